"""The resolution chain, table-driven over hand-built hosts x architectures x user choices.

The plugins are in-process stand-ins (tests/dists_resolution) for fa3,
flashinfer, trtllm_mha, aiter, intel_amx and triton, next to the real
torch_native descriptor. Each row states the resolved pair and every
provenance record ``(pass, source distribution, {field: value})``.
"""

from __future__ import annotations

import json
import re
import types
import warnings
from pathlib import Path

import pytest

from attnplug import AttentionConfig, HostInfo, hookimpl
from attnplug.errors import (
    AttnplugError,
    BackendUnavailableError,
    ConfigError,
    PluginError,
    UnknownBackendError,
)
from attnplug.registry import in_process_source
from attnplug.resolution import AUTO, Resolution, collect_arch_overrides, resolve, trace
from tests import dists_resolution as D
from tests.dists_resolution import triton as triton_plugin

GPT = D.GPT_OSS
LIBS = {"flashinfer-python": "0.6.1", "triton": "3.4.0", "sgl-kernel": "0.3.5", "torch": "2.8.0"}
A100 = HostInfo(platform="cuda", compute_capability=(8, 0), device_name="A100", libraries=LIBS)
H100 = HostInfo(platform="cuda", compute_capability=(9, 0), device_name="H100", libraries=LIBS)
B200 = HostInfo(platform="cuda", compute_capability=(10, 0), device_name="B200", libraries=LIBS)
MI300 = HostInfo(platform="rocm", gfx_arch="gfx942", libraries={"aiter": "0.1.5", "triton": "3.4.0", "torch": "2.8.0"})
SPR = HostInfo(platform="cpu", cpu_flags=frozenset({"amx_bf16", "amx_tile", "avx512f"}), libraries={"torch": "2.8.0"})
CPU = HostInfo(platform="cpu", cpu_flags=frozenset({"avx2"}), libraries={"torch": "2.8.0"})
BARE_H100 = HostInfo(platform="cuda", compute_capability=(9, 0))  # no kernel libraries at all
H100_NO_SGL = HostInfo(platform="cuda", compute_capability=(9, 0),
                       libraries={"flashinfer-python": "0.6.1", "triton": "3.4.0"})
H100_TRITON_ONLY = HostInfo(platform="cuda", compute_capability=(9, 0), libraries={"triton": "3.4.0"})
A100_NO_SGL = HostInfo(platform="cuda", compute_capability=(8, 0),
                       libraries={"flashinfer-python": "0.6.1", "triton": "3.4.0"})
B200_OLD_FI = HostInfo(platform="cuda", compute_capability=(10, 0),
                       libraries={"flashinfer-python": "0.5.2", "triton": "3.4.0"})
A100_OLD_FI = HostInfo(platform="cuda", compute_capability=(8, 0),
                       libraries={"flashinfer-python": "0.4.0", "triton": "3.4.0", "sgl-kernel": "0.3.5"})

ARCH = "arch_overrides"
FILL = "default_fill"
COMPAT = "compat_fallback"
FALLBACK = "fallback_rules"
FORCE = "force_rules"


def fill(name):
    return (FILL, "attnplug", {"attention_backend": name})


def compat(**fields):
    return (COMPAT, "attnplug", fields)


def user(**fields):
    return ("user", "user", fields)


TRITON_DEFAULT = (ARCH, "attnplug-triton", {"attention_backend": "triton"})
FA3_HOPPER = (ARCH, "attnplug-fa3", {"attention_backend": "fa3"})
TRTLLM_BW = (ARCH, "attnplug-trtllm-mha", {"attention_backend": "trtllm_mha"})
TRTLLM_PAGE = (FALLBACK, "attnplug-trtllm-mha", {"page_size": 64})
AITER_ROCM = (ARCH, "attnplug-aiter", {"attention_backend": "aiter"})
AMX_CPU = (ARCH, "attnplug-intel-amx", {"attention_backend": "intel_amx"})

