"""Batch validation and the paged cache: errors name the field, expected vs actual."""

from __future__ import annotations

import pytest
import torch

from attnplug import ForwardBatch, ForwardMode, LayerSpec, PageAllocator, PagedKVCache, ShapeError
from attnplug.batch import check_qkv


def test_decode_and_extend_constructors_fill_host_copies():
    b = ForwardBatch.decode([2, 0], [5, 3], [10, 11])
    assert b.extend_prefix_lens_cpu == [4, 2] and b.extend_seq_lens_cpu == [1, 1]
    assert b.positions.tolist() == [4, 2]
    e = ForwardBatch.extend([0, 1], [3, 0], [2, 4], list(range(6)))
    assert e.seq_lens.tolist() == [5, 4]
    assert e.positions.tolist() == [3, 4, 0, 1, 2, 3]
    assert ForwardBatch.idle().num_tokens == 0


@pytest.mark.parametrize(
    "make,field",
    [
        (lambda: ForwardBatch.decode([0, 1], [3], [1, 2]), r"req_pool_indices has shape \(2,\), expected \(1,\)"),
        (lambda: ForwardBatch.decode([0], [3], [1, 2]), "out_cache_loc"),
        (lambda: ForwardBatch.extend([0], [2], [3], [1, 2]), "out_cache_loc"),
        (lambda: ForwardBatch(ForwardMode.EXTEND, torch.tensor([0]), torch.tensor([5]), torch.tensor([1]),
                              torch.tensor([2]), torch.tensor([1])).validate(), "seq_lens=5"),
        (lambda: ForwardBatch.extend([0], [2], [2], [1, 2], mode=ForwardMode.TARGET_VERIFY,
                                     spec_num_draft_tokens=3), "spec_num_draft_tokens=3"),
        (lambda: ForwardBatch.extend([0], [2], [2], [1, 2], mode=ForwardMode.TARGET_VERIFY,
                                     spec_num_draft_tokens=2, spec_custom_mask=torch.ones(1, 3, 3)),
         "spec_custom_mask"),
        (lambda: ForwardBatch(ForwardMode.EXTEND, torch.tensor([0]), torch.tensor([1]), torch.tensor([0]))
         .validate(), "extend_prefix_lens"),
    ],
)
def test_batch_errors_name_the_field(make, field):
    with pytest.raises(ShapeError, match=field):
        make()


def test_check_qkv_says_expected_vs_actual():
    layer = LayerSpec(layer_id=3, num_heads=4, num_kv_heads=2, head_dim=8, v_head_dim=4)
    q, k, v = torch.zeros(5, 4, 8), torch.zeros(5, 2, 8), torch.zeros(5, 2, 4)
    check_qkv(q, k, v, layer, 5)
    check_qkv(q, None, None, layer, 5)
    with pytest.raises(ShapeError, match=r"q has shape \(5, 4, 8\), expected \(6, 4, 8\)"):
        check_qkv(q, k, v, layer, 6)
    with pytest.raises(ShapeError, match=r"v has shape \(5, 2, 8\), expected \(5, 2, 4\)"):
        check_qkv(q, k, torch.zeros(5, 2, 8), layer, 5)
    with pytest.raises(ShapeError, match="dtypes differ"):
        check_qkv(q, k.half(), v, layer, 5)
    with pytest.raises(ShapeError, match="both"):
        check_qkv(q, k, None, layer, 5)


def test_layer_spec_validates_and_defaults():
    layer = LayerSpec(layer_id=0, num_heads=8, num_kv_heads=2, head_dim=16)
    assert layer.v_head_dim == 16 and layer.scaling == pytest.approx(0.25) and layer.gqa_group_size == 4
    with pytest.raises(ValueError, match="num_kv_heads=3"):
        LayerSpec(layer_id=0, num_heads=8, num_kv_heads=3, head_dim=16)
    with pytest.raises(ValueError, match="sinks"):
        LayerSpec(layer_id=0, num_heads=8, num_kv_heads=2, head_dim=16, sinks=torch.zeros(4))


def test_paged_cache_assigns_scattered_pages_and_writes_slots():
    cache = PagedKVCache(2, num_pages=8, num_kv_heads=2, head_dim=4, page_size=4, max_requests=2,
                         max_context_len=16)
    pages = PageAllocator(8, seed=1).alloc(3)
    cache.assign_pages(1, 10, pages)
    slots = cache.slots(1, 0, 10).tolist()
    assert slots == [pages[i // 4] * 4 + i % 4 for i in range(10)]
    k = torch.randn(2, 2, 4)
    cache.set_kv(1, torch.tensor(slots[8:10]), k, k * 2)
    kb, vb = cache.get_kv(1)
    assert torch.equal(kb[slots[8:10]], k) and torch.equal(vb[slots[8:10]], 2 * k)
    assert kb.abs().sum() == k.abs().sum()  # nothing else written
    assert cache.get_kv(0)[0].abs().sum() == 0  # other layer untouched
    with pytest.raises(ShapeError, match="layer 0"):
        cache.set_kv(0, torch.tensor([0]), torch.zeros(1, 3, 4), torch.zeros(1, 3, 4))
    with pytest.raises(RuntimeError, match="out of KV-cache pages"):
        PageAllocator(2).alloc(3)


def test_staged_write_keeps_or_restores_the_rows():
    cache = PagedKVCache(1, num_pages=4, num_kv_heads=1, head_dim=2, page_size=2)
    loc = torch.tensor([1, 3])
    k = torch.ones(2, 1, 2)
    with cache.staged(0, loc, k, 2 * k, keep=False):
        assert torch.equal(cache.get_kv(0)[0][loc], k)  # visible to the kernel inside the block
    assert cache.get_kv(0)[0].abs().sum() == 0 and cache.get_kv(0)[1].abs().sum() == 0
    with cache.staged(0, loc, keep=False):  # a kernel that writes the rows itself
        cache.get_kv(0)[0][loc] = 5.0
    assert cache.get_kv(0)[0].abs().sum() == 0
    with cache.staged(0, loc, k, 2 * k):
        pass
    assert torch.equal(cache.get_kv(0)[1][loc], 2 * k)
