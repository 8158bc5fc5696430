"""cpu_fused: a decode forward that follows a decode forward of as many requests carries the previous one's work
and prepared calls (issue 30, round 8: ``CpuFusedBackend._carry``), against the path that builds them every forward.

``build_metadata`` of a DECODE forward hands the previous decode forward's ``work`` (the op's header and work rows,
one ``array`` buffer per layer geometry: ``_decode_work``) and its prepared calls (``FusedCall``) to the new
metadata after rewriting each buffer in place with the new forward's header and rows, where the split (KV heads per
work item, the scratch under the aim and the workspace limit) stays the same and the thread count is the one the
work was made for. Each test runs a sequence of decode steps on two identical setups, one carrying and one with
``_CARRY`` off (every forward builds its own), with the same inputs: every step's output against the float64
reference and the cache against a write at ``out_cache_loc`` only (``forward_and_check``), the two outputs the
same bits, the carried work tensor equal to the one built fresh; and checks when the carry happens and when it
must not (another batch size, another thread count, an extend between, a split that changes, a layer plan made
again), that a request crossing into a new page, another request on the same row, a mapping changed outside and a
kernel failure recorded in the carried header all give the rebuilt path's result.
"""

from __future__ import annotations

from typing import Any, Sequence

import pytest
import torch

from attnplug import ForwardBatch, ForwardMode, ShapeError
from attnplug.errors import ResourceLimitError
from attnplug.testing.suite.harness import same_bytes
from attnplug_cpu_fused import backend as cf_backend
from attnplug_cpu_fused import kernel

from test_cpu_fused import F32, Setup, extend_batch, inputs, make, needs_kernel, run_and_check


