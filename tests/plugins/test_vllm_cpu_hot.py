"""vllm_cpu's cheaper per-layer and per-forward checks (issue 30, round 3), each tested both ways.

* **decode check after the op** (called "the fold" below, its first form): the skeleton's staged write
  of a decode forward skips the layout's two k/v sums; the op's output and the new k/v are summed after
  the op (a non-finite sum runs the precise paths and the op again) instead of the tail-page sums before
  it. Every scenario below runs with it and with it switched off (the base's ``write_new_kv``: the
  layout's verdict, the old checks) and must give the same output bits, the same cache bytes and the
  same page marks (raw tail garbage: a subset), and the reference's answer.
* **forward_into**: the output written straight into the caller's buffer (vLLM's ``output``).
* **strided q/k/v**: vLLM hands views of its fused qkv projection; the ops read tokens at any stride,
  so no copy is made, with the same output and cache as contiguous inputs.
* **one pass per forward**: bounds, the new-token mapping, page alignment and the page table from one
  gather of the batch's ``req_to_token`` entries; any failure runs the individual checks, which raise
  exactly as before (or serve a remap as before).
"""

from __future__ import annotations

import functools

import pytest
import torch

from attnplug import LayerSpec, PagedBackend
from attnplug.dtypes import dtype_name
from attnplug.testing.tolerances import tolerance_for

from test_vllm_cpu import _expected, _problem, needs_ops

pytestmark = needs_ops

# prefixes: a tail in the last page, a page just filled (no tail), a fresh page, a longer context
DECODE_PREFIX = [5, 40, 15, 16]


def _boom_ops(monkeypatch):
    """vLLM's attention op made to raise (the writer op left real); returns the exception class."""
    from attnplug_vllm_cpu import backend as B

    class Boom(RuntimeError):
        pass

    real = B.ops()

    class Ops:
        def __getattr__(self, n):
            return getattr(real, n)

        @staticmethod
        def cpu_attention_with_kv_cache(*a, **kw):
            raise Boom("the op failed")
    monkeypatch.setattr(B, "ops", lambda: Ops())
    return Boom


def _storage_poison(cache, slot, value=float("nan"), head=0, dim=3, half="k"):
    """Write ``value`` straight into layer 0's storage at ``slot`` (no layout write: no page mark)."""
    raw = cache.layer_storage(0)[0]
    raw = raw.view(raw.shape[0], raw.shape[1], -1)  # one (page, head) region: K dim-major, then V token-major
    ps, d = cache.page_size, cache.head_dim
    p, o = divmod(int(slot), ps)
    if half == "k":
        raw[p, head, dim * ps + o] = value
    else:
        raw[p, head, ps * d + o * d + dim] = value


def _scenario(name, cache, rows, prefix, k, v):
    r2t = cache.req_to_token
    if name == "nan_new_k":
        k[1, 0, 3] = float("nan")
    elif name == "inf_new_v":
        v[2, 1, 0] = float("inf")
    elif name == "ninf_both":
        k[0, 1, 7] = float("-inf")
        v[3, 0, 1] = float("nan")
    elif name == "tail_raw":  # an unowned slot past request 0's last key, in its last page
        _storage_poison(cache, int(r2t[rows[0], prefix[0]]) + 3)
    elif name == "tail_raw_v":
        _storage_poison(cache, int(r2t[rows[0], prefix[0]]) + 7, float("inf"), head=1, half="v")
    elif name == "owned_raw_last_page":  # a key request 1 owns, in its last page: its output reads it
        _storage_poison(cache, int(r2t[rows[1], 33]))
    elif name == "owned_raw_earlier_page":
        _storage_poison(cache, int(r2t[rows[3], 2]), half="v")


