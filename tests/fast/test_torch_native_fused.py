"""torch_native's fused CPU kernel (``csrc/attention.cpp``, built by ``fused.py``) against the float64
reference, against the eager paths, and its build: failures stated as reasons, the cache key.

The kernel takes every DECODE request, and in the extend modes the requests with at most
``FUSED_MAX_QUERIES`` new tokens; a request's new tokens are cut into chunks of at most
``FUSED_QUERY_CHUNK`` queries (fewer when a chunk's scores would not fit ``FUSED_SCRATCH_BYTES``), so
the chunk tests shrink that constant (and lift the first) to put every boundary inside small
problems. Every case
builds a paged cache on shuffled pages, fills every slot with noise (garbage tests: NaN and
infinities wherever no request reads), runs a forward and compares the output with
``reference_attention`` of the cache as it was before, and the cache after with
``expected_cache_after`` (bit for bit). A case that means the fused kernel asserts it ran: the layer
fits (``fused_fits`` is ``None``) and the eager paths' workspace was never allocated.

The build tests run the real compiler (or a stand-in script that fails the way a compiler does) in a
temporary ``$ATTNPLUG_CACHE_DIR``; ``fused.load``'s per-process cache is cleared before and after.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import shutil
import stat
import textwrap
from pathlib import Path
from typing import Any, Sequence

import pytest
import torch

from attnplug import (
    AttentionConfig,
    BackendUnavailableError,
    BuildContext,
    ForwardBatch,
    ForwardMode,
    HostInfo,
    LayerSpec,
    PageAllocator,
    PagedKVCache,
    ResourceLimitError,
)
from attnplug.dtypes import dtype_name
from attnplug.registry import default_registry
from attnplug.testing.reference import expected_cache_after, reference_attention
from attnplug.testing.suite.harness import same_bytes
from attnplug.testing.tolerances import tolerance_for
from attnplug_torch_native import fused
from attnplug_torch_native import backend as tn_backend
from attnplug_torch_native.backend import FUSED_MAX_QUERIES, FUSED_QUERY_CHUNK, TorchNativeBackend, create

HOST = HostInfo(platform="cpu")
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
DTYPE_IDS = {F32: "f32", BF16: "bf16", F16: "f16", E4M3: "e4m3", E5M2: "e5m2"}

#: the kernel is built for x86-64 Linux only (``fused.load`` says so elsewhere); everything else here
#: needs it, and on such a host a build failure is a test failure (it prints the reason)
KERNEL_HOST = platform.system() == "Linux" and platform.machine() in ("x86_64", "AMD64")
needs_kernel = pytest.mark.skipif(not KERNEL_HOST, reason="the fused CPU kernel is built on x86-64 Linux only")


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request: Any) -> Any:
    """torch's thread count (the kernel's OpenMP threads and its work split), restored afterwards."""
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
    backend: TorchNativeBackend
    layer: LayerSpec
    dtype: torch.dtype
    gen: torch.Generator
    alloc: PageAllocator
    ctx: BuildContext


def make(
    *, dtype: torch.dtype = F32, kv_dtype: torch.dtype | None = None, kv_heads: int = 2, group: int = 4,
    head_dim: int = 16, v_head_dim: int | None = None, page_size: int = 16, layout: str = "nhd",
    scales: tuple[float, float] = (1.0, 1.0), fused: str = "auto", layer_kw: dict[str, Any] | None = None,
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
        config=AttentionConfig(attention_backend="torch_native"), host=HOST, dtype=str(dtype),
        kv_cache_dtype=str(kv_dtype), num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        v_head_dim=v_head_dim, page_size=page_size, kv_cache=cache, max_batch_size=8, max_context_len=160,
        max_workspace_bytes=max_workspace_bytes,
    )
    backend = TorchNativeBackend(ctx, fused=fused)
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
    L, g = s.layer, s.gen
    q = (torch.randn(tokens, L.num_heads, L.head_dim, generator=g) * q_gain).to(s.dtype)
    if not with_kv:
        return q, None, None
    k = torch.randn(tokens, L.num_kv_heads, L.head_dim, generator=g).to(s.dtype)
    v = torch.randn(tokens, L.num_kv_heads, L.v_head_dim, generator=g).to(s.dtype)
    return q, k, v


def tolerance(s: Setup) -> Any:
    return tolerance_for(dtype_name(s.dtype), dtype_name(s.cache.dtype))


def run_and_check(s: Setup, batch: ForwardBatch, *, with_kv: bool = True, save: bool = True, q_gain: float = 1.0,
                  qkv: tuple[Any, Any, Any] | None = None) -> torch.Tensor:
    """One forward: the output against the float64 reference, the cache against a write at out_cache_loc only."""
    layer = s.layer
    q, k, v = qkv or inputs(s, batch.num_tokens, with_kv=with_kv, q_gain=q_gain)
    kc0, vc0 = s.cache.read_kv(0)  # stored values, token-major, whatever the layout
    s.backend.init_forward_metadata(batch)
    out = s.backend.forward(q, k, v, layer, batch, save_kv_cache=save)
    assert out.shape == (batch.num_tokens, layer.num_heads, layer.v_head_dim) and out.dtype == s.dtype
    ks, vs = s.cache.kv_scales(0)
    ref = reference_attention(q, k, v, layer, batch, kc0, vc0, s.cache.req_to_token, ks, vs)
    tol = tolerance(s)
    torch.testing.assert_close(out.double(), ref, atol=tol.atol, rtol=tol.rtol)
    kc1, vc1 = s.cache.read_kv(0)
    writes = save and k is not None and not layer.is_cross_attention
    exp_k, exp_v = expected_cache_after(kc0, vc0, k, v, batch.out_cache_loc, ks, vs) if writes else (kc0, vc0)
    assert same_bytes(kc1, exp_k) and same_bytes(vc1, exp_v), "KV cache differs from a write at out_cache_loc only"
    return out


def assert_fused_ran(s: Setup) -> None:
    """The layer fits the kernel and the eager decode / extend never allocated their workspace."""
    probe = torch.zeros(1, s.layer.num_heads, s.layer.head_dim, dtype=s.dtype)
    assert s.backend.fused_reason is None, s.backend.fused_reason
    assert s.backend.fused_fits(probe, s.layer) is None
    assert s.backend.workspace.grows == 0 and s.backend.workspace.nbytes() == 0, "the eager decode ran"


def assert_eager_ran(s: Setup, reason: str) -> None:
    probe = torch.zeros(1, s.layer.num_heads, s.layer.head_dim, dtype=s.dtype)
    why = s.backend.fused_fits(probe, s.layer)
    assert why is not None and reason in why, why
    assert s.backend.workspace.grows > 0, "the eager decode did not run"


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
    monkeypatch.setattr(tn_backend, "FUSED_MAX_QUERIES", 1000)
    monkeypatch.setattr(tn_backend, "FUSED_QUERY_CHUNK", 4)
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
    monkeypatch.setattr(tn_backend, "FUSED_QUERY_CHUNK", chunk)
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
    monkeypatch.setattr(tn_backend, "FUSED_MAX_QUERIES", 1000)
    assert 130 % FUSED_QUERY_CHUNK == 2
    s = make(dtype=dtype, head_dim=32, seed=75, layer_kw=dict(sliding_window=70))
    run_and_check(s, extend_batch(s, ForwardMode.EXTEND, [0, 25], [130, 2 * FUSED_QUERY_CHUNK + 1]))
    assert_fused_ran(s)


@needs_kernel
def test_chunks_shrink_to_fit_the_scratch_aim(monkeypatch):
    # with a scratch aim a whole chunk cannot meet, the kernel takes shorter chunks (its plans name
    # each chunk length it tried) and still answers right; no eager workspace
    monkeypatch.setattr(tn_backend, "FUSED_SCRATCH_BYTES", 16 << 10)
    s = make(dtype=F32, head_dim=32, seed=76)
    batch = extend_batch(s, ForwardMode.EXTEND, [134, 0], [FUSED_QUERY_CHUNK, 5])
    s.backend.init_forward_metadata(batch)
    q, k, v = inputs(s, batch.num_tokens)
    s.backend.forward(q, k, v, s.layer, batch)
    plans = s.backend.forward_metadata(batch)._plans
    tried = sorted(key[3] for key in plans if isinstance(key, tuple) and key[0] == "fused")
    assert tried[-1] == FUSED_QUERY_CHUNK and tried[0] < FUSED_QUERY_CHUNK
    keys = 134 + FUSED_QUERY_CHUNK
    assert fused.scratch_bytes(torch.get_num_threads(), 1, tried[0], s.layer.gqa_group_size, keys, 32, 32) <= 16 << 10
    run_and_check(s, extend_batch(s, ForwardMode.EXTEND, [130, 0], [FUSED_QUERY_CHUNK, 9], req_ids=[1, 2]))
    assert_fused_ran(s)


@needs_kernel
def test_scratch_over_the_workspace_limit_is_refused(threads):
    # the kernel's scratch counts against max_workspace_bytes: one query per chunk over the limit
    # hands the layer to the eager extend, which needs more and refuses with the limit named
    s = make(dtype=F32, head_dim=32, seed=77, max_workspace_bytes=4 << 10)
    assert fused.scratch_bytes(threads, 1, 1, s.layer.gqa_group_size, 110, 32, 32) > 4 << 10
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
    eager = TorchNativeBackend(s.ctx, fused="off")
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
    assert eager.workspace.grows > 0 and eager.fused_reason == "fused='off'"
    tol = tolerance(s)
    torch.testing.assert_close(outs[0].double(), ref.double(), atol=tol.atol, rtol=tol.rtol)


# ---------------------------------------------------------------------------
# layers the kernel does not take: the eager decode runs, and says why
# ---------------------------------------------------------------------------


@needs_kernel
@pytest.mark.parametrize("kind", ["hnd_layout", "head_dim_40", "v_head_dim_24", "bf16_model_f32_cache"])
def test_layers_the_kernel_does_not_take_run_eager(kind):
    kw: dict[str, Any] = dict(seed=41, head_dim=32)
    reason = {
        "hnd_layout": "nhd layout only (this cache: hnd)",
        "head_dim_40": "head dims 40/40",
        "v_head_dim_24": "head dims 32/24",
        "bf16_model_f32_cache": "a torch.float32 cache under a torch.bfloat16 model",
    }[kind]
    if kind == "hnd_layout":
        kw["layout"] = "hnd"
    elif kind == "head_dim_40":
        kw["head_dim"] = 40
    elif kind == "v_head_dim_24":
        kw["v_head_dim"] = 24
    else:
        kw.update(dtype=BF16, kv_dtype=F32)
    s = make(**kw)
    assert s.backend.fused_reason is None  # the kernel is there; this layer does not fit it
    run_and_check(s, decode_batch(s, LENS))
    assert_eager_ran(s, reason)


# ---------------------------------------------------------------------------
# workspace limit
# ---------------------------------------------------------------------------


@needs_kernel
def test_workspace_limit_below_the_kernel_scratch_falls_back_to_an_eager_decode_that_fits():
    # first tokens only (1 key each) with wide heads: the kernel's scratch (16 padded scores, a
    # 16-row block) is far above the eager decode's ([1 key, D + Dv] per block), which computes
    limit = 8192
    assert fused.scratch_bytes(1, 1, 1, 8, 1, 256, 256) > limit
    s = make(dtype=F32, kv_heads=1, group=8, head_dim=256, seed=51, max_workspace_bytes=limit)
    s.backend.decode_block_bytes = 1  # one KV head of one request per eager block
    run_and_check(s, decode_batch(s, [1, 1]))
    # the layer fits the kernel: the workspace limit alone made it decline, and the eager decode ran
    assert s.backend.fused_fits(torch.zeros(1, 8, 256), s.layer) is None
    assert s.backend.workspace.grows > 0


@needs_kernel
def test_workspace_limit_below_both_paths_is_refused_naming_the_limit():
    s = make(dtype=F32, seed=52, max_workspace_bytes=2048)
    assert fused.scratch_bytes(1, 1, 1, 4, 53, 16, 16) > 2048
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
        lo, hi = fused.scratch_bytes(1, 1, 1, 2, 53, 32, 32), fused.scratch_bytes(1, 4, 1, 2, 53, 32, 32)
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
    assert fused.scratch_bytes(threads, 1, 8, 2, 8 + 3, 16, 16) > 4096
    assert fused.scratch_bytes(threads, 1, 2, 2, 8 + 3, 16, 16) <= 4096
    run_and_check(s, extend_batch(s, ForwardMode.TARGET_VERIFY, [3, 1], [8, 8], mask=None))
    assert_fused_ran(s)


# ---------------------------------------------------------------------------
# the knob: fused and $ATTNPLUG_TORCH_NATIVE_FUSED
# ---------------------------------------------------------------------------


def test_bad_fused_value_is_a_value_error_naming_the_knob():
    s_ctx = make(fused="off").ctx
    with pytest.raises(ValueError, match=r"torch_native: fused must be one of auto, on, off, got 'fast'"):
        TorchNativeBackend(s_ctx, fused="fast")


def test_environment_variable_sets_the_knob_of_the_factory(monkeypatch):
    ctx = make(fused="off").ctx
    monkeypatch.setenv(fused.ENV, "sometimes")
    with pytest.raises(ValueError, match=r"\$ATTNPLUG_TORCH_NATIVE_FUSED must be one of auto, on, off, "
                                         r"got 'sometimes'"):
        create(ctx)
    monkeypatch.setenv(fused.ENV, " OFF ")
    name, backend = create(ctx)
    assert name == "torch_native" and backend.fused == "off" and backend.fused_reason == "fused='off'"
    _, backend = default_registry().build("torch_native", ctx)  # the registry goes through the factory
    assert backend.fused == "off"
    monkeypatch.delenv(fused.ENV)
    assert create(ctx)[1].fused == "auto"


# ---------------------------------------------------------------------------
# building and loading the kernel
# ---------------------------------------------------------------------------


@pytest.fixture
def fresh_build(monkeypatch, tmp_path):
    """An empty kernel cache directory and a cleared ``fused.load`` cache (cleared again afterwards,
    so later tests load the real kernel again)."""
    cache = tmp_path / "kernels"
    monkeypatch.setenv("ATTNPLUG_CACHE_DIR", str(cache))
    fused.load.cache_clear()
    yield cache
    fused.load.cache_clear()


def script(tmp_path: Path, name: str, body: str) -> Path:
    """An executable shell script standing in for a compiler."""
    path = tmp_path / name
    path.write_text("#!/bin/sh\n" + textwrap.dedent(body))
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def leftovers(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.glob("*.tmp.so")) if cache.exists() else []


def test_no_compiler_is_a_reason_and_auto_runs_the_eager_decode(fresh_build, monkeypatch):
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    lib, why = fused.load()
    assert lib is None and why is not None and "no C++ compiler found" in why
    assert "$CXX='/nonexistent/g++' is not an executable" in why
    if KERNEL_HOST:
        s = make(dtype=BF16, head_dim=32, seed=61)  # "auto"
        assert s.backend._fused is None and s.backend.fused_reason == why
        run_and_check(s, decode_batch(s, LENS))
        assert_eager_ran(s, "no C++ compiler found")  # fused_fits answers the backend's reason


def test_fused_on_without_the_kernel_is_unavailable_naming_torch_native(fresh_build, monkeypatch):
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    ctx = make(fused="off").ctx
    with pytest.raises(BackendUnavailableError, match=r"'torch_native' is unavailable.*fused='on': no C\+\+ "
                                                      r"compiler found") as err:
        TorchNativeBackend(ctx, fused="on")
    assert err.value.name == "torch_native"
    monkeypatch.setenv(fused.ENV, "on")
    with pytest.raises(BackendUnavailableError, match="no C\\+\\+ compiler found"):
        create(ctx)


def test_compile_failure_is_a_reason_with_the_compilers_last_lines(fresh_build, tmp_path, monkeypatch):
    cxx = script(tmp_path, "badcxx", """\
        [ "$1" = "--version" ] && { echo "badcxx 1.0"; exit 0; }
        echo "attention.cpp: In function 'run':" >&2
        echo "attention.cpp:12:3: error: expected ';' before '}'" >&2
        exit 1
    """)
    monkeypatch.setenv("CXX", str(cxx))
    lib, why = fused.load()
    assert lib is None
    assert why == ("badcxx failed to compile attention.cpp (exit 1): attention.cpp: In function 'run': | "
                   "attention.cpp:12:3: error: expected ';' before '}'")
    assert leftovers(fresh_build) == [] and list(fresh_build.glob("*.so")) == [], "a failed build left files"
    monkeypatch.setenv("CXX", "/bin/false")  # exits 1 and says nothing
    fused.load.cache_clear()
    lib, why = fused.load()
    assert lib is None and why is not None and why.startswith("false failed to compile attention.cpp (exit 1)")
    assert leftovers(fresh_build) == []


def test_unwritable_cache_directory_is_a_reason(fresh_build, tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", str(script(tmp_path, "anycxx", 'echo "anycxx 1.0"\n')))  # found; never builds
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("ATTNPLUG_CACHE_DIR", str(blocker / "kernels"))
    lib, why = fused.load()
    assert lib is None and why is not None and why.startswith(f"cannot write the kernel cache directory {blocker}")


def test_library_that_does_not_load_is_a_reason(fresh_build, tmp_path, monkeypatch):
    cxx = script(tmp_path, "junkcxx", """\
        [ "$1" = "--version" ] && { echo "junkcxx 1.0"; exit 0; }
        while [ "$#" -gt 0 ]; do [ "$1" = "-o" ] && out="$2"; shift; done
        echo "this is not a shared object" > "$out"
    """)
    monkeypatch.setenv("CXX", str(cxx))
    lib, why = fused.load()
    assert lib is None and why is not None and why.startswith("cannot load the fused CPU kernel ")
    assert why.endswith("; removed it, the next build retries")
    assert leftovers(fresh_build) == [] and list(fresh_build.glob("*.so")) == [], "a library that does not load was kept"


@pytest.mark.skipif(shutil.which("g++") is None or not KERNEL_HOST, reason="needs g++ on x86-64 Linux")
def test_struct_size_disagreeing_with_fused_py_is_a_reason(fresh_build, tmp_path, monkeypatch):
    # a library exporting both entry points but another DecodeArgs: refused before any call
    stub = tmp_path / "stub.cpp"
    stub.write_text('extern "C" int attnplug_fused_decode(const void*) { return 0; }\n'
                    'extern "C" long long attnplug_fused_decode_args_size(void) { return 8; }\n')
    cxx = script(tmp_path, "stubcxx", f"""\
        [ "$1" = "--version" ] && {{ echo "stubcxx 1.0"; exit 0; }}
        while [ "$#" -gt 0 ]; do [ "$1" = "-o" ] && out="$2"; shift; done
        exec g++ -shared -fPIC "{stub}" -o "$out"
    """)
    monkeypatch.setenv("CXX", str(cxx))
    lib, why = fused.load()
    assert lib is None and why is not None
    assert f"DecodeArgs is 8 bytes in the library, {fused.ctypes.sizeof(fused.DecodeArgs)} in fused.py" in why
    assert list(fresh_build.glob("*.so")) == [], "a library with another DecodeArgs was kept"


def test_missing_source_is_a_reason(fresh_build, tmp_path, monkeypatch):
    monkeypatch.setattr(fused, "SOURCE", tmp_path / "csrc" / "attention.cpp")
    lib, why = fused.load()
    if KERNEL_HOST:
        assert lib is None and why is not None and "source" in why and "is missing" in why


def test_other_platforms_are_a_reason_simulated(fresh_build, monkeypatch):
    # simulated: this test cannot run on an ARM host, so platform.machine() answers as one would
    monkeypatch.setattr(fused.platform, "machine", lambda: "aarch64")
    lib, why = fused.load()
    assert lib is None and why is not None and "x86-64 Linux only" in why and "aarch64" in why


def test_cache_directory_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("ATTNPLUG_CACHE_DIR", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert fused.cache_dir() == tmp_path / "explicit"
    monkeypatch.delenv("ATTNPLUG_CACHE_DIR")
    assert fused.cache_dir() == tmp_path / "xdg" / "attnplug"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert fused.cache_dir() == tmp_path / "home" / ".cache" / "attnplug"


def test_library_name_hashes_source_bytes_compiler_version_and_flags(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNPLUG_CACHE_DIR", str(tmp_path))
    cxx = script(tmp_path, "vcxx", 'echo "vcxx $VCXX_VERSION"\n')
    monkeypatch.setenv("VCXX_VERSION", "1")
    base = fused.library_path(str(cxx))
    assert base.parent == tmp_path and base.name.startswith("torch_native_fused-") and base.suffix == ".so"
    originals = fused.sources()
    (tmp_path / "copy").mkdir()
    for f in originals:  # attention.cpp and the tiled kernel's source and header beside it
        shutil.copyfile(f, tmp_path / "copy" / f.name)
    monkeypatch.setattr(fused, "SOURCE", tmp_path / "copy" / "attention.cpp")
    assert fused.library_path(str(cxx)) == base  # the bytes, not where they are
    for original in originals:  # each file's bytes count
        copy = tmp_path / "copy" / original.name
        copy.write_bytes(copy.read_bytes() + b"\n// one more comment\n")
        assert fused.library_path(str(cxx)) != base, original.name
        shutil.copyfile(original, copy)
        assert fused.library_path(str(cxx)) == base
    monkeypatch.setenv("VCXX_VERSION", "2")  # another compiler version
    assert fused.library_path(str(cxx)) != base
    monkeypatch.setenv("VCXX_VERSION", "1")
    monkeypatch.setattr(fused, "FLAGS", fused.FLAGS + ("-DEXTRA",))
    assert fused.library_path(str(cxx)) != base


@needs_kernel
@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None, reason="needs a C++ compiler")
def test_changed_source_builds_a_new_library_atomically_and_it_runs(fresh_build, tmp_path, monkeypatch):
    # a real build (about 5 s): the changed source gets its own library, nothing temporary is left,
    # a second load in a fresh process-cache reuses it, and a backend decodes through it
    monkeypatch.delenv("CXX", raising=False)
    copy = tmp_path / "src" / "attention.cpp"
    copy.parent.mkdir()
    for f in fused.sources()[1:]:  # the tiled kernel's files beside it
        shutil.copyfile(f, copy.parent / f.name)
    copy.write_bytes(fused.SOURCE.read_bytes() + b"\n// a comment: another cache key\n")
    monkeypatch.setattr(fused, "SOURCE", copy)
    lib, why = fused.load()
    assert why is None and lib is not None
    built = fused.library_path(fused.compiler())  # type: ignore[arg-type]
    assert sorted(p.name for p in fresh_build.iterdir()) == [built.name, fused.sidecar_path(built).name]
    assert leftovers(fresh_build) == []
    assert stat.S_IMODE(os.stat(built).st_mode) == 0o755  # usable from a cache shared between users
    assert fused.verify(built) is None
    stamp = os.stat(built).st_mtime_ns
    fused.load.cache_clear()
    again, why = fused.load()
    assert why is None and again is not None and os.stat(built).st_mtime_ns == stamp  # loaded, not rebuilt
    s = make(dtype=F16, head_dim=64, seed=71, layer_kw=dict(sinks=torch.linspace(-1.0, 1.0, 8)))
    assert s.backend._fused is again
    run_and_check(s, decode_batch(s, LENS))
    assert_fused_ran(s)


@pytest.mark.skipif(not KERNEL_HOST, reason="the fused kernel is built for x86-64 Linux only")
@pytest.mark.parametrize("kv_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_fp8_widening_is_exact_for_every_byte(kv_dtype):
    """Every one of the 256 fp8 encodings (subnormals, ±0, the largest, NaN, e5m2's ±inf) is widened
    by the kernel to the value torch gives it. One request sees a cached key whose score dominates by
    200 (its weight is exactly 1 in float32) and whose V row holds all 256 bytes, so a float32 output
    row is the kernel's widening of that row (times a unit scale)."""
    s = make(dtype=F32, kv_dtype=kv_dtype, kv_heads=1, group=1, head_dim=256, seed=71)
    assert s.backend.fused_fits(torch.empty(1, 1, 256), s.layer) is None
    batch = decode_batch(s, [2])  # one cached key (position 0) and the new token
    slot = int(s.cache.req_to_token[7, 0])
    every = torch.arange(256, dtype=torch.uint8)
    k_row = torch.zeros(1, 1, 256).to(kv_dtype)
    k_row[0, 0, 0] = 16.0  # score 16 * q[0]; q[0] = 200 / 16 / scaling keeps the new token's score at 0
    s.cache.set_kv(0, torch.tensor([slot]), k_row, every.view(kv_dtype).view(1, 1, 256), stored=True)
    q = torch.zeros(1, 1, 256)
    q[0, 0, 0] = 200.0 / 16.0 / s.layer.scaling
    k_new = torch.zeros(1, 1, 256)
    v_new = torch.zeros(1, 1, 256)
    s.backend.init_forward_metadata(batch)
    out = s.backend.forward(q, k_new, v_new, s.layer, batch, save_kv_cache=False)
    expected = every.view(kv_dtype).float()
    got = out.reshape(256)
    nan = torch.isnan(expected)
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(got[~nan], expected[~nan]), "a widened fp8 value differs from torch's"


@pytest.mark.skipif(not KERNEL_HOST or shutil.which("g++") is None, reason="needs g++ on x86-64 Linux")
def test_the_portable_build_without_avx512_is_correct_too(fresh_build, monkeypatch):
    """The kernel built for a CPU without AVX-512 (``-march=x86-64-v3``: AVX2) takes the portable code
    paths (vector-extension widening of fp8, float32 scores for bf16 instead of ``vdpbf16ps``); this
    machine runs that build, so the paths CPUs without AVX-512 take are tested here for real."""
    monkeypatch.setattr(fused, "FLAGS", tuple("-march=x86-64-v3" if f == "-march=native" else f for f in fused.FLAGS))
    lib, why = fused.load()
    assert why is None and lib is not None
    assert "x86-64-v3" in " ".join(fused.FLAGS) and len(list(fresh_build.glob("*.so"))) == 1
    for dtype, kv_dtype, group in ((BF16, None, 4), (torch.float16, None, 3), (F32, E4M3, 2), (BF16, E5M2, 4)):
        s = make(dtype=dtype, kv_dtype=kv_dtype, group=group, head_dim=64, scales=(0.375, 1.75), seed=81)
        run_and_check(s, decode_batch(s, LENS))
        assert_fused_ran(s)
    test_fp8_widening_is_exact_for_every_byte(E4M3)
    test_fp8_widening_is_exact_for_every_byte(E5M2)
