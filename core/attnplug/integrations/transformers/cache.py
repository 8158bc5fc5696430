"""A transformers ``Cache`` backed by attnplug's ``PagedKVCache``.

transformers' attention modules call ``cache.update(k, v, layer_idx)`` before
the attention function. Here ``update`` stores nothing and returns the new
K/V unchanged: the attnplug backend writes them at ``out_cache_loc`` inside its
forward (``save_kv_cache=True``) and reads the cached prefix through
``req_to_token``. So the backend, not transformers, owns the KV cache.

Requests are rows of ``req_to_token``. ``add_request`` takes a free row;
``extend`` takes pages from a :class:`PagePool` as the request grows and maps
the new positions (``PagedKVCache.assign_pages``) *before* the forward that
uses them; ``release`` returns the pages and the row, and marks the row's
mapped positions unassigned (-1) so a reused row never points at slots it no
longer owns.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from attnplug import AttnplugError, PagedKVCache

__all__ = ["UNASSIGNED", "AttnplugCache", "PagePool", "PagedCacheLayer"]

#: ``req_to_token`` value of a position no request owns.
UNASSIGNED = -1


class PagePool:
    """Free pages, handed out lowest first and taken back when a request finishes."""

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # a stack: pop() gives the lowest page

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise AttnplugError(
                f"KV cache is out of pages: asked for {n}, {len(self._free)} of {self.num_pages} free "
                f"(raise num_pages, or admit fewer requests at once)"
            )
        return [self._free.pop() for _ in range(n)]

    def free(self, pages: Sequence[int]) -> None:
        for p in pages:
            if not 0 <= p < self.num_pages:
                raise AttnplugError(f"page {p} is not a page of this pool (0 … {self.num_pages - 1})")
        self._free.extend(reversed(list(pages)))


@dataclasses.dataclass
class _Seq:
    row: int
    length: int = 0
    pages: list[int] = dataclasses.field(default_factory=list)
    #: the request's row of ``req_to_token`` (a view: a decode step writes its one entry through it)
    entries: Any = None


class PagedCacheLayer(CacheLayerMixin):
    """One decoder layer's view: K/V live in the shared ``PagedKVCache``, written by the backend."""

    is_compileable = False
    is_croppable = False

    def __init__(self, owner: "AttnplugCache", layer_id: int, is_sliding: bool) -> None:
        super().__init__()
        self.owner = owner
        self.layer_id = layer_id
        self.is_sliding = is_sliding
        self.is_initialized = True
        self.updates = 0
        #: what this forward's ``update`` received (an MLA layer's latents; ``None`` before it)
        self.last: Any = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
               ) -> tuple[torch.Tensor, torch.Tensor]:
        # The backend writes them (save_kv_cache=True); the attention function gets the new tokens only.
        # An MLA module (mla.py) passes its latents here: kept for its attention call, which serves the
        # layer from the latent rows
        self.updates += 1
        self.last = (key_states, value_states)
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.single_length() + query_length, 0

    def get_seq_length(self) -> int:
        return self.owner.single_length()

    def get_max_length(self) -> int:
        return self.owner.kv_cache.max_context_len


