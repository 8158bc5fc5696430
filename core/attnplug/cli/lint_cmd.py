"""``attnplug lint``: the static guard on the command line (stdlib only, imports nothing it checks).

Exit status: 0 clean, 1 reads of the base field found (or stale allow entries
with ``--strict-allow``), 2 usage error (an empty path, a missing path, a path
given directly that is a FIFO, device, socket or symlink loop) or a file that
could not be parsed. Inside a walked directory such non-regular ``*.py``
entries are skipped with a note on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from attnplug.guard import ALLOW_COMMENT, DEFAULT_ATTR

    parser.add_argument("paths", nargs="+", metavar="PATH",
                        help="decision files, or directories walked for *.py")
    parser.add_argument("--attr", default=DEFAULT_ATTR, metavar="NAME",
                        help=f"the base attribute whose reads are reported (default: {DEFAULT_ATTR})")
    parser.add_argument("--allow", action="append", default=[], metavar="FILE:LINE",
                        help=f"suppress the reads at FILE:LINE (repeatable; FILE matches as a path suffix); "
                        f"a trailing '{ALLOW_COMMENT}' comment does the same in the source")
    parser.add_argument("--exclude", action="append", default=[], metavar="PATH",
                        help="skip a file or directory, e.g. the config module that defines the field (repeatable)")
    parser.add_argument("--reason", default=None, metavar="TEXT",
                        help="reason printed with each finding (default: why the base field is wrong)")
    parser.add_argument("--strict-allow", action="store_true",
                        help="exit 1 when an --allow entry matches no read (the allow-list only shrinks)")
    parser.add_argument("--json", action="store_true", help="print the findings as a JSON list of objects")


def run(args: argparse.Namespace) -> int:
    from attnplug.guard import GuardError, check

    paths = {p: args.reason for p in args.paths}
    try:
        report = check(paths, attr=args.attr, allow=args.allow, exclude=args.exclude)
    except FileNotFoundError as exc:
        print(f"attnplug lint: error: {exc}", file=sys.stderr)
        return 2
    except GuardError as exc:
        print(f"attnplug lint: error: {exc}", file=sys.stderr)
        return 2

    if args.json:
        print(json.dumps([f.to_dict() for f in report.findings], indent=2))
    else:
        for finding in report.findings:
            print(finding.format())
    for note in report.skipped:
        print(f"attnplug lint: note: {note}", file=sys.stderr)
    for problem in report.problems:
        print(f"attnplug lint: error: {problem.format()}", file=sys.stderr)
    for entry in report.unused_allow:
        print(f"attnplug lint: warning: --allow {entry} matches no read of {report.attr!r}; remove it",
              file=sys.stderr)
    if not args.json:
        print(
            f"attnplug lint: {report.files_checked} file(s) checked, {len(report.findings)} read(s) of "
            f"{report.attr!r}, {len(report.allowed)} allowed",
            file=sys.stderr,
        )
    if report.problems:
        return 2
    if report.findings or (args.strict_allow and report.unused_allow):
        return 1
    return 0
