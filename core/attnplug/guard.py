"""The static guard: report every read of the base ``attention_backend`` field.

Why: an operator may set ``--prefill-attention-backend`` and
``--decode-attention-backend`` and leave the base ``--attention-backend``
unset. A decision that reads only the base field then answers from a field
nobody set. Every decision must read the pair ``attention_backends()`` and pick
the half it needs; this module proves, without importing anything, that a list
of decision files never reads the base field at all (see ``docs/guard.md``).

What counts as a read (``attr`` is ``"attention_backend"`` unless told):

* ``X.attention_backend`` in a load context, whatever ``X`` is -- a chain, a
  local alias, a call result, a parameter -- and as the target of ``+=``;
* ``getattr(X, NAME[, default])``, ``hasattr(X, NAME)``,
  ``inspect.getattr_static``, ``object.__getattribute__(X, NAME)``,
  ``X.__getattribute__(NAME)``, and any alias of those bound in the file;
* ``operator.attrgetter(NAME)`` (also a dotted path ending in, or passing
  through, the field) and ``operator.itemgetter(NAME)``;
* a mapping view keyed by the field: ``vars(X)[NAME]``, ``X.__dict__[NAME]``,
  ``d[NAME]``, ``d.get(NAME)`` / ``.pop`` / ``.setdefault``, and
  ``NAME in vars(X)`` / ``NAME in X.__dict__``;
* ``match`` patterns ``case C(attention_backend=...)`` and
  ``case {"attention_backend": ...}``.

``NAME`` is the field name as a string constant, or anything the file folds
to it: a name bound to it anywhere in the file (``FIELD = "attention_backend"``,
tuple assignment, walrus, class attribute, ``self.field = ...``), a
concatenation or constant f-string, or a loop variable over a literal
tuple/list/set of strings that contains it.

Not reads: assignment (``X.attention_backend = v``, ``setattr``), ``del``,
keyword arguments (``replace(cfg, attention_backend=v)``), dict-literal keys,
other attribute names (``attention_backends()``, ``prefill_attention_backend``,
``attention_backend_str``), and text in comments, docstrings or other strings.

Only the standard library is imported; nothing checked is ever imported.
"""

from __future__ import annotations

import ast
import dataclasses
import errno
import gc
import io
import os
import re
import stat
import sys
import tokenize
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence, Union

from .errors import AttnplugError  # stdlib-only module: the guard stays import-free

__all__ = [
    "ALLOW_COMMENT",
    "DEFAULT_ATTR",
    "AllowEntry",
    "Finding",
    "GuardError",
    "GuardReport",
    "ParseProblem",
    "assert_no_base_field_reads",
    "check",
    "default_reason",
    "find_base_field_reads",
    "parse_allow",
]

DEFAULT_ATTR = "attention_backend"

#: A trailing comment carrying this marker suppresses the reads on its line.
ALLOW_COMMENT = "# attnplug: allow-base-field"
_ALLOW_RE = re.compile(r"#.*\battnplug:\s*allow-base-field\b")

#: Directory names never walked into (explicitly given paths are always checked).
_SKIP_DIRS = frozenset({"__pycache__", "node_modules", "site-packages"})

PathLike = Union[str, "os.PathLike[str]"]
PathsWithReasons = Union[PathLike, Mapping[PathLike, str | None], Iterable[PathLike]]  # noqa: UP007 (run-time alias)
AllowSpec = Union[str, "AllowEntry", tuple[Any, ...]]


def default_reason(attr: str = DEFAULT_ATTR) -> str:
    """The reason attached to a finding when the caller names none."""
    return (
        f"reads the base field {attr!r}: with a split configuration (prefill and decode set, "
        f"base unset) it answers from a field nobody set; read the pair accessor "
        f"attention_backends() and pick the half this decision needs"
    )


# --------------------------------------------------------------------------- results


@dataclasses.dataclass(frozen=True)
class Finding:
    """One read of the base field. ``line`` and ``col`` are 1-based."""

    path: str
    line: int
    col: int
    expr: str
    reason: str
    kind: str = "attribute"  # attribute | getattr | hasattr | attrgetter | mapping | match

    def location(self) -> str:
        return f"{self.path}:{self.line}:{self.col}"

    def format(self) -> str:
        return f"{self.location()}: {self.expr} \u2014 {self.reason}"

    def to_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        return self.format()