#: (id, host, arch, user fields) -> (expected pair, expected records)
TABLE = [
    # platform default fill, no architecture
    ("a100-default", A100, None, {}, ("flashinfer", "flashinfer"), [fill("flashinfer")]),
    ("h100-default", H100, None, {}, ("fa3", "fa3"), [fill("fa3")]),
    ("b200-default", B200, None, {}, ("flashinfer", "flashinfer"), [fill("flashinfer")]),
    ("mi300-default", MI300, None, {}, ("aiter", "aiter"), [fill("aiter")]),
    ("amx-default", SPR, None, {}, ("intel_amx", "intel_amx"), [fill("intel_amx")]),
    ("amx-fp32", SPR, None, {"dtype": "float32"}, ("torch_native", "torch_native"),
     [user(dtype="float32"), fill("torch_native")]),
    ("cpu-default", CPU, None, {}, ("torch_native", "torch_native"), [fill("torch_native")]),
    ("bare-cuda-default", BARE_H100, None, {}, ("torch_native", "torch_native"), [fill("torch_native")]),
    ("h100-no-sgl-default", H100_NO_SGL, None, {}, ("flashinfer", "flashinfer"), [fill("flashinfer")]),
    ("llama-is-no-override", H100, "LlamaForCausalLM", {}, ("fa3", "fa3"), [fill("fa3")]),
    # gpt-oss: the family's preference emerges from several plugins
    ("gptoss-a100", A100, GPT, {}, ("triton", "triton"), [TRITON_DEFAULT]),
    ("gptoss-h100", H100, GPT, {}, ("fa3", "fa3"), [TRITON_DEFAULT, FA3_HOPPER]),
    ("gptoss-b200", B200, GPT, {}, ("trtllm_mha", "trtllm_mha"), [TRITON_DEFAULT, TRTLLM_BW, TRTLLM_PAGE]),
    ("gptoss-mi300", MI300, GPT, {}, ("aiter", "aiter"), [TRITON_DEFAULT, AITER_ROCM]),
    ("gptoss-amx", SPR, GPT, {}, ("intel_amx", "intel_amx"), [TRITON_DEFAULT, AMX_CPU]),
    ("gptoss-cpu-fallback", CPU, GPT, {}, ("torch_native", "torch_native"),
     [TRITON_DEFAULT, compat(attention_backend="torch_native")]),
    ("gptoss-h100-no-sgl-fallback", H100_NO_SGL, GPT, {}, ("flashinfer", "flashinfer"),
     [TRITON_DEFAULT, FA3_HOPPER, compat(attention_backend="flashinfer")]),
    ("gptoss-bare-cuda", BARE_H100, GPT, {}, ("torch_native", "torch_native"),
     [TRITON_DEFAULT, FA3_HOPPER, compat(attention_backend="torch_native")]),
    # the user's choices are pinned
    ("gptoss-h100-user-triton", H100, GPT, {"attention_backend": "triton"}, ("triton", "triton"),
     [user(attention_backend="triton"), TRITON_DEFAULT, FA3_HOPPER]),
    ("gptoss-b200-user-prefill", B200, GPT, {"prefill_attention_backend": "flashinfer"},
     ("flashinfer", "trtllm_mha"),
     [user(prefill_attention_backend="flashinfer"), TRITON_DEFAULT, TRTLLM_BW, TRTLLM_PAGE]),
    ("gptoss-b200-user-decode", B200, GPT, {"decode_attention_backend": "triton"}, ("trtllm_mha", "triton"),
     [user(decode_attention_backend="triton"), TRITON_DEFAULT, TRTLLM_BW, TRTLLM_PAGE]),
    ("h100-user-split", H100, None, {"prefill_attention_backend": "fa3", "decode_attention_backend": "flashinfer"},
     ("fa3", "flashinfer"), [user(prefill_attention_backend="fa3", decode_attention_backend="flashinfer")]),
    ("h100-user-prefill-only", H100, None, {"prefill_attention_backend": "triton"}, ("triton", "fa3"),
     [user(prefill_attention_backend="triton"), fill("fa3")]),
    ("a100-user-alias", A100, None, {"attention_backend": "torch"}, ("torch_native", "torch_native"),
     [user(attention_backend="torch")]),
    ("cpu-user-torch-native", CPU, GPT, {"attention_backend": "torch_native"}, ("torch_native", "torch_native"),
     [user(attention_backend="torch_native"), TRITON_DEFAULT]),
    # auto: by priority, architecture preferences do not apply
    ("gptoss-b200-auto", B200, GPT, {"attention_backend": AUTO}, ("flashinfer", "flashinfer"),
     [user(attention_backend=AUTO), TRITON_DEFAULT, TRTLLM_BW, fill("flashinfer")]),
    ("gptoss-b200-prefill-auto", B200, GPT, {"prefill_attention_backend": AUTO}, ("flashinfer", "trtllm_mha"),
     [user(prefill_attention_backend=AUTO), TRITON_DEFAULT, TRTLLM_BW,
      (FILL, "attnplug", {"prefill_attention_backend": "flashinfer"}), TRTLLM_PAGE]),
    ("amx-auto", SPR, None, {"attention_backend": AUTO}, ("intel_amx", "intel_amx"),
     [user(attention_backend=AUTO), fill("intel_amx")]),
    # mxfp4 quantisation forces bfloat16 unless the user chose a dtype
    ("gptoss-mxfp4", H100, GPT, {"extra": {"quantization": "mxfp4"}}, ("fa3", "fa3"),
     [user(extra={"quantization": "mxfp4"}), TRITON_DEFAULT, FA3_HOPPER,
      (ARCH, "attnplug-triton", {"dtype": "bfloat16"})]),
    ("gptoss-mxfp4-user-dtype", H100, GPT, {"extra": {"quantization": "mxfp4"}, "dtype": "float16"}, ("fa3", "fa3"),
     [user(dtype="float16", extra={"quantization": "mxfp4"}), TRITON_DEFAULT, FA3_HOPPER,
      (ARCH, "attnplug-triton", {"dtype": "bfloat16"})]),
    # diffusion-LM mode forces flashinfer with CUDA graphs unless the user chose otherwise
    ("diffusion-h100", H100, None, {"extra": {"diffusion_lm": True}}, ("flashinfer", "flashinfer"),
     [user(extra={"diffusion_lm": True}),
      (FORCE, "attnplug-flashinfer", {"attention_backend": "flashinfer", "cuda_graph": True})]),
    ("diffusion-gptoss-h100", H100, GPT, {"extra": {"diffusion_lm": True}}, ("flashinfer", "flashinfer"),
     [user(extra={"diffusion_lm": True}), TRITON_DEFAULT, FA3_HOPPER,
      (FORCE, "attnplug-flashinfer", {"attention_backend": "flashinfer", "cuda_graph": True})]),
    ("diffusion-user-triton", H100, None, {"extra": {"diffusion_lm": True}, "attention_backend": "triton"},
     ("triton", "triton"),
     [user(attention_backend="triton", extra={"diffusion_lm": True}),
      (FORCE, "attnplug-flashinfer", {"attention_backend": "flashinfer", "cuda_graph": True})]),
    ("diffusion-no-flashinfer", H100_TRITON_ONLY, None, {"extra": {"diffusion_lm": True}}, ("triton", "triton"),
     [user(extra={"diffusion_lm": True}),
      (FORCE, "attnplug-flashinfer", {"attention_backend": "flashinfer", "cuda_graph": True}),
      compat(attention_backend="triton")]),
    # deterministic inference: a non-deterministic pass choice falls back
    ("gptoss-b200-deterministic", B200, GPT, {"deterministic": True}, ("flashinfer", "flashinfer"),
     [user(deterministic=True), TRITON_DEFAULT, TRTLLM_BW, compat(attention_backend="flashinfer")]),
    ("mi300-deterministic", MI300, None, {"deterministic": True}, ("triton", "triton"),
     [user(deterministic=True), fill("triton")]),
    # speculative decoding: the half that serves target-verify must claim it
    ("spec-decode-half", B200, GPT, {"speculative_attention_mode": "decode",
                                     "extra": {"speculative_algorithm": "EAGLE"}},
     ("trtllm_mha", "flashinfer"),
     [user(speculative_attention_mode="decode", extra={"speculative_algorithm": "EAGLE"}), TRITON_DEFAULT,
      TRTLLM_BW, compat(decode_attention_backend="flashinfer"), TRTLLM_PAGE]),
    ("spec-prefill-half", B200, GPT, {"extra": {"speculative_algorithm": "EAGLE"}}, ("flashinfer", "trtllm_mha"),
     [user(extra={"speculative_algorithm": "EAGLE"}), TRITON_DEFAULT, TRTLLM_BW,
      compat(prefill_attention_backend="flashinfer"), TRTLLM_PAGE]),
    # the user's page size rules trtllm_mha out
    ("gptoss-b200-page8", B200, GPT, {"page_size": 8}, ("flashinfer", "flashinfer"),
     [user(page_size=8), TRITON_DEFAULT, TRTLLM_BW, compat(attention_backend="flashinfer")]),
    # a floor problem only matters when a half uses that plugin
    ("old-flashinfer-user-triton", B200_OLD_FI, GPT, {"attention_backend": "triton"}, ("triton", "triton"),
     [user(attention_backend="triton"), TRITON_DEFAULT, TRTLLM_BW]),
]


