"""attnplug-fa3's MLA path on a CPU host, against an EMULATOR of FA3's ``flash_attn_with_kvcache(qv=)``.

sgl-kernel's FA3 needs a Hopper GPU, so ``emulate_fa3_mla`` below (a mock: no GPU, no CUDA library here)
implements FA3's documented contract for its MLA mode in float64, as SGLang's ``FlashAttentionBackend`` uses it
with ``use_mla``: ``q`` = the query's rope part ``[T, H, qk_rope]``, ``qv`` = its absorbed nope part ``[T, H,
kv_lora_rank]``, ``k_cache`` / ``v_cache`` = the rope / ``c_kv`` parts of the latent pages ``[pages, page_size,
1, *]`` (strided views of one buffer), read through the int32 ``page_table`` up to ``cache_seqlens``; the logits
are ``softmax_scale * (q·k + qv·v)``, bottom-right causal per request (``cu_seqlens_q``), the output ``p·v``.
Every call is bound to sgl-kernel 0.3.21's real signature and checked against the preconditions in
``_library_contracts`` (``C.emulates``: FA3's ``q_v`` rules); the real backend class must match
``attnplug.testing.reference.reference_mla`` through it (the call's arguments, not the GPU kernel).
"""

from __future__ import annotations

import re

import pytest
import torch

import _fa3_family_helpers as H
import _library_contracts as C
import _problems as M
from attnplug import AttentionConfig, BuildContext, ForwardBatch, ForwardMode
from attnplug.errors import NotSupportedError
from attnplug.testing.reference import reference_mla
from attnplug_fa3.backend import FA3Backend

SGL = {"sgl_kernel": "0.3.21"}
R, ROPE = 512, 64


