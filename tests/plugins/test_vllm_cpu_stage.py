"""vllm_cpu's compiled helper (``attnplug_vllm_cpu/csrc/stage.cpp``; issue 30, round 6) against what it replaces.

* ``stage`` writes exactly the bytes vLLM's writer (``cpu_attn_reshape_and_cache``) writes, for every claimed cache
  dtype, several claimed head dims and page sizes (``vec`` and ``vec16``), scattered and repeated slots and strided
  k/v; its undo copy is exactly the rows ``read`` returns, and writing it back restores every byte;
* its finite verdict of k/v, and ``all_finite`` of an output, say "not finite" exactly where the float32 sums they
  replace do for a NaN, +inf, -inf or a value that overflowed to inf, in any position (and, unlike the sums, do
  not refuse finite values whose sum overflows: their verdict is exact);
* a refused call (slot out of range, wrong dtype, shape, strides) names what is wrong and writes nothing;
* the backend with the helper and without it (``$ATTNPLUG_VLLM_CPU_HELPER=0``) gives the same outputs and caches,
  and says which path it runs (``runtime_notes``); a missing library is named, never silent.
"""

from __future__ import annotations

import math

import pytest
import torch

from attnplug import LayerSpec, ShapeError
from attnplug.kvlayout import KVGeometry

from test_vllm_cpu import _expected, _problem, needs_ops

pytestmark = needs_ops


