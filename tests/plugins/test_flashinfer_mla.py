"""attnplug-flashinfer's MLA path on a CPU host, against an EMULATOR of ``BatchMLAPagedAttentionWrapper``.

FlashInfer's MLA kernels need an SM80+ GPU, so ``EmuMLAWrapper`` below (a mock: no GPU, no CUDA library
here) implements the wrapper's documented contract in float64: ``plan(qo_indptr, kv_indptr, kv_indices,
kv_len_arr, num_heads, head_dim_ckv, head_dim_kpe, page_size, causal, sm_scale, q_data_type, kv_data_type)``
over page ids, ``run(q_nope, q_pe, ckv_cache, kpe_cache, out=)`` with ``[pages, page_size, 512]`` /
``[pages, page_size, 64]`` caches, bottom-right causal. Every call is bound to flashinfer-python 0.5.0's real
signature and checked against the preconditions in ``_library_contracts`` (``C.emulates``). The real backend
class runs against it and must match ``attnplug.testing.reference.reference_mla``: this proves the metadata
and the call arguments, not the GPU kernel (``scripts/gpu_check.sh`` is where a lent GPU would run it).
"""

from __future__ import annotations

import sys

import pytest
import torch

import _flashinfer_family_helpers as H
import _library_contracts as C
import _problems as M
from attnplug import AttentionConfig, BuildContext, ForwardMode, LayerSpec
from attnplug.layer import MLASpec
from attnplug.testing.reference import reference_mla

LIB = {"flashinfer-python": "0.5.2"}
R, ROPE = 512, 64


