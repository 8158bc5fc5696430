"""The bounds checks of a small forward read their values as host ints (issue 30, round 4).

``PagedKVCache.check_slots`` (up to ``_HOST_CHECK_VALUES`` slots) and ``check_batch``'s read of one request's
short prefix take ``tolist`` and Python's ``min``/``max`` instead of ``aminmax`` and two syncs. The same values
are refused with the same words as on the tensor path, which each test switches back on for comparison
(``_HOST_CHECK_VALUES = 0``); past the threshold the tensor path runs as before.
"""

from __future__ import annotations

import pytest
import torch

from attnplug import ForwardBatch, PagedKVCache, ShapeError
from attnplug import kvcache as kv

PAGE = 4
NUM_PAGES = 160  # 640 slots


def _cache() -> PagedKVCache:
    return PagedKVCache(num_layers=1, num_pages=NUM_PAGES, num_kv_heads=1, head_dim=8, page_size=PAGE,
                        max_requests=2, max_context_len=NUM_PAGES * PAGE)


def _error(fn) -> str | None:
    try:
        fn()
    except ShapeError as exc:
        return str(exc)
    return None


def _both_paths(monkeypatch, fn) -> str | None:
    """``fn``'s error on the host-int path, checked equal to the tensor path's."""
    host = _error(fn)
    with monkeypatch.context() as m:
        m.setattr(kv, "_HOST_CHECK_VALUES", 0)
        tensor = _error(fn)
    assert host == tensor
    return host


@pytest.mark.parametrize("n", [1, 3, 256, 257, 600])
@pytest.mark.parametrize("where", ["first", "middle", "last"])
@pytest.mark.parametrize("bad", [-1, -(10 ** 12), "num_slots", 10 ** 12])
def test_check_slots_refuses_a_bad_slot_with_the_same_words_on_both_paths(monkeypatch, n, where, bad):
    cache = _cache()
    bad = cache.num_slots if bad == "num_slots" else bad
    loc = torch.arange(n, dtype=torch.int64) % cache.num_slots
    pos = {"first": 0, "middle": n // 2, "last": n - 1}[where]
    loc[pos] = bad
    got = _both_paths(monkeypatch, lambda: cache.check_slots(loc))
    assert got == f"out_cache_loc[{pos}]={bad} is out of range (expected 0 <= slot < num_slots={cache.num_slots})"


@pytest.mark.parametrize("n", [1, 256, 600])
def test_check_slots_accepts_every_slot_in_range(monkeypatch, n):
    cache = _cache()
    loc = torch.cat([torch.tensor([0, cache.num_slots - 1]), torch.arange(n) % cache.num_slots])
    assert _both_paths(monkeypatch, lambda: cache.check_slots(loc)) is None


@pytest.mark.parametrize("prefix", [1, 5, 256, 257, 500])
@pytest.mark.parametrize("where", ["first", "last"])
@pytest.mark.parametrize("bad", [-1, "num_slots", 10 ** 12, None])
def test_a_decode_requests_prefix_is_checked_alike_on_both_paths(monkeypatch, prefix, where, bad):
    # one request (the batch-1 decode step): its cached entries are read as host ints up to the threshold;
    # an unassigned or wild entry is named by request, position and value exactly as the vectorised pass does
    cache = _cache()
    cache.req_to_token[1, :prefix + 1] = torch.arange(prefix + 1) + 3
    if bad is not None:
        pos = 0 if where == "first" else prefix - 1
        cache.req_to_token[1, pos] = cache.num_slots if bad == "num_slots" else bad
    batch = ForwardBatch.decode([1], [prefix + 1], [prefix + 3])
    got = _both_paths(monkeypatch, lambda: cache.check_batch(batch))
    if bad is None:
        assert got is None
    else:
        value = cache.num_slots if bad == "num_slots" else bad
        assert got is not None and f"request 0 (req_to_token row 1): position {pos} < seq/prefix length {prefix} " \
            f"maps to slot {value}" in got
