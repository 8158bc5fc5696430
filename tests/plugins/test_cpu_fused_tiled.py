"""cpu_fused's tiled extend kernel (``csrc/extend_tiled.cpp``, the op ``attnplug_cpu_fused::extend_tiled``)
against the float64 reference.

Requests with more than ``FUSED_MAX_QUERIES`` new tokens go through the tiled kernel where the layer
fits it (``tiled_fits``): query tiles of ``128 // G`` queries (rows = queries x the KV head's group) x
key tiles of 48 keys with an online softmax, ``ITEM_SUBS`` query tiles a work item sharing each key tile
(the item-edge test puts lengths at an item minus one, an item and an item plus one). The tile-edge tests lower ``FUSED_MAX_QUERIES`` to 0 so
that every request, one new token included, takes the tiled kernel, and put lengths at 1, a tile
minus one, a tile and a tile plus one (queries and keys), over no prefix and prefixes that cross
key tiles, in ragged batches, for GQA groups 1, 3, 4, 8, both dtypes and every instruction set this
CPU runs (``CpuFusedBackend.tiled_isa`` pins one). Problems, the reference check and the cache
check are ``test_cpu_fused``'s (noise in every slot; pages shuffled). A case that means the
tiled kernel asserts it ran: the eager extend's workspace was never allocated.

The AMX body (isa ``amx``, the default where the CPU has AMX and Linux grants the tile data) has its
own tiles (query tiles of ``256 // G`` queries, key tiles of 64 keys) and its own tests below: against
the reference and the FMA tiles at its tile edges, features and page sizes, NaN selection, float32's
error next to the FMA tiles', the default isa choosing it, and the fallback when AMX is refused
(``$ATTNPLUG_CPU_FUSED_AMX=0``); they skip, saying why, where AMX is not usable.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from typing import Any

import pytest
import torch

from attnplug import ForwardMode, ShapeError
from attnplug.testing.reference import reference_attention
from attnplug.testing.tolerances import tolerance_for
from attnplug_cpu_fused import backend as cf_backend
from attnplug_cpu_fused import kernel as fused

from test_cpu_fused import (
    BF16, DTYPE_IDS, F16, F32, E4M3, extend_batch, inputs, make, needs_kernel, run_and_check, threads,  # noqa: F401
)

#: the tiled kernel's tiles (extend_tiled.cpp: MROWS, KT)
ROWS, KEYS = 128, 48


def isas() -> list[int]:
    """The instruction sets this CPU runs (``fused.TILED_ISAS`` codes up to the best)."""
    op, why = fused.load()
    if op is None:
        return []
    return list(range(1, int(torch.ops.attnplug_cpu_fused.tiled_isa()) + 1))


ISA_IDS = {v: k for k, v in fused.TILED_ISAS.items()}

#: the two bf16 bodies of a CPU without AMX (extend_tiled.cpp): bf16 widened to float32 and the avx512 FMA tiles
#: (isa ``avx512``), and vdpbf16ps (isa ``avx512bf16``); isa 0 runs one of them by vdpbf16ps's measured rate
BF16_BODIES = {fused.TILED_ISAS["avx512"]: "widened", fused.TILED_ISAS["avx512bf16"]: "vdpbf16ps"}


def body_cases() -> list[Any]:
    """(dtype, tiled_isa) cases: each dtype by default (isa 0), and bf16 pinned to each bf16 body this CPU runs
    besides (widened and vdpbf16ps), so both are held to the reference whichever the default is here."""
    cases = [pytest.param(F32, 0, id="float32"), pytest.param(BF16, 0, id="bfloat16")]
    best = max(isas(), default=0)
    return cases + [pytest.param(BF16, isa, id=f"bfloat16-{name}") for isa, name in BF16_BODIES.items() if isa <= best]


def assert_tiled_ran(s: Any, q_dtype: torch.dtype) -> None:
    """The kernel was loaded and on, and the eager extend never allocated its workspace."""
    assert s.backend.tiled
    assert s.backend.workspace.grows == 0 and s.backend.workspace.nbytes() == 0, "the eager extend ran"


@pytest.fixture
def all_tiled(monkeypatch: Any) -> None:
    """Every request with a new token through the tiled kernel (none through the chunked one)."""
    monkeypatch.setattr(cf_backend, "FUSED_MAX_QUERIES", 0)


@needs_kernel
@pytest.mark.parametrize("isa", isas(), ids=ISA_IDS.get)
@pytest.mark.parametrize("dtype", [F32, BF16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("group", [1, 3, 4, 8])
def test_tile_edges_every_isa(group, dtype, isa, all_tiled):
    # query tiles of 128 // group queries: new tokens 1, tile - 1, tile, tile + 1 (capped by the cache),
    # over no prefix, a prefix ending one before / at / after a key tile (47, 48, 49), ragged
    # (group 1's tile of 128 queries is past this cache: its requests stay under one tile)
    qt = ROWS // group
    news = [1, min(qt - 1, 60), min(qt, 61), min(qt + 1, 62)]
    for prefix in ([0, 47, 0, 1], [KEYS, 0, KEYS - 1, KEYS + 1]):
        s = make(dtype=dtype, kv_heads=2, group=group, head_dim=32, seed=100 + group + prefix[0])
        s.backend.tiled_isa = isa
        run_and_check(s, extend_batch(s, ForwardMode.EXTEND, prefix, news))
        assert_tiled_ran(s, dtype)


#: query sub-tiles per work item of the FMA bodies (extend_tiled.cpp: ITEM_SUBS): each key tile is read and
#: packed once for all of an item's sub-tiles, a sub-tile skips the key tiles past its own causal end or
#: before its first query's window
ITEM_SUBS = 4
#: layers whose masks cut across an item's sub-tiles (a window ending inside the item, soft-cap, sinks)
ITEM_LAYERS = ("plain", "window20", "softcap_window_sinks")


@needs_kernel
@pytest.mark.parametrize("isa", isas(), ids=ISA_IDS.get)
@pytest.mark.parametrize("dtype", [F32, BF16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("group", [4, 8])
@pytest.mark.parametrize("layer_kind", ITEM_LAYERS)
def test_item_edges_across_sub_tiles(layer_kind, group, dtype, isa, all_tiled):
    # work items of ITEM_SUBS sub-tiles (ITEM_SUBS x 128 // group queries): new tokens an item minus one, an
    # item and an item plus one (capped by the cache's 160 positions), over no prefix and over prefixes ending
    # inside a key tile; a request that ends inside its item's last sub-tile, one that fills it, one that
    # spills one query into the next item
    item = ITEM_SUBS * (ROWS // group)
    for prefix, news in (([0, KEYS - 1], [item - 1, min(item + 1, 160 - KEYS + 1)]), ([5, 0], [item, item + 1])):
        s = make(dtype=dtype, kv_heads=8 // group, group=group, head_dim=32, seed=140 + group + prefix[0],
                 layer_kw=TILED_LAYERS[layer_kind])
        s.backend.tiled_isa = isa
        run_and_check(s, extend_batch(s, ForwardMode.EXTEND, prefix, news),
                      q_gain=4.0 if "softcap" in layer_kind else 1.0)
        assert_tiled_ran(s, dtype)


@needs_kernel
@pytest.mark.parametrize("dtype,isa", body_cases())
@pytest.mark.parametrize("dims", [(16, 16), (64, 64), (128, 128), (48, 80), (64, 32)], ids=lambda d: f"D{d[0]}_Dv{d[1]}")
def test_head_dims(dims, dtype, isa):
    # long extends (> FUSED_MAX_QUERIES new tokens) take the tiled kernel by default; head dims that are not
    # multiples of 32 (16, 48, 80) take the bodies' 16-wide remainders (query pairs, value pairs)
    s = make(dtype=dtype, head_dim=dims[0], v_head_dim=dims[1], seed=110 + dims[0])
    s.backend.tiled_isa = isa
    run_and_check(s, extend_batch(s, ForwardMode.EXTEND, [0, 50], [70, 40]))
    assert_tiled_ran(s, dtype)


TILED_LAYERS: dict[str, dict[str, Any]] = {
    "plain": {},
    "window1": dict(sliding_window=1),
    "window20": dict(sliding_window=20),  # ends inside the query tile, and inside a key tile
    "window60_sinks": dict(sliding_window=60, sinks=torch.linspace(-1.0, 2.0, 8)),  # reaches into the prefix
    "sinks": dict(sinks=torch.linspace(-2.0, 3.0, 8)),
    "softcap": dict(scaling=1.0, logit_cap=3.0),
    "softcap_window_sinks": dict(logit_cap=5.0, sliding_window=33, sinks=torch.linspace(0.0, 1.0, 8)),
}


@needs_kernel
@pytest.mark.parametrize("layer_kind", sorted(TILED_LAYERS))
@pytest.mark.parametrize("dtype,isa", body_cases())
def test_layer_features_and_threads(dtype, isa, layer_kind, threads):  # noqa: F811  # the fixture
    for page_size in (16, 1):
        s = make(dtype=dtype, head_dim=32, page_size=page_size, seed=120 + page_size,
                 layer_kw=TILED_LAYERS[layer_kind])
        s.backend.tiled_isa = isa
        batch = extend_batch(s, ForwardMode.EXTEND, [0, 37, 90, 3], [17, 40, 33, 100])
        run_and_check(s, batch, q_gain=4.0 if "softcap" in layer_kind else 1.0)
        assert_tiled_ran(s, dtype)


@needs_kernel
@pytest.mark.parametrize("dtype", [F32, BF16], ids=DTYPE_IDS.get)
def test_mixed_batch_shares_requests_between_the_two_kernels(dtype):
    # decode requests and short extends through the chunked kernel, long ones through the tiled kernel,
    # in one forward, each writing its own rows
    s = make(dtype=dtype, head_dim=32, seed=130, layer_kw=dict(sinks=torch.linspace(-1.0, 1.0, 8)))
    run_and_check(s, extend_batch(s, ForwardMode.MIXED, [0, 33, 5, 12], [1, 50, 1, 17]))
    assert_tiled_ran(s, dtype)


@needs_kernel
@pytest.mark.parametrize("dtype", [F32, BF16], ids=DTYPE_IDS.get)
def test_tiled_kernel_matches_sdpa_on_a_long_prefill(dtype):
    # the same forward through the tiled kernel and through SDPA (tiled off): both within the tolerance
    # of the reference, and close to each other
    outs = []
    for tiled in (True, False):
        s = make(dtype=dtype, head_dim=64, seed=140)
        s.backend.tiled = tiled
        outs.append(run_and_check(s, extend_batch(s, ForwardMode.EXTEND, [60, 0], [90, 150])))
        if tiled:
            assert_tiled_ran(s, dtype)
        else:
            assert s.backend.workspace.grows > 0
    atol = 1e-5 if dtype == F32 else 2e-2
    torch.testing.assert_close(outs[0].double(), outs[1].double(), atol=atol, rtol=0)


@needs_kernel
@pytest.mark.parametrize("dtype,isa", body_cases())
def test_nan_in_a_later_new_token_reaches_only_the_queries_that_see_it(dtype, isa, all_tiled):
    # causal masking selects: a NaN key/value at new token t never reaches queries before t (0 * NaN is
    # NaN), and does reach t and every later query of the request
    s = make(dtype=dtype, head_dim=32, seed=150)
    s.backend.tiled_isa = isa
    batch = extend_batch(s, ForwardMode.EXTEND, [20, 0], [60, 35])
    q, k, v = inputs(s, batch.num_tokens)
    t = 41  # inside the first request's second query tile, inside a key tile
    k[t, 0, 3] = float("nan")
    v[t, 1, 5] = float("nan")
    s.backend.init_forward_metadata(batch)
    out = s.backend.forward(q, k, v, s.layer, batch)
    G = s.layer.gqa_group_size
    assert not torch.isnan(out[:t]).any() and not torch.isnan(out[60:]).any()
    assert torch.isnan(out[t:60, :G]).all()  # KV head 0's queries read the NaN score
    assert torch.isnan(out[t:60, G:]).any()  # KV head 1's queries read the NaN value row


DECLINED = {
    "float16": (dict(dtype=F16), "float32 and bfloat16"),
    "fp8_cache": (dict(dtype=BF16, kv_dtype=E4M3), "float32 and bfloat16"),
}


@needs_kernel
@pytest.mark.parametrize("case", sorted(DECLINED))
def test_layers_it_does_not_take_go_to_sdpa(case):
    kw, why = DECLINED[case]
    s = make(head_dim=32, seed=160, **kw)
    batch = extend_batch(s, ForwardMode.EXTEND, [10], [40])
    run_and_check(s, batch)
    q = torch.zeros(1, s.layer.num_heads, 32, dtype=s.dtype)
    assert why in s.backend.tiled_fits(q, s.layer, s.backend.forward_metadata(batch))
    assert s.backend.workspace.grows > 0  # SDPA's assembled K/V


@needs_kernel
def test_target_verify_with_many_drafts_goes_to_sdpa():
    drafts = 20
    s = make(dtype=F32, head_dim=32, seed=170)
    mask = (torch.rand(2, drafts, drafts, generator=s.gen) > 0.5) | torch.eye(drafts, dtype=torch.bool)
    batch = extend_batch(s, ForwardMode.TARGET_VERIFY, [5, 30], [drafts] * 2, mask=mask)
    run_and_check(s, batch)
    q = torch.zeros(1, s.layer.num_heads, 32)
    assert "target-verify mask" in s.backend.tiled_fits(q, s.layer, s.backend.forward_metadata(batch))


@needs_kernel
def test_an_isa_this_cpu_lacks_is_refused_with_its_name():
    s = make(dtype=F32, head_dim=32, seed=180)
    s.backend.tiled_isa = max(fused.TILED_ISAS.values()) + 1
    with pytest.raises(ValueError, match=f"tiled_isa={s.backend.tiled_isa} is not available on this CPU"):
        run_and_check(s, extend_batch(s, ForwardMode.EXTEND, [0], [30]))


@needs_kernel
def test_a_slot_out_of_range_is_an_error_naming_the_request(all_tiled):
    # req_to_token rewritten after init_forward_metadata checked it: the kernel checks every slot it reads
    s = make(dtype=F32, head_dim=32, seed=190)
    batch = extend_batch(s, ForwardMode.EXTEND, [30, 20], [20, 20], req_ids=[3, 4])
    q, k, v = inputs(s, batch.num_tokens)
    s.backend.init_forward_metadata(batch)
    op = s.backend._tiled_op

    def rewrite(*args: Any) -> Any:  # rewrites one slot just before the tiled call (the skeleton's checks ran)
        s.cache.req_to_token[4, 7] = s.cache.num_slots + 5
        return op(*args)

    s.backend._tiled_op = rewrite
    with pytest.raises(ShapeError, match=r"request 1 \(req_to_token row 4\): position 7 maps to slot"):
        s.backend.forward(q, k, v, s.layer, batch)


@needs_kernel
@pytest.mark.parametrize("dtype", [F32, BF16], ids=DTYPE_IDS.get)
def test_opcheck_passes_for_the_tiled_op(dtype):
    s = make(dtype=dtype, head_dim=32, seed=200, layer_kw=dict(sliding_window=30))
    batch = extend_batch(s, ForwardMode.EXTEND, [10, 0], [40, 20])
    q, k, v = inputs(s, batch.num_tokens)
    s.backend.init_forward_metadata(batch)
    meta = s.backend.forward_metadata(batch)
    fl = s.backend.layer_plan(s.layer).kernel
    out = torch.zeros(batch.num_tokens, s.layer.num_heads, s.layer.v_head_dim, dtype=dtype)
    args = (q, k, v, fl.k_cache, fl.v_cache, s.cache.req_to_token, meta.tiled_plan(30), fl.sinks, out, fl.err,
            s.layer.gqa_group_size, 30, 0, fl.scale, fl.cap)
    torch.library.opcheck(torch.ops.attnplug_cpu_fused.extend_tiled.default, args)



# ---------------------------------------------------------------------------
# the AMX body (isa ``amx``): bf16 through tdpbf16ps tiles, float32 as bf16 hi + lo parts
# ---------------------------------------------------------------------------

AMX = fused.TILED_ISAS["amx"]
#: the AMX tiles' rows per query tile (extend_tiled.cpp: AMROWS)
AMX_ROWS = 256


def _best_isa() -> int:
    op, why = fused.load()
    return 0 if op is None else int(torch.ops.attnplug_cpu_fused.tiled_isa())


needs_amx = pytest.mark.skipif(_best_isa() < AMX, reason="cpu_fused: no AMX tiles here (the CPU lacks AMX-BF16, "
                               "Linux refused the tile data, or $ATTNPLUG_CPU_FUSED_AMX=0)")


def amx_and_fma(dtype: torch.dtype, batch_of: Any, **kw: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The same forward (same cache, pages, inputs) through the AMX body and the avx512 FMA tiles, each
    checked against the float64 reference."""
    outs = []
    for isa in (AMX, fused.TILED_ISAS["avx512"]):
        s = make(dtype=dtype, **kw)
        s.backend.tiled_isa = isa
        outs.append(run_and_check(s, batch_of(s), q_gain=4.0 if "logit_cap" in kw.get("layer_kw", {}) else 1.0))
        assert_tiled_ran(s, dtype)
    return outs[0], outs[1]


