"""The static guard's files and report: which paths are checked, and what comes back.

``check`` walks files and folders (skipping FIFOs, devices and symlink loops with
a note; naming them is an error), reads and decodes each file, runs the analysis
(``attnplug.guard.analysis``), applies the allow-list and returns a
``GuardReport``; ``find_base_field_reads`` and ``assert_no_base_field_reads``
are the forms host engines call from their tests.
"""

from __future__ import annotations

import dataclasses
import errno
import io
import os
import stat
import sys
import tokenize
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Sequence, Union

from ..errors import AttnplugError  # stdlib-only module: the guard stays import-free
from .analysis import ALLOW_COMMENT, DEFAULT_ATTR, Finding, ParseProblem, check_source, default_reason

__all__ = [
    "AllowEntry", "GuardError", "GuardReport", "assert_no_base_field_reads", "check", "find_base_field_reads",
    "parse_allow",
]

#: Directory names never walked into (explicitly given paths are always checked).
_SKIP_DIRS = frozenset({"__pycache__", "node_modules", "site-packages"})

PathLike = Union[str, "os.PathLike[str]"]
PathsWithReasons = Union[PathLike, Mapping[PathLike, str | None], Iterable[PathLike]]  # noqa: UP007 (run-time alias)
AllowSpec = Union[str, "AllowEntry", tuple[Any, ...]]


class GuardError(AttnplugError, ValueError):
    """The guard could not check what it was asked to (unparsable file, bad allow entry)."""

    def __init__(self, message: str, problems: Sequence[ParseProblem] = ()) -> None:
        self.problems = tuple(problems)
        super().__init__(message)


@dataclasses.dataclass(frozen=True)
class AllowEntry:
    """``FILE:LINE``: suppress the reads at that line. FILE matches as a path suffix."""

    path: str
    line: int

    def matches(self, finding: Finding) -> bool:
        return finding.line == self.line and _same_file(self.path, finding.path)

    def __str__(self) -> str:
        return f"{self.path}:{self.line}"


def parse_allow(spec: AllowSpec) -> AllowEntry:
    """``"FILE:LINE"``, ``(FILE, LINE)`` or an ``AllowEntry`` -> ``AllowEntry``."""
    if isinstance(spec, AllowEntry):
        return spec
    if isinstance(spec, tuple) and len(spec) == 2:
        path, line = spec
    elif isinstance(spec, (str, os.PathLike)):
        path, sep, line = os.fspath(spec).rpartition(":")
        if not sep or not path:
            raise GuardError(f"allow entry {spec!r}: expected FILE:LINE (e.g. engine/runner.py:120)")
    else:
        raise GuardError(f"allow entry {spec!r}: expected 'FILE:LINE' or (FILE, LINE)")
    try:
        number = int(line)
    except (TypeError, ValueError):
        raise GuardError(f"allow entry {spec!r}: LINE must be a positive integer") from None
    if number < 1:
        raise GuardError(f"allow entry {spec!r}: LINE must be a positive integer")
    return AllowEntry(os.fspath(path), number)


@dataclasses.dataclass
class GuardReport:
    """Everything one check found: reads, suppressed reads, unparsable files, stale allows."""

    attr: str
    findings: list[Finding]
    allowed: list[Finding]
    problems: list[ParseProblem]
    unused_allow: list[AllowEntry]
    files_checked: int
    #: paths skipped while walking a directory (a FIFO or device named ``*.py``, a symlink loop)
    skipped: list[str] = dataclasses.field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not self.findings and not self.problems

    def message(self, strict_allow: bool = False) -> str:
        """A multi-line account for a failing test or a CI log."""
        lines: list[str] = []
        if self.findings:
            lines.append(
                f"{len(self.findings)} read(s) of the base field {self.attr!r} "
                f"(read the pair attention_backends() instead):"
            )
            lines.extend(f"  {f.format()}" for f in self.findings)
        if self.problems:
            lines.append(f"{len(self.problems)} file(s) could not be checked:")
            lines.extend(f"  {p.format()}" for p in self.problems)
        if strict_allow and self.unused_allow:
            lines.append("allow entries that match no read (the read is gone: remove them):")
            lines.extend(f"  {a}" for a in self.unused_allow)
        if lines:
            lines.append(
                f"suppress a reviewed read with a trailing '{ALLOW_COMMENT}' comment "
                f"or an allow entry FILE:LINE"
            )
        return "\n".join(lines)


