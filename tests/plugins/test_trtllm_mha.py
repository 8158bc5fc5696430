"""attnplug-trtllm-mha on a CPU host: descriptor, availability, page-size rule, metadata, and kernel emulators.

The trtllm-gen kernels need a Blackwell GPU (SM100/SM103), so here the
metadata is checked against expectations built independently in this file
and by two EMULATORS of the GPU kernels written from flashinfer's documented
contract of ``trtllm_batch_decode_with_kv_cache`` and
``trtllm_batch_context_with_kv_cache``: a ``(k_cache, v_cache)`` pair laid out
``HND`` (``[pages, kv_heads, page_size, dim]``) read through ``block_tables``
up to ``seq_lens``; decode has one query per request; the context kernel
takes ``cum_seq_lens_q``/``cum_seq_lens_kv`` and masks causally, aligned
bottom-right; ``window_left``, ``bmm1_scale`` (the softmax scale),
``bmm2_scale`` and ``sinks``. The real backend class runs with the emulators
in place of flashinfer and must match ``attnplug.testing.reference``: this
proves the metadata and the call's arguments, not the kernels.
"""

from __future__ import annotations

import math

import pytest
import torch

import attnplug_trtllm_mha
import _fa3_family_helpers as H
from _problems import attend64
import _library_contracts as C
from attnplug import AttentionConfig, ForwardMode
from attnplug.errors import BackendUnavailableError, ConfigError, NotSupportedError
from attnplug.resolution import resolve
from attnplug_trtllm_mha import metadata as M
from attnplug_trtllm_mha.backend import TrtllmMHABackend, load_kernels

DIST = "attnplug-trtllm-mha"
FI = {"flashinfer_python": "0.6.3"}


def _problem(**kw):
    """The family's problem at a head dim trtllm_mha claims (64/128/256; the base refuses others)."""
    return H.make_problem(**{"head_dim": 64, **kw})


