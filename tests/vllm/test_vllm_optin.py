"""The opt-in: installed, attnplug changes nothing in vLLM until ATTNPLUG_VLLM=1; the entry point vLLM
loads is declared; importing attnplug (and the integration package) imports neither vllm nor torch."""

from __future__ import annotations

import importlib.metadata as md
import subprocess
import sys

import pytest

import attnplug.integrations.vllm as integ


@pytest.mark.parametrize("value,on", [("", False), ("0", False), ("off", False), ("1", True), ("true", True),
                                      ("ON", True)])
def test_the_switch_reads_the_environment(value, on) -> None:
    assert integ.enabled({"ATTNPLUG_VLLM": value}) is on
    assert integ.enabled({}) is False


@pytest.mark.parametrize("value", ["2", "vllm_cpu", "maybe"])
def test_a_switch_value_that_is_neither_on_nor_off_names_the_variable(value) -> None:
    with pytest.raises(ValueError, match=f"ATTNPLUG_VLLM={value!r}"):
        integ.enabled({"ATTNPLUG_VLLM": value})


def test_the_entry_point_vllm_loads_registers_only_when_switched_on(monkeypatch) -> None:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    eps = [ep for ep in md.entry_points(group="vllm.general_plugins") if ep.name == "attnplug"]
    assert len(eps) == 1 and eps[0].value == "attnplug.integrations.vllm:register"
    fn = eps[0].load()
    integ.unregister()
    monkeypatch.delenv("ATTNPLUG_VLLM", raising=False)
    assert fn() is False and not AttentionBackendEnum.CPU_ATTN.is_overridden()
    monkeypatch.setenv("ATTNPLUG_VLLM", "1")
    try:
        assert fn() is True and AttentionBackendEnum.CPU_ATTN.get_path() == integ.BACKEND_PATH
    finally:
        integ.unregister()
    assert not AttentionBackendEnum.CPU_ATTN.is_overridden()


def test_import_attnplug_and_the_integration_package_import_neither_vllm_nor_torch() -> None:
    code = ("import sys, attnplug, attnplug.integrations.vllm as v; v.enabled({}); "
            "print(sorted(m for m in ('torch', 'vllm') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_bad_attnplug_flags_are_named() -> None:
    from attnplug.errors import AttnplugError
    from attnplug.integrations.vllm.backend import config_from_env

    assert config_from_env({"ATTNPLUG_VLLM_ARGS": "--attention-backend torch_native"}).attention_backends() == (
        "torch_native", "torch_native")
    with pytest.raises(AttnplugError, match="ATTNPLUG_VLLM_ARGS=.*--no-such-flag"):
        config_from_env({"ATTNPLUG_VLLM_ARGS": "--no-such-flag 1"})