@dataclasses.dataclass(frozen=True)
class ParseProblem:
    """A checked file that could not be read or parsed (so it is not proven clean)."""

    path: str
    line: int
    col: int
    message: str

    def format(self) -> str:
        return f"{self.path}:{self.line}:{self.col}: cannot check this file: {self.message}"

    def to_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


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


# --------------------------------------------------------------------------- matching


def _attribute_matches(node: ast.Attribute, attr: str) -> bool:
    """The one predicate for attribute reads: the name alone decides, never the base.

    ``k = cfg.kernel; k.attention_backend`` and ``make().attention_backend`` are
    reads exactly like ``cfg.kernel.attention_backend``; a rule that looked at the
    spelling of the base would miss every alias.
    """
    return node.attr == attr


_FOLD_ROUNDS = 8
_FOLD_MAX_STRINGS = 32
_FOLD_MAX_LEN = 256
_GETATTR_LIKE = frozenset({"getattr", "getattr_static"})
_MAPPING_GETTERS = frozenset({"get", "pop", "setdefault"})
#: Callables recognised by their own name when imported or aliased.
_KNOWN_CALLABLES = frozenset({"getattr", "hasattr", "getattr_static", "attrgetter", "itemgetter", "vars"})


def _terminal_name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _key(node: ast.expr) -> str | None:
    """Binding key: ``FIELD`` for a name, ``.field`` for any ``X.field`` (kept apart)."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return "." + node.attr
    return None


#: Value nodes ``strings_of`` / ``iter_strings`` / ``callable_of`` can say anything about.
_FOLDABLE = frozenset({ast.Constant, ast.Name, ast.Attribute, ast.BinOp, ast.JoinedStr, ast.IfExp, ast.NamedExpr,
                       ast.Tuple, ast.List, ast.Set})
_BINDING_NODES = frozenset({ast.Assign, ast.AnnAssign, ast.NamedExpr, ast.For, ast.AsyncFor, ast.comprehension,
                            ast.ClassDef, ast.ImportFrom})
#: Fields that hold only operator/context singletons (Load, Add, Eq ...): never walked into.
_LEAF_FIELDS = frozenset({"ctx", "op", "ops"})
_FIELDS: dict[type, tuple[str, ...]] = {}


_READ_NODES = frozenset({ast.Attribute, ast.AugAssign, ast.Subscript, ast.Compare, ast.Call, ast.MatchClass,
                         ast.MatchMapping})


@dataclasses.dataclass
class _Nodes:
    """The nodes of one tree the guard looks at, each kind in tree order (parents first)."""

    bindings: list[ast.AST]  # assignments, loops, classes, imports: what constants fold from
    reads: list[ast.AST]  # where a read can be: attributes, subscripts, calls, compares, patterns
    strings: list[ast.AST]  # Constant and JoinedStr: where a '#' is not a comment


def _all_nodes(tree: ast.AST) -> _Nodes:
    """Walk ``tree`` once, sorting the nodes the guard needs into lists.

    One loop instead of ``ast.walk``'s generators, and every later pass runs
    over its own short list: the guard must stay within a small factor of
    ``ast.parse`` on big files.
    """
    nodes = _Nodes([], [], [])
    route: dict[type, list[ast.AST]] = {t: nodes.bindings for t in _BINDING_NODES}
    route.update({t: nodes.reads for t in _READ_NODES})
    route[ast.Constant] = route[ast.JoinedStr] = nodes.strings
    queue: list[ast.AST] = [tree]
    append, AST, fields_of, route_get = queue.append, ast.AST, _FIELDS, route.get
    i = 0
    while i < len(queue):
        node = queue[i]
        i += 1
        cls = type(node)
        bucket = route_get(cls)
        if bucket is not None:
            bucket.append(node)
        fields = fields_of.get(cls)
        if fields is None:
            fields = fields_of[cls] = tuple(f for f in cls._fields if f not in _LEAF_FIELDS)
        for name in fields:
            value = getattr(node, name, None)
            if type(value) is list:
                for item in value:
                    if isinstance(item, AST):
                        append(item)
            elif isinstance(value, AST):
                append(value)
    return nodes


class _Constants:
    """Fold expressions to the set of strings they may hold, from bindings in the file.

    Deliberately an over-approximation: a name bound to the field anywhere in the
    file (any scope) may be the field wherever it is used. The guard prefers a
    reviewed false positive (silenced by an allow) to a missed read.
    """

    def __init__(self, nodes: list[ast.AST], attr: str) -> None:
        self.attr = attr
        self.strings: dict[str, set[str]] = {}
        self.callables: dict[str, str] = {}
        bindings: list[tuple[str, ast.expr, bool]] = []  # (name, value, is_iteration)
        for node in nodes:
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    bindings.extend(_pairs(target, node.value))
            elif isinstance(node, (ast.AnnAssign, ast.NamedExpr)) and node.value is not None:
                bindings.extend(_pairs(node.target, node.value))
            elif isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
                key = _key(node.target)
                if key is not None:
                    bindings.append((key, node.iter, True))
            elif isinstance(node, ast.ClassDef):
                # class K: FIELD = "attention_backend"  ->  getattr(x, K.FIELD) / self.FIELD
                for stmt in node.body:
                    if isinstance(stmt, ast.Assign):
                        for target in stmt.targets:
                            if isinstance(target, ast.Name):
                                bindings.append(("." + target.id, stmt.value, False))
                    elif isinstance(stmt, ast.AnnAssign) and stmt.value is not None and isinstance(stmt.target, ast.Name):
                        bindings.append(("." + stmt.target.id, stmt.value, False))
            elif isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if alias.name in _KNOWN_CALLABLES:
                        self.callables[alias.asname or alias.name] = alias.name
        # only values that can fold to a string or name a callable can change anything
        bindings = [b for b in bindings if type(b[1]) in _FOLDABLE]
        # Fixpoint: FIELD2 = FIELD1, g = getattr, h = operator.attrgetter ... A few
        # rounds suffice for real chains and bound `s = s + "x"`, which never settles.
        changed, rounds = True, 0
        while changed and rounds < _FOLD_ROUNDS:
            changed, rounds = False, rounds + 1
            for name, value, iterating in bindings:
                found = self.iter_strings(value) if iterating else self.strings_of(value)
                known = self.strings.get(name, set())
                if found - known:
                    merged = self._cap(known | found)
                    if merged != known:
                        self.strings[name] = merged
                        changed = True
                if not iterating:
                    fn = self.callable_of(value)
                    if fn is not None and name not in self.callables:
                        self.callables[name] = fn
                        changed = True

    def _cap(self, strings: set[str]) -> set[str]:
        """Bound the folding (``s = s + s`` in a loop would grow without end)."""
        strings = {s for s in strings if len(s) <= _FOLD_MAX_LEN}
        if len(strings) > _FOLD_MAX_STRINGS:
            relevant = sorted(s for s in strings if s in self.attr or self.attr in s)
            strings = set(relevant[:_FOLD_MAX_STRINGS])
        return strings

    def strings_of(self, node: ast.expr | None) -> set[str]:
        if isinstance(node, ast.Constant):
            return {node.value} if isinstance(node.value, str) else set()
        if isinstance(node, (ast.Name, ast.Attribute)):
            key = _key(node)
            return set(self.strings.get(key, ())) if key else set()
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            left, right = self.strings_of(node.left), self.strings_of(node.right)
            return self._cap({a + b for a in left for b in right})
        if isinstance(node, ast.JoinedStr):
            out = {""}
            for part in node.values:
                if isinstance(part, ast.Constant) and isinstance(part.value, str):
                    out = {a + part.value for a in out}
                elif isinstance(part, ast.FormattedValue) and part.conversion == -1 and part.format_spec is None:
                    inner = self.strings_of(part.value)
                    if not inner:
                        return set()
                    out = self._cap({a + b for a in out for b in inner})
                else:
                    return set()
            return out
        if isinstance(node, ast.IfExp):
            return self._cap(self.strings_of(node.body) | self.strings_of(node.orelse))
        if isinstance(node, ast.NamedExpr):
            return self.strings_of(node.value)
        return set()

    def iter_strings(self, node: ast.expr) -> set[str]:
        """Strings a loop over ``node`` may bind: a literal collection, or a name bound to one."""
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            out: set[str] = set()
            for elt in node.elts:
                out |= self.strings_of(elt)
            return self._cap(out)
        if isinstance(node, (ast.Name, ast.Attribute)):
            return set(self.strings.get("[]" + (_key(node) or ""), ()))
        return set()

    def callable_of(self, node: ast.expr) -> str | None:
        """Which known callable ``node`` names (``getattr``, ``operator.attrgetter``, an alias)."""
        if isinstance(node, ast.Name):
            if node.id in self.callables:
                return self.callables[node.id]
            return node.id if node.id in _KNOWN_CALLABLES else None
        if isinstance(node, ast.Attribute) and node.attr in _KNOWN_CALLABLES:
            return node.attr
        return None

    def call_name(self, func: ast.expr) -> str | None:
        """The identity used to classify a call: a known callable, else the terminal name."""
        return self.callable_of(func) or _terminal_name(func)


def _pairs(target: ast.expr, value: ast.expr) -> Iterator[tuple[str, ast.expr, bool]]:
    """Name/value pairs of an assignment, element-wise for tuple = tuple."""
    if isinstance(target, (ast.Tuple, ast.List)):
        if isinstance(value, (ast.Tuple, ast.List)) and len(value.elts) == len(target.elts):
            for t, v in zip(target.elts, value.elts):
                yield from _pairs(t, v)
        return
    name = _key(target)
    if name is None:
        return
    yield (name, value, False)
    if isinstance(value, (ast.Tuple, ast.List, ast.Set)):
        # FIELDS = ("attention_backend", ...): remembered for `for f in FIELDS`.
        yield ("[]" + name, value, True)


def _is_namespace_view(node: ast.expr, consts: _Constants) -> bool:
    """``vars(x)`` or ``x.__dict__``: the object's attributes as a mapping."""
    if isinstance(node, ast.Attribute) and node.attr == "__dict__":
        return True
    return isinstance(node, ast.Call) and consts.callable_of(node.func) == "vars"


