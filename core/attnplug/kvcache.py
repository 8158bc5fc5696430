"""The canonical paged KV cache.

Per layer, one K and one V buffer indexed by *slot*: ``k[layer]`` is
``[num_slots, num_kv_heads, head_dim]`` and ``v[layer]`` is
``[num_slots, num_kv_heads, v_head_dim]``. Slots are grouped in pages of
``page_size`` consecutive slots; page ``p`` holds slots
``p*page_size … p*page_size + page_size - 1``. ``req_to_token[r, i]`` is the
slot of request ``r``'s token at position ``i``; within a request, positions
``i`` and ``i+1`` in the same page occupy consecutive slots, so a position's
offset in its page is ``i % page_size``.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch

from .dtypes import dtype_name, torch_dtype
from .errors import ShapeError


class PagedKVCache:
    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        v_head_dim: int | None = None,
        page_size: int = 1,
        dtype: str | torch.dtype = "float32",
        device: str | torch.device = "cpu",
        max_requests: int = 64,
        max_context_len: int = 4096,
    ) -> None:
        if page_size < 1 or num_pages < 1 or num_layers < 1:
            raise ValueError(
                f"PagedKVCache needs num_layers, num_pages and page_size >= 1 "
                f"(got {num_layers}, {num_pages}, {page_size})"
            )
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_slots = num_pages * page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.v_head_dim = v_head_dim or head_dim
        self.dtype = torch_dtype(dtype)
        self.dtype_name = dtype_name(dtype)
        self.device = torch.device(device)
        self.k_buffers = [
            torch.zeros(self.num_slots, num_kv_heads, head_dim, dtype=self.dtype, device=self.device)
            for _ in range(num_layers)
        ]
        self.v_buffers = [
            torch.zeros(self.num_slots, num_kv_heads, self.v_head_dim, dtype=self.dtype, device=self.device)
            for _ in range(num_layers)
        ]
        self.req_to_token = torch.zeros(max_requests, max_context_len, dtype=torch.int64, device=self.device)

    @property
    def max_context_len(self) -> int:
        return self.req_to_token.shape[1]

    def get_kv(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_buffers[layer_id], self.v_buffers[layer_id]

    def set_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write ``k``/``v`` (``[n, heads, dim]``) into the slots ``loc`` (``[n]``) of one layer."""
        kb, vb = self.k_buffers[layer_id], self.v_buffers[layer_id]
        if k.shape[1:] != kb.shape[1:] or v.shape[1:] != vb.shape[1:]:
            raise ShapeError(
                f"KV-cache write for layer {layer_id}: k {tuple(k.shape)} / v {tuple(v.shape)} "
                f"do not match cache rows {tuple(kb.shape[1:])} / {tuple(vb.shape[1:])}"
            )
        kb[loc] = k.to(kb.dtype)
        vb[loc] = v.to(vb.dtype)

    @contextlib.contextmanager
    def staged(
        self,
        layer_id: int,
        loc: torch.Tensor,
        k: torch.Tensor | None = None,
        v: torch.Tensor | None = None,
        *,
        keep: bool = True,
    ) -> Iterator[None]:
        """Write ``k``/``v`` at ``loc`` (when given) for the duration of the block.

        With ``keep=False`` the rows at ``loc`` are restored afterwards, so the
        cache is unchanged on return: how a ``save_kv_cache=False`` forward runs
        a kernel that reads the new K/V only from the cache (or writes them itself).
        """
        kb, vb = self.get_kv(layer_id)
        old = None if keep else (kb[loc].clone(), vb[loc].clone())
        if k is not None:
            self.set_kv(layer_id, loc, k, v)
        try:
            yield
        finally:
            if old is not None:
                kb[loc] = old[0]
                vb[loc] = old[1]

    # -- slot assignment helpers (engines have their own; tests, doctor and benchmarks use these) --
    def assign_pages(
        self,
        req_index: int,
        length: int,
        pages: Sequence[int],
        start: int = 0,
    ) -> None:
        """Point positions ``start … length-1`` of request ``req_index`` at ``pages``.

        ``pages[i]`` is the page holding positions ``i*page_size …``; ``start``
        lets a request grow without touching the positions it already has.
        """
        ps = self.page_size
        needed = (length + ps - 1) // ps
        if len(pages) < needed:
            raise ValueError(f"request {req_index} needs {needed} pages for {length} tokens, got {len(pages)}")
        if length > self.max_context_len:
            raise ValueError(f"length {length} exceeds max_context_len={self.max_context_len}")
        pos = torch.arange(start, length, device=self.device)
        page_ids = torch.as_tensor(list(pages), dtype=torch.int64, device=self.device)
        self.req_to_token[req_index, start:length] = page_ids[pos // ps] * ps + pos % ps

    def slots(self, req_index: int, start: int, end: int) -> torch.Tensor:
        return self.req_to_token[req_index, start:end]


class PageAllocator:
    """Hands out free pages, optionally scattered at random (for tests and benchmarks)."""

    def __init__(self, num_pages: int, *, shuffle: bool = True, seed: int = 0) -> None:
        order = list(range(num_pages))
        if shuffle:
            g = torch.Generator().manual_seed(seed)
            order = torch.randperm(num_pages, generator=g).tolist()
        self._free = order

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"out of KV-cache pages: asked for {n}, {len(self._free)} free")
        out, self._free = self._free[:n], self._free[n:]
        return out
