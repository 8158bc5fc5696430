"""``ForwardBatch.decode(..., after=previous)``: a decode batch made from host ints takes the previous step's
tensors that still hold its values (issue 30, round 7) — ``req_pool_indices`` for the same rows, ``extend_seq_lens``
(ones) for the same batch size, the previous ``seq_lens`` as ``positions`` when every request is one token
longer — and only while that tensor was never written (write counter 0).

Each case builds the batch with and without ``after``: the same fields, values, dtypes and host copies; the
tensors shared exactly where allowed; a write through the previous batch into a shared tensor is refused by the
new batch's guard (``changed_since_validate`` names the field) and ends ``host_ints``. A reuse that ignored the
counter or the values makes the "not taken" family fail.
"""

from __future__ import annotations

import pytest
import torch

from attnplug import ForwardBatch

FIELDS = ("req_pool_indices", "seq_lens", "out_cache_loc", "extend_prefix_lens", "extend_seq_lens", "positions")
HOST = ("req_pool_indices_cpu", "seq_lens_cpu", "extend_prefix_lens_cpu", "extend_seq_lens_cpu")


def _same(a: ForwardBatch, b: ForwardBatch) -> None:
    for f in FIELDS:
        x, y = getattr(a, f), getattr(b, f)
        assert x.dtype == y.dtype == torch.int64 and torch.equal(x, y), f
    for f in HOST:
        assert getattr(a, f) == getattr(b, f), f
    assert a.host_ints() == b.host_ints() is not None and a.changed_since_validate() is None


#: (previous rows, lengths) -> (rows, lengths) of the step, and which of after's tensors the step may take
CASES = {
    "batch 1, one longer": (([1], [40]), ([1], [41]), {"req_pool_indices", "extend_seq_lens", "positions"}),
    "batch 3, one longer": (([0, 2, 1], [5, 9, 3]), ([0, 2, 1], [6, 10, 4]), {"req_pool_indices", "extend_seq_lens",
                                                                             "positions"}),
    "rows reordered": (([0, 2], [5, 9]), ([2, 0], [10, 6]), {"extend_seq_lens"}),
    "a request left": (([0, 2], [5, 9]), ([0], [6]), set()),
    "a request joined": (([0], [5]), ([0, 1], [6, 3]), set()),
    "lengths not one longer": (([0, 1], [5, 9]), ([0, 1], [7, 10]), {"req_pool_indices", "extend_seq_lens"}),
    "the same lengths again": (([3], [5]), ([3], [5]), {"req_pool_indices", "extend_seq_lens"}),
}


@pytest.mark.parametrize("inference", [True, False])
@pytest.mark.parametrize("name", sorted(CASES))
def test_the_same_batch_with_and_without_after_sharing_only_what_holds(name, inference):
    (rows0, lens0), (rows, lens), shared = CASES[name]
    with torch.inference_mode(inference):
        prev = ForwardBatch.decode(rows0, lens0, list(range(10, 10 + len(rows0))))
        loc = list(range(20, 20 + len(rows)))
        got = ForwardBatch.decode(rows, lens, loc, after=prev)
        want = ForwardBatch.decode(rows, lens, loc)
    _same(got, want)
    took = {f for f in FIELDS if any(getattr(got, f) is getattr(prev, g) for g in FIELDS)}
    assert took == shared
    if "positions" in shared:
        assert got.positions is prev.seq_lens


@pytest.mark.parametrize("written", ["req_pool_indices", "extend_seq_lens", "seq_lens"])
def test_a_tensor_of_after_written_since_is_not_taken(written):
    prev = ForwardBatch.decode([0, 1], [5, 9], [10, 11])
    getattr(prev, written).add_(0)  # a torch write that changes no value: the counter moves
    got = ForwardBatch.decode([0, 1], [6, 10], [20, 21], after=prev)
    _same(got, ForwardBatch.decode([0, 1], [6, 10], [20, 21]))
    assert all(getattr(got, f) is not getattr(prev, written) for f in FIELDS)


@pytest.mark.parametrize("field,shared_as", [("req_pool_indices", "req_pool_indices"),
                                             ("extend_seq_lens", "extend_seq_lens"), ("seq_lens", "positions")])
def test_a_write_through_the_previous_batch_is_refused_by_the_new_one(field, shared_as):
    prev = ForwardBatch.decode([0, 1], [5, 9], [10, 11])
    got = ForwardBatch.decode([0, 1], [6, 10], [20, 21], after=prev)
    assert got.changed_since_validate() is None and got.host_ints() is not None
    getattr(prev, field)[0] = 7
    assert got.changed_since_validate() == shared_as
    if shared_as == "req_pool_indices":
        assert got.host_ints() is None  # the checks read the tensors again


def test_after_made_from_tensors_or_given_with_tensors_takes_nothing():
    prev = ForwardBatch.decode(torch.tensor([0]), torch.tensor([5]), torch.tensor([10]))  # the tensor path
    got = ForwardBatch.decode([0], [6], [20], after=prev)
    _same(got, ForwardBatch.decode([0], [6], [20]))
    assert all(getattr(got, f) is not getattr(prev, g) for f in FIELDS for g in FIELDS)
    host_prev = ForwardBatch.decode([0], [5], [10])
    t = ForwardBatch.decode(torch.tensor([0]), torch.tensor([6]), torch.tensor([20]), after=host_prev)
    assert t.req_pool_indices is not host_prev.req_pool_indices and t.seq_lens_cpu == [6]
