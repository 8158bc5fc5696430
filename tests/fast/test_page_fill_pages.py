"""``PagedKVCache.fill_from_pages``: ``fill_from_page_table`` for a host holding its page lists as ints (the
transformers cache adapter, issue 30 round 7).

What it must keep: the same entries and the same ``PageFill`` record as ``fill_from_page_table`` for the
positions it covers (so every per-forward check answers the same, with and without the record); the same
refusal of a bad used block id (a ``ShapeError`` naming the request, the page, the id and the bound, nothing
written); a record voided by any torch write. What it adds: it writes only what the last fill's (valid) record
does not already hold — nothing for a decode step that opened no page, only the new pages for one that did — and
never a row with no positions or a position past a row's last page (the host's unassigned marks stay). A fill
that trusted a stale record (its counter not asked) or skipped pages it should write makes the
write-after-fill families fail.
"""

from __future__ import annotations

import pytest
import torch

from attnplug import ForwardBatch, PagedKVCache, ShapeError

PAGE = 4
NUM_PAGES = 40
ROWS = 6
MAX_LEN = 64


def _cache(max_len: int = MAX_LEN) -> PagedKVCache:
    cache = PagedKVCache(num_layers=1, num_pages=NUM_PAGES, num_kv_heads=1, head_dim=8, page_size=PAGE,
                         max_requests=ROWS, max_context_len=max_len)
    cache.req_to_token.fill_(-1)  # the transformers adapter's "unassigned"
    return cache


def _blocks(lens, seed=0, extra=0):
    """Distinct block ids, ``ceil(len / PAGE) + extra`` per request (``extra``: pages not yet used)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(NUM_PAGES, generator=g).tolist()
    out = []
    for x in lens:
        u = -(-x // PAGE) + extra
        out.append(ids[:u])
        ids = ids[u:]
    return out


def _expected(cache: PagedKVCache, blocks, lens) -> torch.Tensor:
    """``req_to_token`` as the fill must leave it: each row's used pages whole (up to ``max_context_len``), the
    rest as it was (-1)."""
    want = torch.full_like(cache.req_to_token, -1)
    for i, (ids, x) in enumerate(zip(blocks, lens)):
        u = -(-x // PAGE)
        slots = [b * PAGE + o for b in ids[:u] for o in range(PAGE)][:cache.max_context_len]
        if slots:
            want[i, :len(slots)] = torch.tensor(slots)
    return want


LENS = {
    "three requests": [5, 17, 8],
    "one": [1],
    "whole pages": [4, 4, 4, 4],
    "an empty row between": [9, 0, 3],
    "up to max_context_len": [64, 1, 33],
    "six": [12, 3, 64, 7, 1, 2],
}


@pytest.mark.parametrize("name", sorted(LENS))
def test_the_same_entries_and_table_as_fill_from_page_table_where_it_covers(name):
    lens = LENS[name]
    blocks = _blocks(lens, extra=1)  # a page more than used: never read, never written
    a, b = _cache(), _cache()
    rec = a.fill_from_pages(blocks, lens)
    width = max(len(x) for x in blocks)
    table = torch.tensor([x + [10 ** 6] * (width - len(x)) for x in blocks], dtype=torch.int32)  # junk past use
    ref = b.fill_from_page_table(table, lens)
    assert torch.equal(a.req_to_token, _expected(a, blocks, lens))
    for i, x in enumerate(lens):  # the covered positions: what fill_from_page_table wrote
        assert torch.equal(a.req_to_token[i, :x], b.req_to_token[i, :x])
    assert rec is a.page_fill() and torch.equal(rec.table, ref.table)
    assert rec.lens == ref.lens and rec.pages == ref.pages and rec.blocks == ref.blocks
    rows = [i for i, x in enumerate(lens) if x]
    batch = ForwardBatch.decode(rows, [lens[i] for i in rows], [rec.slot(i, lens[i] - 1, PAGE) for i in rows])
    for cache in (a, b):  # every per-forward check answers on the record
        assert cache.page_fill(batch.req_pool_indices_cpu, batch.seq_lens_cpu) is not None
        cache.check_batch(batch, new_tokens_mapped=True)
        cache.check_page_aligned(batch.req_pool_indices_cpu, batch.seq_lens_cpu)
    assert torch.equal(a.page_table(batch), b.page_table(batch))


@pytest.mark.parametrize("max_len,lens", [(63, [63, 1, 61]), (62, [62, 60]), (3, [3, 1])])
def test_a_row_shorter_than_its_last_page_is_filled_up_to_its_end(max_len, lens):
    cache = _cache(max_len)
    blocks = _blocks(lens)
    cache.fill_from_pages(blocks, lens)
    assert torch.equal(cache.req_to_token, _expected(cache, blocks, lens))


@pytest.mark.parametrize("value", [-1, -7, NUM_PAGES, 10 ** 9])
@pytest.mark.parametrize("request_i", [0, 1, 2], ids=["first", "middle", "last"])
@pytest.mark.parametrize("page", ["first", "last_used"])
@pytest.mark.parametrize("after_a_fill", [False, True])
def test_a_bad_used_block_id_is_refused_naming_request_page_block_and_bound(value, request_i, page, after_a_fill):
    lens = [5, 17, 8]
    blocks = _blocks(lens)
    cache = _cache()
    if after_a_fill:  # a valid record first: the bad id is in a page it does not hold
        cache.fill_from_pages(blocks, lens)
    j = 0 if page == "first" else len(blocks[request_i]) - 1
    bad = [list(x) for x in blocks]
    bad[request_i][j] = value
    before = cache.req_to_token.clone()
    with pytest.raises(ShapeError, match=rf"fill_from_pages: request {request_i}: page {j} is block {value}, which "
                                         rf"is out of range \(expected 0 <= block < num_pages={NUM_PAGES}\); "
                                         rf"nothing was written"):
        cache.fill_from_pages(bad, lens)
    assert torch.equal(cache.req_to_token, before) and cache.page_fill() is None


@pytest.mark.parametrize("value", [-1, NUM_PAGES, 10 ** 9])
def test_a_bad_block_id_past_the_used_pages_is_not_read(value):
    lens = [5, 8]
    blocks = [x + [value] for x in _blocks(lens)]
    cache = _cache()
    rec = cache.fill_from_pages(blocks, lens)
    assert torch.equal(cache.req_to_token, _expected(cache, blocks, lens)) and rec.blocks == [x[:-1] for x in blocks]


@pytest.mark.parametrize("blocks,lens,words", [
    ([[1]], [5], r"request 0 needs 2 pages for 5 positions, but its page list has 1"),
    ([[1], [2]], [1, 65], r"request 1: length 65 is out of range \(expected 0 <= length <= max_context_len=64\)"),
    ([[1]], [-1], r"request 0: length -1 is out of range"),
    ([[1]] * 7, [1] * 7, r"7 requests, but req_to_token has 6 rows and 7 page lists"),
    ([[1]], [1, 1], r"2 requests, but req_to_token has 6 rows and 1 page lists"),
])
def test_a_fill_that_does_not_fit_is_refused_naming_what(blocks, lens, words):
    cache = _cache()
    with pytest.raises(ShapeError, match="fill_from_pages: " + words):
        cache.fill_from_pages(blocks, lens)
    assert bool((cache.req_to_token == -1).all())


@pytest.mark.parametrize("inference", [True, False])
def test_decode_steps_write_only_the_pages_they_open(inference):
    """Each request one position longer per step, its pages already listed: the entries and table equal a
    fill from nothing every step, and ``req_to_token``'s counter moves once per request that opened a page."""
    lens = [3, 0, 6]
    blocks = _blocks([x + 9 for x in lens])  # pages for 9 more positions each
    cache = _cache()
    with torch.inference_mode(inference):
        cache.fill_from_pages(blocks, lens)
        for _ in range(9):
            opened = sum(1 for x in lens if x and x % PAGE == 0)  # position x starts a page
            lens = [x + 1 if x else 0 for x in lens]
            before = cache.req_to_token._version
            rec = cache.fill_from_pages(blocks, lens)
            assert cache.req_to_token._version - before == opened
            fresh = _cache()
            fresh.fill_from_pages(blocks, lens)
            assert torch.equal(cache.req_to_token, fresh.req_to_token)
            assert torch.equal(rec.table, fresh.page_fill().table)
            assert cache.page_fill([0, 2], [lens[0], lens[2]]) is rec