@pytest.fixture(scope="module")
def registries():
    cache: dict[HostInfo, object] = {}

    def get(host):
        if host not in cache:
            cache[host] = D.registry(host)
        return cache[host]

    return get


@pytest.mark.parametrize("case", TABLE, ids=[c[0] for c in TABLE])
def test_table(case, registries):
    _, host, arch, fields, pair, records = case
    cfg = AttentionConfig(**fields)
    res = resolve(cfg, arch=arch, host=host, registry=registries(host))
    assert res.pair == pair
    # the kv_layout pass closes every successful resolution (tested in test_kv_layout.py); every backend
    # of this table reads only the core's default layout
    *rest, last = res.records
    assert last.as_tuple() == ("kv_layout", "attnplug", {"kv_layout": "nhd"}) and res.config.kv_layout == "nhd"
    assert [r.as_tuple() for r in rest] == records
    assert_user_choice_kept(cfg, res)
    # a fresh registry gives the same answer and the same records
    again = resolve(cfg, arch=arch, host=host, registry=D.registry(host))
    assert again.config == res.config and again.records == res.records


CANONICAL = {"torch": "torch_native"}


def assert_user_choice_kept(cfg: AttentionConfig, res: Resolution) -> None:
    for field, value in cfg.explicit_fields().items():
        if value != AUTO:
            want = CANONICAL.get(value, value) if isinstance(value, str) else value
            assert getattr(res.config, field) == want, field
    for mine, got in zip(cfg.attention_backends(), res.pair):
        if mine is not None and mine != AUTO:
            assert got == CANONICAL.get(mine, mine)


