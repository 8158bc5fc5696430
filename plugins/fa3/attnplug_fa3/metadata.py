"""FlashAttention-3 metadata from an ``attnplug.ForwardBatch`` (torch only; runs on any host).

FA3's ``flash_attn_with_kvcache`` reads the paged cache through:

* ``k_cache``/``v_cache``: ``[num_pages, page_size, kv_heads, dim]`` (the
  canonical slot buffers viewed page by page: page ``p`` = slots
  ``p*page_size …``);
* ``page_table``: int32 ``[batch, max_pages]``, the page holding positions
  ``j*page_size …`` of request ``b`` in column ``j`` (unused columns are 0);
* ``cache_seqlens``: int32 ``[batch]``, the KV length of each request,
  new tokens included (they are written to the cache before the call);
* ``cu_seqlens_q``: int32 ``[batch + 1]``, query offsets (varlen queries) and
  ``max_seqlen_q``;
* ``causal``: the mask is aligned bottom-right, so query ``i`` of a request
  with ``sq`` queries and ``sk`` keys sees keys ``j <= i + sk - sq`` (its
  position), and ``window_size=(left, 0)`` keeps ``j >= position - left``.

Target-verify with a custom draft mask has no FA3 mask argument, so it is
laid out one query per row (``TreeLayout``): row ``(b, a)`` lists, in a
token-granular table (the cache viewed with page size 1), exactly the slots
draft token ``a`` may see (prefix, then its visible drafts; the sliding
window already applied), and runs non-causal. This is the same kernel call
with different metadata.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from attnplug import ForwardMode

I32 = torch.int32


@dataclasses.dataclass
class TreeLayout:
    """Target-verify with a custom mask: one row per draft token, listing the slots it may see.

    ``page_table`` is token-granular (pass the cache viewed with page size
    1), ``cache_seqlens`` counts each row's visible keys, ``cu_seqlens_q`` is
    ``0 … rows``; run non-causal, without a window (it is applied here).
    """

    page_table: torch.Tensor
    cache_seqlens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    max_seqlen_q: int = 1
    causal: bool = False
    page_size: int = 1

    @property
    def max_seqlen_k(self) -> int:
        return int(self.page_table.shape[1])


def tree_layout(
    req_to_token: torch.Tensor, req_pool_indices: list[int], prefix: list[int], draft: int,
    mask: torch.Tensor, window: int | None,
) -> TreeLayout:
    """Rows ``(b, a)`` (request-major): the slots of positions ``j`` that draft ``a`` sees, in position order.

    Visible: ``j <= p + a`` (causal by position), ``j >= p + a - window``,
    and for a draft ``j = p + b``: ``mask[b_req, a, b]``.
    """
    device = req_to_token.device
    rows_slots, rows_len = [], []
    for i, (r, p) in enumerate(zip(req_pool_indices, prefix)):
        n = p + draft
        pos = torch.arange(n, device=device)
        qpos = p + torch.arange(draft, device=device)
        vis = pos[None, :] <= qpos[:, None]
        if window is not None:
            vis &= pos[None, :] >= (qpos - window)[:, None]
        vis[:, p:] &= mask[i].to(device=device, dtype=torch.bool)
        # visible positions first, in position order (a stable sort of the hidden flag)
        order = torch.sort((~vis).to(torch.int8), dim=1, stable=True).indices
        count = vis.sum(dim=1)
        slots = req_to_token[r, :n].long()[order]
        rows_slots.append(slots)
        rows_len.append(count)
    width = max((int(c.max()) for c in rows_len if c.numel()), default=0)
    table = torch.zeros(len(rows_slots) * draft, width, dtype=I32, device=device)
    for i, (slots, count) in enumerate(zip(rows_slots, rows_len)):
        keep = torch.arange(width, device=device)[None, :] < count[:, None]
        block = slots[:, :width] if slots.shape[1] >= width else torch.nn.functional.pad(slots, (0, width - slots.shape[1]))
        table[i * draft:(i + 1) * draft] = block.masked_fill(~keep, 0).to(I32)
    seqlens = torch.cat(rows_len).to(I32) if rows_len else torch.zeros(0, dtype=I32, device=device)
    return TreeLayout(table, seqlens, torch.arange(seqlens.numel() + 1, dtype=I32, device=device))


@dataclasses.dataclass
class FA3Metadata:
    """One forward's FA3 arguments, shared by every layer (see the module docstring)."""

    mode: ForwardMode
    page_size: int
    page_table: torch.Tensor
    cache_seqlens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    causal: bool = True
    #: target-verify with a custom mask: built per sliding window on first use
    tree: dict[int | None, TreeLayout] = dataclasses.field(default_factory=dict)
    _tree_args: tuple[Any, ...] | None = None

    @property
    def batch_size(self) -> int:
        return int(self.cache_seqlens.numel())

    @property
    def uses_tree(self) -> bool:
        return self._tree_args is not None

    def tree_for(self, window: int | None) -> TreeLayout:
        if self._tree_args is None:
            raise ValueError("this forward has no custom draft mask")
        if window not in self.tree:
            self.tree[window] = tree_layout(*self._tree_args, window=window)
        return self.tree[window]


def build_metadata(batch: Any, cache: Any) -> FA3Metadata | None:
    """FA3 metadata for ``batch`` over ``cache`` (``None`` for an idle batch). Once per forward.

    The pieces every paged kernel shares come from the core (``ForwardBatch.qo_indptr`` …,
    ``PagedKVCache.page_table``); FA3 adds only its tree layout for a custom draft mask.
    """
    mode = batch.forward_mode
    if mode is ForwardMode.IDLE:
        return None
    device = cache.req_to_token.device
    meta = FA3Metadata(
        mode=mode,
        page_size=cache.page_size,
        page_table=cache.page_table(batch),
        cache_seqlens=batch.seq_lens_int32(device),
        cu_seqlens_q=batch.qo_indptr(device),
        cu_seqlens_k=batch.kv_indptr(device),
        max_seqlen_q=batch.max_extend_len,
        max_seqlen_k=batch.max_seq_len,
    )
    if mode is ForwardMode.TARGET_VERIFY and batch.spec_custom_mask is not None:
        meta._tree_args = (cache.req_to_token, batch.req_pool_indices.tolist(), list(batch.extend_prefix_lens_cpu),
                           int(batch.spec_num_draft_tokens), batch.spec_custom_mask)
    return meta


def window_size(sliding_window: int | None) -> tuple[int, int]:
    """FA3's ``window_size`` for a layer: ``(left, 0)`` with a window, ``(-1, -1)`` without."""
    return (-1, -1) if sliding_window is None else (int(sliding_window), 0)
