"""trtllm-gen (flashinfer ``trtllm_batch_*_with_kv_cache``) metadata from a ``ForwardBatch`` (torch only).

The kernels read:

* ``kv_cache``: a ``(k_cache, v_cache)`` pair, each ``[num_pages,
  kv_heads, page_size, dim]`` (layout ``HND``). The canonical slot buffers
  ``[slots, kv_heads, dim]`` are viewed ``[num_pages, page_size, kv_heads,
  dim]`` and permuted (``hnd_view``): no copy;
* ``block_tables``: int32 ``[batch, max_pages]``, the page of positions
  ``j*page_size …`` of request ``b`` in column ``j`` (unused columns 0);
* ``seq_lens``: int32 ``[batch]``, each request's KV length with the new
  tokens (written to the cache before the call);
* context (prefill) only: ``cum_seq_lens_q`` / ``cum_seq_lens_kv`` (int32
  ``[batch + 1]``), ``max_q_len``, ``max_kv_len``, ``batch_size``; the causal
  mask is aligned bottom-right (query ``i`` of ``sq`` over ``sk`` keys sits
  at key ``i + sk - sq``), ``window_left`` keeps keys ``>= position - window_left``;
* decode: one query per request, rows in batch order.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from attnplug.errors import ShapeError
from attnplug.modes import ForwardMode

I32 = torch.int32


def cu_seqlens(lens: torch.Tensor) -> torch.Tensor:
    """``[0, l0, l0+l1, …]`` as int32."""
    out = torch.zeros(lens.numel() + 1, dtype=I32, device=lens.device)
    if lens.numel():
        torch.cumsum(lens.to(I32), 0, out=out[1:])
    return out


def block_tables(
    req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, lens: torch.Tensor, max_len: int, page_size: int
) -> torch.Tensor:
    """int32 ``[batch, ceil(max_len / page_size)]``: column ``j`` holds the page of positions ``j*page_size …``
    (``req_to_token`` at ``j*page_size`` floor-divided by the page size); columns past a request's pages are 0."""
    if page_size < 1:
        raise ShapeError(f"page_size={page_size} (expected >= 1)")
    b = req_pool_indices.numel()
    pages = (max_len + page_size - 1) // page_size
    if max_len > req_to_token.shape[1]:
        raise ShapeError(f"a request needs {max_len} positions but req_to_token has {req_to_token.shape[1]} columns")
    if b == 0 or pages == 0:
        return torch.zeros(b, pages, dtype=I32, device=req_to_token.device)
    cols = torch.arange(pages, device=req_to_token.device) * page_size
    rows = req_to_token.index_select(0, req_pool_indices.to(req_to_token.device).long())[:, cols]
    valid = cols[None, :] < lens.to(req_to_token.device)[:, None]
    return torch.div(rows, page_size, rounding_mode="floor").masked_fill(~valid, 0).to(I32)


def hnd_view(buf: torch.Tensor, page_size: int) -> torch.Tensor:
    """The slot buffer ``[slots, heads, dim]`` as ``[num_pages, heads, page_size, dim]`` (a view, no copy).

    With one KV head (MQA) the permuted view has strides ``(P*D, D, D, 1)``: the head stride equals
    the token stride, the degenerate pattern for which trtllm-gen cannot build its TMA descriptor.
    The head dimension has size 1, so its stride never moves a pointer; it is set to ``P*D`` (what a
    contiguous ``[pages, 1, P, D]`` tensor has), the same memory seen through canonical strides."""
    slots, heads, dim = buf.shape
    if slots % page_size:
        raise ShapeError(f"KV buffer of {slots} slots is not a whole number of {page_size}-token pages")
    view = buf.view(slots // page_size, page_size, heads, dim).permute(0, 2, 1, 3)
    if heads == 1:
        s0, _, s2, s3 = view.stride()
        view = view.as_strided(view.shape, (s0, page_size * s2, s2, s3), view.storage_offset())
    return view


@dataclasses.dataclass
class TrtllmMetadata:
    """One forward's trtllm-gen arguments, shared by every layer (see the module docstring)."""

    mode: ForwardMode
    page_size: int
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    cum_seq_lens_q: torch.Tensor
    cum_seq_lens_kv: torch.Tensor
    max_q_len: int
    max_kv_len: int
    num_tokens: int

    @property
    def batch_size(self) -> int:
        return int(self.seq_lens.numel())

    @property
    def decode(self) -> bool:
        return self.mode is ForwardMode.DECODE


def build_metadata(batch: Any, req_to_token: torch.Tensor, page_size: int) -> TrtllmMetadata | None:
    """trtllm-gen metadata for ``batch`` (``None`` when idle). Once per forward."""
    mode = batch.forward_mode
    if mode is ForwardMode.IDLE:
        return None
    device = req_to_token.device
    req = batch.req_pool_indices.to(device)
    seq = batch.seq_lens.to(device)
    max_kv = max(batch.seq_lens_cpu, default=0)
    if mode is ForwardMode.DECODE:
        q_lens, max_q = torch.ones_like(seq), 1
    else:
        q_lens, max_q = batch.extend_seq_lens.to(device), max(batch.extend_seq_lens_cpu, default=0)
    return TrtllmMetadata(
        mode=mode, page_size=page_size,
        block_tables=block_tables(req_to_token, req, seq, max_kv, page_size),
        seq_lens=seq.to(I32), cum_seq_lens_q=cu_seqlens(q_lens), cum_seq_lens_kv=cu_seqlens(seq),
        max_q_len=max_q, max_kv_len=max_kv, num_tokens=batch.num_tokens,
    )


def window_left(sliding_window: int | None) -> int:
    """``window_left`` for a layer: the window (keys ``>= position - window``), or -1 without one."""
    return -1 if sliding_window is None else int(sliding_window)


def page_size_reasons(page_size: int, supported: tuple[int, ...]) -> list[str]:
    """Why ``page_size`` cannot be used (empty when it can)."""
    if page_size in supported:
        return []
    return [f"page_size={page_size}: trtllm-gen kernels read {'/'.join(map(str, supported))}-token pages "
            f"(resolution fills page_size=64 when it is unset; a page size you set is kept)"]
