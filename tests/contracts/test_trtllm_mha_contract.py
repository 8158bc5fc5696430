"""trtllm_mha against flashinfer's real ``trtllm_batch_{decode,context}_with_kv_cache`` (0.6.0 … 0.7.4
recorded; the installed package too) and trtllm-gen's preconditions: int32 tables, float32 sinks, 16/32/64
pages, and canonical (non-degenerate) KV strides with one KV head."""

from __future__ import annotations

import inspect

import pytest
import torch

import _fa3_family_helpers as H
import _library_contracts as C
from _drive import check_versions, forward, unchecked
from attnplug import ForwardMode
from packaging.version import Version as version_key
from attnplug_trtllm_mha import LIBRARY, MIN_VERSION
from attnplug_trtllm_mha.backend import TrtllmMHABackend
from attnplug_trtllm_mha.metadata import hnd_view

import test_trtllm_mha as T

DECODE = "flashinfer.decode.trtllm_batch_decode_with_kv_cache"
CONTEXT = "flashinfer.prefill.trtllm_batch_context_with_kv_cache"
#: fp8 cases' cache scales (k_scale, v_scale)
FP8_SCALES = (0.04, 2.5)
SUPPORTED = [(LIBRARY, v) for v in C.versions(LIBRARY) if version_key(v) >= version_key(MIN_VERSION)]


def _calls(p):
    rec = C.Recorder()
    ctx = H.context(p, H.cuda_host(100, flashinfer_python=MIN_VERSION), dtype="bfloat16",
                    kv_cache_dtype="float8_e4m3fn" if p.cache.quantized else "bfloat16")
    kernels = (rec.wrap(DECODE, unchecked(T.emulate_decode)), rec.wrap(CONTEXT, unchecked(T.emulate_context)))
    forward(TrtllmMHABackend(ctx, kernels=kernels, workspace_bytes=1024), p)
    return rec.calls


CASES = {
    "decode": dict(mode=ForwardMode.DECODE, ext=(1, 1, 1)),
    "extend": dict(mode=ForwardMode.EXTEND),
    "mqa_decode": dict(mode=ForwardMode.DECODE, ext=(1, 1, 1), num_kv_heads=1),
    "mqa_extend": dict(mode=ForwardMode.EXTEND, num_kv_heads=1),
    "sinks_window": dict(mode=ForwardMode.EXTEND, sinks=True, window=5),
}


@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("case", sorted(CASES))
def test_calls_bind_to_every_supported_flashinfer(case, page_size):
    """Bug 6: a one-KV-head cache must reach trtllm-gen with canonical strides."""
    p = H.make_problem(dtype=torch.bfloat16, head_dim=64, page_size=page_size, **CASES[case])
    calls = _calls(p)
    check_versions(SUPPORTED, lambda lib, v: ([], calls))


def test_calls_bind_to_the_installed_flashinfer():
    try:
        import flashinfer.decode
        import flashinfer.prefill
    except ImportError:
        pytest.skip("flashinfer-python is not installed in this environment")
    import importlib.metadata as im

    real = {DECODE: inspect.signature(flashinfer.decode.trtllm_batch_decode_with_kv_cache),
            CONTEXT: inspect.signature(flashinfer.prefill.trtllm_batch_context_with_kv_cache)}
    version = im.distribution(LIBRARY).version
    calls = [c for case in ("decode", "mqa_extend", "sinks_window")
             for c in _calls(H.make_problem(dtype=torch.bfloat16, head_dim=64, page_size=16, **CASES[case]))]
    calls += _calls(H.make_problem(dtype=torch.bfloat16, head_dim=64, page_size=16, kv_dtype=torch.float8_e4m3fn,
                                   kv_scales=FP8_SCALES, **CASES["extend"]))
    found = [p for c in calls for p in C.problems(c, LIBRARY, version, sig=real[c.qualname])]
    assert not found, "\n".join(dict.fromkeys(found))