def _read_source(path: Path, display: str) -> tuple[str | None, ParseProblem | None]:
    try:
        data = path.read_bytes()
    except OSError as exc:
        return None, ParseProblem(display, 1, 1, f"cannot read: {exc.strerror or exc}")
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
        return data.decode(encoding), None
    except (SyntaxError, LookupError, UnicodeDecodeError) as exc:
        return None, ParseProblem(display, 1, 1, f"cannot decode: {exc}")


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def _stat_problem(path: str) -> tuple[str, str | None]:
    """``("file" | "dir" | "other", why)``: what ``path`` is, following symlinks, and the
    sentence to report when it cannot be checked (``None`` for a regular file or directory)."""
    try:
        st = os.stat(path)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "other", f"{path}: symlink loop (too many levels of symbolic links)"
        if exc.errno == errno.ENOENT:
            dangling = os.path.islink(path)
            return "missing", f"{path}: " + ("dangling symlink" if dangling else "no such file or directory")
        return "other", f"{path}: cannot read: {exc.strerror or exc}"
    if stat.S_ISREG(st.st_mode):
        return "file", None
    if stat.S_ISDIR(st.st_mode):
        return "dir", None
    return "other", f"{path}: {_kind(st.st_mode)}, not a Python source file"


def _walk(root: Path, skipped: list[str]) -> Iterator[Path]:
    """``*.py`` regular files under ``root``; anything else named ``*.py`` is noted in ``skipped``
    (reading a FIFO would block forever) and never opened."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(
            d for d in dirnames
            if not d.startswith(".") and d not in _SKIP_DIRS and not d.endswith(".egg-info")
        )
        for name in sorted(filenames):
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                kind, why = _stat_problem(path)
                if kind == "file":
                    yield Path(path)
                else:
                    skipped.append(f"skipped {why}")


def _normalise(paths_with_reasons: PathsWithReasons) -> list[tuple[str, str | None]]:
    if isinstance(paths_with_reasons, (str, os.PathLike)):
        return [(os.fspath(paths_with_reasons), None)]
    if isinstance(paths_with_reasons, Mapping):
        return [(os.fspath(p), r) for p, r in paths_with_reasons.items()]
    return [(os.fspath(p), None) for p in paths_with_reasons]


def _same_file(allow_path: str, finding_path: str) -> bool:
    a, f = Path(allow_path), Path(finding_path)
    if _real(a) == _real(f):
        return True
    if a.is_absolute():
        return False
    a_parts = Path(os.path.normpath(a)).parts
    f_parts = _real(f).parts
    return len(a_parts) <= len(f_parts) and tuple(f_parts[-len(a_parts):]) == a_parts


def _real(path: PathLike) -> Path:
    """The resolved path; never raises (a symlink loop resolves as far as it can)."""
    return Path(os.path.realpath(os.fspath(path)))


def _files(
    paths_with_reasons: PathsWithReasons, attr: str, exclude: Iterable[PathLike], skipped: list[str] | None = None,
) -> list[tuple[Path, str, str]]:
    """(file, display path, reason); a file named more specifically keeps its own reason.

    A path given directly must be a regular file or a directory: a missing
    path is ``FileNotFoundError``; an empty path, a symlink loop, a FIFO, a
    device or a socket is a ``GuardError`` saying which. Inside a walked
    directory those are skipped and listed in ``skipped``.
    """
    skipped = [] if skipped is None else skipped
    excluded = [_real(e) for e in exclude]

    def is_excluded(p: Path) -> bool:
        return any(p == e or e in p.parents for e in excluded)

    chosen: dict[Path, tuple[int, int, str, str]] = {}  # resolved -> (specificity, order, display, reason)
    order = 0
    for given, reason in _normalise(paths_with_reasons):
        if not given:
            raise GuardError("an empty path was given; name a file or a directory")
        kind, why = _stat_problem(given)
        if kind == "missing":
            raise FileNotFoundError(why)
        if why is not None:
            raise GuardError(why)
        root = Path(given)
        specificity = len(_real(root).parts)
        files = [root] if kind == "file" else list(_walk(root, skipped))
        for f in files:
            resolved = _real(f)
            if is_excluded(resolved):
                continue
            current = chosen.get(resolved)
            if current is None or specificity > current[0]:
                order += 1
                chosen[resolved] = (specificity, current[1] if current else order, str(f), reason or default_reason(attr))
    return [(r, display, reason) for r, (_, _, display, reason) in sorted(chosen.items(), key=lambda kv: kv[1][1])]


# --------------------------------------------------------------------------- public API


def check(
    paths_with_reasons: PathsWithReasons,
    attr: str = DEFAULT_ATTR,
    allow: Iterable[AllowSpec] = (),
    *,
    exclude: Iterable[PathLike] = (),
) -> GuardReport:
    """Check files and directories (walked for ``*.py``); never raises for an unparsable file.

    ``paths_with_reasons`` is ``{path: reason}`` (a ``None`` reason gets
    :func:`default_reason`), an iterable of paths, or one path. A file reached
    both directly and through a directory keeps the reason of the more specific
    entry. ``exclude`` removes files or whole directories (e.g. the config module
    that defines the field). Raises ``FileNotFoundError`` for a missing path and
    :class:`GuardError` for a bad ``attr`` or allow entry, an empty path, or a path
    given directly that is not a regular file or directory (FIFO, device, socket,
    symlink loop); such entries met while walking a directory are skipped and
    listed in ``GuardReport.skipped``.
    """
    if not isinstance(attr, str) or not attr.isidentifier():
        raise GuardError(f"attr={attr!r}: expected an attribute name such as {DEFAULT_ATTR!r}")
    entries = [parse_allow(a) for a in allow]
    used: set[AllowEntry] = set()
    findings: list[Finding] = []
    allowed: list[Finding] = []
    problems: list[ParseProblem] = []
    skipped: list[str] = []
    files = _files(paths_with_reasons, attr, exclude, skipped)
    for path, display, reason in files:
        source, problem = _read_source(path, display)
        if problem is not None or source is None:
            problems.append(problem or ParseProblem(display, 1, 1, "cannot read"))
            continue
        try:
            found, suppressed = check_source(source, display, attr, reason)
        except SyntaxError as exc:
            problems.append(ParseProblem(display, exc.lineno or 1, exc.offset or 1, f"syntax error: {exc.msg}"))
            continue
        except (ValueError, RecursionError) as exc:  # e.g. null bytes, absurd nesting
            problems.append(ParseProblem(display, 1, 1, f"{type(exc).__name__}: {exc}"))
            continue
        allowed.extend(suppressed)
        for finding in found:
            hit = [e for e in entries if e.matches(finding)]
            if hit:
                used.update(hit)
                allowed.append(finding)
            else:
                findings.append(finding)
    unused = [e for e in entries if e not in used]
    return GuardReport(attr, findings, allowed, problems, unused, len(files), skipped)


def find_base_field_reads(
    paths_with_reasons: PathsWithReasons,
    attr: str = DEFAULT_ATTR,
    allow: Iterable[AllowSpec] = (),
    *,
    exclude: Iterable[PathLike] = (),
) -> list[Finding]:
    """Every unsuppressed read of ``attr``; raises :class:`GuardError` naming unparsable files."""
    report = check(paths_with_reasons, attr, allow, exclude=exclude)
    if report.problems:
        raise GuardError(
            "the static guard could not check every file:\n" + "\n".join(f"  {p.format()}" for p in report.problems),
            report.problems,
        )
    return report.findings


def assert_no_base_field_reads(
    paths_with_reasons: PathsWithReasons,
    attr: str = DEFAULT_ATTR,
    allow: Iterable[AllowSpec] = (),
    *,
    exclude: Iterable[PathLike] = (),
    strict_allow: bool = False,
) -> None:
    """The one-test helper for a host engine::

        def test_decisions_read_the_pair():
            assert_no_base_field_reads({
                "engine/model_runner.py": "picks the kernel per forward mode",
                "engine/server_args.py": None,
            }, exclude=["engine/config.py"])

    Fails (``pytest.fail`` under pytest, else ``AssertionError``) listing each
    offender as ``file:line:col: expression — reason``, and names any file it
    could not parse. With ``strict_allow`` an allow entry that matches no read
    also fails, so the allow-list only ever shrinks.
    """
    report = check(paths_with_reasons, attr, allow, exclude=exclude)
    if report.clean and not (strict_allow and report.unused_allow):
        return
    _fail(report.message(strict_allow=strict_allow))


def _fail(message: str) -> None:
    pytest = sys.modules.get("pytest")  # running under pytest: a clean failure, no guard traceback
    if pytest is not None and hasattr(pytest, "fail"):
        pytest.fail(message, pytrace=False)
    raise AssertionError(message)
