#!/usr/bin/env python3
"""Extract the real signatures of the kernel-library functions the GPU plugins call.

Writes ``tests/contracts/signatures.json``: for each (library, version) in
``SOURCES``, the parameters of each function in ``FUNCTIONS`` as written in
that release's own Python wrapper source, plus where the source came from.
The contract tier (``tests/contracts``) binds every recorded plugin call
against these signatures, so it needs neither the library, a GPU nor CUDA.

Sources are read, never imported: a wheel or sdist downloaded by name with
``pip download --no-deps`` (PyPI), or, for a library whose releases are not
on PyPI (amd-aiter: PyPI stops at 0.1.7.post2.dev18, the ROCm builds come
from the GitHub tags), a tag of a local git clone (``--git amd-aiter=DIR``).
Each file is parsed with ``ast``.

Re-extract (one command; run it when a plugin floor moves, then commit the file):

    python scripts/extract_signatures.py --git amd-aiter=/path/to/ROCm/aiter/clone

Without ``--git`` for a library its entries are kept from the existing file.
Downloads go to ``--download-dir`` (default: a temporary folder) and are
reused when already there. sgl-kernel wheels are 300-550 MB each.
"""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "contracts" / "signatures.json"

#: (library, version, origin). Versions: each plugin's floors, the feature floors inside them, and
#: the newest release checked. ``"pypi"``: downloaded by name; ``"git:<repo>@<tag>"``: a tag of a clone.
SOURCES: list[tuple[str, str, str]] = [
    ("sgl-kernel", "0.3.0", "pypi"),  # fa3 floor (layers without sinks)
    ("sgl-kernel", "0.3.4", "pypi"),  # the last release without sinks= (shows why the sinks floor is higher)
    ("sgl-kernel", "0.3.4.post1", "pypi"),  # fa3 floor for sink layers
    ("sgl-kernel", "0.3.21", "pypi"),  # newest under the old distribution name
    ("sglang-kernel", "0.4.10", "pypi"),  # the successor distribution (same sgl_kernel module)
    ("flashinfer-python", "0.5.0", "pypi"),  # flashinfer floor
    ("flashinfer-python", "0.6.0", "pypi"),  # trtllm_mha floor
    ("flashinfer-python", "0.6.4", "pypi"),  # first release whose FA3 prefill checks q/KV dtypes
    ("flashinfer-python", "0.7.4", "pypi"),  # newest checked
    ("amd-aiter", "0.1.9", "git:ROCm/aiter@v0.1.9"),  # the last tag without sink_ptr=
    ("amd-aiter", "0.1.10", "git:ROCm/aiter@v0.1.10"),  # aiter floor
    # vllm_cpu's floor: the ops are C++ (no Python wrapper to parse), so their schemas are read from the
    # installed ops library (torch.ops.load_library, no `import vllm`) when that version is installed here
    ("vllm-cpu", "0.32.0", "torch-ops:vllm/_C.abi3.so"),
]

_FI_WRAPPERS = {
    "BatchDecodeWithPagedKVCacheWrapper": "flashinfer/decode.py",
    "BatchPrefillWithPagedKVCacheWrapper": "flashinfer/prefill.py",
    "BatchPrefillWithRaggedKVCacheWrapper": "flashinfer/prefill.py",
}
#: where ``BatchMLAPagedAttentionWrapper`` and ``trtllm_batch_decode_with_kv_cache_mla`` are defined, by release
#: (0.5.0: mla.py / decode.py; 0.6.x: mla.py; 0.7.x: the mla package); the first file defining the name wins
_FI_MLA_WRAPPER_FILES = ("flashinfer/mla.py", "flashinfer/mla/_batch_mla/_wrapper.py")
_FI_TRTLLM_MLA_FILES = ("flashinfer/decode.py", "flashinfer/mla.py", "flashinfer/mla/_core.py")
_SGL = {"sgl_kernel.flash_attn.flash_attn_with_kvcache": ("sgl_kernel/flash_attn.py", "flash_attn_with_kvcache")}

