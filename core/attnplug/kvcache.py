"""The canonical paged KV cache.

Per layer, K and V for every *slot*, stored in one ``KVLayout`` (``kvlayout.py``;
the default ``nhd`` holds ``k[layer]`` as ``[num_slots, num_kv_heads, head_dim]``
and ``v[layer]`` as ``[num_slots, num_kv_heads, v_head_dim]``). Whatever the
layout, ``read_kv`` returns any slots token-major and ``set_kv`` writes them:
the host, the reference, the suite and doctor use only these. Slots are grouped in pages of
``page_size`` consecutive slots; page ``p`` holds slots
``p*page_size … p*page_size + page_size - 1``. ``req_to_token[r, i]`` is the
slot of request ``r``'s token at position ``i``; within a request, positions
``i`` and ``i+1`` in the same page occupy consecutive slots, so a position's
offset in its page is ``i % page_size``. A position no page was assigned to holds
``UNASSIGNED`` (-1), so reading it is an error rather than a silent read of slot 0.

Bounds: every slot index written or read goes through a check — per call in
``set_kv``/``staged`` (host code), once per forward in ``check_batch`` (backends,
which then write with ``checked=False``).

FP8 caches (``float8_e4m3fn`` / ``float8_e5m2``) carry one K and one V scale per layer
(per tensor; ``set_kv_scales``). Every write path quantizes: stored = round(x / scale)
saturated to the dtype's finite range (NaN stays NaN); a reader dequantizes: value =
stored × scale (``read_kv(..., dequantize=True)``, ``dequantize``).

MLA (latent) caches (``v_head_dim=0``, ``num_kv_heads=1``, ``head_dim = kv_lora_rank + qk_rope_head_dim``):
per token ONE latent row ``c_kv ++ k_pe`` held as the K row; V rows are empty (``[.., 1, 0]``: the
values of an MLA layer are the first ``kv_lora_rank`` entries of the latent row, docs/mla.md). The
layouts need nothing new (``nhd``: ``[num_slots, 1, head_dim]``; ``hnd``: ``[num_pages, 1, page_size,
head_dim]``; an adopted buffer holds ``num_slots * head_dim`` elements). ``read_latent`` / ``set_latent``
read and write the rows; an fp8 latent cache has ONE scale per layer (``set_latent_scale``; stored as
the K scale, with the V scale kept equal).
"""

from __future__ import annotations

import array
import contextlib
import operator
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import torch

from .dtypes import FP8_DTYPES, dtype_name, torch_dtype
from .errors import KVLayoutError, ShapeError
from .kvlayout import NHD, KVGeometry, KVLayout, check_layout

if TYPE_CHECKING:  # batch.py imports this module: annotations only
    from .batch import ForwardBatch
    from .layer import LayerSpec

__all__ = ["FP8_DTYPES", "UNASSIGNED", "PageAllocator", "PageFill", "PagedKVCache", "indptr", "quantize"]

#: ``req_to_token`` value of a position that has no slot yet
UNASSIGNED = -1
#: ``check_batch`` reads up to this many requests' ``req_to_token`` entries as slices (cheaper than the
#: vectorised gather at small batches, which are the ones whose per-forward cost shows)
_SLICED_CHECK_ROWS = 64
#: up to this many values, a bounds check reads them as host ints (``tolist``, min and max in Python: one
#: op) instead of ``aminmax`` and two syncs (three ops: a decode step's slots and a short prefix)
_HOST_CHECK_VALUES = 256
#: ``check_batch`` takes a host-made decode batch's ints (``ForwardBatch.host_ints``) instead of reading its
#: tensors back (tests switch it off to run the tensor reads on the same batch)
_USE_HOST_INTS = True


def quantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``round(x / scale)`` saturated to ``dtype``'s finite range, in ``dtype`` (NaN stays NaN)."""
    fmax = torch.finfo(dtype).max
    return (x.to(torch.float32) / scale).clamp_(-fmax, fmax).to(dtype)


def _check_scale(owner: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 < float(value) < float("inf")):
        raise ValueError(f"{owner}={value!r} (expected a positive finite number)")
    return float(value)


