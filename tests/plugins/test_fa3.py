"""attnplug-fa3 on a CPU host: descriptor, availability, metadata layout, and an emulator of the FA3 kernel.

The FA3 kernel (sgl-kernel / flash-attn-3) needs an SM80-SM90 GPU, so here
its metadata is checked twice: against expectations built independently in
this file, and by ``emulate_flash_attn_with_kvcache`` — an EMULATOR of the GPU
kernel written from FA3's documented contract (paged ``[pages, page_size,
kv_heads, dim]`` caches read through ``page_table`` up to ``cache_seqlens``,
varlen queries by ``cu_seqlens_q``, bottom-right-aligned causal mask,
``window_size=(left, right)``, ``softcap``, ``sinks``). The real backend class
runs with the emulator in place of the library function, and its output must
match ``attnplug.testing.reference``: this proves the metadata and the call's
arguments, not the kernel.
"""

from __future__ import annotations

import math

import pytest
import torch

from attnplug import AttentionConfig, BuildContext, ForwardMode
from attnplug.errors import BackendUnavailableError, NotSupportedError, ShapeError
from attnplug.resolution import resolve
from attnplug_fa3 import metadata as M
from attnplug_fa3.backend import FA3Backend, load_kernel

import _fa3_family_helpers as H
from _problems import attend64
import _library_contracts as C

DIST = "attnplug-fa3"
SGL = {"sgl_kernel": "0.3.16"}
UPSTREAM = {"flash_attn_3": "3.0.0b1"}