#: library -> {qualified name the plugins use: (file in the distribution, or candidate files tried in order,
#: name inside the file)}
FUNCTIONS: dict[str, dict[str, tuple[str | tuple[str, ...], str]]] = {
    "sgl-kernel": _SGL,
    "sglang-kernel": _SGL,
    "flashinfer-python": {
        **{f"flashinfer.{cls}.{meth}": (path, f"{cls}.{meth}")
           for cls, path in _FI_WRAPPERS.items() for meth in ("__init__", "plan", "run")},
        "flashinfer.decode.trtllm_batch_decode_with_kv_cache":
            ("flashinfer/decode.py", "trtllm_batch_decode_with_kv_cache"),
        "flashinfer.prefill.trtllm_batch_context_with_kv_cache":
            ("flashinfer/prefill.py", "trtllm_batch_context_with_kv_cache"),
        # MLA (flashinfer, trtllm_mha): the definitions moved between releases; the first file defining it wins
        **{f"flashinfer.mla.BatchMLAPagedAttentionWrapper.{meth}":
           (_FI_MLA_WRAPPER_FILES, f"BatchMLAPagedAttentionWrapper.{meth}") for meth in ("__init__", "plan", "run")},
        "flashinfer.decode.trtllm_batch_decode_with_kv_cache_mla":
            (_FI_TRTLLM_MLA_FILES, "trtllm_batch_decode_with_kv_cache_mla"),
    },
    "amd-aiter": {
        "aiter.mha_batch_prefill_func": ("aiter/ops/mha.py", "mha_batch_prefill_func"),
        "aiter.paged_attention_ragged": ("aiter/ops/attention.py", "paged_attention_ragged"),
        "aiter.mla.mla_decode_fwd": ("aiter/mla.py", "mla_decode_fwd"),  # MLA absorbed decode
    },
}

#: library -> torch ops (``torch.ops.<namespace>.<op>``) whose schemas are recorded from the installed library
TORCH_OPS: dict[str, tuple[str, ...]] = {
    "vllm-cpu": ("torch.ops._C.get_scheduler_metadata", "torch.ops._C.cpu_attn_reshape_and_cache",
                 "torch.ops._C.cpu_attention_with_kv_cache", "torch.ops._C.mla_decode_kvcache"),
}

_KINDS = {"posonlyargs": "POSITIONAL_ONLY", "args": "POSITIONAL_OR_KEYWORD", "kwonlyargs": "KEYWORD_ONLY"}


def _is_overload(fn: ast.AST) -> bool:
    return any((isinstance(d, ast.Name) and d.id == "overload") or
               (isinstance(d, ast.Attribute) and d.attr == "overload") for d in getattr(fn, "decorator_list", ()))


def find_function(tree: ast.Module, dotted: str) -> ast.FunctionDef | None:
    """The implementation of ``dotted`` (``"f"`` or ``"Class.method"``); ``@overload`` stubs skipped,
    the last definition wins (as at run time)."""
    body: list[ast.stmt] = tree.body
    *owners, name = dotted.split(".")
    for owner in owners:
        cls = [n for n in body if isinstance(n, ast.ClassDef) and n.name == owner]
        if not cls:
            return None
        body = cls[-1].body
    defs = [n for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name
            and not _is_overload(n)]
    return defs[-1] if defs else None