NEW_GARBAGE = {"nan_new_k": [1], "inf_new_v": [2], "ninf_both": [0, 3]}
#: tokens whose request reads a garbage key (their values are compared with the old path only, above)
READERS = {**NEW_GARBAGE, "owned_raw_last_page": [1], "owned_raw_earlier_page": [3]}
SCENARIOS = ["clean", "nan_new_k", "inf_new_v", "ninf_both", "tail_raw", "tail_raw_v", "owned_raw_last_page",
             "owned_raw_earlier_page"]


def _run(name, fold, monkeypatch, dtype=torch.float32, layers=2, save=True, geometry=(64, 16), prefix=DECODE_PREFIX):
    from attnplug_vllm_cpu.backend import VllmCpuBackend

    with monkeypatch.context() as m:
        calls = {"fold": 0, "unchecked_writes": 0}
        if not fold:  # the old path: the layout's verdict on every write, the old per-layer checks
            m.setattr(VllmCpuBackend, "write_new_kv", PagedBackend.write_new_kv)
        real_fold = VllmCpuBackend._decode_check  # the check after the op, on the general path and the short one

        def spy_fold(*a, **kw):
            calls["fold"] += 1
            return real_fold(*a, **kw)
        m.setattr(VllmCpuBackend, "_decode_check", spy_fold)
        head_dim, page_size = geometry
        cache, batch, backend, qkv, rows = _problem(prefix, [1] * len(prefix), decode=True, layers=layers,
                                                    dtype=dtype, head_dim=head_dim, page_size=page_size)
        if backend.helper is not None:  # the compiled helper's one call checks after the op too (round 6)
            real_layer = backend.helper.decode_layer_new

            def spy_layer(*a):
                out, code = real_layer(*a)
                calls["fold"] += code >= 0
                calls["one_call"] = calls.get("one_call", 0) + (code >= 0)
                return out, code
            backend.helper = backend.helper._replace(decode_layer_new=spy_layer)
        real_write = VllmCpuBackend.write_new_kv

        @functools.wraps(real_write)  # (keeps ``takes_undo_copy``: the undo copy is still taken by the write)
        def spy_write(self, *a, **kw):  # a skeleton write that left the verdict to the fold
            real_write(self, *a, **kw)
            calls["unchecked_writes"] += self._unchecked is not None
        m.setattr(VllmCpuBackend, "write_new_kv", spy_write)
        k0, v0 = qkv[0][1].clone(), qkv[0][2].clone()
        _scenario(name, cache, rows, prefix, k0, v0)
        qkv[0] = (qkv[0][0], k0, v0)
        backend.init_forward_metadata(batch)
        outs, refs = [], []
        for i in range(layers):
            layer = LayerSpec(i, 4, 2, head_dim)
            outs.append(backend.forward(*qkv[i], layer, batch, save_kv_cache=save))
            refs.append(_expected(cache, batch, layer, *qkv[i]))
        marks = [cache.layer_storage(i)[1].clone() for i in range(layers)]
        raws = [cache.layer_storage(i)[0].clone() for i in range(layers)]
    return outs, refs, marks, raws, calls


