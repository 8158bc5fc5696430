"""The shape of the core after issue 21 part A: who may import whom, where each concept is defined.

Read from the sources with ``ast`` (module-level imports only: an import inside a function runs when
that function does, not when the module is imported).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

CORE = Path(__file__).resolve().parents[2] / "core" / "attnplug"


def _module_imports(path: Path) -> set[str]:
    """The core modules ``path`` imports at module level (``TYPE_CHECKING`` blocks left out), as dotted
    names relative to ``attnplug`` (``"registry"``, ``"resolution.vocabulary"``)."""
    package = path.relative_to(CORE).with_suffix("").parts[:-1]
    out: set[str] = set()
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(package[: len(package) - node.level + 1])
                mod = ".".join(base + ([node.module] if node.module else []))
                names = [mod] if node.module else [".".join(base + [a.name]) for a in node.names]
                out.update(n for n in names if n)
            elif node.module and node.module.startswith("attnplug."):
                out.add(node.module[len("attnplug."):])
        elif isinstance(node, ast.Import):
            out.update(a.name[len("attnplug."):] for a in node.names if a.name.startswith("attnplug."))
    return out


RESOLUTION = sorted((CORE / "resolution").glob("*.py"))
#: what resolution must not reach at import: the registry's world (plugin code, the name table)
REGISTRY_WORLD = {"registry", "descriptor", "isolation", "settle", "building", "discovery", "kvlayouts"}


@pytest.mark.parametrize("path", RESOLUTION, ids=[p.name for p in RESOLUTION])
def test_resolution_imports_nothing_of_the_registry_world(path: Path) -> None:
    assert not _module_imports(path) & REGISTRY_WORLD, sorted(_module_imports(path))


def test_the_host_view_and_the_support_query_import_no_plugin_machinery() -> None:
    for name in ("hostview.py", "support.py", "resolution/vocabulary.py"):
        assert not _module_imports(CORE / name) & REGISTRY_WORLD, name


def test_discovery_knows_no_registry() -> None:
    text = (CORE / "discovery.py").read_text()
    assert "registry" not in _module_imports(CORE / "discovery.py")
    assert "Registry" not in text and "register_plugin" not in text


def test_probe_helpers_are_defined_in_probes_and_descriptor_imports_them() -> None:
    tree = ast.parse((CORE / "probes.py").read_text())
    defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    assert {"module_missing", "library_missing", "installed_library", "version_tuple", "version_key"} <= defined
    assert "descriptor" not in _module_imports(CORE / "probes.py")
    assert "probes" in _module_imports(CORE / "descriptor.py")
    import attnplug.descriptor as descriptor
    import attnplug.probes as probes

    assert descriptor.library_missing is probes.library_missing and descriptor.version_key is probes.version_key


@pytest.mark.parametrize("module,defines", [
    ("building.py", {"build", "build_pair", "validate_factory_result", "build_problems"}),
    ("kvlayouts.py", {"LayoutTable"}),
    ("settle.py", {"settle", "collect_arch_overrides", "collect_resolution_rules"}),
    ("hostview.py", {"HostView", "BackendOnHost"}),
    ("support.py", {"SupportQuery", "reasons"}),
    ("resolution/vocabulary.py", {"Record", "Declaration", "ArchOverride", "ResolutionRule", "State", "Pass"}),
])
def test_each_job_has_its_module(module: str, defines: set[str]) -> None:
    tree = ast.parse((CORE / module).read_text())
    top = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    assert defines <= top, defines - top


def test_the_registry_no_longer_builds_or_words_support_itself() -> None:
    text = (CORE / "registry.py").read_text()
    for gone in ("support_reasons(", "layer_reasons(", "call_plugin(desc.distribution", "def _claim_layout"):
        assert gone not in text, gone