def test_overruled_declarations_are_recorded_not_dropped():
    res = resolve(AttentionConfig(attention_backend="triton"), arch=GPT, host=H100, registry=D.registry(H100))
    fa3 = [r for r in res.records if r.source == "attnplug-fa3"][0]
    assert fa3.applied == {} and "attention_backend" in fa3.overruled
    assert "pinned" in fa3.overruled["attention_backend"]
    over = res.overruled()
    assert [(r.source, f, v) for r, f, v, _ in over] == [("attnplug-fa3", "attention_backend", "fa3")]


def test_split_user_choice_overrules_per_half_declaration():
    # the base choice pins both halves; a per-half declaration that would move one is overruled
    mod = types.ModuleType("per_half_override")

    @hookimpl
    def attnplug_arch_overrides(register):
        register("Toy", lambda host, config: {"decode_attention_backend": "flashinfer"})

    mod.attnplug_arch_overrides = attnplug_arch_overrides
    reg = D.registry(H100, in_process_source(mod, "attnplug-toy"))
    res = resolve(AttentionConfig(attention_backend="triton"), arch="Toy", host=H100, registry=reg)
    assert res.pair == ("triton", "triton")
    rec, = [r for r in res.records if r.pass_name == "arch_overrides"]
    assert rec.overruled == {"decode_attention_backend": "would change the decode half you chose ('triton')"}


def test_mxfp4_user_dtype_overruled_reason():
    cfg = AttentionConfig(dtype="float16", extra={"quantization": "mxfp4"})
    res = resolve(cfg, arch=GPT, host=H100, registry=D.registry(H100))
    assert res.config.dtype == "float16"
    (rec, field, value, why), = res.overruled()
    assert (rec.source, field, value) == ("attnplug-triton", "dtype", "bfloat16")
    assert why == "pinned: you set dtype='float16'"


def test_diffusion_forces_cuda_graph():
    res = resolve(AttentionConfig(extra={"diffusion_lm": True}), host=H100, registry=D.registry(H100))
    assert res.config.cuda_graph is True


# -- checks -------------------------------------------------------------------
def test_deterministic_with_user_choice_names_qualifying_backends():
    with pytest.raises(ValueError) as info:
        resolve(AttentionConfig(attention_backend="trtllm_mha", deterministic=True), arch=GPT, host=B200,
                registry=D.registry(B200))
    msg = str(info.value)
    assert "trtllm_mha" in msg and "Backends that do: fa3, flashinfer, triton" in msg
    assert "available here: flashinfer, triton" in msg


def test_deterministic_nothing_serves_names_backends_that_declare_it():
    with pytest.raises(ConfigError) as info:
        resolve(AttentionConfig(deterministic=True), host=CPU, registry=D.registry(CPU))
    msg = str(info.value)
    assert "no attention backend serves the prefill half" in msg
    assert "Backends that declare deterministic output: fa3, flashinfer, triton" in msg
    assert "torch_native (deterministic (batch-invariant) output is not claimed)" in msg


def test_library_floor_fails_when_the_decode_half_uses_it():
    # the user chose prefill only; gpt-oss's override puts trtllm_mha (floor 0.6.0) on decode
    with pytest.raises(ConfigError) as info:
        resolve(AttentionConfig(prefill_attention_backend="triton"), arch=GPT, host=B200_OLD_FI,
                registry=D.registry(B200_OLD_FI))
    msg = str(info.value)
    assert "attnplug-trtllm-mha" in msg and "flashinfer-python >= 0.6.0, found 0.5.2" in msg
    assert "decode half" in msg


