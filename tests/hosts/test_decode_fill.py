"""A decode step maps its rows through ``PagedKVCache.fill_from_pages`` (issue 30, round 7).

The transformers cache adapter hands the step's page lists to the fill, which writes only the pages the last
fill did not (a step that opens no page writes nothing) and keeps a ``PageFill`` record, so ``check_batch`` skips
reading the rows back. What must hold: greedy tokens equal to transformers' own ``sdpa`` under the margin rule
(``greedy_rule``), and the very same logits as the entry-by-entry path (``cache._FILL`` off), at page sizes where
decode steps open pages, at batch 1 and with requests joining and leaving; a torch write into ``req_to_token``
voids the record, after which the rows are compared with the requests' pages before anything is filled over
them (an entry that differs is left for ``check_batch`` to read, as without the fill).
"""

from __future__ import annotations

import pytest
import torch

import hf_models as models
from attnplug import AttentionConfig, ForwardMode, ShapeError
from attnplug.integrations.transformers import Chunk, Request, TransformersRunner, generate
from attnplug.integrations.transformers import cache as cache_mod
from attnplug.integrations.transformers import runner as runner_mod
from attnplug.testing.tolerances import tolerance_for
from greedy_rule import follow_reference

FP32 = tolerance_for("float32")
BACKENDS = sorted({models.cpu_default(), "torch_native"})
_SDPA: dict = {}


def sdpa_reference(arch: str, lens: tuple[int, ...], new_tokens: int):
    """transformers' greedy ``generate()`` with its own ``sdpa`` attention, one prompt at a time (memoised)."""
    key = (arch, lens, new_tokens)
    if key not in _SDPA:
        model = models.build(arch)
        model.set_attn_implementation("sdpa")
        out = []
        with torch.inference_mode():
            for p in models.prompts(lens):
                ids = torch.tensor([p])
                o = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                   min_new_tokens=new_tokens, do_sample=False, output_logits=True,
                                   return_dict_in_generate=True)
                out.append((o.sequences[0, len(p):].tolist(), torch.stack([s[0] for s in o.logits]).float()))
        _SDPA[key] = out
    return _SDPA[key]


class _FillSpy:
    """Counts ``fill_from_pages`` calls on one cache (and the writes they made to ``req_to_token``)."""

    def __init__(self, kv_cache):
        self.calls = self.writes = 0
        orig = kv_cache.fill_from_pages

        def spy(blocks, lens):
            self.calls += 1
            before = kv_cache.req_to_token._version
            rec = orig(blocks, lens)
            self.writes += kv_cache.req_to_token._version - before
            return rec
        kv_cache.fill_from_pages = spy


@pytest.fixture(params=[True, False], ids=["fill", "entry writes"])
def fill(request, monkeypatch):
    monkeypatch.setattr(cache_mod, "_FILL", request.param)
    return request.param


