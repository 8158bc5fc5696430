"""cpu_fused: the fused C++ CPU kernel (``csrc/attention.cpp`` behind the op ``attnplug_cpu_fused::attend``)
against the float64 reference, against torch_native's eager paths, its declared envelope, the op
(schema, fake, ``torch.library.opcheck``, ``torch.compile(fullgraph=True)``), the ISA variants and
the one OpenMP runtime.

The kernel takes every DECODE request, and in the extend modes the requests with at most
``FUSED_MAX_QUERIES`` new tokens; a request's new tokens are cut into chunks of at most
``FUSED_QUERY_CHUNK`` queries (fewer when a chunk's scores would not fit ``FUSED_SCRATCH_BYTES``), so
the chunk tests shrink that constant (and lift the first) to put every boundary inside small
problems. Every case builds a paged cache on shuffled pages, fills every slot with noise (garbage
tests: NaN and infinities wherever no request reads), runs a forward and compares the output with
``reference_attention`` of the cache as it was before, and the cache after with
``expected_cache_after`` (bit for bit). A case that means the kernel asserts it ran: torch_native's
eager workspace was never allocated.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from typing import Any, Sequence

import pytest
import torch

from attnplug import (
    AttentionConfig,
    BuildContext,
    ForwardBatch,
    ForwardMode,
    HostInfo,
    LayerSpec,
    PageAllocator,
    PagedKVCache,
)
from attnplug.errors import BackendUnavailableError, ResourceLimitError
from attnplug.dtypes import dtype_name
from attnplug.testing.reference import reference_attention
from attnplug.registry import default_registry
from attnplug.testing.suite.harness import same_bytes
from attnplug.testing.tolerances import tolerance_for
from attnplug_cpu_fused import CAPABILITIES, probe
from attnplug_cpu_fused import backend as cf_backend
from attnplug_cpu_fused import kernel
from attnplug_cpu_fused.backend import FUSED_MAX_QUERIES, FUSED_QUERY_CHUNK, CpuFusedBackend, FusedMeta
from attnplug_torch_native.backend import TorchNativeBackend
from tests.forward_check import forward_and_check
from tests import paged_setup

HOST = HostInfo(platform="cpu")
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
DTYPE_IDS = {F32: "f32", BF16: "bf16", F16: "f16", E4M3: "e4m3", E5M2: "e5m2"}

#: the kernel is compiled at install for x86-64; on a host where the package is installed without it
#: every test here but the probe's is skipped with the reason
_OP, _WHY = kernel.load()
needs_kernel = pytest.mark.skipif(_OP is None, reason=f"cpu_fused: {_WHY}")


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request: Any) -> Any:
    """torch's thread count (the kernel's pool threads and its work split), restored afterwards."""
    old = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(old)


# ---------------------------------------------------------------------------
# problems
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class Setup:
    cache: PagedKVCache
    backend: CpuFusedBackend
    layer: LayerSpec
    dtype: torch.dtype
    gen: torch.Generator
    alloc: PageAllocator
    ctx: BuildContext


def make(
    *, dtype: torch.dtype = F32, kv_dtype: torch.dtype | None = None, kv_heads: int = 2, group: int = 4,
    head_dim: int = 16, v_head_dim: int | None = None, page_size: int = 16, layout: str = "nhd",
    scales: tuple[float, float] = (1.0, 1.0), layer_kw: dict[str, Any] | None = None,
    seed: int = 0, max_workspace_bytes: int = 4 << 30,
) -> Setup:
    gen = torch.Generator().manual_seed(seed)
    kv_dtype = kv_dtype or dtype
    v_head_dim = v_head_dim or head_dim
    heads = kv_heads * group
    num_pages = max(6, 384 // page_size)
    cache = PagedKVCache(1, num_pages, kv_heads, head_dim, v_head_dim=v_head_dim, page_size=page_size,
                         dtype=kv_dtype, max_requests=8, max_context_len=160, layout=layout)
    if cache.quantized:
        cache.set_kv_scales(0, *scales)
    slots = torch.arange(cache.num_slots)
    spread = 3.0 if cache.quantized else 1.0  # fp8 noise uses more of the format than |x| < 1
    noise_k = (torch.randn(cache.num_slots, kv_heads, head_dim, generator=gen) * spread).to(kv_dtype)
    noise_v = (torch.randn(cache.num_slots, kv_heads, v_head_dim, generator=gen) * spread).to(kv_dtype)
    cache.set_kv(0, slots, noise_k, noise_v, stored=True)  # noise everywhere: reading a wrong slot shows
    ctx = BuildContext(
        config=AttentionConfig(attention_backend="cpu_fused"), host=HOST, dtype=str(dtype),
        kv_cache_dtype=str(kv_dtype), num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        v_head_dim=v_head_dim, page_size=page_size, kv_cache=cache, max_batch_size=8, max_context_len=160,
        max_workspace_bytes=max_workspace_bytes,
    )
    backend = CpuFusedBackend(ctx)
    layer = LayerSpec(0, heads, kv_heads, head_dim, v_head_dim=v_head_dim, **(layer_kw or {}))
    return Setup(cache, backend, layer, dtype, gen, PageAllocator(num_pages, shuffle=True, seed=seed + 1), ctx)


def decode_batch(s: Setup, seq_lens: Sequence[int], *, req_ids: Sequence[int] | None = None,
                 encoder_lens: Sequence[int] | None = None, extra: int = 0) -> ForwardBatch:
    """A DECODE batch (``seq_lens`` count the new token) on scattered pages; ``extra`` positions past
    each request's length are mapped too (to slots the request must not read)."""
    req_ids = list(req_ids if req_ids is not None else [7 - i for i in range(len(seq_lens))])  # not 0..B-1
    ps = s.cache.page_size
    for i, (r, n) in enumerate(zip(req_ids, seq_lens)):
        mapped = max(n, encoder_lens[i] if encoder_lens is not None else 0) + extra
        s.cache.assign_pages(r, mapped, s.alloc.alloc(-(-mapped // ps)))
    loc = torch.stack([s.cache.req_to_token[r, n - 1] for r, n in zip(req_ids, seq_lens)])
    kw = {} if encoder_lens is None else {"encoder_lens": torch.tensor(list(encoder_lens))}
    return ForwardBatch.decode(req_ids, list(seq_lens), loc, **kw)


def extend_batch(s: Setup, mode: ForwardMode, prefix: Sequence[int], ext: Sequence[int], *,
                 req_ids: Sequence[int] | None = None, encoder_lens: Sequence[int] | None = None,
                 mask: torch.Tensor | None = None, extra: int = 0) -> ForwardBatch:
    """An extend-shaped batch (EXTEND, MIXED, TARGET_VERIFY, DRAFT_EXTEND...) on scattered pages;
    TARGET_VERIFY takes ``mask`` (``[batch, drafts, drafts]`` bool or ``None``: causal)."""
    req_ids = list(req_ids if req_ids is not None else [7 - i for i in range(len(prefix))])
    ps = s.cache.page_size
    for i, (r, p, e) in enumerate(zip(req_ids, prefix, ext)):
        mapped = max(p + e, encoder_lens[i] if encoder_lens is not None else 0) + extra
        s.cache.assign_pages(r, mapped, s.alloc.alloc(-(-mapped // ps)))
    parts = [s.cache.req_to_token[r, p:p + e] for r, p, e in zip(req_ids, prefix, ext)]
    loc = torch.cat(parts)
    kw: dict[str, Any] = {} if encoder_lens is None else {"encoder_lens": torch.tensor(list(encoder_lens))}
    if mode is ForwardMode.TARGET_VERIFY:
        kw.update(spec_num_draft_tokens=ext[0], spec_custom_mask=mask)
    return ForwardBatch.extend(req_ids, list(prefix), list(ext), loc, mode=mode, **kw)


def inputs(s: Setup, tokens: int, *, with_kv: bool = True, q_gain: float = 1.0) -> tuple[Any, Any, Any]:
    return paged_setup.qkv(s, s.layer, tokens, with_kv, q_gain)


def tolerance(s: Setup) -> Any:
    return tolerance_for(dtype_name(s.dtype), dtype_name(s.cache.dtype))


def run_and_check(s: Setup, batch: ForwardBatch, *, with_kv: bool = True, save: bool = True, q_gain: float = 1.0,
                  qkv: tuple[Any, Any, Any] | None = None) -> torch.Tensor:
    """One forward: the output against the float64 reference, the cache against a write at out_cache_loc only."""
    q, k, v = qkv or inputs(s, batch.num_tokens, with_kv=with_kv, q_gain=q_gain)
    return forward_and_check(s.backend, s.cache, s.layer, batch, q, k, v, dtype=s.dtype, save=save)


def assert_fused_ran(s: Setup) -> None:
    """torch_native's eager decode / extend never allocated their workspace: the kernel did the work."""
    assert s.backend.workspace.grows == 0 and s.backend.workspace.nbytes() == 0, "the eager decode ran"


# lengths count the new token: 1 (only the new token), not multiples of 16, one above 3 * 16
LENS = [1, 17, 53, 30]


# ---------------------------------------------------------------------------
# against the float64 reference
# ---------------------------------------------------------------------------

DIMS = [(16, 16), (48, 48), (64, 64), (128, 128), (256, 256), (64, 32), (32, 128), (48, 80)]


@needs_kernel
@pytest.mark.parametrize("dims", DIMS, ids=lambda d: f"D{d[0]}_Dv{d[1]}")
@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=DTYPE_IDS.get)
def test_head_dims_and_dtypes(dtype, dims):
    # D 64 and 128 take the kernel's unrolled score loops, the others its generic loop; Dv 32, 48
    # and 80 leave value tiles narrower than four vectors
    D, Dv = dims
    s = make(dtype=dtype, head_dim=D, v_head_dim=Dv, seed=D + Dv)
    run_and_check(s, decode_batch(s, LENS))
    assert_fused_ran(s)


@needs_kernel
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("group,dtype", [(1, F32), (3, BF16), (4, F32), (8, BF16)], ids=["g1_f32", "g3_bf16",
                                                                                        "g4_f32", "g8_bf16"])
def test_gqa_groups_page_sizes_and_threads(group, dtype, page_size, threads):
    # groups 1 and 3 are not multiples of the kernel's 4-row value tiles (remainder rows); one and
    # two requests on 4 KV heads make the kernel split each request's heads over work items
    s = make(dtype=dtype, kv_heads=4, group=group, head_dim=32, page_size=page_size, seed=group)
    run_and_check(s, decode_batch(s, [49, 5], req_ids=[6, 1]))
    run_and_check(s, decode_batch(s, [64], req_ids=[3]))
    assert_fused_ran(s)


@needs_kernel
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_the_kernel_runs_its_work_items_on_torchs_thread_pool(dtype, threads):
    # the op reports in its work header (WORK_THREADS) how many distinct threads ran the call's work items: with
    # torch at 2 threads and 4 requests (4 items) both pool threads work, at 1 thread one does. A call that never
    # hands its items to the pool (a lost `parallel` pointer: 73c0b1c..a fix, decode ran on one thread whatever
    # torch's count) reports 1, and this fails.
    s = make(dtype=dtype, kv_heads=2, group=4, head_dim=32, seed=31)
    batch = decode_batch(s, [40, 33, 29, 51])
    run_and_check(s, batch)
    assert_fused_ran(s)
    (fw,) = s.backend.forward_metadata(batch).work.values()
    assert int(fw.work[0, kernel.WORK_THREADS]) == threads
    assert int(fw.work[0, kernel.WORK_ERR]) == 0


@needs_kernel
@pytest.mark.parametrize("group,new", [(4, 1), (2, 2), (1, 4), (2, 3)], ids=["g4_decode", "g2_two_new", "g1_four_new",
                                                                           "g2_three_new"])
@pytest.mark.parametrize("head_dim", [32, 128])
def test_bf16_four_query_rows_a_head_share_one_pass_over_k(group, new, head_dim):
    # bf16 without AMX scores a head's rows in one pass over the block's K rows where the head has exactly 4 rows
    # (scores_bf16_x4: a decode step of G = 4, or 2 queries of G = 2, 4 of G = 1); 3 queries of G = 2 (6 rows)
    # take the per-row form. Against the float64 reference with a window and a soft-cap (masked lanes, capped
    # scores), on the path a CPU with AMX takes too when AMX is refused.
    s = make(dtype=BF16, kv_heads=2, group=group, head_dim=head_dim, seed=group * 7 + new,
             layer_kw=dict(scaling=1.0, sliding_window=21, logit_cap=4.0))
    if new == 1:
        batch = decode_batch(s, [53, 17, 30])
    else:
        batch = extend_batch(s, ForwardMode.EXTEND, [48, 0, 19], [new, new, new])
    out = run_and_check(s, batch, q_gain=4.0 / head_dim ** 0.5)
    assert_fused_ran(s)
    assert bool(torch.isfinite(out).all())


@needs_kernel
@pytest.mark.parametrize("kv_heads,group,nthreads", [(5, 3, 1), (3, 5, 2), (7, 1, 2)],
                         ids=["items_2_2_1", "items_1_1_1_group5", "items_of_1"])
def test_kv_heads_not_dividing_into_work_items(kv_heads, group, nthreads):
    # one request: 5 KV heads on 1 thread go in items of 2, 2 and 1 heads (the last one short); a
    # group of 5 is one 4-row value tile and a remainder row
    old = torch.get_num_threads()
    torch.set_num_threads(nthreads)
    try:
        s = make(dtype=BF16, kv_heads=kv_heads, group=group, head_dim=16, seed=kv_heads,
                 layer_kw=dict(sinks=torch.linspace(-1.0, 2.0, kv_heads * group)))
        run_and_check(s, decode_batch(s, [41]))
        assert_fused_ran(s)
    finally:
        torch.set_num_threads(old)


FEATURES: dict[str, dict[str, Any]] = {
    "window0": dict(sliding_window=0),  # only the new token
    "window5": dict(sliding_window=5),  # smaller than every length but the first
    "window40": dict(sliding_window=40),  # cuts only the longest request
    "sinks": dict(sinks=torch.linspace(-2.0, 3.0, 8)),
    "softcap": dict(scaling=1.0, logit_cap=5.0),  # with q x 4: scores of tens, the cap bites hard
    "all": dict(scaling=1.0, sliding_window=7, logit_cap=4.0, sinks=torch.linspace(3.0, -1.0, 8)),
}


@needs_kernel
@pytest.mark.parametrize("feature", sorted(FEATURES))
@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=DTYPE_IDS.get)
def test_layer_features(dtype, feature):
    s = make(dtype=dtype, head_dim=32, seed=11, layer_kw=FEATURES[feature])
    gain = 4.0 if "logit_cap" in FEATURES[feature] else 1.0
    out = run_and_check(s, decode_batch(s, LENS), q_gain=gain)
    assert_fused_ran(s)
    assert bool(torch.isfinite(out).all())


@needs_kernel
@pytest.mark.parametrize("layer_kw", [{}, dict(sinks=torch.linspace(1.0, 4.0, 8), sliding_window=2)],
                         ids=["plain", "sinks_and_window"])
@pytest.mark.parametrize("with_kv", [False, True], ids=["kv_none", "kv_given"])
@pytest.mark.parametrize("dtype", [F32, BF16], ids=DTYPE_IDS.get)
def test_cross_attention_with_an_empty_encoder(dtype, with_kv, layer_kw):
    # cross-attention reads the encoder's keys only (no new token, no window) and writes nothing;
    # the request without encoder tokens gets zeros, sinks or not
    s = make(dtype=dtype, head_dim=48, seed=12, layer_kw=dict(is_cross_attention=True, **layer_kw))
    batch = decode_batch(s, [5, 3, 30, 2], encoder_lens=[13, 0, 55, 1])
    out = run_and_check(s, batch, with_kv=with_kv)
    assert torch.count_nonzero(out[1]) == 0 and torch.count_nonzero(out[0]) > 0
    assert_fused_ran(s)


@needs_kernel
@pytest.mark.parametrize("layer_kw", [{}, dict(sliding_window=9, logit_cap=30.0, sinks=torch.linspace(-1, 1, 8))],
                         ids=["plain", "window_cap_sinks"])
@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=DTYPE_IDS.get)
def test_fp8_cache_with_scales(fmt, dtype, layer_kw):
    # stored values times non-unit scales (the reference reads stored * scale, and the new token as
    # the cache stores it); head dims 64 and 48 take both score loops
    D = 64 if layer_kw else 48
    s = make(dtype=dtype, kv_dtype=fmt, head_dim=D, scales=(0.375, 1.75), seed=13, layer_kw=layer_kw)
    run_and_check(s, decode_batch(s, LENS))
    run_and_check(s, decode_batch(s, [9, 2], req_ids=[0, 1]), save=False)
    assert_fused_ran(s)


@needs_kernel
def test_strided_q_k_v_from_one_projection():
    # engines split q, k, v out of one projection: views whose head and token strides are not
    # the packed ones
    s = make(dtype=BF16, kv_heads=2, group=3, head_dim=32, seed=14)
    batch = decode_batch(s, LENS)
    L = s.layer
    T, qw, kw = batch.num_tokens, L.num_heads * 32, L.num_kv_heads * 32
    qkv = torch.randn(T, qw + 2 * kw + 16, generator=s.gen).to(BF16)  # 16 spare columns: padded rows
    q = qkv[:, :qw].view(T, L.num_heads, 32)
    k = qkv[:, qw:qw + kw].view(T, L.num_kv_heads, 32)
    v = qkv[:, qw + kw:qw + 2 * kw].view(T, L.num_kv_heads, 32)
    assert not q.is_contiguous() and not k.is_contiguous()
    run_and_check(s, batch, qkv=(q, k, v))
    assert_fused_ran(s)


# ---------------------------------------------------------------------------
# extend modes: requests of at most FUSED_MAX_QUERIES new tokens through the kernel, in chunks
# ---------------------------------------------------------------------------

VERIFY_LAYERS: dict[str, dict[str, Any]] = {
    "plain": {},
    "window0": dict(sliding_window=0),  # each draft sees itself only
    "window2": dict(sliding_window=2),  # shorter than the drafts: hides earlier drafts from later ones
    "window5_sinks": dict(sliding_window=5, sinks=torch.linspace(-1.0, 2.0, 8)),
    "softcap": dict(scaling=1.0, logit_cap=4.0),
}


@needs_kernel
@pytest.mark.parametrize("drafts", [1, 3, FUSED_MAX_QUERIES])
@pytest.mark.parametrize("layer_kind", sorted(VERIFY_LAYERS))
@pytest.mark.parametrize("dtype", [F32, BF16], ids=DTYPE_IDS.get)
def test_target_verify_drafts_with_a_tree_mask(dtype, layer_kind, drafts):
    s = make(dtype=dtype, head_dim=32, seed=drafts, layer_kw=VERIFY_LAYERS[layer_kind])
    # a tree: every draft sees itself, others at random; request 0 has no prefix and its last draft
    # sees no draft at all (with no prefix nor itself: a zero row)
    mask = (torch.rand(3, drafts, drafts, generator=s.gen) > 0.5) | torch.eye(drafts, dtype=torch.bool)
    mask[0, drafts - 1, :] = False
    batch = extend_batch(s, ForwardMode.TARGET_VERIFY, [0, 20, 45], [drafts] * 3, mask=mask)
    out = run_and_check(s, batch, q_gain=4.0 if layer_kind == "softcap" else 1.0)
    assert torch.count_nonzero(out[drafts - 1]) == 0
    assert_fused_ran(s)


@needs_kernel
@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.DRAFT_EXTEND,
                                  ForwardMode.DRAFT_EXTEND_V2], ids=lambda m: m.name)
@pytest.mark.parametrize("dtype,kv_dtype", [(F32, F32), (F16, F16), (BF16, E4M3)], ids=["f32", "f16", "bf16_e4m3"])
def test_extend_modes(dtype, kv_dtype, mode):
    # causal among the new tokens, a window shorter than the step, a request extending by 0
    s = make(dtype=dtype, kv_dtype=kv_dtype, head_dim=48, seed=61, scales=(0.5, 1.25),
             layer_kw=dict(sliding_window=3, sinks=torch.linspace(0.0, 2.0, 8)))
    run_and_check(s, extend_batch(s, mode, [0, 17, 50, 4], [FUSED_MAX_QUERIES, 2, 5, 0]))
    assert_fused_ran(s)


@needs_kernel
@pytest.mark.parametrize("dtype", [F32, BF16], ids=DTYPE_IDS.get)
def test_mixed_batch_splits_requests_between_the_kernel_and_the_eager_extend(dtype):
    # FUSED_MAX_QUERIES new tokens go through the kernel, one more through the eager extend (the tiled
    # kernel off: test_torch_native_tiled.py has it); both in one forward, each writing its own rows
    s = make(dtype=dtype, head_dim=32, seed=62, layer_kw=dict(sinks=torch.linspace(-1.0, 1.0, 8)))
    s.backend.tiled = False
    run_and_check(s, extend_batch(s, ForwardMode.MIXED, [9], [FUSED_MAX_QUERIES], req_ids=[0]))
    assert_fused_ran(s)
    run_and_check(s, extend_batch(s, ForwardMode.MIXED, [0, 33, 5, 12], [1, FUSED_MAX_QUERIES + 1, 1, 20],
                                  req_ids=[1, 2, 3, 4]))
    assert s.backend.workspace.grows > 0  # the two long requests went through the eager extend


CHUNK_LAYERS: dict[str, dict[str, Any]] = {
    "plain": {},
    "window1": dict(sliding_window=1),  # the window ends inside a chunk: no cached key for most queries
    "window6": dict(sliding_window=6),  # longer than a chunk, shorter than the step
    "window30_sinks": dict(sliding_window=30, sinks=torch.linspace(-1.0, 2.0, 8)),  # reaches into the prefix
    "softcap": dict(scaling=1.0, logit_cap=3.0),
}


@needs_kernel
@pytest.mark.parametrize("layer_kind", sorted(CHUNK_LAYERS))
@pytest.mark.parametrize("dtype", [F32, BF16], ids=DTYPE_IDS.get)
def test_extend_queries_cut_into_chunks(dtype, layer_kind, threads, monkeypatch):
    # every request through the kernel, in chunks of 4 queries: steps of 1, 4 (one whole chunk), 5 and 9 (a chunk plus one), 13, 23,
    # over no prefix, short and long prefixes, on page size 16 and 1 (every key on its own page)
    monkeypatch.setattr(cf_backend, "FUSED_MAX_QUERIES", 1000)
    monkeypatch.setattr(cf_backend, "FUSED_QUERY_CHUNK", 4)
    for page_size in (16, 1):
        s = make(dtype=dtype, head_dim=32, page_size=page_size, seed=64 + page_size,
                 layer_kw=CHUNK_LAYERS[layer_kind])
        batch = extend_batch(s, ForwardMode.MIXED, [0, 37, 3, 0, 90, 11], [1, 4, 5, 9, 13, 23])
        run_and_check(s, batch, q_gain=4.0 if layer_kind == "softcap" else 1.0)
        assert_fused_ran(s)


@needs_kernel
@pytest.mark.parametrize("chunk", [1, 2, 3, 8])
def test_target_verify_mask_rows_follow_their_chunk(chunk, monkeypatch):
    # each chunk reads the mask rows of its own queries: chunks of 1, 2, 3 and 8 over 7 drafts
    monkeypatch.setattr(cf_backend, "FUSED_QUERY_CHUNK", chunk)
    drafts = 7
    s = make(dtype=F32, head_dim=32, seed=70 + chunk, layer_kw=dict(sliding_window=4))
    mask = (torch.rand(3, drafts, drafts, generator=s.gen) > 0.5) | torch.eye(drafts, dtype=torch.bool)
    mask[1, 5, :] = False  # a row hiding every draft, itself included, over a prefix: the prefix only
    run_and_check(s, extend_batch(s, ForwardMode.TARGET_VERIFY, [0, 20, 45], [drafts] * 3, mask=mask))
    assert_fused_ran(s)


@needs_kernel
@pytest.mark.parametrize("dtype", [F32, BF16], ids=DTYPE_IDS.get)
def test_a_prefill_longer_than_the_default_chunk(dtype, monkeypatch):
    # the default chunk, every request through the kernel: 130 new tokens (the last chunk of 2
    # queries) with and without a prefix, and a window reaching back across chunk boundaries
    monkeypatch.setattr(cf_backend, "FUSED_MAX_QUERIES", 1000)
    assert 130 % FUSED_QUERY_CHUNK == 2
    s = make(dtype=dtype, head_dim=32, seed=75, layer_kw=dict(sliding_window=70))
    run_and_check(s, extend_batch(s, ForwardMode.EXTEND, [0, 25], [130, 2 * FUSED_QUERY_CHUNK + 1]))
    assert_fused_ran(s)


@needs_kernel
def test_chunks_shrink_to_fit_the_scratch_aim(monkeypatch):
    # with a scratch aim a whole chunk cannot meet, the kernel takes shorter chunks (its plans name
    # each chunk length it tried) and still answers right; no eager workspace
    monkeypatch.setattr(cf_backend, "FUSED_SCRATCH_BYTES", 16 << 10)
    s = make(dtype=F32, head_dim=32, seed=76)
    batch = extend_batch(s, ForwardMode.EXTEND, [134, 0], [FUSED_QUERY_CHUNK, 5])
    s.backend.init_forward_metadata(batch)
    q, k, v = inputs(s, batch.num_tokens)
    s.backend.forward(q, k, v, s.layer, batch)
    meta = s.backend.forward_metadata(batch)
    assert isinstance(meta, FusedMeta)
    tried = sorted(key[2] for key in meta._plan)
    assert tried[-1] == FUSED_QUERY_CHUNK and tried[0] < FUSED_QUERY_CHUNK
    keys = 134 + FUSED_QUERY_CHUNK
    assert kernel.scratch_bytes(torch.get_num_threads(), 1, tried[0], s.layer.gqa_group_size, keys, 32, 32) <= 16 << 10
    run_and_check(s, extend_batch(s, ForwardMode.EXTEND, [130, 0], [FUSED_QUERY_CHUNK, 9], req_ids=[1, 2]))
    assert_fused_ran(s)


@needs_kernel
@pytest.mark.parametrize("dtype", [F32, BF16], ids=DTYPE_IDS.get)
def test_the_scratch_counted_against_the_workspace_includes_the_amx_buffer_where_it_may_run(monkeypatch, dtype):
    # a bf16 layer on an AMX process also fills the kernel's AMX buffer (VNNI queries, P's parts, V pairs):
    # the scratch counted against max_workspace_bytes includes it there, and only there
    seen: list[bool] = []
    real = kernel.scratch_bytes

    def spy(*args: Any) -> int:
        seen.append(bool(args[7]) if len(args) > 7 else False)
        return real(*args)

    monkeypatch.setattr(kernel, "scratch_bytes", spy)
    s = make(dtype=dtype, head_dim=64, seed=78)
    run_and_check(s, decode_batch(s, [40, 7]))
    on_amx = s.backend.tiled_body == "amx" and s.backend.isa == "avx512bf16"
    assert seen and set(seen) == {dtype == BF16 and on_amx}
    assert real(1, 2, 1, 4, 100, 64, 64, True) > real(1, 2, 1, 4, 100, 64, 64)
    # the extra is the C++ buffer's size (attention.cpp, tl_amx): heads*D*8 + KB*D/2 + KB*16 floats, plus
    # P's two bf16 parts over the keys rounded to 32 and one block's V pairs where dv is a multiple of 32
    assert real(1, 2, 1, 4, 100, 64, 64, True) - real(1, 2, 1, 4, 100, 64, 64) == 4 * (
        2 * 64 * 8 + 16 * 64 // 2 + 256 + 8 * 128 + 16 * 64)
    assert real(1, 2, 1, 4, 100, 64, 48, True) - real(1, 2, 1, 4, 100, 64, 48) == 4 * (2 * 64 * 8 + 16 * 64 // 2 + 256)


@needs_kernel
def test_scratch_over_the_workspace_limit_is_refused(threads):
    # the kernel's scratch counts against max_workspace_bytes: one query per chunk over the limit
    # hands the layer to the eager extend, which needs more and refuses with the limit named
    s = make(dtype=F32, head_dim=32, seed=77, max_workspace_bytes=4 << 10)
    assert kernel.scratch_bytes(threads, 1, 1, s.layer.gqa_group_size, 110, 32, 32) > 4 << 10
    with pytest.raises(ResourceLimitError, match=r"workspace limit of 4\.00 KiB"):
        run_and_check(s, extend_batch(s, ForwardMode.EXTEND, [100], [10]))


@needs_kernel
@pytest.mark.parametrize("dtype", [F32, BF16], ids=DTYPE_IDS.get)
def test_cross_attention_extend_with_an_empty_encoder(dtype):
    s = make(dtype=dtype, head_dim=32, seed=63, layer_kw=dict(is_cross_attention=True))
    batch = extend_batch(s, ForwardMode.EXTEND, [0, 2, 7], [3, 1, 6], encoder_lens=[20, 0, 9])
    out = run_and_check(s, batch, with_kv=False)
    assert torch.count_nonzero(out[3]) == 0 and torch.count_nonzero(out[:3]) > 0
    assert_fused_ran(s)


# ---------------------------------------------------------------------------
# garbage where no request reads never reaches an output
# ---------------------------------------------------------------------------

GARBAGE_LAYERS: dict[str, dict[str, Any]] = {
    "plain": {},
    "window3": dict(sliding_window=3),
    "sinks": dict(sinks=torch.linspace(-1.0, 2.0, 8)),
    "softcap": dict(logit_cap=1.5, scaling=1.0),
    "cross": dict(is_cross_attention=True),
}


@needs_kernel
@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.MIXED],
                         ids=lambda m: m.name)
@pytest.mark.parametrize("layer_kind", sorted(GARBAGE_LAYERS))
@pytest.mark.parametrize("dtype,kv_dtype,page_size", [(F32, F32, 1), (BF16, BF16, 16), (F16, E4M3, 1),
                                                      (BF16, E5M2, 16)],
                         ids=["f32_page1", "bf16_page16", "f16_e4m3_page1", "bf16_e5m2_page16"])
def test_garbage_never_reaches_an_output(dtype, kv_dtype, page_size, layer_kind, mode):
    s = make(dtype=dtype, kv_dtype=kv_dtype, page_size=page_size, head_dim=32, seed=21, scales=(0.5, 2.0),
             layer_kw=GARBAGE_LAYERS[layer_kind])
    s.alloc._free.remove(0)  # page 0 (slot 0, where a padded read would land) goes to no request
    cross = layer_kind == "cross"
    enc = [11, 0, 3, 8] if cross else None
    # every request maps 20 positions past its length (to garbage slots); positions beyond those stay
    # unassigned (-1); cross-attention requests read encoder tokens 0 .. enc-1 only
    prefix = [10, 0, 29, 7]
    if mode is ForwardMode.DECODE:
        batch = decode_batch(s, [p + 1 for p in prefix], encoder_lens=enc, extra=20)
    else:
        mask = torch.tensor([[1, 0, 0], [1, 1, 0], [0, 1, 1]], dtype=torch.bool).expand(4, 3, 3).contiguous()
        ext = [3] * 4 if mode is ForwardMode.TARGET_VERIFY else [1, 4, 0, 2]
        batch = extend_batch(s, mode, prefix, ext, encoder_lens=enc, mask=mask, extra=20)
    reads = enc or prefix  # the cached positions each request reads
    owned = torch.cat([s.cache.req_to_token[r, :m] for r, m in zip(batch.req_pool_indices.tolist(), reads)])
    bad = torch.ones(s.cache.num_slots, dtype=torch.bool)
    bad[owned] = False
    assert bool(bad[0]), "slot 0 (where padding would read) must hold garbage"
    if not cross:  # the new tokens' slots hold garbage too: their k/v come from the arguments
        assert bool(bad[batch.out_cache_loc].all())
    idx = bad.nonzero().squeeze(1)
    vals = torch.tensor([float("nan"), float("inf"), float("-inf")])[torch.arange(idx.numel()) % 3]
    k_bad = vals[:, None, None].expand(-1, s.cache.num_kv_heads, s.cache.head_dim).to(kv_dtype)
    v_bad = vals[:, None, None].expand(-1, s.cache.num_kv_heads, s.cache.v_head_dim).to(kv_dtype)
    s.cache.set_kv(0, idx, k_bad, v_bad, stored=True)
    out = run_and_check(s, batch, with_kv=not cross)
    assert bool(torch.isfinite(out).all())
    assert_fused_ran(s)


# ---------------------------------------------------------------------------
# fused against eager; repeated forwards
# ---------------------------------------------------------------------------


@needs_kernel
@pytest.mark.parametrize("dtype,kv_dtype", [(F32, F32), (BF16, BF16), (F16, F16), (BF16, E4M3)],
                         ids=["f32", "bf16", "f16", "bf16_e4m3"])
@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.TARGET_VERIFY], ids=lambda m: m.name)
def test_fused_matches_eager_and_repeats_bit_for_bit(dtype, kv_dtype, threads, mode):
    s = make(dtype=dtype, kv_dtype=kv_dtype, kv_heads=2, group=3, head_dim=64, seed=31, scales=(0.25, 1.5),
             layer_kw=dict(sliding_window=40, sinks=torch.linspace(-1.0, 1.0, 6)))
    eager = TorchNativeBackend(s.ctx)
    if mode is ForwardMode.DECODE:
        batch = decode_batch(s, LENS)
    else:
        mask = (torch.rand(4, 5, 5, generator=s.gen) > 0.5) | torch.eye(5, dtype=torch.bool)
        batch = extend_batch(s, mode, [0, 16, 52, 29], [5] * 4, mask=mask)
    q, k, v = inputs(s, batch.num_tokens)
    outs = []
    for _ in range(3):
        s.backend.init_forward_metadata(batch)
        outs.append(s.backend.forward(q, k, v, s.layer, batch, save_kv_cache=False))
    assert all(same_bytes(outs[0], o) for o in outs[1:]), "repeated fused forwards differ"
    assert_fused_ran(s)
    eager.init_forward_metadata(batch)
    ref = eager.forward(q, k, v, s.layer, batch, save_kv_cache=False)
    assert eager.workspace.grows > 0
    tol = tolerance(s)
    torch.testing.assert_close(outs[0].double(), ref.double(), atol=tol.atol, rtol=tol.rtol)