def _helper():
    from attnplug_vllm_cpu import stage

    helper, why = stage._load_library()
    if helper is None:
        pytest.skip(f"the compiled helper is not loaded here: {why}")
    return helper


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as integers (NaN payloads compared too)."""
    return t.contiguous().view({4: torch.int32, 2: torch.int16}[t.element_size()])


DTYPES = [torch.float32, torch.bfloat16, torch.float16]
#: (head_dim, page_size): vec (both multiples of 32) and vec16 geometries, small and large heads
GEOMETRIES = [(64, 16), (128, 32), (80, 16), (32, 64), (256, 128), (96, 48)]


def _raw(head_dim, page_size, dtype, pages=6, heads=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    raw = torch.randn(pages, heads, page_size, 2 * head_dim, generator=g).to(dtype)
    raw.view(-1)[::97] = float("nan")  # garbage already in the cache: its bytes must survive the undo
    return raw, KVGeometry(num_pages=pages, num_kv_heads=heads, head_dim=head_dim, v_head_dim=head_dim, page_size=page_size)


def _kv(n, heads, head_dim, dtype, strided, seed=1):
    g = torch.Generator().manual_seed(seed)
    if strided:  # vLLM's views of a fused qkv: each token's rows dense, tokens further apart
        big = torch.randn(n, heads + 3, head_dim, generator=g).to(dtype)
        return big[:, :heads], big[:, 1:heads + 1]
    return (torch.randn(n, heads, head_dim, generator=g).to(dtype),
            torch.randn(n, heads, head_dim, generator=g).to(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: f"d{g[0]}_ps{g[1]}")
@pytest.mark.parametrize("slots_kind", ["decode", "scattered", "one", "repeated"])
@pytest.mark.parametrize("strided", [False, True], ids=["dense", "strided"])
def test_stage_writes_the_writers_bytes_and_its_undo_copy_restores_every_byte(dtype, geometry, slots_kind, strided):
    from attnplug_vllm_cpu import isa_for
    from attnplug_vllm_cpu.layout import VllmCpuLayout
    from attnplug_vllm_cpu.ops import ops

    helper = _helper()
    d, ps = geometry
    raw, geo = _raw(d, ps, dtype)
    S = geo.num_pages * ps
    slots = {"decode": [3, ps + 5, 4 * ps - 1, S - 1], "scattered": list(range(1, S, 7)), "one": [ps * 2],
             "repeated": [9, 2 * ps + 1, 9]}[slots_kind]
    slots_t = torch.tensor(slots, dtype=torch.int64)
    k, v = _kv(len(slots), 2, d, dtype, strided)
    layout = VllmCpuLayout()
    old_k, old_v = layout.read((raw, None), geo, slots_t)
    before = raw.clone()
    want = raw.clone()
    kc, vc = VllmCpuLayout.views(want)
    ops().cpu_attn_reshape_and_cache(k, v, kc, vc, slots_t, isa_for(d, ps))
    snap = torch.empty((2, len(slots), 2, d), dtype=dtype)
    verdict = helper.stage(raw, k, v, slots_t, snap)
    assert verdict is True
    if slots_kind == "repeated":
        # two new tokens into one slot: which one vLLM's writer leaves there is its own (measured: dtype dependent);
        # stage leaves the last one, every other byte is the writer's, and the undo copy is the slot's old row
        rep = torch.tensor([9], dtype=torch.int64)
        got_k, got_v = layout.read((raw, None), geo, rep)
        assert torch.equal(_bits(got_k[0]), _bits(k[2])) and torch.equal(_bits(got_v[0]), _bits(v[2]))
        index = layout._flat_index(raw, geo, rep).flatten()
        raw_cmp, want_cmp = raw.clone().view(-1), want.clone().view(-1)
        raw_cmp[index] = 0
        want_cmp[index] = 0
        assert torch.equal(_bits(raw_cmp), _bits(want_cmp))
        assert torch.equal(_bits(snap[0, 2]), _bits(old_k[0])) and torch.equal(_bits(snap[1, 2]), _bits(old_v[0]))
    else:
        assert torch.equal(_bits(raw), _bits(want))  # the writer's bytes, every one
    assert torch.equal(_bits(snap[0]), _bits(old_k)) and torch.equal(_bits(snap[1]), _bits(old_v))
    VllmCpuLayout._torch_write(raw, geo, slots_t, snap[0], snap[1])  # the backend's undo
    assert torch.equal(_bits(raw), _bits(before))  # exactly as before, NaN payloads included


BAD = {"nan": float("nan"), "+inf": float("inf"), "-inf": float("-inf")}


def _sum_verdict(*ts):
    return math.isfinite(sum(t.sum(dtype=torch.float32).item() for t in ts))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("where", ["k", "v"])
@pytest.mark.parametrize("bad", [*BAD, "overflowed"])
@pytest.mark.parametrize("at", [(0, 0, 0), (2, 1, 63), (1, 0, 17)], ids=["first", "last", "middle"])
def test_stages_verdict_is_the_sums_for_every_non_finite_value(dtype, where, bad, at):
    helper = _helper()
    raw, geo = _raw(64, 16, dtype)
    slots = torch.tensor([1, 20, 50], dtype=torch.int64)
    k, v = _kv(3, 2, 64, dtype, strided=False)
    t = k if where == "k" else v
    if bad == "overflowed":  # a value computed past the dtype's largest: inf
        big = torch.tensor([torch.finfo(dtype).max], dtype=dtype)
        t[at] = (big * 2)[0]
        assert math.isinf(float(t[at]))
    else:
        t[at] = BAD[bad]
    snap = torch.empty((2, 3, 2, 64), dtype=dtype)
    assert helper.stage(raw, k, v, slots, snap) is False
    assert _sum_verdict(k, v) is False  # what the sums say about the same values


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("bad", [None, *BAD, "overflowed"])
@pytest.mark.parametrize("n", [1, 7, 4096 + 3])
def test_all_finite_is_the_sums_verdict_on_an_output(dtype, bad, n):
    helper = _helper()
    g = torch.Generator().manual_seed(n)
    for pos in sorted({0, n // 2, n - 1}):
        out = torch.randn(n, generator=g).to(dtype)
        if bad == "overflowed":
            out[pos] = (torch.tensor([torch.finfo(dtype).max], dtype=dtype) * 4)[0]
        elif bad is not None:
            out[pos] = BAD[bad]
        assert helper.all_finite(out) is _sum_verdict(out) is (bad is None)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_the_helpers_verdict_is_exact_where_a_sum_overflows(dtype):
    """The one difference, on the safe side: finite values whose float32 sum overflows make the sums send the call
    down the precise paths (which give the same output); the helper's verdict (the exponent bits) is exact."""
    helper = _helper()
    big = torch.full((8,), torch.finfo(dtype).max, dtype=dtype)
    if dtype == torch.float16:  # float16's largest does not overflow a float32 sum: exactness still holds
        assert helper.all_finite(big) is True
        return
    assert helper.all_finite(big) is True and _sum_verdict(big) is False


