"""A decode batch made from host ints is checked from those ints (issue 30, round 5).

``ForwardBatch.decode`` given plain ints (what the transformers runner and vLLM hold) makes its tensors from
them and keeps private copies; ``ForwardBatch.host_ints`` returns the copies only while ``req_pool_indices``,
``seq_lens`` and ``out_cache_loc`` are still the very tensors made from them, never written since (write
counters) and the host copies ``req_pool_indices_cpu`` / ``seq_lens_cpu`` still equal them.
``PagedKVCache.check_batch`` then bounds rows, lengths and slots on those ints instead of reading three tensors
back (``kvcache._USE_HOST_INTS``; each test switches it off on the same batch for comparison: same words).
"""

from __future__ import annotations

import pytest
import torch

from attnplug import ForwardBatch, PagedKVCache
from attnplug import kvcache as kv
from test_host_int_bounds import _error

PAGE = 4
NUM_PAGES = 40  # 160 slots
ROWS = 3
MAX_LEN = 64


def _cache() -> PagedKVCache:
    cache = PagedKVCache(num_layers=1, num_pages=NUM_PAGES, num_kv_heads=1, head_dim=8, page_size=PAGE,
                         max_requests=ROWS, max_context_len=MAX_LEN)
    for r in range(ROWS):  # every row's positions mapped (to slots r * MAX_LEN // 2 + position, in range)
        cache.req_to_token[r, :MAX_LEN] = (torch.arange(MAX_LEN) + r * 40) % cache.num_slots
    return cache


def _both(monkeypatch, make, spoil=None) -> str | None:
    """``check_batch``'s error for a fresh batch from ``make`` (spoiled by ``spoil``) with the host ints
    used, checked equal to the error with them switched off (a fresh batch, spoiled alike)."""
    cache = _cache()
    batch = make()
    if spoil is not None:
        spoil(batch, cache)
    fast = _error(lambda: cache.check_batch(batch))
    cache = _cache()
    batch = make()
    if spoil is not None:
        spoil(batch, cache)
    with monkeypatch.context() as m:
        m.setattr(kv, "_USE_HOST_INTS", False)
        slow = _error(lambda: cache.check_batch(batch))
    assert fast == slow
    return fast


BATCHES = {
    "one request": lambda: ForwardBatch.decode([1], [9], [48]),
    "three requests": lambda: ForwardBatch.decode([2, 0, 1], [5, 1, 30], [84, 0, 69]),
    "first and last slot": lambda: ForwardBatch.decode([0, 1], [64, 1], [159, 0]),
}


@pytest.mark.parametrize("name", BATCHES)
def test_a_good_host_made_batch_is_accepted_on_its_ints(monkeypatch, name):
    make = BATCHES[name]
    assert make().host_ints() is not None
    assert _both(monkeypatch, make) is None


BAD = {
    "row past the rows": (lambda: ForwardBatch.decode([0, ROWS], [5, 5], [4, 44]), "req_pool_indices[1]=3"),
    "slot past the slots": (lambda: ForwardBatch.decode([0, 1], [5, 5], [4, 160]), "out_cache_loc[1]=160"),
    "far slot": (lambda: ForwardBatch.decode([1], [5], [10 ** 12]), "out_cache_loc[0]=1000000000000"),
    "length past max_context_len": (lambda: ForwardBatch.decode([1, 0], [5, MAX_LEN + 1], [44, 4]),
                                    "seq_lens=65 exceeds"),
}


@pytest.mark.parametrize("name", BAD)
def test_a_bad_host_made_batch_is_refused_with_the_tensor_paths_words(monkeypatch, name):
    make, words = BAD[name]
    got = _both(monkeypatch, make)
    assert got is not None and words in got


def _write(field, value):
    def spoil(batch, cache):
        getattr(batch, field)[0] = value
    return spoil


def _unmap(batch, cache):
    cache.req_to_token[1, 3] = -1


def _wild_entry(batch, cache):
    cache.req_to_token[1, 0] = cache.num_slots


SPOILED = {
    # written in place after the batch was made: the ints are stale, the tensors are what the kernels read
    "out_cache_loc written": (_write("out_cache_loc", 500), "out_cache_loc[0]=500"),
    "req_pool_indices written": (_write("req_pool_indices", 7), "req_pool_indices[0]=7"),
    "seq_lens written": (_write("seq_lens", MAX_LEN + 3), "seq_lens=67 exceeds"),
    "out_cache_loc replaced": (lambda b, c: setattr(b, "out_cache_loc", torch.tensor([-2])), "out_cache_loc[0]=-2"),
    "req_pool_indices replaced": (lambda b, c: setattr(b, "req_pool_indices", torch.tensor([9])),
                                  "req_pool_indices[0]=9"),
    # the prefix entries are read from req_to_token as before
    "prefix entry unassigned": (_unmap, "position 3"),
    "prefix entry out of range": (_wild_entry, "position 0"),
}


@pytest.mark.parametrize("name", SPOILED)
def test_a_batch_changed_after_it_was_made_is_refused_as_on_the_tensor_path(monkeypatch, name):
    spoil, words = SPOILED[name]
    got = _both(monkeypatch, lambda: ForwardBatch.decode([1], [9], [48]), spoil)
    assert got is not None and words in got, got


def _cpu_copy(field, value):
    def spoil(batch):
        setattr(batch, field, value)
    return spoil


@pytest.mark.parametrize("spoil", [
    _write("out_cache_loc", 3), _write("seq_lens", 4), _write("req_pool_indices", 0),
    lambda b: setattr(b, "seq_lens", torch.tensor([9])),
    _cpu_copy("seq_lens_cpu", [10]), _cpu_copy("req_pool_indices_cpu", [0]),
    lambda b: b.seq_lens_cpu.append(3),
], ids=["loc written", "seq written", "rows written", "seq replaced", "seq_lens_cpu replaced",
        "req_pool_indices_cpu replaced", "seq_lens_cpu appended to"])
def test_host_ints_are_not_offered_once_a_field_or_host_copy_changed(spoil):
    batch = ForwardBatch.decode([1], [9], [48])
    assert batch.host_ints() == ([1], [9], [48])
    if spoil.__code__.co_argcount == 2:
        spoil(batch, None)
    else:
        spoil(batch)
    assert batch.host_ints() is None


@pytest.mark.parametrize("make", [
    lambda: ForwardBatch.decode(torch.tensor([1]), torch.tensor([9]), torch.tensor([48])),
    lambda: ForwardBatch.extend([1], [8], [1], torch.tensor([48])),
    lambda: ForwardBatch.decode([1], [9], torch.tensor([48])),
], ids=["tensors", "extend", "mixed ints and a tensor"])
def test_only_a_batch_made_from_host_ints_offers_them(make):
    assert make().host_ints() is None


def test_host_ints_hold_under_inference_mode_and_a_later_write_is_seen():
    with torch.inference_mode():
        batch = ForwardBatch.decode([1, 2], [9, 4], [48, 83])
        assert batch.host_ints() == ([1, 2], [9, 4], [48, 83])
        batch.out_cache_loc[1] = 5  # an in-place write under inference mode still moves the counter
        assert batch.host_ints() is None