@pytest.mark.parametrize("fields", [
    {"attention_backend": "flashinfer"},
    {"prefill_attention_backend": "flashinfer", "decode_attention_backend": "triton"},
    {"prefill_attention_backend": "triton", "decode_attention_backend": "flashinfer"},
    {"decode_attention_backend": "flashinfer", "attention_backend": "triton"},
    {},  # the default fill picks flashinfer: the floor still fails at start-up
])
def test_library_floor_fails_when_either_half_uses_the_plugin(fields):
    with pytest.raises(ConfigError, match=r"attnplug-flashinfer.*flashinfer-python >= 0\.5\.0, found 0\.4\.0"):
        resolve(AttentionConfig(**fields), host=A100_OLD_FI, registry=D.registry(A100_OLD_FI))


def test_library_floor_ignored_when_no_half_uses_the_plugin():
    res = resolve(AttentionConfig(attention_backend="triton"), host=A100_OLD_FI, registry=D.registry(A100_OLD_FI))
    assert res.pair == ("triton", "triton")


def test_unavailable_explicit_choice_raises_with_reasons_and_what_would_serve():
    with pytest.raises(BackendUnavailableError) as info:
        resolve(AttentionConfig(attention_backend="fa3"), host=A100_NO_SGL, registry=D.registry(A100_NO_SGL))
    err = info.value
    assert err.name == "fa3"
    assert any("sgl-kernel" in r for r in err.reasons)
    assert "Backends that would serve this configuration here: flashinfer, triton, torch_native" in str(err)


def test_unavailable_split_choice_names_its_half():
    with pytest.raises(BackendUnavailableError, match="aiter"):
        resolve(AttentionConfig(decode_attention_backend="aiter"), host=H100, registry=D.registry(H100))


def test_unsupported_explicit_choice_raises():
    with pytest.raises(ConfigError, match=r"'trtllm_mha'.*page_size=8"):
        resolve(AttentionConfig(attention_backend="trtllm_mha", page_size=8), host=B200, registry=D.registry(B200))


def test_check_config_hook_problem_names_the_plugin():
    with pytest.raises(ConfigError, match=r"plugin 'attnplug-aiter': aiter on gfx942 stores fp8 KV"):
        resolve(AttentionConfig(kv_cache_dtype="float8_e5m2"), host=MI300, registry=D.registry(MI300))


def test_unknown_name_lists_what_is_installed():
    with pytest.raises(UnknownBackendError, match="unknown attention backend 'nope'"):
        resolve(AttentionConfig(attention_backend="nope"), host=H100, registry=D.registry(H100))


def test_draft_backend_is_checked():
    with pytest.raises(BackendUnavailableError, match="speculative draft"):
        resolve(AttentionConfig(speculative_draft_attention_backend="aiter"), host=H100, registry=D.registry(H100))
    res = resolve(AttentionConfig(speculative_draft_attention_backend="triton_attn"), host=H100,
                  registry=D.registry(H100))
    assert res.config.speculative_draft_attention_backend == "triton"


def test_draft_auto_means_the_configured_pair():
    res = resolve(AttentionConfig(speculative_draft_attention_backend=AUTO), host=H100, registry=D.registry(H100))
    assert res.config.speculative_draft_attention_backend is None


# -- names: aliases, deprecated aliases, host-dependent names, auto ------------
def test_alias_resolves_to_canonical():
    res = resolve(AttentionConfig(attention_backend="flash_attention_3"), host=H100, registry=D.registry(H100))
    assert res.pair == ("fa3", "fa3")
    assert res.pinned == {"attention_backend": "fa3"}


def test_deprecated_alias_warns_naming_the_replacement():
    with pytest.warns(DeprecationWarning, match="'flashattention3' is deprecated; use 'fa3'"):
        res = resolve(AttentionConfig(prefill_attention_backend="flashattention3"), host=H100,
                      registry=D.registry(H100))
    assert res.pair == ("fa3", "fa3")


@pytest.mark.parametrize("host,expected", [(H100, "fa3"), (SPR, "intel_amx"), (CPU, "torch_native"),
                                           (A100, "triton"), (MI300, "triton")])
def test_host_dependent_name(host, expected):
    res = resolve(AttentionConfig(attention_backend="hybrid_default"), host=host, registry=D.registry(host))
    assert res.pair == (expected, expected)


