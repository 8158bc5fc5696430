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

A decode step maps its requests' rows through ``PagedKVCache.fill_from_pages``
(whole pages from the requests' page lists, host ints), recorded to the end of each
request's last page: while that record holds (nothing wrote ``req_to_token`` since)
and covers the step, with each new slot the one it gives, the step writes and fills
nothing; otherwise the fill writes only the pages the record lacks. The record
(``PageFill``) lets ``check_batch`` take the covered entries as real slots instead
of reading them back. Within a request's last page, the positions past its length
then already hold that page's slots (its own); ``truncate`` and ``release`` mark
every position of the pages they give back unassigned.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from attnplug import AttnplugError, PagedKVCache, ShapeError

__all__ = ["UNASSIGNED", "AttnplugCache", "PagePool", "PagedCacheLayer"]

#: ``req_to_token`` value of a position no request owns.
UNASSIGNED = -1

#: a decode step maps its rows through ``PagedKVCache.fill_from_pages`` (tests switch it off to compare with
#: the entry-by-entry write, which leaves no ``PageFill`` record)
_FILL = True
#: the fill records each request to the end of its last page, so later steps in that page need no fill (tests
#: and the round 7 measurement switch it off: recorded to the length, a fill every step)
_PAGE_END = True


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

    def _extend_one(self, rid: Any, seq: _Seq, write: bool = True) -> int:
        cache = self.kv_cache
        ps, old = cache.page_size, seq.length
        if old + 1 > cache.max_context_len:
            raise AttnplugError(
                f"request {rid!r} would hold {old + 1} tokens, beyond max_context_len={cache.max_context_len}"
            )
        if old // ps >= len(seq.pages):
            seq.pages.extend(self.pool.alloc(old // ps + 1 - len(seq.pages)))
        slot = seq.pages[old // ps] * ps + old % ps
        if write:
            seq.entries[old] = slot  # req_to_token[row, old]: one index into the row's view
        seq.length = old + 1
        return slot

    def decode_step(self, rids: Sequence[Any], prefix: dict[Any, int]) -> tuple[list[int], list[int], list[int]]:
        """A decode forward's mapping, one request after the other (``extend_one`` each): its cached length
        goes into ``prefix`` *before* its slot is mapped (so a failure can be undone by ``truncate``);
        returns the requests' rows, their lengths after the forward and their new slots. A request that is
        not in the cache is an ``AttnplugError`` naming it. The rows are then mapped by one
        ``PagedKVCache.fill_from_pages`` over the requests' page lists (``_FILL``; else each new entry is
        written on its own): its record covers the step's rows for ``check_batch``."""
        rows, lens, slots = [], [], []
        seqs = self._seqs
        fill = _FILL
        for rid in rids:
            seq = seqs.get(rid)
            if seq is None:
                raise AttnplugError(f"decode Chunk for request {rid!r}, which has no prompt in the cache")
            prefix[rid] = seq.length
            slots.append(self._extend_one(rid, seq, not fill))  # its page mapped before the forward
            rows.append(seq.row)
            lens.append(seq.length)
        if fill and rows:
            self._fill_step([seqs[rid] for rid in rids], rows, lens, slots)
        return rows, lens, slots

    def _fill_step(self, seqs: list[_Seq], rows: list[int], lens: list[int], slots: list[int]) -> None:
        """Map a decode step's rows by ``fill_from_pages`` (whole pages; only those the last fill did not write),
        unless the last fill's record still holds, covers every position of the step and gives each new slot.
        Positions a request had before the step that the last fill's record does not cover (none holds, or
        the rows were written since: an extend, or a write from outside) are first compared with the request's
        pages: where one differs, nothing is filled over it — each new entry is written on its own and
        ``check_batch`` reads the rows, refusing a bad entry in its own words, as without the fill."""
        cache = self.kv_cache
        ps = cache.page_size
        rec = cache.page_fill()
        if _PAGE_END and rec is not None and rec.blocks is not None:
            # every position of the step lies in pages the last fill wrote whole (recorded to their end) and nothing
            # has written ``req_to_token`` since (``covers``, written out), and each new slot is the one the record
            # gives (``slot``): nothing to write. Else (a page opened, or a page list changed under the record:
            # a host bug) the fill below writes what differs
            covered, ids, n = rec.lens, rec.blocks, len(rec.lens)
            for r, x, slot in zip(rows, lens, slots):
                p = x - 1
                if r >= n or x > covered[r] or ids[r][p // ps] * ps + p % ps != slot:
                    break
            else:
                return
        olds = [x - 1 for x in lens]
        if rec is None or not rec.covers(rows, olds):
            if not all(self._as_mapped(seq, old) for seq, old in zip(seqs, olds)):
                for seq, old, slot in zip(seqs, olds, slots):
                    seq.entries[old] = slot
                return
        n = max(rows) + 1
        blocks: list[Sequence[int]] = [()] * n
        upto = [0] * n
        L = cache.max_context_len
        for seq, x in zip(seqs, lens):
            # recorded to the end of the request's last page (the fill writes whole pages): the next steps in
            # that page are covered as they are
            blocks[seq.row], upto[seq.row] = seq.pages, (min(len(seq.pages) * ps, L) if _PAGE_END else x)
        try:
            cache.fill_from_pages(blocks, upto)
        except ShapeError as exc:  # a bad page id: name the request it belongs to
            bad = next((rid for rid, seq in self._seqs.items() if f"request {seq.row}:" in str(exc)), None)
            raise ShapeError(f"decode step of request {bad!r}: {exc}") from None

    def _as_mapped(self, seq: _Seq, length: int) -> bool:
        """Whether ``seq``'s row maps its positions ``0 … length-1`` to its pages' slots."""
        ps, pages = self.kv_cache.page_size, seq.pages
        if length <= 256 and seq.entries.device.type == "cpu":
            return seq.entries[:length].tolist() == [pages[p // ps] * ps + p % ps for p in range(length)]
        dev = seq.entries.device
        pos = torch.arange(length, device=dev)
        ids = torch.tensor(pages[:-(-length // ps)], dtype=torch.int64, device=dev)
        return torch.equal(seq.entries[:length], ids[pos // ps] * ps + pos % ps)

    def truncate(self, rid: Any, length: int) -> None:
        """Forget positions ``length …`` of ``rid`` (a forward that failed), returning whole pages."""
        seq = self._seq(rid)
        if length < seq.length:
            self.kv_cache.req_to_token[seq.row, length:self._mapped_end(seq)] = UNASSIGNED
            keep = -(-length // self.kv_cache.page_size)
            self.pool.free(seq.pages[keep:])
            del seq.pages[keep:]
            seq.length = length

    def release(self, rid: Any) -> None:
        """``rid`` finished: its pages and row go back to the free lists."""
        seq = self._seqs.pop(rid, None)
        if seq is None:
            raise AttnplugError(f"request {rid!r} is not in the KV cache (already released?)")
        self.kv_cache.req_to_token[seq.row, :self._mapped_end(seq)] = UNASSIGNED
        self.pool.free(seq.pages)
        self._free_rows.append(seq.row)

    def _mapped_end(self, seq: _Seq) -> int:
        """The end of the positions of ``seq``'s row that may hold a slot: its length, or the end of its last
        page (a decode step's fill maps whole pages), whichever is further (within ``max_context_len``)."""
        cache = self.kv_cache
        return max(seq.length, min(len(seq.pages) * cache.page_size, cache.max_context_len))

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
