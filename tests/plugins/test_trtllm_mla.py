"""attnplug-trtllm-mha's MLA path on a CPU host, against an EMULATOR of trtllm-gen's MLA decode.

``trtllm_batch_decode_with_kv_cache_mla`` needs a Blackwell GPU, so ``emulate_mla_decode`` below (a mock: no
GPU, no CUDA library here) implements flashinfer's documented contract in float64: ``query [B, q_len, H,
kv_lora_rank + qk_rope]`` over ``kv_cache [pages, page_size, kv_lora_rank + qk_rope]`` read through int32
``block_tables`` up to ``seq_lens``, values = the first ``kv_lora_rank`` entries, ``bmm1_scale`` on Q·Kᵀ and
``bmm2_scale`` on P·V. Every call is bound to flashinfer-python 0.6.0's real signature and checked against the
preconditions in ``_library_contracts`` (``C.emulates``); the real backend class must match
``attnplug.testing.reference.reference_mla`` through it (the call's arguments, not the GPU kernel).
"""

from __future__ import annotations

import pytest
import torch

import _fa3_family_helpers as H
import _library_contracts as C
import _problems as M
from attnplug import AttentionConfig, BuildContext, ForwardBatch, ForwardMode, LayerSpec
from attnplug.layer import MLASpec
from attnplug.testing.reference import reference_mla
from attnplug_trtllm_mha.backend import TrtllmMHABackend

FI = {"flashinfer_python": "0.6.3"}
R, ROPE = 512, 64


