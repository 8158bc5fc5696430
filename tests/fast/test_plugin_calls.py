"""A warm resolution runs no plugin code that depends only on the host (issue 21).

Settling a registry for a host asks every probe, priority function and collecting hook once; the
frozen per-host view holds the answers, and ``resolve``/``trace`` read only that view. The spy
wraps ``isolation.call_plugin`` wherever the core holds it (every call into plugin code goes through
it) and sorts the calls by what they run:

* host code: probes, priority functions, ``attnplug_register_backends`` / ``attnplug_arch_overrides``
  / ``attnplug_resolution_rules`` / ``attnplug_resolve_name`` hooks -- a warm resolve makes none;
* configuration rules: the override and resolution rules and ``attnplug_check_config``, which read the
  configuration being resolved and so run once per resolution, each at most once.
"""

from __future__ import annotations

import sys
from collections import Counter
from typing import Any, Callable, Iterator

import pytest

from attnplug import AttentionConfig, isolation
from attnplug.resolution import AUTO, resolve, trace
from tests import dists_resolution as D
from tests.fast import resolution_snapshot as S

#: what a call's label starts with when it runs a configuration rule, not host code
CONFIG_RULES = ("resolution rule ", "hook attnplug_check_config")


@pytest.fixture
def plugin_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[Counter[str]]:
    """Every call into plugin code, by ``"<distribution>: <what>"``."""
    calls: Counter[str] = Counter()
    real = isolation.call_plugin

    def spy(distribution: str, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        calls[f"{distribution}: {what}"] += 1
        return real(distribution, what, fn, *args, **kwargs)

    holders = [m for name, m in list(sys.modules.items())
               if name.startswith("attnplug") and getattr(m, "call_plugin", None) is real]
    assert holders, "no module holds isolation.call_plugin"
    for module in holders:
        monkeypatch.setattr(module, "call_plugin", spy)
    yield calls


def _split(calls: Counter[str]) -> tuple[Counter[str], Counter[str]]:
    def rule(label: str) -> bool:
        return label.split(": ", 1)[1].startswith(CONFIG_RULES)

    host = Counter({w: n for w, n in calls.items() if not rule(w)})
    rules = Counter({w: n for w, n in calls.items() if rule(w)})
    return host, rules


CASES = [
    ("default", None, {}),
    ("gpt-oss", D.GPT_OSS, {}),
    ("auto", None, {"attention_backend": AUTO}),
    ("split", None, {"prefill_attention_backend": "triton", "decode_attention_backend": "torch_native"}),
    ("deterministic", None, {"deterministic": True}),
    ("eagle", D.GPT_OSS, {"extra": {"speculative_algorithm": "EAGLE"}}),
]


@pytest.mark.parametrize("kind", ["standins", "real"])
@pytest.mark.parametrize("hostname", ["H100", "B200", "MI300", "SPR", "CPU"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_a_warm_resolve_calls_no_host_plugin_code(plugin_calls: Counter[str], kind: str, hostname: str,
                                                  case: tuple[str, str | None, dict[str, Any]]) -> None:
    host = S.HOSTS[hostname]
    reg = S.REGISTRIES[kind](host)
    _, arch, fields = case
    cfg = AttentionConfig(**fields)
    cold = trace(cfg, arch=arch, host=host, registry=reg)
    assert sum(plugin_calls.values()) > 0  # the spy sees the cold resolve settle the host
    plugin_calls.clear()
    warm = trace(cfg, arch=arch, host=host, registry=reg)
    host_code, rules = _split(plugin_calls)
    assert warm.to_dict() == cold.to_dict()
    assert host_code == Counter(), f"a warm resolve ran plugin code: {dict(host_code)}"
    # every configuration rule runs at most once per resolution
    assert all(n == 1 for n in rules.values()), dict(rules)


def test_the_spy_counts_what_a_cold_registry_runs(plugin_calls: Counter[str]) -> None:
    """The spy is not blind: a first resolve asks every probe and priority function and hook."""
    host = S.HOSTS["H100"]
    resolve(AttentionConfig(), host=host, registry=D.registry(host))
    host_code, _ = _split(plugin_calls)
    labels = " ".join(host_code)
    for what in ("availability probe of backend 'fa3'", "priority function of backend 'fa3'",
                 "hook attnplug_arch_overrides", "hook attnplug_resolution_rules"):
        assert what in labels, (what, dict(host_code))