class _Visitor:
    def __init__(self, attr: str, consts: _Constants) -> None:
        self.attr = attr
        self.consts = consts
        self.hits: list[tuple[ast.AST, str]] = []
        self._dispatch: dict[type[ast.AST], Callable[[Any], None]] = {
            ast.Attribute: self.visit_Attribute, ast.AugAssign: self.visit_AugAssign,
            ast.Subscript: self.visit_Subscript, ast.Compare: self.visit_Compare, ast.Call: self.visit_Call,
            ast.MatchClass: self.visit_MatchClass, ast.MatchMapping: self.visit_MatchMapping,
        }

    def run(self, nodes: list[ast.AST]) -> list[tuple[ast.AST, str]]:
        """Every read among ``nodes`` (each node looked at once; no recursion)."""
        dispatch = self._dispatch
        for node in nodes:
            handler = dispatch.get(type(node))
            if handler is not None:
                handler(node)
        return self.hits

    def _names_field(self, node: ast.expr | None) -> bool:
        return node is not None and self.attr in self.consts.strings_of(node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if isinstance(node.ctx, ast.Load) and _attribute_matches(node, self.attr):
            self.hits.append((node, "attribute"))

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        # `x.attention_backend += s` reads the field before writing it.
        target = node.target
        if isinstance(target, ast.Attribute) and _attribute_matches(target, self.attr):
            self.hits.append((target, "attribute"))
        elif isinstance(target, ast.Subscript) and self._names_field(target.slice):
            self.hits.append((target, "mapping"))

    def visit_Subscript(self, node: ast.Subscript) -> None:
        if isinstance(node.ctx, ast.Load) and self._names_field(node.slice):
            self.hits.append((node, "mapping"))

    def visit_Compare(self, node: ast.Compare) -> None:
        # "attention_backend" in vars(x) / in x.__dict__: a presence check, like hasattr.
        left = node.left
        for op, right in zip(node.ops, node.comparators):
            if isinstance(op, (ast.In, ast.NotIn)) and self._names_field(left) and _is_namespace_view(right, self.consts):
                self.hits.append((node, "hasattr"))
                break
            left = right

    def visit_Call(self, node: ast.Call) -> None:
        kind = self._call_kind(node)
        if kind is not None:
            self.hits.append((node, kind))

    def _call_kind(self, node: ast.Call) -> str | None:
        name = self.consts.call_name(node.func)
        args = node.args
        if name in _GETATTR_LIKE and len(args) >= 2 and self._names_field(args[1]):
            return "getattr"
        if name == "hasattr" and len(args) >= 2 and self._names_field(args[1]):
            return "hasattr"
        if name == "__getattribute__" and args and self._names_field(args[-1]):
            return "getattr"
        if name == "attrgetter":
            for arg in args:
                if any(self.attr in s.split(".") for s in self.consts.strings_of(arg)):
                    return "attrgetter"
        if name == "itemgetter" and any(self._names_field(arg) for arg in args):
            return "mapping"
        if name in _MAPPING_GETTERS and isinstance(node.func, ast.Attribute) and args and self._names_field(args[0]):
            return "mapping"
        return None

    def visit_MatchClass(self, node: ast.MatchClass) -> None:
        if self.attr in node.kwd_attrs:
            self.hits.append((node, "match"))

    def visit_MatchMapping(self, node: ast.MatchMapping) -> None:
        if any(self._names_field(key) for key in node.keys):
            self.hits.append((node, "match"))


# --------------------------------------------------------------------------- files


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


_LINE_END = re.compile(r"\r\n|\r|\n")


_OTHER_BREAKS = re.compile("[\v\f\x1c\x1d\x1e\x85\u2028\u2029]")


def _split_lines(source: str) -> list[str]:
    """Lines as ``ast`` counts them (``\\r\\n``, ``\\r``, ``\\n``; not form feeds), endings kept."""
    if not _OTHER_BREAKS.search(source):
        return source.splitlines(keepends=True)  # the same split, in C
    lines: list[str] = []
    start = 0
    for m in _LINE_END.finditer(source):
        lines.append(source[start:m.end()])
        start = m.end()
    if start < len(source):
        lines.append(source[start:])
    return lines


class _Lines:
    """The source's lines, each encoded to UTF-8 once and only when a finding needs it
    (``ast`` columns are byte offsets). Every lookup is O(length of that line), so
    N findings cost O(N + size), never O(N x size)."""

    def __init__(self, source: str) -> None:
        self.text = _split_lines(source)
        self._bytes: dict[int, bytes] = {}

    def raw(self, lineno: int) -> bytes:
        data = self._bytes.get(lineno)
        if data is None:
            data = self.text[lineno - 1].encode("utf-8") if 0 < lineno <= len(self.text) else b""
            self._bytes[lineno] = data
        return data

    def segment(self, node: ast.AST) -> str | None:
        start, end = node.lineno, node.end_lineno  # type: ignore[attr-defined]
        col, end_col = node.col_offset, node.end_col_offset  # type: ignore[attr-defined]
        if end is None or end_col is None:
            return None
        if start == end:
            return self.raw(start)[col:end_col].decode("utf-8", errors="replace")
        parts = [self.raw(start)[col:]] + [self.raw(n) for n in range(start + 1, end)] + [self.raw(end)[:end_col]]
        return b"".join(parts).decode("utf-8", errors="replace")

    def char_col(self, lineno: int, byte_col: int) -> int:
        return len(self.raw(lineno)[:byte_col].decode("utf-8", errors="replace"))


def _allow_comment_lines(nodes: list[ast.AST], lines: _Lines, candidates: set[int]) -> set[int]:
    """Which ``candidates`` (lines whose text contains the allow marker) carry it in a comment.

    No tokenizer: outside string literals a ``#`` always starts a comment, and
    the tree knows every string literal's span. Only lines that hold a finding
    and the marker text are looked at, so the cost stays linear in the file.
    """
    if not candidates:
        return set()
    strings: dict[int, list[tuple[int, int]]] = {n: [] for n in candidates}
    for node in nodes:
        if type(node) is ast.JoinedStr or (type(node) is ast.Constant and isinstance(node.value, (str, bytes))):
            first, last = node.lineno, node.end_lineno or node.lineno
            for n in range(first, last + 1):  # each line a literal spans: linear in the file overall
                if n in strings:
                    lo = node.col_offset if n == first else 0
                    hi = (node.end_col_offset or 0) if n == last else 1 << 60
                    strings[n].append((lo, hi))
    found: set[int] = set()
    for n in candidates:
        raw = lines.raw(n)
        pos = raw.find(b"#")
        while pos != -1:
            if not any(lo <= pos < hi for lo, hi in strings[n]):
                if _ALLOW_RE.search(raw[pos:].decode("utf-8", errors="replace")):
                    found.add(n)
                break
            pos = raw.find(b"#", pos + 1)
    return found


def _check_source(source: str, display: str, attr: str, reason: str) -> tuple[list[Finding], list[Finding]]:
    """Parse ``source`` (raises SyntaxError) -> (findings, findings suppressed by a comment).

    Linear in the size of the file (``benchmarks/lint_scaling.py`` measures it
    against ``ast.parse`` alone).
    """
    gc_was_enabled = gc.isenabled()
    gc.disable()  # a big tree is hundreds of thousands of objects: no collections while building it
    try:
        tree = ast.parse(source, filename=display)
        nodes = _all_nodes(tree)
        found = _Visitor(attr, _Constants(nodes.bindings, attr)).run(nodes.reads)
        if not found:
            return [], []
        return _report(found, nodes, source, display, attr, reason)
    finally:
        if gc_was_enabled:
            gc.enable()


def _report(found: list[tuple[ast.AST, str]], nodes: _Nodes, source: str, display: str, attr: str,
            reason: str) -> tuple[list[Finding], list[Finding]]:
    lines = _Lines(source)
    # (start, col, end, end_col) -> (node, kind); the first kind found for a span wins
    spans: dict[tuple[int, int, int, int], tuple[ast.AST, str]] = {}
    for node, kind in found:
        key = (node.lineno, node.col_offset, node.end_lineno or node.lineno,  # type: ignore[attr-defined]
               node.end_col_offset or 0)  # type: ignore[attr-defined]
        if key not in spans:
            spans[key] = (node, kind)
    # source order; of two reads starting together, the enclosing one first
    keys = sorted(spans, key=lambda k: (k[0], k[1], -k[2], -k[3]))
    hit_lines = {n for k in keys for n in range(k[0], k[2] + 1)}
    marked = {n for n in hit_lines if b"allow-base-field" in lines.raw(n)}
    allow_lines = _allow_comment_lines(nodes.strings, lines, marked)
    findings: list[Finding] = []
    suppressed: list[Finding] = []
    for key in keys:
        node, kind = spans[key]
        start, col, end = key[0], key[1], key[2]
        segment = lines.segment(node) or f"<{kind} read of {attr}>"
        finding = Finding(display, start, lines.char_col(start, col) + 1, _one_line(segment), reason, kind)
        if allow_lines and (start in allow_lines or any(n in allow_lines for n in range(start + 1, end + 1))):
            suppressed.append(finding)
        else:
            findings.append(finding)
    return findings, suppressed


def _one_line(segment: str) -> str:
    if "\n" not in segment and "\r" not in segment:
        return segment
    return _join_lines(segment)


def _join_lines(segment: str) -> str:
    """A multi-line read on one line: ``(cfg\\n .attention_backend)`` -> ``cfg.attention_backend``."""
    segment = re.sub(r"(?<=[(\[{])\s*\n\s*|\s*\n\s*(?=[.)\]},])", "", segment)
    return re.sub(r"\s*\n\s*", " ", segment)


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
            found, suppressed = _check_source(source, display, attr, reason)
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
