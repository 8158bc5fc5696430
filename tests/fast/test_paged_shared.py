"""The pieces the paged GPU plugins share from the core: ``ForwardBatch`` kernel inputs, ``PagedKVCache``
page tables, and the ``PagedBackend`` hooks they use (``backend_reasons``, ``graph_metadata``, the
zero-token forward). A small real ``PagedBackend`` subclass stands in for a plugin; expectations are
computed here by walking positions one at a time."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from attnplug import (AttentionConfig, BuildContext, ForwardBatch, ForwardMode, LayerSpec, NotSupportedError,
                      PageAllocator, PagedBackend, PagedKVCache, ShapeError)
from attnplug.capabilities import Capabilities
from attnplug.errors import AttnplugError, MetadataNotInitializedError
from attnplug.host import HostInfo
from attnplug.kvcache import indptr
from attnplug.testing.reference import reference_attention


def _problem(prefix=(0, 5, 17), ext=(3, 1, 6), page_size=4, seed=0):
    seq = [p + e for p, e in zip(prefix, ext)]
    cache = PagedKVCache(1, sum(math.ceil(s / page_size) for s in seq) + 4, 2, 8, page_size=page_size,
                         max_requests=len(seq) + 3, max_context_len=max(seq) + page_size)
    alloc = PageAllocator(cache.num_pages, shuffle=True, seed=seed)
    rows = [(2 * i + 1) % cache.max_requests for i in range(len(seq))]
    for r, s in zip(rows, seq):
        cache.assign_pages(r, s, alloc.alloc(math.ceil(s / page_size)))
    loc = torch.cat([cache.req_to_token[r, p:s] for r, p, s in zip(rows, prefix, seq)])
    return cache, ForwardBatch.extend(rows, list(prefix), list(ext), loc), rows, seq


def test_batch_kernel_inputs_match_running_sums():
    _, b, _, seq = _problem()
    assert b.qo_indptr().tolist() == [0, 3, 4, 10] and b.qo_indptr().dtype == torch.int32
    assert b.kv_indptr().tolist() == [0, seq[0], seq[0] + seq[1], sum(seq)] and b.kv_indptr().dtype == torch.int32
    assert b.seq_lens_int32().tolist() == seq and b.seq_lens_int32().dtype == torch.int32
    assert (b.max_extend_len, b.max_seq_len) == (6, 23)
    assert b.qo_indptr() is b.qo_indptr()  # built once per forward, shared by every layer
    assert b.kv_indptr().tolist() == [0, 3, 9, 32]
    b.extend_prefix_lens[0], b.seq_lens[0] = 1, 4  # an engine reusing the batch re-validates it: inputs follow
    assert b.validate().kv_indptr().tolist() == [0, 4, 10, 33] and b.max_seq_len == 23
    d = ForwardBatch.decode([1, 0], [7, 2], [3, 4])
    assert d.qo_indptr().tolist() == [0, 1, 2] and d.max_extend_len == 1
    assert ForwardBatch.idle().qo_indptr().tolist() == [0] and ForwardBatch.idle().max_seq_len == 0
    assert indptr([]).tolist() == [0] and indptr(torch.tensor([2, 0, 5])).tolist() == [0, 2, 2, 7]


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_page_table_matches_a_walk_of_req_to_token(page_size):
    cache, b, rows, seq = _problem(page_size=page_size, seed=page_size)
    table = cache.page_table(b)
    width = math.ceil(max(seq) / page_size)
    assert table.dtype == torch.int32 and tuple(table.shape) == (len(seq), width)
    for i, (r, s) in enumerate(zip(rows, seq)):
        want = [int(cache.req_to_token[r, j]) // page_size for j in range(0, s, page_size)]
        assert table[i].tolist() == want + [0] * (width - len(want))
    cache.check_page_aligned(b.req_pool_indices, seq)


def test_misaligned_rows_are_named():
    cache, b, rows, seq = _problem(page_size=4)
    cache.req_to_token[rows[2], 9] += 1  # position 9 = offset 1 of its page: now off by one
    with pytest.raises(ShapeError, match=rf"req_to_token\[{rows[2]}, 9\] .*request 2.*page_size=4"):
        cache.check_page_aligned(b.req_pool_indices, seq)


# -- the base's hooks, through a small real backend ------------------------------------------
@dataclasses.dataclass
class _Meta:
    page_table: torch.Tensor
    seq_lens: torch.Tensor


class _Gathering(PagedBackend):
    """Attends by gathering the page table's slots (new K/V read back from the cache)."""

    capabilities = Capabilities(dtypes=("float32",), cuda_graph=True)
    backend_name = "gathering"
    new_kv_source = "cache"
    computed = 0

    def backend_reasons(self, layer, ctx):
        reasons = [f"num_heads={layer.num_heads} (supported: up to 4)"] if layer.num_heads > 4 else []
        if ctx is not None and ctx.max_batch_size > 8:
            reasons.append(f"max_batch_size={ctx.max_batch_size} (supported: up to 8)")
        return reasons

    def build_metadata(self, batch):
        return _Meta(self.cache.page_table(batch), batch.seq_lens_int32())

    def compute_extend(self, q, k, v, layer, batch, meta):
        type(self).computed += 1
        kb, vb = self.cache.get_kv(layer.layer_id)
        ps, out, t0 = self.cache.page_size, self.empty_output(q, layer), 0
        for i, e in enumerate(batch.extend_seq_lens_cpu):
            n = int(meta.seq_lens[i])
            pos = torch.arange(n)
            slots = meta.page_table[i, pos // ps].long() * ps + pos % ps
            scores = torch.einsum("qhd,khd->hqk", q[t0:t0 + e], kb[slots].repeat_interleave(2, 1)) * layer.scaling
            scores = scores.masked_fill(pos[None, None, :] > (n - e + torch.arange(e))[None, :, None], -math.inf)
            out[t0:t0 + e] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vb[slots].repeat_interleave(2, 1))
            t0 += e
        return out


