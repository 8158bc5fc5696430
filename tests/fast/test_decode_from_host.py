"""``ForwardBatch.decode`` from host ints (the path a host's scheduler takes, issue 30 round 3).

The path checks the ints themselves and makes the tensors from them instead of reading tensors back.
These tests hold it to the tensor path: the same batch for every valid input, the same refusal (same
message) for every invalid one, and tensors that keep write counters even under
``torch.inference_mode``, so a batch changed in place after ``init_forward_metadata`` is refused per
layer (the tensor path under inference mode made inference tensors, which keep none: such a change went
unnoticed; ``test_an_in_place_change_is_refused_under_inference_mode`` fails on the code before it).
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from attnplug import ForwardBatch, ForwardMode, LayerSpec, ShapeError
from attnplug.batch import _INDEX_FIELDS
from tests.paged_setup import qkv, small_setup

VALID = {
    "one": ([0], [1], [0]),
    "one long": ([3], [40], [17]),
    "three": ([2, 0, 5], [7, 1, 30], [9, 0, 100]),
    "empty": ([], [], []),
    "tuples": ((1, 2), (4, 5), (6, 7)),
}


def _tensor_path(rows, seq, loc, **kw):
    return ForwardBatch.decode(torch.tensor(list(rows), dtype=torch.int64), torch.tensor(list(seq), dtype=torch.int64),
                               torch.tensor(list(loc), dtype=torch.int64), **kw)


def _mode(inference):
    return torch.inference_mode() if inference else contextlib.nullcontext()


@pytest.mark.parametrize("inference", [False, True], ids=["plain", "inference_mode"])
@pytest.mark.parametrize("mla_form", ["absorbed", "unabsorbed"])
@pytest.mark.parametrize("case", sorted(VALID))
def test_host_ints_build_the_batch_the_tensor_path_builds(case, mla_form, inference):
    rows, seq, loc = VALID[case]
    with _mode(inference):
        fast = ForwardBatch.decode(rows, seq, loc, mla_form=mla_form)
        ref = _tensor_path(rows, seq, loc, mla_form=mla_form)
    assert fast.forward_mode is ForwardMode.DECODE and fast.mla_form == mla_form
    for field in _INDEX_FIELDS:
        a, b = getattr(fast, field), getattr(ref, field)
        if b is None:
            assert a is None, field
            continue
        assert a.dtype == b.dtype == torch.int64 and a.device == b.device and a.is_contiguous(), field
        assert torch.equal(a, b), field
    for host in ("seq_lens_cpu", "extend_prefix_lens_cpu", "extend_seq_lens_cpu", "req_pool_indices_cpu"):
        assert getattr(fast, host) == getattr(ref, host), host
    assert fast.changed_since_validate() is None
    assert (fast.num_tokens, fast.batch_size, fast.max_seq_len) == (ref.num_tokens, ref.batch_size, ref.max_seq_len)
    assert torch.equal(fast.qo_indptr(), ref.qo_indptr()) and torch.equal(fast.kv_indptr(), ref.kv_indptr())


class _Sub(ForwardBatch):
    """A host's subclass: made through its own constructor (``_decode_from_host`` sets ``ForwardBatch``'s fields
    straight into ``__dict__`` only for ``ForwardBatch`` itself)."""


@pytest.mark.parametrize("cls", [ForwardBatch, _Sub])
@pytest.mark.parametrize("case", sorted(VALID))
def test_the_batch_made_from_host_ints_has_every_field_the_constructor_gives(case, cls):
    """The host-ints path fills ``ForwardBatch``'s ``__dict__`` directly (no setter calls): the same keys, in the
    same order, with the same values as the dataclass constructor with those fields (every field of the class,
    defaults included — a field added to the class and not to that path fails here), plus the validation record."""
    import dataclasses

    rows, seq, loc = VALID[case]
    fast = cls.decode(rows, seq, loc)
    assert type(fast) is cls
    made = cls(**{f.name: getattr(fast, f.name) for f in dataclasses.fields(cls)})
    names = [f.name for f in dataclasses.fields(cls)]
    assert [k for k in fast.__dict__ if not k.startswith("_")] == names == list(made.__dict__)
    for name in names:
        assert getattr(fast, name) is getattr(made, name), name
    defaults = cls(ForwardMode.DECODE, fast.req_pool_indices, fast.seq_lens, fast.out_cache_loc)
    for f in dataclasses.fields(cls):
        if f.name in ("spec_num_draft_tokens", "spec_custom_mask", "encoder_lens", "mla_form"):
            assert getattr(fast, f.name) == getattr(defaults, f.name), f.name  # the constructor's defaults
    assert {"_validated", "_host_ints", "_made"} <= set(fast.__dict__)



INVALID = {
    "negative row": (([0, -1], [3, 3], [1, 2]), {}),
    "zero length": (([0, 1], [3, 0], [1, 2]), {}),
    "negative length": (([0], [-4], [1]), {}),
    "negative slot": (([0, 1], [3, 3], [1, -1]), {}),
    "too few rows": (([0], [3, 3], [1, 2]), {}),
    "too many rows": (([0, 1, 2], [3, 3], [1, 2]), {}),
    "too few slots": (([0, 1], [3, 3], [1]), {}),
    "too many slots": (([0, 1], [3, 3], [1, 2, 3]), {}),
    "bad mla form": (([0], [3], [1]), {"mla_form": "compressed"}),
}


@pytest.mark.parametrize("inference", [False, True], ids=["plain", "inference_mode"])
@pytest.mark.parametrize("case", sorted(INVALID))
def test_host_ints_are_refused_as_the_tensor_path_refuses_them(case, inference):
    (rows, seq, loc), kw = INVALID[case]
    with _mode(inference):
        with pytest.raises(ShapeError) as ref:
            _tensor_path(rows, seq, loc, **kw)
        with pytest.raises(ShapeError) as fast:
            ForwardBatch.decode(rows, seq, loc, **kw)
    assert str(fast.value) == str(ref.value)


@pytest.mark.parametrize("field,args", [
    ("req_pool_indices", ([2 ** 63], [3], [1])),
    ("seq_lens", ([0], [2 ** 64], [1])),
    ("out_cache_loc", ([0], [3], [2 ** 70])),
])
def test_a_value_outside_int64_is_refused_naming_the_field(field, args):
    with pytest.raises(ShapeError, match=f"ForwardBatch.{field} holds a value outside int64"):
        ForwardBatch.decode(*args)


@pytest.mark.parametrize("rows,seq,loc,match", [
    ([True], [3], [1], "must be integers, got dtype torch.bool"),  # a bool is not taken as an index
    ([0], [3.0], [1], "must be integers, got dtype torch.float32"),
    ([0], [3], [1.5], "must be integers, got dtype torch.float32"),
])
def test_values_that_are_not_plain_ints_take_the_tensor_path_and_its_refusal(rows, seq, loc, match):
    with pytest.raises(ShapeError, match=match):
        ForwardBatch.decode(rows, seq, loc)


def test_numpy_ints_and_other_fields_take_the_tensor_path_with_the_same_result():
    a = ForwardBatch.decode(np.array([1, 2]), [3, 4], [5, 6])
    b = ForwardBatch.decode([1, 2], [3, 4], [5, 6], encoder_lens=torch.tensor([2, 2]))
    assert torch.equal(a.seq_lens, torch.tensor([3, 4])) and a.req_pool_indices_cpu == [1, 2]
    assert torch.equal(b.encoder_lens, torch.tensor([2, 2])) and b.positions.tolist() == [2, 3]


# -- a change after the checks is still refused, under inference mode too --------------------------------
H, KV, D, PS = 4, 2, 8, 4
LAYERS = [LayerSpec(layer_id=i, num_heads=H, num_kv_heads=KV, head_dim=D) for i in range(2)]


def _decode_setup(kind):
    s = small_setup(kind, num_layers=2, lens={2: 7, 0: 3}, heads=H, kv_heads=KV, head_dim=D, page_size=PS)
    loc = [int(s.cache.req_to_token[2, 6]), int(s.cache.req_to_token[0, 2])]
    return s.cache, s.backend, ([2, 0], [7, 3], loc), qkv(s, LAYERS[0], 2)


FIELDS = ("req_pool_indices", "seq_lens", "out_cache_loc", "positions", "extend_prefix_lens", "extend_seq_lens")


@pytest.mark.parametrize("kind", ["torch_native", "template_sdpa"])
@pytest.mark.parametrize("field", FIELDS)
@pytest.mark.parametrize("before_layer", [0, 1])
def test_an_in_place_change_is_refused_under_inference_mode(kind, field, before_layer):
    """The host path's tensors keep write counters under ``torch.inference_mode`` (the runner's mode): a
    field written in place after ``init_forward_metadata`` is refused at the next layer, naming it, and the
    cache is not written by the refused layer."""
    cache, backend, args, (q, k, v) = _decode_setup(kind)
    with torch.inference_mode():
        batch = ForwardBatch.decode(*args)
        backend.init_forward_metadata(batch)
        for layer in LAYERS[:before_layer]:
            backend.forward(q, k, v, layer, batch)
        target = LAYERS[before_layer]
        kept = cache.get_kv(target.layer_id)[0].clone()
        getattr(batch, field)[0] += 1
        with pytest.raises(ShapeError, match=f"ForwardBatch.{field} changed after init_forward_metadata"):
            backend.forward(q, k, v, target, batch)
        assert torch.equal(cache.get_kv(target.layer_id)[0], kept)


@pytest.mark.parametrize("kind", ["torch_native", "template_sdpa"])
@pytest.mark.parametrize("value,what", [(-1, "is unassigned"), (10 ** 6, "is out of range"), (70, "is out of range")])
def test_a_page_table_changed_before_the_step_is_refused_by_the_per_forward_check(kind, value, what):
    """What the host path does not read back (``req_to_token``) is still checked per forward."""
    cache, backend, args, _ = _decode_setup(kind)
    cache.req_to_token[2, 1] = value
    with torch.inference_mode():
        batch = ForwardBatch.decode(*args)
        with pytest.raises(ShapeError, match=f"request 0 \\(req_to_token row 2\\): position 1 .* {what}"):
            backend.init_forward_metadata(batch)


@pytest.mark.parametrize("kind", ["torch_native", "template_sdpa"])
@pytest.mark.parametrize("args,match", [
    (([2, 0], [7, 3], [1000, 1]), r"out_cache_loc\[0\]=1000 is out of range"),
    (([9, 0], [7, 3], [1, 2]), r"req_pool_indices\[0\]=9 is out of range"),
    (([2, 0], [33, 3], [1, 2]), "seq_lens=33 exceeds max_context_len=32"),
])
def test_an_out_of_range_slot_row_or_length_from_host_ints_is_refused_per_forward(kind, args, match):
    _, backend, _, _ = _decode_setup(kind)
    with torch.inference_mode():
        batch = ForwardBatch.decode(*args)
        with pytest.raises(ShapeError, match=match):
            backend.init_forward_metadata(batch)