# -- (4) the emulators ---------------------------------------------------------------
def _read_hnd(kv_cache, block_tables, b, sk):
    k_cache, v_cache = kv_cache
    assert k_cache.dim() == 4 and k_cache.shape[:3] == v_cache.shape[:3]
    ps = k_cache.shape[2]  # HND: [pages, kv_heads, page_size, dim]
    assert math.ceil(sk / ps) <= block_tables.shape[1], "block_tables too narrow"
    j = torch.arange(sk)
    pages = block_tables[b, j // ps].long()
    return k_cache[pages, :, j % ps], v_cache[pages, :, j % ps]  # [sk, kv_heads, dim]



@C.emulates("flashinfer.decode.trtllm_batch_decode_with_kv_cache", "flashinfer-python", "0.6.0")
def emulate_decode(*, query, kv_cache, workspace_buffer, block_tables, seq_lens, max_seq_len, bmm1_scale=1.0,
                   bmm2_scale=1.0, window_left=-1, out_dtype=None, sinks=None, **unexpected):
    """EMULATOR of ``flashinfer.decode.trtllm_batch_decode_with_kv_cache`` (GPU-only), float64: query row ``b``
    attends to the ``seq_lens[b]`` keys of request ``b`` read through ``block_tables`` from the HND pages."""
    assert not unexpected, f"unexpected kernel arguments {sorted(unexpected)}"
    assert block_tables.dtype == torch.int32 and seq_lens.dtype == torch.int32
    assert workspace_buffer.dtype == torch.uint8 and int(workspace_buffer.abs().sum()) == 0
    B = seq_lens.numel()
    assert query.shape[0] == B and block_tables.shape[0] == B and int(seq_lens.max()) <= max_seq_len
    out = torch.zeros(B, query.shape[1], kv_cache[1].shape[-1], dtype=torch.float64)
    for b in range(B):
        K, V = _read_hnd(kv_cache, block_tables, b, int(seq_lens[b]))
        out[b:b + 1] = attend64(query[b:b + 1], K, V, scale=bmm1_scale, causal=True, left=window_left,
                                  sinks=sinks) * bmm2_scale
    return out.to(out_dtype or query.dtype)


@C.emulates("flashinfer.prefill.trtllm_batch_context_with_kv_cache", "flashinfer-python", "0.6.0")
def emulate_context(*, query, kv_cache, workspace_buffer, block_tables, seq_lens, max_q_len, max_kv_len, bmm1_scale,
                    bmm2_scale, batch_size, cum_seq_lens_q, cum_seq_lens_kv, window_left=-1, out_dtype=None,
                    sinks=None, **unexpected):
    """EMULATOR of ``flashinfer.prefill.trtllm_batch_context_with_kv_cache`` (GPU-only), float64: request ``b``'s
    queries are rows ``cum_seq_lens_q[b] …``; its keys the ``seq_lens[b]`` tokens of its pages; causal bottom-right."""
    assert not unexpected, f"unexpected kernel arguments {sorted(unexpected)}"
    assert cum_seq_lens_q.dtype == torch.int32 and cum_seq_lens_kv.dtype == torch.int32
    assert batch_size == seq_lens.numel() == cum_seq_lens_q.numel() - 1
    assert cum_seq_lens_kv[1:].sub(cum_seq_lens_kv[:-1]).tolist() == seq_lens.tolist()
    assert int(cum_seq_lens_q[-1]) == query.shape[0]
    out = torch.zeros(query.shape[0], query.shape[1], kv_cache[1].shape[-1], dtype=torch.float64)
    for b in range(batch_size):
        q0, q1 = int(cum_seq_lens_q[b]), int(cum_seq_lens_q[b + 1])
        sk = int(seq_lens[b])
        assert q1 - q0 <= max_q_len and sk <= max_kv_len
        K, V = _read_hnd(kv_cache, block_tables, b, sk)
        out[q0:q1] = attend64(query[q0:q1], K, V, scale=bmm1_scale, causal=True, left=window_left,
                                sinks=sinks) * bmm2_scale
    return out.to(out_dtype or query.dtype)


def build(p, host=None):
    ctx = H.context(p, host or H.cuda_host(100, **FI))
    return TrtllmMHABackend(ctx, kernels=(emulate_decode, emulate_context), workspace_bytes=1024)


def run(p, save=True, backend=None):
    backend = backend or build(p)
    return H.forward(backend, p, save)


# -- (1) registration and availability ------------------------------------------------
def test_registers_through_entry_point_and_is_unavailable_without_flashinfer():
    reg = H.registry(DIST)
    desc = reg.get("trtllm_mha")
    assert desc.distribution == DIST and desc.library == "flashinfer-python" and desc.min_library_version == "0.6.0"
    # a CPU host without flashinfer (the contract tier installs flashinfer-python here, so the host is built)
    avail = reg.availability("trtllm_mha", H.cpu_host(False))
    assert not avail and any("flashinfer-python" in r and "not installed" in r for r in avail.reasons)


@pytest.mark.parametrize("host, ok", [
    (H.cuda_host(100, **FI), True),
    (H.cuda_host(103, **FI), True),
    (H.cuda_host(90, **FI), False),
    (H.cuda_host(120, **FI), False),
    (H.cuda_host(100), False),
    (H.cuda_host(100, flashinfer="0.6.3"), False),  # the old distribution name is not flashinfer-python
    (H.rocm_host(**FI), False),
    (H.cpu_host(True, **FI), False),
])
def test_available_exactly_on_the_right_hardware(host, ok):
    avail = H.registry(DIST).availability("trtllm_mha", host)
    assert bool(avail) is ok, avail.reasons


def test_library_floor():
    desc = H.registry(DIST).get("trtllm_mha")
    assert "found 0.5.2" in desc.library_floor_problem(H.cuda_host(100, flashinfer_python="0.5.2"))


def test_descriptor_imports_neither_torch_nor_flashinfer():
    mods = H.imports_after("attnplug_trtllm_mha")
    assert not mods & {"torch", "flashinfer"}, mods


def test_loading_the_kernels_without_flashinfer_fails_in_words(monkeypatch):
    """Mocked: flashinfer made unimportable (the contract tier installs the real package in CI)."""
    import sys

    for name in ("flashinfer", "flashinfer.decode", "flashinfer.prefill"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(BackendUnavailableError, match="flashinfer"):
        load_kernels()


# -- (3) metadata ------------------------------------------------------------------------
@pytest.mark.parametrize("ps", [1, 16])
def test_metadata_layout(ps):
    p = _problem(prefix=(0, 21, 17, 5), ext=(7, 3, 1, 30), page_size=ps)
    meta = M.build_metadata(p.batch, p.cache)
    assert meta.seq_lens.tolist() == p.seq and meta.seq_lens.dtype == torch.int32
    assert meta.cum_seq_lens_q.tolist() == [0, 7, 10, 11, 41]
    assert meta.cum_seq_lens_kv.tolist() == [0, 7, 31, 49, 84]
    assert (meta.max_q_len, meta.max_kv_len, meta.batch_size) == (30, 35, 4)
    width = math.ceil(35 / ps)
    for b, (r, s) in enumerate(zip(p.rows, p.seq)):
        want = H.pages_of(p.cache, r, s)
        assert meta.block_tables[b].tolist() == want + [0] * (width - len(want))


def test_hnd_view_is_a_view_of_the_slots():
    p = _problem(prefix=(0,), ext=(3,), page_size=16)
    kb, _ = p.cache.get_kv(0)
    view = M.hnd_view(kb, 16)
    assert view.data_ptr() == kb.data_ptr() and tuple(view.shape) == (kb.shape[0] // 16, kb.shape[1], 16, kb.shape[2])
    assert torch.equal(view[3, 1, 5], kb[3 * 16 + 5, 1])


# -- (4) backend + emulators vs the float64 reference ---------------------------------------------
@pytest.mark.parametrize("ps", [16, 32, 64])
@pytest.mark.parametrize("features", [{}, {"window": 6}, {"sinks": True}])
def test_extend_with_prefix(ps, features):
    p = _problem(prefix=(0, 21, 70, 5), ext=(7, 3, 1, 30), page_size=ps, **features)
    H.assert_close(run(p), p.expected)


@pytest.mark.parametrize("ps", [16, 64])
def test_decode(ps):
    p = _problem(mode=ForwardMode.DECODE, prefix=(15, 16, 40, 0), ext=(1, 1, 1, 1), page_size=ps,
                       window=5, sinks=True)
    H.assert_close(run(p), p.expected)


def test_draft_extend_and_mixed():
    # target-verify is not claimed (speculative_verify=False), so the base refuses it even without a
    # custom mask: see test_unclaimed_features_are_refused
    for mode in (ForwardMode.DRAFT_EXTEND, ForwardMode.MIXED):
        p = _problem(mode=mode, prefix=(9, 33), ext=(3, 3), page_size=16)
        H.assert_close(run(p), p.expected)


def test_bfloat16_gqa():
    p = _problem(prefix=(3, 40), ext=(4, 9), page_size=32, dtype=torch.bfloat16, num_heads=8, num_kv_heads=2)
    H.assert_close(run(p), p.expected, torch.bfloat16)


@pytest.mark.parametrize("save", [True, False])
def test_kv_cache_write(save):
    p = _problem(prefix=(3, 12), ext=(4, 9), page_size=16)
    H.assert_close(run(p, save=save), p.expected)
    H.assert_written_at_loc_only(p, save)


def test_cuda_graph_buffers_feed_the_kernel():
    p = _problem(mode=ForwardMode.DECODE, prefix=(15, 40), ext=(1, 1), page_size=16)
    b = build(p)
    b.init_cuda_graph_state(8, 8)
    b.init_forward_metadata_capture_cuda_graph(p.batch)
    assert b._guard.require(p.batch).block_tables.data_ptr() == b._graph["block_tables"].data_ptr()
    H.assert_close(b.forward_decode(p.q, p.k, p.v, p.layer, p.batch), p.expected)


# -- (5) overrides and the page-size rule ----------------------------------------------------
@pytest.mark.parametrize("sm, want", [(100, ("trtllm_mha", "trtllm_mha")), (103, ("trtllm_mha", "trtllm_mha"))])
def test_gpt_oss_override_on_blackwell(sm, want):
    host = H.cuda_host(sm, **FI)
    res = resolve(AttentionConfig(), arch="GptOssForCausalLM", host=host, registry=H.registry(DIST, host))
    assert res.pair == want and res.config.page_size == 64


@pytest.mark.parametrize("host", [H.cuda_host(90, **FI), H.cpu_host(True, **FI), H.rocm_host(**FI)])
def test_gpt_oss_override_elsewhere_does_not_pick_trtllm(host):
    assert attnplug_trtllm_mha.gpt_oss_on_blackwell(host, AttentionConfig()) == {}
    res = resolve(AttentionConfig(), arch="GptOssForCausalLM", host=host, registry=H.registry(DIST, host))
    assert "trtllm_mha" not in res.pair


def test_page_size_rule_keeps_a_supported_user_page_size_and_refuses_others():
    host = H.cuda_host(100, **FI)
    reg = H.registry(DIST, host)
    res = resolve(AttentionConfig(attention_backend="trtllm_mha", page_size=32), host=host, registry=reg)
    assert res.config.page_size == 32
    with pytest.raises(ConfigError, match=r"page_size=8"):
        resolve(AttentionConfig(attention_backend="trtllm_mha", page_size=8), host=host, registry=reg)
    res = resolve(AttentionConfig(attention_backend="trtllm_mha"), host=host, registry=reg)
    assert res.config.page_size == 64


# -- (6) guards ------------------------------------------------------------------------------
def test_page_size_guard_at_build():
    p = _problem(prefix=(0,), ext=(3,), page_size=1)
    with pytest.raises(NotSupportedError, match=r"page_size=1 \(supported: 16, 32, 64\)"):
        build(p)


def test_a_16_bit_cache_in_another_dtype_is_refused_by_the_declared_capability():
    """trtllm-gen takes the query and a 16-bit cache in one dtype (``kv_cache_dtype_follows_model``)."""
    p = _problem(prefix=(0,), ext=(3,), page_size=16)
    H.check_kv_follows_model(DIST, "trtllm_mha", H.cuda_host(100, **FI), build(p))


def test_unclaimed_features_are_refused():
    from attnplug import LayerSpec

    p = _problem(prefix=(0, 4), ext=(3, 2), page_size=16, cap=2.0)
    b = build(p)
    assert any("logit_cap" in r for r in b.not_supported_reasons(p.layer))
    assert any("head_dim=96" in r for r in b.not_supported_reasons(LayerSpec(0, 4, 2, 96)))
    b.init_forward_metadata(p.batch)
    with pytest.raises(NotSupportedError, match="logit_cap"):
        b.forward_extend(p.q, p.k, p.v, p.layer, p.batch)
    for custom_mask in (True, False):
        t = _problem(mode=ForwardMode.TARGET_VERIFY, prefix=(5,), ext=(2,), custom_mask=custom_mask)
        b = build(t)
        with pytest.raises(NotSupportedError, match="target_verify is not claimed"):  # the base, per forward
            b.init_forward_metadata(t.batch)


# -- (7) fp8 KV: the cache's scales folded into the bmm scales (mocked: no GPU) -----------------------
FP8_SCALES = (0.04, 2.5)  # (k_scale, v_scale)


def _fp8_build(p, kernels, host=None):
    ctx = H.context(p, host or H.cuda_host(100, **FI), dtype="bfloat16", kv_cache_dtype="float8_e4m3fn")
    return TrtllmMHABackend(ctx, kernels=kernels, workspace_bytes=1024)


@pytest.mark.parametrize("case", [
    dict(mode=ForwardMode.DECODE, ext=(1, 1, 1)),
    dict(mode=ForwardMode.EXTEND, window=5),
    dict(mode=ForwardMode.EXTEND, sinks=True, num_kv_heads=1),
], ids=["decode", "extend_window", "extend_sinks_mqa"])
def test_fp8_kv_folds_the_scales_into_bmm1_and_bmm2_mocked_no_gpu(case):
    """Mocked kernels (no GPU): with an fp8 cache of scales (0.04, 2.5), bmm1_scale = 1 (q) x 0.04 x
    softmax scale and bmm2_scale = 2.5 (flashinfer's trtllm-gen fused form), the query is e4m3, and the
    emulated kernels applying them match the float64 reference."""
    p = _problem(dtype=torch.bfloat16, kv_dtype=torch.float8_e4m3fn, kv_scales=FP8_SCALES, **case)
    calls = []

    def rec(fn):
        return lambda **kw: calls.append(kw) or fn(**kw)

    out = run(p, backend=_fp8_build(p, (rec(emulate_decode), rec(emulate_context))))
    assert calls
    for kw in calls:
        assert kw["bmm1_scale"] == pytest.approx(FP8_SCALES[0] * p.layer.scaling, rel=1e-12)
        assert kw["bmm2_scale"] == FP8_SCALES[1]
        assert kw["query"].dtype == torch.float8_e4m3fn and kw["out_dtype"] == torch.bfloat16
    H.assert_close(out, p.expected, torch.bfloat16)


def test_fp8_kv_with_bmm2_left_at_one_misses_the_reference_mocked_no_gpu():
    """The check above can fail: a V scale dropped from bmm2 (SGLang's bmm2_scale=1.0) is caught."""
    p = _problem(mode=ForwardMode.DECODE, ext=(1, 1, 1), dtype=torch.bfloat16, kv_dtype=torch.float8_e4m3fn,
                 kv_scales=FP8_SCALES)
    out = run(p, backend=_fp8_build(p, (lambda **kw: emulate_decode(**{**kw, "bmm2_scale": 1.0}), emulate_context)))
    with pytest.raises(AssertionError):
        H.assert_close(out, p.expected, torch.bfloat16)


def test_bmm_scales_of_a_16_bit_cache_are_the_softmax_scale_and_one():
    from attnplug_trtllm_mha.backend import bmm_scales

    assert bmm_scales(0.125, 1.0, 1.0) == (0.125, 1.0)
    assert bmm_scales(0.125, 0.04, 2.5) == (pytest.approx(0.005), 2.5)
    assert bmm_scales(0.125, 0.04, 2.5, q_scale=2.0) == (pytest.approx(0.01), 2.5)
    p = _problem(mode=ForwardMode.DECODE, ext=(1, 1, 1))
    calls = []
    run(p, backend=TrtllmMHABackend(build(p).ctx, kernels=(lambda **kw: calls.append(kw) or emulate_decode(**kw),
                                                           emulate_context), workspace_bytes=1024))
    assert calls[0]["bmm1_scale"] == p.layer.scaling and calls[0]["bmm2_scale"] == 1.0
    assert calls[0]["query"].dtype == p.q.dtype


@pytest.mark.parametrize("sm, kv, refused", [
    (90, "fp8_e4m3", True), (120, "float8_e4m3fn", True), (100, "fp8_e4m3", False), (103, "fp8_e4m3", False),
    (90, "auto", False),
])
def test_check_config_refuses_fp8_kv_off_the_sm100_family(sm, kv, refused):
    from attnplug_trtllm_mha import attnplug_check_config

    cfg = AttentionConfig(attention_backend="trtllm_mha", dtype="bfloat16", kv_cache_dtype=kv)
    problems = attnplug_check_config(config=cfg, host=H.cuda_host(sm, **FI))
    assert bool(problems) is refused, problems
    if refused:
        assert f"SM{sm}" in problems[0] and "SM100/103" in problems[0]
    other = cfg.replace(attention_backend="torch_native")
    assert attnplug_check_config(config=other, host=H.cuda_host(sm, **FI)) is None