@pytest.mark.parametrize("name", SCENARIOS)
@pytest.mark.parametrize("geometry,prefix", [
    ((64, 16), DECODE_PREFIX),  # 16 KiB pages: the fold gathers them into one sum
    ((128, 64), DECODE_PREFIX),  # 128 KiB pages: one view sum per page
    ((64, 16), DECODE_PREFIX[:1]),  # one request: one page
], ids=["gather", "per_page", "one_page"])
@pytest.mark.parametrize("helper", [True, False], ids=["helper", "torch"])
def test_the_decode_fold_gives_the_old_checks_answer_bit_for_bit(name, geometry, prefix, helper, monkeypatch):
    if len(prefix) == 1 and name not in ("clean", "tail_raw", "tail_raw_v"):
        pytest.skip("the scenario poisons another request")
    _helper_mode(monkeypatch, helper)
    fast = _run(name, True, monkeypatch, geometry=geometry, prefix=prefix)
    slow = _run(name, False, monkeypatch, geometry=geometry, prefix=prefix)
    # with the helper, the first layer (the forward's scheduler metadata not yet built) takes stage and the short
    # path, the second the one compiled call (write, op and checks)
    assert fast[4].pop("one_call", 0) == (1 if helper else 0)
    slow[4].pop("one_call", None)
    for a, b in zip(fast[0], slow[0]):
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(torch.nan_to_num(a), torch.nan_to_num(b)), name
    for a, b in zip(fast[2], slow[2]):  # page marks: the pages new garbage was written to through the layout
        if name.startswith("tail"):  # none but where the precise path ran: its masking writes the raw tail
            assert not (a & ~b).any(), name  # garbage back through the layout; the old path always ran it
        else:
            assert torch.equal(a, b), name
    for a, b in zip(fast[3], slow[3]):  # the cache: the same bytes (masked tails restored after the call)
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(torch.nan_to_num(a), torch.nan_to_num(b)), name
    # and the answer is the reference's: a (token, head) row non-finite exactly where the reference's is
    # (as harness.compare asks), equal elsewhere
    for out, ref in zip(fast[0], fast[1]):
        bad_out, bad_ref = ~torch.isfinite(out).all(-1), ~torch.isfinite(ref).all(-1)
        assert not (bad_ref & ~bad_out).any(), name  # garbage the reference sees is never hidden
        if name not in NEW_GARBAGE:  # (a poisoned new token's rows are set NaN per KV head: conservative)
            assert torch.equal(bad_out, bad_ref), name
        # values: the rows of tokens that read no garbage (the float64 reference lets a non-finite value of
        # one KV head change the other KV head's rows of the request; the old path and the fold agree above)
        clean = torch.ones_like(bad_ref)
        clean[READERS.get(name, [])] = False
        keep = clean & ~bad_ref
        torch.testing.assert_close(out.double()[keep], ref[keep], atol=2e-6, rtol=0)
    # the fold ran on every layer (one page sum each) and no skeleton write summed k/v; the old path never
    assert fast[4] == {"fold": 2, "unchecked_writes": 2}, fast[4]
    assert slow[4] == {"fold": 0, "unchecked_writes": 0}, slow[4]
    if name.startswith(("nan", "inf", "ninf")):
        assert fast[2][0].any()  # the page holding the garbage is marked as the layout's verdict would
    if name != "clean":
        assert not all(torch.isfinite(o).all() for o in fast[0]) or name.startswith("tail")


@pytest.mark.parametrize("name", ["clean", "nan_new_k", "tail_raw"])
@pytest.mark.parametrize("how", ["raises", "no_save"])
def test_the_decode_fold_leaves_the_cache_byte_identical_when_the_op_raises_or_nothing_is_saved(name, how,
                                                                                                 monkeypatch):
    cache, batch, backend, qkv, rows = _problem(DECODE_PREFIX, [1] * 4, decode=True)
    q, k, v = (t.clone() for t in qkv[0])
    _scenario(name, cache, rows, DECODE_PREFIX, k, v)
    before = cache.layer_storage(0)[0].clone()
    backend.init_forward_metadata(batch)
    layer = LayerSpec(0, 4, 2, 64)
    if how == "raises":
        with pytest.raises(_boom_ops(monkeypatch)):
            backend.forward(q, k, v, layer, batch)
    else:
        backend.forward(q, k, v, layer, batch, save_kv_cache=False)
    after = cache.layer_storage(0)[0]
    assert torch.equal(before.isnan(), after.isnan())
    assert torch.equal(torch.nan_to_num(before), torch.nan_to_num(after))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [("decode", [5, 40, 15]), ("extend", [0, 17, 3])])