@C.emulates("sgl_kernel.flash_attn.flash_attn_with_kvcache", "sgl-kernel", "0.3.21")
def emulate_fa3_mla(q, k_cache, v_cache, *, qv, cache_seqlens, page_table, cu_seqlens_q, max_seqlen_q,
                    softmax_scale, causal, num_splits=0, **unexpected):
    """Mock of FA3's ``flash_attn_with_kvcache`` in its MLA (``qv=``) mode (GPU-only), float64."""
    assert not unexpected, f"unexpected kernel arguments {sorted(unexpected)}"
    assert k_cache.dim() == 4 and k_cache.shape[:3] == v_cache.shape[:3]
    ps, B = k_cache.shape[1], cache_seqlens.numel()
    assert cu_seqlens_q.numel() == B + 1 and page_table.shape[0] == B and int(cu_seqlens_q[-1]) == q.shape[0]
    out = torch.zeros(q.shape[0], q.shape[1], v_cache.shape[-1], dtype=torch.float64)
    for b in range(B):
        sk = int(cache_seqlens[b])
        q0, q1 = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        assert q1 - q0 <= max_seqlen_q and -(-sk // ps) <= page_table.shape[1]
        j = torch.arange(sk)
        pages = page_table[b, j // ps].long()
        K, V = k_cache[pages, j % ps, 0].double(), v_cache[pages, j % ps, 0].double()  # [sk, rope] / [sk, rank]
        s = softmax_scale * (torch.einsum("nhd,ld->nhl", q[q0:q1].double(), K)
                             + torch.einsum("nhd,ld->nhl", qv[q0:q1].double(), V))
        if causal:
            n = q1 - q0
            vis = j[None, :] <= (sk - n + torch.arange(n))[:, None]
            s = s.masked_fill(~vis[:, None, :], float("-inf"))
        out[q0:q1] = torch.einsum("nhl,ld->nhd", torch.softmax(s, -1), V)
    return out.to(q.dtype)


def mla_problem(prefix, ext, *, mode=ForwardMode.EXTEND, page_size=16, heads=8, dtype=torch.bfloat16,
                rank=R, rope=ROPE, tree=False, seed=0):
    """Requests with ``prefix`` cached tokens extending by ``ext``; garbage in every slot not owned."""
    p = M.latent_problem(prefix, ext, mode=mode, page_size=page_size, heads=heads, dtype=dtype, rank=rank, rope=rope,
                         garbage=True, tree=tree, seed=seed)
    return p.cache, p.batch, p.layers[0], p.q, p.latents[0]


def build(cache, layer, *, sm=90, kernel=emulate_fa3_mla, deterministic=False, kv_cache_dtype=None):
    ctx = BuildContext(config=AttentionConfig(deterministic=deterministic), host=H.cuda_host(sm, **SGL),
                       dtype=cache.dtype, num_heads=layer.num_heads, num_kv_heads=1, head_dim=layer.head_dim,
                       page_size=cache.page_size, kv_cache=cache, kv_cache_dtype=kv_cache_dtype,
                       max_context_len=cache.max_context_len, layers=(layer,))
    return FA3Backend(ctx, kernel=kernel, provider="sgl-kernel")


CASES = {
    "decode": (ForwardMode.DECODE, [0, 16, 40, 15], [1, 1, 1, 1], False),
    "extend_prefix": (ForwardMode.EXTEND, [0, 5, 17, 3], [4, 1, 6, 9], False),
    "verify_chain": (ForwardMode.TARGET_VERIFY, [5, 17, 3], [3, 3, 3], False),
    "verify_tree": (ForwardMode.TARGET_VERIFY, [5, 17, 3], [3, 3, 3], True),
    "draft_extend": (ForwardMode.DRAFT_EXTEND, [7, 2], [3, 3], False),
}


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("case", sorted(CASES))
def test_emulated_mla_matches_the_reference_mocked_no_gpu(case, page_size):
    mode, prefix, ext, tree = CASES[case]
    cache, batch, layer, q, lat = mla_problem(prefix, ext, mode=mode, page_size=page_size, tree=tree)
    be = build(cache, layer)
    expect = reference_mla(q, lat, layer, batch, cache.read_latent(0), cache.req_to_token)
    be.init_forward_metadata(batch)
    out = be.forward(q, lat, None, layer, batch)
    assert tuple(out.shape) == (q.shape[0], layer.num_heads, R) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), expect, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rank,rope", [(512, 64), (256, 32)])
def test_other_dtypes_and_latents_within_fa3s_limits_mocked_no_gpu(dtype, rank, rope):
    """fp16 and bf16 with DeepSeek's latent and a smaller one inside FA3's qv limits."""
    cache, batch, layer, q, lat = mla_problem([9, 30], [2, 5], dtype=dtype, rank=rank, rope=rope)
    be = build(cache, layer)
    expect = reference_mla(q, lat, layer, batch, cache.read_latent(0), cache.req_to_token)
    be.init_forward_metadata(batch)
    out = be.forward(q, lat, None, layer, batch)
    tol = 3e-3 if dtype is torch.float16 else 2e-2
    torch.testing.assert_close(out.double(), expect, atol=tol, rtol=tol)


def test_save_kv_cache_false_leaves_the_latent_unchanged_mocked_no_gpu():
    cache, batch, layer, q, lat = mla_problem([4, 11], [3, 2])
    M.check_mla_no_save(build(cache, layer), cache, batch, layer, q, lat)


def test_the_call_splits_the_latent_as_sglang_does_mocked_no_gpu():
    """k_cache / v_cache are views of the latent buffer (no copy); q / qv the rope / nope parts of the query."""
    calls = []

    def spy(**kw):
        calls.append(kw)
        return emulate_fa3_mla(**kw)

    cache, batch, layer, q, lat = mla_problem([5], [1], mode=ForwardMode.DECODE)
    be = build(cache, layer, kernel=spy, deterministic=True)
    be.init_forward_metadata(batch)
    be.forward(q, lat, None, layer, batch)
    (kw,) = calls
    buf = cache.get_kv(0)[0]
    assert kw["v_cache"].data_ptr() == buf.data_ptr() and kw["k_cache"].data_ptr() == buf[..., R:].data_ptr()
    assert kw["k_cache"].shape[-1] == ROPE and kw["v_cache"].shape[-1] == R and kw["qv"].shape[-1] == R
    assert kw["num_splits"] == 1 and kw["softmax_scale"] == layer.scaling


def test_the_claim_is_absorbed_in_every_mode():
    import attnplug_fa3 as D

    assert dict(D.CAPABILITIES.mla_forms) == {"decode": ("absorbed",), "extend": ("absorbed",)}


@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.EXTEND])
def test_the_unabsorbed_form_is_refused_in_words_and_writes_nothing_mocked_no_gpu(mode):
    prefix, ext = ([9, 20], [1, 1]) if mode is ForwardMode.DECODE else ([9, 20], [2, 3])
    cache, batch, layer, q, lat = mla_problem(prefix, ext, mode=mode)
    fwd = ForwardBatch(batch.forward_mode, batch.req_pool_indices, batch.seq_lens, batch.out_cache_loc,
                       extend_prefix_lens=batch.extend_prefix_lens, extend_seq_lens=batch.extend_seq_lens,
                       positions=batch.positions, mla_form="unabsorbed")
    be = build(cache, layer)
    kind = "decode" if mode is ForwardMode.DECODE else "extend"
    M.check_mla_refused(be, cache, fwd, layer, q[..., :128 + ROPE].contiguous(), lat,
                        rf"unabsorbed {kind}\) not supported by fa3")


