"""fa3 against sgl-kernel's real ``flash_attn_with_kvcache`` (signatures of 0.3.0 … 0.3.21 and
sglang-kernel 0.4.10 read from the wheels) and its checks: bfloat16 sinks, int32 indices, one q/KV
dtype, sinks only from 0.3.4.post1. GPU kernels cannot run here: an emulator does the math."""

from __future__ import annotations

import pytest
import torch

import _fa3_family_helpers as H
import _library_contracts as C
from _drive import check_versions, forward, unchecked
from attnplug import AttentionConfig, BuildContext, ForwardMode, LayerSpec
from packaging.version import Version as version_key
from attnplug_fa3 import SGL_KERNEL
from attnplug_fa3.backend import FA3Backend

import test_fa3

QUAL = "sgl_kernel.flash_attn.flash_attn_with_kvcache"
MIN_SGL_KERNEL = H.registry("attnplug-fa3").get("fa3").min_library_version  # the floor the plugin declares
SUPPORTED = [(lib, v) for lib in ("sgl-kernel", "sglang-kernel") for v in C.versions(lib)
             if version_key(v) >= version_key(MIN_SGL_KERNEL)]


def _run_at(p, **cfg):
    def run_at(library, version):
        rec = C.Recorder()
        host = H.cuda_host(90, **{library.replace("-", "_"): version})
        kv = "float8_e4m3fn" if p.cache.quantized else "bfloat16"
        ctx = BuildContext(config=AttentionConfig(**cfg), host=host, dtype="bfloat16", kv_cache_dtype=kv,
                           num_heads=p.layer.num_heads,
                           num_kv_heads=p.layer.num_kv_heads, head_dim=p.layer.head_dim, page_size=p.page_size,
                           kv_cache=p.cache, max_context_len=p.cache.max_context_len)
        backend = FA3Backend(ctx, kernel=rec.wrap(QUAL, unchecked(test_fa3.emulate_flash_attn_with_kvcache)),
                             provider=SGL_KERNEL)
        refusals = list(backend.layer_reasons(p.layer))  # the per-layer verdict a forward takes
        if not refusals:
            forward(backend, p)
        return refusals, rec.calls
    return run_at


