"""The static guard's analysis: one source text in, every read of the base field out.

``check_source`` parses a file's text once, folds the names bound to the field's
name, visits every node that can read an attribute and reports each read as a
``Finding`` (the rules are in the package docstring, ``attnplug.guard``); reads
on a line carrying ``ALLOW_COMMENT`` come back apart. No file is opened here and
nothing checked is ever imported (``attnplug.guard.files`` walks the paths).
"""

from __future__ import annotations

import ast
import dataclasses
import gc
import re
from typing import Any, Callable, Iterator

__all__ = ["ALLOW_COMMENT", "DEFAULT_ATTR", "Finding", "ParseProblem", "check_source", "default_reason"]

DEFAULT_ATTR = "attention_backend"

#: A trailing comment carrying this marker suppresses the reads on its line.
ALLOW_COMMENT = "# attnplug: allow-base-field"
_ALLOW_RE = re.compile(r"#.*\battnplug:\s*allow-base-field\b")


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


def check_source(source: str, display: str, attr: str, reason: str) -> tuple[list[Finding], list[Finding]]:
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
