"""``attnplug`` entry point: one subcommand per module, each imported only when chosen."""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Sequence

#: subcommand -> (module under attnplug.cli, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "list": ("list_cmd", "list discovered backends: distribution, aliases, availability, capabilities"),
    "doctor": ("doctor_cmd", "check this host end to end: discover, resolve, build and run every backend"),
    "resolve": ("resolve_cmd", "resolve and explain the (prefill, decode) pair pass by pass"),
    "bench": ("bench_cmd", "benchmark backends against the per-request loop and the contiguous floor, side by side"),
    "lint": ("lint_cmd", "static guard: report reads of the base attention_backend field"),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser. Only the chosen subcommand's module is imported (``attnplug list``
    pays for nothing else); ``command=None`` imports all of them (docs, tests)."""
    parser = argparse.ArgumentParser(
        prog="attnplug",
        description="Pluggable attention backends for LLM serving engines.",
        epilog="Environment: ATTNPLUG_PLUGINS (allow-list of plugin distributions or entry-point names), "
        "ATTNPLUG_DISABLE_PLUGINS (deny-list), ATTNPLUG_HOST_JSON (explain a recorded host).",
    )
    from attnplug import __version__

    parser.add_argument("--version", action="version", version=f"attnplug {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        if command is None or command == name:
            _add_arguments(module, p)
    return parser


def _add_arguments(module: str, parser: argparse.ArgumentParser) -> None:
    """Each subcommand module defines ``add_arguments(parser)`` and ``run(args) -> int``;
    modules stay light at import time (torch is imported inside ``run``)."""
    mod = importlib.import_module(f"attnplug.cli.{module}")
    mod.add_arguments(parser)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    chosen = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(chosen if chosen in SUBCOMMANDS else None)
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    mod = importlib.import_module(f"attnplug.cli.{args._module}")
    return int(mod.run(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
