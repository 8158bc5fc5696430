"""attnplug-aiter's MLA path on a CPU host, against an EMULATOR of aiter's ``mla_decode_fwd``.

``aiter.mla.mla_decode_fwd`` needs an MI300/MI350 GPU, so ``emulate_mla_decode_fwd`` below (a mock: no GPU, no
ROCm library here) implements its contract from aiter v0.1.10's ``aiter/mla.py`` in float64: ``q [total_s, H,
576]`` over ``kv_buffer [num_page, page_size, 1, 576]`` read through int32 ``kv_indptr``/``kv_indices`` (pages;
the last page holding ``kv_last_page_lens`` tokens), ``qo_indptr`` for the queries of each request, values = the
first ``o.shape[-1]`` entries of each row, ``sm_scale`` on Q·Kᵀ, the result written into ``o``. Every call is
bound to v0.1.10's real signature and checked against the preconditions in ``_library_contracts``
(``C.emulates``); the real backend class must match ``attnplug.testing.reference.reference_mla`` through it (the
call's arguments, not the GPU kernel).
"""

from __future__ import annotations

import re
import sys

import pytest
import torch

import _flashinfer_family_helpers as H
import _library_contracts as C
import _problems as M
from attnplug import AttentionConfig, BuildContext, ForwardBatch, ForwardMode
from attnplug.errors import NotSupportedError
from attnplug.testing.reference import reference_mla

LIB = {"amd-aiter": "0.1.10"}
R, ROPE = 512, 64


@C.emulates("aiter.mla.mla_decode_fwd", "amd-aiter", "0.1.10")
def emulate_mla_decode_fwd(q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens, max_seqlen_q,
                           sm_scale=None, logit_cap=0.0, num_kv_splits=None, num_kv_splits_indptr=None,
                           work_meta_data=None, work_indptr=None, work_info_set=None, reduce_indptr=None,
                           reduce_final_map=None, reduce_partial_map=None, q_scale=None, kv_scale=None,
                           intra_batch_mode=False, return_logits=False, return_lse=False):
    """Mock of ``aiter.mla.mla_decode_fwd`` (GPU-only), float64; writes ``o`` as the kernel does."""
    _, ps, _, width = kv_buffer.shape
    if sm_scale is None:
        sm_scale = 1.0 / width ** 0.5
    flat = kv_buffer.reshape(-1, width)
    dv = o.shape[-1]
    for b in range(qo_indptr.shape[0] - 1):
        q0, q1 = int(qo_indptr[b]), int(qo_indptr[b + 1])
        assert q1 - q0 <= max_seqlen_q
        pages = kv_indices[int(kv_indptr[b]):int(kv_indptr[b + 1])].long()
        L = (pages.numel() - 1) * ps + int(kv_last_page_lens[b])
        j = torch.arange(L)
        rows = flat[pages[j // ps] * ps + j % ps].double()  # [L, 576]
        s = sm_scale * torch.einsum("nhd,ld->nhl", q[q0:q1].double(), rows)
        n = q1 - q0
        vis = j[None, :] <= (L - n + torch.arange(n))[:, None]  # MTP rows: causal, bottom-right
        s = s.masked_fill(~vis[:, None, :], float("-inf"))
        o[q0:q1] = torch.einsum("nhl,ld->nhd", torch.softmax(s, -1), rows[:, :dv]).to(o.dtype)
    return None, None


def mla_problem(seq, *, page_size=16, heads=16, dtype=torch.bfloat16, rank=R, seed=0):
    """A DECODE batch of requests ``seq`` long (the new token counted); garbage in every slot not owned."""
    p = M.latent_problem([s - 1 for s in seq], [1] * len(seq), mode=ForwardMode.DECODE, page_size=page_size,
                         heads=heads, dtype=dtype, rank=rank, rope=ROPE, garbage=True, seed=seed)
    return p.cache, p.batch, p.layers[0], p.q, p.latents[0]


def install_fake_aiter(monkeypatch):
    """Mocked: no ROCm build here. An in-memory module ``aiter`` (+ ``aiter.mla``) owned by amd-aiter 0.1.10."""
    mod = H.fake_module("aiter", "0.1.10")
    mla = H.fake_module("aiter.mla", "0.1.10", mla_decode_fwd=emulate_mla_decode_fwd)
    mod.mla = mla
    monkeypatch.setitem(sys.modules, "aiter", mod)
    monkeypatch.setitem(sys.modules, "aiter.mla", mla)
    import attnplug_aiter.backend as B

    monkeypatch.setattr(B, "library_provider", lambda dists: ("amd-aiter", "0.1.10") if "amd-aiter" in dists else None)
    return mod


@pytest.fixture
def fake_aiter(monkeypatch):
    return install_fake_aiter(monkeypatch)


def build(cache, layer, dtype="bfloat16", mla_kernel=None):
    from attnplug_aiter.backend import AiterBackend

    ctx = BuildContext(AttentionConfig(), H.host("rocm", LIB, gfx_arch="gfx942"), dtype=dtype,
                       num_heads=layer.num_heads, num_kv_heads=1, head_dim=layer.head_dim, page_size=cache.page_size,
                       kv_cache=cache, max_context_len=cache.max_context_len, layers=(layer,))
    return AiterBackend(ctx, mla_kernel=mla_kernel)


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("seq", [[1], [33, 5, 64, 100]])
def test_emulated_mla_decode_matches_the_reference_mocked_no_gpu(fake_aiter, page_size, heads, seq):
    cache, batch, layer, q, lat = mla_problem(seq, page_size=page_size, heads=heads)
    be = build(cache, layer)  # the kernel comes from the (fake) module aiter.mla, as on a GPU host
    expect = reference_mla(q, lat, layer, batch, cache.read_latent(0), cache.req_to_token)
    be.init_forward_metadata(batch)
    out = be.forward(q, lat, None, layer, batch)
    assert tuple(out.shape) == (len(seq), heads, R) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), expect, atol=2e-2, rtol=2e-2)