@pytest.mark.parametrize("page_size", [4, 16])
@pytest.mark.parametrize("lens", [(32,), (5, 17, 11)], ids=["batch 1", "batch 3"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_tokens_follow_sdpa_under_the_margin_rule(backend, lens, page_size, fill):
    new_tokens = 20
    ref = sdpa_reference("llama", lens, new_tokens)
    runner = TransformersRunner(models.build("llama"), AttentionConfig(attention_backend=backend),
                                max_requests=4, max_context_len=128, page_size=page_size)
    spy = _FillSpy(runner.kv_cache)
    res, _ = follow_reference(runner, ref, models.prompts(lens), lens, new_tokens, FP32)
    decode_steps = sum(s.mode is ForwardMode.DECODE for s in res.steps)
    assert decode_steps == new_tokens - 1
    opened = sum(-(-(n + new_tokens - 1) // page_size) - -(-n // page_size) for n in lens)
    if fill:  # filled at the first decode step after the prefill and where a page opens; else the record covers
        assert 1 <= spy.calls <= 1 + opened and spy.writes <= opened + len(lens)
    else:
        assert spy.calls == 0
    assert runner.cache.requests == [] and bool((runner.kv_cache.req_to_token == -1).all())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_the_fill_gives_the_very_logits_of_the_entry_writes(backend, page_size, monkeypatch):
    """Requests joining at different steps and finishing at different steps (rows reused): the same logits,
    bit for bit, with and without the fill (and the decode batch taking the previous one's tensors,
    ``ForwardBatch.decode(after=...)``)."""
    prompts = models.prompts((7, 3, 12, 5))
    reqs = [Request(p, n, arrival=a) for p, n, a in zip(prompts, (9, 4, 6, 8), (0, 0, 2, 5))]
    out = {}
    for on in (True, False):  # both round 7 paths on (the default), or both off
        monkeypatch.setattr(cache_mod, "_FILL", on)
        monkeypatch.setattr(runner_mod, "_AFTER", on)
        runner = TransformersRunner(models.build("llama"), AttentionConfig(attention_backend=backend),
                                    max_requests=3, max_context_len=64, page_size=page_size)
        out[on] = generate(runner, reqs, max_running=2, record_logits=True)
    assert out[True].tokens == out[False].tokens
    for a, b in zip(out[True].logits, out[False].logits):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def _two_steps(runner):
    runner.forward([Chunk("a", range(1, 7))])  # 6 tokens, page size 4
    runner.forward([Chunk("a", (3,), decode=True)])
    runner.forward([Chunk("a", (4,), decode=True)])


@pytest.mark.parametrize("write", ["add_(0)", "the same value", "a copy of the row"])
def test_a_torch_write_voids_the_record_and_the_rows_are_compared_before_the_next_fill(write):
    runner = TransformersRunner(models.build("llama"), AttentionConfig(attention_backend="torch_native"),
                                max_requests=2, max_context_len=32, page_size=4)
    ref = TransformersRunner(models.build("llama"), AttentionConfig(attention_backend="torch_native"),
                             max_requests=2, max_context_len=32, page_size=4)
    for r in (runner, ref):
        _two_steps(r)
    r2t, row = runner.kv_cache.req_to_token, runner.cache.row("a")
    assert runner.kv_cache.page_fill([row], [8]) is not None
    if write == "add_(0)":
        r2t.add_(0)
    elif write == "the same value":
        r2t[row, 2] = int(r2t[row, 2])
    else:
        r2t[row].copy_(r2t[row].clone())
    assert runner.kv_cache.page_fill() is None  # voided by the write
    spy = _FillSpy(runner.kv_cache)
    got = runner.forward([Chunk("a", (5,), decode=True)])
    want = ref.forward([Chunk("a", (5,), decode=True)])
    assert torch.equal(got, want) and spy.calls == 1
    assert runner.kv_cache.page_fill([row], [9]) is not None  # the rows matched their pages: filled, recorded


@pytest.mark.parametrize("value,words", [
    (-1, r"position 2 .* is unassigned"),
    (10 ** 6, r"position 2 .* is out of range"),
])
def test_an_entry_that_differs_from_its_page_is_not_filled_over_and_check_batch_refuses_it(value, words):
    runner = TransformersRunner(models.build("llama"), AttentionConfig(attention_backend="torch_native"),
                                max_requests=2, max_context_len=32, page_size=4)
    _two_steps(runner)
    row = runner.cache.row("a")
    runner.kv_cache.req_to_token[row, 2] = value
    spy = _FillSpy(runner.kv_cache)
    with pytest.raises(ShapeError, match=words):
        runner.forward([Chunk("a", (5,), decode=True)])
    assert spy.calls == 0 and int(runner.kv_cache.req_to_token[row, 2]) == value  # left for check_batch to name


def test_an_in_range_entry_that_differs_from_its_page_is_left_as_without_the_fill(monkeypatch):
    """A wrong but in-range slot is not a bound violation: ``check_batch`` passes it with or without the fill
    (it checks bounds); the fill does not write over it either, so both paths compute the same."""
    out = []
    for on in (True, False):
        monkeypatch.setattr(cache_mod, "_FILL", on)
        runner = TransformersRunner(models.build("llama"), AttentionConfig(attention_backend="torch_native"),
                                    max_requests=2, max_context_len=32, page_size=4)
        _two_steps(runner)
        row = runner.cache.row("a")
        runner.kv_cache.req_to_token[row, 2] = int(runner.kv_cache.req_to_token[row, 1])
        out.append((runner.forward([Chunk("a", (5,), decode=True)]), runner.kv_cache.req_to_token[row, :9].clone()))
    assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1])


@pytest.mark.parametrize("page_end", [True, False], ids=["recorded to the page end", "recorded to the length"])
def test_a_page_list_changed_under_the_record_is_written_where_it_differs(page_end, fill, monkeypatch):
    """The request's current page swapped in its page list (another free page, in range) between two steps: the
    new token's ``req_to_token`` entry is its ``out_cache_loc`` slot afterwards, whatever path mapped it (the
    record is not trusted for a slot it does not give)."""
    monkeypatch.setattr(cache_mod, "_PAGE_END", page_end)
    runner = TransformersRunner(models.build("llama"), AttentionConfig(attention_backend="torch_native"),
                                max_requests=2, max_context_len=32, page_size=4)
    _two_steps(runner)  # length 8: the next position (8) opens page 2; swap page 1 instead, after one more step
    runner.forward([Chunk("a", (5,), decode=True)])  # length 9, page 2 holds position 8
    seq, row = runner.cache._seqs["a"], runner.cache.row("a")
    other = runner.cache.pool.alloc(1)[0]
    seq.pages[2] = other
    runner.forward([Chunk("a", (6,), decode=True)])  # position 9
    assert int(runner.kv_cache.req_to_token[row, 9]) == other * 4 + 1
    if fill:
        rec = runner.kv_cache.page_fill([row], [10])
        assert rec is not None and rec.blocks[row][2] == other
