"""cpu_fused's tiled extend kernel (``csrc/extend_tiled.cpp``, the op ``attnplug_cpu_fused::extend_tiled``)
against the float64 reference.

Requests with more than ``FUSED_MAX_QUERIES`` new tokens go through the tiled kernel where the layer
fits it (``tiled_fits``): query tiles of ``128 // G`` queries (rows = queries x the KV head's group) x
key tiles of 48 keys with an online softmax. The tile-edge tests lower ``FUSED_MAX_QUERIES`` to 0 so
that every request, one new token included, takes the tiled kernel, and put lengths at 1, a tile
minus one, a tile and a tile plus one (queries and keys), over no prefix and prefixes that cross
key tiles, in ragged batches, for GQA groups 1, 3, 4, 8, both dtypes and every instruction set this
CPU runs (``CpuFusedBackend.tiled_isa`` pins one). Problems, the reference check and the cache
check are ``test_cpu_fused``'s (noise in every slot; pages shuffled). A case that means the
tiled kernel asserts it ran: the eager extend's workspace was never allocated.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from attnplug import ForwardMode, ShapeError
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


@needs_kernel
@pytest.mark.parametrize("dtype", [F32, BF16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("dims", [(16, 16), (64, 64), (128, 128), (48, 80), (64, 32)], ids=lambda d: f"D{d[0]}_Dv{d[1]}")
def test_head_dims(dims, dtype):
    # long extends (> FUSED_MAX_QUERIES new tokens) take the tiled kernel by default
    s = make(dtype=dtype, head_dim=dims[0], v_head_dim=dims[1], seed=110 + dims[0])
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
@pytest.mark.parametrize("dtype", [F32, BF16], ids=DTYPE_IDS.get)
def test_layer_features_and_threads(dtype, layer_kind, threads):  # noqa: F811  # the fixture
    for page_size in (16, 1):
        s = make(dtype=dtype, head_dim=32, page_size=page_size, seed=120 + page_size,
                 layer_kw=TILED_LAYERS[layer_kind])
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
@pytest.mark.parametrize("dtype", [F32, BF16], ids=DTYPE_IDS.get)
def test_nan_in_a_later_new_token_reaches_only_the_queries_that_see_it(dtype, all_tiled):
    # causal masking selects: a NaN key/value at new token t never reaches queries before t (0 * NaN is
    # NaN), and does reach t and every later query of the request
    s = make(dtype=dtype, head_dim=32, seed=150)
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
    with pytest.raises(ValueError, match="tiled_isa=5 is not available on this CPU"):
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
