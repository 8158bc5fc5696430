"""The per-layer hot path (issue 30): what runs once per layer object, once per forward, and per call.

A layer's first forward runs every structural check and builds its plan; later forwards compare
q/k/v with what the plan and the forward recorded. These tests hold the skeleton to that: every
refusal still happens on a layer that already has a plan (the cheap comparisons must miss nothing),
the layer-only checks and the verdict run once per layer object, the per-forward record follows each
new ``init_forward_metadata``, and ``kernel_call`` (what ``bench --overhead`` compares with) does the
forward's work.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from attnplug import ForwardBatch, LayerSpec, NotSupportedError, PagedBackend, ShapeError
from attnplug.errors import MetadataNotInitializedError
from attnplug.kvcache import PagedKVCache, indptr

from test_paged_base import (CacheReadingToy, H, KV, D, LAYER, ToyBackend, decode_batch, make, qkv, restore, same,
                             snapshot)


class _NoSetterBatch(ForwardBatch):
    """A ``ForwardBatch`` whose class replaces the setter (a host's subclass): a replaced field does not replace the
    validation record, so the per-layer guard must compare every field's identity for it."""

    __setattr__ = object.__setattr__  # type: ignore[assignment]


def _batch_of_kind(cache, kind):
    """The test's decode batch made the ways a host makes one: from tensors (one write counter per field); from
    host ints (every field a view of one buffer: one counter); from host ints after a previous step (fields taken
    from the previous batch's buffer: two counters); and the host-ints batch of a class without the setter."""
    batch = decode_batch(cache)
    loc = batch.out_cache_loc.tolist()
    if kind == "tensors":
        return batch
    if kind == "host ints":
        return ForwardBatch.decode([2, 0], [6, 3], loc)
    if kind == "host ints after":
        prev = ForwardBatch.decode([2, 0], [5, 2], [0, 1])
        return ForwardBatch.decode([2, 0], [6, 3], loc, after=prev)
    assert kind == "no setter"
    return _NoSetterBatch.decode([2, 0], [6, 3], loc)


BATCH_KINDS = ("tensors", "host ints", "host ints after", "no setter")


def _planned(cls=ToyBackend, kind="tensors"):
    """A backend whose LAYER already ran one good forward (so it has a plan)."""
    backend, cache = make(cls)
    batch = _batch_of_kind(cache, kind)
    backend.init_forward_metadata(batch)
    backend.forward(*qkv(2), LAYER, batch)
    assert backend.layer_plan(LAYER) is backend.layer_plan(LAYER)  # cached per layer object
    return backend, cache, batch


def _bad_calls():
    q, k, v = qkv(2)
    return {
        "q dtype": ((q.to(torch.float64), k.double(), v.double()), NotSupportedError, r"dtype=float64"),
        "q int dtype": ((q.to(torch.int32), k.int(), v.int()), NotSupportedError, r"dtype=int32"),
        "q shape": ((q[:, :2], k, v), ShapeError, r"q has shape \(2, 2, 8\)"),
        "q tokens": ((q[:1], k[:1], v[:1]), ShapeError, r"q has shape \(1, 4, 8\)"),
        "k shape": ((q, k[:, :1], v), ShapeError, r"k has shape \(2, 1, 8\)"),
        "v shape": ((q, k, v[:, :, :4]), ShapeError, r"v has shape \(2, 2, 4\)"),
        "k dtype": ((q, k.bfloat16(), v), ShapeError, r"dtypes differ"),
        "v dtype": ((q, k, v.bfloat16()), ShapeError, r"dtypes differ"),
        "k and v None": ((q, None, None), ShapeError, r"k and v are None for self-attention layer 1"),
        "v None": ((q, k, None), ShapeError, r"k and v must both be given"),
        "k None": ((q, None, v), ShapeError, r"k and v must both be given"),
        # the per-call device test reads Tensor.is_cpu for a CPU cache (round 5): a tensor on another device
        # ("meta": no data, any machine) still takes the full check and its words
        "q device": ((q.to("meta"), k, v), ShapeError, r"q/k/v are on meta, the KV cache of layer 1 on cpu"),
        "k device": ((q, k.to("meta"), v.to("meta")), ShapeError, r"q/k/v are on cpu, the KV cache of layer 1 on cpu"),
    }


@pytest.mark.parametrize("cls", [ToyBackend, CacheReadingToy])
@pytest.mark.parametrize("case", list(_bad_calls()))
def test_a_planned_layer_still_refuses_every_bad_call_and_writes_nothing(cls, case):
    """The cheap per-call comparisons miss nothing: each refusal of a first call also happens once the
    layer has a plan, with the same message, and the cache is untouched."""
    backend, cache, batch = _planned(cls)
    (q, k, v), exc, match = _bad_calls()[case]
    before = snapshot(cache)
    with pytest.raises(exc, match=match):
        backend.forward(q, k, v, LAYER, batch)
    assert same(cache, before)
    backend.forward(*qkv(2), LAYER, batch)  # and the layer still serves good calls


class CrossToy(ToyBackend):
    capabilities = dataclasses.replace(ToyBackend.capabilities, cross_attention=True)


def test_a_planned_cross_attention_layer_still_needs_encoder_lens():
    backend, cache = make(CrossToy)
    cross = LayerSpec(layer_id=0, num_heads=H, num_kv_heads=KV, head_dim=D, is_cross_attention=True)
    batch = decode_batch(cache)
    batch.encoder_lens = torch.tensor([2, 3])
    batch.validate()
    backend.init_forward_metadata(batch)
    q, _, _ = qkv(2)
    backend.forward(q, None, None, cross, batch)  # planned
    plain = decode_batch(cache)
    backend.init_forward_metadata(plain)
    with pytest.raises(ShapeError, match="cross-attention layer 0 but ForwardBatch.encoder_lens is None"):
        backend.forward(q, None, None, cross, plain)


def test_layer_checks_and_the_verdict_run_once_per_layer_object(monkeypatch):
    backend, cache = make()
    calls = {"rows": 0, "verdict": 0}
    rows, reasons = cache.check_layer_rows, type(backend).layer_reasons

    def count_rows(layer):
        calls["rows"] += 1
        return rows(layer)

    def count_reasons(self, layer):
        calls["verdict"] += 1
        return reasons(self, layer)

    monkeypatch.setattr(cache, "check_layer_rows", count_rows)
    monkeypatch.setattr(type(backend), "layer_reasons", count_reasons)
    layers = [LayerSpec(layer_id=i, num_heads=H, num_kv_heads=KV, head_dim=D) for i in range(2)]
    for _ in range(3):  # three forwards of a two-layer model
        batch = decode_batch(cache)
        backend.init_forward_metadata(batch)
        for layer in layers:
            backend.forward(*qkv(2), layer, batch)
    assert calls["verdict"] == 2  # once per layer object
    assert calls["rows"] <= 2 * 2  # the first call of each layer (check_forward, then the plan)


def test_an_unsupported_layer_is_refused_on_every_call():
    """A layer that fails its checks gets no plan: every call refuses it again."""
    backend, cache = make()
    wide = LayerSpec(layer_id=0, num_heads=H, num_kv_heads=KV, head_dim=D, logit_cap=3.0)

    class NoCap(type(backend)):
        capabilities = type(backend).capabilities

        def backend_reasons(self, layer, ctx):
            return ["logit_cap=3.0 is not claimed"] if layer.logit_cap else []

    nocap = NoCap(backend.ctx)
    batch = decode_batch(cache)
    nocap.init_forward_metadata(batch)
    for _ in range(2):
        with pytest.raises(NotSupportedError, match="logit_cap=3.0 is not claimed"):
            nocap.forward(*qkv(2), wide, batch)


def test_the_forward_record_follows_each_new_batch():
    """The token count and compute recorded by init_forward_metadata are the new batch's, not the last's."""
    backend, cache, batch = _planned()
    from attnplug import ForwardBatch
    loc = torch.stack([cache.slots(2, 4, 5)[0]])
    one = ForwardBatch.decode([2], [5], loc)
    backend.init_forward_metadata(one)
    q, k, v = qkv(1)
    out = backend.forward(q, k, v, LAYER, one)
    assert out.shape == (1, H, D)
    with pytest.raises(ShapeError, match=r"q has shape \(2, 4, 8\), expected \(1, 4, 8\)"):
        backend.forward(*qkv(2), LAYER, one)


def test_a_layer_like_object_that_is_not_a_layerspec_is_checked_on_every_call():
    """Only frozen LayerSpecs get a cached plan: another object may change, so its layer checks rerun."""
    class MutableLayer:
        def __init__(self, spec):
            self.__dict__.update(dataclasses.asdict(spec))

        gqa_group_size = property(lambda s: s.num_heads // s.num_kv_heads)
        uses_sliding_window = property(lambda s: s.sliding_window is not None)
        uses_softcap = property(lambda s: bool(s.logit_cap))
        uses_sinks = property(lambda s: s.sinks is not None)

    backend, cache = make()
    layer = MutableLayer(LAYER)
    batch = decode_batch(cache)
    backend.init_forward_metadata(batch)
    backend.forward(*qkv(2), layer, batch)
    layer.layer_id = 7  # out of range now
    with pytest.raises(ShapeError, match="layer_id=7 is out of range"):
        backend.forward(*qkv(2), layer, batch)


@pytest.mark.parametrize("cls", [ToyBackend, CacheReadingToy])
@pytest.mark.parametrize("save", [True, False])
def test_kernel_call_does_the_forwards_work(cls, save):
    """What bench --overhead compares a forward with: the same output and the same cache writes."""
    backend, cache, batch = _planned(cls)
    q, k, v = qkv(2)
    before = snapshot(cache)
    want = backend.forward(q, k, v, LAYER, batch)
    after = snapshot(cache)
    restore(cache, before)
    call = backend.kernel_call(q, k, v, LAYER, batch)
    got = call()
    torch.testing.assert_close(got, want)
    assert same(cache, after)
    assert got is not call()  # a fresh output per call


@pytest.mark.parametrize("lens", [[], [0], [3], [1, 2, 3], (4, 0, 5)])
def test_indptr_from_host_lengths_equals_the_tensor_path(lens):
    got = indptr(list(lens))
    want = indptr(torch.tensor(list(lens), dtype=torch.int64))
    assert got.dtype == want.dtype == torch.int32 and torch.equal(got, want)


@pytest.mark.parametrize("lens", [(5, 5), (4, 8), (8, 4), (1, 9), (9, 9)])
def test_page_table_zeroes_columns_past_each_requests_pages(lens):
    """The mask-free page table (every request fills every column) and the masked one agree with a
    per-request reading of req_to_token."""
    from attnplug import ForwardBatch, PageAllocator

    cache = PagedKVCache(1, num_pages=16, num_kv_heads=1, head_dim=4, page_size=4, max_requests=2,
                         max_context_len=16)
    alloc = PageAllocator(16, seed=1)
    for r, n in enumerate(lens):
        cache.assign_pages(r, n, alloc.alloc(-(-n // 4)))
    loc = torch.cat([cache.slots(r, n - 1, n) for r, n in enumerate(lens)])
    batch = ForwardBatch.decode([0, 1], list(lens), loc)
    table = cache.page_table(batch)
    pages = -(-max(lens) // 4)
    assert table.shape == (2, pages) and table.dtype == torch.int32
    for r, n in enumerate(lens):
        for j in range(pages):
            want = int(cache.req_to_token[r, j * 4]) // 4 if j * 4 < n else 0
            assert int(table[r, j]) == want


# -- round 2 of issue 30: the page-alignment fast path, hosts under inference_mode --------------------

def _aligned_cache(lens, ps=4, seed=3):
    from attnplug import PageAllocator

    cache = PagedKVCache(1, num_pages=32, num_kv_heads=1, head_dim=4, page_size=ps, max_requests=len(lens),
                         max_context_len=32)
    alloc = PageAllocator(32, seed=seed)
    for r, n in enumerate(lens):
        cache.assign_pages(r, n, alloc.alloc(-(-n // ps)))
    return cache


def _unaligned(kind, cache, lens):
    """Break page alignment one way in the last request's row (``kind``); returns the position broken."""
    r, ps, t = len(lens) - 1, cache.page_size, cache.req_to_token
    if kind == "slot moved within its page":  # same page, wrong offset
        t[r, 1], t[r, 2] = int(t[r, 2]), int(t[r, 1])
        return 1
    if kind == "page does not start at a multiple":  # the whole page shifted by one slot
        t[r, 0:ps] += 1
        return 0
    if kind == "page switched mid-page":  # the second half of a page in another (aligned) page
        t[r, 2:ps] = t[r, 2:ps] + 4 * ps
        return 2
    if kind == "last position read off by one slot":
        n = lens[r]
        t[r, n - 1] = int(t[r, n - 1]) + 1
        return n - 1
    raise AssertionError(kind)


_UNALIGNED = ["slot moved within its page", "page does not start at a multiple", "page switched mid-page",
              "last position read off by one slot"]


@pytest.mark.parametrize("lens", [(7,), (3, 9), (4, 1, 10), (8, 8)])
def test_check_page_aligned_accepts_every_aligned_mapping(lens):
    cache = _aligned_cache(lens)
    cache.check_page_aligned(list(range(len(lens))), list(lens), who="toy")


@pytest.mark.parametrize("lens", [(7,), (3, 9), (4, 1, 10)])
@pytest.mark.parametrize("kind", _UNALIGNED)
def test_check_page_aligned_fast_path_refuses_what_the_full_pass_names(lens, kind):
    """The sliced pass (few requests) refuses every unaligned mapping, and the error is the full pass's:
    request, row and position named; a mapping that only looks aligned at page starts is caught too."""
    import attnplug.kvcache as kvcache

    cache = _aligned_cache(lens)
    pos = _unaligned(kind, cache, lens)
    rows, n = list(range(len(lens))), list(lens)
    assert not cache._aligned_slices(rows, n)
    with pytest.raises(ShapeError, match=rf"\(request {len(lens) - 1}, position {pos}\) is not page-aligned"):
        cache.check_page_aligned(rows, n, who="toy")
    # the full pass alone (no sliced pass) says the same
    old = kvcache._SLICED_CHECK_ROWS
    kvcache._SLICED_CHECK_ROWS = 0
    try:
        with pytest.raises(ShapeError, match=rf"\(request {len(lens) - 1}, position {pos}\) is not page-aligned"):
            cache.check_page_aligned(rows, n, who="toy")
    finally:
        kvcache._SLICED_CHECK_ROWS = old


@pytest.mark.parametrize("shape", [(3,), (2, 5)])
def test_version_of_an_inference_tensor_is_none_without_raising(shape):
    """Hosts run under torch.inference_mode (vLLM, the transformers runner): their index tensors keep no
    write counter. ``_version`` asks first instead of catching the error reading it raises (~12 us a field
    and forward, measured: the transformers runner spent 180 us a token in it)."""
    from attnplug.batch import _version

    with torch.inference_mode():
        t = torch.zeros(shape, dtype=torch.int64)
    normal = torch.zeros(shape, dtype=torch.int64)
    before = _version(normal)
    normal.add_(1)
    assert _version(t) is None and _version(None) is None
    assert _version(normal) == before + 1


@pytest.mark.parametrize("cls", [ToyBackend, CacheReadingToy])
def test_a_forward_under_inference_mode_writes_through_a_private_copy_of_the_slots(cls):
    """Under inference_mode the forward's int64 write slots are a copy made outside it (it keeps a write
    counter, so per-slot-tensor memos hold for the forward), equal to out_cache_loc; the forward's output
    and writes are those of a forward outside inference mode."""
    backend, cache = make(cls)
    initial = snapshot(cache)
    b0 = decode_batch(cache)
    backend.init_forward_metadata(b0)
    q, k, v = qkv(2)
    want = backend.forward(q, k, v, LAYER, b0)
    written = snapshot(cache)
    restore(cache, initial)
    with torch.inference_mode():
        batch = decode_batch(cache)
        backend.init_forward_metadata(batch)
        loc = backend._fwd.loc
        got = backend.forward(q, k, v, LAYER, batch)
        got2 = backend.forward(q, k, v, LAYER, batch)
    assert batch.out_cache_loc.is_inference() and not loc.is_inference()
    assert loc is not batch.out_cache_loc and torch.equal(loc, batch.out_cache_loc.to(torch.int64))
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got2, want)
    assert same(cache, written)


# -- round 5: the per-layer "batch unchanged" test without the call (PagedBackend._unchanged) ----------------
_TENSOR_FIELDS = ("req_pool_indices", "seq_lens", "out_cache_loc", "extend_prefix_lens", "extend_seq_lens",
                  "positions")


def _shares_counter(batch, field):
    """``field``'s tensor is a view of a buffer another index field of ``batch`` is a view of too."""
    base = getattr(batch, field)._base
    return base is not None and any(getattr(batch, f)._base is base for f in _TENSOR_FIELDS if f != field)


@pytest.mark.parametrize("kind", BATCH_KINDS)
@pytest.mark.parametrize("field", _TENSOR_FIELDS)
@pytest.mark.parametrize("how", ["in_place", "in_place_value", "replaced", "replaced_equal", "revalidated", "none"])
def test_the_per_layer_unchanged_test_answers_as_changed_since_validate(field, how, kind):
    """``PagedBackend._unchanged(fwd)`` (what each layer asks) is ``changed_since_validate() is None`` whenever
    that says a field changed, for every index field, every way to change it and every way a host makes the batch
    (issue 30, sixth session: one write counter for the views of one buffer; the validation record replaced with
    a replaced field); after a re-validation it answers False (the full check then asks
    ``changed_since_validate`` itself), and a forward then runs or refuses: the error names the field — a write of
    the same values into a buffer several fields are views of names all of them."""
    from attnplug import PagedBackend

    backend, cache, batch = _planned(kind=kind)
    fwd = backend._fwd
    assert PagedBackend._unchanged(fwd) and batch.changed_since_validate() is None
    t = getattr(batch, field)
    shared = _shares_counter(batch, field)
    assert shared == (kind in ("host ints", "host ints after", "no setter"))
    if how == "in_place":
        t.add_(0)  # the same values: the write counter moves
    elif how == "in_place_value":
        t[0] += 1
    elif how in ("replaced", "replaced_equal"):
        setattr(batch, field, t.clone() if how == "replaced_equal" else t + 0)
    elif how == "revalidated":
        t.add_(0)
        batch.validate()
    changed = batch.changed_since_validate()
    fast = PagedBackend._unchanged(fwd)
    # the flag the layer reads first (``_Forward.trusted``, pushed by the record when superseded): set only for a
    # batch whose setter replaces the record, and cleared exactly when the record was replaced
    assert fwd.trusted == (kind != "no setter" and how in ("in_place", "in_place_value", "none"))
    if changed is not None:
        assert not fast
        if how == "in_place" and shared:
            assert changed.endswith("(views of one buffer, one of them written in place)") and field in changed
        else:
            assert changed == field
    elif how == "none":
        assert fast
    else:  # re-validated: the cheap test is conservative, the full check decides
        assert not fast
    if changed is not None:
        with pytest.raises(ShapeError, match=rf"ForwardBatch\.(?:[a-z_, ]*\b)?{field}\b.* changed after "
                                             rf"init_forward_metadata"):
            backend.forward(*qkv(2), LAYER, batch)
    else:
        backend.forward(*qkv(2), LAYER, batch)


@pytest.mark.parametrize("kind", BATCH_KINDS)
def test_the_per_layer_guard_reads_one_counter_per_buffer_and_trusts_the_record_only_with_the_setter(kind):
    """What the per-layer guard reads (``_Forward.counters``, ``_Forward.watch``): one write counter per buffer
    the index fields are views of (a host-ints batch: one; one taking fields from the previous step: two; a batch
    of tensors: one per field) and ``req_to_token``'s, and the record's identity alone only for a class whose setter replaces the
    record when a field is replaced; a field replaced before the forward record is made is compared field by
    field (the record would not show it)."""
    from attnplug.paged import _RECORD_TRACKS_FIELDS, _Forward

    backend, cache, batch = _planned(kind=kind)
    fwd = backend._fwd
    # the batch's counters, then ``req_to_token``'s
    assert len(fwd.counters) == {"tensors": 6, "host ints": 1, "host ints after": 2, "no setter": 1}[kind] + 1
    assert fwd.counters[-1][0] is cache.req_to_token
    # the buffer out_cache_loc is a view of is read through out_cache_loc itself (the tensor the K/V write touches)
    loc = batch.out_cache_loc
    assert sum(t is loc for t, _ in fwd.counters) == 1
    base = loc._base if loc._base is not None else loc
    assert not any(t is base for t, _ in fwd.counters) or base is loc
    # worked out once per record: a second forward record of the batch takes the very same tuple
    record = batch.__dict__["_validated"]
    assert record.counters() is record.counters() and fwd.counters[:-1] == record.counters()
    assert (fwd.watch is _RECORD_TRACKS_FIELDS) == (kind != "no setter")
    object.__setattr__(batch, "seq_lens", batch.seq_lens.clone())  # past the setter: the record is not replaced
    again = _Forward(backend, batch, fwd.meta)
    assert again.watch is not _RECORD_TRACKS_FIELDS and not PagedBackend._unchanged(again)


def test_the_unchanged_test_of_a_batch_without_a_validation_record_is_the_call_s():
    """A batch-like object with no ``_validated`` record: ``_unchanged`` asks ``changed_since_validate`` (or has
    nothing to ask), as the skeleton did."""
    from attnplug import PagedBackend
    from attnplug.paged import _Forward

    backend, cache, batch = _planned()
    batch.__dict__.pop("_validated")
    fwd = _Forward(backend, batch, backend._fwd.meta)
    assert fwd.watch is None and PagedBackend._unchanged(fwd)
    fwd.changed = lambda: "seq_lens"
    assert not PagedBackend._unchanged(fwd)


# -- the backend's checked call (PagedBackend.checked_layer_call; issue 30, fourth session) --------------------
class CheckedCallToy(ToyBackend):
    """A backend offering the skeleton a self-checking call per planned layer: it records every try and either
    declines (``None``: the skeleton's checked path runs) or, when ``accept`` is set, runs the layer itself with
    the checks it claims (here: q/k/v exactly the plan's shapes, dtype and device, else it declines)."""

    accept = False

    def checked_layer_call(self, plan):
        self.tries = getattr(self, "tries", [])

        def call(q, k, v, meta, loc, save_kv_cache):
            self.tries.append((plan.layer_id, q, meta, loc, save_kv_cache))
            if not self.accept or k is None or v is None or not save_kv_cache:
                return None
            T = loc.shape[0]
            ok = q.shape == (T,) + plan.q_rest and k.shape == (T,) + plan.k_rest and v.shape == (T,) + plan.v_rest \
                and q.dtype == k.dtype == v.dtype == self.cache.dtype and q.is_cpu and k.is_cpu and v.is_cpu
            if not ok:
                return None
            out = self.compute_extend(q, k, v, plan.layer, self._fwd.batch, meta)
            self.write_new_kv(self.cache, plan, loc, k, v)
            self.accepted = getattr(self, "accepted", 0) + 1
            return out

        return call


def test_the_checked_call_is_tried_only_for_a_planned_layer_after_the_per_forward_checks():
    """A layer's first call (no plan yet) takes the full check; a planned layer's call is offered to the backend
    with the forward's metadata and int64 slots and ``save_kv_cache``; a batch changed since
    ``init_forward_metadata`` or a ``req_to_token`` written since is refused before the backend sees the call."""
    backend, cache = make(CheckedCallToy)
    batch = decode_batch(cache)
    backend.init_forward_metadata(batch)
    backend.forward(*qkv(2), LAYER, batch)
    assert backend.tries == []  # the plan is built by this call (its checks ran in full)
    backend.forward(*qkv(2), LAYER, batch, save_kv_cache=False)
    (lid, q, meta, loc, save), = backend.tries
    assert lid == LAYER.layer_id and meta == "meta" and loc.dtype == torch.int64 and save is False
    assert torch.equal(loc, batch.out_cache_loc.to(torch.int64))
    batch.seq_lens.add_(0)  # an index field written after init_forward_metadata
    with pytest.raises(ShapeError, match=r"ForwardBatch\.seq_lens changed after init_forward_metadata"):
        backend.forward(*qkv(2), LAYER, batch)
    backend.init_forward_metadata(batch)
    cache.req_to_token.add_(0)  # the page table written after the forward was checked
    with pytest.raises(ShapeError, match=r"req_to_token was written after init_forward_metadata"):
        backend.forward(*qkv(2), LAYER, batch)
    assert len(backend.tries) == 1


@pytest.mark.parametrize("accept", [False, True], ids=["declines", "accepts_good_calls"])
@pytest.mark.parametrize("case", list(_bad_calls()))
def test_a_checked_call_leaves_every_bad_call_to_the_skeletons_words(case, accept):
    """Whatever the backend's call declines reaches the skeleton's per-call checks: every refusal of a planned
    layer keeps its error and words, the cache untouched, and good calls still run."""
    backend, cache, batch = _planned(CheckedCallToy)
    backend.accept = accept
    (q, k, v), exc, match = _bad_calls()[case]
    before = snapshot(cache)
    with pytest.raises(exc, match=match):
        backend.forward(q, k, v, LAYER, batch)
    assert same(cache, before)
    assert getattr(backend, "accepted", 0) == 0
    backend.forward(*qkv(2), LAYER, batch)
    assert getattr(backend, "accepted", 0) == (1 if accept else 0)


def test_an_accepted_checked_call_is_the_layers_forward():
    """The call's output is the forward's, and its write is the forward's: the same bytes as the skeleton's path."""
    results = []
    for cls_accept in (False, True):
        torch.manual_seed(0)  # (``make`` fills the cache with random values: the same ones for both)
        backend, cache, batch = _planned(CheckedCallToy)
        backend.accept = cls_accept
        q, k, v = qkv(2)
        out = backend.forward(q, k * 2, v * 3, LAYER, batch)
        results.append((out, snapshot(cache)))
        assert getattr(backend, "accepted", 0) == (1 if cls_accept else 0)
    (o1, c1), (o2, c2) = results
    assert torch.equal(o1, o2)
    assert all(torch.equal(a, b) for pa, pb in zip(c1, c2) for a, b in zip(pa, pb))


class OwnWriteToy(ToyBackend):
    """Overrides ``write_new_kv``: the skeleton must call it, never its own inline write."""

    writes = 0

    def write_new_kv(self, cache, plan, loc, k, v):
        self.writes += 1
        super().write_new_kv(cache, plan, loc, k, v)


class OwnComputeAndWriteToy(ToyBackend):
    """Overrides ``compute_and_write``: the skeleton must call it, never its own inline write."""

    calls = 0

    def compute_and_write(self, compute, cache, plan, loc, q, k, v, layer, batch, meta):
        self.calls += 1
        return super().compute_and_write(compute, cache, plan, loc, q, k, v, layer, batch, meta)


@pytest.mark.parametrize("cls", [ToyBackend, OwnWriteToy, OwnComputeAndWriteToy])
def test_the_inline_write_is_the_hooks_write_and_only_where_no_hook_is_overridden(cls):
    """``_forward`` writes the new K/V itself (no ``compute_and_write`` / ``write_new_kv`` frame) only for a backend
    keeping both hooks; the cache then holds exactly what the hooks write, and a raising compute writes nothing.
    A backend overriding either hook gets its override on every planned call."""
    backend, cache, batch = _planned(cls)
    assert backend._plain_write is (cls is ToyBackend)
    q, k, v = qkv(2)
    k, v = 2 * k + 1, 3 * v  # not the planning forward's values: this forward's write must show
    before = snapshot(cache)
    out = backend.forward(q, k, v, LAYER, batch)
    want_cache = snapshot(cache)
    restore(cache, before)
    plan = backend.layer_plan(LAYER)
    PagedBackend.write_new_kv(backend, cache, plan, batch.out_cache_loc.to(torch.int64), k, v)
    assert same(cache, want_cache)  # the forward wrote what the hook writes: the slots of this forward, k and v
    assert not same(cache, before)
    if cls is OwnWriteToy:
        assert backend.writes == 2  # the planning forward and this one
    if cls is OwnComputeAndWriteToy:
        assert backend.calls == 2
    torch.testing.assert_close(out, backend.kernel_call(q, k, v, LAYER, batch)())
    backend.fail_with = RuntimeError("kernel failed")
    restore(cache, before)
    with pytest.raises(RuntimeError, match="kernel failed"):
        backend.forward(q, k, v, LAYER, batch)
    assert same(cache, before)  # a raising compute writes nothing


class DecodeHookToy(ToyBackend):
    """Overrides ``forward_decode``: its ``forward`` must dispatch to it."""

    decodes = 0

    def forward_decode(self, q, k, v, layer, batch, save_kv_cache=True):
        self.decodes += 1
        return super().forward_decode(q, k, v, layer, batch, save_kv_cache)


class DecodeHookChild(DecodeHookToy):
    pass


class DirectAgain(DecodeHookToy):
    forward_decode = PagedBackend.forward_decode  # both hooks the skeleton's again


class OwnForwardToy(ToyBackend):
    def forward(self, q, k, v, layer, batch, save_kv_cache=True):
        self.own = True
        return super().forward(q, k, v, layer, batch, save_kv_cache)


def test_a_class_keeping_the_skeletons_hooks_has_the_skeleton_as_its_forward():
    """No dispatch frame for a class keeping ``forward_decode`` / ``forward_extend``; the dispatching ``forward``
    for one overriding either (and its subclasses), and a class's own ``forward`` is never replaced."""
    assert ToyBackend.forward is PagedBackend._forward
    assert DecodeHookToy.forward is PagedBackend.forward and DecodeHookChild.forward is PagedBackend.forward
    assert DirectAgain.forward is PagedBackend._forward
    assert OwnForwardToy.__dict__["forward"] is OwnForwardToy.forward
    for cls in (ToyBackend, DecodeHookToy, DecodeHookChild, DirectAgain, OwnForwardToy):
        backend, cache, batch = _planned(cls)
        out = backend.forward(*qkv(2), LAYER, batch)
        torch.testing.assert_close(out, backend.kernel_call(*qkv(2), LAYER, batch)())  # the layer's attention
        if cls in (DecodeHookToy, DecodeHookChild):
            assert backend.decodes == 2  # the planning forward and this one went through the override
        if cls is OwnForwardToy:
            assert backend.own


@pytest.mark.parametrize("cls", [ToyBackend, DecodeHookToy])
def test_forward_without_metadata_idle_is_empty_and_any_other_mode_is_refused(cls):
    """As ``AttentionBackend.forward`` dispatched it: an IDLE batch needs no metadata (an empty output), any other
    batch without ``init_forward_metadata`` is refused by name."""
    backend, cache = make(cls)
    q, k, v = qkv(2)
    idle = ForwardBatch.idle()
    out = backend.forward(q[:0], k[:0], v[:0], LAYER, idle)
    assert out.shape == (0, H, D)
    with pytest.raises(MetadataNotInitializedError, match="before init_forward_metadata"):
        backend.forward(q, k, v, LAYER, decode_batch(cache))


# -- the plan chain and the record's push (issue 30, seventh session) ------------------------------------------
class _PlanRecordingToy(ToyBackend):
    """Records, per call, the plan the skeleton holds when it offers the backend's checked call (declined: the
    skeleton's checked path runs), so a test sees which plan each layer call used."""

    def checked_layer_call(self, plan):
        def call(q, k, v, meta, loc, save_kv_cache):
            self.used = getattr(self, "used", [])
            self.used.append(plan)
            return None
        return call


_LAYERS = tuple(LayerSpec(layer_id=i, num_heads=H, num_kv_heads=KV, head_dim=D) for i in range(4))


def _chain_forward(backend, cache, order, lookups):
    """One decode forward running the layers in ``order``; returns the outputs and how many plan lookups
    (``_find_plan``) it took."""
    batch = decode_batch(cache)
    backend.init_forward_metadata(batch)
    n = len(lookups)
    outs = [backend.forward(*qkv(2), _LAYERS[i], batch, save_kv_cache=False) for i in order]
    return outs, len(lookups) - n


def _one_successor(order):
    """Each layer of ``order`` followed by one layer only, the last by the first (the next forward's)."""
    succ = {}
    for a, b in zip(order, order[1:] + order[:1]):
        succ.setdefault(a, set()).add(b)
    return all(len(x) == 1 for x in succ.values())


@pytest.mark.parametrize("order", [(0, 1, 2, 3), (3, 1, 0, 2), (0, 0, 1, 1), (2,), (0, 1, 2, 3, 0, 1, 2, 3)])
def test_the_plan_chain_finds_each_layers_own_plan_and_looks_up_only_what_it_did_not_expect(order, monkeypatch):
    """``PagedBackend._forward`` takes the plan the chain expects (``LayerPlan.next``: the layer that followed
    in the last forward) and looks it up only when the layer is another: from the third forward of one layer
    order, no lookup at all; a new order costs one lookup per layer whose successor changed, then none. Every
    call holds the plan the lookup would give (its own layer's), and the outputs are the reference's."""
    torch.manual_seed(0)
    backend, cache = make(_PlanRecordingToy, num_layers=4)
    torch.manual_seed(0)  # (the same cache contents)
    ref, _ = make(ToyBackend, num_layers=4)
    lookups = []
    find = PagedBackend._find_plan

    def counting(self, fwd, layer):
        lookups.append(layer.layer_id)
        return find(self, fwd, layer)

    monkeypatch.setattr(PagedBackend, "_find_plan", counting)
    for step in range(3):
        outs, n = _chain_forward(backend, cache, order, lookups)
        expect, _ = _chain_forward(ref, ref.cache, order, [])
        assert all(torch.equal(a, b) for a, b in zip(outs, expect))
        # a layer followed by one layer only (within and across forwards) is always expected; one followed by
        # several (0 then 0, 0 then 1) costs a lookup where the last successor differs, never a wrong plan
        if step == 0:  # (every call looked up: a layer's first calls have no plan, later ones link)
            assert n == len(order)
        elif step == 2:
            assert n == 0 if _one_successor(order) else 0 < n < len(order), n
    used = backend.used[-len(order):]
    assert [p.layer for p in used] == [_LAYERS[i] for i in order]
    assert all(p is backend._layer_plans[id(p.layer)] for p in used)
    # another order: lookups only where the expectation fails, then none
    other = tuple(reversed(order))
    _, n = _chain_forward(backend, cache, other, lookups)
    assert 0 < n <= len(other) or other == order
    _, n = _chain_forward(backend, cache, other, lookups)
    assert n == 0 if _one_successor(other) else 0 < n < len(other)
    used = backend.used[-len(other):]
    assert [p.layer for p in used] == [_LAYERS[i] for i in other]


def test_a_plan_made_again_is_the_one_used_never_the_chains_old_one():
    """The chain never leads to a plan the lookup would not give: storing a plan (``layer_plan``) and
    ``forget_layer_plans`` unlink every plan; the next forwards use the new plans (found by lookup, then
    chained)."""
    backend, cache = make(_PlanRecordingToy, num_layers=4)
    for _ in range(3):
        _chain_forward(backend, cache, (0, 1, 2, 3), [])
    old = [backend.layer_plan(layer) for layer in _LAYERS]
    assert [p.next for p in old] == [old[1], old[2], old[3], None] and backend._first_plan is old[0]
    backend.forget_layer_plans()
    assert backend._first_plan is None and not backend._layer_plans and all(p.next is None for p in old)
    for step in range(3):
        backend.used = []
        _chain_forward(backend, cache, (0, 1, 2, 3), [])
        new = [backend._layer_plans[id(layer)] for layer in _LAYERS]
        assert not any(a is b for a, b in zip(new, old))
        if step:  # (the first forward after forgetting plans each layer on its full check: no checked call)
            assert backend.used == new
    # a plan stored while a forward runs (a layer seen for the first time) unlinks the chain, current forward too
    extra = LayerSpec(layer_id=0, num_heads=H, num_kv_heads=KV, head_dim=D)  # (equal, another object)
    batch = decode_batch(cache)
    backend.init_forward_metadata(batch)
    backend.forward(*qkv(2), _LAYERS[0], batch, save_kv_cache=False)
    assert backend._fwd.expect is new[1]
    backend.forward(*qkv(2), extra, batch, save_kv_cache=False)
    assert backend._fwd.expect is None and backend._first_plan is None and all(p.next is None for p in new)


def test_the_forward_record_is_told_when_the_batch_replaces_its_validation_record():
    """``ValidationRecord.watch``: the per-forward record (``_Forward.trusted``) is cleared when the batch
    replaces its validation record (a field replaced, ``validate`` again), whichever batch object shares it; the
    record holds its watchers weakly (an old forward's record is freed by reference counting alone, with its
    metadata); a copy, deep copy or pickle of a batch carries no watcher."""
    import copy
    import gc
    import pickle
    import weakref

    from attnplug.batch import ValidationRecord

    backend, cache, batch = _planned(kind="host ints")
    fwd = backend._fwd
    record = batch.__dict__["_validated"]
    assert type(record) is ValidationRecord and fwd.trusted and [r() for r in record.watchers] == [fwd]
    # copies: the record's entries, no watcher; the original's forward still trusted
    for clone in (copy.deepcopy(batch), pickle.loads(pickle.dumps(batch))):
        rec = clone.__dict__["_validated"]
        assert type(rec) is ValidationRecord and rec.watchers == [] and not rec.superseded
        assert list(rec) == list(record)
        clone.validate()
    assert fwd.trusted
    # a shallow copy shares the record: a field replaced on it clears the original's forward (conservative),
    # and the original's forward still runs (its batch unchanged: the full comparison says so)
    shallow = copy.copy(batch)
    shallow.seq_lens = shallow.seq_lens.clone()
    assert not fwd.trusted and record.superseded and PagedBackend._unchanged(fwd)
    backend.forward(*qkv(2), LAYER, batch)
    # a new forward on a new batch: the old record keeps no strong reference to the old forward
    gc.disable()
    try:
        old = weakref.ref(fwd)
        del fwd
        other = _batch_of_kind(cache, "host ints")
        backend.init_forward_metadata(other)
        assert old() is None
        assert backend._fwd.trusted
        other.validate()
        assert not backend._fwd.trusted
    finally:
        gc.enable()


def test_counters_of_reads_one_counter_per_buffer_through_out_cache_loc():
    """``batch.counters_of``: views of one buffer give one entry, read through the ``out_cache_loc`` entry when it
    is one of them; a buffer recorded with two versions gets -1 (a counter never reads it: never "unchanged");
    entries without a tensor or a counter are skipped."""
    from attnplug.batch import counters_of

    buf = torch.zeros(8, dtype=torch.int64)
    a, loc = buf[:4], buf[4:]
    other = torch.zeros(3, dtype=torch.int64)
    got = counters_of({"seq_lens": (a, 0), "out_cache_loc": (loc, 0), "positions": (other, 2), "x": (None, None),
                       "y": (torch.zeros(1), None)})
    assert len(got) == 2 and got[0][0] is loc and got[0][1] == 0 and got[1] == (other, 2)
    got = counters_of({"seq_lens": (a, 0), "req_pool_indices": (buf[:2], 1)})
    assert got == ((buf, -1),) and buf._version != -1
    # out_cache_loc on a buffer of its own: read through itself; the others through their buffer
    own = torch.zeros(2, dtype=torch.int64)
    got = counters_of({"seq_lens": (a, 0), "out_cache_loc": (own, 0)})
    assert got[0][0] is buf and got[1][0] is own


def test_a_planned_layer_called_with_another_claimed_dtype_is_checked_again_and_served_as_a_fresh_backend_serves_it():
    """``LayerPlan.dtype``: the per-call test compares q's dtype with the one the layer's last full check passed
    with (not with the claimed set): a call in another claimed dtype (bfloat16 after float32 on a float32
    cache) takes the full check again and gets what a backend without a plan gives it (the same output or the
    same error), and the layer then serves either dtype, alternating, as a fresh backend does."""
    results = {}
    for planned in (False, True):
        torch.manual_seed(0)
        backend, cache = make(ToyBackend)
        batch = decode_batch(cache)
        backend.init_forward_metadata(batch)
        if planned:
            backend.forward(*qkv(2), LAYER, batch, save_kv_cache=False)
            assert backend.layer_plan(LAYER).dtype is torch.float32
        got = []
        for dt in (torch.bfloat16, torch.float32, torch.bfloat16):
            try:
                got.append(backend.forward(*qkv(2, dt), LAYER, batch, save_kv_cache=False))
            except Exception as e:  # the same refusal either way
                got.append((type(e), str(e)))
        results[planned] = got
    for a, b in zip(results[False], results[True]):
        assert (torch.equal(a, b) and a.dtype == b.dtype) if isinstance(a, torch.Tensor) else a == b
