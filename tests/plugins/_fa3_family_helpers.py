"""Shared test helpers of the fa3, trtllm_mha and intel_amx plugin tests (private; not a conftest).

* ``make_problem``: a paged KV cache full of noise with pages scattered at
  random, requests in scattered ``req_to_token`` rows, one ``ForwardBatch``
  and one layer's q/k/v; the expected output comes from
  ``attnplug.testing.reference.reference_attention`` only.
* ``attend64``: the float64 attention arithmetic the kernel emulators share
  (scores, bottom-right-aligned causal/window masks, soft-cap, sinks). Each
  emulator does its own reading of its library's layout and calls this for
  the arithmetic only.
* hand-built hosts and a registry holding one real plugin (through its entry
  point) plus ``attnplug-torch-native``.
"""

from __future__ import annotations

import math
import subprocess
import sys
import types
from typing import Any, Sequence

import torch

from attnplug import ForwardBatch, ForwardMode, LayerSpec, PageAllocator, PagedKVCache
from attnplug.host import HostInfo
from _problems import fill_kv_noise, visible
from attnplug.registry import Registry
from attnplug.testing.reference import reference_attention

PY = sys.executable


# -- hosts -------------------------------------------------------------------
def cuda_host(sm: int, **libs: str) -> HostInfo:
    name = {80: "A100", 86: "A10", 89: "L40S", 90: "H100", 100: "B200", 103: "B300", 120: "RTX 5090"}.get(sm, "GPU")
    return HostInfo(platform="cuda", device_name=name, compute_capability=(sm // 10, sm % 10), device_count=1,
                    libraries={"torch": "2.13.0", **{k.replace("_", "-"): v for k, v in libs.items()}})


def cpu_host(amx: bool, **libs: str) -> HostInfo:
    flags = {"avx512f", "avx512_bf16"} | ({"amx_bf16", "amx_tile", "amx_int8"} if amx else set())
    return HostInfo(platform="cpu", cpu_flags=frozenset(flags),
                    libraries={"torch": "2.13.0", **{k.replace("_", "-"): v for k, v in libs.items()}})


def rocm_host(**libs: str) -> HostInfo:
    return HostInfo(platform="rocm", gfx_arch="gfx942", device_count=1,
                    libraries={"torch": "2.13.0", **{k.replace("_", "-"): v for k, v in libs.items()}})


def registry(dist: str, host: HostInfo | None = None) -> Registry:
    """A fresh registry with ``dist`` and attnplug-torch-native, found through their real entry points."""
    return Registry.discover(env={"ATTNPLUG_PLUGINS": f"{dist},attnplug-torch-native"}, host=host)


def imports_after(module: str) -> set[str]:
    """Top-level modules present in ``sys.modules`` after importing ``module`` in a fresh interpreter."""
    code = f"import sys, {module}; print(' '.join(sorted({{m.split('.')[0] for m in sys.modules}})))"
    out = subprocess.run([PY, "-c", code], capture_output=True, text=True, check=True).stdout
    return set(out.split())


# -- problems ----------------------------------------------------------------
def make_problem(
    *,
    mode: ForwardMode = ForwardMode.EXTEND,
    prefix: Sequence[int] = (0, 5, 17),
    ext: Sequence[int] = (7, 3, 1),
    page_size: int = 16,
    dtype: torch.dtype = torch.float16,  # the three plugins claim float16/bfloat16 only
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    v_head_dim: int | None = None,
    window: int | None = None,
    cap: float | None = None,
    sinks: bool = False,
    custom_mask: bool = False,
    seed: int = 0,
    kv_dtype: torch.dtype | None = None,
    kv_scales: tuple[float, float] = (1.0, 1.0),
) -> types.SimpleNamespace:
    """One layer's problem. Decode: ``ext`` must be all ones; target-verify: all equal (the draft count).

    ``kv_dtype`` fp8: the cache stores fp8 with the layer's ``kv_scales`` (prefix values ~ N(0, 1) after
    dequantization), and q holds values e4m3 represents exactly, so a kernel path that quantizes q
    with scale 1 computes what the reference computes from the unquantized q."""
    g = torch.Generator().manual_seed(seed)
    prefix, ext = list(prefix), list(ext)
    seq = [p + e for p, e in zip(prefix, ext)]
    B = len(seq)
    need = sum(math.ceil(s / page_size) for s in seq)
    num_pages = 2 * need + 3
    max_requests = 2 * B + 3
    cache = PagedKVCache(1, num_pages, num_kv_heads, head_dim, v_head_dim=v_head_dim, page_size=page_size,
                         dtype=kv_dtype or dtype, max_requests=max_requests, max_context_len=max(seq) + page_size)
    kb, vb = fill_kv_noise(cache, g, dtype, kv_scales)
    cache.req_to_token.fill_(-1)  # nothing may read an unassigned position
    alloc = PageAllocator(num_pages, shuffle=True, seed=seed + 1)
    rows = torch.randperm(max_requests, generator=g)[:B].tolist()
    for r, s in zip(rows, seq):
        cache.assign_pages(r, s, alloc.alloc(math.ceil(s / page_size)))
    loc = torch.cat([cache.req_to_token[r, p:s] for r, p, s in zip(rows, prefix, seq)] or
                    [torch.zeros(0, dtype=torch.int64)])
    if mode is ForwardMode.DECODE:
        assert all(e == 1 for e in ext)
        batch = ForwardBatch.decode(rows, seq, loc)
    else:
        kw: dict[str, Any] = {}
        if mode is ForwardMode.TARGET_VERIFY:
            d = ext[0]
            kw["spec_num_draft_tokens"] = d
            if custom_mask:
                m = torch.rand(B, d, d, generator=g) < 0.6
                m |= torch.eye(d, dtype=torch.bool)[None]
                kw["spec_custom_mask"] = m
        batch = ForwardBatch.extend(rows, prefix, ext, loc, mode=mode, **kw)
    T = sum(ext)
    Dv = v_head_dim or head_dim
    q = torch.randn(T, num_heads, head_dim, generator=g)
    q = (q.to(torch.float8_e4m3fn) if cache.quantized else q).to(dtype)
    k = torch.randn(T, num_kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(T, num_kv_heads, Dv, generator=g).to(dtype)
    layer = LayerSpec(0, num_heads, num_kv_heads, head_dim, v_head_dim=v_head_dim, sliding_window=window,
                      logit_cap=cap, sinks=_bf16_exact(torch.randn(num_heads, generator=g)) if sinks else None)
    before = (kb.clone(), vb.clone())
    expected = reference_attention(q, k, v, layer, batch, before[0], before[1], cache.req_to_token,
                                   *cache.kv_scales(0))
    return types.SimpleNamespace(cache=cache, batch=batch, layer=layer, q=q, k=k, v=v, before=before,
                                 expected=expected, rows=rows, prefix=prefix, ext=ext, seq=seq, page_size=page_size)


def _bf16_exact(x: torch.Tensor) -> torch.Tensor:
    """Sink values bfloat16 represents exactly: fa3 hands sinks to the kernel in bfloat16 (sgl-kernel's
    check), so the float64 reference and the emulated kernel see the same numbers."""
    return x.to(torch.bfloat16).to(torch.float32)


def pages_of(cache: PagedKVCache, row: int, length: int) -> list[int]:
    """Independent expectation: the page of positions ``j*page_size …`` of a request, from its first slot."""
    ps = cache.page_size
    return [int(cache.req_to_token[row, j * ps]) // ps for j in range(math.ceil(length / ps))]


# -- the shared float64 arithmetic of the emulators -------------------------------
def attend64(
    q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, *, scale: float, causal: bool, left: int = -1,
    right: int = -1, softcap: float = 0.0, sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """``q`` ``[sq, H, D]`` over ``K``/``V`` ``[sk, Hkv, *]`` in float64, masks aligned bottom-right.

    Query ``i`` sits at key index ``i + sk - sq``; ``causal`` hides keys after
    it, ``left``/``right`` (``-1``: unlimited) bound the keys before/after it.
    Query head ``h`` uses KV head ``h // (H // Hkv)``. A row with nothing
    visible is 0.
    """
    sq, H = q.shape[0], q.shape[1]
    sk, Hkv = K.shape[0], K.shape[1]
    G = H // Hkv
    Kh = K.double().repeat_interleave(G, dim=1)
    Vh = V.double().repeat_interleave(G, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.double(), Kh) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    vis = visible(sq, sk, causal, left, right)
    s = s.masked_fill(~vis[None], -math.inf)
    m = s.amax(dim=2) if sk else torch.full((H, sq), -math.inf, dtype=torch.float64)
    snk = None if sinks is None else sinks.double()[:, None]
    if snk is not None:
        m = torch.maximum(m, snk.expand_as(m))
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w = torch.exp(s - m[:, :, None])
    den = w.sum(dim=2)
    if snk is not None:
        den = den + torch.exp(snk - m)
    o = torch.einsum("hqk,khd->qhd", w, Vh)
    den = den.transpose(0, 1)[:, :, None]
    return torch.where(den > 0, o / den.clamp_min(1e-300), torch.zeros_like(o))


def context(p: types.SimpleNamespace, host: HostInfo, *, config: Any = None, dtype: Any = None,
            **kw: Any) -> Any:
    """The build context of problem ``p`` on ``host``: its layer's heads and head dim, its page size and
    cache (``dtype``: default q's dtype; ``kw``: more ``BuildContext`` fields)."""
    from attnplug import AttentionConfig, BuildContext

    return BuildContext(config=config or AttentionConfig(), host=host, dtype=p.q.dtype if dtype is None else dtype,
                        num_heads=p.layer.num_heads, num_kv_heads=p.layer.num_kv_heads, head_dim=p.layer.head_dim,
                        page_size=p.page_size, kv_cache=p.cache, max_context_len=p.cache.max_context_len, **kw)


def forward(backend: Any, p: types.SimpleNamespace, save: bool = True) -> torch.Tensor:
    """``init_forward_metadata`` of ``p``'s batch, then its mode's forward (``forward_decode`` for DECODE,
    ``forward_extend`` otherwise) on ``p``'s q/k/v."""
    backend.init_forward_metadata(p.batch)
    fwd = backend.forward_decode if p.batch.forward_mode is ForwardMode.DECODE else backend.forward_extend
    return fwd(p.q, p.k, p.v, p.layer, p.batch, save_kv_cache=save)


def assert_written_at_loc_only(p: types.SimpleNamespace, save: bool) -> None:
    """After a forward of ``p``: its new K/V at ``out_cache_loc`` when ``save`` (nothing written otherwise),
    every other slot as it was before."""
    kb, vb = p.cache.get_kv(0)
    loc = p.batch.out_cache_loc
    if save:
        assert torch.equal(kb[loc], p.k) and torch.equal(vb[loc], p.v)
        kb[loc], vb[loc] = p.before[0][loc], p.before[1][loc]
    assert torch.equal(kb, p.before[0]) and torch.equal(vb, p.before[1])


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype | None = None) -> None:
    """``got`` within the suite's tolerance for ``dtype`` (default: ``got``'s dtype) of the float64 ``want``."""
    from attnplug.dtypes import dtype_name
    from attnplug.testing.tolerances import tolerance_for

    tol = tolerance_for(dtype_name(dtype or got.dtype))
    g, w = got.double(), want.double()
    assert g.shape == w.shape, f"shape {tuple(g.shape)} != {tuple(w.shape)}"
    err = (g - w).abs() - tol.rtol * w.abs()
    assert float(err.max()) <= tol.atol if err.numel() else True, f"max excess error {float(err.max())}"


# -- the declared KV-dtype rule ------------------------------------------------------------
#: The core's reason for a bfloat16 model over a float16 cache on a backend declaring
#: ``kv_cache_dtype_follows_model`` (fa3, trtllm_mha and intel_amx all do).
KV_FOLLOWS_MODEL = ("kv_cache_dtype=float16 with dtype=bfloat16: a non-fp8 KV cache must be in the model dtype "
                    "(kv_cache_dtype_follows_model)")


def check_kv_follows_model(dist: str, name: str, host: HostInfo, backend: Any, *, page_size: int = 16) -> None:
    """A bfloat16 model with a float16 cache is refused by ``name``'s declared capability everywhere it is
    asked: resolution moves away (and a pinned half is a ``ConfigError``), ``Registry.build`` refuses before
    the factory runs, and the built ``backend`` answers it in ``not_supported_reasons``. The same model
    with a cache in its own dtype resolves to ``name``."""
    import pytest

    from attnplug import AttentionConfig, BuildContext
    from attnplug.errors import ConfigError, NotSupportedError
    from attnplug.resolution import resolve, trace

    reg = registry(dist, host)
    assert reg.get(name).capabilities.kv_cache_dtype_follows_model is True
    assert resolve(AttentionConfig(dtype="bfloat16", kv_cache_dtype="bfloat16"), host=host,
                   registry=reg).pair == (name, name)
    moved = resolve(AttentionConfig(dtype="bfloat16", kv_cache_dtype="float16"), host=host, registry=reg)
    assert name not in moved.pair and KV_FOLLOWS_MODEL in moved.rejected()[name]
    pinned = trace(AttentionConfig(attention_backend=name, dtype="bfloat16", kv_cache_dtype="float16"),
                   host=host, registry=reg)
    assert isinstance(pinned.error, ConfigError) and KV_FOLLOWS_MODEL in str(pinned.error)
    ctx = BuildContext(config=AttentionConfig(), host=host, dtype="bfloat16", kv_cache_dtype="float16",
                       num_heads=4, num_kv_heads=2, head_dim=64, page_size=page_size)
    with pytest.raises(NotSupportedError) as exc:
        reg.build(name, ctx)
    assert KV_FOLLOWS_MODEL in str(exc.value)
    layer = LayerSpec(0, 4, 2, 64)
    assert KV_FOLLOWS_MODEL in backend.not_supported_reasons(layer, backend.ctx.replace(
        dtype="bfloat16", kv_cache_dtype="float16", kv_cache=None))
    assert not any("kv_cache_dtype" in r for r in backend.not_supported_reasons(layer, backend.ctx.replace(
        dtype="bfloat16", kv_cache_dtype="bfloat16", kv_cache=None)))