@pytest.mark.parametrize("fault", ["slot_high", "slot_negative", "k_dtype", "snap_dtype", "k_shape", "k_rows",
                                   "slots_int32", "snap_shape"])
def test_a_refused_stage_names_the_fault_and_writes_nothing(fault):
    helper = _helper()
    raw, geo = _raw(64, 16, torch.float32)
    slots = torch.tensor([1, 20, 50], dtype=torch.int64)
    k, v = _kv(3, 2, 64, torch.float32, strided=False)
    snap = torch.zeros((2, 3, 2, 64))
    word = {"slot_high": "out of range", "slot_negative": "out of range", "k_dtype": "k/v are",
            "snap_dtype": "snap must be", "k_shape": "k/v of shape", "k_rows": "must be dense",
            "slots_int32": "slots must be", "snap_shape": "snap must be"}[fault]
    if fault == "slot_high":
        slots[2] = geo.num_pages * 16
    elif fault == "slot_negative":
        slots[1] = -1
    elif fault == "k_dtype":
        k = k.double()
    elif fault == "snap_dtype":
        snap = snap.half()
    elif fault == "k_shape":
        k = k[:, :1]
    elif fault == "k_rows":
        k = k.transpose(1, 2).contiguous().transpose(1, 2)
    elif fault == "slots_int32":
        slots = slots.int()
    elif fault == "snap_shape":
        snap = snap[:, :2]
    before, snap_before = raw.clone(), snap.clone()
    with pytest.raises(RuntimeError, match=word):
        helper.stage(raw, k, v, slots, snap)
    assert torch.equal(_bits(raw), _bits(before)) and torch.equal(_bits(snap), _bits(snap_before))