# ---------------------------------------------------------------------------
# the declared envelope: what the kernel does not take is refused before a forward, with the reason
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind,reason", [
    ("hnd_layout", "kv_layout=hnd (reads: nhd)"),
    ("head_dim_40", "head_dim=40 is not a multiple of 16 (head_dim_multiple_of)"),
    ("v_head_dim_24", "v_head_dim=24 is not a multiple of 16 (head_dim_multiple_of)"),
    ("bf16_model_f32_cache", "a non-fp8 KV cache must be in the model dtype (kv_cache_dtype_follows_model)"),
    ("cuda_device", "device=cuda (supported: cpu)"),
])
def test_layers_outside_the_envelope_are_refused_by_the_registry_with_the_reason(kind, reason):
    kw: dict[str, Any] = dict(layout="nhd", head_dim=32, v_head_dim=32, dtype="bfloat16", kv="bfloat16", device=None)
    layer_kw: dict[str, Any] = {}
    if kind == "hnd_layout":
        kw["layout"] = "hnd"
    elif kind == "head_dim_40":
        kw.update(head_dim=40, v_head_dim=40)
    elif kind == "v_head_dim_24":
        kw["v_head_dim"] = 24
    elif kind == "bf16_model_f32_cache":
        kw["kv"] = "float32"
    else:
        kw["device"] = "cuda"
    from attnplug.capabilities import support_reasons

    layer = LayerSpec(0, 8, 2, kw["head_dim"], v_head_dim=kw["v_head_dim"], **layer_kw)
    reasons = support_reasons(CAPABILITIES, layer, dtype=kw["dtype"], kv_cache_dtype=kw["kv"],
                              kv_layout=kw["layout"], device=kw["device"])
    assert any(reason in r for r in reasons), reasons


