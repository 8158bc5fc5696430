"""Problem pieces the GPU plugins' tests share (private: not a conftest).

``visible`` is the key mask of the flash-attention style emulators (causal, window ``(left, right)``).
``check_mla_no_save`` checks a ``save_kv_cache=False`` MLA forward, ``check_mla_refused`` a refused one. ``latent_problem`` builds one batch over a latent cache (``v_head_dim=0``: one row of
``kv_lora_rank + qk_rope_head_dim`` per token) on shuffled pages, requests in pool rows 3, 8, …
(not batch order), prefixes ending mid-page; each test file keeps a thin wrapper choosing its
kernel's defaults and the shape of what it returns.
"""

from __future__ import annotations

import types
from typing import Any, Sequence

import pytest
import torch

from attnplug import ForwardBatch, ForwardMode, LayerSpec, PageAllocator, PagedKVCache
from attnplug.errors import NotSupportedError
from attnplug.layer import MLASpec
from attnplug.testing.reference import reference_mla


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


def latent_problem(prefix: Sequence[int], ext: Sequence[int], *, mode: ForwardMode = ForwardMode.EXTEND,
                   page_size: int = 16, heads: int = 8, dtype: torch.dtype = torch.bfloat16,
                   kv_dtype: torch.dtype | None = None, layers: int = 1, rank: int = 512, rope: int = 64,
                   garbage: bool = False, fp8_scale: float | None = None, custom_mask: torch.Tensor | None = None,
                   seed: int = 0) -> types.SimpleNamespace:
    """Requests with ``prefix`` cached tokens extending by ``ext`` (DECODE: ``ext`` all ones).

    Every slot holds noise; with ``garbage`` it is large (x1000) everywhere but the requests' prefixes
    (slots a request does not own must never reach an output). ``fp8_scale``: the latent scale of
    every layer where the cache is fp8. ``custom_mask``: target-verify's ``spec_custom_mask``.
    Returns ``cache``, ``batch``, ``layers`` (one ``LayerSpec`` per layer), ``q`` and ``latents``
    (this forward's latent rows, one tensor per layer)."""
    g = torch.Generator().manual_seed(seed)
    width = rank + rope
    seq = [p + e for p, e in zip(prefix, ext)]
    b = len(seq)
    pages = sum(-(-s // page_size) for s in seq) + 3
    cache = PagedKVCache(layers, pages, 1, width, v_head_dim=0, page_size=page_size, dtype=kv_dtype or dtype,
                         max_requests=2 * b + 6, max_context_len=max(seq) + page_size)
    if fp8_scale is not None and cache.quantized:
        for lid in range(layers):
            cache.set_latent_scale(lid, fp8_scale)
    alloc = PageAllocator(pages, shuffle=True, seed=seed)
    rows = [(3 + 5 * i) % (2 * b + 6) for i in range(b)]
    for r, s in zip(rows, seq):
        cache.assign_pages(r, s, alloc.alloc(-(-s // page_size)))
    every = torch.arange(cache.num_slots)
    for lid in range(layers):
        cache.set_latent(lid, every, (1e3 if garbage else 1.0) * torch.randn(cache.num_slots, 1, width, generator=g))
        if garbage:
            for r, p in zip(rows, prefix):
                if p:
                    cache.set_latent(lid, cache.req_to_token[r, :p], torch.randn(p, 1, width, generator=g))
    loc = torch.cat([cache.req_to_token[r, p:s] for r, p, s in zip(rows, prefix, seq)])
    if mode is ForwardMode.DECODE:
        assert all(e == 1 for e in ext), f"a DECODE batch extends by one token, not {list(ext)}"
        batch = ForwardBatch.decode(rows, seq, loc)
    else:
        kw = {}
        if mode is ForwardMode.TARGET_VERIFY:
            kw["spec_num_draft_tokens"] = ext[0]
            if custom_mask is not None:
                kw["spec_custom_mask"] = custom_mask
        batch = ForwardBatch.extend(rows, list(prefix), list(ext), loc, mode=mode, **kw)
    specs = [LayerSpec(lid, heads, 1, width, mla=MLASpec(rank, 128, rope, 128)) for lid in range(layers)]
    tokens = sum(ext)
    q = torch.randn(tokens, heads, width, generator=g).to(dtype)
    latents = [torch.randn(tokens, 1, width, generator=g).to(dtype) for _ in range(layers)]
    return types.SimpleNamespace(cache=cache, batch=batch, layers=specs, q=q, latents=latents)


def check_mla_no_save(backend: Any, cache: PagedKVCache, batch: ForwardBatch, layer: LayerSpec, q: torch.Tensor,
                      latent: torch.Tensor, tol: float = 2e-2) -> None:
    """One forward with ``save_kv_cache=False``: the output equals ``reference_mla`` over the latent as it was
    (within ``tol``, absolute and relative), and the latent cache is unchanged."""
    before = cache.read_latent(0)
    expect = reference_mla(q, latent, layer, batch, before, cache.req_to_token)
    backend.init_forward_metadata(batch)
    out = backend.forward(q, latent, None, layer, batch, save_kv_cache=False)
    torch.testing.assert_close(out.double(), expect, atol=tol, rtol=tol)
    assert torch.equal(cache.read_latent(0), before)


def check_mla_refused(backend: Any, cache: PagedKVCache, batch: ForwardBatch, layer: LayerSpec, q: torch.Tensor,
                      latent: torch.Tensor, words: str) -> None:
    """The forward raises ``NotSupportedError`` matching ``words`` (a regex) and leaves the latent cache unchanged."""
    before = cache.read_latent(0)
    backend.init_forward_metadata(batch)
    with pytest.raises(NotSupportedError, match=words):
        backend.forward(q, latent, None, layer, batch)
    assert torch.equal(cache.read_latent(0), before)