def _backend(cache, **ctx_kw):
    ctx = BuildContext(AttentionConfig(), HostInfo(platform="cpu"), num_heads=4, num_kv_heads=2, head_dim=8,
                       page_size=cache.page_size, kv_cache=cache, max_context_len=cache.max_context_len, **ctx_kw)
    return _Gathering(ctx)


def test_backend_reasons_join_the_generic_ones_and_the_layer_verdict():
    cache, b, _, _ = _problem()
    be = _backend(cache, max_batch_size=16)
    wide = LayerSpec(0, 8, 2, 8, logit_cap=3.0)
    assert be.not_supported_reasons(wide) == [
        "logit_cap=3.0 is not claimed", "num_heads=8 (supported: up to 4)", "max_batch_size=16 (supported: up to 8)"]
    assert be.layer_reasons(wide) == ["logit_cap=3.0 is not claimed", "num_heads=8 (supported: up to 4)"]
    be.init_forward_metadata(b)
    q, kv = torch.zeros(b.num_tokens, 8, 8), torch.zeros(b.num_tokens, 2, 8)
    with pytest.raises(NotSupportedError, match="'gathering'.*logit_cap=3.0 is not claimed; num_heads=8"):
        be.forward(q, kv, kv, wide, b)


def test_graph_metadata_moves_fields_into_static_buffers():
    cache, b, _, seq = _problem()
    be = _backend(cache)
    bufs = {"page_table": torch.full((4, 8), 99, dtype=torch.int32), "seq_lens": torch.zeros(4, dtype=torch.int32)}
    with pytest.raises(AttnplugError, match="init_cuda_graph_state"):
        be.graph_metadata(b, None)
    meta = be.graph_metadata(b, bufs)
    assert meta is be.forward_metadata(b) and be.metadata_builds == 1
    assert meta.page_table.data_ptr() == bufs["page_table"].data_ptr()
    assert meta.seq_lens.data_ptr() == bufs["seq_lens"].data_ptr() and meta.seq_lens.tolist() == seq
    w = cache.page_table(b).shape[1]
    assert torch.equal(bufs["page_table"][:3, :w], cache.page_table(b)) and not bufs["page_table"][:3, w:].any()
    assert (bufs["page_table"][3] == 99).all()  # rows past the batch untouched
    layer = LayerSpec(0, 4, 2, 8)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b.num_tokens, h, 8, generator=g) for h in (4, 2, 2))
    kb, vb = cache.get_kv(0)
    kb.copy_(torch.randn(kb.shape, generator=g))
    vb.copy_(torch.randn(vb.shape, generator=g))
    want = reference_attention(q, k, v, layer, b, kb.clone(), vb.clone(), cache.req_to_token)
    torch.testing.assert_close(be.forward(q, k, v, layer, b).double(), want, atol=1e-5, rtol=1e-5)
    big, _, _, _ = _problem(prefix=(0, 0, 0, 0, 0), ext=(1, 1, 1, 1, 1))
    _, b5, _, _ = _problem(prefix=(0, 0, 0, 0, 0), ext=(1, 1, 1, 1, 1))
    be5 = _backend(big)
    with pytest.raises(ShapeError, match=r"page_table of shape \(5, 1\) .*exceeds its CUDA-graph buffer \(4, 8\)"):
        be5.graph_metadata(b5, bufs)
    with pytest.raises(MetadataNotInitializedError):  # no forward runs on half-moved metadata
        be5.forward_metadata(b5)


def test_zero_token_forward_returns_empty_without_computing_or_writing():
    cache, _, rows, _ = _problem()
    b = ForwardBatch.extend(rows[:2], [3, 6], [0, 0], torch.zeros(0, dtype=torch.int64))
    be = _backend(cache)
    be.init_forward_metadata(b)
    before, _Gathering.computed = cache.k_buffers[0].clone(), 0
    z = torch.zeros(0, 4, 8)
    out = be.forward(z, torch.zeros(0, 2, 8), torch.zeros(0, 2, 8), LayerSpec(0, 4, 2, 8), b)
    assert out.shape == (0, 4, 8) and _Gathering.computed == 0 and torch.equal(cache.k_buffers[0], before)
    assert b.forward_mode is ForwardMode.EXTEND
