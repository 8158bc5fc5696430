"""``PagedKVCache.fill_from_page_table``: rows filled whole pages at a time from a host's page table, and the
record the per-forward checks consult (issue 23, round 5).

The fill checks each request's *used* block ids (its first ``ceil(len / page_size)`` columns) in
``[0, num_pages)`` and records what it wrote; while ``req_to_token``'s write counter is unmoved,
``check_batch``, ``check_page_aligned`` and ``page_table`` take the covered entries as in range and
page-aligned by construction instead of reading each one. Every test here runs the same batch on a cache
holding the record and on one holding the same entries without it (voided by a no-op torch write): the
same answer (the same table, or the same error words). A record trusted wrongly (its counter ignored, its
rows or lengths not compared) makes the write-after-fill and not-covered families fail.
"""

from __future__ import annotations

import pytest
import torch

from attnplug import ForwardBatch, PagedKVCache, ShapeError
from attnplug import kvcache as kv

PAGE = 4
NUM_PAGES = 40
ROWS = 6
MAX_LEN = 64
LENS = [5, 17, 8]  # 2, 5 and 2 pages; column 4 used by request 1 only


def _cache() -> PagedKVCache:
    return PagedKVCache(num_layers=1, num_pages=NUM_PAGES, num_kv_heads=1, head_dim=8, page_size=PAGE,
                        max_requests=ROWS, max_context_len=MAX_LEN)