@pytest.mark.parametrize("dims,expected", [((16, 16), []), ((48, 80), []), ((24, 16), ["head_dim=24"]),
                                           ((32, 8), ["v_head_dim=8"]), ((40, 24), ["head_dim=40", "v_head_dim=24"])])
def test_head_dim_multiple_of_names_each_dim_that_breaks_it(dims, expected):
    from attnplug.capabilities import layer_reasons

    reasons = layer_reasons(CAPABILITIES, LayerSpec(0, 4, 2, dims[0], v_head_dim=dims[1]))
    assert [r.split(" ")[0] for r in reasons] == expected, reasons


@pytest.mark.parametrize("value", [0, -16, 16.0, True, "16"])
def test_head_dim_multiple_of_of_the_wrong_type_is_a_descriptor_problem(value):
    from attnplug.capabilities import Capabilities
    from attnplug.descriptor import capabilities_problems

    problems = capabilities_problems(Capabilities(head_dim_multiple_of=value))
    assert problems == [f"field 'capabilities.head_dim_multiple_of': expected None (no rule) or a positive int, "
                        f"got {value!r} ({type(value).__name__})"], problems


# ---------------------------------------------------------------------------
# workspace limit
# ---------------------------------------------------------------------------


@needs_kernel
def test_workspace_limit_below_the_kernel_scratch_falls_back_to_an_eager_decode_that_fits():
    # first tokens only (1 key each) with wide heads: the kernel's scratch (16 padded scores, a
    # 16-row block) is far above the eager decode's ([1 key, D + Dv] per block), which computes
    limit = 8192
    assert kernel.scratch_bytes(1, 1, 1, 8, 1, 256, 256) > limit
    s = make(dtype=F32, kv_heads=1, group=8, head_dim=256, seed=51, max_workspace_bytes=limit)
    s.backend.decode_block_bytes = 1  # one KV head of one request per eager block
    run_and_check(s, decode_batch(s, [1, 1]))
    # the layer fits the kernel: the workspace limit alone made it decline, and the eager decode ran
    assert s.backend.workspace.grows > 0