def test_host_dependent_name_is_cached_per_name_and_host():
    reg = D.registry(H100)
    before = len(triton_plugin.RESOLVE_CALLS)
    for _ in range(3):
        resolve(AttentionConfig(attention_backend="hybrid_default"), host=H100, registry=reg)
    assert len(triton_plugin.RESOLVE_CALLS) - before == 1
    resolve(AttentionConfig(attention_backend="hybrid_default"), host=SPR, registry=reg)
    assert len(triton_plugin.RESOLVE_CALLS) - before == 2


def test_auto_everywhere_is_the_default_fill():
    for host in (A100, H100, B200, MI300, SPR, CPU, BARE_H100):
        reg = D.registry(host)
        plain = resolve(AttentionConfig(), host=host, registry=reg)
        auto = resolve(AttentionConfig(attention_backend=AUTO), host=host, registry=reg)
        assert auto.pair == plain.pair
        assert "auto" not in auto.config.to_dict().values()


def test_base_auto_under_two_halves_is_dropped():
    cfg = AttentionConfig(attention_backend=AUTO, prefill_attention_backend="fa3", decode_attention_backend="triton")
    res = resolve(cfg, host=H100, registry=D.registry(H100))
    assert res.pair == ("fa3", "triton")
    assert "auto" not in res.config.to_dict().values()


def test_auto_half_with_split_auto_filled_per_half():
    cfg = AttentionConfig(attention_backend=AUTO, prefill_attention_backend=AUTO, decode_attention_backend="triton")
    res = resolve(cfg, host=H100, registry=D.registry(H100))
    assert res.pair == ("fa3", "triton")
    assert "auto" not in res.config.to_dict().values()


# -- plugin rules that break the contract name their distribution ----------------
def _rule_plugin(hook: str, fn):
    mod = types.ModuleType("bad_rules")
    if hook == "arch":
        @hookimpl
        def attnplug_arch_overrides(register):
            fn(register)

        mod.attnplug_arch_overrides = attnplug_arch_overrides
    else:
        @hookimpl
        def attnplug_resolution_rules(register):
            fn(register)

        mod.attnplug_resolution_rules = attnplug_resolution_rules
    return in_process_source(mod, "attnplug-bad-rules")


@pytest.mark.parametrize("hook,fn,match", [
    ("arch", lambda r: r("Toy", lambda h, c: {"no_such_field": 1}), "unknown field 'no_such_field'"),
    ("arch", lambda r: r("Toy", lambda h, c: {"attention_backend": "nope"}), "declared attention_backend='nope'"),
    ("arch", lambda r: r("Toy", lambda h, c: {"attention_backend": AUTO}), "declare a backend name"),
    ("arch", lambda r: r("Toy", lambda h, c: 1 / 0), "raised ZeroDivisionError"),
    ("arch", lambda r: r("Toy", lambda h, c: ["fa3"]), "must return a dict"),
    ("arch", lambda r: r("Toy", lambda h, c: {"page_size": -1}), "page_size=-1"),
    ("arch", lambda r: r("Toy", "not callable"), "not callable"),
    ("rules", lambda r: r("x", "sometimes", lambda h, c, g: {}), "stage='sometimes'"),
    ("rules", lambda r: r("x", "force", lambda h, c, g: {"speculative_attention_mode": "both"}),
     "speculative_attention_mode"),
    ("rules", lambda r: (_ for _ in ()).throw(RuntimeError("boom")), "raised RuntimeError: boom"),
])
def test_bad_rules_set_the_plugin_aside_naming_it(hook, fn, match):
    """The contract (issue 26, item 13): the plugin is set aside with the reason, and resolution runs
    again for everyone else -- the same pair as without the plugin."""
    reg = D.registry(H100, _rule_plugin(hook, fn))
    res = resolve(AttentionConfig(), arch="Toy", host=H100, registry=reg)
    assert list(res.set_aside) == ["attnplug-bad-rules"]
    assert re.search(match, res.set_aside["attnplug-bad-rules"])
    record = next(p for p in reg.plugins if p.distribution == "attnplug-bad-rules")
    assert record.status == "failed" and re.search(match, record.error)
    assert res.pair == resolve(AttentionConfig(), arch="Toy", host=H100, registry=D.registry(H100)).pair


def test_pass_choice_that_cannot_serve_names_the_rule():
    # a fallback rule that switches to a backend unavailable here: the check names who chose it
    def switch(register):
        register("to_aiter", "fallback", lambda h, c, g: {"decode_attention_backend": "aiter"})

    reg = D.registry(H100, _rule_plugin("rules", switch))
    with pytest.raises(ConfigError, match=r"decode half 'aiter', declared by fallback_rules \[attnplug-bad-rules\]"):
        resolve(AttentionConfig(), host=H100, registry=reg)