CASES = {
    "extend": dict(mode=ForwardMode.EXTEND),
    "decode": dict(mode=ForwardMode.DECODE, ext=(1, 1, 1)),
    "verify_tree": dict(mode=ForwardMode.TARGET_VERIFY, ext=(3, 3, 3), custom_mask=True),
    "window_softcap": dict(mode=ForwardMode.EXTEND, window=4, cap=5.0),
    "mqa": dict(mode=ForwardMode.DECODE, ext=(1, 1, 1), num_kv_heads=1),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_calls_bind_to_every_supported_sgl_kernel(case):
    p = H.make_problem(dtype=torch.bfloat16, head_dim=64, page_size=16, **CASES[case])
    verdicts = check_versions(SUPPORTED, _run_at(p, deterministic=case == "decode"))
    assert not any(verdicts.values()), verdicts  # layers without sinks run on every version >= the floor


@pytest.mark.parametrize("mode", ["extend", "decode"])
def test_sink_layers_bind_where_accepted_and_are_refused_below_0_3_4_post1(mode):
    """Bugs 1 and 2: sinks reach the kernel as bfloat16, and only versions with ``sinks=`` accept them."""
    kw = CASES[mode]
    p = H.make_problem(dtype=torch.bfloat16, head_dim=64, page_size=16, sinks=True, **kw)
    verdicts = check_versions(SUPPORTED, _run_at(p))
    assert verdicts["sgl-kernel 0.3.0"] and verdicts["sgl-kernel 0.3.4"], verdicts
    assert not verdicts["sgl-kernel 0.3.4.post1"] and not verdicts["sglang-kernel 0.4.10"], verdicts
    assert "0.3.4.post1" in verdicts["sgl-kernel 0.3.0"][0]


def test_the_sinks_floor_is_the_first_release_with_sinks():
    assert C.signature("sgl-kernel", "0.3.4", QUAL).parameters.get("sinks") is None
    assert "sinks" in C.signature("sgl-kernel", "0.3.4.post1", QUAL).parameters


def test_fp8_kv_head_dims_must_be_multiples_of_16():
    ctx = BuildContext(config=AttentionConfig(), host=H.cuda_host(90, sgl_kernel="0.3.21"), dtype="bfloat16",
                       kv_cache_dtype="float8_e4m3fn", num_heads=4, num_kv_heads=2, head_dim=72)
    backend = FA3Backend(ctx, kernel=lambda **kw: None, provider=SGL_KERNEL)
    assert any("multiples of 16" in r for r in backend.not_supported_reasons(LayerSpec(0, 4, 2, 72), ctx))
    assert not any("multiples of 16" in r for r in backend.not_supported_reasons(LayerSpec(0, 4, 2, 80), ctx))
    bf16 = ctx.replace(kv_cache_dtype="bfloat16")
    assert not any("multiples of 16" in r for r in backend.not_supported_reasons(LayerSpec(0, 4, 2, 72), bf16))


def test_a_float32_sink_fails_the_emulator_as_it_fails_sgl_kernel():
    """The emulator asserts the library's precondition: a wrong sinks dtype fails on CPU too."""
    p = H.make_problem(dtype=torch.bfloat16, head_dim=64, page_size=16, mode=ForwardMode.DECODE, ext=(1, 1, 1))
    q = p.q
    kc = p.cache.get_kv(0)[0].view(-1, 16, 2, 64)
    args = dict(cache_seqlens=torch.ones(3, dtype=torch.int32), page_table=torch.zeros(3, 1, dtype=torch.int32),
                cu_seqlens_q=torch.arange(4, dtype=torch.int32), max_seqlen_q=1, softmax_scale=0.1, causal=True)
    with pytest.raises(AssertionError, match="sinks must have dtype bfloat16"):
        test_fa3.emulate_flash_attn_with_kvcache(q, kc, kc, sinks=torch.zeros(4), **args)


FP8_SCALES = (0.04, 2.5)


@pytest.mark.parametrize("case", ["extend", "decode", "verify_tree", "mqa"])
def test_fp8_kv_calls_bind_with_descales_on_every_supported_sgl_kernel(case):
    """fp8 KV (mocked: no GPU): e4m3 q and cache, float32 ``[batch, kv_heads]`` descales holding the cache's
    scales, bound to every supported release's signature and checked against FA3's shape rule."""
    p = H.make_problem(dtype=torch.bfloat16, head_dim=64, page_size=16, kv_dtype=torch.float8_e4m3fn,
                       kv_scales=FP8_SCALES, **CASES[case])
    seen = []

    def run_at(library, version):
        refusals, calls = _run_at(p, kv_cache_dtype="fp8_e4m3")(library, version)
        seen.extend(calls)
        return refusals, calls

    verdicts = check_versions(SUPPORTED, run_at)
    assert not any(verdicts.values()), verdicts
    for call in seen:
        a = call.arguments(C.signature("sgl-kernel", "0.3.21", QUAL))
        assert a["q"].dtype == torch.float8_e4m3fn
        assert float(a["k_descale"].max()) == float(a["k_descale"].min()) == pytest.approx(FP8_SCALES[0])
        assert float(a["v_descale"].max()) == float(a["v_descale"].min()) == pytest.approx(FP8_SCALES[1])
        assert float(a["q_descale"].max()) == 1.0 and a["softmax_scale"] == p.layer.scaling


def test_a_descale_of_the_wrong_shape_fails_the_precondition():
    """The shape rule itself can fail: one value per request instead of ``[batch, kv_heads]``."""
    kc = torch.zeros(4, 16, 2, 64, dtype=torch.float8_e4m3fn)
    call = C.Call(QUAL, (torch.zeros(3, 4, 64, dtype=torch.float8_e4m3fn), kc, kc),
                  dict(cache_seqlens=torch.ones(3, dtype=torch.int32), page_table=torch.zeros(3, 1, dtype=torch.int32),
                       cu_seqlens_q=torch.arange(4, dtype=torch.int32), max_seqlen_q=1, softmax_scale=0.1,
                       causal=True, k_descale=torch.ones(3), v_descale=torch.ones(3, 2, dtype=torch.float64)))
    found = C.problems(call, "sgl-kernel", "0.3.21")
    assert any("k_descale must have shape (batch_size, num_heads_k) = (3, 2)" in f for f in found), found
    assert any("v_descale must be a float32 tensor" in f for f in found), found


# -- issue 27: sinks only on SM90 --------------------------------------------------------------------
def _fa3_on(sm, p):
    host = H.cuda_host(sm, sgl_kernel="0.3.21")
    ctx = H.context(p, host, dtype="bfloat16")
    return FA3Backend(ctx, kernel=unchecked(test_fa3.emulate_flash_attn_with_kvcache), provider=SGL_KERNEL)


@pytest.mark.parametrize("sm, served", [(80, False), (86, False), (87, False), (89, False), (90, True)])
@pytest.mark.parametrize("mode", ["extend", "decode"])
def test_sink_layers_are_refused_off_sm90(sm, served, mode):
    """Bug 5: sgl-kernel's FA3 applies ``sinks=`` in its SM90 kernel only; on SM80/86/89 the output silently
    omits them. Off SM90 a sink layer is refused in words (a forward raises); plain layers still run."""
    from attnplug.errors import NotSupportedError

    kw = {"mode": ForwardMode.DECODE, "ext": (1, 1, 1)} if mode == "decode" else {}
    p = H.make_problem(dtype=torch.bfloat16, head_dim=64, page_size=16, sinks=True, **kw)
    be = _fa3_on(sm, p)
    reasons = be.layer_reasons(p.layer)  # the per-layer verdict a forward takes
    assert (not reasons) is served, reasons
    plain = LayerSpec(0, p.layer.num_heads, p.layer.num_kv_heads, p.layer.head_dim)
    assert not be.layer_reasons(plain)
    if served:
        H.assert_close(forward(be, p), p.expected, torch.bfloat16)
        return
    assert any(f"SM{sm}" in r and "sinks" in r for r in reasons), reasons
    with pytest.raises(NotSupportedError, match="sinks"):
        forward(be, p)


@pytest.mark.parametrize("sm, want", [(80, "triton"), (86, "triton"), (89, "triton"), (90, "fa3")])
def test_resolution_moves_sink_models_off_fa3_below_sm90(sm, want):
    """Bug 5 (resolution): the declared ``sinks_sms`` lets resolution, given the model's layers, pick a
    backend that applies the sinks on this GPU; without sink layers fa3 keeps its place."""
    from attnplug import Registry
    from attnplug.resolution import trace

    host = H.cuda_host(sm, sgl_kernel="0.3.21", triton="3.5.0")
    reg = Registry.discover(env={"ATTNPLUG_PLUGINS": "attnplug-fa3,attnplug-triton,attnplug-torch-native"},
                            host=host)
    sinks = LayerSpec(0, 8, 2, 64, sinks=torch.zeros(8))
    res = trace(AttentionConfig(dtype="bfloat16"), host=host, registry=reg, layers=(sinks,))
    assert res.ok and res.pair == (want, want), res.explain() if hasattr(res, "explain") else res
    plain = trace(AttentionConfig(dtype="bfloat16"), host=host, registry=reg, layers=(LayerSpec(0, 8, 2, 64),))
    assert plain.pair[0] in ("fa3", "triton")
    if sm in (80, 90):  # fa3 is a default there (priority 30 / 60, above triton's 20)
        assert plain.pair == ("fa3", "fa3")