@pytest.mark.parametrize("sm,rank,rope,kv,words", [
    (89, 512, 64, None, r"MLA layer: FA3's qv= .* runs on Hopper \(SM90\) only; this GPU is SM89"),
    (80, 512, 64, None, r"this GPU is SM80"),
    (90, 512, 128, None, r"MLA qk_rope_head_dim=128 \(FA3's qv= takes q/k head sizes of at most 64"),
    (90, 1024, 64, None, r"MLA kv_lora_rank=1024"),
    (90, 512, 64, "float8_e4m3fn", r"kv_cache_dtype=float8_e4m3fn: FA3's qv= is fp16/bf16 only"),
])
def test_gpus_shapes_and_fp8_fa3_lacks_are_reasons(sm, rank, rope, kv, words):
    cache, batch, layer, q, lat = mla_problem([5], [1], mode=ForwardMode.DECODE, rank=rank, rope=rope)
    be = build(cache, layer, sm=sm, kv_cache_dtype=kv)
    found = be.not_supported_reasons(layer, be.ctx)
    assert any(re.search(words, r) for r in found), found
    assert be.backend_reasons(layer, None) != []  # the forward's check (ctx None) sees the build context
    be.init_forward_metadata(batch)
    with pytest.raises(NotSupportedError, match=words):
        be.forward(q, lat, None, layer, batch)


def test_a_served_layer_has_no_mla_reasons():
    cache, batch, layer, q, lat = mla_problem([5], [1], mode=ForwardMode.DECODE)
    be = build(cache, layer)
    assert be.backend_reasons(layer, be.ctx) == [] and be.backend_reasons(layer, None) == []


def test_the_qv_preconditions_catch_a_wrong_call():
    """The mock fails as FA3 would: a 128-wide q with qv, and a qv whose width is not v_cache's."""
    i32 = torch.zeros(1, dtype=torch.int32)
    kw = dict(k_cache=torch.zeros(2, 16, 1, 128, dtype=torch.bfloat16), v_cache=torch.zeros(2, 16, 1, 512,
              dtype=torch.bfloat16), qv=torch.zeros(1, 8, 256, dtype=torch.bfloat16), cache_seqlens=i32,
              page_table=torch.zeros(1, 2, dtype=torch.int32), cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32),
              max_seqlen_q=1, softmax_scale=0.1, causal=True)
    with pytest.raises(AssertionError) as err:
        emulate_fa3_mla(torch.zeros(1, 8, 128, dtype=torch.bfloat16), **kw)
    assert "q_v is only supported for head_size <= 64" in str(err.value)
    assert "q_v must have shape" in str(err.value) and "V head dim 512 differs" in str(err.value)