def test_save_kv_cache_false_leaves_the_latent_unchanged_mocked_no_gpu(fake_aiter):
    cache, batch, layer, q, lat = mla_problem([20, 3])
    M.check_mla_no_save(build(cache, layer), cache, batch, layer, q, lat)


def test_the_claim_is_absorbed_decode_only():
    import attnplug_aiter as D

    assert dict(D.CAPABILITIES.mla_forms) == {"decode": ("absorbed",)}


@pytest.mark.parametrize("mode,form,words", [
    (ForwardMode.EXTEND, "absorbed", r"absorbed extend\) not supported by aiter"),
    (ForwardMode.TARGET_VERIFY, "absorbed", r"absorbed extend\) not supported by aiter"),
    (ForwardMode.DECODE, "unabsorbed", r"unabsorbed decode\) not supported by aiter"),
])
def test_unclaimed_mla_forwards_are_refused_in_words_and_write_nothing_mocked_no_gpu(fake_aiter, mode, form, words):
    cache, batch, layer, q, lat = mla_problem([9, 20])
    be = build(cache, layer)
    if mode is ForwardMode.DECODE:
        fwd = ForwardBatch.decode(batch.req_pool_indices_cpu, [9, 20], batch.out_cache_loc, mla_form=form)
    else:
        kw = dict(spec_num_draft_tokens=1) if mode is ForwardMode.TARGET_VERIFY else {}
        fwd = ForwardBatch.extend(batch.req_pool_indices_cpu, [8, 19], [1, 1], batch.out_cache_loc, mode=mode, **kw)
    if form == "unabsorbed":  # per-head queries: qk_nope + qk_rope wide
        q = q[..., :128 + ROPE].contiguous()
    M.check_mla_refused(be, cache, fwd, layer, q, lat, words)


@pytest.mark.parametrize("heads,rank,dtype,words", [
    (32, 512, "bfloat16", r"MLA num_heads=32 \(aiter's mla_decode_fwd writes o for 16 or 128 heads\)"),
    (8, 512, "bfloat16", r"MLA num_heads=8"),
    (16, 256, "bfloat16", r"MLA kv_lora_rank=256, qk_rope_head_dim=64"),
    (16, 512, "float16", r"MLA with dtype float16 \(aiter's MLA decode kernels take bfloat16"),
])
def test_heads_latents_and_dtypes_aiter_lacks_are_reasons(fake_aiter, heads, rank, dtype, words):
    tdt = getattr(torch, dtype)
    cache, batch, layer, q, lat = mla_problem([5], heads=heads, rank=rank, dtype=tdt)
    be = build(cache, layer, dtype=dtype)
    found = be.not_supported_reasons(layer, be.ctx)
    assert any(re.search(words, r) for r in found), found
    be.init_forward_metadata(batch)
    with pytest.raises(NotSupportedError, match=words):
        be.forward(q, lat, None, layer, batch)


def test_a_served_layer_has_no_reasons(fake_aiter):
    cache, batch, layer, q, lat = mla_problem([5], heads=128)
    be = build(cache, layer)
    # (this CPU host is not ROCm: the device reason stays; no MLA reason)
    assert [r for r in be.not_supported_reasons(layer, be.ctx) if "MLA" in r] == []
    assert be.backend_reasons(layer, None) == []


def test_the_emulator_checks_the_preconditions():
    """The mock fails as aiter would: a 3-D kv_buffer and an int64 kv_indptr are named."""
    q = torch.zeros(2, 16, 576, dtype=torch.bfloat16)
    o = torch.zeros(2, 16, 512, dtype=torch.bfloat16)
    i32 = torch.zeros(3, dtype=torch.int32)
    with pytest.raises(AssertionError) as err:
        emulate_mla_decode_fwd(q, torch.zeros(4, 1, 576, dtype=torch.bfloat16), o, i32, i32.long(), i32, i32[:2], 1)
    assert "kv_indptr must be int32" in str(err.value) and "kv_buffer must be 4-D" in str(err.value)