class EmuMLAWrapper:
    """Mock of flashinfer's ``BatchMLAPagedAttentionWrapper`` (no GPU here), float64."""

    def __init__(self, float_workspace_buffer, use_cuda_graph=False, qo_indptr=None, kv_indptr=None,
                 kv_indices=None, kv_len_arr=None, backend="auto"):
        self.contract_owner = {k: v for k, v in locals().items() if k not in ("self", "__class__")}
        self.p = None
        self.plan_calls = 0

    @C.emulates("flashinfer.mla.BatchMLAPagedAttentionWrapper.plan", "flashinfer-python", "0.5.0")
    def plan(self, qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads, head_dim_ckv, head_dim_kpe, page_size,
             causal, sm_scale, q_data_type, kv_data_type, use_profiler=False):
        self.plan_calls += 1
        self.p = dict(qo=qo_indptr.clone(), indptr=kv_indptr.clone(), indices=kv_indices.clone(),
                      lens=kv_len_arr.clone(), heads=num_heads, ps=page_size, causal=causal, scale=sm_scale)

    @C.emulates("flashinfer.mla.BatchMLAPagedAttentionWrapper.run", "flashinfer-python", "0.5.0")
    def run(self, q_nope, q_pe, ckv_cache, kpe_cache, out=None, lse=None, return_lse=False, profiler_buffer=None,
            kv_len=None, page_table=None):
        p = self.p
        assert ckv_cache.shape[1] == p["ps"] and q_nope.shape[1] == p["heads"]
        res = torch.zeros(q_nope.shape[0], q_nope.shape[1], ckv_cache.shape[-1], dtype=torch.float64)
        for i in range(p["lens"].numel()):
            q0, q1 = int(p["qo"][i]), int(p["qo"][i + 1])
            pages = p["indices"][int(p["indptr"][i]):int(p["indptr"][i + 1])].long()
            L = int(p["lens"][i])
            assert len(pages) == -(-L // p["ps"]), "kv_indptr pages do not cover kv_len_arr"
            ckv = ckv_cache[pages].reshape(-1, ckv_cache.shape[-1])[:L].double()
            kpe = kpe_cache[pages].reshape(-1, kpe_cache.shape[-1])[:L].double()
            s = p["scale"] * (torch.einsum("nhd,ld->nhl", q_nope[q0:q1].double(), ckv)
                              + torch.einsum("nhd,ld->nhl", q_pe[q0:q1].double(), kpe))
            n = q1 - q0
            if p["causal"]:
                vis = torch.arange(L)[None, :] <= (L - n + torch.arange(n))[:, None]
                s = s.masked_fill(~vis[:, None, :], float("-inf"))
            res[q0:q1] = torch.einsum("nhl,ld->nhd", torch.softmax(s, -1), ckv)
        if out is None:
            return res.to(q_nope.dtype)
        out.copy_(res.to(out.dtype))
        return out


@pytest.fixture
def fake_flashinfer(monkeypatch):
    mla = H.fake_module("flashinfer.mla", "0.5.0", BatchMLAPagedAttentionWrapper=EmuMLAWrapper)
    mod = H.fake_module("flashinfer", "0.5.0", mla=mla)
    monkeypatch.setitem(sys.modules, "flashinfer", mod)
    monkeypatch.setitem(sys.modules, "flashinfer.mla", mla)
    import importlib.metadata as im

    real = im.version
    monkeypatch.setattr(im, "version", lambda n: (_ for _ in ()).throw(im.PackageNotFoundError(n))
                        if n == "flashinfer-python" else real(n))
    return mod


def mla_problem(mode, prefix, ext, *, page_size=16, heads=8, dtype=torch.float16, kv_dtype=None, layers=1,
                rank=R, rope=ROPE, tree=False, seed=0):
    """An MLA batch on shuffled pages: rows 3, 0, 5, … (not batch order), prefixes ending mid-page."""
    p = M.latent_problem(prefix, ext, mode=mode, page_size=page_size, heads=heads, dtype=dtype, kv_dtype=kv_dtype,
                         layers=layers, rank=rank, rope=rope, tree=tree, seed=seed)
    return p.cache, p.batch, p.layers, p.q, p.latents


def build(cache, spec, dtype="float16"):
    from attnplug_flashinfer.backend import FlashInferBackend

    ctx = BuildContext(AttentionConfig(), H.host("cuda", LIB, compute_capability=(9, 0)), dtype=dtype,
                       kv_cache_dtype=str(cache.dtype).replace("torch.", ""), num_heads=spec[0].num_heads,
                       num_kv_heads=1, head_dim=spec[0].head_dim, page_size=cache.page_size, kv_cache=cache,
                       max_context_len=cache.max_context_len, layers=tuple(spec))
    return FlashInferBackend(ctx)


CASES = {
    "decode": (ForwardMode.DECODE, [0, 16, 31, 15], [1, 1, 1, 1]),
    "extend_prefix": (ForwardMode.EXTEND, [0, 5, 17, 3], [4, 1, 6, 9]),
    "verify_chain": (ForwardMode.TARGET_VERIFY, [5, 17, 3], [3, 3, 3]),
    "draft_extend": (ForwardMode.DRAFT_EXTEND, [7, 2], [3, 3]),
}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("case", sorted(CASES))
def test_emulated_mla_matches_the_reference_mocked_no_gpu(fake_flashinfer, case, page_size, dtype):
    mode, prefix, ext = CASES[case]
    cache, batch, spec, q, lat = mla_problem(mode, prefix, ext, page_size=page_size, dtype=dtype)
    be = build(cache, spec, str(dtype).replace("torch.", ""))
    before = cache.read_latent(0)
    expect = reference_mla(q, lat[0], spec[0], batch, before, cache.req_to_token)
    be.init_forward_metadata(batch)
    out = be.forward(q, lat[0], None, spec[0], batch)
    assert tuple(out.shape) == (q.shape[0], 8, R)
    tol = 2e-2 if dtype is torch.bfloat16 else 3e-3
    torch.testing.assert_close(out.double(), expect, atol=tol, rtol=tol)
    assert torch.equal(cache.read_latent(0, batch.out_cache_loc), lat[0])


def test_one_plan_per_forward_shared_by_every_mla_layer_mocked_no_gpu(fake_flashinfer):
    cache, batch, spec, q, lat = mla_problem(ForwardMode.EXTEND, [3, 9], [2, 5], layers=3)
    be = build(cache, spec)
    be.init_forward_metadata(batch)
    for layer, rows in zip(spec, lat):
        be.forward(q, rows, None, layer, batch)
    (wrapper,) = [w for k, w in be._eager.items() if k[0] == "mla"]
    assert wrapper.plan_calls == 1


def test_save_kv_cache_false_leaves_the_latent_cache_unchanged_mocked_no_gpu(fake_flashinfer):
    cache, batch, spec, q, lat = mla_problem(ForwardMode.EXTEND, [3, 9], [2, 5])
    be = build(cache, spec)
    before = cache.read_latent(0)
    be.init_forward_metadata(batch)
    be.forward(q, lat[0], None, spec[0], batch, save_kv_cache=False)
    assert torch.equal(cache.read_latent(0), before)


def test_the_claim_is_the_absorbed_form_in_decode_and_extend():
    import attnplug_flashinfer as D

    assert dict(D.CAPABILITIES.mla_forms) == {"decode": ("absorbed",), "extend": ("absorbed",)}


@pytest.mark.parametrize("what,words", [
    ("tree_verify", r"custom \(tree\) mask on an MLA layer"),
    ("unabsorbed", r"unabsorbed extend\) not supported by flashinfer"),
])
def test_what_the_mla_wrapper_cannot_express_is_refused_in_words_mocked_no_gpu(fake_flashinfer, what, words):
    mode = ForwardMode.TARGET_VERIFY if what == "tree_verify" else ForwardMode.EXTEND
    cache, batch, spec, q, lat = mla_problem(mode, [5, 7], [3, 3], tree=what == "tree_verify")
    be = build(cache, spec)
    if what == "unabsorbed":
        g = torch.Generator().manual_seed(1)
        spec = [LayerSpec(0, 8, 1, R + ROPE, mla=MLASpec(R, 128, ROPE, 128, torch.randn(8, 128, R, generator=g),
                                                         torch.randn(8, R, 128, generator=g)))]
        batch.mla_form = "unabsorbed"
        q = q[..., :192].contiguous()
    M.check_mla_refused(be, cache, batch, spec[0], q, lat[0], words)


def test_other_latent_shapes_and_fp8_latents_are_reasons_mocked_no_gpu(fake_flashinfer):
    cache, batch, spec, q, lat = mla_problem(ForwardMode.DECODE, [4], [1])
    be = build(cache, spec)
    small = LayerSpec(0, 8, 1, 320, mla=MLASpec(256, 128, 64, 128))
    assert any("kv_lora_rank=256" in r for r in be.not_supported_reasons(small, be.ctx))
    assert not [r for r in be.not_supported_reasons(spec[0], be.ctx) if "MLA" in r]
    cache8, batch8, spec8, q8, lat8 = mla_problem(ForwardMode.DECODE, [4], [1], kv_dtype=torch.float8_e4m3fn)
    be8 = build(cache8, spec8)
    assert any("kv_cache_dtype=float8_e4m3fn with an MLA layer" in r for r in be8.not_supported_reasons(spec8[0], be8.ctx))


def test_mla_layers_are_left_out_of_cuda_graph_plans_mocked_no_gpu(fake_flashinfer):
    cache, batch, spec, q, lat = mla_problem(ForwardMode.DECODE, [4, 9], [1, 1])
    be = build(cache, spec)
    assert be._graph_layers() == {}