class AttnplugCache(Cache):
    """The transformers-facing cache of a :class:`~.runner.TransformersRunner`."""

    def __init__(self, kv_cache: PagedKVCache, sliding: Sequence[bool], num_requests: int) -> None:
        super().__init__(layers=[PagedCacheLayer(self, i, s) for i, s in enumerate(sliding)])
        self.kv_cache = kv_cache
        self.pool = PagePool(kv_cache.num_pages)
        self._free_rows = list(range(num_requests - 1, -1, -1))
        self._seqs: dict[Any, _Seq] = {}
        self._active: dict[Any, int] = {}  # request -> cached length before the forward in progress

    # -- requests -----------------------------------------------------------
    @property
    def requests(self) -> list[Any]:
        return list(self._seqs)

    def add_request(self, rid: Any) -> int:
        if rid in self._seqs:
            raise AttnplugError(f"request {rid!r} is already in the KV cache")
        if not self._free_rows:
            raise AttnplugError(
                f"no free request row for {rid!r}: all {self.kv_cache.req_to_token.shape[0]} rows are in use "
                f"(raise max_requests, or release finished requests)"
            )
        row = self._free_rows.pop()
        self._seqs[rid] = _Seq(row, entries=self.kv_cache.req_to_token[row])
        return row

    def _seq(self, rid: Any) -> _Seq:
        try:
            return self._seqs[rid]
        except KeyError:
            raise AttnplugError(f"request {rid!r} is not in the KV cache (known: {sorted(map(str, self._seqs))})") from None

    def __contains__(self, rid: Any) -> bool:
        return rid in self._seqs

    def row(self, rid: Any) -> int:
        return self._seq(rid).row

    def length(self, rid: Any) -> int:
        return self._seq(rid).length

    def extend(self, rid: Any, n: int) -> torch.Tensor:
        """Map ``n`` more positions of ``rid`` (taking pages as needed); returns their slots."""
        seq = self._seq(rid)
        cache, ps = self.kv_cache, self.kv_cache.page_size
        new_len = seq.length + n
        if new_len > cache.max_context_len:
            raise AttnplugError(
                f"request {rid!r} would hold {new_len} tokens, beyond max_context_len={cache.max_context_len}"
            )
        need = -(-new_len // ps) - len(seq.pages)
        if need > 0:
            seq.pages.extend(self.pool.alloc(need))
        old = seq.length
        if n == 1:  # a decode step: one slot, computed here (assign_pages' tensor ops cost ~10x more)
            return torch.tensor([self.extend_one(rid)], dtype=torch.int64, device=cache.device)
        cache.assign_pages(seq.row, new_len, seq.pages, start=old)
        seq.length = new_len
        return cache.slots(seq.row, old, new_len)

    def extend_one(self, rid: Any) -> int:
        """Map one more position of ``rid`` (a decode step; a page taken when it starts one); returns its slot.
        The slot is computed here from the request's page list (``assign_pages``' tensor ops for one
        slot cost ~10x more) and written into ``req_to_token`` (a torch write: its write counter moves)."""
        return self._extend_one(rid, self._seq(rid))

    def _extend_one(self, rid: Any, seq: _Seq) -> int:
        cache = self.kv_cache
        ps, old = cache.page_size, seq.length
        if old + 1 > cache.max_context_len:
            raise AttnplugError(
                f"request {rid!r} would hold {old + 1} tokens, beyond max_context_len={cache.max_context_len}"
            )
        if old // ps >= len(seq.pages):
            seq.pages.extend(self.pool.alloc(old // ps + 1 - len(seq.pages)))
        slot = seq.pages[old // ps] * ps + old % ps
        seq.entries[old] = slot  # req_to_token[row, old]: one index into the row's view
        seq.length = old + 1
        return slot

    def decode_step(self, rids: Sequence[Any], prefix: dict[Any, int]) -> tuple[list[int], list[int], list[int]]:
        """A decode forward's mapping, one request after the other (``extend_one`` each): its cached length
        goes into ``prefix`` *before* its slot is mapped (so a failure can be undone by ``truncate``);
        returns the requests' rows, their lengths after the forward and their new slots. A request that is
        not in the cache is an ``AttnplugError`` naming it."""
        rows, lens, slots = [], [], []
        seqs = self._seqs
        for rid in rids:
            seq = seqs.get(rid)
            if seq is None:
                raise AttnplugError(f"decode Chunk for request {rid!r}, which has no prompt in the cache")
            prefix[rid] = seq.length
            slots.append(self._extend_one(rid, seq))  # its page mapped before the forward
            rows.append(seq.row)
            lens.append(seq.length)
        return rows, lens, slots

    def truncate(self, rid: Any, length: int) -> None:
        """Forget positions ``length …`` of ``rid`` (a forward that failed), returning whole pages."""
        seq = self._seq(rid)
        if length < seq.length:
            self.kv_cache.req_to_token[seq.row, length:seq.length] = UNASSIGNED
            keep = -(-length // self.kv_cache.page_size)
            self.pool.free(seq.pages[keep:])
            del seq.pages[keep:]
            seq.length = length

    def release(self, rid: Any) -> None:
        """``rid`` finished: its pages and row go back to the free lists."""
        seq = self._seqs.pop(rid, None)
        if seq is None:
            raise AttnplugError(f"request {rid!r} is not in the KV cache (already released?)")
        self.kv_cache.req_to_token[seq.row, :seq.length] = UNASSIGNED
        self.pool.free(seq.pages)
        self._free_rows.append(seq.row)

    # -- one forward ------------------------------------------------------------
    def begin_forward(self, prefix_lens: dict[Any, int]) -> None:
        """A forward over the requests of ``prefix_lens`` (request -> cached length before it) starts: kept,
        not copied, until ``end_forward`` (the runner does not change it meanwhile)."""
        self._active = prefix_lens
        for layer in self.layers:
            layer.updates = 0
            layer.last = None

    def end_forward(self) -> None:
        """Every layer must have gone through ``update`` exactly once (the model used this cache)."""
        wrong = [(layer.layer_id, layer.updates) for layer in self.layers if layer.updates != 1]
        self._active = {}
        if wrong:
            raise AttnplugError(
                "the model did not call cache.update() once per layer in this forward "
                f"(layer, calls): {wrong}; it must receive this AttnplugCache as its `cache`"
            )

    def single_length(self) -> int:
        """transformers asks for "the" cached length only when it derives positions itself;
        with a ragged batch there is none, so the runner always passes ``position_ids``."""
        lengths = set(self._active.values())
        if len(lengths) == 1:  # one request, or every request with the same cached length (e.g. none)
            return next(iter(lengths))
        raise AttnplugError(
            f"AttnplugCache holds a ragged batch of {len(self._active)} requests with cached lengths "
            f"{sorted(lengths)}: there is no single sequence length; pass position_ids (TransformersRunner.forward does)"
        )
