"""Property: over random configurations and hosts, resolution either returns a pair that is
available here and supports the configuration, or raises a clear error; it never changes a
pinned field and is deterministic (same inputs -> same result and records)."""

from __future__ import annotations

import warnings

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from attnplug import AttentionConfig, HostInfo
from attnplug.errors import AttnplugError
from attnplug.resolution import AUTO, trace
from attnplug.resolution.passes import PAIR_FIELDS, support_problems
from tests import dists_resolution as D

NAMES = [None] * 40 + [AUTO, "fa3", "flashinfer", "trtllm_mha", "aiter", "intel_amx", "triton", "torch_native",
         "torch", "triton_attn", "flash_attention_3", "flashattention3", "hybrid_default", "no_such_backend"]
NAME_FIELDS = sorted(PAIR_FIELDS | {"speculative_draft_attention_backend"})
LIBRARY_VERSIONS = {
    "flashinfer-python": ["0.4.0", "0.5.2", "0.6.1", "0.6.1", "0.6.1"],  # old ones break a floor
    "triton": ["2.3.0", "3.4.0", "3.4.0", "3.4.0"],
    "sgl-kernel": ["0.2.0", "0.3.5", "0.3.5", "0.3.5"],
    "aiter": ["0.1.5"],
    "torch": ["2.8.0"],
}


@st.composite
def hosts(draw) -> HostInfo:
    platform = draw(st.sampled_from(["cpu", "cuda", "cuda", "rocm", "xpu"]))
    libs = {}
    for dist, versions in LIBRARY_VERSIONS.items():
        if draw(st.sampled_from([True, True, False])):
            libs[dist] = draw(st.sampled_from(versions))
    flags = draw(st.sets(st.sampled_from(["amx_bf16", "amx_tile", "avx512f", "avx2"])))
    cc = draw(st.sampled_from([(7, 5), (8, 0), (8, 6), (9, 0), (10, 0), (12, 0)])) if platform == "cuda" else None
    gfx = draw(st.sampled_from(["gfx90a", "gfx942", "gfx950"])) if platform == "rocm" else None
    return HostInfo(platform=platform, compute_capability=cc, gfx_arch=gfx, cpu_flags=frozenset(flags),
                    libraries=libs)


@st.composite
def configs(draw) -> AttentionConfig:
    extra = draw(st.fixed_dictionaries({}, optional={
        "diffusion_lm": st.booleans(),
        "quantization": st.sampled_from(["mxfp4", "fp8"]),
        "speculative_algorithm": st.sampled_from(["EAGLE", ""]),
    }))
    return AttentionConfig(
        attention_backend=draw(st.sampled_from(NAMES)),
        prefill_attention_backend=draw(st.sampled_from(NAMES)),
        decode_attention_backend=draw(st.sampled_from(NAMES)),
        speculative_attention_mode=draw(st.sampled_from(["prefill", "decode"])),
        speculative_draft_attention_backend=draw(st.sampled_from([None] * 8 + [AUTO, "triton", "fa3"])),
        deterministic=draw(st.sampled_from([False, False, False, True])),
        dtype=draw(st.sampled_from([None, "float32", "float16", "bfloat16", "bf16"])),
        kv_cache_dtype=draw(st.sampled_from([None, None, "bfloat16", "float8_e4m3fn", "float8_e5m2"])),
        page_size=draw(st.sampled_from([None, None, 1, 8, 16, 64])),
        cuda_graph=draw(st.sampled_from([False, False, True])),
        extra=extra,
    )


def _quiet_trace(cfg, arch, host, reg):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return trace(cfg, arch=arch, host=host, registry=reg)


def _canonical(reg, host, value):
    if not isinstance(value, str) or value == AUTO:
        return value
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return reg.canonical(value, host)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=configs(), host=hosts(), arch=st.sampled_from([None, D.GPT_OSS, "LlamaForCausalLM"]))
def test_resolution_is_sound_pinned_and_deterministic(cfg, host, arch):
    reg = D.registry(host)
    res = _quiet_trace(cfg, arch, host, reg)
    again = _quiet_trace(cfg, arch, host, D.registry(host))  # a fresh registry: nothing carried over
    assert again.records == res.records
    assert again.config == res.config
    assert type(again.error) is type(res.error) and str(again.error) == str(res.error)

    event("resolved" if res.error is None else f"raised {type(res.error).__name__}")
    if res.error is not None:
        assert isinstance(res.error, (AttnplugError, ValueError)), repr(res.error)
        assert str(res.error)  # a clear message, not a bare class
        return

    out = res.config
    for half, name in zip(("prefill", "decode"), res.pair):
        assert name is not None and name != AUTO
        assert name in reg.names()
        assert reg.availability(name, host), (half, name, reg.availability(name, host).reasons)
        assert support_problems(reg, name, out, half) == [], (half, name)
        assert reg.get(name).library_floor_problem(host) is None
    for field in NAME_FIELDS:
        assert getattr(out, field) != AUTO, field

    # pinned fields never change (names compare canonically; "auto" is "pick by priority")
    for field, value in cfg.explicit_fields().items():
        if value == AUTO:
            continue
        got = getattr(out, field)
        if field in NAME_FIELDS:
            if value is not None:
                assert got == _canonical(reg, host, value), field
        else:
            assert got == value, field
    # the user's halves never change either
    for mine, got in zip(cfg.attention_backends(), res.pair):
        if mine is not None and mine != AUTO:
            assert got == _canonical(reg, host, mine)
    # every overruled declaration touched something the user pinned
    for _record, _field, _, why in res.overruled():
        assert why.startswith("pinned") or why.startswith("would change the"), why
    assert out is not cfg
