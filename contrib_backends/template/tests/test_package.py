"""The package's own checks (the conformance suite itself runs through `--backend`, see pyproject.toml)."""

from __future__ import annotations

import importlib.metadata as md
import subprocess
import sys

import attnplug
from attnplug.registry import default_registry


def test_entry_point_names_the_descriptor_module() -> None:
    eps = [ep for ep in md.entry_points(group="attnplug.backends") if ep.value == "attnplug_template_backend"]
    assert eps and eps[0].dist is not None and eps[0].dist.metadata["Name"] == "attnplug-template-backend"


def test_descriptor_module_is_light() -> None:
    code = "import sys, attnplug_template_backend; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_registered_with_alias_and_claims() -> None:
    reg = default_registry()
    assert reg.canonical("template") == "template_sdpa"
    caps = reg.get("template_sdpa").capabilities
    assert caps.deterministic and not caps.sinks and not caps.logit_softcap


def test_factory_returns_canonical_effective_name() -> None:
    from attnplug_template_backend.backend import TemplateSDPABackend, create

    ctx = attnplug.BuildContext(config=attnplug.AttentionConfig(attention_backend="template_sdpa"),
                                host=attnplug.HostInfo(), kv_cache=attnplug.PagedKVCache(1, 4, 1, 64))
    name, backend = create(ctx)
    assert name == "template_sdpa" and isinstance(backend, TemplateSDPABackend)