@pytest.mark.parametrize("write", ["a torch write (no value changed)", "an entry corrupted", "the table written"])
def test_a_fill_after_a_write_writes_every_used_page_again(write):
    lens = [5, 9]
    blocks = _blocks([x + 4 for x in lens])
    cache = _cache()
    rec = cache.fill_from_pages(blocks, lens)
    if write == "a torch write (no value changed)":
        cache.req_to_token.add_(0)
    elif write == "an entry corrupted":
        cache.req_to_token[1, 2] = 10 ** 6
    else:
        rec.table.add_(0)
    # (not asked through ``page_fill`` here: that would drop the stale record before the fill sees it)
    cache.fill_from_pages(blocks, [6, 10])  # no page opened: with a valid record it would write nothing
    assert torch.equal(cache.req_to_token, _expected(cache, blocks, [6, 10]))
    assert cache.page_fill([0, 1], [6, 10]) is not None


def test_a_valid_record_of_other_pages_is_not_trusted_for_them():
    """A row whose recorded pages differ from the new ones (another request took the row) is written whole."""
    lens = [5, 9]
    a, b = _blocks(lens, seed=1), _blocks(lens, seed=2)
    cache = _cache()
    cache.fill_from_pages(a, lens)
    cache.fill_from_pages(b, lens)
    assert torch.equal(cache.req_to_token, _expected(cache, b, lens))


def test_an_empty_row_and_positions_past_the_last_page_keep_their_marks():
    cache = _cache()
    cache.fill_from_pages([[3, 4], [], [7]], [5, 0, 2])
    r2t = cache.req_to_token
    assert bool((r2t[1] == -1).all()) and bool((r2t[0, 8:] == -1).all()) and bool((r2t[2, 4:] == -1).all())
    assert bool((r2t[3:] == -1).all())