@needs_kernel
@needs_amx
@pytest.mark.parametrize("dtype", [F32, BF16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("dims", [(16, 16), (48, 80), (128, 128), (64, 32)], ids=lambda d: f"D{d[0]}_Dv{d[1]}")
def test_amx_matches_the_reference_and_the_fma_tiles(dims, group, dtype, all_tiled):
    # AMX query tiles are AMX_ROWS // group queries, key tiles 64 keys, rows padded to 32, D padded to 32
    # (16, 48: a half step of zeros), V column blocks of 16 in pairs (Dv 80: an odd one); new tokens 1, a
    # query tile -1, a tile, a tile +1 (capped by the cache) over prefixes ending before / at / after a key
    # tile, ragged
    qt = AMX_ROWS // group
    for prefix, news in (([0, 63], [1, min(qt - 1, 90)]), ([64, 65], [min(qt, 91), min(qt + 1, 92)])):
        def batch_of(s: Any) -> Any:
            return extend_batch(s, ForwardMode.EXTEND, prefix, news)  # noqa: B023  # called in this iteration

        amx, fma = amx_and_fma(dtype, batch_of, kv_heads=2, group=group, head_dim=dims[0], v_head_dim=dims[1],
                               seed=300 + group + dims[0] + prefix[0])
        # both bodies within the tolerance of the reference (run_and_check), and of each other
        torch.testing.assert_close(amx.double(), fma.double(), atol=1e-4 if dtype == F32 else 3e-2, rtol=0)


@needs_kernel
@needs_amx
@pytest.mark.parametrize("layer_kind", sorted(TILED_LAYERS))
@pytest.mark.parametrize("dtype", [F32, BF16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("page_size", [1, 16, 32])
def test_amx_layer_features_and_page_sizes(page_size, dtype, layer_kind, threads):  # noqa: F811  # the fixture
    s = make(dtype=dtype, head_dim=64, page_size=page_size, seed=320 + page_size,
             layer_kw=TILED_LAYERS[layer_kind])
    s.backend.tiled_isa = AMX
    batch = extend_batch(s, ForwardMode.EXTEND, [0, 37, 90, 3], [17, 40, 33, 100])
    run_and_check(s, batch, q_gain=4.0 if "softcap" in layer_kind else 1.0)
    assert_tiled_ran(s, dtype)


@needs_kernel
@needs_amx
@pytest.mark.parametrize("dtype", [F32, BF16], ids=DTYPE_IDS.get)
def test_amx_nan_in_a_later_new_token_reaches_only_the_queries_that_see_it(dtype, all_tiled):
    # the AMX tiles multiply P by V: a tile holding a non-finite value row hidden from some rows goes
    # through the select path instead (0 * NaN is NaN)
    s = make(dtype=dtype, head_dim=32, seed=330)
    s.backend.tiled_isa = AMX
    batch = extend_batch(s, ForwardMode.EXTEND, [20, 0], [60, 35])
    q, k, v = inputs(s, batch.num_tokens)
    t = 41
    k[t, 0, 3] = float("nan")
    v[t, 1, 5] = float("inf")
    s.backend.init_forward_metadata(batch)
    out = s.backend.forward(q, k, v, s.layer, batch)
    G = s.layer.gqa_group_size
    assert torch.isfinite(out[:t]).all() and torch.isfinite(out[60:]).all()
    assert torch.isnan(out[t:60, :G]).all()
    assert (~torch.isfinite(out[t:60, G:])).any()


#: float32 through AMX (three bf16 parts an operand, six products) must stay this far inside the float32
#: tolerance on inputs of the suite's magnitudes (q gain up to 4)
AMX_F32_MARGIN = 4.0


def _worst_error_over_bound(s: Any, batch: Any, q_gain: float = 1.0) -> float:
    """max |out - ref| / (atol + rtol |ref|) of one forward (1.0: at the float32 tolerance)."""
    q, k, v = inputs(s, batch.num_tokens, q_gain=q_gain)
    kc0, vc0 = s.cache.read_kv(0)
    s.backend.init_forward_metadata(batch)
    out = s.backend.forward(q, k, v, s.layer, batch)
    ks, vs = s.cache.kv_scales(0)
    ref = reference_attention(q, k, v, s.layer, batch, kc0, vc0, s.cache.req_to_token, ks, vs)
    tol = tolerance_for("float32")
    return float(((out.double() - ref).abs() / (tol.atol + tol.rtol * ref.abs())).max())


F32_CASES: dict[str, tuple[dict[str, Any], float]] = {
    "d128_g4": (dict(head_dim=128, group=4), 1.0),
    "d64_g8_window": (dict(head_dim=64, group=8, layer_kw=dict(sliding_window=50)), 1.0),
    "d256_g1": (dict(head_dim=256, group=1), 1.0),
    "d32_softcap_sinks": (dict(head_dim=32, layer_kw=dict(scaling=1.0, logit_cap=3.0,
                                                          sinks=torch.linspace(-1.0, 2.0, 8))), 4.0),
    "d128_gain4": (dict(head_dim=128, group=4), 4.0),
    "d128_gain12": (dict(head_dim=128, group=4), 12.0),  # scores in the tens: the FMA tiles' error grows too
}


@needs_kernel
@needs_amx
@pytest.mark.parametrize("case", sorted(F32_CASES))
def test_amx_float32_is_as_accurate_as_the_fma_tiles(case):
    # the measured reason float32 runs through AMX by default: against the float64 reference its error is
    # no larger than the avx512 FMA tiles' on the same problem, and AMX_F32_MARGIN times inside the float32
    # tolerance at the suite's magnitudes (docs/performance.md has the figures; with two bf16 parts
    # an operand, three products, it was 10x the FMA tiles' at |v| ~ 30)
    kw, gain = F32_CASES[case]
    worst = {}
    for isa in (AMX, fused.TILED_ISAS["avx512"]):
        s = make(dtype=F32, seed=340, **kw)
        s.backend.tiled_isa = isa
        worst[isa] = _worst_error_over_bound(s, extend_batch(s, ForwardMode.EXTEND, [0, 60, 17], [150, 100, 40]),
                                             gain)
        assert_tiled_ran(s, F32)
    amx, fma = worst[AMX], worst[fused.TILED_ISAS["avx512"]]
    assert amx <= max(1.5 * fma, 0.02), f"float32 through AMX: {amx:.4f} of the tolerance, FMA tiles {fma:.4f}"
    if gain <= 4.0:
        assert amx <= 1.0 / AMX_F32_MARGIN, f"float32 through AMX: {amx:.3f} of the tolerance"


@needs_kernel
@needs_amx
@pytest.mark.parametrize("dtype", [F32, BF16], ids=DTYPE_IDS.get)
def test_the_default_isa_runs_the_amx_body_where_amx_is_usable(dtype):
    # isa 0 on an AMX CPU is the AMX body for both dtypes: bit for bit the pinned one's output
    outs = []
    for isa in (0, AMX):
        s = make(dtype=dtype, head_dim=64, seed=350)
        s.backend.tiled_isa = isa
        outs.append(run_and_check(s, extend_batch(s, ForwardMode.EXTEND, [30, 0], [70, 40])))
    assert torch.equal(outs[0], outs[1])


_REFUSED_SCRIPT = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[1])
    import torch
    from attnplug import ForwardMode
    from attnplug_cpu_fused import kernel as fused
    from test_cpu_fused import BF16, F32, extend_batch, make, run_and_check
    best = int(torch.ops.attnplug_cpu_fused.tiled_isa())
    print(best)
    for dtype in (F32, BF16):
        s = make(dtype=dtype, head_dim=64, seed=360)
        run_and_check(s, extend_batch(s, ForwardMode.EXTEND, [30, 0], [70, 40]))  # isa 0: the fallback
        assert s.backend.workspace.grows == 0, "the tiled kernel did not run"
    s = make(dtype=F32, head_dim=64, seed=360)
    s.backend.tiled_isa = fused.TILED_ISAS["amx"]
    try:
        run_and_check(s, extend_batch(s, ForwardMode.EXTEND, [30, 0], [70, 40]))
    except ValueError as exc:
        print("refused:", exc)
""")


@needs_kernel
@needs_amx
def test_amx_refused_falls_back_to_the_avx512_bodies():
    # $ATTNPLUG_CPU_FUSED_AMX=0 makes the process behave as if Linux refused the tile data (or the CPU had
    # no AMX): the best isa drops from amx (this process's, needs_amx) below it, isa 0 runs the fallback
    # bodies within the tolerance, and a pinned amx is refused naming it (a CPU without AMX takes the
    # same path: cpu_isa(); there every other test here runs the fallback bodies)
    env = dict(os.environ, ATTNPLUG_CPU_FUSED_AMX="0")
    proc = subprocess.run([sys.executable, "-c", _REFUSED_SCRIPT, os.path.dirname(__file__)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert int(lines[0]) < AMX
    assert any(f"tiled_isa={AMX} is not available on this CPU" in line for line in lines), proc.stdout


# the bf16 body without AMX: vdpbf16ps or widened to float32, by vdpbf16ps's rate measured once a process

_BF16_CHOICE_SCRIPT = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[1])
    import torch
    from attnplug import ForwardMode
    from attnplug_cpu_fused import kernel as fused
    from test_cpu_fused import BF16, extend_batch, make, run_and_check
    code, ratio, rounded, how = torch.ops.attnplug_cpu_fused.tiled_bf16_isa()
    s = make(dtype=BF16, head_dim=64, seed=370)
    print(code, ratio, rounded, how, s.backend.tiled_bf16_body, sep="|")
    print(s.backend.runtime_notes()[0])
    outs = []
    for isa in (0, code):  # the default and the body it names, pinned: the same bits
        s = make(dtype=BF16, head_dim=64, seed=370)
        s.backend.tiled_isa = isa
        outs.append(run_and_check(s, extend_batch(s, ForwardMode.EXTEND, [30, 0], [70, 40])))
        assert s.backend.workspace.grows == 0, "the tiled kernel did not run"
    assert torch.equal(outs[0], outs[1]), "isa 0 is not the body tiled_bf16_isa names"
    print("same")
""")


def _bf16_choice(rate: str | None) -> tuple[int, float, float, int, str, str]:
    """A fresh process without AMX (``$ATTNPLUG_CPU_FUSED_AMX=0``; the choice is made once a process) and, where
    ``rate`` is given, ``$ATTNPLUG_CPU_FUSED_DPBF16_RATE`` set to it: the op's report, the backend's body, its
    runtime note, after checking that a bf16 extend at isa 0 is bit for bit the pinned body it names."""
    env = dict(os.environ, ATTNPLUG_CPU_FUSED_AMX="0")
    env.pop(fused.DPBF16_RATE_ENV, None)
    if rate is not None:
        env[fused.DPBF16_RATE_ENV] = rate
    proc = subprocess.run([sys.executable, "-c", _BF16_CHOICE_SCRIPT, os.path.dirname(__file__)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[-1] == "same", proc.stdout
    code, ratio, rounded, how, body = lines[0].split("|")
    return int(code), float(ratio), float(rounded), int(how), body, lines[1]


def _has_avx512bf16() -> bool:
    op, _ = fused.load()
    return op is not None and int(torch.ops.attnplug_cpu_fused.tiled_isa()) >= fused.TILED_ISAS["avx512bf16"]


needs_avx512bf16 = pytest.mark.skipif(not _has_avx512bf16(), reason="cpu_fused: this CPU has no AVX-512 BF16 "
                                      "(vdpbf16ps): bf16 extends widen to float32, nothing to choose")


@needs_kernel
@needs_avx512bf16
@pytest.mark.parametrize("rate,rounded,body", [("2", 2.0, "vdpbf16ps"), ("1.3", 1.0, "vdpbf16ps"),
                                               ("0.75", 1.0, "vdpbf16ps"), ("0.7", 0.5, "widened"),
                                               ("0.5", 0.5, "widened"), ("0.25", 0.25, "widened")])
def test_bf16_body_follows_the_rate(rate, rounded, body):
    # without AMX a bf16 long extend runs vdpbf16ps where its flops a cycle (over the float32 FMA's, rounded to a
    # power of two) reach DPBF16_PAYS_AT, else widens to float32; $ATTNPLUG_CPU_FUSED_DPBF16_RATE stands for the
    # measurement (a CPU issuing vdpbf16ps at the FMA's rate is 2, this Xeon 0.5): the choice, its report and
    # the body that runs follow it
    code, got_ratio, got_rounded, how, got_body, note = _bf16_choice(rate)
    assert (how, got_ratio, got_rounded, got_body) == (2, float(rate), rounded, body)
    assert code == {"vdpbf16ps": fused.TILED_ISAS["avx512bf16"], "widened": fused.TILED_ISAS["avx512"]}[body]
    assert (rounded >= fused.DPBF16_PAYS_AT) == (body == "vdpbf16ps")
    assert f"bf16 long extends: {'vdpbf16ps' if body == 'vdpbf16ps' else 'widened to float32'}" in note
    assert f"set by ${fused.DPBF16_RATE_ENV} at {float(rate):.2f}x" in note


@needs_kernel
@needs_avx512bf16
def test_bf16_body_is_measured_and_the_same_every_run():
    # unset, the rate is measured (register-only vdpbf16ps and FMA loops): a positive ratio, rounded to a power of
    # two, the same choice in two processes, the note saying it was measured and what it chose
    runs = [_bf16_choice(None) for _ in range(2)]
    for _code, ratio, rounded, how, body, note in runs:
        assert how == 1 and ratio > 0 and rounded == 2.0 ** round(math.log2(ratio))
        assert body == ("vdpbf16ps" if rounded >= fused.DPBF16_PAYS_AT else "widened")
        assert f"vdpbf16ps measured at {ratio:.2f}x the float32 FMA's flops a cycle" in note
    assert {(r[0], r[2], r[4]) for r in runs} == {(runs[0][0], runs[0][2], runs[0][4])}, runs


@needs_kernel
@pytest.mark.parametrize("value", ["fast", "0", "-2", "nan", "inf"])
def test_a_bad_dpbf16_rate_is_an_error_naming_the_variable(value, monkeypatch):
    monkeypatch.setenv(fused.DPBF16_RATE_ENV, value)
    with pytest.raises(ValueError, match=rf"\${fused.DPBF16_RATE_ENV}='{value}': expected a positive number"):
        fused.tiled_bf16_body()


@needs_kernel
def test_runtime_notes_name_the_bf16_extend_body():
    s = make(seed=380)
    (note,) = s.backend.runtime_notes()
    body, why = fused.tiled_bf16_body()
    assert (s.backend.tiled_bf16_body, s.backend.tiled_bf16_why) == (body, why)
    assert f"bf16 long extends: {why}" in note
    assert body == {"amx": "amx", "avx512bf16": body}.get(s.backend.tiled_body, "widened")
