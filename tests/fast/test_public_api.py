"""The public surface is small, documented, and the only thing plugins, the template and examples use."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
from pathlib import Path

import pytest

import attnplug

ROOT = Path(__file__).resolve().parents[2]
API_DOC = (ROOT / "docs" / "api.md").read_text()
PUBLIC = set(attnplug.__all__)


def _is_public_module(mod: str) -> bool:
    return mod == "attnplug" or any(mod == ns or mod.startswith(ns + ".") for ns in attnplug.PUBLIC_NAMESPACES)


def _violations(path: Path) -> list[str]:
    out = []
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and (
            node.module == "attnplug" or node.module.startswith("attnplug.")
        ):
            if node.module == "attnplug":
                out += [f"{path.relative_to(ROOT)}:{node.lineno}: attnplug.{a.name}"
                        for a in node.names if a.name not in PUBLIC]
            elif not _is_public_module(node.module):
                out.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.module}")
        elif isinstance(node, ast.Import):
            out += [f"{path.relative_to(ROOT)}:{node.lineno}: {a.name}" for a in node.names
                    if a.name.startswith("attnplug.") and not _is_public_module(a.name)]
    return out


def _consumer_files() -> list[Path]:
    files = []
    for folder in ("plugins", "contrib_backends", "examples"):
        files += [p for p in (ROOT / folder).rglob("*.py") if "build" not in p.parts and "/tests/" not in str(p)]
    return sorted(files)


def test_the_top_level_surface_is_small() -> None:
    assert 20 <= len(PUBLIC - {"__version__"}) <= 25, sorted(PUBLIC)
    for name in PUBLIC - {"__version__"}:
        getattr(attnplug, name)  # every name resolves


def test_a_name_outside_the_surface_is_not_an_attribute() -> None:
    """No compatibility aliases: a name that moved to a namespace is found only there."""
    for name in ("MetadataGuard", "PluginError", "stamp", "add_attention_args", "module_missing", "KVLayout"):
        assert not hasattr(attnplug, name), name
    assert "_MOVED" not in vars(attnplug)


def _namespace_files() -> list[Path]:
    """Every module of every public namespace (package ``__init__`` and public submodules), found on
    disk so that a namespace importing an optional library (vLLM) is checked without it. The suite's
    ``test_*`` modules are pytest modules, not namespaces. ``attnplug.resolution``'s submodules are
    its implementation (#21 part A splits them): the package's own ``__init__`` is the namespace."""
    core = ROOT / "core"
    out = []
    for ns in attnplug.PUBLIC_NAMESPACES:
        base = core.joinpath(*ns.split("."))
        if base.with_suffix(".py").is_file():
            out.append(base.with_suffix(".py"))
        elif ns == "attnplug.resolution":
            out.append(base / "__init__.py")
        else:
            out += [p for p in base.rglob("*.py")
                    if not p.name.startswith("test_") and not (p.name.startswith("_") and p.name != "__init__.py")]
    return sorted(out)


def _all_of(path: Path) -> list[str] | None:
    tree = ast.parse(path.read_text(), str(path))
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
        if isinstance(target, ast.Name) and target.id == "__all__":
            value = node.value
            if isinstance(value, ast.Call):  # ``sorted(_EXPORTS)``: computed at import
                return ["<computed>"]
            return [ast.literal_eval(e) for e in value.elts]
    return None


def _defined_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node in tree.body:
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return names


def test_every_public_namespace_is_walked() -> None:
    names = {str(p.relative_to(ROOT / "core")) for p in _namespace_files()}
    assert {"attnplug/errors.py", "attnplug/hookspecs.py", "attnplug/testing/suite/harness.py",
            "attnplug/integrations/vllm/backend.py", "attnplug/resolution/__init__.py"} <= names
    assert len(names) == len(set(_namespace_files())) > 25


@pytest.mark.parametrize("path", _namespace_files(), ids=lambda p: str(p.relative_to(ROOT / "core")))
def test_every_public_namespace_module_declares_all(path: Path) -> None:
    exported = _all_of(path)
    assert exported is not None, f"{path.relative_to(ROOT)} has no __all__"
    if exported != ["<computed>"]:
        undefined = sorted(set(exported) - _defined_names(path))
        assert undefined == [], f"{path.relative_to(ROOT)}: __all__ names what the module does not define"
        assert len(exported) == len(set(exported)), f"{path.relative_to(ROOT)}: __all__ repeats a name"


def test_the_namespace_check_catches_a_module_without_all(tmp_path: Path) -> None:
    (tmp_path / "m.py").write_text("def f():\n    pass\n")
    assert _all_of(tmp_path / "m.py") is None
    (tmp_path / "n.py").write_text("__all__ = ['f', 'g']\ndef f():\n    pass\n")
    assert set(_all_of(tmp_path / "n.py") or []) - _defined_names(tmp_path / "n.py") == {"g"}


@pytest.mark.parametrize("path", _consumer_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_consumers_import_only_the_public_surface(path: Path) -> None:
    assert _violations(path) == []


def test_the_checker_catches_a_private_import(tmp_path: Path) -> None:
    bad = ROOT / "examples" / "_tmp_private_import_probe.py"
    bad.write_text("from attnplug.batch import check_qkv\nfrom attnplug import MetadataGuard\nimport attnplug.registry\n")
    try:
        assert len(_violations(bad)) == 3
    finally:
        bad.unlink()


def _section(name: str) -> str:
    m = re.search(rf"^### `{re.escape(name)}`\n(.*?)(?=^### |^## |\Z)", API_DOC, re.S | re.M)
    return m.group(1) if m else ""


@pytest.mark.parametrize("name", sorted(PUBLIC - {"__version__"}))
def test_every_public_name_has_an_api_entry(name: str) -> None:
    assert _section(name), f"docs/api.md has no '### `{name}`' entry"


def _public_members(cls: type) -> list[str]:
    names = [f.name for f in dataclasses.fields(cls)] if dataclasses.is_dataclass(cls) else []
    for klass in cls.__mro__:
        if klass.__module__.startswith("attnplug"):
            names += [n for n, v in vars(klass).items() if not n.startswith("_")
                      and (callable(v) or isinstance(v, (property, classmethod, staticmethod)))]
    return sorted(set(names))


@pytest.mark.parametrize("name", sorted(n for n in PUBLIC if inspect.isclass(getattr(attnplug, n, None))
                                        and not issubclass(getattr(attnplug, n), Exception)
                                        and n != "ForwardMode"))
def test_every_field_and_method_is_documented(name: str) -> None:
    cls = getattr(attnplug, name)
    text = _section(name)
    if name in ("PagedBackend", "BackendWrapper", "HybridBackend"):
        text += _section("AttentionBackend")
    missing = [m for m in _public_members(cls) if f"`{m}" not in text and f" {m}(" not in text]
    assert missing == [], f"docs/api.md entry for {name} lacks: {missing}"


def test_kv_cache_instance_attributes_are_documented() -> None:
    cache = attnplug.PagedKVCache(1, 2, 1, 4)
    missing = [a for a in vars(cache) if not a.startswith("_") and f"`{a}`" not in _section("PagedKVCache")]
    assert missing == []


@pytest.mark.parametrize("name", sorted(n for n in PUBLIC if inspect.isclass(getattr(attnplug, n, None))))
def test_every_public_method_has_a_docstring(name: str) -> None:
    cls = getattr(attnplug, name)
    missing = []
    for klass in cls.__mro__:
        if not klass.__module__.startswith("attnplug"):
            continue
        for n, v in vars(klass).items():
            if n.startswith("_") or not inspect.isfunction(v):
                continue
            if not inspect.getdoc(getattr(cls, n)):
                missing.append(f"{klass.__name__}.{n}")
    assert missing == []


def test_type_checkers_see_exactly_the_lazy_exports() -> None:
    """``attnplug/__init__.py`` re-exports lazily (PEP 562) and names the same objects under
    ``TYPE_CHECKING`` (``from .m import X as X``) so mypy sees real types; the two lists must agree."""
    tree = ast.parse((ROOT / "core" / "attnplug" / "__init__.py").read_text())
    block = next(n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING")
    typed = {(n.module, a.name) for n in block.body if isinstance(n, ast.ImportFrom) for a in n.names
             if a.asname == a.name}
    lazy = {(module, name) for name, module in attnplug._EXPORTS.items()}
    assert typed == lazy