@needs_kernel
def test_workspace_limit_below_both_paths_is_refused_naming_the_limit():
    s = make(dtype=F32, seed=52, max_workspace_bytes=2048)
    assert kernel.scratch_bytes(1, 1, 1, 4, 53, 16, 16) > 2048
    batch = decode_batch(s, LENS)
    q, k, v = inputs(s, batch.num_tokens)
    before = s.cache.read_kv(0)
    s.backend.init_forward_metadata(batch)
    with pytest.raises(ResourceLimitError, match="BuildContext.max_workspace_bytes"):
        s.backend.forward(q, k, v, s.layer, batch)
    assert all(same_bytes(a, b) for a, b in zip(before, s.cache.read_kv(0))), "a refused forward wrote"


@needs_kernel
def test_workspace_limit_between_one_head_and_all_heads_runs_fused_with_fewer_heads_per_item():
    # four requests on one thread: all KV heads per item would need more scratch than the limit,
    # one head per item fits, so the kernel still runs (items of fewer heads)
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        probe_backend = make(dtype=BF16, head_dim=32, seed=53).backend  # does this process run bf16 on AMX?
        amx = probe_backend.tiled_body == "amx" and probe_backend.isa == "avx512bf16"
        lo, hi = (kernel.scratch_bytes(1, 1, 1, 2, 53, 32, 32, amx), kernel.scratch_bytes(1, 4, 1, 2, 53, 32, 32, amx))
        s = make(dtype=BF16, kv_heads=4, group=2, head_dim=32, seed=53, max_workspace_bytes=(lo + hi) // 2)
        run_and_check(s, decode_batch(s, LENS))
        assert_fused_ran(s)
    finally:
        torch.set_num_threads(old)


@needs_kernel
def test_workspace_limit_in_an_extend_mode_shortens_the_chunks(threads):
    # target-verify with 8 drafts: one chunk of 8 queries needs more scratch than the limit, one of
    # 2 does not, so the kernel runs in shorter chunks (the eager extend never allocates)
    s = make(dtype=F32, kv_heads=1, group=2, head_dim=16, seed=54, max_workspace_bytes=4096)
    assert kernel.scratch_bytes(threads, 1, 8, 2, 8 + 3, 16, 16) > 4096
    assert kernel.scratch_bytes(threads, 1, 2, 2, 8 + 3, 16, 16) <= 4096
    run_and_check(s, extend_batch(s, ForwardMode.TARGET_VERIFY, [3, 1], [8, 8], mask=None))
    assert_fused_ran(s)


# ---------------------------------------------------------------------------
# availability: the probe and the loader say "no compiled kernel for this CPU / platform"
# ---------------------------------------------------------------------------


def test_descriptor_discovered_alone_imports_no_torch_and_registers_only_cpu_fused():
    """The descriptor narrows torch_native's envelope (importing torch_native's light descriptor module);
    discovered alone, it registers cpu_fused only and loads no torch."""
    code = textwrap.dedent("""
        import json, sys
        from attnplug.registry import Registry
        reg = Registry.discover(env={"ATTNPLUG_PLUGINS": "attnplug-cpu-fused"})
        reg.availability("cpu_fused")
        print(json.dumps([reg.names(), sorted(m for m in sys.modules if m.split(".")[0] == "torch")]))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    names, torch_modules = json.loads(proc.stdout)
    assert names == ["cpu_fused"] and torch_modules == []


def test_probe_on_this_host_finds_the_compiled_kernel():
    assert probe(HostInfo(platform="cpu")) == ([] if _OP is not None else probe(HostInfo(platform="cpu")))
    if _OP is not None:
        assert kernel.library_path() is not None


@pytest.mark.parametrize("case,expected", [
    ("gpu_host", "serves CPU hosts (the fused C++ CPU kernel); this host is cuda"),
    ("aarch64", "no compiled kernel for this CPU / platform: the kernel is built for x86-64 only (this machine: aarch64)"),
    ("not_built", "no compiled kernel for this CPU / platform: attnplug_cpu_fused/_C*.so is missing"),
])
def test_probe_reasons(case, expected, monkeypatch):
    import attnplug_cpu_fused as desc

    host = HostInfo(platform="cuda" if case == "gpu_host" else "cpu")
    if case == "aarch64":
        monkeypatch.setattr(desc.platform, "machine", lambda: "aarch64")
    if case == "not_built":
        monkeypatch.setattr(desc, "_library_built", lambda: False)
    reasons = probe(host)
    assert any(r.startswith(expected) for r in reasons), reasons


@pytest.mark.parametrize("case", ["missing", "does_not_load"])
def test_loader_without_a_library_is_a_reason_and_the_backend_is_unavailable(case, monkeypatch, tmp_path):

    if case == "missing":
        monkeypatch.setattr(kernel, "library_path", lambda: None)
        expected = "no compiled kernel for this platform: attnplug_cpu_fused/_C*.so is missing"
    else:
        bad = tmp_path / "_C.cpython-311-x86_64-linux-gnu.so"
        bad.write_bytes(b"not a library")
        monkeypatch.setattr(kernel, "library_path", lambda: str(bad))
        expected = "no compiled kernel for this CPU / platform: _C.cpython-311-x86_64-linux-gnu.so does not load"
    kernel.load.cache_clear()
    try:
        op, why = kernel.load()
        assert op is None and why is not None and why.startswith(expected), why
        with pytest.raises(BackendUnavailableError, match="cpu_fused"):
            make()
    finally:
        monkeypatch.undo()
        kernel.load.cache_clear()
        assert kernel.load()[0] is not None


@needs_kernel
def test_registry_ranks_cpu_fused_above_torch_native_and_vllm_cpu_on_cpu():
    reg = default_registry()
    host = HostInfo(platform="cpu", cpu_flags=frozenset({"avx512f", "avx512_bf16", "amx_tile"}))
    prio = {name: reg.priority(name, host) for name in ("cpu_fused", "torch_native")}
    assert prio["cpu_fused"] > prio["torch_native"]
    if "vllm_cpu" in reg.names():
        assert prio["cpu_fused"] > reg.priority("vllm_cpu", host)


# ---------------------------------------------------------------------------
# the op: schema, fake, opcheck, torch.compile
# ---------------------------------------------------------------------------


def op_setup(dtype: torch.dtype = F32, mode: ForwardMode = ForwardMode.DECODE,
             **layer_kw: Any) -> tuple[Setup, Any, Any, Any, Any, Any]:
    """One forward ready for a direct op call (the opcheck / compile tests of ``attend`` and ``attend_write``):
    the setup, the batch (decode over ``LENS``, or a 2-request extend with a verify mask), q, k, v and the
    forward's metadata."""
    s = make(dtype=dtype, head_dim=32, seed=90, layer_kw=layer_kw)
    if mode is ForwardMode.DECODE:
        batch = decode_batch(s, LENS)
    else:
        mask = (torch.rand(2, 3, 3, generator=s.gen) > 0.5) | torch.eye(3, dtype=torch.bool)
        batch = extend_batch(s, mode, [4, 20], [3, 3], mask=mask)
    s.backend.init_forward_metadata(batch)
    q, k, v = inputs(s, batch.num_tokens)
    return s, batch, q, k, v, s.backend.forward_metadata(batch)


def _op_args(dtype: torch.dtype = F32, mode: ForwardMode = ForwardMode.DECODE, **layer_kw: Any) -> tuple[Any, ...]:
    s, batch, q, k, v, meta = op_setup(dtype, mode, **layer_kw)
    fl = s.backend.layer_plan(s.layer).kernel
    fw = s.backend._work(q, s.layer, meta, fl)
    assert isinstance(fw, cf_backend.FusedForward)
    out = torch.zeros(batch.num_tokens, s.layer.num_heads, s.layer.v_head_dim, dtype=dtype)
    return s.backend._args(q, k, v, s.layer, fl, fw, out)


@needs_kernel
@pytest.mark.parametrize("case", ["f32_decode", "bf16_decode_sinks_window", "f32_verify_mask",
                                  "bf16_verify_mask_sinks_cap"])
def test_opcheck_passes(case):
    # every form the op's params and work take: sinks after the scalars, the mask's bytes after the plan (an fp8
    # cache, whose scales the params carry per call, cannot go through opcheck: its schema test multiplies
    # every tensor argument, which torch does not do for float8; tests/plugins' fp8 cases run it)
    if case == "f32_decode":
        args = _op_args()
    elif case == "bf16_decode_sinks_window":
        args = _op_args(BF16, sinks=torch.linspace(-1.0, 1.0, 8), sliding_window=9)
    elif case == "f32_verify_mask":
        args = _op_args(F32, ForwardMode.TARGET_VERIFY)
    else:
        args = _op_args(BF16, ForwardMode.TARGET_VERIFY, sinks=torch.linspace(-1.0, 1.0, 8), logit_cap=20.0)
    if "sinks" in case:
        assert args[6][kernel.PARAMS - 1] == 1.0 and args[6].numel() == kernel.PARAMS + 8
    if "mask" in case:
        assert int(args[7][0, 2]) == 3 and args[7].shape[0] > 1 + int(args[7][0, 0])
    torch.library.opcheck(torch.ops.attnplug_cpu_fused.attend.default, args)


@needs_kernel
def test_op_schema_declares_out_and_err_mutated_and_nothing_else():
    schema = torch.ops.attnplug_cpu_fused.attend.default._schema
    mutated = [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    assert mutated == ["work", "out"] and len(schema.returns) == 0


@needs_kernel
@pytest.mark.parametrize("backend_name", ["aot_eager", "inductor"])
def test_a_function_calling_the_kernel_compiles_fullgraph(backend_name):
    args = _op_args()
    q, kn, vn, kc, vc, r2t, params, work, out = args

    def f(q: torch.Tensor, kn: torch.Tensor, vn: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        torch.ops.attnplug_cpu_fused.attend(q * 1.0, kn, vn, kc, vc, r2t, params, work, out)
        return out + 0.0

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend=backend_name)
    got = compiled(q, kn, vn, torch.zeros_like(out))
    want = f(q, kn, vn, torch.zeros_like(out))
    assert same_bytes(got, want)
    assert torch.count_nonzero(got) > 0


@needs_kernel
def test_op_errors_name_the_argument_at_fault():
    args = list(_op_args())
    work = args[7]

    def fails(index: int, value: Any, match: str) -> None:
        bad = list(args)
        bad[index] = value
        with pytest.raises(RuntimeError, match=match):
            torch.ops.attnplug_cpu_fused.attend(*bad)

    out = args[8]
    fails(8, out.to(BF16), "out is BFloat16, q is Float")
    params = args[6].clone()
    params[0] = 3  # a group disagreeing with the heads
    fails(6, params, "shapes disagree")
    # the layer's scalars in another dtype, too few, not contiguous, 2-d
    for params in (args[6].float(), args[6][:6], torch.zeros(2, 7, dtype=torch.float64)[:, 0],
                   args[6].view(1, -1)):
        fails(6, params, r"params must be a contiguous float64 CPU tensor of 7")
    params = args[6].clone()
    params[6] = 1.0  # sinks announced, none follow
    fails(6, params, r"params has 7 values; with sinks 1 it needs 15 \(8 query heads\)")
    fails(6, torch.cat([args[6], torch.zeros(3, dtype=torch.float64)]), r"params has 10 values; with sinks 0 it needs 7")
    # the work tensor: another dtype, another width, not contiguous, a header the rows disagree with
    for bad_work in (work.to(torch.int32), work[:, :4].contiguous(), work.t().contiguous().t()[:, :8],
                     torch.zeros(0, 8, dtype=torch.int64)):
        fails(7, bad_work, r"work must be a contiguous int64 CPU tensor \[1 \+ B \+ M, 8\]")
    for column, value, match in ((0, int(work[0, 0]) + 1, r"work has \d+ rows; its header \(B=\d+, mask side E=0\) "
                                  r"needs \d+"),
                                 (2, 3, r"work has \d+ rows; its header \(B=\d+, mask side E=3\) needs \d+"),
                                 (0, -1, r"work's header holds B=-1"), (1, 0, r"heads per item 0"),
                                 (2, 5000, r"E=5000")):
        bad_work = work.clone()
        bad_work[0, column] = value
        fails(7, bad_work, match)


@needs_kernel
@pytest.mark.parametrize("sides", [(1, 1), (2, 3), (5, 4), (3, 8), (4, 9)], ids=str)
def test_the_work_tensor_holds_the_header_the_plan_and_the_mask_bytes(sides):
    # attend's work: row 0 (B, heads per item, the mask's side E, 0, the error record zeroed), the plan's B
    # rows, then B x E x E mask bytes in whole rows of 64 (zero-padded); no mask: the plan alone
    rows, side = sides
    gen = torch.Generator().manual_seed(rows * 10 + side)
    plan = torch.randint(0, 100, (rows, 8), generator=gen, dtype=torch.int64)
    mask = torch.rand(rows, side, side, generator=gen) > 0.5
    for m in (mask, mask.to(torch.uint8), None):  # a 0/1 uint8 mask reads as the bool one
        work = cf_backend.work_tensor(plan, m, 3)
        e = 0 if m is None else side
        mask_rows = -(-rows * e * e // 64)
        assert work.dtype == torch.int64 and work.is_contiguous() and tuple(work.shape) == (1 + rows + mask_rows, 8)
        assert work[0].tolist() == [rows, 3, e, 0, 0, 0, 0, 0]
        assert torch.equal(work[1:1 + rows], plan)
        raw = work[1 + rows:].contiguous().view(torch.uint8).reshape(-1)
        if m is not None:
            assert torch.equal(raw[:rows * e * e], m.reshape(-1).to(torch.uint8))
            assert not raw[rows * e * e:].any()
        else:
            assert raw.numel() == 0


@needs_kernel
@pytest.mark.parametrize("heads,with_sinks", [(4, False), (8, True), (300, True)])
def test_the_layer_params_hold_the_scalars_then_the_sinks(heads, with_sinks):
    # attend's params: group, window, scale, cap, k_scale, v_scale, sinks 0/1, then the H sinks (float32 values
    # exact in float64: the kernel reads them back as float32); more heads than the op's stack buffer (256) too
    sinks = torch.linspace(-2.0, 3.0, heads) + 1e-3 if with_sinks else None
    p = cf_backend.layer_params(2, 17, 0.125, 30.0, 0.5, 2.0, sinks)
    assert p.dtype == torch.float64 and p.is_contiguous()
    assert p[:kernel.PARAMS].tolist() == [2, 17, 0.125, 30.0, 0.5, 2.0, 1.0 if with_sinks else 0.0]
    if sinks is None:
        assert p.numel() == kernel.PARAMS
    else:
        assert torch.equal(p[kernel.PARAMS:].float(), sinks.float())


# ---------------------------------------------------------------------------
# ISA variants and threads: one OpenMP runtime, every variant this CPU runs agrees with the reference
# ---------------------------------------------------------------------------


@needs_kernel
def test_one_openmp_runtime_in_the_process(threads):
    s = make(dtype=BF16, head_dim=64, seed=91)
    run_and_check(s, decode_batch(s, LENS))
    maps = open("/proc/self/maps").read().splitlines()
    runtimes = {line.split()[-1] for line in maps if any(n in line for n in ("libgomp", "libiomp", "libomp"))}
    assert len(runtimes) == 1, runtimes
    import torch as _t
    assert next(iter(runtimes)).startswith(os.path.dirname(_t.__file__)), runtimes  # torch's own


_VARIANT_SCRIPT = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[1])
    import torch
    import test_cpu_fused as t
    from attnplug_cpu_fused import kernel
    print(kernel.isa())
    for dtype, kv in ((t.F32, t.F32), (t.BF16, t.BF16), (t.F16, t.E4M3), (t.BF16, t.E5M2)):
        s = t.make(dtype=dtype, kv_dtype=kv, head_dim=64, seed=5, scales=(0.5, 1.5),
                   layer_kw=dict(sinks=torch.linspace(-1.0, 1.0, 8), sliding_window=20))
        t.run_and_check(s, t.decode_batch(s, t.LENS))
        t.run_and_check(s, t.extend_batch(s, t.ForwardMode.MIXED, [0, 9], [5, 1], req_ids=[0, 1]))
        t.assert_fused_ran(s)
""")


def _variants_this_cpu_runs() -> list[str]:
    flags = set(open("/proc/cpuinfo").read().split()) if os.path.exists("/proc/cpuinfo") else set()
    out = ["portable"]
    if {"avx2", "fma", "f16c"} <= flags:
        out.append("avx2")
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        out.append("avx512")
    if "avx512_bf16" in flags:
        out.append("avx512bf16")
    return out


@needs_kernel
@pytest.mark.parametrize("isa", ["avx512bf16", "avx512", "avx2", "portable"])
def test_every_isa_variant_matches_the_reference(isa):
    if isa not in _variants_this_cpu_runs():
        pytest.skip(f"this CPU does not run the {isa} variant")
    env = dict(os.environ, ATTNPLUG_CPU_FUSED_ISA=isa)
    proc = subprocess.run([sys.executable, "-c", _VARIANT_SCRIPT, os.path.dirname(__file__)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[0] == isa


#: bf16 layers whose scores go through AMX tiles where the CPU has AMX (up to 16 query rows per KV
#: head: decode at groups 1-8, verify of 3 drafts at group 4) and past it (verify at group 8: 24 rows);
#: page size 1 makes every 16-key block a copy into the tile buffer, 16 loads it from the cache in place
def _run_with_amx(script: str, amx: str) -> None:
    """Run ``script`` (this file's directory as its argument) in a fresh process with ``$ATTNPLUG_CPU_FUSED_AMX``
    set to ``amx`` (the tile permission is asked once per process); it must print ``ok`` last."""
    env = dict(os.environ, ATTNPLUG_CPU_FUSED_AMX=amx)
    proc = subprocess.run([sys.executable, "-c", script, os.path.dirname(__file__)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[-1] == "ok"


_AMX_SCRIPT = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[1])
    import torch
    import test_cpu_fused as t
    for page_size in (1, 16):
        for group in (1, 4, 8):
            s = t.make(dtype=t.BF16, group=group, head_dim=64, page_size=page_size, seed=7 + group,
                       layer_kw=dict(sinks=torch.linspace(-1.0, 1.0, 2 * group), sliding_window=40, logit_cap=20.0))
            t.run_and_check(s, t.decode_batch(s, t.LENS))
            mask = (torch.rand(2, 3, 3, generator=s.gen) > 0.5) | torch.eye(3, dtype=torch.bool)
            t.run_and_check(s, t.extend_batch(s, t.ForwardMode.TARGET_VERIFY, [4, 70], [3, 3], mask=mask))
            t.assert_fused_ran(s)
    print("ok")
""")


@needs_kernel
@pytest.mark.parametrize("amx", ["1", "0"], ids=["amx_where_usable", "amx_off"])
def test_bf16_scores_with_and_without_amx_match_the_reference(amx):
    # $ATTNPLUG_CPU_FUSED_AMX=0 makes the process behave as if Linux refused the tile data (asked once
    # per process, hence a subprocess): the vdpbf16ps / widening paths run instead
    _run_with_amx(_AMX_SCRIPT, amx)


def _cpu_has_amx() -> bool:
    """The CPU flags AMX needs (cpuinfo); whether Linux grants the tile data is the kernel's own check."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return False
    return {"amx_tile", "amx_bf16", "avx512_bf16"} <= set(flags)


#: a bf16 decode and target-verify through the kernel: prints the runtime note, then per problem the
#: mean and max |out - float64 reference| (page 16; head dim 128: the AMX value pass's pairs of 32 dims)
_AMX_ACCURACY_SCRIPT = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[1])
    import torch
    import test_cpu_fused as t
    from attnplug.testing.reference import reference_attention
    for i, mode in enumerate((t.ForwardMode.DECODE, t.ForwardMode.TARGET_VERIFY)):
        s = t.make(dtype=t.BF16, group=4, head_dim=128, page_size=16, seed=5 + i)
        if i == 0:
            print(s.backend.runtime_notes()[0])
        batch = (t.decode_batch(s, [159, 97, 64]) if i == 0 else
                 t.extend_batch(s, mode, [150, 60], [4, 4]))
        q, k, v = t.inputs(s, batch.num_tokens, q_gain=3.0)
        kc0, vc0 = s.cache.read_kv(0)
        s.backend.init_forward_metadata(batch)
        out = s.backend.forward(q, k, v, s.layer, batch)
        ref = reference_attention(q, k, v, s.layer, batch, kc0, vc0, s.cache.req_to_token, 1.0, 1.0)
        err = (out.double() - ref).abs()
        print(f"{float(err.mean()):.6e} {float(err.max()):.6e}")
        t.assert_fused_ran(s)
""")


def _amx_accuracy(amx: str) -> tuple[str, list[tuple[float, float]]]:
    env = dict(os.environ, ATTNPLUG_CPU_FUSED_AMX=amx)
    proc = subprocess.run([sys.executable, "-c", _AMX_ACCURACY_SCRIPT, os.path.dirname(__file__)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    note, *rows = proc.stdout.strip().splitlines()
    return note, [(float(a), float(b)) for a, b in (r.split() for r in rows)]


@needs_kernel
def test_bf16_decode_on_amx_is_as_accurate_as_without_it():
    # with AMX the value pass multiplies P (as two bf16 parts, hi + lo) by V through tdpbf16ps; without,
    # P stays float32 and V is widened. Against the float64 reference the two must err alike (P rounded
    # to one bf16 part measured 1.5x the mean error), and the note says which ran
    if not _cpu_has_amx() or kernel.isa() != "avx512bf16":
        pytest.skip("this CPU has no AMX (or the kernel variant is not avx512bf16): one path only")
    note_on, on = _amx_accuracy("1")
    note_off, off = _amx_accuracy("0")
    assert "(bf16: scores and value sum through AMX tiles)" in note_on, note_on
    assert "tiled extend kernel's amx body" in note_on, note_on
    assert "AMX tiles" not in note_off and "tiled extend kernel's avx512bf16 body" in note_off, note_off
    for (mean_on, max_on), (mean_off, max_off) in zip(on, off):
        assert mean_on <= 1.15 * mean_off and max_on <= 1.25 * max_off, (on, off)


#: bf16 target-verify (3 drafts a request, causal) whose last draft's V is NaN / inf: that value row is
#: hidden from the earlier drafts (P 0), so a value block holding it is added row by row where P is not 0,
#: never through the tiles (0 * NaN is NaN); the earlier drafts match the reference, the last is not
#: finite. Then the same with that row's K and V in the cache and a 40-token window hiding the cached
#: tokens before it (NaN / inf there too). Page 16, head dims 64 and 128.
_HIDDEN_NAN_SCRIPT = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[1])
    import torch
    import test_cpu_fused as t
    from attnplug.testing.reference import reference_attention
    for head_dim in (64, 128):
        for window in (None, 40):
            s = t.make(dtype=t.BF16, group=4, head_dim=head_dim, page_size=16, seed=11,
                       layer_kw=dict(sliding_window=window))
            first = [140, 90]
            batch = t.extend_batch(s, t.ForwardMode.TARGET_VERIFY, first, [3, 3])
            if window is not None:  # cached tokens before every query's window: NaN / inf
                for r, p in zip(batch.req_pool_indices.tolist(), first):
                    hidden = s.cache.req_to_token[r, :p - window - 1]
                    vals = torch.tensor([float("nan"), float("inf"), float("-inf")])[torch.arange(hidden.numel()) % 3]
                    bad = vals[:, None, None].expand(-1, 2, head_dim).to(torch.bfloat16)
                    s.cache.set_kv(0, hidden, bad, bad, stored=True)
            q, k, v = t.inputs(s, batch.num_tokens)
            v = v.clone()
            v[2], v[5] = float("nan"), float("inf")  # each request's last draft
            kc0, vc0 = s.cache.read_kv(0)
            s.backend.init_forward_metadata(batch)
            out = s.backend.forward(q, k, v, s.layer, batch)
            ref = reference_attention(q, k, v, s.layer, batch, kc0, vc0, s.cache.req_to_token, 1.0, 1.0)
            keep = [0, 1, 3, 4]
            tol = t.tolerance(s)
            torch.testing.assert_close(out[keep].double(), ref[keep], atol=tol.atol, rtol=tol.rtol)
            assert not bool(torch.isfinite(out[[2, 5]]).any())
            t.assert_fused_ran(s)
    print("ok")
""")


@needs_kernel
@pytest.mark.parametrize("amx", ["1", "0"], ids=["amx_where_usable", "amx_off"])
def test_bf16_values_hidden_from_a_draft_never_reach_its_output(amx):
    _run_with_amx(_HIDDEN_NAN_SCRIPT, amx)


@needs_kernel
def test_an_isa_this_cpu_cannot_run_is_refused_naming_the_variable():
    env = dict(os.environ, ATTNPLUG_CPU_FUSED_ISA="sse9")
    code = "from attnplug_cpu_fused import kernel; print(kernel.load()[1])"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert "$ATTNPLUG_CPU_FUSED_ISA=sse9 is not a kernel variant this CPU runs" in proc.stdout + proc.stderr


@needs_kernel
@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.EXTEND], ids=lambda m: m.name)
def test_bidirectional_layers_run_torch_natives_eager_paths(mode):
    # claimed (encoders): the kernel masks causally, so such a layer takes the parent's eager paths
    s = make(dtype=F32, head_dim=32, seed=95, layer_kw=dict(causality="bidirectional"))
    batch = decode_batch(s, LENS) if mode is ForwardMode.DECODE else extend_batch(s, mode, [0, 5], [7, 3])
    run_and_check(s, batch)
    assert s.backend.workspace.grows > 0, "the eager paths did not run"


@needs_kernel
@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.TARGET_VERIFY], ids=lambda m: m.name)
def test_kernel_call_does_the_forwards_work(mode):
    """What bench --overhead compares a forward with: the op with prepared arguments and the K/V write."""
    s = make(dtype=BF16, head_dim=64, seed=96)
    batch = decode_batch(s, LENS) if mode is ForwardMode.DECODE else extend_batch(s, mode, [3, 20], [4, 4])
    q, k, v = inputs(s, batch.num_tokens)
    before = [t.clone() for t in s.cache.read_kv(0)]
    s.backend.init_forward_metadata(batch)
    want = s.backend.forward(q, k, v, s.layer, batch)
    after = [t.clone() for t in s.cache.read_kv(0)]
    s.cache.set_kv(0, torch.arange(s.cache.num_slots), *before, stored=True)
    call = s.backend.kernel_call(q, k, v, s.layer, batch)
    got = call()
    assert same_bytes(got, want) and got is not call()
    assert all(same_bytes(a, b) for a, b in zip(after, s.cache.read_kv(0)))


@pytest.mark.parametrize("cxx", [None, "no-such-g++"], ids=["no_compiler_on_path", "cxx_names_a_missing_one"])
def test_a_build_without_a_compiler_stops_naming_the_compiler(cxx, tmp_path):
    """The install-time build (setup.py) with no C++ compiler reachable: a clear failure naming the
    compiler it looked for, before torch's build machinery runs (no compile-at-first-use fallback)."""
    root = os.path.join(os.path.dirname(__file__), "..", "..", "plugins", "cpu_fused")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    os.symlink(sys.executable, bindir / "python")
    env = {k: v for k, v in os.environ.items() if k not in ("CXX", "CC")}
    env["PATH"] = str(bindir)
    if cxx:
        env["CXX"] = cxx
    proc = subprocess.run([sys.executable, "setup.py", "--name"], cwd=root, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode != 0
    named = cxx or "c++"
    assert f"attnplug-cpu-fused: no C++ compiler found: {named!r} is not on PATH" in proc.stderr, proc.stderr


# ---------------------------------------------------------------------------
# per-forward plans shared by layers, the tiled kernel's refusals, the constructor's refusals, errors
# ---------------------------------------------------------------------------


@needs_kernel
@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.EXTEND], ids=lambda m: m.name)
def test_layers_of_one_forward_share_its_plans(mode):
    # two layers over the same cache with different query heads per KV head (two geometries, one
    # window): the work rows are planned once per forward and shared (the long extend's tiled plan
    # too); each layer's own work split is its own; both outputs match the reference
    s = make(dtype=F32, head_dim=32, seed=97)
    other = LayerSpec(0, 2 * 2, 2, 32)  # 2 query heads per KV head instead of 4
    batch = decode_batch(s, LENS) if mode is ForwardMode.DECODE else extend_batch(s, mode, [4, 30], [40, 3])
    s.backend.init_forward_metadata(batch)
    meta = s.backend.forward_metadata(batch)
    kc0, vc0 = s.cache.read_kv(0)
    tol = tolerance(s)
    for layer in (s.layer, other, s.layer):
        q = torch.randn(batch.num_tokens, layer.num_heads, 32, generator=s.gen)
        k = torch.randn(batch.num_tokens, 2, 32, generator=s.gen)
        v = torch.randn(batch.num_tokens, 2, 32, generator=s.gen)
        out = s.backend.forward(q, k, v, layer, batch, save_kv_cache=False)
        want = reference_attention(q, k, v, layer, batch, kc0, vc0, s.cache.req_to_token)
        torch.testing.assert_close(out.double(), want, atol=tol.atol, rtol=tol.rtol)
    assert len(meta.work) == 2  # one work split per geometry
    if mode is ForwardMode.DECODE:  # each geometry's header and rows in one buffer (_decode_work): the same rows
        a, b = meta.work.values()
        assert torch.equal(a.plan, b.plan) and meta._plan == {}, (a.plan, b.plan)
    else:
        assert len(meta._plan) == 1, meta._plan.keys()  # planned once, used by both geometries
    if mode is ForwardMode.EXTEND:
        assert list(meta._tiled) == [None] and len(meta.tiled_why) == 2


@needs_kernel
@pytest.mark.parametrize("case", ["bidirectional", "cross", "group_over_64", "scratch_limit", "tiled_off"])
def test_tiled_fits_names_why_it_refuses(case):
    kw: dict[str, Any] = {}
    layer_kw: dict[str, Any] = {}
    if case == "bidirectional":
        layer_kw = dict(causality="bidirectional")
    elif case == "cross":
        layer_kw = dict(is_cross_attention=True)
    elif case == "group_over_64":
        kw = dict(kv_heads=1, group=65)
    elif case == "scratch_limit":
        kw = dict(max_workspace_bytes=1 << 16)
    s = make(dtype=F32, head_dim=32, seed=98, layer_kw=layer_kw, **kw)
    if case == "tiled_off":
        s.backend.tiled = False
    batch = extend_batch(s, ForwardMode.EXTEND, [4], [40])
    s.backend.init_forward_metadata(batch)
    q = torch.randn(batch.num_tokens, s.layer.num_heads, 32, generator=s.gen)
    why = s.backend.tiled_fits(q, s.layer, s.backend.forward_metadata(batch))
    expected = {"bidirectional": "a bidirectional layer", "cross": "cross-attention",
                "group_over_64": "65 query heads per KV head (the tiled kernel takes up to 64)",
                "scratch_limit": "is over the workspace limit", "tiled_off": "tiled=False"}[case]
    assert why is not None and expected in why, why


@needs_kernel
def test_a_backend_off_the_cpu_is_unavailable_naming_the_device():
    ctx = BuildContext(config=AttentionConfig(attention_backend="cpu_fused"), host=HOST, dtype="float32",
                       kv_cache_dtype="float32", num_heads=8, num_kv_heads=2, head_dim=16, page_size=16,
                       device="meta", max_batch_size=2, max_context_len=64)
    with pytest.raises(BackendUnavailableError, match=r"runs on CPU only \(this backend is on meta\)"):
        CpuFusedBackend(ctx)


@needs_kernel
def test_runtime_notes_name_the_variant_and_the_split():
    s = make(seed=99)
    (note,) = s.backend.runtime_notes()
    assert f"kernel variant {kernel.isa()}" in note and f"<= {FUSED_MAX_QUERIES} new tokens" in note


@needs_kernel
@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.TARGET_VERIFY], ids=lambda m: m.name)
def test_a_slot_changed_after_the_check_is_an_error_naming_the_request(mode):
    # req_to_token changed after init_forward_metadata checked it: the kernel's own per-slot check
    # stops the call and the backend raises naming the request, its row and the slot
    from attnplug.errors import ShapeError
    s = make(dtype=F32, head_dim=32, seed=100)
    batch = decode_batch(s, LENS) if mode is ForwardMode.DECODE else extend_batch(s, mode, [4, 20], [3, 3])
    s.backend.init_forward_metadata(batch)
    row = int(batch.req_pool_indices[1])
    # written through .data: the table's version counter does not move, so the core's per-forward check
    # cannot see it (as for a write by native code sharing the memory); the kernel's check must
    s.cache.req_to_token.data[row, 2] = s.cache.num_slots + 7
    q, k, v = inputs(s, batch.num_tokens)
    with pytest.raises(ShapeError, match=rf"request 1 \(req_to_token row {row}\): position 2 maps to slot "
                                         rf"{s.cache.num_slots + 7}, which is out of range"):
        s.backend.forward(q, k, v, s.layer, batch, save_kv_cache=False)