def test_strided_qkv_views_are_read_in_place_with_the_same_result(dtype, shape):
    """q/k/v as views of one fused qkv tensor (how vLLM hands them): no copy, the same output and cache."""
    kind, prefix = shape
    ext = [1] * 3 if kind == "decode" else [4, 9, 2]
    res = []
    for strided in (False, True):
        cache, batch, backend, qkv, _ = _problem(prefix, ext, decode=kind == "decode", dtype=dtype, seed=4)
        q, k, v = qkv[0]
        if strided:
            T = q.shape[0]
            fused = torch.cat([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], dim=1)
            q, k, v = (x.view(T, -1, 64) for x in fused.split([256, 128, 128], dim=1))
            assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
        backend.init_forward_metadata(batch)
        out = backend.forward(q, k, v, LayerSpec(0, 4, 2, 64), batch)
        res.append((out, cache.layer_storage(0)[0].clone()))
    assert torch.equal(res[0][0], res[1][0]) and torch.equal(res[0][1], res[1][1])


def test_the_fold_is_not_used_where_a_new_token_may_lie_outside_the_last_pages(monkeypatch):
    """Extend (new tokens span pages) keeps the layout's verdict and the tail-page sums."""
    from attnplug_vllm_cpu.backend import VllmCpuBackend

    calls = []
    real = VllmCpuBackend._decode_check
    monkeypatch.setattr(VllmCpuBackend, "_decode_check", lambda *a: calls.append(1) or real(*a))
    cache, batch, backend, qkv, _ = _problem([5, 40], [20, 3])
    q, k, v = (t.clone() for t in qkv[0])
    k[21, 1, 2] = float("nan")  # request 1's third new token
    backend.init_forward_metadata(batch)
    layer = LayerSpec(0, 4, 2, 64)
    out = backend.forward(q, k, v, layer, batch)
    ref = _expected(cache, batch, layer, q, k, v)
    assert not calls
    assert torch.equal(~torch.isfinite(out).all(-1), ~torch.isfinite(ref).all(-1))
    assert cache.layer_storage(0)[1].any()  # marked by the layout's own verdict


# -- one pass per forward -------------------------------------------------------------------------------
def _mutate(kind, cache, batch, rows):
    r2t = cache.req_to_token
    if kind == "unassigned_prefix":
        r2t[rows[1], 7] = -1
    elif kind == "wild_prefix":
        r2t[rows[3], 2] = cache.num_slots + 5
    elif kind == "new_token_unassigned":
        r2t[rows[0], DECODE_PREFIX[0]] = -1
    elif kind == "new_token_wild":
        r2t[rows[2], DECODE_PREFIX[2]] = 10 ** 9
    elif kind == "loc_out_of_range":
        batch.out_cache_loc[1] = cache.num_slots
        batch.validate()
    elif kind == "loc_negative":  # written after validate(): the checks re-validate and name it
        batch.out_cache_loc[2] = -1
    elif kind == "unaligned_prefix":  # two positions of one page swapped
        a, b_ = int(r2t[rows[1], 3]), int(r2t[rows[1], 4])
        r2t[rows[1], 3], r2t[rows[1], 4] = b_, a
    elif kind == "page_not_at_a_page_start":
        r2t[rows[3], 0:16] += 1
    elif kind == "remapped_new_token":  # served, not refused: the token's position maps to a free slot
        used = set(r2t[r2t >= 0].tolist())
        free = next(s for s in range(cache.num_slots) if s not in used and s % cache.page_size == 0)
        r2t[rows[0], DECODE_PREFIX[0]] = free  # request 0's last page starts... its position 5 is offset 5
        r2t[rows[0], 0:DECODE_PREFIX[0] + 1] = torch.arange(free, free + DECODE_PREFIX[0] + 1)
    elif kind == "stale_host_copy":
        batch.req_pool_indices[0] = rows[1]


ONE_PASS_KINDS = ["clean", "unassigned_prefix", "wild_prefix", "new_token_unassigned", "new_token_wild",
                  "loc_out_of_range", "loc_negative", "unaligned_prefix", "page_not_at_a_page_start",
                  "remapped_new_token", "stale_host_copy"]