def test_check_hook_that_raises_names_the_plugin():
    mod = types.ModuleType("raising_check")

    @hookimpl
    def attnplug_check_config(config, host):
        raise KeyError("x")

    mod.attnplug_check_config = attnplug_check_config
    reg = D.registry(H100, in_process_source(mod, "attnplug-raising-check"))
    res = resolve(AttentionConfig(), host=H100, registry=reg)  # set aside (issue 26), not a failed resolution
    assert "attnplug_check_config raised KeyError" in res.set_aside["attnplug-raising-check"]


# -- purity ------------------------------------------------------------------
def test_resolution_returns_a_new_config_and_writes_nothing_global(monkeypatch):
    import os

    env = dict(os.environ)
    reg = D.registry(B200)
    names, descs = reg.names(), dict(reg.descriptors)
    cfg = AttentionConfig(prefill_attention_backend="flashinfer")
    res = resolve(cfg, arch=GPT, host=B200, registry=reg)
    assert res.config is not cfg and cfg == AttentionConfig(prefill_attention_backend="flashinfer")
    assert res.user_config is cfg
    assert dict(os.environ) == env and reg.names() == names and reg.descriptors == descs
    with pytest.raises(Exception):
        res.config.page_size = 1  # frozen


def test_trace_returns_partial_result_with_the_error():
    res = trace(AttentionConfig(attention_backend="trtllm_mha", deterministic=True), arch=GPT, host=B200,
                registry=D.registry(B200))
    assert not res.ok and isinstance(res.error, ValueError)
    assert [r.pass_name for r in res.records][:1] == ["user"]
    assert "resolution FAILED" in res.explain()


def test_errors_are_attnplug_errors_or_value_errors():
    for exc in (ConfigError, BackendUnavailableError, UnknownBackendError, PluginError):
        assert issubclass(exc, (AttnplugError, ValueError))


# -- explain ------------------------------------------------------------------
def test_explain_text_lists_passes_pins_overruled_and_rejected():
    res = resolve(AttentionConfig(attention_backend="triton"), arch=GPT, host=H100, registry=D.registry(H100))
    text = res.explain()
    assert "resolved pair: prefill=triton decode=triton" in text
    assert "pinned (set by you; no pass may change them): attention_backend='triton'" in text
    for name in ("arch_overrides", "force_rules", "default_fill", "compat_fallback", "fallback_rules"):
        assert name in text
    assert text.index("arch_overrides") < text.index("default_fill") < text.index("compat_fallback")
    assert "arch_overrides [attnplug-fa3] attention_backend='fa3': pinned: you set attention_backend='triton'" \
        in text
    assert "aiter (attnplug-aiter 1.0.0): needs a rocm device" in text
    assert "trtllm_mha (attnplug-trtllm-mha 1.0.0): needs compute capability >= 10.0" in text


def test_rejected_reasons_cover_every_other_backend():
    res = resolve(AttentionConfig(), arch=GPT, host=H100, registry=D.registry(H100))
    rejected = res.rejected()
    assert set(rejected) == {"aiter", "flashinfer", "intel_amx", "torch_native", "triton", "trtllm_mha"}
    assert all(rejected.values())
    assert "not chosen" in rejected["flashinfer"][0]


def test_to_dict_is_json():
    res = resolve(AttentionConfig(extra={"quantization": "mxfp4"}), arch=GPT, host=B200, registry=D.registry(B200))
    data = json.loads(json.dumps(res.to_dict()))
    assert data["pair"] == {"prefill": "trtllm_mha", "decode": "trtllm_mha"}
    assert data["records"][0]["pass"] == "user"
    assert {c["name"] for c in data["candidates"]} >= {"fa3", "torch_native"}


def test_list_overrides_in_application_order():
    overrides = collect_arch_overrides(D.registry(H100))
    assert [(o.distribution, o.name, o.precedence) for o in overrides] == [
        ("attnplug-triton", "gpt_oss_default", -10),
        ("attnplug-aiter", "gpt_oss_on_rocm", 0),
        ("attnplug-fa3", "gpt_oss_on_hopper", 0),
        ("attnplug-intel-amx", "gpt_oss_on_amx", 0),
        ("attnplug-torch-native", "mla_on_cpu", 0),  # DeepseekV3ForCausalLM
        ("attnplug-torch-native", "mla_on_cpu", 0),  # DeepseekV2ForCausalLM
        ("attnplug-triton", "gpt_oss_mxfp4_dtype", 0),
        ("attnplug-trtllm-mha", "gpt_oss_on_blackwell", 0),
    ]
    assert overrides[2].description == "gpt-oss on SM90 prefers fa3"


