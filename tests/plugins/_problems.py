"""Problem pieces the GPU plugins' tests share (private: not a conftest).

``visible`` is the key mask of the flash-attention style emulators (causal, window ``(left, right)``);
``attend64`` the float64 attention arithmetic every kernel emulator (fa3, trtllm_mha, intel_amx, flashinfer,
aiter) shares: each emulator reads its library's layout and calls it for the arithmetic only.
``check_mla_no_save`` checks a ``save_kv_cache=False`` MLA forward, ``check_mla_refused`` a refused one.
``latent_problem`` asks the conformance suite's MLA builder (``attnplug.testing.suite.mla_problem``) for
one batch over a latent cache (``v_head_dim=0``: one row of ``kv_lora_rank + qk_rope_head_dim`` per
token) on shuffled pages, requests in random pool rows; each test file keeps a thin wrapper choosing
its kernel's defaults and the shape of what it returns.
"""

from __future__ import annotations

import math
import types
from typing import Any, Sequence

import pytest
import torch

from attnplug import ForwardBatch, ForwardMode, LayerSpec, PagedKVCache
from attnplug.errors import NotSupportedError
from attnplug.testing.reference import reference_mla
from attnplug.testing.suite.harness import same_bytes


def visible(queries: int, keys: int, causal: bool, left: int, right: int) -> torch.Tensor:
    """``[queries, keys]``: which keys each query sees, the queries being a request's last ``queries``
    positions (bottom-right aligned) under a causal mask (``causal``) and a window of ``left`` keys
    before and ``right`` after (-1: unbounded), as flash-attention's ``window_size`` means them."""
    pos = keys - queries + torch.arange(queries)[:, None]
    j = torch.arange(keys)[None, :]
    vis = torch.ones(queries, keys, dtype=torch.bool)
    if causal:
        vis &= j <= pos
    if left >= 0:
        vis &= j >= pos - left
    if right >= 0:
        vis &= j <= pos + right
    return vis


def attend64(
    q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, *, scale: float, causal: bool, left: int = -1,
    right: int = -1, softcap: float = 0.0, sinks: torch.Tensor | None = None, mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """``q`` ``[sq, H, D]`` over ``K``/``V`` ``[sk, Hkv, *]`` in float64, masks aligned bottom-right.

    Query ``i`` sits at key index ``i + sk - sq``; ``causal`` hides keys after
    it, ``left``/``right`` (``-1``: unlimited) bound the keys before/after it;
    ``mask`` (``[sq, sk]`` bool, e.g. a draft tree's) hides the keys it is False at.
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
    if mask is not None:
        vis &= mask
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

def latent_problem(prefix: Sequence[int], ext: Sequence[int], *, mode: ForwardMode = ForwardMode.EXTEND,
                   page_size: int = 16, heads: int = 8, dtype: torch.dtype = torch.bfloat16,
                   kv_dtype: torch.dtype | None = None, layers: int = 1, rank: int = 512, rope: int = 64,
                   garbage: bool = False, fp8_scale: float | None = None, tree: bool = False,
                   seed: int = 0) -> types.SimpleNamespace:
    """Requests with ``prefix`` cached tokens extending by ``ext`` (DECODE: ``ext`` all ones), asked of the
    conformance suite's MLA builder (``mla_problem.make_mla_problem``, absorbed form): noise in every
    latent slot, requests in random ``req_to_token`` rows on shuffled pages.

    ``garbage``: NaN in every slot no request owns (such a slot must never reach an output). ``fp8_scale``:
    the latent scale of every layer where the cache is fp8. ``tree``: a target-verify batch with a random
    tree mask (``spec_custom_mask``: each draft sees itself and a random subset of earlier drafts).
    Returns ``cache``, ``batch``, ``layers`` (one ``LayerSpec`` per layer, with decompression weights),
    ``q`` and ``latents`` (this forward's latent rows, one tensor per layer)."""
    from attnplug.dtypes import dtype_name
    from attnplug.layer import ABSORBED
    from attnplug.testing.suite.cases import Case, Scenario, Shape
    from attnplug.testing.suite.mla_problem import make_mla_problem

    if mode is ForwardMode.DECODE:
        assert all(e == 1 for e in ext), f"a DECODE batch extends by one token, not {list(ext)}"
    verify = mode is ForwardMode.TARGET_VERIFY
    sc = Scenario("plugin_mla", mode.value, tuple(prefix), tuple(ext), draft=ext[0] if verify else None,
                  custom_mask=tree and verify)
    kv = kv_dtype or dtype
    quantized = kv.itemsize == 1
    case = Case("plugin_mla", f"seed{seed}", sc, dtype=dtype_name(dtype), page_size=page_size,
                shape=Shape("plugin_mla", heads, 1, rank + rope, rank),
                kv_cache_dtype=None if kv_dtype is None else dtype_name(kv_dtype),
                kv_scales=(fp8_scale, fp8_scale) if quantized and fp8_scale is not None else None,
                garbage="nan" if garbage else None, mla_form=ABSORBED)
    p = make_mla_problem(case, "cpu", dims=(rank, 128, rope, 128), num_layers=layers)
    return types.SimpleNamespace(cache=p.cache, batch=p.batch, layers=list(p.layers), q=p.q, latents=list(p.latents))


def check_mla_no_save(backend: Any, cache: PagedKVCache, batch: ForwardBatch, layer: LayerSpec, q: torch.Tensor,
                      latent: torch.Tensor, tol: float = 2e-2) -> None:
    """One forward with ``save_kv_cache=False``: the output equals ``reference_mla`` over the latent as it was
    (within ``tol``, absolute and relative), and the latent cache is unchanged (byte for byte)."""
    before = cache.read_latent(0)
    expect = reference_mla(q, latent, layer, batch, before, cache.req_to_token)
    backend.init_forward_metadata(batch)
    out = backend.forward(q, latent, None, layer, batch, save_kv_cache=False)
    torch.testing.assert_close(out.double(), expect, atol=tol, rtol=tol)
    assert same_bytes(cache.read_latent(0), before)  # byte for byte: NaN garbage compares equal to itself


def check_mla_refused(backend: Any, cache: PagedKVCache, batch: ForwardBatch, layer: LayerSpec, q: torch.Tensor,
                      latent: torch.Tensor, words: str) -> None:
    """The forward raises ``NotSupportedError`` matching ``words`` (a regex) and leaves the latent cache unchanged (byte for byte)."""
    before = cache.read_latent(0)
    backend.init_forward_metadata(batch)
    with pytest.raises(NotSupportedError, match=words):
        backend.forward(q, latent, None, layer, batch)
    assert same_bytes(cache.read_latent(0), before)  # byte for byte: NaN garbage compares equal to itself