def _init(kind, one_pass, monkeypatch):
    from attnplug_vllm_cpu.backend import VllmCpuBackend

    with monkeypatch.context() as m:
        used = []
        real = VllmCpuBackend._one_pass
        m.setattr(VllmCpuBackend, "_one_pass",
                  (lambda self, b: used.append(real(self, b)) or used[-1]) if one_pass else (lambda self, b: False))
        cache, batch, backend, qkv, rows = _problem(DECODE_PREFIX, [1] * 4, decode=True)
        _mutate(kind, cache, batch, rows)
        try:
            backend.init_forward_metadata(batch)
        except Exception as exc:
            return ("error", type(exc), str(exc)), used
        meta = backend.forward_metadata(batch)
        out = backend.forward(*qkv[0], LayerSpec(0, 4, 2, 64), batch)
        table = meta.self_keys.block_table
        remap = None if meta.remap is None else tuple(t.tolist() for t in meta.remap)
        return ("ok", table.dtype, table.tolist(), remap, out), used


def _host_pass(monkeypatch, on):
    """The one pass on the host (``_host_pass``: small batches, the default here) or as tensor ops."""
    import attnplug_vllm_cpu.backend as B

    monkeypatch.setattr(B, "_HOST_PASS_REQUESTS", 16 if on else 0)


@pytest.mark.parametrize("host", [True, False], ids=["host_pass", "tensor_pass"])
@pytest.mark.parametrize("kind", ONE_PASS_KINDS)
def test_the_one_pass_refuses_or_serves_exactly_what_the_individual_checks_do(kind, host, monkeypatch):
    _host_pass(monkeypatch, host)
    fast, used = _init(kind, True, monkeypatch)
    slow, _ = _init(kind, False, monkeypatch)
    assert fast[:-1] == slow[:-1] if fast[0] == "ok" else fast == slow, (kind, fast, slow)
    if fast[0] == "ok":
        assert torch.equal(fast[-1], slow[-1])
    # the one pass itself accepts only a batch every check passes (and then the base's passes are skipped)
    assert used == [kind == "clean"], (kind, used)
    if kind not in ("clean", "remapped_new_token"):
        assert fast[0] == "error", (kind, fast)


@pytest.mark.parametrize("host", [True, False], ids=["host_pass", "tensor_pass"])
@pytest.mark.parametrize("prefix", [[5, 40, 15, 16], [0, 31, 32, 63], [1], [100, 2, 47]])
def test_the_one_pass_page_table_is_the_caches(prefix, host, monkeypatch):
    _host_pass(monkeypatch, host)
    cache, batch, backend, _, _ = _problem(prefix, [1] * len(prefix), decode=True)
    backend.init_forward_metadata(batch)
    table = backend.forward_metadata(batch).self_keys.block_table
    assert table.dtype == torch.int32 and torch.equal(table, cache.page_table(batch))


# ---- page snapshot: a long write's undo copy as whole pages (issue 23/30, round 3) ----------------------


def _force_pages(monkeypatch, on):
    """Switch the layout's undo copy for every write: whole pages (``True``), the rows through one flat
    ``take`` (``"flat"``), or no layout copy at all (``False``: the skeleton's ``read`` / ``set_kv`` rows)."""
    from attnplug_vllm_cpu.layout import VllmCpuLayout

    monkeypatch.setattr(VllmCpuLayout, "page_snapshot_min_slots", 0 if on is True else 1 << 30)
    monkeypatch.setattr(VllmCpuLayout, "PAGE_SNAPSHOT_SPREAD", 1 << 30 if on is True else 4)
    monkeypatch.setattr(VllmCpuLayout, "flat_row_snapshot", on == "flat")


def _helper_mode(monkeypatch, on):
    """The compiled helper on (as installed: the test skips where it is not) or off (``$ATTNPLUG_VLLM_CPU_HELPER=0``:
    the pure-torch path) for the backends built after this call."""
    from attnplug_vllm_cpu import stage

    if on:
        monkeypatch.delenv(stage.HELPER_ENV, raising=False)
        helper, why = stage.load()
        if helper is None:
            pytest.skip(f"the compiled helper is not loaded here: {why}")
    else:
        monkeypatch.setenv(stage.HELPER_ENV, "0")


