#!/usr/bin/env python3
"""How strong is a backend's test suite? Mutate its kernel module one point at a time,
run ``pytest --backend=<name>`` against each mutant, report the kill rate and the survivors.

A tool, not a CI gate (see docs/conformance.md, "Mutation testing"). Each mutant is
one realistic single-point bug: a comparison off by one (``<`` <-> ``<=``), a flipped
operator (``+`` <-> ``-``, ``*`` <-> ``/``, ``and`` <-> ``or``, ``min`` <-> ``max``), a
constant changed (``n`` -> ``n + 1``, ``True`` <-> ``False``), a sign or ``not``
dropped, or one expression statement deleted (a forgotten ``masked_fill_``).

How it runs: the backend's package folder is copied to a temporary folder that
is put first on ``PYTHONPATH``; the mutant replaces the module file in the
copy, so the installed package is never touched. A canary mutant (the module
raising at import) must be killed first, which proves the copy is what runs.
``pytest -x`` stops at the first failing case, so a killed mutant costs little.

    python scripts/mutate.py --backend torch_native \\
        --module plugins/torch_native/attnplug_torch_native/backend.py [--sample 60 --seed 1] \\
        [--pytest-args "-k 'float32 and ps16'"] [--lines 1-90,120-300] [--json mutants.json]

Compiled kernels (``--mutants FILE.json``): the mutants are a curated list of realistic
single-point bugs in a C/C++ source (``scripts/cpp_mutants.json`` for cpu_fused's kernel,
``csrc/attention.cpp``: ``{"source": path, "mutants": [{"id", "class", "find", "replace"[, "nth"][, "equivalent"]}]}``).
Each is applied to the copy's source, then ``--build-check`` (a shell command run with the copy
first on ``PYTHONPATH``) must succeed — it builds and loads the mutant; a failure counts as
*did not compile*, apart from kills — and the suite runs. A mutant marked ``equivalent`` (with
the argument why) is counted apart. The canary is a source that does not compile, which the
build check must refuse. cpu_fused is built at install, so the build check rebuilds the copy's
library in place (``kernel.build_inplace``: the ISA variants in parallel, ``ops.cpp``'s object kept
between mutants) and loads it; a backend without its kernel is unavailable, so a mutant can never
hide behind an eager path:

    python scripts/mutate.py --backend cpu_fused --mutants scripts/cpp_mutants.json \
        --build-check "python -m attnplug_cpu_fused.kernel build && python -c 'import sys, attnplug_cpu_fused.kernel as k; sys.exit(k.load()[0] is None)'"

Exit status 0 whatever the score (it is a measurement); 2 for bad arguments or a
canary that survives.
"""

from __future__ import annotations

import argparse
import ast
import copy
import dataclasses
import json
import os
import random
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

_SWAP_CMP = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq,
             ast.NotEq: ast.Eq, ast.Is: ast.IsNot, ast.IsNot: ast.Is, ast.In: ast.NotIn, ast.NotIn: ast.In}
_SWAP_BIN = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult, ast.FloorDiv: ast.Mult,
             ast.Mod: ast.FloorDiv, ast.LShift: ast.RShift, ast.RShift: ast.LShift, ast.BitOr: ast.BitAnd,
             ast.BitAnd: ast.BitOr}
_SWAP_CALL = {"min": "max", "max": "min", "amax": "amin", "amin": "amax", "maximum": "minimum",
              "minimum": "maximum"}


@dataclasses.dataclass
class Mutant:
    index: int
    line: int
    kind: str
    before: str
    after: str
    outcome: str = ""  # killed | survived | timeout | error
    seconds: float = 0.0
    detail: str = ""


def _is_docstring(node: ast.AST, parent: ast.AST | None) -> bool:
    return (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str))