def parameters(fn: ast.FunctionDef) -> list[dict[str, Any]]:
    """The parameters in order: name, kind, whether it has a default, and the default's source text
    (annotations are left out: binding needs names, kinds and defaults only)."""
    a = fn.args
    out: list[dict[str, Any]] = []
    positional = a.posonlyargs + a.args
    defaults: list[ast.expr | None] = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    for arg, default in zip(positional, defaults):
        kind = "POSITIONAL_ONLY" if arg in a.posonlyargs else "POSITIONAL_OR_KEYWORD"
        out.append(_param(arg, kind, default))
    if a.vararg:
        out.append(_param(a.vararg, "VAR_POSITIONAL", None))
    for arg, default in zip(a.kwonlyargs, a.kw_defaults):
        out.append(_param(arg, "KEYWORD_ONLY", default))
    if a.kwarg:
        out.append(_param(a.kwarg, "VAR_KEYWORD", None))
    return out


def _param(arg: ast.arg, kind: str, default: ast.expr | None) -> dict[str, Any]:
    return {"name": arg.arg, "kind": kind, "has_default": default is not None,
            "default": None if default is None else ast.unparse(default)}


def schema_types(text: str) -> list[str]:
    """The declared type of each argument of a schema's text, as written (``ScalarType``, ``Tensor(a2!)``,
    ``Tensor?``; the parsed schema shows a ScalarType as ``int``)."""
    args = text.split("(", 1)[1].rsplit(") ->", 1)[0]
    return [a.split("=", 1)[0].rsplit(" ", 1)[0].strip() for a in args.split(", ") if a.strip() and a.strip() != "*"]


def schema_parameters(schema: Any) -> list[dict[str, Any]]:
    """A torch op schema's arguments as recorded parameters (plus the schema type of each)."""
    out = []
    types = schema_types(str(schema))
    for a, declared in zip(schema.arguments, types):
        has_default = a.default_value is not None or (a.has_default_value() if hasattr(a, "has_default_value") else False)
        out.append({"name": a.name, "kind": "KEYWORD_ONLY" if a.kwarg_only else "POSITIONAL_OR_KEYWORD",
                    "has_default": bool(has_default), "default": None if not has_default else repr(a.default_value),
                    "type": declared})
    return out


def torch_ops_entry(library: str, version: str, rel: str) -> dict[str, Any] | None:
    """The schemas of ``TORCH_OPS[library]`` from the installed library's ``rel`` (``None``: that version is
    not installed in this interpreter)."""
    import importlib.metadata as md
    import importlib.util

    try:
        if md.version(library) != version:
            return None
    except md.PackageNotFoundError:
        return None
    import torch

    pkg, name = rel.split("/", 1)
    spec = importlib.util.find_spec(pkg)  # the package directory, without running its __init__
    path = Path(list(spec.submodule_search_locations)[0]) / name  # type: ignore[union-attr]
    torch.ops.load_library(str(path))
    functions: dict[str, Any] = {}
    for qualname in TORCH_OPS[library]:
        _, _, ns, op = qualname.split(".")
        schema = getattr(getattr(torch.ops, ns), op).default._schema
        functions[qualname] = {"file": rel, "schema": str(schema), "parameters": schema_parameters(schema)}
    return {"source": f"the installed {library} {version}: op schemas read from {rel} (torch.ops.load_library)",
            "functions": functions}