# ---------------------------------------------------------------------------
# the prepared call per forward and layer (issue 30, round 4: FusedMeta.calls)
# ---------------------------------------------------------------------------


def _strided(x: torch.Tensor) -> torch.Tensor:
    """``x`` with its last dimension strided (every other element of a wider buffer): the op's slow path."""
    wide = torch.zeros(*x.shape[:-1], 2 * x.shape[-1], dtype=x.dtype)
    wide[..., ::2] = x
    return wide[..., ::2]


@needs_kernel
@pytest.mark.parametrize("case", ["same layer twice", "threads change", "another layer object", "strided k/v",
                                  "strided q", "bidirectional layer"])
def test_the_prepared_call_is_made_again_whenever_what_it_holds_may_differ(case):
    # within one decode forward, each call of a layer reuses the op's prepared arguments only for the same
    # layer object, query dtype and thread count, and only when q/k/v need no conversion; every call's
    # output equals the reference, whatever path served it
    s = make(dtype=F32, head_dim=32, seed=131, layer_kw=dict(causality="bidirectional") if case ==
             "bidirectional layer" else None)
    batch = decode_batch(s, LENS)
    s.backend.init_forward_metadata(batch)
    meta = s.backend.forward_metadata(batch)
    kc0, vc0 = s.cache.read_kv(0)
    tol = tolerance(s)
    layers = [s.layer, s.layer]
    if case == "another layer object":
        layers[1] = dataclasses.replace(s.layer)  # equal, but another object: its own call
    threads = torch.get_num_threads()
    try:
        for i, layer in enumerate(layers):
            if case == "threads change" and i == 1:
                torch.set_num_threads(max(1, threads - 1) if threads > 1 else 2)
            q, k, v = inputs(s, batch.num_tokens)
            if case == "strided k/v" and i == 1:
                k, v = _strided(k), _strided(v)
            if case == "strided q" and i == 1:
                q = _strided(q)
            out = s.backend.forward(q, k, v, layer, batch, save_kv_cache=False)
            want = reference_attention(q, k, v, layer, batch, kc0, vc0, s.cache.req_to_token)
            torch.testing.assert_close(out.double(), want, atol=tol.atol, rtol=tol.rtol)
            call = meta.calls[id(layer)]
            assert call.layer is layer and call.dtype == q.dtype and call.threads == torch.get_num_threads()
            if case == "bidirectional layer":
                assert call.head is None and call.work is cf_backend.BIDIRECTIONAL
            else:
                assert isinstance(call.work, cf_backend.FusedForward) and call.head is not None
    finally:
        torch.set_num_threads(threads)
    if case == "another layer object":
        assert meta.calls[id(layers[0])] is not meta.calls[id(layers[1])]
        # one geometry: the work rows planned once for both (a decode forward's in one buffer: _decode_work)
        assert len(meta.work) == 1 and meta.calls[id(layers[0])].work is meta.calls[id(layers[1])].work