def test_the_ops_pass_torch_library_opcheck():
    """Schemas (``raw``/``snap`` declared mutated), the fake implementations and the real ones agree."""
    helper = _helper()
    raw, geo = _raw(64, 16, torch.float32)
    raw = torch.nan_to_num(raw)
    slots = torch.tensor([1, 20, 50], dtype=torch.int64)
    k, v = _kv(3, 2, 64, torch.float32, strided=False)
    snap = torch.zeros((2, 3, 2, 64))
    torch.library.opcheck(helper.stage, (raw, k, v, slots, snap), test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(helper.all_finite, (k,), test_utils=("test_schema", "test_faketensor"))


# ---- the backend: with the helper and without it ---------------------------------------------------------


def _build(prefix, *, helper, dtype, monkeypatch, geometry=(64, 16), seed=3):
    from attnplug_vllm_cpu import stage

    if helper:
        _helper()
        monkeypatch.delenv(stage.HELPER_ENV, raising=False)
    else:
        monkeypatch.setenv(stage.HELPER_ENV, "0")
    d, ps = geometry
    return _problem(prefix, [1] * len(prefix), decode=True, dtype=dtype, head_dim=d, page_size=ps, layers=2,
                    seed=seed)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("geometry", [(64, 16), (128, 32), (80, 16)], ids=lambda g: f"d{g[0]}_ps{g[1]}")
@pytest.mark.parametrize("poison", [None, "k_nan", "v_inf", "k_ninf", "tail_nan", "tail_v_inf", "owned_inf"])
def test_the_backend_gives_the_same_bits_with_the_helper_and_without(dtype, geometry, poison, monkeypatch):
    """Both layers poisoned alike: the first runs ``stage`` and the short path, the second the one compiled call;
    garbage in a new token's k/v, in an unowned tail past a request's last key, or in a key a request owns."""
    results = []
    for helper in (True, False):
        cache, batch, backend, qkv, rows = _build([5, 40, 15, 16], helper=helper, dtype=dtype,
                                                  monkeypatch=monkeypatch, geometry=geometry)
        assert (backend.helper is not None) is helper
        calls: list[int] = []
        if helper:
            def spy(*a, real=backend.helper.decode_layer_new, calls=calls):
                calls.append(1)
                return real(*a)
            backend.helper = backend.helper._replace(decode_layer_new=spy)
        ps, d = geometry[1], geometry[0]
        qkv = [(q, k.clone(), v.clone()) for q, k, v in qkv]
        for i, (_q, k, v) in enumerate(qkv):
            raw = cache.layer_storage(i)[0].view(cache.num_pages, 2, -1)
            if poison == "k_nan":
                k[1, 0, 3] = float("nan")
            elif poison == "v_inf":
                v[2, 1, 0] = float("inf")
            elif poison == "k_ninf":
                k[0, 1, 7] = float("-inf")
            elif poison in ("tail_nan", "owned_inf"):  # straight into the storage (no page mark)
                slot = int(cache.req_to_token[rows[0], 5]) + 3 if poison == "tail_nan" else \
                    int(cache.req_to_token[rows[1], 33])
                p, o = divmod(slot, ps)
                raw[p, 0, 3 * ps + o] = float("nan") if poison == "tail_nan" else float("inf")
            elif poison == "tail_v_inf":  # a V past request 0's last key: the op lets it through (0 * inf)
                p, o = divmod(int(cache.req_to_token[rows[0], 5]) + 2, ps)
                raw[p, 1, ps * d + o * d + 5] = float("inf")
        backend.init_forward_metadata(batch)
        outs = [backend.forward(*qkv[0], LayerSpec(0, 4, 2, d), batch),
                backend.forward(*qkv[1], LayerSpec(1, 4, 2, d), batch)]
        assert calls == ([1] if helper else [])
        results.append((outs, [cache.layer_storage(i)[0].clone() for i in (0, 1)],
                        [cache.layer_storage(i)[1].clone() for i in (0, 1)]))
        if poison in (None, "tail_nan", "tail_v_inf"):  # (unowned garbage never reaches an output)
            ref = _expected(cache, batch, LayerSpec(1, 4, 2, geometry[0]), *qkv[1])
            assert torch.isfinite(outs[1]).all() and (outs[1].double() - ref).abs().max() < 0.05
    (o1, r1, m1), (o2, r2, m2) = results
    for a, b in zip(o1 + r1, o2 + r2):
        assert torch.equal(_bits(a), _bits(b))
    for a, b in zip(m1, m2):
        assert torch.equal(a, b)


@pytest.mark.parametrize("how", ["raises", "no_save"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_a_failing_op_or_save_kv_cache_false_leaves_the_cache_as_it_was(how, dtype, monkeypatch):
    from test_vllm_cpu_hot import _boom_ops

    cache, batch, backend, qkv, rows = _build([5, 40, 15, 16], helper=True, dtype=dtype, monkeypatch=monkeypatch)
    calls = []
    real_stage = backend.helper.stage
    backend.helper = backend.helper._replace(stage=lambda *a: calls.append(1) or real_stage(*a))
    before = [_bits(cache.layer_storage(0)[0]).clone(), cache.layer_storage(0)[1].clone()]
    backend.init_forward_metadata(batch)
    layer = LayerSpec(0, 4, 2, 64)
    if how == "raises":
        boom = _boom_ops(monkeypatch)
        with pytest.raises(boom):
            backend.forward(*qkv[0], layer, batch)
    else:
        backend.forward(*qkv[0], layer, batch, save_kv_cache=False)
    assert calls == [1]  # the helper wrote (and took the undo copy)
    assert torch.equal(_bits(cache.layer_storage(0)[0]), before[0])
    assert torch.equal(cache.layer_storage(0)[1], before[1])


def test_the_path_taken_is_named_in_runtime_notes(monkeypatch):
    from attnplug_vllm_cpu import stage

    cache, batch, backend, qkv, rows = _build([5], helper=True, dtype=torch.float32, monkeypatch=monkeypatch)
    assert any("compiled helper" in n and "attnplug_vllm_cpu.decode_layer_new" in n for n in backend.runtime_notes())
    cache, batch, backend, qkv, rows = _build([5], helper=False, dtype=torch.float32, monkeypatch=monkeypatch)
    notes = backend.runtime_notes()
    assert any("compiled helper not loaded" in n and "ATTNPLUG_VLLM_CPU_HELPER=0" in n for n in notes), notes
    # a package built without the library: the reason names the missing file
    monkeypatch.delenv(stage.HELPER_ENV)
    monkeypatch.setattr(stage, "library_path", lambda: None)
    stage._load_library.cache_clear()
    try:
        cache, batch, backend, qkv, rows = _problem([5], [1], decode=True)
        assert backend.helper is None
        assert any("_stage*.so is missing" in n for n in backend.runtime_notes())
        backend.init_forward_metadata(batch)
        out = backend.forward(*qkv[0], LayerSpec(0, 4, 2, 64), batch)  # the pure-torch path serves
        assert torch.isfinite(out).all()
    finally:
        stage._load_library.cache_clear()


_FAILING = None


def _failing_attention_op():
    """A torch op with the schema of vLLM's attention op that raises (the one compiled call finds it by name)."""
    global _FAILING
    if _FAILING is None:
        from attnplug_vllm_cpu.ops import ops

        schema = str(ops().cpu_attention_with_kv_cache.default._schema).split("(", 1)[1]
        lib = torch.library.Library("attnplug_vllm_cpu_test", "DEF")
        lib.define("failing_attention(" + schema)

        def failing(*a, **kw):
            raise RuntimeError("the attention op failed (test)")
        lib.impl("failing_attention", failing, "CPU")
        _FAILING = lib
    return "attnplug_vllm_cpu_test::failing_attention"


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("how", ["raises", "no_save", "saved"])
def test_the_one_call_path_writes_or_restores_exactly(dtype, how, monkeypatch):
    """The compiled one call (``decode_layer_new``: a layer after the forward's first): a raising attention op
    (found by name through the dispatcher) and ``save_kv_cache=False`` leave the layer's cache bytes and page
    marks as they were; a saved forward writes exactly vLLM's writer's bytes and gives the helper-less output."""
    from attnplug_vllm_cpu.layout import VllmCpuLayout
    from attnplug_vllm_cpu.ops import ops

    cache, batch, backend, qkv, rows = _build([5, 40, 15, 16], helper=True, dtype=dtype, monkeypatch=monkeypatch)
    calls = []
    real = backend.helper.decode_layer_new

    def spy(*a):
        calls.append(1)
        return real(*a)
    backend.helper = backend.helper._replace(decode_layer_new=spy)
    backend.init_forward_metadata(batch)
    backend.forward(*qkv[0], LayerSpec(0, 4, 2, 64), batch)  # the first layer builds the scheduler metadata
    assert calls == []
    layer = LayerSpec(1, 4, 2, 64)
    before = [_bits(cache.layer_storage(1)[0]).clone(), cache.layer_storage(1)[1].clone()]
    want = cache.layer_storage(1)[0].clone()
    kc, vc = VllmCpuLayout.views(want)
    ops().cpu_attn_reshape_and_cache(qkv[1][1], qkv[1][2], kc, vc, batch.out_cache_loc.to(torch.int64),
                                     backend.layer_plan(layer).kernel.isa)
    if how == "raises":
        backend.attention_op = _failing_attention_op()
        with pytest.raises(RuntimeError, match="the attention op failed"):
            backend.forward(*qkv[1], layer, batch)
    else:
        out = backend.forward(*qkv[1], layer, batch, save_kv_cache=how == "saved")
        ref = _expected(cache, batch, layer, *qkv[1])
        assert (out.double() - ref).abs().max() < 0.05
    assert calls == [1]
    if how == "saved":
        assert torch.equal(_bits(cache.layer_storage(1)[0]), _bits(want))
    else:
        assert torch.equal(_bits(cache.layer_storage(1)[0]), before[0])
    assert torch.equal(cache.layer_storage(1)[1], before[1])


def test_the_installed_package_carries_its_compiled_helper_where_a_compiler_is_found():
    """setup.py builds ``_stage*.so`` at install (tox: ``--no-build-isolation`` against the tier's torch) wherever a
    C++ compiler is on PATH; a package without it would run the slower path (named in runtime_notes)."""
    import shutil

    from attnplug_vllm_cpu import stage

    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler here: the package is built without its helper (and says so)")
    assert stage.library_path() is not None, "attnplug-vllm-cpu was installed without its compiled helper"
    helper, why = stage._load_library()
    assert helper is not None, why


# -- the skeleton's checked call (PagedBackend.checked_layer_call; issue 30, fourth session) -------------------
def _two_forwards(helper, dtype, monkeypatch, poison=None, seed=3):
    """Two decode forwards of the same batch through the same two layer objects: the first plans both layers,
    the second offers layer 1 (the forward's scheduler metadata built by layer 0) to the checked call. Returns
    the second forward's outputs, layer 1's cache bytes and page marks, and how many times ``decode_layer_new``
    ran during the second forward's layer 1."""
    cache, batch, backend, qkv, rows = _build([5, 40, 15, 16], helper=helper, dtype=dtype, monkeypatch=monkeypatch,
                                              seed=seed)
    layers = [LayerSpec(0, 4, 2, 64), LayerSpec(1, 4, 2, 64)]
    calls: list[int] = []
    if helper:
        def spy(*a, real=backend.helper.decode_layer_new):
            calls.append(1)
            return real(*a)
        backend.helper = backend.helper._replace(decode_layer_new=spy)
    backend.init_forward_metadata(batch)
    for layer, (q, k, v) in zip(layers, qkv):
        backend.forward(q, k, v, layer, batch)
    q, k, v = qkv[1]
    k, v = k * 0.5, v * 2.0
    if poison == "k_nan":
        k[1, 0, 3] = float("nan")
    elif poison == "v_inf":
        v[2, 1, 0] = float("inf")
    elif poison == "owned_inf":  # a key request 1 owns, straight into the storage
        p, o = divmod(int(cache.req_to_token[rows[1], 33]), 16)
        cache.layer_storage(1)[0].view(cache.num_pages, 2, -1)[p, 0, 3 * 16 + o] = float("inf")
    backend.init_forward_metadata(batch)
    out0 = backend.forward(*qkv[0], layers[0], batch)
    calls.clear()
    checked_path = []  # the skeleton's staged path (its undo copy) ran for layer 1
    real_snapshot = backend._snapshot
    backend._snapshot = lambda *a: checked_path.append(1) or real_snapshot(*a)
    out1 = backend.forward(q, k, v, layers[1], batch)
    del backend._snapshot
    backend.took_checked_path = bool(checked_path)
    return backend, cache, batch, (out0, out1), len(calls), (q, k, v), layers


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("poison", [None, "k_nan", "v_inf", "owned_inf"])
def test_a_planned_decode_layer_runs_in_one_checked_call_with_the_checked_paths_bits(dtype, poison, monkeypatch):
    """vllm_cpu's checked call (the compiled one call tried before the skeleton's q/k/v checks) gives exactly the
    helper-less path's output and cache bytes; clean, it is the layer's only op call; with a non-finite k/v or
    output it puts its write back and the checked path redoes the layer (two calls: the reference's NaN rows)."""
    results = []
    for helper in (True, False):
        backend, cache, batch, outs, n_calls, _, _ = _two_forwards(helper, dtype, monkeypatch, poison)
        assert n_calls == (0 if not helper else 1 if poison is None else 2)
        assert backend.took_checked_path is (not helper or poison is not None)
        results.append((outs, _bits(cache.layer_storage(1)[0]).clone(), cache.layer_storage(1)[1].clone()))
    (o1, r1, m1), (o2, r2, m2) = results
    for a, b in zip(o1, o2):
        assert torch.equal(_bits(a), _bits(b))
    assert torch.equal(r1, r2) and torch.equal(m1, m2)


def _bad_planned_calls(q, k, v):
    return {
        "q heads": ((torch.cat([q, q[:, :1]], 1), k, v), r"q has shape \(4, 5, 64\)"),
        "q tokens": ((q[:3], k[:3], v[:3]), r"q has shape \(3, 4, 64\)"),
        "k heads": ((q, k[:, :1], v), r"k has shape \(4, 1, 64\)"),
        "v head dim": ((q, k, v[:, :, :32]), r"v has shape \(4, 2, 32\)"),
        "k dtype": ((q, k.double(), v), r"dtypes differ"),
        "q device": ((q.to("meta"), k, v), r"q/k/v are on meta"),
        "k device": ((q, k.to("meta"), v.to("meta")), r"q/k/v are on cpu, the KV cache of layer 1 on cpu"),
    }


@pytest.mark.parametrize("case", list(_bad_planned_calls(*(torch.zeros(4, h, 64) for h in (4, 2, 2)))))
def test_the_checked_call_refuses_what_the_skeleton_refuses_and_writes_nothing(case, monkeypatch):
    """A planned layer's bad call (a wrong head count, token count, head dim, dtype or device): the one call
    returns -1 having done nothing, the skeleton's checks name the fault in their words, the cache bytes and
    page marks are as before, and the layer then serves a good call through the checked call."""
    backend, cache, batch, _, _, (q, k, v), layers = _two_forwards(True, torch.float32, monkeypatch)
    (bq, bk, bv), match = _bad_planned_calls(q, k, v)[case]
    before = (_bits(cache.layer_storage(1)[0]).clone(), cache.layer_storage(1)[1].clone())
    with pytest.raises(ShapeError, match=match):
        backend.forward(bq, bk, bv, layers[1], batch)
    assert torch.equal(_bits(cache.layer_storage(1)[0]), before[0])
    assert torch.equal(cache.layer_storage(1)[1], before[1])
    out = backend.forward(q, k, v, layers[1], batch)
    assert (out.double() - _expected(cache, batch, layers[1], q, k, v)).abs().max() < 1e-4


def test_the_checked_call_serves_strided_queries_and_forward_into_buffers(monkeypatch):
    """Calls the one call does not take (a query whose heads are not dense rows) or does (a ``forward_into``
    buffer of exactly the output) give the reference's output; an ill-shaped buffer is named."""
    backend, cache, batch, (_, out1), _, (q, k, v), layers = _two_forwards(True, torch.float32, monkeypatch)
    ref = _expected(cache, batch, layers[1], q, k, v)
    wide = torch.zeros(q.shape[0], 4, 2 * 64)
    wide[:, :, :64] = q
    strided = wide[:, :, :64]
    assert (backend.forward(strided, k, v, layers[1], batch).double() - ref).abs().max() < 1e-4
    into = torch.empty_like(q)
    calls = []
    real = backend.helper.decode_layer
    backend.helper = backend.helper._replace(decode_layer=lambda *a: calls.append(1) or real(*a))
    assert backend.forward_into(into, q, k, v, layers[1], batch) is into and calls == [1]
    assert torch.equal(into, out1)
    with pytest.raises(ShapeError, match=r"forward_into: out has shape \(4, 4, 32\)"):
        backend.forward_into(torch.empty(4, 4, 32), q, k, v, layers[1], batch)


def test_the_one_call_op_refuses_a_head_count_other_than_the_layers_and_other_devices():
    """``decode_layer_new`` itself: q with more heads than ``num_heads`` says, or q on another device, is -1 with
    nothing written (the schema's ``num_heads``; the fake answers -1 for real tensors on two devices)."""
    cache, batch, backend, qkv, rows = _problem([5, 40], [1, 1], decode=True, layers=1)
    backend.init_forward_metadata(batch)
    layer = LayerSpec(0, 4, 2, 64)
    backend.forward(*qkv[0], layer, batch)
    helper = _helper()
    la, meta = backend.layer_plan(layer).kernel, backend._fwd.meta
    keys, sched = meta.self_keys, meta.scheduler[la.sched_key]
    q, k, v = qkv[0]
    loc = batch.out_cache_loc.to(torch.int64)
    before = _bits(la.raw).clone()
    for bad_q, heads in ((q, 3), (q.to("meta"), 4)):
        out, code = helper.decode_layer_new(la.raw, k, v, loc, torch.empty(0), bad_q, la.key_cache, la.value_cache,
                                            keys.query_start_loc, keys.seq_lens, la.scaling, la.window,
                                            keys.block_table, la.cap, sched, la.sinks, meta.threads, heads,
                                            backend.attention_op)
        assert code == -1
    assert torch.equal(_bits(la.raw), before)