def test_one_kv_head_view_has_canonical_strides_over_the_same_memory():
    buf = torch.arange(4 * 16 * 1 * 8, dtype=torch.float32).view(64, 1, 8)
    view = hnd_view(buf, 16)
    assert view.shape == (4, 1, 16, 8) and view.stride() == (128, 128, 8, 1)
    assert torch.equal(view, buf.view(4, 16, 1, 8).permute(0, 2, 1, 3))
    two = hnd_view(torch.zeros(64, 2, 8), 16)
    assert two.stride() == (256, 8, 16, 1)  # several heads: the permuted NHD strides are already distinct



@pytest.mark.parametrize("case", ["decode", "extend", "mqa_decode", "sinks_window"])
def test_fp8_kv_calls_bind_with_the_fused_scales(case):
    """fp8 KV (mocked: no GPU): e4m3 query and cache, bmm1_scale = 0.04 x softmax scale and bmm2_scale = 2.5
    as floats, bound to every supported flashinfer's signature and its scale-type rule."""
    p = H.make_problem(dtype=torch.bfloat16, head_dim=64, page_size=16, kv_dtype=torch.float8_e4m3fn,
                       kv_scales=FP8_SCALES, **CASES[case])
    calls = _calls(p)
    check_versions(SUPPORTED, lambda lib, v: ([], calls))
    for c in calls:
        a = c.arguments(C.signature(LIBRARY, "0.7.4", c.qualname))
        assert a["query"].dtype == torch.float8_e4m3fn and a["kv_cache"][0].dtype == torch.float8_e4m3fn
        assert a["bmm1_scale"] == pytest.approx(FP8_SCALES[0] * p.layer.scaling, rel=1e-12)
        assert a["bmm2_scale"] == FP8_SCALES[1]


def test_a_float64_bmm_scale_tensor_fails_the_precondition():
    """The scale rule itself can fail ("bmm1_scale tensor must have dtype torch.float32")."""
    p = H.make_problem(dtype=torch.bfloat16, head_dim=64, page_size=16, **CASES["decode"])
    call = _calls(p)[0]
    call.kwargs["bmm1_scale"] = torch.tensor(0.1, dtype=torch.float64)
    found = C.problems(call, LIBRARY, "0.7.4")
    assert any("bmm1_scale tensor must have dtype torch.float32" in f for f in found), found


# -- issue 27: KV scales changed after capture --------------------------------------------------------
@pytest.mark.parametrize("change", ["k", "v", "both", "none"])
@pytest.mark.parametrize("mode", ["decode", "extend"])
def test_kv_scales_changed_after_capture_are_refused(mode, change):
    """Bug 8b: ``bmm1_scale``/``bmm2_scale`` are floats computed from the cache's scales, constants of the
    captured launches; a replay after ``set_kv_scales`` silently dequantized with the old ones. Refused,
    naming the layer; unchanged scales replay."""
    from attnplug.errors import AttnplugError

    kw = dict(mode=ForwardMode.DECODE, ext=(1, 1, 1)) if mode == "decode" else dict(mode=ForwardMode.EXTEND)
    p = H.make_problem(dtype=torch.bfloat16, head_dim=64, page_size=16, kv_dtype=torch.float8_e4m3fn,
                       kv_scales=FP8_SCALES, **kw)
    ctx = H.context(p, H.cuda_host(100, flashinfer_python=MIN_VERSION), dtype="bfloat16",
                    kv_cache_dtype="float8_e4m3fn")
    be = TrtllmMHABackend(ctx, kernels=(unchecked(T.emulate_decode), unchecked(T.emulate_context)),
                          workspace_bytes=1024)
    be.init_cuda_graph_state(8, 64)
    be.init_forward_metadata_capture_cuda_graph(p.batch)
    k, v = FP8_SCALES
    p.cache.set_kv_scales(0, *{"k": (k * 2, v), "v": (k, v * 2), "both": (k / 2, v / 2), "none": (k, v)}[change])
    if change == "none":
        be.init_forward_metadata_replay_cuda_graph(p.batch)
        return
    with pytest.raises(AttnplugError, match=r"KV scales changed after .*layer 0"):
        be.init_forward_metadata_replay_cuda_graph(p.batch)