def _map(s: Setup, req_ids: Sequence[int], upto: Sequence[int]) -> None:
    """Map each request's positions ``0 .. upto - 1`` on fresh (shuffled) pages."""
    ps = s.cache.page_size
    for r, n in zip(req_ids, upto):
        s.cache.assign_pages(r, n, s.alloc.alloc(-(-n // ps)))


def _step(s: Setup, req_ids: Sequence[int], lens: Sequence[int]) -> ForwardBatch:
    """A DECODE batch of ``req_ids`` at ``lens`` (counting the new token) over the pages mapped already."""
    loc = torch.stack([s.cache.req_to_token[r, n - 1] for r, n in zip(req_ids, lens)])
    return ForwardBatch.decode(list(req_ids), list(lens), loc)


class Pair:
    """Two identical setups (same seed): ``a`` carries (``_CARRY`` on), ``b`` builds every forward's work."""

    def __init__(self, monkeypatch: Any, **kw: Any) -> None:
        self.a, self.b = make(**kw), make(**kw)
        self.mp = monkeypatch

    def map(self, req_ids: Sequence[int], upto: Sequence[int]) -> None:
        _map(self.a, req_ids, upto)
        _map(self.b, req_ids, upto)

    def run(self, make_batch: Any) -> tuple[Any, Any]:
        """One forward of each setup over ``make_batch(setup)`` with the same q/k/v; the two outputs the same bits
        (each checked against the reference and a write at ``out_cache_loc`` only); returns the two metadata."""
        metas = []
        outs = []
        qkv = None
        for s, carry in ((self.a, True), (self.b, False)):
            self.mp.setattr(cf_backend, "_CARRY", carry)
            batch = make_batch(s)
            if qkv is None:
                qkv = inputs(s, batch.num_tokens)
            outs.append(run_and_check(s, batch, qkv=qkv))
            metas.append(s.backend.forward_metadata(batch))
        self.mp.setattr(cf_backend, "_CARRY", True)
        assert same_bytes(outs[0], outs[1])
        a, b = metas
        assert not b.carried
        if a.mode is ForwardMode.DECODE:  # the carried (or built) work tensors are the ones built fresh
            assert a.work.keys() == b.work.keys()
            for key in a.work:
                wa, wb = a.work[key], b.work[key]
                if not isinstance(wb, cf_backend.FusedForward):  # Declined: the same answer
                    assert wa == wb
                    continue
                assert torch.equal(wa.work, wb.work) and torch.equal(wa.plan, wb.plan), (wa.work, wb.work)
                assert wa.per_item == wb.per_item and wa.requests == wb.requests
        return a, b

    def decode(self, req_ids: Sequence[int], lens: Sequence[int]) -> Any:
        return self.run(lambda s: _step(s, req_ids, lens))[0]


@needs_kernel
@pytest.mark.parametrize("window", [None, 0, 5], ids=lambda w: f"window{w}")
@pytest.mark.parametrize("lens", [[1], [14], [3, 30], [1, 17, 53, 30]], ids=["one_token", "page_end", "two", "four"])
def test_decode_steps_carry_the_work_and_give_the_rebuilt_paths_bits(lens, window, monkeypatch):
    # eight steps, every request one token longer each (crossing into new pages: page size 16, "page_end" at the
    # second step), the window's start moving; from the second step on the work and the calls are the first's
    p = Pair(monkeypatch, dtype=F32, head_dim=16, seed=11, layer_kw=dict(sliding_window=window))
    req_ids = [7 - i for i in range(len(lens))]
    p.map(req_ids, [n + 8 for n in lens])
    first = None
    for t in range(8):
        meta = p.decode(req_ids, [n + t for n in lens])
        assert meta.carried == (t > 0)
        if first is None:
            first = meta
        else:  # the same objects: buffers rewritten, calls kept
            assert meta.work is first.work and meta.calls == first.calls


@needs_kernel
def test_another_request_on_the_same_rows_and_a_mapping_changed_outside_are_read_anew(monkeypatch):
    # the work rows hold rows and lengths, never slots: a decode step of other requests (other rows, other lengths,
    # as many) carries with its own rows; pages mapped anew between two steps (written outside the forwards) are
    # what the kernel reads
    p = Pair(monkeypatch, dtype=F32, head_dim=16, seed=12)
    p.map([7, 6], [40, 40])
    p.decode([7, 6], [20, 5])
    assert p.decode([6, 7], [9, 33]).carried  # swapped rows, other lengths
    p.map([3, 6], [40, 40])  # request 6's pages mapped anew; row 3 a new request
    meta = p.decode([3, 6], [2, 31])
    assert meta.carried


@needs_kernel
def test_what_stops_the_carry(monkeypatch):
    p = Pair(monkeypatch, dtype=F32, head_dim=16, seed=13)
    p.map([7, 6, 5], [60, 60, 60])
    p.decode([7, 6], [10, 12])
    # another batch size: built
    assert not p.decode([7, 6, 5], [11, 13, 4]).carried
    assert not p.decode([7, 6], [12, 14]).carried
    assert p.decode([7, 6], [13, 15]).carried
    # an extend forward between two decode forwards: the next decode builds its own
    p.run(lambda s: extend_batch(s, ForwardMode.EXTEND, [20], [3], req_ids=[4]))
    assert not p.decode([7, 6], [14, 16]).carried
    assert p.decode([7, 6], [15, 17]).carried
    # another thread count: built (and the calls made again for it)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2 if threads == 1 else 1)
        meta = p.decode([7, 6], [16, 18])
        assert not meta.carried
        assert all(c.threads == torch.get_num_threads() for c in meta.calls.values())
    finally:
        torch.set_num_threads(threads)
    assert not p.decode([7, 6], [17, 19]).carried
    # the layer's plan made again (another LayerPlan object): the work is carried, the call is made again
    before = p.decode([7, 6], [18, 20])
    assert before.carried
    old_call = before.calls[id(p.a.layer)]
    for s in (p.a, p.b):
        s.backend.forget_layer_plans()
        s.backend.layer_plan(s.layer)  # made again before the next forward: its own kernel arguments
    meta = p.decode([7, 6], [19, 21])
    assert meta.carried and meta.work is before.work
    call = meta.calls[id(p.a.layer)]
    assert call is not old_call and call.fl is p.a.backend.layer_plan(p.a.layer).kernel


@needs_kernel
def test_a_split_that_changes_is_not_carried(monkeypatch):
    # one thread, two requests: both KV heads in one work item while the scratch fits; the workspace limit set so
    # that 16 keys fit two heads and 17 keys do not: at 17 the split is one head an item, built afresh
    D, G, Hkv = 16, 4, 2
    limit = kernel.scratch_bytes(1, Hkv, 1, G, 16, D, D)
    assert kernel.scratch_bytes(1, Hkv, 1, G, 17, D, D) > limit >= kernel.scratch_bytes(1, 1, 1, G, 40, D, D)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        p = Pair(monkeypatch, dtype=F32, head_dim=D, kv_heads=Hkv, group=G, seed=14, max_workspace_bytes=limit)
        p.map([7, 6], [40, 40])
        m0 = p.decode([7, 6], [15, 3])
        assert [w.per_item for w in m0.work.values()] == [2]
        assert p.decode([7, 6], [16, 4]).carried
        m2 = p.decode([7, 6], [17, 5])
        assert not m2.carried and [w.per_item for w in m2.work.values()] == [1]
        assert p.decode([7, 6], [18, 6]).carried
        # the workspace limit lowered under one head's scratch between two steps: declined, never carried (the
        # eager paths then run, and refuse their own workspace over that limit, as without the carry)
        errors = []
        for s, carry in ((p.a, True), (p.b, False)):
            monkeypatch.setattr(cf_backend, "_CARRY", carry)
            s.backend.max_workspace_bytes = kernel.scratch_bytes(1, 1, 1, G, 19, D, D) - 1
            batch = _step(s, [7, 6], [19, 7])
            s.backend.init_forward_metadata(batch)
            meta = s.backend.forward_metadata(batch)
            with pytest.raises(ResourceLimitError) as err:
                s.backend.forward(*inputs(s, 2), s.layer, batch)
            errors.append(str(err.value))
            assert not meta.carried and all(isinstance(w, cf_backend.Declined) for w in meta.work.values())
        assert errors[0] == errors[1]
    finally:
        torch.set_num_threads(threads)


@needs_kernel
def test_a_failure_recorded_in_a_carried_header_does_not_stay(monkeypatch):
    # the kernel records a bad slot in the work header and raises; the next decode step carries the same buffer,
    # rewritten whole (the record cleared), and gives the reference's output
    p = Pair(monkeypatch, dtype=F32, head_dim=16, seed=15)
    p.map([7, 6], [40, 40])
    p.decode([7, 6], [10, 20])
    s = p.a
    batch = _step(s, [7, 6], [11, 21])
    s.backend.init_forward_metadata(batch)
    assert s.backend.forward_metadata(batch).carried
    good = int(s.cache.req_to_token[6, 2])
    s.cache.req_to_token.data[6, 2] = s.cache.num_slots + 5  # past the version counter: only the kernel sees it
    q, k, v = inputs(s, batch.num_tokens)
    with pytest.raises(ShapeError, match=r"request 1 \(req_to_token row 6\): position 2 maps to slot"):
        s.backend.forward(q, k, v, s.layer, batch)
    (fw,) = s.backend.forward_metadata(batch).work.values()
    assert int(fw.work[0, kernel.WORK_ERR]) == kernel.RC_BAD_SLOT
    s.cache.req_to_token.data[6, 2] = good
    batch = _step(s, [7, 6], [12, 22])
    run_and_check(s, batch)  # against the reference
    meta = s.backend.forward_metadata(batch)
    assert meta.carried and meta.work[next(iter(meta.work))] is fw and int(fw.work[0, kernel.WORK_ERR]) == 0
    # the rewritten buffer is the work a fresh build gives (the carry off)
    monkeypatch.setattr(cf_backend, "_CARRY", False)
    fresh = s.backend.build_metadata(batch)
    want = s.backend._work(q, s.layer, fresh, s.backend.layer_plan(s.layer).kernel)
    # (the header's WORK_THREADS column is what the last call wrote, not an input: the fresh one is unused)
    used = fw.work.clone()
    assert 1 <= int(used[0, kernel.WORK_THREADS]) <= torch.get_num_threads()
    assert int(want.work[0, kernel.WORK_THREADS]) == 0
    used[0, kernel.WORK_THREADS] = 0
    assert not fresh.carried and torch.equal(used, want.work)
