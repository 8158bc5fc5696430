"""The paged problem the kernel tests build their batches on (torch_native, triton).

``make_setup`` makes one paged KV cache with noise in every slot (a read of a wrong slot shows), a
backend over it (built through the registry, or constructed directly with the test's keyword
arguments) and the layers; ``make_batch`` places each request of a batch on scattered pages
(``PageAllocator(shuffle=True)``) and builds the ``ForwardBatch``; ``qkv`` draws a forward's inputs and
``run_and_check`` runs one forward on them, checked by ``tests.forward_check.forward_and_check``. The conformance suite's
harness builds its problems from suite cases; a kernel test chooses its batches one by one (request
rows, prefixes ending mid-page, several batches over one cache), so it builds them here.
``small_setup`` is the small float32 cache and registry-built backend the batch-checking tests (a batch
changed after ``init_forward_metadata``, ``ForwardBatch.decode`` from host ints) share.
``assert_claims_every_feature`` asks a built backend's ``not_supported_reasons`` about a layer using every
optional feature.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import torch

from attnplug import AttentionConfig, BuildContext, ForwardBatch, ForwardMode, HostInfo, LayerSpec, PageAllocator
from attnplug import PagedKVCache
from attnplug.dtypes import dtype_name
from attnplug.registry import default_registry
from tests.forward_check import forward_and_check


@dataclasses.dataclass
class Setup:
    cache: PagedKVCache
    alloc: PageAllocator
    backend: Any
    layers: list[LayerSpec]
    dtype: torch.dtype
    gen: torch.Generator


def make_setup(
    name: str, construct: Callable[[BuildContext], Any], *, host: HostInfo, page_size: int, heads: int,
    kv_heads: int, head_dim: int, v_head_dim: int | None, dtype: torch.dtype, kv_dtype: torch.dtype | None,
    num_layers: int, seed: int, layer_kw: dict[str, Any] | None, num_pages: int, max_context_len: int,
    via_registry: bool = False, unassigned: int | None = None, canary: float | None = None,
    **ctx_kw: Any,
) -> Setup:
    """A paged cache with noise in every slot and backend ``name`` over it: built through the registry
    (``via_registry``, checked to answer ``name``) or ``construct(ctx)``.

    ``unassigned``: what ``req_to_token`` holds at positions no page was assigned to (default the
    cache's own ``UNASSIGNED``, -1). ``canary``: each K/V buffer becomes a view into a larger tensor
    whose rows just before slot 0 and after the last slot hold this value, so a load through a
    negative or too-large slot index (an unmasked ``-1``) shows in the output. ``ctx_kw``: more
    ``BuildContext`` fields (e.g. ``max_workspace_bytes``)."""
    gen = torch.Generator().manual_seed(seed)
    kv_dtype = kv_dtype or dtype
    cache = PagedKVCache(num_layers, num_pages, kv_heads, head_dim, v_head_dim=v_head_dim, page_size=page_size,
                         dtype=kv_dtype, max_requests=8, max_context_len=max_context_len)
    if canary is not None:
        margin = 4 * page_size
        for bufs in (cache.k_buffers, cache.v_buffers):
            for i, buf in enumerate(bufs):
                big = torch.full((buf.shape[0] + 2 * margin, *buf.shape[1:]), canary, dtype=kv_dtype)
                bufs[i] = big[margin:margin + buf.shape[0]]
    for buf in cache.k_buffers + cache.v_buffers:  # noise everywhere: reading a wrong slot shows
        buf.copy_(torch.randn(buf.shape, generator=gen).to(kv_dtype))
    if unassigned is not None:
        cache.req_to_token.fill_(unassigned)
    ctx = BuildContext(
        config=AttentionConfig(attention_backend=name), host=host, dtype=dtype_name(dtype),
        kv_cache_dtype=dtype_name(kv_dtype), num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        v_head_dim=v_head_dim, page_size=page_size, kv_cache=cache, max_batch_size=8,
        max_context_len=max_context_len, **ctx_kw,
    )
    if via_registry:
        built, backend = default_registry().build(name, ctx)
        assert built == name
    else:
        backend = construct(ctx)
    layers = [LayerSpec(i, heads, kv_heads, head_dim, v_head_dim=v_head_dim, **(layer_kw or {}))
              for i in range(num_layers)]
    return Setup(cache, PageAllocator(num_pages, shuffle=True, seed=seed + 1), backend, layers, dtype, gen)


def small_setup(name: str, *, num_layers: int, lens: dict[int, int], heads: int = 4, kv_heads: int = 2,
                head_dim: int = 8, page_size: int = 4, num_pages: int = 16, max_context_len: int = 32,
                seed: int = 0) -> Setup:
    """A small float32 cache (noise in every slot) and backend ``name`` built through the registry on a
    plain CPU host, with request rows ``lens`` (``{row: length}``) placed on scattered pages."""
    s = make_setup(name, _no_construct, host=HostInfo(platform="cpu"), page_size=page_size, heads=heads,
                   kv_heads=kv_heads, head_dim=head_dim, v_head_dim=None, dtype=torch.float32, kv_dtype=None,
                   num_layers=num_layers, seed=seed, layer_kw=None, num_pages=num_pages,
                   max_context_len=max_context_len, via_registry=True)
    place(s, list(lens), list(lens.values()))
    return s


def _no_construct(ctx: BuildContext) -> Any:
    raise AssertionError("small_setup builds through the registry")


def place(s: Setup, req_ids: Sequence[int], seq_lens: Sequence[int]) -> None:
    """Give each request scattered pages covering ``seq_lens`` positions."""
    ps = s.cache.page_size
    for r, n in zip(req_ids, seq_lens):
        s.cache.assign_pages(r, n, s.alloc.alloc((n + ps - 1) // ps))


def new_slots(s: Setup, req_ids: Sequence[int], prefix: Sequence[int], ext: Sequence[int]) -> torch.Tensor:
    """The slots ``req_to_token`` maps each request's new positions to, in batch order."""
    parts = [s.cache.req_to_token[r, p:p + e] for r, p, e in zip(req_ids, prefix, ext)]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


def make_batch(s: Setup, mode: ForwardMode, prefix: Sequence[int], ext: Sequence[int],
               req_ids: Sequence[int] | None = None, **kw: Any) -> ForwardBatch:
    """Requests (default pool rows 7, 6, …: not 0..B-1) with ``prefix`` cached positions extending by
    ``ext`` on scattered pages; ``encoder_lens`` (a list) maps that many positions at least."""
    req_ids = list(req_ids if req_ids is not None else [7 - i for i in range(len(prefix))])
    enc = kw.get("encoder_lens", [0] * len(req_ids))
    place(s, req_ids, [max(p + e, n_enc) for p, e, n_enc in zip(prefix, ext, enc)])
    loc = new_slots(s, req_ids, prefix, ext)
    if "encoder_lens" in kw:
        kw["encoder_lens"] = torch.tensor(kw["encoder_lens"], dtype=torch.int64)
    if mode is ForwardMode.DECODE:
        return ForwardBatch.decode(req_ids, [p + 1 for p in prefix], loc, **kw)
    return ForwardBatch.extend(req_ids, prefix, ext, loc, mode=mode, **kw)


def qkv(s: Setup, layer: LayerSpec, tokens: int, with_kv: bool = True,
        q_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """A forward's q (times ``q_scale``) and, ``with_kv``, its new k/v, drawn from the setup's generator."""
    g = s.gen
    q = (torch.randn(tokens, layer.num_heads, layer.head_dim, generator=g) * q_scale).to(s.dtype)
    if not with_kv:
        return q, None, None
    k = torch.randn(tokens, layer.num_kv_heads, layer.head_dim, generator=g).to(s.dtype)
    v = torch.randn(tokens, layer.num_kv_heads, layer.v_head_dim, generator=g).to(s.dtype)
    return q, k, v


def run_and_check(s: Setup, batch: ForwardBatch, layer: LayerSpec | None = None, *, with_kv: bool = True,
                  save: bool = True, init: bool = True, q_scale: float = 1.0,
                  inputs: tuple[Any, Any, Any] | None = None, edit: Callable[..., Any] | None = None) -> torch.Tensor:
    """One forward of the setup's backend on ``layer`` (default the first) with drawn inputs (``qkv``) or
    ``inputs``, checked by ``forward_and_check``; ``edit(q, k, v)`` may change the inputs in place first."""
    layer = layer or s.layers[0]
    q, k, v = inputs or qkv(s, layer, batch.num_tokens, with_kv, q_scale)
    if edit is not None:
        edit(q, k, v)
    return forward_and_check(s.backend, s.cache, layer, batch, q, k, v, dtype=s.dtype, save=save, init=init)


def assert_claims_every_feature(backend: Any, *, fp8: str, refused: dict[str, str]) -> None:
    """``backend.not_supported_reasons`` gives no reason for a layer using every optional feature (MQA, a V
    head dim of its own, a window, soft-cap, sinks, cross-attention), over the backend's own context and
    over an ``fp8`` KV cache (the suite family fp8_kv); over its context with the fields ``refused``
    (``{field: value}``, no cache) some reason names the first of them as ``field=value``."""
    layer = LayerSpec(0, 8, 1, 40, v_head_dim=24, sliding_window=3, logit_cap=30.0, sinks=torch.zeros(8),
                      is_cross_attention=True)
    ctx = backend.ctx
    assert backend.not_supported_reasons(layer, ctx) == []
    assert backend.not_supported_reasons(layer, ctx.replace(kv_cache=None, kv_cache_dtype=fp8)) == []
    field, value = next(iter(refused.items()))
    reasons = backend.not_supported_reasons(layer, ctx.replace(kv_cache=None, **refused))
    assert any(f"{field}={value}" in r for r in reasons), reasons