def _positive_int(owner: str, name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{owner}.{name}={value!r} (expected a positive integer)")
    return value


#: ``fill_from_page_table`` reads up to this many page-table entries as host ints (the used block ids kept
#: for the host-side checks that consult the record); a larger table is checked and recorded with tensor ops
_FILL_HOST_ENTRIES = 8192


class PageFill:
    """What ``PagedKVCache.fill_from_page_table`` wrote: rows ``0 .. n-1`` of ``req_to_token`` filled whole pages
    at a time from a host's page table, each request's used block ids checked in ``[0, num_pages)``.

    While it is valid (``PagedKVCache.page_fill``: the same ``req_to_token`` object, its in-place write
    counter unmoved since the fill) the positions ``0 .. lens[r]-1`` of row ``r`` hold
    ``blocks[r][p // page_size] * page_size + p % page_size``: every entry a real slot, every page of positions
    one page of consecutive slots. So the per-entry passes (bounds, page alignment) have nothing to find
    there, and the page table is ``table``. A write through torch voids it; a write around torch's counter
    (through ``.numpy()``, a raw pointer) is not seen: a host that writes ``req_to_token`` that way must not
    call ``fill_from_page_table`` (docs/reliability.md)."""

    __slots__ = ("tensor", "version", "lens", "pages", "blocks", "table", "table_version")

    def __init__(self, tensor: torch.Tensor, lens: list[int], pages: list[int], blocks: list[list[int]] | None,
                 table: torch.Tensor) -> None:
        self.tensor = tensor
        #: ``req_to_token``'s write counter after the fill
        self.version = int(tensor._version)
        #: per row ``0 .. n-1``, the positions the fill covers, and the pages they take (``ceil(len / page_size)``)
        self.lens, self.pages = lens, pages
        #: per row, its used block ids (host ints; ``None`` for a fill too large to read back)
        self.blocks = blocks
        #: int32 ``[n, max(pages)]``: the used block ids, 0 past each row's last page (``PagedKVCache.page_table``'s
        #: form, what vllm_cpu's op takes) and its write counter (a consumer writing it in place voids the record)
        self.table = table
        self.table_version = int(table._version)

    def covers(self, rows: Sequence[int], lens: Sequence[int]) -> bool:
        """Whether every ``rows[i]`` is a filled row whose first ``lens[i]`` positions the fill wrote."""
        mine, n = self.lens, len(self.lens)
        for r, x in zip(rows, lens):
            if not 0 <= r < n or x > mine[r]:
                return False
        return True

    def slot(self, row: int, pos: int, page_size: int) -> int:
        """The slot the fill mapped ``(row, pos)`` to (a covered position; ``blocks`` known)."""
        assert self.blocks is not None
        return self.blocks[row][pos // page_size] * page_size + pos % page_size

    def maps_new_tokens(self, rows: Sequence[int], starts: Sequence[int], ends: Sequence[int], loc: Sequence[int],
                        page_size: int) -> bool:
        """Whether the new tokens' slots ``loc`` (request after request, positions ``starts[i] .. ends[i]-1`` of
        ``rows[i]``) are the slots the fill mapped those positions to, compared as host ints (``blocks`` known;
        covered rows)."""
        t, n = 0, len(loc)
        for r, p, s in zip(rows, starts, ends):
            for pos in range(p, s):
                if t >= n or loc[t] != self.slot(r, pos, page_size):
                    return False
                t += 1
        return t == n

    def table_for(self, rows: Sequence[int], lens: Sequence[int], page_size: int) -> torch.Tensor:
        """int32 ``[len(rows), ceil(max(lens) / page_size)]``: the page table of covered ``rows`` / ``lens``, 0
        past each request's last page (``PagedKVCache.page_table``'s answer, without reading ``req_to_token``).
        The recorded table itself when the rows are ``0 .. n-1`` and each takes the pages it was filled with."""
        ps = page_size
        need = [-(-int(x) // ps) for x in lens]
        width = max(need, default=0)
        n = len(self.lens)
        if len(rows) == n and need == self.pages and list(rows) == list(range(n)):
            return self.table
        dev = self.table.device
        if not rows or width == 0:
            return torch.zeros(len(rows), width, dtype=torch.int32, device=dev)
        if self.blocks is None:
            idx = torch.as_tensor(list(rows), dtype=torch.int64, device=dev)
            out = self.table.index_select(0, idx)[:, :width].clone()
            cols = torch.arange(width, device=dev)
            out.masked_fill_(cols[None, :] >= torch.as_tensor(need, device=dev)[:, None], 0)
            return out.contiguous()
        flat: list[int] = []
        for r, u in zip(rows, need):
            flat.extend(self.blocks[r][:u])
            flat.extend([0] * (width - u))
        return _int32_tensor(flat, dev).view(len(rows), width)


def _int32_tensor(values: list[int], device: torch.device) -> torch.Tensor:
    """An int32 tensor of host ints through an ``array`` buffer (on CPU; ``torch.tensor`` elsewhere)."""
    if device.type == "cpu" and values:
        return torch.frombuffer(array.array("i", values), dtype=torch.int32)
    return torch.tensor(values, dtype=torch.int32, device=device)


def _not_inference() -> Any:
    """``torch.inference_mode(False)`` as torch's own guard (what that context manager's ``__enter__`` makes),
    entered directly: ~0.3 µs against ~1.1 µs for the Python context manager; the latter where a torch build
    has no such guard. Tensors made under it keep write counters even when a host runs under inference mode."""
    guard = getattr(torch._C, "_InferenceMode", None)
    return torch.inference_mode(False) if guard is None else guard(False)


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
        layout: str | KVLayout = NHD,
        buffers: Sequence[torch.Tensor] | None = None,
    ) -> None:
        """``buffers``: adopt memory a host engine allocated instead of allocating (one contiguous
        tensor per layer of ``num_pages * page_size * num_kv_heads * (head_dim + v_head_dim)``
        elements in ``dtype`` on ``device``; ``KVLayout.wrap`` views it in the layout, no copy)."""
        for field, value in (
            ("num_layers", num_layers), ("num_pages", num_pages), ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim), ("page_size", page_size), ("max_requests", max_requests),
            ("max_context_len", max_context_len),
        ):
            _positive_int("PagedKVCache", field, value)
        if v_head_dim is not None and v_head_dim != 0:  # 0: a latent (MLA) cache, K rows only
            _positive_int("PagedKVCache", "v_head_dim", v_head_dim)
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_slots = num_pages * page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.v_head_dim = head_dim if v_head_dim is None else v_head_dim
        #: an MLA latent cache (``v_head_dim == 0``): one latent row per token, no V rows
        self.latent = self.v_head_dim == 0
        if self.latent and num_kv_heads != 1:
            raise ValueError(f"PagedKVCache: a latent (MLA) cache (v_head_dim=0) has one latent row per token: "
                             f"num_kv_heads={num_kv_heads}, expected 1")
        self.dtype = torch_dtype(dtype)
        self.dtype_name = dtype_name(dtype)
        self.device = torch.device(device)
        #: how every layer's K/V are arranged (``kvlayout.KVLayout``); ``layout.name`` is what backends declare
        self.layout = check_layout(layout)
        self.geometry = KVGeometry(num_pages, page_size, num_kv_heads, head_dim, self.v_head_dim)
        #: whether K/V are stored quantized (an fp8 dtype): writes quantize with the layer's scales
        self.quantized = self.dtype_name in FP8_DTYPES
        # per layer, the K and V scales (1.0 until ``set_kv_scales``; fp8 caches only); read them through
        # ``k_scales`` / ``v_scales`` / ``kv_scales`` (read-only: a scale changes only through set_kv_scales)
        self._k_scales = [1.0] * num_layers
        self._v_scales = [1.0] * num_layers
        problems = self.layout.geometry_reasons(self.geometry)
        if problems:
            raise ValueError(f"PagedKVCache: layout {self.layout.name!r} cannot hold this cache: {'; '.join(problems)}")
        if buffers is None:
            self._storage = [self.layout.allocate(self.geometry, self.dtype, self.device) for _ in range(num_layers)]
        else:
            self._storage = self._adopt(buffers)
        #: ``[max_requests, max_context_len]`` int64: slot of (request row, position); ``UNASSIGNED`` where none.
        #: A normal tensor even when the cache is made under ``torch.inference_mode`` (as hosts build it): its
        #: in-place write counter is what voids a ``PageFill`` record and what the per-layer guard reads
        with torch.inference_mode(False):
            self.req_to_token = torch.full(
                (max_requests, max_context_len), UNASSIGNED, dtype=torch.int64, device=self.device
            )
        #: the last ``fill_from_page_table`` (``None``: none, or voided); read it through ``page_fill``
        self._fill: PageFill | None = None
        self._page_offsets: torch.Tensor | None = None  # arange(page_size), for the fill's write

    def _adopt(self, buffers: Sequence[torch.Tensor]) -> list[tuple[torch.Tensor, ...]]:
        buffers = list(buffers)
        if len(buffers) != self.num_layers:
            raise ValueError(f"PagedKVCache: {len(buffers)} buffers given for num_layers={self.num_layers}")
        for i, b in enumerate(buffers):
            if not isinstance(b, torch.Tensor) or b.dtype != self.dtype or b.device != self.device:
                got = f"{b.dtype} on {b.device}" if isinstance(b, torch.Tensor) else type(b).__name__
                raise ValueError(f"PagedKVCache: buffers[{i}] is {got}, expected {self.dtype} on {self.device}")
        return [self.layout.wrap(self.geometry, b) for b in buffers]

    @property
    def k_scales(self) -> tuple[float, ...]:
        """Per layer, the K scale (a tuple: change one with ``set_kv_scales``, which validates it)."""
        return tuple(self._k_scales)

    @property
    def v_scales(self) -> tuple[float, ...]:
        """Per layer, the V scale (a tuple: change one with ``set_kv_scales``, which validates it)."""
        return tuple(self._v_scales)

    @property
    def k_buffers(self) -> list[torch.Tensor]:
        """Per layer, the K buffer ``[num_slots, num_kv_heads, head_dim]`` (the ``nhd`` layout only)."""
        self._require_nhd("k_buffers")
        return [s[0] for s in self._storage]

    @property
    def v_buffers(self) -> list[torch.Tensor]:
        """Per layer, the V buffer ``[num_slots, num_kv_heads, v_head_dim]`` (the ``nhd`` layout only)."""
        self._require_nhd("v_buffers")
        return [s[1] for s in self._storage]

    def _require_nhd(self, what: str) -> None:
        if self.layout.name != NHD:
            raise KVLayoutError(
                f"PagedKVCache.{what} is the token-major storage of the {NHD!r} layout, but this cache is in layout "
                f"{self.layout.name!r}: read slots with read_kv(layer_id, slots), write with set_kv, or reach "
                f"the layout's own storage with layer_storage(layer_id)")

    @property
    def max_context_len(self) -> int:
        """Positions per request row of ``req_to_token``."""
        return self.req_to_token.shape[1]

    @property
    def max_requests(self) -> int:
        """Request rows of ``req_to_token``."""
        return self.req_to_token.shape[0]

    # -- checks ------------------------------------------------------------------
    def check_layer_id(self, layer_id: int) -> None:
        """``layer_id`` is an integer in ``[0, num_layers)`` (negative ids never wrap)."""
        if isinstance(layer_id, bool) or not isinstance(layer_id, int) or not 0 <= layer_id < self.num_layers:
            raise ShapeError(
                f"layer_id={layer_id!r} is out of range for this KV cache (expected 0 <= layer_id < "
                f"num_layers={self.num_layers})"
            )

    def check_layer_rows(self, layer: LayerSpec) -> None:
        """The cache rows of ``layer`` match its KV heads and head dims (an MLA layer: a latent cache of
        its row width; any other layer: not a latent cache)."""
        mla = getattr(layer, "mla", None)
        if mla is not None or self.latent:
            lid = layer.layer_id
            if mla is None:
                raise ShapeError(f"kv_cache is a latent (MLA) cache (v_head_dim=0) but layer {lid} is not an MLA "
                                 f"layer (LayerSpec.mla is None)")
            if not self.latent or self.head_dim != layer.head_dim:
                raise ShapeError(
                    f"kv_cache rows for MLA layer {lid} are k {(self.num_kv_heads, self.head_dim)} / v "
                    f"{(self.num_kv_heads, self.v_head_dim)}, expected a latent cache: k (1, "
                    f"{layer.head_dim}) / v (1, 0) (PagedKVCache(num_kv_heads=1, head_dim=kv_lora_rank + "
                    f"qk_rope_head_dim, v_head_dim=0))")
            return
        want_k = (layer.num_kv_heads, layer.head_dim)
        want_v = (layer.num_kv_heads, layer.v_head_dim)
        if (self.num_kv_heads, self.head_dim) != want_k or (self.num_kv_heads, self.v_head_dim) != want_v:
            raise ShapeError(
                f"kv_cache rows for layer {layer.layer_id} are k {(self.num_kv_heads, self.head_dim)} / "
                f"v {(self.num_kv_heads, self.v_head_dim)}, expected {want_k} / {want_v} "
                f"(num_kv_heads, head_dim / v_head_dim)"
            )

    def check_slots(self, loc: torch.Tensor, field: str = "out_cache_loc") -> None:
        """Every slot in ``loc`` is in ``[0, num_slots)``; the error names ``field``, the value and the bound."""
        if not isinstance(loc, torch.Tensor):
            raise ShapeError(f"{field} is a {type(loc).__name__}, expected an integer tensor of slot indices")
        if loc.dtype.is_floating_point or loc.dtype.is_complex or loc.dtype == torch.bool:
            raise ShapeError(f"{field} has dtype {loc.dtype}, expected an integer tensor of slot indices")
        n = loc.numel()
        if n == 0:
            return
        if n <= _HOST_CHECK_VALUES and loc.device.type == "cpu":
            vals = loc.tolist()
            lo, hi = min(vals), max(vals)
        else:
            lo_t, hi_t = torch.aminmax(loc)
            lo, hi = int(lo_t), int(hi_t)
        if lo < 0 or hi >= self.num_slots:
            bad = lo if lo < 0 else hi
            where = int((loc == bad).nonzero()[0, 0])
            raise ShapeError(
                f"{field}[{where}]={bad} is out of range (expected 0 <= slot < num_slots={self.num_slots})"
            )

    def check_batch(self, batch: ForwardBatch, *, new_tokens_mapped: bool = False) -> None:
        """Every index ``batch`` will use is in bounds for this cache (one pass; call once per forward).

        Checks ``req_pool_indices`` against the rows, ``out_cache_loc`` against the slots,
        ``seq_lens``/``encoder_lens`` against ``max_context_len``, and that every position a
        request reads from the cache (its cached prefix; its encoder tokens; with
        ``new_tokens_mapped`` also its new tokens, which must map to ``out_cache_loc``) holds a
        real slot. Errors name the field, the request, the bad value and the bound.
        """
        b: Any = batch
        req = b.req_pool_indices
        if req.dtype.is_floating_point or req.dtype == torch.bool:
            raise ShapeError(f"req_pool_indices has dtype {req.dtype}, expected an integer tensor")
        changed = getattr(b, "changed_since_validate", None)
        # a decode batch made from host ints and unchanged since (``ForwardBatch.host_ints``): its rows, lengths
        # and slots are those ints, so they are bounded here without reading the tensors back (the same checks
        # below, on the same values); any other batch is read back and compared with its host copies
        known = b.host_ints() if _USE_HOST_INTS and hasattr(b, "host_ints") else None
        host_loc: list[int] | None = None
        if known is not None:
            rows, _, host_loc = known
            if changed is not None and changed() is not None:  # another field (positions …) was changed
                b.validate()
        elif ((rows := req.tolist()) != getattr(b, "req_pool_indices_cpu", rows)
              or b.seq_lens.tolist() != b.seq_lens_cpu or (changed is not None and changed() is not None)):
            # the tensors changed after validate() (an engine reusing a batch object): the host copies
            # backends read are stale, so derive and check them again rather than trust them
            b.validate()
        for i, r in enumerate(rows):
            if not 0 <= r < self.max_requests:
                raise ShapeError(
                    f"req_pool_indices[{i}]={r} is out of range (expected 0 <= row < "
                    f"max_requests={self.max_requests} rows of req_to_token)"
                )
        if host_loc is None or (host_loc and (min(host_loc) < 0 or max(host_loc) >= self.num_slots)):
            self.check_slots(b.out_cache_loc, "out_cache_loc")  # reads the tensor; names a bad slot
        L = self.max_context_len
        for i, s in enumerate(b.seq_lens_cpu):
            if s > L:
                raise ShapeError(f"request {i}: seq_lens={s} exceeds max_context_len={L} of the KV cache")
        enc = None
        if b.encoder_lens is not None:
            enc = [int(x) for x in b.encoder_lens.tolist()]
            for i, e in enumerate(enc):
                if not 0 <= e <= L:
                    raise ShapeError(f"request {i}: encoder_lens={e} is out of range (expected 0 <= len <= {L})")
        if not rows:
            return
        # cached positions each request reads: [0, prefix) (and [0, enc) for cross-attention)
        read = list(b.extend_prefix_lens_cpu)
        if enc is not None:
            read = [max(p, e) for p, e in zip(read, enc)]
        upto = [s if new_tokens_mapped else p for s, p in zip(b.seq_lens_cpu, read)]
        width = max(upto, default=0)
        # rows filled from a host's page table and not written since (``page_fill``): every entry they cover is
        # a real slot by construction (block ids checked in range at the fill), nothing to read
        fill = self.page_fill(rows, upto) if width else None
        if fill is not None:
            width = 0
        if width and len(rows) <= _SLICED_CHECK_ROWS:
            # few requests: their entries as slices of req_to_token, one cat and one min/max (a handful of
            # ops whatever the batch); the vectorised pass below runs only to name a bad entry
            r2t = self.req_to_token
            parts = [r2t[r, :u] for r, u in zip(rows, upto) if u]
            if len(parts) == 1 and upto[0] <= _HOST_CHECK_VALUES and r2t.device.type == "cpu":
                host = parts[0].tolist()  # one request's short prefix (a decode step at batch 1)
                lo, hi = min(host), max(host)
            else:
                vals = parts[0] if len(parts) == 1 else torch.cat(parts)
                lo_t, hi_t = torch.aminmax(vals)
                lo, hi = int(lo_t), int(hi_t)
            if lo >= 0 and hi < self.num_slots:
                width = 0
        if width:
            dev = self.req_to_token.device
            idx = torch.as_tensor(rows, dtype=torch.int64, device=dev)
            table = self.req_to_token.index_select(0, idx)[:, :width]
            lens = torch.as_tensor(upto, dtype=torch.int64, device=dev)
            used = torch.arange(width, device=dev)[None, :] < lens[:, None]
            bad = used & ((table < 0) | (table >= self.num_slots))
            if bool(bad.any()):
                i, pos = (int(x) for x in bad.nonzero()[0])
                val = int(table[i, pos])
                what = "is unassigned (-1)" if val == UNASSIGNED else f"is out of range (num_slots={self.num_slots})"
                raise ShapeError(
                    f"request {i} (req_to_token row {rows[i]}): position {pos} < seq/prefix length {upto[i]} "
                    f"maps to slot {val}, which {what}; assign pages for every position a forward reads"
                )
        if new_tokens_mapped and b.num_tokens and self._new_tokens_filled(b, rows, host_loc):
            return
        if new_tokens_mapped and b.num_tokens:
            starts = [0]
            for e in b.extend_seq_lens_cpu:
                starts.append(starts[-1] + e)
            dev = self.req_to_token.device
            mapped = torch.cat([
                self.req_to_token[r, p:s] for r, p, s in zip(rows, b.extend_prefix_lens_cpu, b.seq_lens_cpu)
            ])
            if not torch.equal(mapped, b.out_cache_loc.to(dev)):
                t = int((mapped != b.out_cache_loc.to(dev)).nonzero()[0, 0])
                i = max(j for j in range(len(rows)) if starts[j] <= t)
                raise ShapeError(
                    f"request {i}: new token {t} is written to out_cache_loc[{t}]={int(b.out_cache_loc[t])} but "
                    f"req_to_token maps its position to slot {int(mapped[t])}; this backend reads new tokens "
                    f"through req_to_token, so map them before the forward"
                )

    def _new_tokens_filled(self, b: Any, rows: list[int], host_loc: list[int] | None) -> bool:
        """Whether every new token's position maps to its ``out_cache_loc``, answered on host ints from a valid
        ``page_fill`` covering the batch (``False``: not known that way; the tensor comparison runs and names
        a mismatch)."""
        fill = self.page_fill(rows, b.seq_lens_cpu)
        if fill is None or fill.blocks is None:
            return False
        loc = host_loc
        if loc is None:
            if b.num_tokens > _HOST_CHECK_VALUES or b.out_cache_loc.device.type != "cpu":
                return False
            loc = b.out_cache_loc.tolist()
        return fill.maps_new_tokens(rows, b.extend_prefix_lens_cpu, b.seq_lens_cpu, loc, self.page_size)

    # -- access --------------------------------------------------------------------
    def get_kv(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The K and V buffers of one layer: ``[num_slots, num_kv_heads, head_dim / v_head_dim]``.

        The storage itself (writes through it are cache writes), for the ``nhd`` layout only; a
        ``KVLayoutError`` names the cache's layout otherwise (use ``read_kv``/``set_kv``).
        """
        self.check_layer_id(layer_id)
        self._require_nhd("get_kv")
        kb, vb = self._storage[layer_id]
        return kb, vb

    def layer_storage(self, layer_id: int) -> tuple[torch.Tensor, ...]:
        """The raw storage of one layer in this cache's layout (for the backend that owns the layout)."""
        self.check_layer_id(layer_id)
        return self._storage[layer_id]

    def read_kv(self, layer_id: int, slots: torch.Tensor | None = None, *,
                dequantize: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """K ``[n, num_kv_heads, head_dim]`` and V ``[n, num_kv_heads, v_head_dim]`` of ``slots`` (an integer
        tensor or a list of ints; every slot when ``None``), token-major, as new tensors, whatever the layout. Slots are bounds-checked.

        The stored values, in the cache dtype; ``dequantize=True`` returns float32 values (stored ×
        the layer's scale for an fp8 cache)."""
        self.check_layer_id(layer_id)
        if slots is None:
            slots = torch.arange(self.num_slots, device=self.device)
        else:
            slots = _slot_indices(slots, "read_kv slots")
            self.check_slots(slots, "slots")
            slots = slots.to(device=self.device, dtype=torch.int64).reshape(-1)
        k, v = self.layout.read(self._storage[layer_id], self.geometry, slots)
        return self.dequantize(layer_id, k, v) if dequantize else (k, v)

    def read_latent(self, layer_id: int, slots: torch.Tensor | None = None, *,
                    dequantize: bool = False) -> torch.Tensor:
        """The latent rows ``[n, 1, head_dim]`` of ``slots`` of a latent (MLA) cache (``read_kv``'s K)."""
        self._require_latent("read_latent")
        return self.read_kv(layer_id, slots, dequantize=dequantize)[0]

    def set_latent(self, layer_id: int, loc: torch.Tensor, latent: torch.Tensor, *, checked: bool = True,
                   stored: bool = False) -> None:
        """Write latent rows ``[n, 1, head_dim]`` at ``loc`` of a latent cache (``set_kv`` with empty V)."""
        self._require_latent("set_latent")
        self.set_kv(layer_id, loc, latent, None, checked=checked, stored=stored)

    def set_latent_scale(self, layer_id: int, scale: float) -> None:
        """The one scale of an fp8 latent layer (kept as both its K and V scale)."""
        self._require_latent("set_latent_scale")
        self.set_kv_scales(layer_id, scale, scale)

    def _require_latent(self, what: str) -> None:
        if not self.latent:
            raise KVLayoutError(f"PagedKVCache.{what} reads a latent (MLA) cache, but this cache has V rows "
                                f"(v_head_dim={self.v_head_dim}); an MLA cache is built with v_head_dim=0")

    # -- fp8: scales, quantize, dequantize ---------------------------------------------
    def set_kv_scales(self, layer_id: int, k_scale: float, v_scale: float) -> None:
        """The K and V scales of one layer (positive finite numbers; fp8 caches only: another dtype
        stores values as they are, and a scale it would ignore is an error)."""
        self.check_layer_id(layer_id)
        k_scale = _check_scale(f"layer {layer_id} k_scale", k_scale)
        v_scale = _check_scale(f"layer {layer_id} v_scale", v_scale)
        if self.latent and k_scale != v_scale:
            raise ValueError(f"layer {layer_id}: a latent (MLA) cache has one scale per layer (set_latent_scale); "
                             f"got k_scale={k_scale}, v_scale={v_scale}")
        if not self.quantized and (k_scale, v_scale) != (1.0, 1.0):
            raise ValueError(f"KV scales apply to fp8 caches ({', '.join(FP8_DTYPES)}); this cache stores "
                             f"{self.dtype_name}, which would ignore k_scale={k_scale}, v_scale={v_scale}")
        self._k_scales[layer_id], self._v_scales[layer_id] = k_scale, v_scale

    def kv_scales(self, layer_id: int) -> tuple[float, float]:
        """``(k_scale, v_scale)`` of one layer (1.0, 1.0 unless set)."""
        self.check_layer_id(layer_id)
        return self._k_scales[layer_id], self._v_scales[layer_id]

    def quantize(self, layer_id: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``k``/``v`` as this cache stores them for ``layer_id``: quantized with its scales for fp8,
        else converted to the cache dtype."""
        if not self.quantized:
            return k.to(self.dtype), v.to(self.dtype)
        return (quantize(k, self._k_scales[layer_id], self.dtype), quantize(v, self._v_scales[layer_id], self.dtype))

    def dequantize(self, layer_id: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Stored ``k``/``v`` as float32 values (× the layer's scales for fp8)."""
        if not self.quantized:
            return k.to(torch.float32), v.to(torch.float32)
        return (k.to(torch.float32) * self._k_scales[layer_id], v.to(torch.float32) * self._v_scales[layer_id])

    def set_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, *,
               checked: bool = True, stored: bool = False) -> None:
        """Write ``k``/``v`` (``[n, heads, dim]``) into the slots ``loc`` (``[n]``) of one layer (a latent
        cache: ``v`` may be ``None``, its rows are empty).

        Values are quantized as the cache stores them (``quantize``); ``stored=True`` writes values
        that already are stored values (a ``read_kv`` snapshot being restored) as they are.
        ``checked=False`` skips the slot-range check (one reduction) for callers that validated
        ``loc`` already, as ``PagedBackend`` does once per forward.
        """
        self.check_layer_id(layer_id)
        if v is None and self.latent:
            v = k.new_empty((k.shape[0], 1, 0))
        rows_k, rows_v = (self.num_kv_heads, self.head_dim), (self.num_kv_heads, self.v_head_dim)
        if v is None or tuple(k.shape[1:]) != rows_k or tuple(v.shape[1:]) != rows_v or k.shape[0] != loc.shape[0] \
                or v.shape[0] != loc.shape[0]:
            raise ShapeError(
                f"KV-cache write for layer {layer_id}: k {tuple(k.shape)} / v {None if v is None else tuple(v.shape)} at "
                f"{tuple(loc.shape)} slots do not match cache rows {rows_k} / {rows_v}"
            )
        if checked:
            self.check_slots(loc, "loc")
        if stored or not self.quantized:
            if k.dtype != self.dtype or v.dtype != self.dtype:
                k, v = k.to(self.dtype), v.to(self.dtype)
        else:
            k, v = self.quantize(layer_id, k, v)
        storage = self._storage[layer_id]
        if loc.dtype != torch.int64:
            loc = loc.to(torch.int64)
        if self.layout.name == NHD:  # the hot path: two indexed copies, no layout call
            if self.quantized:  # index_copy_ has no fp8 kernel on CPU; indexed assignment does
                storage[0][loc] = k
                storage[1][loc] = v
            else:
                storage[0].index_copy_(0, loc, k)
                storage[1].index_copy_(0, loc, v)
            return
        self.layout.write(storage, self.geometry, loc, k, v)

    def snapshot(self, layer_id: int, loc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored K/V rows at ``loc`` (int64 slots, already bounds-checked) of one layer, as copies:
        what ``set_kv(layer_id, loc, *old, stored=True)`` puts back (``staged``, ``PagedBackend``)."""
        return self.layout.read(self._storage[layer_id], self.geometry, loc)

    @contextlib.contextmanager
    def staged(
        self,
        layer_id: int,
        loc: torch.Tensor,
        k: torch.Tensor | None = None,
        v: torch.Tensor | None = None,
        *,
        keep: bool = True,
        checked: bool = True,
    ) -> Iterator[None]:
        """Write ``k``/``v`` at ``loc`` (when given) for the duration of the block.

        The rows at ``loc`` are restored afterwards when ``keep=False`` (how a
        ``save_kv_cache=False`` forward runs a kernel that reads the new K/V only from the
        cache) and whenever the block raises, so a failed forward leaves the cache as it was.
        """
        self.check_layer_id(layer_id)
        if checked:
            self.check_slots(loc, "loc")
        loc = loc.to(torch.int64)
        old = self.snapshot(layer_id, loc)
        if k is not None:
            self.set_kv(layer_id, loc, k, v, checked=False)
        try:
            yield
        except BaseException:
            self.set_kv(layer_id, loc, *old, checked=False, stored=True)
            raise
        if not keep:
            self.set_kv(layer_id, loc, *old, checked=False, stored=True)

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
        self._check_row(req_index)
        if not 0 <= start <= length:
            raise ValueError(f"request {req_index}: start={start} must satisfy 0 <= start <= length={length}")
        bad = [p for p in list(pages)[:needed] if not 0 <= int(p) < self.num_pages]
        if bad:
            raise ValueError(f"request {req_index}: page {bad[0]} is out of range (num_pages={self.num_pages})")
        pos = torch.arange(start, length, device=self.device)
        page_ids = torch.as_tensor(list(pages), dtype=torch.int64, device=self.device)
        self.req_to_token[req_index, start:length] = page_ids[pos // ps] * ps + pos % ps

    def fill_from_page_table(self, table: torch.Tensor, lens: Sequence[int]) -> PageFill:
        """Point rows ``0 .. n-1`` of ``req_to_token`` (``n = len(lens)``) at a host's page table, whole pages at a
        time: position ``p`` of row ``i`` -> ``table[i, p // page_size] * page_size + p % page_size`` for the
        ``ceil(lens[i] / page_size)`` pages request ``i`` uses (vLLM's block table, ``slot_mapping``'s pages).

        The used block ids (each request's first ``ceil(lens[i] / page_size)`` columns; later columns are not
        read, whatever they hold) are checked in ``[0, num_pages)`` first: a bad one is a ``ShapeError`` naming
        the request, the column, the id and the bound, and nothing is written. The fill is recorded
        (``PageFill``, returned and read through ``page_fill``): while ``req_to_token`` is not written again
        through torch, the per-forward checks (``check_batch``, ``check_page_aligned``, a backend's page
        table) take the covered entries as in range and page-aligned by construction instead of reading each
        one. Positions past ``lens[i]`` of a filled row point into page 0 (never read by a forward the fill
        covers). A host that writes ``req_to_token`` around torch (``.numpy()``, a raw pointer) must not use
        the fill: such a write does not move the counter that voids the record."""
        prev, self._fill = self.page_fill(), None
        if not isinstance(table, torch.Tensor) or table.dim() != 2 or table.dtype.is_floating_point \
                or table.dtype.is_complex or table.dtype == torch.bool:
            got = f"{table.dtype} {tuple(table.shape)}" if isinstance(table, torch.Tensor) else type(table).__name__
            raise ShapeError(f"fill_from_page_table: the page table is {got}, expected a 2-D integer tensor "
                             f"[requests, pages]")
        lens = [operator.index(x) for x in lens]
        n, ps, L = len(lens), self.page_size, self.max_context_len
        if n > self.max_requests or n > table.shape[0]:
            raise ShapeError(f"fill_from_page_table: {n} requests, but req_to_token has {self.max_requests} rows "
                             f"and the page table {table.shape[0]}")
        for i, x in enumerate(lens):
            if not 0 <= x <= L:
                raise ShapeError(f"fill_from_page_table: request {i}: length {x} is out of range (expected 0 <= "
                                 f"length <= max_context_len={L})")
        pages = [-(-x // ps) for x in lens]
        width = max(pages, default=0)
        if width > table.shape[1]:
            i = pages.index(width)
            raise ShapeError(f"fill_from_page_table: request {i} needs {width} pages for {lens[i]} positions, but "
                             f"the page table has {table.shape[1]} columns")
        with _not_inference():  # the recorded table keeps a write counter (see ``PageFill.table_version``)
            return self._fill_rows(table, lens, n, pages, width, prev)

    def _fill_rows(self, table: torch.Tensor, lens: list[int], n: int, pages: list[int], width: int,
                   prev: PageFill | None) -> PageFill:
        ps, L = self.page_size, self.max_context_len
        dev, P = self.req_to_token.device, self.num_pages
        blocks: list[list[int]] | None = None
        if n * width <= _FILL_HOST_ENTRIES:  # read once as ints: checked, kept, and the table made from them
            # (a short table is read whole, one op, no slice: vLLM's is [max_num_seqs, max pages per request])
            host = table.tolist()[:n] if table.numel() <= 2 * n * width + 64 else table[:n, :width].tolist()
            blocks, flat = [], []
            for i, (ids, u) in enumerate(zip(host, pages)):
                ids = ids[:u]
                if ids and (min(ids) < 0 or max(ids) >= P):
                    self._bad_block(i, ids, P)
                blocks.append(ids)
                flat.extend(ids)
                flat.extend([0] * (width - u))
            if prev is not None and prev.blocks == blocks:
                # the same requests on the same pages as the last fill, which nothing has written over since (a
                # decode step that opened no page): every position below each request's pages already holds
                # its slot, so nothing is written and the record covers the new lengths
                self._fill = rec = PageFill(self.req_to_token, lens, pages, blocks, prev.table)
                return rec
            pt = _int32_tensor(flat, dev).view(n, width) if flat else torch.zeros(n, width, dtype=torch.int32,
                                                                                 device=dev)
        else:
            used = table[:n, :width]
            cols = torch.arange(width, device=used.device)
            unused = cols[None, :] >= torch.as_tensor(pages, device=used.device)[:, None]
            masked = used.masked_fill(unused, 0)
            lo, hi = (int(x) for x in torch.aminmax(masked))
            if lo < 0 or hi >= P:
                i = int(((masked < 0) | (masked >= P)).any(1).nonzero()[0, 0])
                self._bad_block(i, masked[i, :pages[i]].tolist(), P)
            pt = masked.to(device=dev, dtype=torch.int32).contiguous()
        if width:
            ar = self._page_offsets
            if ar is None or ar.device != dev:
                ar = self._page_offsets = torch.arange(ps, dtype=torch.int64, device=dev)
            # slot = block * page_size + offset, written straight into the rows (one op); a row shorter than its
            # last page (max_context_len not a multiple of page_size) takes that page's first positions
            if width * ps <= L:
                torch.add(ar, pt[:, :, None], alpha=ps, out=self.req_to_token[:n, :width * ps].view(n, width, ps))
            else:
                self.req_to_token[:n, :L].copy_(torch.add(ar, pt[:, :, None], alpha=ps).view(n, width * ps)[:, :L])
        self._fill = rec = PageFill(self.req_to_token, lens, pages, blocks, pt)
        return rec

    @staticmethod
    def _bad_block(i: int, ids: list[int], num_pages: int) -> None:
        j = next(j for j, x in enumerate(ids) if not 0 <= x < num_pages)
        raise ShapeError(f"fill_from_page_table: request {i}: page table column {j} holds block {ids[j]}, which is "
                         f"out of range (expected 0 <= block < num_pages={num_pages}); nothing was written")

    def fill_from_pages(self, blocks: Sequence[Sequence[int]], lens: Sequence[int]) -> PageFill:
        """``fill_from_page_table`` for a host that keeps each request's pages as host ints (the transformers cache
        adapter): row ``i`` of ``req_to_token`` (``i < len(lens)``) maps position ``p`` of its first
        ``ceil(lens[i] / page_size)`` pages to ``blocks[i][p // page_size] * page_size + p % page_size``. The same
        checks first (each row's used ids in ``[0, num_pages)``: a bad one is a ``ShapeError`` naming the request,
        the page, the id and the bound, and nothing is written; ids past a row's used pages are not read) and the
        same record (``PageFill``, read through ``page_fill``). Only what is not there yet is written: while the
        last fill's record holds, a row's leading pages it recorded (the same ids in the same places) are left
        as they are (every fill writes whole pages) and only the pages after them are written, so a decode step
        that opened no page writes nothing; a row with no positions and every position past a row's last page
        are never written (``fill_from_page_table`` writes page 0 there), so a host's unassigned marks stay."""
        prev, self._fill = self.page_fill(), None
        lens = [operator.index(x) for x in lens]
        n, ps, L = len(lens), self.page_size, self.max_context_len
        if n > self.max_requests or n > len(blocks):
            raise ShapeError(f"fill_from_pages: {n} requests, but req_to_token has {self.max_requests} rows and "
                             f"{len(blocks)} page lists were given")
        used: list[list[int]] = []
        for i, x in enumerate(lens):
            if not 0 <= x <= L:
                raise ShapeError(f"fill_from_pages: request {i}: length {x} is out of range (expected 0 <= length "
                                 f"<= max_context_len={L})")
            u = -(-x // ps)
            ids = blocks[i][:u]
            if type(ids) is not list:
                ids = list(ids)
            if len(ids) < u:
                raise ShapeError(f"fill_from_pages: request {i} needs {u} pages for {x} positions, but its page "
                                 f"list has {len(ids)}")
            used.append(ids)
        if prev is not None and prev.blocks == used:
            # the same requests on the same pages as the last fill, which nothing has written over since: every
            # entry is in place (ids checked when that record was made); the record covers the new lengths
            self._fill = rec = PageFill(self.req_to_token, lens, prev.pages, prev.blocks, prev.table)
            return rec
        P = self.num_pages
        for i, ids in enumerate(used):
            ids = used[i] = [operator.index(b) for b in ids]
            for j, b in enumerate(ids):
                if not 0 <= b < P:
                    raise ShapeError(f"fill_from_pages: request {i}: page {j} is block {b}, which is out of range "
                                     f"(expected 0 <= block < num_pages={P}); nothing was written")
        old = prev.blocks if prev is not None else None
        pages = [len(ids) for ids in used]
        width = max(pages, default=0)
        dev = self.req_to_token.device
        with _not_inference():  # the recorded table keeps a write counter (see ``PageFill.table_version``)
            ar = self._page_offsets
            if ar is None or ar.device != dev:
                ar = self._page_offsets = torch.arange(ps, dtype=torch.int64, device=dev)
            flat: list[int] = []
            for i, ids in enumerate(used):
                k = 0  # the leading pages the last (valid) record already put in this row
                if old is not None and i < len(old):
                    o, m = old[i], min(len(old[i]), len(ids))
                    while k < m and o[k] == ids[k]:
                        k += 1
                if k < len(ids):
                    new = torch.tensor(ids[k:], dtype=torch.int64, device=dev)
                    slots = torch.add(ar, new[:, None], alpha=ps).view(-1)
                    end = min(len(ids) * ps, L)
                    self.req_to_token[i, k * ps:end].copy_(slots[:end - k * ps])
                flat.extend(ids)
                flat.extend([0] * (width - len(ids)))
            pt = _int32_tensor(flat, dev).view(n, width) if flat else torch.zeros(n, width, dtype=torch.int32,
                                                                                 device=dev)
            self._fill = rec = PageFill(self.req_to_token, lens, pages, used, pt)
        return rec

    def page_fill(self, rows: Sequence[int] | None = None, lens: Sequence[int] | None = None) -> PageFill | None:
        """The last ``fill_from_page_table``'s record while it holds: ``req_to_token`` is the tensor it wrote and its
        write counter has not moved since (any torch write into it, anywhere, voids the record), and it covers
        ``rows`` / ``lens`` (each row filled, its first ``lens[i]`` positions written by the fill). Else
        ``None``: read the entries."""
        rec = self._fill
        if rec is None:
            return None
        r2t = self.req_to_token
        if rec.tensor is not r2t or r2t._version != rec.version or rec.table._version != rec.table_version:
            self._fill = None
            return None
        if rows is not None and not rec.covers(rows, lens if lens is not None else [0] * len(rows)):
            return None
        return rec

    def release(self, req_index: int) -> None:
        """Forget every slot of request row ``req_index`` (its positions become ``UNASSIGNED``)."""
        self._check_row(req_index)
        self.req_to_token[req_index].fill_(UNASSIGNED)

    def slots(self, req_index: int, start: int, end: int) -> torch.Tensor:
        """Slots of positions ``start … end-1`` of request row ``req_index`` (a view of ``req_to_token``)."""
        self._check_row(req_index)
        return self.req_to_token[req_index, start:end]

    def _check_row(self, req_index: int) -> None:
        if isinstance(req_index, bool) or not isinstance(req_index, int) or not 0 <= req_index < self.max_requests:
            raise ValueError(
                f"request row {req_index!r} is out of range (expected 0 <= row < max_requests={self.max_requests})"
            )

    # -- kernel inputs shared by backends: page tables read from req_to_token --------------
    def page_table(self, batch: ForwardBatch) -> torch.Tensor:
        """int32 ``[batch, ceil(max_seq_len / page_size)]``: column ``j`` holds the page of positions
        ``j*page_size …`` of each request (its slot at ``j*page_size`` floor-divided by ``page_size``);
        columns past a request's last page are 0. One gather, no host loop; assumes the rows are
        page-aligned (``check_page_aligned``), as ``assign_pages`` keeps them.
        """
        b: Any = batch
        ps, dev = self.page_size, self.req_to_token.device
        max_len = b.max_seq_len
        if max_len > self.max_context_len:
            raise ShapeError(f"a request needs {max_len} positions but req_to_token has {self.max_context_len} columns")
        pages = (max_len + ps - 1) // ps
        n = len(b.seq_lens_cpu)
        if n == 0 or pages == 0:
            return torch.zeros(n, pages, dtype=torch.int32, device=dev)
        fill = self.page_fill(b.req_pool_indices_cpu, b.seq_lens_cpu)
        if fill is not None:  # the rows were filled from this table and not written since
            return fill.table_for(b.req_pool_indices_cpu, b.seq_lens_cpu, ps)
        rows = self.req_to_token.index_select(0, b.req_pool_indices.to(device=dev, dtype=torch.int64))
        rows = rows[:, :pages * ps:ps]  # column j: the slot of position j * page_size
        table = torch.div(rows, ps, rounding_mode="floor")
        if min(b.seq_lens_cpu) <= (pages - 1) * ps:  # some request has fewer pages: zero its last columns
            cols = torch.arange(pages, device=dev) * ps
            table.masked_fill_(cols[None, :] >= b.seq_lens.to(dev)[:, None], 0)
        return table.to(torch.int32)

    def check_page_aligned(self, req_pool_indices: Sequence[int] | torch.Tensor, lens: Sequence[int],
                           who: str = "") -> None:
        """Raise ``ShapeError`` unless each request's first ``lens[i]`` positions sit at offset ``j % page_size``
        of one page per ``page_size`` positions (what a page table can express). One pass over the batch
        (``PagedBackend`` calls it once per forward for backends that declare ``reads_page_table``); the
        error names the request, its row, the position, the slot and why (``who``: the backend)."""
        ps = self.page_size
        if ps == 1:
            return
        rows = req_pool_indices.tolist() if isinstance(req_pool_indices, torch.Tensor) else list(req_pool_indices)
        lens = [int(n) for n in lens]
        width = max(lens, default=0)
        if not rows or width == 0:
            return
        if self.page_fill(rows, lens) is not None:
            return  # filled whole pages from checked block ids and not written since: aligned by construction
        dev = self.req_to_token.device
        if len(rows) <= _SLICED_CHECK_ROWS and self._aligned_slices(rows, lens):
            return  # the vectorised pass below runs only to name the first bad entry
        table = self.req_to_token.index_select(0, torch.as_tensor(rows, dtype=torch.int64, device=dev))[:, :width]
        pos = torch.arange(width, device=dev)
        first = table[:, (pos // ps) * ps]
        used = pos[None, :] < torch.as_tensor(lens, dtype=torch.int64, device=dev)[:, None]
        bad = used & ((table != first + pos % ps) | (first % ps != 0))
        if bool(bad.any()):
            i, j = (int(x) for x in bad.nonzero()[0])
            r, start = rows[i], int(first[i, j])
            why = (f"its page starts at slot {start}, not a multiple of {ps}" if start % ps else
                   f"expected slot {start + j % ps}, offset {j % ps} of the page starting at slot {start}")
            reader = f"{who} reads the cache through a page table; " if who else ""
            raise ShapeError(f"req_to_token[{r}, {j}] = {int(table[i, j])} (request {i}, position {j}) is not "
                             f"page-aligned for page_size={ps}: {why}; {reader}map each page of "
                             f"{ps} positions to one page of {ps} consecutive slots")


    def _aligned_slices(self, rows: list[int], lens: list[int]) -> bool:
        """``check_page_aligned``'s usual case in a few ops whatever the batch: the rows' entries as slices of
        ``req_to_token``, concatenated; ``y = slot - position % page_size`` is a page start (a multiple of
        ``page_size``) everywhere and the same within each page (it may change only where a page begins)."""
        ps, r2t = self.page_size, self.req_to_token
        mod = self.__dict__.get("_position_mod")
        if mod is None or mod.device != r2t.device:
            mod = self.__dict__["_position_mod"] = torch.arange(self.max_context_len, device=r2t.device) % ps
        parts = [(r2t[r, :n], mod[:n]) for r, n in zip(rows, lens) if n]
        if len(parts) == 1:
            slots, pm = parts[0]
        else:
            slots, pm = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        y = slots - pm
        bad = y.remainder(ps) != 0
        bad[1:] |= (y[1:] != y[:-1]) & (pm[1:] != 0)
        return not bool(bad.any())


def indptr(lengths: Sequence[int] | torch.Tensor, device: torch.device | str | None = None) -> torch.Tensor:
    """``[0, l0, l0+l1, …]`` as int32 (``[len(lengths) + 1]``): CSR offsets of ragged rows, as kernels take them."""
    if isinstance(lengths, (list, tuple)):  # host lengths (the batch's validated copies): one tensor op
        offsets, total = [0], 0
        for n in lengths:
            total += int(n)
            offsets.append(total)
        if device is None or torch.device(device).type == "cpu":  # through an ``array`` buffer: ~0.7 µs, not ~2.3
            try:
                return torch.frombuffer(array.array("i", offsets), dtype=torch.int32)
            except OverflowError:
                pass  # a total past int32: torch.tensor's own error below
        return torch.tensor(offsets, dtype=torch.int32, device=device)
    lens = torch.as_tensor(lengths, dtype=torch.int64, device=device).reshape(-1)
    out = torch.zeros(lens.numel() + 1, dtype=torch.int64, device=lens.device)
    torch.cumsum(lens, 0, out=out[1:])
    return out.to(torch.int32)



class PageAllocator:
    """Hands out free pages, optionally scattered at random (for tests and benchmarks)."""

    def __init__(self, num_pages: int, *, shuffle: bool = True, seed: int = 0) -> None:
        order = list(range(num_pages))
        if shuffle:
            g = torch.Generator().manual_seed(seed)
            order = torch.randperm(num_pages, generator=g).tolist()
        self._free = order

    def alloc(self, n: int) -> list[int]:
        """``n`` free page ids (an error when fewer are left)."""
        if n > len(self._free):
            raise RuntimeError(f"out of KV-cache pages: asked for {n}, {len(self._free)} free")
        out, self._free = self._free[:n], self._free[n:]
        return out


def _slot_indices(slots: object, field: str) -> torch.Tensor:
    """``slots`` as a tensor: a tensor as given, a list/tuple/range of ints as int64; anything else a
    ``ShapeError`` naming ``field`` and what it got."""
    if isinstance(slots, torch.Tensor):
        return slots
    if isinstance(slots, (list, tuple, range)):
        bad = [s for s in slots if isinstance(s, bool) or not hasattr(s, "__index__")]
        if not bad:
            return torch.tensor([operator.index(s) for s in slots], dtype=torch.int64)
        raise ShapeError(f"{field}: {bad[0]!r} ({type(bad[0]).__name__}) is not a slot index (expected ints)")
    raise ShapeError(f"{field} is a {type(slots).__name__}, expected an integer tensor or a list of ints")
