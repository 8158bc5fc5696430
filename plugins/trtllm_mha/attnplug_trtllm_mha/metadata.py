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
from attnplug import ForwardMode

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

    @property
    def batch_size(self) -> int:
        return int(self.seq_lens.numel())

    @property
    def decode(self) -> bool:
        return self.mode is ForwardMode.DECODE


def build_metadata(batch: Any, cache: Any) -> TrtllmMetadata | None:
    """trtllm-gen metadata for ``batch`` over ``cache`` (``None`` when idle), from the core's shared
    pieces (``PagedKVCache.page_table``, ``ForwardBatch.qo_indptr`` …). Once per forward."""
    mode = batch.forward_mode
    if mode is ForwardMode.IDLE:
        return None
    device = cache.req_to_token.device
    return TrtllmMetadata(
        mode=mode, page_size=cache.page_size, block_tables=cache.page_table(batch),
        seq_lens=batch.seq_lens_int32(device), cum_seq_lens_q=batch.qo_indptr(device),
        cum_seq_lens_kv=batch.kv_indptr(device), max_q_len=batch.max_extend_len, max_kv_len=batch.max_seq_len,
    )


def window_left(sliding_window: int | None) -> int:
    """``window_left`` for a layer: the window (keys ``>= position - window``), or -1 without one."""
    return -1 if sliding_window is None else int(sliding_window)