@pytest.mark.parametrize("helper", [True, False], ids=["helper", "torch"])
@pytest.mark.parametrize("pages_on", [True, "flat", False], ids=["pages", "flat_rows", "rows"])
@pytest.mark.parametrize("how", ["raises", "no_save", "saved"])
@pytest.mark.parametrize("shape", [([0, 17, 3], [40, 9, 30]), ([0, 0], [33, 64]), ([5, 40, 15, 16], [1] * 4)],
                         ids=["prefill_ragged", "prefill_full_pages", "decode"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_staged_write_is_undone_exactly_by_the_page_snapshot_and_by_the_rows(pages_on, how, shape, dtype, helper,
                                                                               monkeypatch):
    """Whether the undo copy is whole pages, the written rows, or the compiled helper's rows (a decode step with
    the helper loaded: ``stage`` takes it in the write's pass, the layout's copy is not taken), a raising op and
    ``save_kv_cache=False`` leave every byte of the layer as it was (pages shared with other requests included:
    the untouched rows of a page are put back as they were), and a saved forward writes exactly the new rows."""
    _force_pages(monkeypatch, pages_on)
    _helper_mode(monkeypatch, helper)
    prefix, ext = shape
    decode = ext == [1] * len(ext)
    cache, batch, backend, qkv, rows = _problem(prefix, ext, decode=decode, dtype=dtype, seed=7)
    staged = []
    if backend.helper is not None:
        real_stage = backend.helper.stage
        backend.helper = backend.helper._replace(stage=lambda *a: staged.append(1) or real_stage(*a))
    q, k, v = qkv[0]
    layer = LayerSpec(0, 4, 2, 64)
    storage = cache.layer_storage(0)
    before = storage[0].clone()
    kb0, vb0 = cache.read_kv(0)
    tol = tolerance_for(dtype_name(dtype), dtype_name(dtype))
    called = []
    real_snapshot = type(cache.layout).page_snapshot

    def spy(self, st, g, slots):
        snap = real_snapshot(self, st, g, slots)
        called.append(snap is not None)
        return snap
    monkeypatch.setattr(type(cache.layout), "page_snapshot", spy)
    backend.init_forward_metadata(batch)
    if how == "raises":
        boom = _boom_ops(monkeypatch)
        with pytest.raises(boom):
            backend.forward(q, k, v, layer, batch)
    else:
        ref = _expected(cache, batch, layer, q, k, v)
        out = backend.forward(q, k, v, layer, batch, save_kv_cache=how == "saved")
    by_helper = helper and decode
    assert called == ([] if by_helper else [pages_on is not False])  # the path under test was the one taken
    assert staged == ([1] if by_helper else [])
    after = storage[0]
    if how == "saved":
        kb, vb = cache.read_kv(0)
        loc = batch.out_cache_loc
        assert torch.equal(kb[loc], k.to(dtype)) and torch.equal(vb[loc], v.to(dtype))
        untouched = torch.ones(cache.num_slots, dtype=torch.bool)
        untouched[loc] = False
        assert torch.equal(kb[untouched], kb0[untouched]) and torch.equal(vb[untouched], vb0[untouched])
        torch.testing.assert_close(out.double(), ref, atol=tol.atol, rtol=tol.rtol)
    else:
        assert torch.equal(before, after)


def test_the_page_snapshot_is_taken_for_a_long_prefill_and_not_for_a_decode_step():
    """The default rule: whole pages for a write of at least ``page_snapshot_min_slots`` dense slots; rows for
    a decode step's few slots and for writes spread one slot a page."""
    from attnplug_vllm_cpu.layout import VllmCpuLayout

    cache, batch, backend, qkv, rows = _problem([0, 0], [130, 200], dtype=torch.float32)
    lay, st, g = cache.layout, cache.layer_storage(0), cache.geometry
    assert isinstance(lay, VllmCpuLayout)
    snap = lay.page_snapshot(st, g, batch.out_cache_loc)
    assert snap is not None and snap[0].numel() == 9 + 13  # ceil(130/16) + ceil(200/16) pages
    short = lay.page_snapshot(st, g, batch.out_cache_loc[:5])
    assert short is not None and short[0] is None  # short: the rows, one flat take
    assert short[2].numel() == 5 * 2 * g.num_kv_heads * g.head_dim
    spread = torch.arange(0, cache.num_slots, g.page_size)[:lay.page_snapshot_min_slots]
    if spread.numel() >= lay.page_snapshot_min_slots:
        sparse = lay.page_snapshot(st, g, spread)
        assert sparse is None or sparse[0] is None  # one slot a page: rows are cheaper


@pytest.mark.parametrize("change", ["none", "in_place", "new_tensor", "strided_raw",
                                    "other_dtype_raw"])
def test_the_kept_flat_index_is_the_one_built_afresh(change):
    """Round 5: a kept flat index (the undo copy's and ``read``'s) is answered from its memo with only raw's
    dtype and contiguity read per call; it must be exactly the index built afresh for the same slots and
    geometry, rebuilt after an in-place change of the slots, and refused (``None``) for a raw the take cannot
    read, memo or not."""
    from attnplug_vllm_cpu.layout import VllmCpuLayout

    cache, batch, backend, qkv, rows = _problem(DECODE_PREFIX, [1] * 4, decode=True, dtype=torch.float32)
    lay, st, g = cache.layout, cache.layer_storage(0), cache.geometry
    assert isinstance(lay, VllmCpuLayout)
    slots = batch.out_cache_loc.to(torch.int64).clone()
    raw = st[0]
    first = lay._flat_index(raw, g, slots)
    assert first is not None and lay._flat_index(raw, g, slots) is first  # kept
    if change == "in_place":
        slots[0], slots[1] = slots[1].clone(), slots[0].clone()
    elif change == "new_tensor":
        slots = slots.flip(0)
    elif change == "strided_raw":
        raw = torch.zeros(raw.shape[:-1] + (2 * raw.shape[-1],), dtype=raw.dtype)[..., ::2]
    elif change == "other_dtype_raw":
        raw = raw.to(torch.float64)
    got = lay._flat_index(raw, g, slots)
    if change in ("strided_raw", "other_dtype_raw"):
        assert got is None
        return
    fresh = VllmCpuLayout()._flat_index(raw, g, slots.clone())  # a layout with no memo, other slots object
    assert fresh is not None and torch.equal(got, fresh)
    if change == "none":
        assert got is first


# ---- forward_into: the output in the caller's buffer (vLLM's ``output``; issue 23/30) -----------------


def _into_case(decode, seed=3):
    prefix, ext = (DECODE_PREFIX, [1] * 4) if decode else ([5, 40], [20, 3])
    return _problem(prefix, ext, decode=decode, layers=2, seed=seed)


@pytest.mark.parametrize("decode", [True, False], ids=["decode", "extend"])
@pytest.mark.parametrize("buf", ["exact", "float64", "strided", "flat"])
def test_forward_into_gives_forward_s_output_and_cache(decode, buf, monkeypatch):
    """Two layers through ``forward_into`` give the bits ``forward`` gives and the same cache bytes; an
    exact buffer is written by the op itself (no copy), any other buffer of that many elements gets a
    copy, and the call returns the caller's buffer."""
    import attnplug_vllm_cpu.backend as B

    ref_cache, ref_batch, ref_backend, ref_qkv, _ = _into_case(decode)
    cache, batch, backend, qkv, _ = _into_case(decode)
    ref_backend.init_forward_metadata(ref_batch)
    backend.init_forward_metadata(batch)
    taken = []
    real = PagedBackend.output_buffer
    monkeypatch.setattr(B.VllmCpuBackend, "output_buffer",
                        lambda self, q, shape: taken.append(real(self, q, shape)) or taken[-1])
    for i in range(2):
        layer = LayerSpec(i, 4, 2, 64)
        want = ref_backend.forward(*ref_qkv[i], layer, ref_batch)
        T = want.shape[0]
        if buf == "exact":
            out = torch.full((T, 4, 64), 7.0)
        elif buf == "float64":
            out = torch.full((T, 4, 64), 7.0, dtype=torch.float64)
        elif buf == "strided":
            out = torch.full((T, 8, 64), 7.0)[:, ::2]
        else:
            out = torch.full((T, 4 * 64), 7.0).view(T, 4, 64)
        got = backend.forward_into(out, *qkv[i], layer, batch)
        assert got is out
        assert torch.equal(got.to(want.dtype), want)
        assert torch.equal(cache.layer_storage(i)[0], ref_cache.layer_storage(i)[0])
    in_place = [t is not None for t in taken]
    assert in_place == [buf in ("exact", "flat")] * 2, in_place
    assert backend._into is None  # nothing kept past the call


def test_forward_into_refuses_a_buffer_of_another_shape_naming_both():
    from attnplug.errors import ShapeError

    cache, batch, backend, qkv, _ = _into_case(True)
    backend.init_forward_metadata(batch)
    before = cache.layer_storage(0)[0].clone()
    with pytest.raises(ShapeError, match=r"out has shape \(4, 4, 32\).*\(4, 4, 64\)"):
        backend.forward_into(torch.empty(4, 4, 32), *qkv[0], LayerSpec(0, 4, 2, 64), batch)
    assert backend._into is None
    assert not torch.equal(before, cache.layer_storage(0)[0])  # the forward itself ran (and wrote)


@pytest.mark.parametrize("how", ["raises", "no_save"])
def test_forward_into_leaves_the_cache_byte_identical_when_the_op_raises_or_nothing_is_saved(how, monkeypatch):
    cache, batch, backend, qkv, _ = _into_case(True)
    backend.init_forward_metadata(batch)
    layer = LayerSpec(0, 4, 2, 64)
    backend.forward(*qkv[0], layer, batch)  # the layer's plan made: the next call takes the short path
    before = cache.layer_storage(0)[0].clone()
    out = torch.empty(4, 4, 64)
    if how == "raises":
        boom = _boom_ops(monkeypatch)
        if backend.helper is not None:  # the one compiled call finds the attention op through the dispatcher
            from test_vllm_cpu_stage import _failing_attention_op
            backend.attention_op = _failing_attention_op()
            boom = RuntimeError
        with pytest.raises(boom):
            backend.forward_into(out, *qkv[0], layer, batch)
    else:
        backend.forward_into(out, *qkv[0], layer, batch, save_kv_cache=False)
    assert torch.equal(before, cache.layer_storage(0)[0])
    assert backend._into is None


def test_forward_into_of_a_poisoned_decode_gives_the_precise_paths_answer():
    """A NaN in a new K (the check after the op fails): the precise paths run the op again into a fresh
    output, which is copied into the caller's buffer; the same bits as ``forward``."""
    ref_cache, ref_batch, ref_backend, ref_qkv, _ = _into_case(True)
    cache, batch, backend, qkv, _ = _into_case(True)
    for qkv_ in (ref_qkv, qkv):
        qkv_[0] = (qkv_[0][0], qkv_[0][1].clone(), qkv_[0][2])
        qkv_[0][1][1, 0, 3] = float("nan")
    layer = LayerSpec(0, 4, 2, 64)
    ref_backend.init_forward_metadata(ref_batch)
    backend.init_forward_metadata(batch)
    want = ref_backend.forward(*ref_qkv[0], layer, ref_batch)
    got = backend.forward_into(torch.empty(4, 4, 64), *qkv[0], layer, batch)
    assert torch.equal(want.isnan(), got.isnan()) and torch.equal(want.nan_to_num(), got.nan_to_num())
    assert got[1].isnan().any() and not got[0].isnan().any()