@C.emulates("flashinfer.decode.trtllm_batch_decode_with_kv_cache_mla", "flashinfer-python", "0.6.0")
def emulate_mla_decode(query, kv_cache, workspace_buffer, qk_nope_head_dim, kv_lora_rank, qk_rope_head_dim,
                       block_tables, seq_lens, max_seq_len, sparse_mla_top_k=0, out=None, bmm1_scale=1.0,
                       bmm2_scale=1.0, sinks=None, skip_softmax_threshold_scale_factor=None, enable_pdl=None,
                       backend="auto"):
    """Mock of ``flashinfer.decode.trtllm_batch_decode_with_kv_cache_mla`` (GPU-only), float64."""
    assert workspace_buffer.dtype == torch.uint8
    B, n, Hq, _ = query.shape
    ps = kv_cache.shape[-2]
    flat = kv_cache.reshape(kv_cache.shape[0], ps, -1)
    res = torch.zeros(B, n, Hq, kv_lora_rank, dtype=torch.float64)
    for b in range(B):
        L = int(seq_lens[b])
        assert L <= max_seq_len and -(-L // ps) <= block_tables.shape[1]
        j = torch.arange(L)
        rows = flat[block_tables[b, j // ps].long(), j % ps].double()  # [L, 576]
        s = bmm1_scale * torch.einsum("nhd,ld->nhl", query[b].double(), rows)
        vis = j[None, :] <= (L - n + torch.arange(n))[:, None]  # MTP rows: causal, bottom-right
        s = s.masked_fill(~vis[:, None, :], float("-inf"))
        res[b] = torch.einsum("nhl,ld->nhd", torch.softmax(s, -1), rows[:, :kv_lora_rank]) * bmm2_scale
    dtype = torch.bfloat16 if query.dtype == torch.float8_e4m3fn else query.dtype
    return res.to(dtype)


def mla_problem(seq, *, page_size=32, heads=8, dtype=torch.bfloat16, kv_dtype=None, seed=0):
    """A DECODE batch of requests ``seq`` long (the new token counted); an fp8 latent has scale 0.5."""
    p = M.latent_problem([s - 1 for s in seq], [1] * len(seq), mode=ForwardMode.DECODE, page_size=page_size,
                         heads=heads, dtype=dtype, kv_dtype=kv_dtype, rank=R, rope=ROPE, fp8_scale=0.5, seed=seed)
    return p.cache, p.batch, p.layers[0], p.q, p.latents[0]


def build(cache, layer, dtype=torch.bfloat16, kernel=emulate_mla_decode):
    ctx = BuildContext(config=AttentionConfig(), host=H.cuda_host(100, **FI), dtype=dtype, num_heads=layer.num_heads,
                       num_kv_heads=1, head_dim=layer.head_dim, page_size=cache.page_size, kv_cache=cache,
                       kv_cache_dtype=str(cache.dtype).replace("torch.", ""), max_context_len=cache.max_context_len,
                       layers=(layer,))
    return TrtllmMHABackend(ctx, kernels=(None, None), workspace_bytes=1024, mla_kernel=kernel)


@pytest.mark.parametrize("page_size", [32, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("seq", [[1], [33, 5, 64, 100]])
def test_emulated_mla_decode_matches_the_reference_mocked_no_gpu(page_size, dtype, seq):
    cache, batch, layer, q, lat = mla_problem(seq, page_size=page_size, dtype=dtype)
    be = build(cache, layer, dtype)
    expect = reference_mla(q, lat, layer, batch, cache.read_latent(0), cache.req_to_token)
    be.init_forward_metadata(batch)
    out = be.forward(q, lat, None, layer, batch)
    assert tuple(out.shape) == (len(seq), 8, R) and out.dtype == dtype
    tol = 2e-2 if dtype is torch.bfloat16 else 3e-3
    torch.testing.assert_close(out.double(), expect, atol=tol, rtol=tol)


def test_an_fp8_latent_folds_its_scale_into_both_bmm_scales_mocked_no_gpu():
    """e4m3 latent with scale 0.5: the query is quantized to e4m3 (scale 1), bmm1 = scaling x 0.5 and bmm2 = 0.5;
    the result stays within an fp8 query's error of the reference (dequantized latent, unquantized query)."""
    calls = []

    def spy(**kw):
        calls.append(kw)
        return emulate_mla_decode(**kw)

    cache, batch, layer, q, lat = mla_problem([40, 7], kv_dtype=torch.float8_e4m3fn)
    be = build(cache, layer, kernel=spy)
    expect = reference_mla(q, lat, layer, batch, cache.read_latent(0), cache.req_to_token, scale=0.5)
    be.init_forward_metadata(batch)
    out = be.forward(q, lat, None, layer, batch)
    (kw,) = calls
    assert kw["query"].dtype == torch.float8_e4m3fn and kw["kv_cache"].dtype == torch.float8_e4m3fn
    assert kw["bmm1_scale"] == pytest.approx(layer.scaling * 0.5) and kw["bmm2_scale"] == 0.5
    assert (out.double() - expect).abs().max() < 0.15  # e4m3 query rounding (3 mantissa bits)


def test_the_claim_is_absorbed_decode_only():
    import attnplug_trtllm_mha as D

    assert dict(D.CAPABILITIES.mla_forms) == {"decode": ("absorbed",)}


def test_extend_shaped_mla_forwards_are_refused_in_words_mocked_no_gpu():
    cache, batch, layer, q, lat = mla_problem([9, 20])
    be = build(cache, layer)
    ext = ForwardBatch.extend(batch.req_pool_indices_cpu, [8, 19], [1, 1], batch.out_cache_loc,
                              mode=ForwardMode.EXTEND)
    M.check_mla_refused(be, cache, ext, layer, q, lat, r"absorbed extend\) not supported by trtllm_mha")


@pytest.mark.parametrize("page_size,rank,words", [
    (16, 512, r"page_size=16 with an MLA layer \(trtllm_batch_decode_with_kv_cache_mla takes blocks of 32 or 64\)"),
    (32, 256, r"MLA kv_lora_rank=256"),
])
def test_page_sizes_and_latents_trtllm_gen_lacks_are_reasons(page_size, rank, words):
    import re

    cache, batch, layer, q, lat = mla_problem([5], page_size=page_size)
    be = build(cache, layer)
    probe = layer if rank == 512 else LayerSpec(0, 8, 1, rank + ROPE, mla=MLASpec(rank, 128, ROPE, 128))
    assert any(re.search(words, r) for r in be.not_supported_reasons(probe, be.ctx))
