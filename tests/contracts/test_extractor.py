"""scripts/extract_signatures.py reads signatures from source text exactly as Python would bind them."""

from __future__ import annotations

import ast
import importlib.util
import inspect
import zipfile
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "extract_signatures.py"
spec = importlib.util.spec_from_file_location("extract_signatures", SCRIPT)
X = importlib.util.module_from_spec(spec)
spec.loader.exec_module(X)  # type: ignore[union-attr]

SOURCE = '''
from typing import overload

class W:
    @overload
    def run(self, q: int) -> int: ...
    @overload
    def run(self, q: int, *, return_lse: bool) -> tuple: ...
    def run(self, q, paged_kv_cache=None, *args, q_scale=None, return_lse=False, **kw):
        return q

def f(a, /, b, c=(-1, -1), *, d, e=None):
    pass
'''


def _sig(params):
    return inspect.Signature([inspect.Parameter(p["name"], getattr(inspect.Parameter, p["kind"]),
                                                default=0 if p["has_default"] else inspect.Parameter.empty)
                              for p in params])


def test_overload_stubs_are_skipped_and_kinds_kept():
    tree = ast.parse(SOURCE)
    ns: dict = {}
    exec(SOURCE, ns)
    for dotted, real in (("W.run", ns["W"].run), ("f", ns["f"])):
        got = X.parameters(X.find_function(tree, dotted))
        assert [(p.name, p.kind) for p in _sig(got).parameters.values()] == \
            [(p.name, p.kind) for p in inspect.signature(real).parameters.values()]
    f = {p["name"]: p for p in X.parameters(X.find_function(tree, "f"))}
    assert f["c"]["default"] == "(-1, -1)" and not f["d"]["has_default"] and f["e"]["has_default"]
    assert X.find_function(tree, "W.missing") is None and X.find_function(tree, "Nope.run") is None


def test_archive_reads_python_files_from_a_wheel(tmp_path):
    whl = tmp_path / "lib-1.0-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr("lib/ops.py", SOURCE)
        z.writestr("lib/data.bin", b"\0")
    arch = X.Archive(whl)
    assert "def f(" in arch.read("lib/ops.py") and list(arch.files) == ["lib/ops.py"]
