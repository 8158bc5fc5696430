"""vllm_cpu over rows filled from a host's page table (``PagedKVCache.fill_from_page_table``, issue 23 round 5).

While the fill's record holds, ``VllmCpuBackend._one_pass`` takes the covered entries as in range and page
aligned (``_filled_pass``: only the new token's slot compared, on host ints; the page table is the recorded
one). Every batch here runs twice over the same entries: with the record, and with it voided by a torch
write that changes no value. Both must give the same error words, or the same page table, remap and output
bits; ``_filled_pass`` must be taken exactly where the record is valid and covers the batch.
"""

from __future__ import annotations

import math

import pytest
import torch

from attnplug import AttentionConfig, BuildContext, ForwardBatch, LayerSpec

from test_vllm_cpu import _cache, _real, needs_ops

pytestmark = needs_ops

PAGE = 16
SEQ = [6, 41, 16, 17]  # a tail in the last page, three pages, a page just filled, a fresh page


def _problem(seq, *, host_ints=True, void=False, spoil=None, rows=None, extend=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    need = sum(math.ceil(s / PAGE) for s in seq)
    cache = _cache(64, PAGE, torch.float32, num_pages=need + 6, max_requests=8, max_context_len=max(seq) + PAGE)
    n = cache.num_slots
    cache.set_kv(0, torch.arange(n), torch.randn(n, 2, 64, generator=g), torch.randn(n, 2, 64, generator=g))
    ids = torch.randperm(cache.num_pages, generator=g).tolist()
    width = max(math.ceil(s / PAGE) for s in seq) + 2
    table = []
    for s in seq:
        u = math.ceil(s / PAGE)
        table.append(ids[:u] + [10 ** 6] * (width - u))  # stale ids past the used pages, as vLLM's table holds
        ids = ids[u:]
    cache.fill_from_page_table(torch.tensor(table, dtype=torch.int32), seq)
    if void:
        cache.req_to_token.add_(0)
    rows = list(range(len(seq))) if rows is None else rows
    lens = [seq[r] for r in rows]
    if extend is None:
        loc = [int(cache.req_to_token[r, x - 1]) for r, x in zip(rows, lens)]
        if spoil is not None:
            loc = spoil(cache, loc)
        batch = ForwardBatch.decode(rows, lens, loc if host_ints else torch.tensor(loc))
        T = len(rows)
    else:
        prefix = [x - e for x, e in zip(lens, extend)]
        loc_t = torch.cat([cache.req_to_token[r, p:x] for r, p, x in zip(rows, prefix, lens)])
        if spoil is not None:
            spoil(cache, None)
        batch = ForwardBatch.extend(rows, prefix, extend, loc_t)
        T = sum(extend)
    ctx = BuildContext(config=AttentionConfig(attention_backend="vllm_cpu"), host=_real.host, dtype="float32",
                       num_heads=4, num_kv_heads=2, head_dim=64, page_size=PAGE, kv_cache=cache,
                       max_context_len=cache.max_context_len)
    _, backend = _real.build("vllm_cpu", ctx)
    qkv = tuple(torch.randn(T, h, 64, generator=g) for h in (4, 2, 2))
    return cache, batch, backend, qkv


def _run(monkeypatch, **kw):
    from attnplug_vllm_cpu.backend import VllmCpuBackend

    used = []
    real = VllmCpuBackend._filled_pass
    with monkeypatch.context() as m:
        m.setattr(VllmCpuBackend, "_filled_pass", lambda self, *a: used.append(real(self, *a)) or used[-1])
        cache, batch, backend, qkv = _problem(**kw)
        try:
            backend.init_forward_metadata(batch)
            meta = backend.forward_metadata(batch)
            out = backend.forward(*qkv, LayerSpec(0, 4, 2, 64), batch)
        except Exception as exc:
            return ("error", type(exc), str(exc)), used
    table = meta.self_keys.block_table
    remap = None if meta.remap is None else tuple(t.tolist() for t in meta.remap)
    return ("ok", table.dtype, table.tolist(), remap, out, cache.read_kv(0)), used


def _same(monkeypatch, **kw):
    fast, used = _run(monkeypatch, **kw)
    slow, unused = _run(monkeypatch, void=True, **kw)
    assert unused == []  # a voided record is never consulted
    assert fast[0] == slow[0], (fast, slow)
    if fast[0] == "ok":
        assert fast[1:4] == slow[1:4]
        assert torch.equal(fast[4], slow[4])
        assert all(torch.equal(a, b) for a, b in zip(fast[5], slow[5]))
    else:
        assert fast == slow
    return fast, used


def _free_slot(cache):
    taken = set(cache.req_to_token[cache.req_to_token >= 0].tolist())
    return next(s for s in range(cache.num_slots) if s not in taken)


def _set(row, pos, value):
    def spoil(cache, loc):
        cache.req_to_token[row, pos] = value(cache) if callable(value) else value
        return loc
    return spoil


def _swap(cache, loc):
    a, b = int(cache.req_to_token[1, 3]), int(cache.req_to_token[1, 4])
    cache.req_to_token[1, 3], cache.req_to_token[1, 4] = b, a
    return loc


def _shift_page(cache, loc):
    cache.req_to_token[1, 16:32] += 1
    return loc


DECODE = {
    # name: (spoil, the record still valid and covering); the old checks serve a slot written twice as a remap
    "clean": (None, True),
    "new token at another request's slot (served as a remap)": (lambda c, loc: [loc[1]] + loc[1:], True),
    "new token at a free slot (served as a remap)": (lambda c, loc: [_free_slot(c)] + loc[1:], True),
    "new token past the slots": (lambda c, loc: loc[:3] + [c.num_slots], True),
    "unassigned prefix entry (written after the fill)": (_set(1, 7, -1), False),
    "wild prefix entry": (_set(3, 2, 10 ** 9), False),
    "new token's entry unassigned": (_set(0, SEQ[0] - 1, -1), False),
    "two positions of a page swapped": (_swap, False),
    "a page off its page start": (_shift_page, False),
    "an in-range rewrite of a row no request reads": (_set(6, 0, 3), False),
}


@pytest.mark.parametrize("host_ints", [True, False], ids=["host_ints", "tensors"])
@pytest.mark.parametrize("kind", DECODE)
def test_a_decode_batch_gets_the_same_answer_with_and_without_the_record(kind, host_ints, monkeypatch):
    spoil, valid = DECODE[kind]
    got, used = _same(monkeypatch, seq=SEQ, host_ints=host_ints, spoil=spoil)
    assert used == ([kind == "clean"] if valid else []), (kind, used)
    if kind == "clean" or "remap" in kind or "no request reads" in kind:
        assert got[0] == "ok", got
    else:
        assert got[0] == "error", got


@pytest.mark.parametrize("rows", [[2, 0], [1], [3, 2, 1, 0]], ids=["two_reordered", "one", "reversed"])
def test_a_batch_of_some_filled_rows_in_any_order_takes_the_recorded_pages(rows, monkeypatch):
    got, used = _same(monkeypatch, seq=SEQ, rows=rows)
    assert got[0] == "ok" and used == [True]


@pytest.mark.parametrize("extend", [[6, 1, 16, 17], [1, 9, 3, 1]], ids=["prefill", "chunk_on_a_prefix"])
@pytest.mark.parametrize("spoil", [None, _set(2, 3, -1)], ids=["clean", "written_after_the_fill"])
def test_an_extend_batch_gets_the_same_answer_with_and_without_the_record(extend, spoil, monkeypatch):
    got, used = _same(monkeypatch, seq=SEQ, extend=extend, spoil=spoil)
    assert used == []  # extend batches take the core's checks (which consult the record themselves)
    assert got[0] == ("ok" if spoil is None else "error"), got