# -- CLI ------------------------------------------------------------------------
@pytest.fixture
def cli_registry(monkeypatch):
    import attnplug.registry as registry_mod

    reg = D.registry()
    monkeypatch.setattr(registry_mod, "default_registry", lambda: reg)
    return reg


def test_cli_resolve_host_json(cli_registry, tmp_path, capsys):
    from attnplug.cli.main import main

    host = tmp_path / "host.json"
    host.write_text(json.dumps({"platform": "cuda", "compute_capability": [10, 0],
                                "libraries": {"flashinfer-python": "0.6.1"}}))
    assert main(["resolve", "--arch", GPT, "--host-json", str(host), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["pair"] == {"prefill": "trtllm_mha", "decode": "trtllm_mha"}
    assert data["config"]["page_size"] == 64
    assert main(["resolve", "--arch", GPT, "--host-json", str(host), "--prefill-attention-backend", "flashinfer",
                 "--decode-attention-backend", "torch"]) == 0
    out = capsys.readouterr().out
    assert "resolved pair: prefill=flashinfer decode=torch_native" in out
    assert "overruled" in out and "would change" not in out


def test_cli_resolve_failure_explains_and_exits_1(cli_registry, tmp_path, capsys):
    from attnplug.cli.main import main

    host = tmp_path / "host.json"
    host.write_text(json.dumps({"platform": "cpu"}))
    assert main(["resolve", "--host-json", str(host), "--deterministic"]) == 1
    out = capsys.readouterr().out
    assert "resolution FAILED" in out and "Backends that declare deterministic output" in out


def test_cli_resolve_extra_flags(cli_registry, tmp_path, capsys):
    from attnplug.cli.main import main

    host = tmp_path / "host.json"
    host.write_text(json.dumps({"platform": "cuda", "compute_capability": "9.0",
                                "libraries": {"flashinfer-python": "0.6.1", "sgl-kernel": "0.3.5"}}))
    assert main(["resolve", "--host-json", str(host), "--extra", "diffusion_lm=true", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["pair"]["prefill"] == "flashinfer" and data["config"]["cuda_graph"] is True
    assert main(["resolve", "--extra", "oops"]) == 2


def test_cli_list_overrides(cli_registry, capsys):
    from attnplug.cli.main import main

    assert main(["resolve", "--list-overrides"]) == 0
    out = capsys.readouterr().out
    assert "GptOssForCausalLM: gpt_oss_on_hopper [attnplug-fa3] precedence=0 -- gpt-oss on SM90 prefers fa3" in out
    assert "force: diffusion_lm_flashinfer [attnplug-flashinfer]" in out
    assert main(["resolve", "--list-overrides", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data["overrides"]) == 8 and len(data["rules"]) == 2  # 6 gpt-oss + torch_native's 2 MLA archs


def test_cli_resolve_with_installed_plugins_only(capsys, tmp_path):
    """The real default registry (torch_native only) on a recorded CUDA host."""
    from attnplug.cli.main import main

    host = tmp_path / "host.json"
    host.write_text(json.dumps({"platform": "cuda", "compute_capability": [9, 0]}))
    assert main(["resolve", "--host-json", str(host), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["pair"] == {"prefill": "torch_native", "decode": "torch_native"}


# -- static properties of the core ---------------------------------------------
CORE = Path(__file__).resolve().parents[2] / "core" / "attnplug"
CHAIN_FILES = sorted((CORE / "resolution").glob("*.py"))
RESOLUTION_FILES = CHAIN_FILES + [CORE / "cli" / n for n in ("resolve_cmd.py", "doctor_cmd.py")]


def test_core_resolution_has_no_architecture_or_hardware_ladders():
    banned = ("GptOss", "gpt_oss", "Llama", "fa3", "flashinfer", "trtllm", "aiter", "intel_amx", "triton",
              "sm()", "compute_capability", "gfx", "has_amx", "torch_native")
    for path in CHAIN_FILES:
        text = path.read_text()
        for word in banned:
            assert word not in text, f"{path.name} mentions {word!r}: architecture/hardware knowledge belongs to plugins"


def test_resolution_never_reads_the_base_field():
    guard = pytest.importorskip("attnplug.guard")
    guard.assert_no_base_field_reads({str(p): "resolution decides from the pair" for p in RESOLUTION_FILES})


def test_resolve_command_never_imports_torch():
    import subprocess
    import sys

    code = ("import sys, io, contextlib\n"
            "from attnplug.cli.main import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    rc = main(['resolve', '--arch', 'GptOssForCausalLM'])\n"
            "import attnplug.cli.doctor_cmd\n"
            "print(rc, 'torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["0", "False"], out.stdout + out.stderr