def _table(lens=LENS, width=8, seed=0, unused=10 ** 6) -> torch.Tensor:
    """int32 ``[n, width]``: distinct block ids in the used columns, ``unused`` (out of range) past them."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(NUM_PAGES, generator=g).tolist()
    rows = []
    for x in lens:
        u = -(-x // PAGE)
        rows.append(ids[:u] + [unused] * (width - u))
        ids = ids[u:]
    return torch.tensor(rows, dtype=torch.int32)


def _void(cache: PagedKVCache) -> None:
    """A torch write that changes no value: the record is void, the entries are the same."""
    cache.req_to_token.add_(0)


def _pair(lens=LENS, before=None):
    """Two caches with the same entries: the first holds the fill's record, the second's is voided."""
    out = []
    for _ in range(2):
        cache = _cache()
        if before is not None:
            before(cache)
        cache.fill_from_page_table(_table(lens), lens)
        out.append(cache)
    _void(out[1])
    assert out[0].page_fill() is not None and out[1].page_fill() is None
    assert torch.equal(out[0].req_to_token, out[1].req_to_token)
    return out


def _answer(fn):
    try:
        res = fn()
    except ShapeError as exc:
        return ("error", str(exc))
    return ("ok", None if res is None else res.tolist())


def _checks(cache: PagedKVCache, batch: ForwardBatch, mapped: bool):
    """What every per-forward check the record may shortcut answers for ``batch`` on ``cache``."""
    return [
        _answer(lambda: cache.check_batch(batch, new_tokens_mapped=mapped)),
        _answer(lambda: cache.check_page_aligned(batch.req_pool_indices_cpu, batch.seq_lens_cpu, who="x")),
        _answer(lambda: cache.page_table(batch)),
    ]


def _decode(cache, rows, lens):
    return ForwardBatch.decode(rows, lens, [int(cache.req_to_token[r, x - 1]) for r, x in zip(rows, lens)])


# -- the counter: a normal tensor, moved by writes under inference mode ------------------------------------
WRITES = {
    "index assignment": lambda c: c.req_to_token.__setitem__((0, 3), 7),
    "a view's copy_": lambda c: c.req_to_token[1, :4].copy_(torch.arange(4)),
    "fill_": lambda c: c.req_to_token.fill_(-1),
    "assign_pages": lambda c: c.assign_pages(2, 6, [3, 4]),
    "release": lambda c: c.release(0),
    "fill_from_page_table": lambda c: c.fill_from_page_table(_table(), LENS),
    "add_ of zero": _void,
}


@pytest.mark.parametrize("made_under_inference", [True, False])
@pytest.mark.parametrize("write", WRITES)
def test_req_to_token_keeps_a_write_counter_that_writes_under_inference_mode_move(write, made_under_inference):
    if made_under_inference:
        with torch.inference_mode():
            cache = _cache()
    else:
        cache = _cache()
    assert not cache.req_to_token.is_inference()
    with torch.inference_mode():
        before = cache.req_to_token._version
        WRITES[write](cache)
        assert cache.req_to_token._version > before


@pytest.mark.parametrize("write", [w for w in WRITES if w != "fill_from_page_table"])
def test_any_torch_write_after_the_fill_voids_the_record(write):
    cache = _cache()
    with torch.inference_mode():
        cache.fill_from_page_table(_table(), LENS)
        assert cache.page_fill([0, 1, 2], LENS) is not None
        WRITES[write](cache)
    assert cache.page_fill() is None and cache.page_fill([0, 1, 2], LENS) is None


def test_a_replaced_req_to_token_voids_the_record():
    cache = _cache()
    cache.fill_from_page_table(_table(), LENS)
    cache.req_to_token = cache.req_to_token.clone()
    assert cache.page_fill() is None


# -- what the fill writes and records ------------------------------------------------------------------------
@pytest.mark.parametrize("lens", [LENS, [1], [4, 4, 4, 4], [64, 1, 33], [0, 9], [12, 3, 64, 7, 1, 2]])
@pytest.mark.parametrize("host", [True, False], ids=["host_ints", "tensor_ops"])
def test_the_fill_writes_each_used_page_and_records_its_table(lens, host, monkeypatch):
    if not host:
        monkeypatch.setattr(kv, "_FILL_HOST_ENTRIES", 0)
    cache = _cache()
    table = _table(lens, width=16)
    rec = cache.fill_from_page_table(table, lens)
    for i, x in enumerate(lens):
        pos = torch.arange(x)
        want = table[i].long()[pos // PAGE] * PAGE + pos % PAGE
        assert torch.equal(cache.req_to_token[i, :x], want)
    assert (rec.blocks is not None) == host
    assert rec.table.dtype == torch.int32
    rows = [i for i, x in enumerate(lens) if x]
    if rows:  # the recorded table is page_table's answer over the same entries without the record
        batch = _decode(cache, rows, [lens[r] for r in rows])
        got = cache.page_table(batch)
        _void(cache)
        assert torch.equal(got, cache.page_table(batch))


@pytest.mark.parametrize("max_len,lens", [(63, [63, 1, 61]), (62, [62, 60]), (3, [3, 1])])
def test_a_row_shorter_than_its_last_page_is_filled_up_to_its_end(max_len, lens):
    cache = PagedKVCache(num_layers=1, num_pages=NUM_PAGES, num_kv_heads=1, head_dim=8, page_size=PAGE,
                         max_requests=ROWS, max_context_len=max_len)
    table = _table(lens, width=16)
    cache.fill_from_page_table(table, lens)
    for i, x in enumerate(lens):
        pos = torch.arange(x)
        assert torch.equal(cache.req_to_token[i, :x], table[i].long()[pos // PAGE] * PAGE + pos % PAGE)
    assert cache.page_fill(list(range(len(lens))), lens) is not None


@pytest.mark.parametrize("value", [-1, -7, NUM_PAGES, 10 ** 9])
@pytest.mark.parametrize("request_i", [0, 1, 2], ids=["first", "middle", "last"])
@pytest.mark.parametrize("column", ["first", "last_used"])
@pytest.mark.parametrize("host", [True, False], ids=["host_ints", "tensor_ops"])
def test_a_bad_used_block_id_is_refused_naming_request_column_block_and_bound(value, request_i, column, host,
                                                                              monkeypatch):
    if not host:
        monkeypatch.setattr(kv, "_FILL_HOST_ENTRIES", 0)
    cache = _cache()
    table = _table()
    j = 0 if column == "first" else -(-LENS[request_i] // PAGE) - 1
    table[request_i, j] = value
    cache.req_to_token[4, :3] = torch.tensor([0, 1, 2])  # an earlier row mapping, left as it was
    before = cache.req_to_token.clone()
    with pytest.raises(ShapeError) as err:
        cache.fill_from_page_table(table, LENS)
    assert str(err.value) == (
        f"fill_from_page_table: request {request_i}: page table column {j} holds block {value}, which is out of "
        f"range (expected 0 <= block < num_pages={NUM_PAGES}); nothing was written")
    assert torch.equal(cache.req_to_token, before) and cache.page_fill() is None


@pytest.mark.parametrize("value", [-1, NUM_PAGES, 10 ** 9])
@pytest.mark.parametrize("request_i", [0, 2])
@pytest.mark.parametrize("host", [True, False], ids=["host_ints", "tensor_ops"])
def test_a_bad_block_id_in_an_unused_column_is_not_refused(value, request_i, host, monkeypatch):
    """vLLM's block table holds stale ids past a request's pages: never read, never refused; the recorded
    table holds 0 there (``page_table``'s form)."""
    if not host:
        monkeypatch.setattr(kv, "_FILL_HOST_ENTRIES", 0)
    cache = _cache()
    table = _table(unused=value)
    rec = cache.fill_from_page_table(table, LENS)
    u = -(-LENS[request_i] // PAGE)
    assert rec.table[request_i, u:].tolist() == [0] * (rec.table.shape[1] - u)
    assert cache.page_fill([0, 1, 2], LENS) is rec


@pytest.mark.parametrize("lens,table,words", [
    ([MAX_LEN + 1], torch.zeros(1, 20, dtype=torch.int32), "request 0: length 65 is out of range"),
    ([-1], torch.zeros(1, 2, dtype=torch.int32), "request 0: length -1 is out of range"),
    ([4] * (ROWS + 1), torch.zeros(ROWS + 1, 2, dtype=torch.int32), "7 requests, but req_to_token has 6 rows"),
    ([4, 4], torch.zeros(1, 2, dtype=torch.int32), "and the page table 1"),
    ([9], torch.zeros(1, 2, dtype=torch.int32), "request 0 needs 3 pages for 9 positions, but the page table has 2"),
    ([4], torch.zeros(1, 2, dtype=torch.float32), "expected a 2-D integer tensor"),
    ([4], torch.zeros(2, dtype=torch.int32), "expected a 2-D integer tensor"),
])
def test_a_fill_that_does_not_fit_is_refused_naming_what(lens, table, words):
    cache = _cache()
    before = cache.req_to_token.clone()
    with pytest.raises(ShapeError, match=words):
        cache.fill_from_page_table(table, lens)
    assert torch.equal(cache.req_to_token, before) and cache.page_fill() is None


# -- the checks: the same answers with the record and without it ----------------------------------------------
def _same(make_batch, mapped, spoil=None, lens=LENS, before=None, expect_record=None):
    with_rec, without = _pair(lens, before)
    answers = []
    for cache in (with_rec, without):
        if spoil is not None:
            spoil(cache)
        batch = make_batch(cache)
        answers.append(_checks(cache, batch, mapped))
    if expect_record is not None:
        batch = make_batch(with_rec)
        rows, seq = batch.req_pool_indices_cpu, batch.seq_lens_cpu
        assert (with_rec.page_fill(rows, seq) is not None) == expect_record
    assert answers[0] == answers[1]
    return answers[0]


def _extend(rows, prefix, ext):
    def make(cache):
        loc = torch.cat([cache.req_to_token[r, p:p + e] for r, p, e in zip(rows, prefix, ext)])
        return ForwardBatch.extend(rows, prefix, ext, loc)
    return make


GOOD = {
    "decode, every row": lambda c: _decode(c, [0, 1, 2], LENS),
    "decode, host ints": lambda c: ForwardBatch.decode([0, 1, 2], LENS, [int(c.req_to_token[r, x - 1])
                                                                         for r, x in zip([0, 1, 2], LENS)]),
    "decode, rows reordered and shorter": lambda c: _decode(c, [2, 0], [8, 3]),
    "decode, one row": lambda c: _decode(c, [1], [17]),
    "extend with a prefix": _extend([0, 1, 2], [2, 9, 0], [3, 8, 8]),
    "extend, one row": _extend([1], [0], [17]),
}


@pytest.mark.parametrize("mapped", [True, False])
@pytest.mark.parametrize("name", GOOD)
def test_a_covered_batch_gets_the_same_answers_with_and_without_the_record(name, mapped):
    ans = _same(GOOD[name], mapped, expect_record=True)
    assert [a[0] for a in ans] == ["ok"] * 3


SPOILS = {  # a torch write after the fill: the record is void, the full passes name the entry
    "unassigned prefix entry": lambda c: c.req_to_token.__setitem__((1, 6), -1),
    "wild prefix entry": lambda c: c.req_to_token.__setitem__((1, 6), 10 ** 12),
    "entry past the slots": lambda c: c.req_to_token.__setitem__((2, 0), NUM_PAGES * PAGE),
    "misaligned in range": lambda c: c.req_to_token.__setitem__((0, 1), int(c.req_to_token[0, 1]) + 1),
    "page moved off a page start": lambda c: c.req_to_token[2, 4:8].add_(1),
    "new token's entry unassigned": lambda c: c.req_to_token.__setitem__((0, 4), -1),
}


@pytest.mark.parametrize("mapped", [True, False])
@pytest.mark.parametrize("spoil", SPOILS)
def test_a_write_after_the_fill_voids_the_record_and_the_full_pass_names_the_entry(spoil, mapped):
    def make(c):  # the batch made before the write: its slots are the filled ones
        return ForwardBatch.decode([0, 1, 2], LENS, [_filled_slot(c, r, x - 1) for r, x in zip([0, 1, 2], LENS)])
    ans = _same(make, mapped, spoil=SPOILS[spoil], expect_record=False)
    assert ans[0][0] == "error" or ans[1][0] == "error", ans


def _filled_slot(cache, row, pos):
    rec = cache.page_fill()
    if rec is None:  # the twin without a record: the same table
        table = _table()
        return int(table[row, pos // PAGE]) * PAGE + pos % PAGE
    return rec.slot(row, pos, PAGE)


def _row5(cache):  # a row mapped before the fill (by assign_pages): the fill never wrote it
    cache.assign_pages(5, 9, [30, 31, 32])


def _row5_bad(cache):
    _row5(cache)
    cache.req_to_token[5, 2] = -1


NOT_COVERED = {
    "a row the fill did not write (good)": (lambda c: _decode(c, [0, 5], [5, 9]), _row5),
    "a row the fill did not write (unassigned entry)": (
        lambda c: ForwardBatch.decode([0, 5], [5, 9], [int(c.req_to_token[0, 4]), int(c.req_to_token[5, 8])]),
        _row5_bad),
    "longer than the fill wrote": (lambda c: _decode(c, [0, 1], [9, 17]), None),
    "a row past the filled rows (unassigned)": (
        lambda c: ForwardBatch.decode([0, 3], [5, 1], [int(c.req_to_token[0, 4]), 0]), None),
}


@pytest.mark.parametrize("mapped", [True, False])
@pytest.mark.parametrize("name", NOT_COVERED)
def test_rows_or_lengths_the_fill_did_not_write_take_the_full_pass(name, mapped):
    make, before = NOT_COVERED[name]
    _same(make, mapped, before=before, expect_record=False)


LOC_SPOILS = {
    "another request's slot": lambda c, loc: [loc[1], loc[1], loc[2]],
    "the previous position's slot": lambda c, loc: [loc[0] - 1, loc[1], loc[2]],
    "out of range": lambda c, loc: [loc[0], loc[1], NUM_PAGES * PAGE],
    "negative": lambda c, loc: [loc[0], -3, loc[2]],
}


@pytest.mark.parametrize("host_ints", [True, False])
@pytest.mark.parametrize("name", LOC_SPOILS)
def test_a_new_token_slot_other_than_its_mapping_gets_the_same_error_with_and_without_the_record(name, host_ints):
    def make(c):
        loc = LOC_SPOILS[name](c, [int(c.req_to_token[r, x - 1]) for r, x in zip([0, 1, 2], LENS)])
        if not host_ints:
            loc = torch.tensor(loc)
        try:
            return ForwardBatch.decode([0, 1, 2], LENS, loc)
        except ShapeError:  # a negative slot is refused by the batch itself: checked without it then
            return ForwardBatch.decode([0, 1, 2], LENS, torch.as_tensor(loc).clamp(min=0))
    ans = _same(make, True, expect_record=True)
    assert ans[0][0] == "error", ans


# -- a fill of the same pages (a decode step that opened no page) writes nothing ---------------------------------
def _entries_ok(cache, table, lens):
    for i, x in enumerate(lens):
        pos = torch.arange(x)
        assert torch.equal(cache.req_to_token[i, :x], table[i].long()[pos // PAGE] * PAGE + pos % PAGE)


@pytest.mark.parametrize("inference", [True, False])
def test_a_fill_of_the_same_pages_writes_nothing_and_covers_the_new_lengths(inference):
    cache = _cache()
    table = _table()
    with torch.inference_mode(inference):
        first = cache.fill_from_page_table(table, LENS)
        version = cache.req_to_token._version
        longer = [6, 20, 8]  # each request still within its pages
        rec = cache.fill_from_page_table(table, longer)
    assert cache.req_to_token._version == version and rec.table is first.table
    assert cache.page_fill([0, 1, 2], longer) is rec
    _entries_ok(cache, table, longer)


CHANGES = {
    "a request opens a page": lambda t, lens: (_with(t, 0, 2, 39), [9, 17, 8]),
    "another block id in the first request": lambda t, lens: (_with(t, 0, 1, 39), lens),
    "another block id in the last request": lambda t, lens: (_with(t, 2, 0, 38), lens),
    "one request fewer": lambda t, lens: (t, lens[:2]),
}


def _with(table, i, j, value):
    table = table.clone()
    table[i, j] = value
    return table


@pytest.mark.parametrize("change", CHANGES)
def test_a_fill_of_other_pages_writes_them(change):
    cache = _cache()
    cache.fill_from_page_table(_table(), LENS)
    version = cache.req_to_token._version
    table, lens = CHANGES[change](_table(), LENS)
    rec = cache.fill_from_page_table(table, lens)
    assert cache.req_to_token._version > version and cache.page_fill(list(range(len(lens))), lens) is rec
    _entries_ok(cache, table, lens)


@pytest.mark.parametrize("write", ["req_to_token", "the recorded table"])
def test_a_fill_after_a_write_writes_again_even_for_the_same_pages(write):
    cache = _cache()
    table = _table()
    rec = cache.fill_from_page_table(table, LENS)
    if write == "req_to_token":
        cache.req_to_token[0, 0] = 10 ** 9  # a covered entry spoiled: the next fill must rewrite it
    else:
        rec.table.add_(0)  # a consumer wrote the recorded table in place: the record is void
    version = cache.req_to_token._version
    again = cache.fill_from_page_table(table, LENS)  # (the record not asked for first: nothing voided it but
    assert cache.req_to_token._version > version and again.table is not rec.table  # the counters)
    _entries_ok(cache, table, LENS)
    assert cache.page_fill() is again