# -- reading sources ---------------------------------------------------------------
class Archive:
    """Files of a downloaded wheel/sdist (paths relative to the package root)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.files: dict[str, bytes] = {}
        if path.suffix == ".whl" or path.suffix == ".zip":
            with zipfile.ZipFile(path) as z:
                for n in z.namelist():
                    if n.endswith(".py"):
                        self.files[n] = z.read(n)
        else:
            with tarfile.open(path) as t:
                for m in t.getmembers():
                    if m.isfile() and m.name.endswith(".py"):
                        rel = m.name.split("/", 1)[1] if "/" in m.name else m.name  # drop <name>-<version>/
                        self.files[rel] = t.extractfile(m).read()  # type: ignore[union-attr]

    def read(self, rel: str) -> str:
        for cand in (rel, f"python/{rel}"):
            if cand in self.files:
                return self.files[cand].decode("utf-8")
        raise FileNotFoundError(f"{rel} is not in {self.path.name}")


def download(library: str, version: str, where: Path) -> Path:
    folder = where / f"{library}-{version}"
    folder.mkdir(parents=True, exist_ok=True)
    found = sorted(p for p in folder.iterdir() if p.suffix in (".whl", ".gz", ".zip"))
    if not found:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(folder), f"{library}=={version}"]
        subprocess.run(cmd, check=True)
        found = sorted(p for p in folder.iterdir() if p.suffix in (".whl", ".gz", ".zip"))
    if not found:
        raise SystemExit(f"pip download {library}=={version} left nothing in {folder}")
    return found[0]


def git_reader(clone: Path, ref: str):  # type: ignore[no-untyped-def]
    def read(rel: str) -> str:
        proc = subprocess.run(["git", "-C", str(clone), "show", f"{ref}:{rel}"], capture_output=True, text=True)
        if proc.returncode:
            raise FileNotFoundError(f"{rel} at {ref} in {clone}: {proc.stderr.strip()}")
        return proc.stdout
    return read


def extract(library: str, read) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    out: dict[str, Any] = {}
    trees: dict[str, ast.Module] = {}
    for qualname, (where, dotted) in FUNCTIONS[library].items():
        out[qualname] = None  # absent in this version: a call to it fails to bind
        for rel in (where,) if isinstance(where, str) else where:
            if rel not in trees:
                try:
                    trees[rel] = ast.parse(read(rel))
                except FileNotFoundError:
                    if isinstance(where, str):
                        raise
                    continue
            fn = find_function(trees[rel], dotted)
            if fn is not None:
                out[qualname] = {"file": rel, "line": fn.lineno, "parameters": parameters(fn)}
                break
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--download-dir", type=Path, default=None, help="where wheels are downloaded (reused)")
    ap.add_argument("--git", action="append", default=[], metavar="LIBRARY=CLONE",
                    help="a local git clone to read a library's tags from (e.g. amd-aiter=~/src/aiter)")
    ap.add_argument("--only", action="append", default=[], help="extract only these libraries")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    clones = dict(item.split("=", 1) for item in args.git)
    old = json.loads(args.out.read_text()) if args.out.exists() else {"libraries": {}}
    libs: dict[str, dict[str, Any]] = {}
    tmp = tempfile.TemporaryDirectory() if args.download_dir is None else None
    where = args.download_dir or Path(tmp.name)  # type: ignore[union-attr]
    for library, version, origin in SOURCES:
        keep = old.get("libraries", {}).get(library, {}).get(version)
        if (args.only and library not in args.only) or (origin.startswith("git:") and library not in clones):
            if keep is None:
                print(f"skipped {library} {version} ({origin}): nothing recorded before", file=sys.stderr)
            else:
                libs.setdefault(library, {})[version] = keep
            continue
        if origin.startswith("torch-ops:"):
            entry = torch_ops_entry(library, version, origin.split(":", 1)[1])
            if entry is None:
                if keep is None:
                    print(f"skipped {library} {version}: not installed here, nothing recorded before", file=sys.stderr)
                else:
                    libs.setdefault(library, {})[version] = keep
                continue
        elif origin == "pypi":
            archive = Archive(download(library, version, where))
            entry = {"source": f"PyPI {archive.path.name} (pip download --no-deps {library}=={version})",
                     "functions": extract(library, archive.read)}
        else:
            repo, ref = origin[4:].split("@", 1)
            entry = {"source": f"GitHub {repo} tag {ref} (PyPI has no such release)",
                     "functions": extract(library, git_reader(Path(clones[library]).expanduser(), ref))}
        libs.setdefault(library, {})[version] = entry
        print(f"{library} {version}: {sum(v is not None for v in entry['functions'].values())} functions", file=sys.stderr)
    doc = {"generated_by": "scripts/extract_signatures.py", "libraries": libs}
    args.out.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