def _points(tree: ast.Module) -> Iterator[tuple[ast.AST, str]]:
    """Every mutation point (node, kind) in source order, skipping annotations and f-strings."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.JoinedStr, ast.arg)):
            skip.update(id(n) for n in ast.walk(node))
        if isinstance(node, (ast.AnnAssign, ast.FunctionDef)):
            for ann in ([node.annotation] if isinstance(node, ast.AnnAssign) else [node.returns]):
                if ann is not None:
                    skip.update(id(n) for n in ast.walk(ann))
    found: list[tuple[ast.AST, str]] = []
    for node in ast.walk(tree):
        if id(node) in skip or not hasattr(node, "lineno"):
            continue
        if isinstance(node, ast.Compare):
            found += [(node, f"cmp{i}") for i, op in enumerate(node.ops) if type(op) in _SWAP_CMP]
        elif isinstance(node, (ast.BinOp, ast.AugAssign)) and type(node.op) in _SWAP_BIN:
            found.append((node, "binop"))
        elif isinstance(node, ast.BoolOp):
            found.append((node, "boolop"))
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.Not)):
            found.append((node, "unary"))
        elif isinstance(node, ast.Constant) and type(node.value) in (int, float, bool):
            found.append((node, "const"))
        elif isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
            if name in _SWAP_CALL:
                found.append((node, "call"))
        elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
            found.append((node, "delete"))
    found.sort(key=lambda p: (p[0].lineno, p[0].col_offset, p[1]))  # type: ignore[attr-defined]
    yield from found


def _mutate(node: ast.AST, kind: str) -> None:
    if kind.startswith("cmp"):
        i = int(kind[3:])
        node.ops[i] = _SWAP_CMP[type(node.ops[i])]()  # type: ignore[attr-defined]
    elif kind == "binop":
        node.op = _SWAP_BIN[type(node.op)]()  # type: ignore[attr-defined]
    elif kind == "boolop":
        node.op = ast.Or() if isinstance(node.op, ast.And) else ast.And()  # type: ignore[attr-defined]
    elif kind == "const":
        v = node.value  # type: ignore[attr-defined]
        node.value = (not v) if isinstance(v, bool) else v + 1  # type: ignore[attr-defined]
    elif kind == "call":
        f = node.func  # type: ignore[attr-defined]
        if isinstance(f, ast.Attribute):
            f.attr = _SWAP_CALL[f.attr]
        else:
            f.id = _SWAP_CALL[f.id]
    elif kind == "delete":
        node.value = ast.Constant(None)  # type: ignore[attr-defined]
    else:
        raise KeyError(kind)


def mutants(source: str) -> list[tuple[Mutant, str]]:
    """Every single-point mutant of ``source``: (description, mutated source)."""
    tree = ast.parse(source)
    out = []
    points = list(_points(tree))
    for i, (node, kind) in enumerate(points):
        if kind == "unary":
            continue  # handled below (replace the node by its operand)
        t2 = copy.deepcopy(tree)
        target = list(_points(t2))[i][0]
        before = ast.unparse(target).splitlines()[0][:100]
        _mutate(target, kind)
        after = ast.unparse(target).splitlines()[0][:100]
        out.append((Mutant(len(out), node.lineno, kind, before, after), ast.unparse(t2)))  # type: ignore[attr-defined]
    for i, (node, kind) in enumerate(points):
        if kind != "unary":
            continue
        t2 = copy.deepcopy(tree)
        target = list(_points(t2))[i][0]
        before = ast.unparse(target)[:100]
        for parent in ast.walk(t2):
            for field, value in ast.iter_fields(parent):
                if value is target:
                    setattr(parent, field, target.operand)  # type: ignore[attr-defined]
                elif isinstance(value, list) and any(v is target for v in value):
                    value[value.index(target)] = target.operand  # type: ignore[attr-defined]
        out.append((Mutant(len(out), node.lineno, "unary", before, ast.unparse(target.operand)[:100]),  # type: ignore[attr-defined]
                    ast.unparse(t2)))
    return out


def _env(pkg_root: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(pkg_root)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def compiled_mutants(spec_path: Path) -> tuple[Path, list[tuple[Mutant, str]], dict[int, str]]:
    """The curated mutants of a compiled source: (source path, [(mutant, mutated text)], {index:
    why it is equivalent}). A ``find`` that does not occur (or not ``nth`` times) is an error:
    the list is out of date with the source."""
    spec = json.loads(spec_path.read_text(encoding="utf-8"))
    source = Path(spec["source"])
    if not source.is_absolute():
        source = (Path.cwd() / source).resolve()
    text = source.read_text(encoding="utf-8")
    out: list[tuple[Mutant, str]] = []
    equivalent: dict[int, str] = {}
    for entry in spec["mutants"]:
        find, nth = entry["find"], int(entry.get("nth", 0))
        starts = [i for i in range(len(text)) if text.startswith(find, i)]
        if len(starts) <= nth or ("nth" not in entry and len(starts) != 1):
            raise SystemExit(f"mutant {entry['id']!r}: {find!r} occurs {len(starts)} time(s) in {source} "
                             f"(expected {'at least ' + str(nth + 1) if 'nth' in entry else 'exactly once'}): "
                             f"update {spec_path}")
        at = starts[nth]
        line = text.count("\n", 0, at) + 1
        m = Mutant(len(out), line, entry.get("class", "compiled"), find.strip()[:100], entry["replace"].strip()[:100],
                   detail=entry["id"])
        if entry.get("equivalent"):
            equivalent[m.index] = entry["equivalent"]
        out.append((m, text[:at] + entry["replace"] + text[at + len(find):]))
    return source, out, equivalent


def _build_ok(pkg_root: Path, command: str, timeout: float) -> tuple[bool, str]:
    try:
        proc = subprocess.run(command, shell=True, env=_env(pkg_root), capture_output=True, text=True,
                              timeout=timeout, cwd=pkg_root)
    except subprocess.TimeoutExpired:
        return False, f"build check timed out after {timeout:.0f} s"
    tail = (proc.stdout + proc.stderr).strip().splitlines()
    return proc.returncode == 0, (tail[-1] if tail else "")


def _run(pkg_root: Path, args: list[str], timeout: float) -> tuple[str, float, str]:
    env = _env(pkg_root)
    t0 = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *args],
                              env=env, capture_output=True, text=True, timeout=timeout, cwd=pkg_root)
    except subprocess.TimeoutExpired:
        return "timeout", time.monotonic() - t0, ""
    dt = time.monotonic() - t0
    tail = (proc.stdout + proc.stderr).strip().splitlines()
    last = tail[-1] if tail else ""
    if proc.returncode == 0:
        return "survived", dt, last
    return ("killed" if proc.returncode == 1 else "error"), dt, last


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", required=True, help="backend name given to pytest --backend")
    p.add_argument("--module", type=Path, help="the kernel module to mutate (a file of an "
                   "importable package; its top-level package folder is copied)")
    p.add_argument("--mutants", type=Path, default=None, help="a compiled source's curated mutant list (JSON, "
                   "see above) instead of --module")
    p.add_argument("--build-check", default="", help="with --mutants: a shell command that builds and loads "
                   "the mutated source (non-zero: did not compile)")
    p.add_argument("--pytest-args", default="", help="extra pytest arguments (e.g. a -k subset for speed)")
    p.add_argument("--sample", type=int, default=0, help="test only N mutants, drawn with --seed (0: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=0, help="seconds per mutant (default: 5x the clean run + 30)")
    p.add_argument("--lines", default="", help="only mutate lines A-B (comma-separated ranges: A-B,C-D)")
    p.add_argument("--json", type=Path, default=None, help="write every mutant and its outcome here")
    p.add_argument("--list", action="store_true", help="list the mutants and exit")
    a = p.parse_args(argv)
    if (a.module is None) == (a.mutants is None):
        p.error("give exactly one of --module (a Python kernel module) and --mutants (a compiled source's list)")
    if a.mutants is not None and not a.build_check:
        p.error("--mutants needs --build-check (the command that builds and loads the mutated source)")
    equivalent: dict[int, str] = {}
    if a.mutants is not None:
        if not a.mutants.is_file():
            p.error(f"--mutants {a.mutants}: no such file")
        module, found, equivalent = compiled_mutants(a.mutants)
        source = module.read_text(encoding="utf-8")
    else:
        module = a.module.resolve()
        if not module.is_file():
            p.error(f"--module {a.module}: no such file")
        source = module.read_text(encoding="utf-8")
        found = mutants(source)
    pkg = module.parent
    while (pkg.parent / "__init__.py").exists():
        pkg = pkg.parent
    rel = module.relative_to(pkg.parent)
    if a.lines:
        spans = []
        for part in a.lines.split(","):
            lo, _, hi = part.strip().partition("-")
            if not lo.isdigit() or not (hi or lo).isdigit():
                p.error(f"--lines {a.lines!r}: expected ranges like 10-40,55-90")
            spans.append((int(lo), int(hi or lo)))
        found = [m for m in found if any(lo <= m[0].line <= hi for lo, hi in spans)]
    if a.sample and a.sample < len(found):
        found = sorted(random.Random(a.seed).sample(found, a.sample), key=lambda m: m[0].index)
    if a.list:
        for m, _ in found:
            print(f"#{m.index:4d} line {m.line:4d} {m.kind:7s} {m.before!r} -> {m.after!r}")
        return 0
    extra = shlex.split(a.pytest_args)
    args = [f"--backend={a.backend}", *extra]
    with tempfile.TemporaryDirectory(prefix="attnplug-mutate-") as tmp:
        root = Path(tmp)
        shutil.copytree(pkg, root / pkg.name, ignore=shutil.ignore_patterns("__pycache__"))
        target = root / rel

        def install(text: str) -> None:
            target.write_text(text, encoding="utf-8")

        compiled = a.mutants is not None
        install(source if compiled else ast.unparse(ast.parse(source)))  # the clean module, as mutants are written
        if compiled:
            ok, why = _build_ok(root, a.build_check, 900)
            if not ok:
                print(f"the clean source does not build and load ({why}); fix that first", file=sys.stderr)
                return 2
        clean, clean_s, last = _run(root, args, 3600)
        if clean != "survived":
            print(f"the clean module does not pass the suite ({clean}: {last}); fix that first", file=sys.stderr)
            return 2
        if compiled:  # the canary: a source that cannot compile must be refused by the build check
            install(source + "\n#error attnplug mutation canary\n")
            canary = "killed" if not _build_ok(root, a.build_check, 900)[0] else "survived"
        else:
            install("raise RuntimeError('attnplug mutation canary')\n")
            canary, _, _ = _run(root, args, 3600)
        if canary == "survived":
            print(f"the canary survived: the suite does not import {rel} from the copy (is the package "
                  f"installed in a way that ignores PYTHONPATH?)", file=sys.stderr)
            return 2
        timeout = a.timeout or clean_s * 5 + 30
        print(f"{len(found)} mutants of {rel} against pytest --backend={a.backend} {' '.join(extra)} "
              f"(clean run {clean_s:.1f} s, timeout {timeout:.0f} s)", flush=True)
        for m, text in found:
            install(text)
            name = m.detail
            if m.index in equivalent:
                m.outcome, m.detail = "equivalent", equivalent[m.index]
            elif compiled and not (built := _build_ok(root, a.build_check, 900))[0]:
                m.outcome, m.detail = "no-compile", built[1]
            else:
                m.outcome, m.seconds, m.detail = _run(root, args, timeout)
            label = f"{name} " if compiled else ""
            print(f"  #{m.index:4d} line {m.line:4d} {m.kind:7s} {m.outcome:8s} {m.seconds:5.1f}s {label}"
                  f"{m.before!r} -> {m.after!r}", flush=True)
    done = [m for m, _ in found]
    equivalents = [m for m in done if m.outcome == "equivalent"]
    no_compile = [m for m in done if m.outcome == "no-compile"]
    # a timeout is not a kill: a mutant that makes the suite hang (an endless loop) is caught only
    # if a real run would time out too, so timeouts are counted apart and listed for a look
    killed = [m for m in done if m.outcome in ("killed", "error")]
    timeouts = [m for m in done if m.outcome == "timeout"]
    survivors = [m for m in done if m.outcome == "survived"]
    decided = len(killed) + len(survivors)
    rate = 100.0 * len(killed) / decided if decided else 100.0
    print(f"\nkill rate {rate:.1f}% ({len(killed)} of {decided} killed; {len(survivors)} survived; "
          f"{len(timeouts)} timed out, {len(equivalents)} equivalent, {len(no_compile)} did not compile: "
          f"not counted)")
    for m in equivalents:
        print(f"  equivalent line {m.line}: {m.before!r} -> {m.after!r}: {m.detail}")
    for m in no_compile:
        print(f"  did not compile line {m.line}: {m.before!r} -> {m.after!r}: {m.detail}")
    for m in survivors:
        print(f"  survivor line {m.line}: {m.kind}: {m.before!r} -> {m.after!r}")
    for m in timeouts:
        print(f"  timed out line {m.line}: {m.kind}: {m.before!r} -> {m.after!r}")
    if a.json:
        a.json.write_text(json.dumps({"backend": a.backend, "module": str(rel), "pytest_args": extra,
                                      "kill_rate": rate, "timeouts": len(timeouts), "mutants": [dataclasses.asdict(m) for m in done]},
                                     indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