@needs_kernel
@pytest.mark.parametrize("window", [None, 3, 40])
@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.EXTEND], ids=lambda m: m.name)
def test_the_work_rows_from_the_array_buffer_are_the_rows_of_the_nested_list(mode, window):
    # FusedMeta.plan / tiled_plan build their int64 tables through an array buffer; the table is the one the
    # nested-list torch.tensor made (every column), for decode, short and long extends and windows
    s = make(dtype=F32, head_dim=32, seed=132)
    batch = decode_batch(s, LENS) if mode is ForwardMode.DECODE else extend_batch(s, mode, [4, 30, 0], [40, 3, 5])
    meta = FusedMeta(batch, s.cache)
    table, most_keys, most_q = meta.plan(window, False, FUSED_QUERY_CHUNK)
    rows, keys = [], []
    for i, a0, nq in meta.chunks(FUSED_QUERY_CHUNK):
        p = meta.prefix[i]
        start = 0 if window is None else min(p, max(0, p + a0 - window))
        rows.append([meta.rows[i], start, p - start, meta.q_off[i] + a0, nq, p + a0, meta.q_off[i], a0])
        keys.append(p - start + a0 + nq)
    assert table.dtype == torch.int64 and table.is_contiguous()
    assert table.tolist() == rows and most_keys == max(keys) and most_q == max(r[4] for r in rows)
    tiled = meta.tiled_plan(window)
    want = []
    for i in meta.tiled_requests():
        p, e = meta.prefix[i], meta.ext[i]
        start = 0 if window is None else min(p, max(0, p - window))
        want.append([meta.rows[i], start, p - start, meta.q_off[i], e, p, meta.q_off[i], 0])
    assert tiled.shape == (len(want), 8) and tiled.tolist() == want