# -- (4) the emulator ------------------------------------------------------------
@C.emulates("sgl_kernel.flash_attn.flash_attn_with_kvcache", "sgl-kernel", "0.3.21")
def emulate_flash_attn_with_kvcache(q, k_cache, v_cache, *, cache_seqlens, page_table, cu_seqlens_q, max_seqlen_q,
                                    softmax_scale, causal, window_size=(-1, -1), softcap=0.0, sinks=None,
                                    num_splits=0, q_descale=None, k_descale=None, v_descale=None, **unexpected):
    """EMULATOR of FA3's ``flash_attn_with_kvcache`` (the GPU kernel cannot run here), in float64.

    Reads exactly what FA3 documents: request ``b``'s key ``j`` (``j <
    cache_seqlens[b]``) is ``k_cache[page_table[b, j // page_size], j %
    page_size]`` with ``page_size = k_cache.shape[1]``; its queries are rows
    ``cu_seqlens_q[b] … cu_seqlens_q[b+1]-1`` of ``q``. fp8: ``q_descale``/``k_descale``/``v_descale``
    (float32 ``[batch, kv_heads]``, default 1) dequantize request ``b``'s query, keys and values per
    KV head: the kernel folds ``q_descale * k_descale`` into the softmax scale and the soft-cap
    threshold (so the cap applies to the dequantized logits) and multiplies the output by ``v_descale``.
    """
    assert not unexpected, f"unexpected kernel arguments {sorted(unexpected)}"
    assert cache_seqlens.dtype == torch.int32 and page_table.dtype == torch.int32 and cu_seqlens_q.dtype == torch.int32
    assert k_cache.dim() == 4 and k_cache.shape[1:3] == v_cache.shape[1:3]
    ps = k_cache.shape[1]
    B = cache_seqlens.numel()
    assert cu_seqlens_q.numel() == B + 1 and page_table.shape[0] == B and int(cu_seqlens_q[-1]) == q.shape[0]
    H_ = q.shape[1]
    out = torch.zeros(q.shape[0], H_, v_cache.shape[-1], dtype=torch.float64)
    for b in range(B):
        sk = int(cache_seqlens[b])
        q0, q1 = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        assert q1 - q0 <= max_seqlen_q
        assert math.ceil(sk / ps) <= page_table.shape[1], "page_table too narrow"
        j = torch.arange(sk)
        pages = page_table[b, j // ps].long()
        K, V = k_cache[pages, j % ps].double(), v_cache[pages, j % ps].double()
        qb = q[q0:q1].double()
        if k_descale is not None:  # per KV head of request b (query head h reads KV head h // group)
            group = H_ // K.shape[1]
            qb = qb * q_descale[b].double().repeat_interleave(group)[None, :, None]
            K = K * k_descale[b].double()[None, :, None]
            V = V * v_descale[b].double()[None, :, None]
        left, right = window_size
        out[q0:q1] = attend64(qb, K, V, scale=softmax_scale, causal=causal, left=left, right=right,
                                softcap=softcap, sinks=sinks)
    # FA3's fp8 path writes bfloat16 (the backend converts to the model dtype)
    return out.to(torch.bfloat16 if q.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else q.dtype)


def build(p, *, deterministic=False, provider="sgl-kernel", host=None):
    ctx = H.context(p, host or H.cuda_host(90, **SGL), config=AttentionConfig(deterministic=deterministic))
    return FA3Backend(ctx, kernel=emulate_flash_attn_with_kvcache, provider=provider)


def run(p, backend=None, save=True):
    backend = backend or build(p)
    return H.forward(backend, p, save)


# -- (1) registration and availability -------------------------------------------
def test_registers_through_entry_point_and_is_unavailable_here():
    reg = H.registry(DIST)
    assert "fa3" in reg.names()
    desc = reg.get("fa3")
    assert desc.distribution == DIST and desc.library == "sgl-kernel" and desc.min_library_version == "0.3.0"
    assert reg.canonical("flash_attention_3") == "fa3"
    avail = reg.availability("fa3")
    assert not avail
    assert any("sgl-kernel" in r and "not installed" in r for r in avail.reasons), avail.reasons


@pytest.mark.parametrize("host, ok", [
    (H.cuda_host(90, **SGL), True),
    (H.cuda_host(80, **SGL), True),
    (H.cuda_host(86, **SGL), True),
    (H.cuda_host(89, **SGL), True),
    (H.cuda_host(90, **UPSTREAM), True),
    (H.cuda_host(80, **UPSTREAM), False),  # upstream FA3 is Hopper-only
    (H.cuda_host(100, **SGL), False),
    (H.cuda_host(120, **SGL), False),
    (H.cuda_host(75, **SGL), False),
    (H.cuda_host(90), False),  # no kernel library
    (H.rocm_host(**SGL), False),
    (H.cpu_host(True, **SGL), False),
])
def test_available_exactly_on_the_right_hardware(host, ok):
    avail = H.registry(DIST).availability("fa3", host)
    assert bool(avail) is ok, avail.reasons
    if not ok:
        assert avail.reasons and all(isinstance(r, str) and r for r in avail.reasons)


def test_priorities_follow_the_stand_in():
    desc = H.registry(DIST).get("fa3")
    assert desc.priority_on(H.cuda_host(90)) == 60
    assert desc.priority_on(H.cuda_host(80)) == 30
    assert desc.priority_on(H.cuda_host(89)) is None
    assert desc.priority_on(H.cpu_host(True)) is None


def test_library_floor():
    desc = H.registry(DIST).get("fa3")
    assert "needs sgl-kernel >= 0.3.0, found 0.2.9" in desc.library_floor_problem(H.cuda_host(90, sgl_kernel="0.2.9"))
    assert desc.library_floor_problem(H.cuda_host(90, **SGL)) is None


# -- (2) a light descriptor ---------------------------------------------------------
def test_descriptor_imports_neither_torch_nor_kernel_library():
    mods = H.imports_after("attnplug_fa3")
    assert not mods & {"torch", "sgl_kernel", "flash_attn_interface", "flash_attn_3"}, mods


def test_loading_the_kernel_here_fails_in_words():
    with pytest.raises(BackendUnavailableError, match=r"sgl_kernel.*flash_attn_interface"):
        load_kernel()


# -- (3) metadata layout -------------------------------------------------------------
@pytest.mark.parametrize("ps", [1, 16])
def test_extend_metadata_layout(ps):
    p = H.make_problem(prefix=(0, 21, 17, 5), ext=(7, 3, 1, 30), page_size=ps)
    meta = M.build_metadata(p.batch, p.cache)
    p.cache.check_page_aligned(p.batch.req_pool_indices, p.seq)
    assert meta.cache_seqlens.tolist() == p.seq and meta.cache_seqlens.dtype == torch.int32
    assert meta.cu_seqlens_q.tolist() == [0, 7, 10, 11, 41]
    assert meta.cu_seqlens_k.tolist() == [0, 7, 31, 49, 84]
    assert (meta.max_seqlen_q, meta.max_seqlen_k) == (30, 35)
    width = math.ceil(35 / ps)
    assert tuple(meta.page_table.shape) == (4, width) and meta.page_table.dtype == torch.int32
    for b, (r, s) in enumerate(zip(p.rows, p.seq)):
        want = H.pages_of(p.cache, r, s)
        assert meta.page_table[b].tolist() == want + [0] * (width - len(want))


def test_decode_metadata_layout_mid_page():
    p = H.make_problem(mode=ForwardMode.DECODE, prefix=(15, 16, 40), ext=(1, 1, 1), page_size=16)
    meta = M.build_metadata(p.batch, p.cache)
    assert meta.cu_seqlens_q.tolist() == [0, 1, 2, 3] and meta.max_seqlen_q == 1
    assert meta.cache_seqlens.tolist() == [16, 17, 41]
    assert meta.page_table[1].tolist() == H.pages_of(p.cache, p.rows[1], 17) + [0]


def test_tree_layout_lists_exactly_the_visible_slots():
    p = H.make_problem(mode=ForwardMode.TARGET_VERIFY, prefix=(5, 18), ext=(3, 3), page_size=4, custom_mask=True)
    meta = M.build_metadata(p.batch, p.cache)
    for window in (None, 4):
        t = meta.tree_for(window)
        assert t.cu_seqlens_q.tolist() == list(range(7)) and t.causal is False
        for i, (r, pre) in enumerate(zip(p.rows, p.prefix)):
            for a in range(3):
                pos = pre + a
                want = [int(p.cache.req_to_token[r, j]) for j in range(pos + 1)
                        if (window is None or j >= pos - window)
                        and (j < pre or bool(p.batch.spec_custom_mask[i, a, j - pre]))]
                row = i * 3 + a
                assert int(t.cache_seqlens[row]) == len(want)
                assert t.page_table[row, :len(want)].tolist() == want


def test_page_alignment_guard_names_the_position():
    p = H.make_problem(prefix=(0, 20), ext=(5, 3), page_size=16)
    r = p.rows[1]
    p.cache.req_to_token[r, 18] += 1
    with pytest.raises(ShapeError, match=rf"req_to_token\[{r}, 18\] .*not page-aligned"):
        p.cache.check_page_aligned(p.batch.req_pool_indices, p.seq)


def test_idle_has_no_metadata():
    from attnplug import ForwardBatch

    assert M.build_metadata(ForwardBatch.idle(), H.make_problem(prefix=(0,), ext=(1,)).cache) is None


# -- (4) the backend with the emulated kernel against the float64 reference ------------------
@pytest.mark.parametrize("ps", [1, 16])
@pytest.mark.parametrize("features", [{}, {"window": 6}, {"cap": 2.0, "sinks": True}])
def test_extend_with_prefix(ps, features):
    p = H.make_problem(prefix=(0, 21, 17, 5), ext=(7, 3, 1, 30), page_size=ps, **features)
    H.assert_close(run(p), p.expected)


@pytest.mark.parametrize("ps", [1, 16])
def test_decode(ps):
    p = H.make_problem(mode=ForwardMode.DECODE, prefix=(15, 16, 40, 0), ext=(1, 1, 1, 1), page_size=ps,
                       window=5, sinks=True)
    H.assert_close(run(p), p.expected)


@pytest.mark.parametrize("custom_mask", [False, True])
@pytest.mark.parametrize("window", [None, 3])
def test_target_verify(custom_mask, window):
    p = H.make_problem(mode=ForwardMode.TARGET_VERIFY, prefix=(5, 27, 16), ext=(4, 4, 4), page_size=16,
                       custom_mask=custom_mask, window=window)
    H.assert_close(run(p), p.expected)


def test_draft_extend_and_mixed():
    for mode in (ForwardMode.DRAFT_EXTEND, ForwardMode.MIXED):
        p = H.make_problem(mode=mode, prefix=(9, 0), ext=(2, 5), page_size=16)
        H.assert_close(run(p), p.expected)


def test_bfloat16_mqa():
    p = H.make_problem(prefix=(3, 12), ext=(4, 9), page_size=16, dtype=torch.bfloat16, num_heads=4, num_kv_heads=1)
    H.assert_close(run(p), p.expected, torch.bfloat16)


@pytest.mark.parametrize("save", [True, False])
def test_kv_cache_write(save):
    p = H.make_problem(prefix=(3, 12), ext=(4, 9), page_size=16)
    out = run(p, save=save)
    H.assert_close(out, p.expected)
    H.assert_written_at_loc_only(p, save)


def test_metadata_is_built_once_and_shared_by_layers():
    p = H.make_problem(prefix=(3, 12), ext=(4, 9), page_size=16)
    backend = build(p)
    backend.init_forward_metadata(p.batch)
    for _ in range(3):
        H.assert_close(backend.forward_extend(p.q, p.k, p.v, p.layer, p.batch, save_kv_cache=False), p.expected)
    assert backend.metadata_builds == 1


def test_cuda_graph_buffers_feed_the_kernel():
    p = H.make_problem(mode=ForwardMode.DECODE, prefix=(15, 40), ext=(1, 1), page_size=16)
    backend = build(p)
    backend.init_cuda_graph_state(8, 8)
    backend.init_forward_metadata_replay_cuda_graph(p.batch)
    meta = backend._guard.require(p.batch)
    assert meta.page_table.data_ptr() == backend._graph["page_table"].data_ptr()
    H.assert_close(backend.forward_decode(p.q, p.k, p.v, p.layer, p.batch), p.expected)


def test_deterministic_config_asks_for_one_split():
    p = H.make_problem(prefix=(0,), ext=(3,), page_size=16)
    assert build(p, deterministic=True).num_splits == 1 and build(p).num_splits == 0


# -- (5) gpt-oss overrides ---------------------------------------------------------------
def _override_declared(res):
    return [r.as_tuple() for r in res.records if r.as_tuple()[0] == "arch_overrides" and r.as_tuple()[1] == DIST]


@pytest.mark.parametrize("host, pair, declared", [
    (H.cuda_host(90, **SGL), ("fa3", "fa3"), True),
    (H.cuda_host(90, **UPSTREAM), ("fa3", "fa3"), True),
    (H.cuda_host(80, **SGL), ("fa3", "fa3"), False),  # fa3 by priority on SM80, not by the gpt-oss override
    (H.cuda_host(100, **SGL), ("torch_native", "torch_native"), False),
    (H.cuda_host(90), ("torch_native", "torch_native"), True),  # preferred, unavailable: compat fallback
    (H.cpu_host(True, **SGL), ("torch_native", "torch_native"), False),
])
def test_gpt_oss_override(host, pair, declared):
    res = resolve(AttentionConfig(), arch="GptOssForCausalLM", host=host, registry=H.registry(DIST, host))
    assert res.pair == pair
    assert bool(_override_declared(res)) is declared, res.records


# -- (6) guards ----------------------------------------------------------------------------
def test_not_supported_reasons():
    from attnplug import LayerSpec

    p = H.make_problem(prefix=(0,), ext=(3,), page_size=16)
    b = build(p, provider="flash-attn-3")
    sinks = LayerSpec(0, 4, 2, 64, sinks=torch.zeros(4))
    assert any("sgl-kernel" in r for r in b.not_supported_reasons(sinks))
    assert any("head_dim=260" in r for r in b.not_supported_reasons(LayerSpec(0, 4, 2, 260)))
    ctx = b.ctx.replace(dtype="bfloat16", kv_cache_dtype="float8_e4m3fn", kv_cache=None, host=H.cuda_host(80, **SGL))
    assert any("Hopper" in r for r in b.not_supported_reasons(LayerSpec(0, 4, 2, 64), ctx))


def test_a_16_bit_cache_in_another_dtype_is_refused_by_the_declared_capability():
    """FA3 takes q and a 16-bit cache in one dtype: declared (``kv_cache_dtype_follows_model``), so resolution
    moves away from fa3 on an H100 for a bf16 model over an fp16 cache, instead of failing at build."""
    p = H.make_problem(prefix=(0,), ext=(3,), page_size=16)
    H.check_kv_follows_model(DIST, "fa3", H.cuda_host(90, **SGL), build(p))


def test_forward_guards():
    p = H.make_problem(prefix=(0, 4), ext=(3, 2), page_size=16)
    b = build(p)
    b.init_forward_metadata(p.batch)
    with pytest.raises(ShapeError, match="q has shape"):
        b.forward_extend(p.q[:-1], p.k, p.v, p.layer, p.batch)
    with pytest.raises(ShapeError, match="k and v are None"):
        b.forward_extend(p.q, None, None, p.layer, p.batch)
    g = build(p)
    with pytest.raises(Exception, match="init_cuda_graph_state"):
        g.init_forward_metadata_capture_cuda_graph(p.batch)
    t = H.make_problem(mode=ForwardMode.TARGET_VERIFY, prefix=(5,), ext=(2,), custom_mask=True)
    g = build(t)
    g.init_cuda_graph_state(4, 8)
    with pytest.raises(NotSupportedError, match="custom draft mask"):
        g.init_forward_metadata_capture_cuda_graph(t.batch)


# -- (7) fp8 KV: the cache's scales reach FA3 as descale factors (mocked: no GPU) -------------------
FP8_SCALES = (0.04, 2.5)  # (k_scale, v_scale): neither 1, and different, so a swap or a drop shows


def _recorded_fp8_calls(p, provider="sgl-kernel"):
    calls = []

    def recording_kernel(**kw):
        calls.append(kw)
        return emulate_flash_attn_with_kvcache(**kw)

    ctx = BuildContext(config=AttentionConfig(), host=H.cuda_host(90, **SGL), dtype="bfloat16",
                       kv_cache_dtype="float8_e4m3fn", num_heads=p.layer.num_heads,
                       num_kv_heads=p.layer.num_kv_heads, head_dim=p.layer.head_dim, page_size=p.page_size,
                       kv_cache=p.cache, max_context_len=p.cache.max_context_len)
    out = run(p, FA3Backend(ctx, kernel=recording_kernel, provider=provider))
    return out, calls


@pytest.mark.parametrize("case", [
    dict(mode=ForwardMode.EXTEND),
    dict(mode=ForwardMode.DECODE, ext=(1, 1, 1)),
    dict(mode=ForwardMode.TARGET_VERIFY, ext=(3, 3, 3), custom_mask=True),  # tree rows: batch = draft tokens
    dict(mode=ForwardMode.EXTEND, window=5, cap=4.0),
], ids=["extend", "decode", "verify_tree", "window_softcap"])
def test_fp8_kv_passes_the_cache_scales_as_fa3_descales_mocked_no_gpu(case):
    """Mocked kernel (no GPU): an fp8 cache with scales (0.04, 2.5) reaches FA3 as float32 ``[batch,
    kv_heads]`` descales (k 0.04, v 2.5, q 1: the query is quantized unscaled), softmax_scale stays the
    layer's, q is e4m3; the emulated kernel applying them matches the float64 reference."""
    p = H.make_problem(dtype=torch.bfloat16, head_dim=64, kv_dtype=torch.float8_e4m3fn, kv_scales=FP8_SCALES,
                       **case)
    out, calls = _recorded_fp8_calls(p)
    assert calls
    for kw in calls:
        rows = kw["cu_seqlens_q"].numel() - 1
        assert kw["q"].dtype == torch.float8_e4m3fn and kw["softmax_scale"] == p.layer.scaling
        for name, want in (("q_descale", 1.0), ("k_descale", FP8_SCALES[0]), ("v_descale", FP8_SCALES[1])):
            t = kw[name]
            assert t.dtype == torch.float32 and tuple(t.shape) == (rows, p.layer.num_kv_heads), (name, t.shape)
            assert torch.all(t == torch.tensor(want, dtype=torch.float32)), (name, t)
    H.assert_close(out, p.expected, torch.bfloat16)


def test_fp8_kv_with_the_scales_ignored_misses_the_reference_mocked_no_gpu():
    """The check above can fail: the same call with k/v descales dropped (scale 1) is far from the reference."""
    p = H.make_problem(dtype=torch.bfloat16, head_dim=64, kv_dtype=torch.float8_e4m3fn, kv_scales=FP8_SCALES)

    def dropping(**kw):
        kw.pop("k_descale"), kw.pop("v_descale"), kw.pop("q_descale")
        return emulate_flash_attn_with_kvcache(**kw)

    ctx = BuildContext(config=AttentionConfig(), host=H.cuda_host(90, **SGL), dtype="bfloat16",
                       kv_cache_dtype="float8_e4m3fn", num_heads=4, num_kv_heads=2, head_dim=64,
                       page_size=p.page_size, kv_cache=p.cache, max_context_len=p.cache.max_context_len)
    out = run(p, FA3Backend(ctx, kernel=dropping, provider="sgl-kernel"))
    with pytest.raises(AssertionError):
        H.assert_close(out, p.expected, torch.bfloat16)


def test_fp8_descales_follow_a_changed_scale_in_the_same_storage_mocked_no_gpu():
    """A scale set after the first forward is written into the tensor FA3 already reads (a captured
    CUDA graph keeps its pointer), never a new one."""
    p = H.make_problem(dtype=torch.bfloat16, head_dim=64, kv_dtype=torch.float8_e4m3fn, kv_scales=FP8_SCALES)
    _, calls = _recorded_fp8_calls(p)
    ctx = BuildContext(config=AttentionConfig(), host=H.cuda_host(90, **SGL), dtype="bfloat16",
                       kv_cache_dtype="float8_e4m3fn", num_heads=4, num_kv_heads=2, head_dim=64,
                       page_size=p.page_size, kv_cache=p.cache, max_context_len=p.cache.max_context_len)
    b = FA3Backend(ctx, kernel=lambda **kw: None, provider="sgl-kernel")
    first = b.descale_arguments(0, 3, 2)
    p.cache.set_kv_scales(0, 0.5, 0.25)
    second = b.descale_arguments(0, 3, 2)
    assert first["k_descale"].data_ptr() == second["k_descale"].data_ptr()
    assert float(second["k_descale"][0, 0]) == 0.5 and float(second["v_descale"][2, 1]) == 0.25


def test_a_16_bit_cache_passes_no_descales_mocked_no_gpu():
    p = H.make_problem(dtype=torch.bfloat16, head_dim=64)
    calls = []
    ctx = BuildContext(config=AttentionConfig(), host=H.cuda_host(90, **SGL), dtype="bfloat16",
                       num_heads=4, num_kv_heads=2, head_dim=64, page_size=p.page_size, kv_cache=p.cache,
                       max_context_len=p.cache.max_context_len)
    run(p, FA3Backend(ctx, kernel=lambda **kw: calls.append(kw) or emulate_flash_attn_with_kvcache(**kw),
                      provider="sgl-kernel"))
    assert calls and not any(n in kw for kw in calls for n in ("q_descale", "k_descale", "v_descale"))
    assert all(kw["q"].dtype == torch.bfloat16 for kw in calls)


@pytest.mark.parametrize("sm, kv, backend, refused", [
    (80, "fp8_e4m3", "fa3", True),
    (89, "float8_e4m3fn", "fa3", True),
    (90, "fp8_e4m3", "fa3", False),
    (80, "auto", "fa3", False),  # auto = the model dtype
    (80, "bfloat16", "fa3", False),
    (80, "fp8_e4m3", "torch_native", False),  # not fa3's business
])
def test_check_config_refuses_fp8_kv_off_hopper(sm, kv, backend, refused):
    from attnplug_fa3 import attnplug_check_config

    cfg = AttentionConfig(attention_backend=backend, dtype="bfloat16", kv_cache_dtype=kv)
    problems = attnplug_check_config(config=cfg, host=H.cuda_host(sm, **SGL))
    assert bool(problems) is refused, problems
    if refused:
        assert f"SM{sm}" in problems[0] and "SM90" in problems[0] and "float8_e4m3fn" in problems[0]


def test_check_config_refuses_fp8_kv_for_the_fa3_half_of_a_split_pair():
    from attnplug_fa3 import attnplug_check_config

    cfg = AttentionConfig(prefill_attention_backend="torch_native", decode_attention_backend="fa3",
                          dtype="bfloat16", kv_cache_dtype="fp8_e4m3")
    assert attnplug_check_config(config=cfg, host=H.cuda_host(86, **SGL))
