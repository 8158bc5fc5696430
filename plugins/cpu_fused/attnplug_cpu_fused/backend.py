"""Kernel module of the ``cpu_fused`` backend: the fused C++ CPU kernel behind a torch op.

Imported only when the backend is built. ``CpuFusedBackend`` subclasses torch_native's backend:
decode, and every extend-mode request with at most ``FUSED_MAX_QUERIES`` new tokens (target-verify
drafts, a mixed batch's decode requests, short extends), go through
``torch.ops.attnplug_cpu_fused.attend`` (``csrc/attention.cpp``, compiled at install: one pass over
the paged cache reading each visible row once, in place, computing in float32); longer extends go
through ``torch.ops.attnplug_cpu_fused.extend_tiled`` (``csrc/extend_tiled.cpp``: query tiles x key
tiles with an online softmax, causal tiles skipped, bf16 products through ``vdpbf16ps`` where the
CPU has it) where the layer fits it (``tiled_fits``: float32/bfloat16 with the cache in the model
dtype, self-attention, no target-verify mask, at most 64 query heads per KV head); what neither
takes runs torch_native's SDPA path, as do bidirectional layers (the kernels mask causally) and a
forward whose kernel scratch would exceed ``BuildContext.max_workspace_bytes``. What the kernel does not take at
all (another layout, a cache dtype other than the model's or fp8, head dims not multiples of 16,
another device) is refused by the declared capabilities before a forward, with the reason.

What each layer's call needs is prepared in three named pieces:

- ``FusedLayer`` (``plan_layer``, once per ``LayerSpec``): the layer's cache tensors, sinks,
  window, scaling, soft-cap, its error record and its geometry;
- ``FusedForward`` (``FusedMeta.work``, once per forward and layer geometry, shared by every layer
  of that geometry): the work rows (``plan``), the target-verify mask per row, the work split; or
  ``NO_REQUESTS`` (no request of this forward is the kernel's) or a ``Declined`` saying why the
  eager paths run instead;
- the call: q, the new K/V and the output are passed as tensors each time.

Where every request of a forward goes through the op and the cache stores the new K/V as they are (an
unquantized ``nhd`` cache in the model dtype), ``compute_and_write`` (the skeleton's hook) calls
``torch.ops.attnplug_cpu_fused.attend_write`` instead: the attention into a fresh output, then the new rows
written at ``out_cache_loc``, in one call (the skeleton's write after the kernel: two index copies a layer).
"""

from __future__ import annotations

import array
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import torch

from attnplug import ForwardMode
from attnplug.errors import BackendUnavailableError, ResourceLimitError, ShapeError
from attnplug_torch_native.backend import ForwardMeta, TorchNativeBackend

from . import CAPABILITIES, NAME
from . import kernel

#: In the extend modes the kernel takes requests with at most this many new tokens (drafts, a
#: mixed batch's decode requests, short extends); longer ones go through torch_native's SDPA path.
#: Measured (one thread, 32/8 heads, head dim 128, over 1024 cached tokens, kernel time over SDPA's):
#: 4 new tokens 0.48x fp32 / 0.31x bf16, 16 0.80x / 0.69x, 32 1.05x / 0.96x, 128 1.26x / 1.13x.
FUSED_MAX_QUERIES = 16
#: Most queries per work row: a request's new tokens are cut into chunks of this many, fewer when
#: one chunk's scores would not fit ``FUSED_SCRATCH_BYTES`` (long contexts).
FUSED_QUERY_CHUNK = 16
#: Per-thread scratch the kernel aims under (it takes fewer KV heads per work item to fit).
FUSED_SCRATCH_BYTES = 8 << 20

_F32 = torch.float32


def create(ctx: Any) -> tuple[str, "CpuFusedBackend"]:
    """Factory named by the descriptor: ``(effective_name, backend)``."""
    return NAME, CpuFusedBackend(ctx)


@dataclass(frozen=True)
class Declined:
    """The kernel does not take this layer in this forward: the eager paths run (``reason`` says why)."""

    reason: str


@dataclass(frozen=True)
class NoRequests:
    """No request of this forward is the kernel's (every one is a long extend)."""


NO_REQUESTS = NoRequests()
BIDIRECTIONAL = Declined("a bidirectional layer (the kernel masks causally): torch_native's eager paths")


@dataclass(frozen=True)
class FusedForward:
    """The op's arguments that depend on the forward, shared by every layer of one geometry."""

    plan: torch.Tensor  # int64 [B, 8]: the work rows (FusedMeta.plan)
    mask: torch.Tensor | None  # the target-verify mask per work row
    per_item: int  # KV heads per work item
    requests: list[int]  # the request of each work row (error messages name it)
    #: the op's ``work`` (``kernel.WORK_COLS``): a header (B, per_item, the mask's side, the error record), the
    #: plan's rows and the mask's bytes in one int64 tensor: one argument instead of four (each costs the op's
    #: dispatch ~0.1 us per call); made by ``work_tensor``
    work: torch.Tensor
    #: a DECODE forward's self-attention work (``CpuFusedBackend._decode_work``): how the next decode forward of as
    #: many requests rewrites ``work`` in place instead of building it (``DecodeRows``); ``None`` elsewhere
    rows: "DecodeRows | None" = None


def work_tensor(plan: torch.Tensor, mask: torch.Tensor | None, per_item: int) -> torch.Tensor:
    """``attend``'s ``work`` for the plan ``[B, 8]``, the mask ``[B, E, E]`` (or ``None``) and the KV heads per
    work item: int64 ``[1 + B + M, 8]`` (``kernel.WORK_COLS``; the mask's bytes in M rows, zero-padded)."""
    side = 0 if mask is None else int(mask.shape[-1])
    parts = [torch.tensor([[plan.shape[0], per_item, side, 0, 0, 0, 0, 0]], dtype=torch.int64), plan]
    if mask is not None and mask.numel():
        raw = mask.to(torch.bool).contiguous().view(torch.uint8).reshape(-1)  # 1 byte a key: 1 seen, 0 hidden
        pad = -raw.numel() % (8 * kernel.WORK_COLS)
        if pad:
            raw = torch.cat([raw, raw.new_zeros(pad)])
        parts.append(raw.view(torch.int64).view(-1, kernel.WORK_COLS))
    return torch.cat(parts)


#: what ``FusedMeta.work`` answers for one layer geometry
Work = FusedForward | NoRequests | Declined


@dataclass
class FusedLayer:
    """The op's arguments that depend only on the layer (``CpuFusedBackend.plan_layer``)."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    sinks: torch.Tensor | None  # float32 [H]
    window: int  # -1: none
    cross: bool
    scale: float
    cap: float
    err: torch.Tensor  # int64 [4]: the kernel's first failure (code, work row, position, slot)
    geometry: tuple[Any, ...]
    bidirectional: bool = False  # the kernel masks causally: such a layer runs torch_native's paths
    #: the op's ``params`` (``kernel.PARAMS``, float64: group, window, scale, cap, k_scale 1, v_scale 1, sinks
    #: 0/1, then the sinks), made once: one tensor argument instead of six scalars and the sinks (each costs
    #: the op's dispatch ~0.1 us per call); an fp8 cache's scales are read per call instead (``_args``)
    params: torch.Tensor = dataclasses.field(default_factory=lambda: torch.zeros(kernel.PARAMS, dtype=torch.float64))


def layer_params(group: int, window: int, scale: float, cap: float, k_scale: float, v_scale: float,
                 sinks: torch.Tensor | None) -> torch.Tensor:
    """``attend``'s ``params`` (``kernel.PARAMS`` values, then the sinks where the layer has them)."""
    head = torch.tensor([group, window, scale, cap, k_scale, v_scale, 0.0 if sinks is None else 1.0],
                        dtype=torch.float64)
    return head if sinks is None else torch.cat([head, sinks.to(torch.float64)])


class FusedMeta(ForwardMeta):
    """torch_native's per-forward metadata plus the kernel's work rows, built once per forward."""

    def __init__(self, batch: Any, cache: Any) -> None:
        super().__init__(batch, cache)
        self._chunks: dict[int, list[tuple[int, int, int]]] = {}
        self._plan: dict[tuple[Any, ...], tuple[torch.Tensor, int, int]] = {}
        self._mask: dict[int, torch.Tensor | None] = {}
        self._tiled: dict[int | None, torch.Tensor] = {}
        #: per (dtype, layer): why the tiled kernel does not take the layer's long extends (None: it does)
        self.tiled_why: dict[tuple[Any, ...], str | None] = {}
        #: per (dtype, threads, layer geometry): what the kernel does in this forward
        self.work: dict[tuple[Any, ...], Work] = {}
        #: per layer object (by ``id``): its prepared call in this forward (``FusedCall``)
        self.calls: dict[int, FusedCall] = {}
        #: ``work`` and ``calls`` are the previous decode forward's, their work rows rewritten for this one
        #: (``CpuFusedBackend._carry``)
        self.carried = False

    def fused_requests(self) -> tuple[int, ...]:
        """The requests the kernel takes in this forward: every one in decode; in the extend modes
        those with 1 to ``FUSED_MAX_QUERIES`` new tokens."""
        if self.mode is ForwardMode.DECODE:
            return tuple(range(len(self.rows)))
        return tuple(i for i, e in enumerate(self.ext) if 1 <= e <= FUSED_MAX_QUERIES)

    def chunks(self, chunk: int) -> list[tuple[int, int, int]]:
        """``(request, first query, queries)`` per work row: each fused request's new tokens in chunks
        of at most ``chunk`` (bounded scratch; a chunk reads only the keys its queries can see)."""
        got = self._chunks.get(chunk)
        if got is None:
            got = self._chunks[chunk] = [(i, a0, min(chunk, self.ext[i] - a0))
                                         for i in self.fused_requests() for a0 in range(0, self.ext[i], chunk)]
        return got

    def mask(self, chunk: int) -> torch.Tensor | None:
        """The target-verify mask of each work row's request (contiguous)."""
        if self.custom_mask is None:
            return None
        if chunk not in self._mask:
            rows = [i for i, _, _ in self.chunks(chunk)]
            self._mask[chunk] = self.custom_mask[rows].contiguous()
        return self._mask[chunk]

    def tiled_requests(self) -> tuple[int, ...]:
        """The requests the tiled extend kernel may take in this forward: in the extend modes those
        with more than ``FUSED_MAX_QUERIES`` new tokens (none in decode: one new token each)."""
        return tuple(i for i, e in enumerate(self.ext) if e > FUSED_MAX_QUERIES)

    def tiled_plan(self, window: int | None) -> torch.Tensor:
        """``extend_tiled``'s ``[n, 8]`` int64 plan: ``plan``'s rows with each request of
        ``tiled_requests()`` whole (self-attention only), built once per forward and window."""
        got = self._tiled.get(window)
        if got is None:
            rows = array.array("q")
            for i in self.tiled_requests():
                p, e = self.prefix[i], self.ext[i]
                start = 0 if window is None else min(p, max(0, p - window))
                rows.extend((self.rows[i], start, p - start, self.q_off[i], e, p, self.q_off[i], 0))
            got = self._tiled[window] = _table(rows)
        return got

    def plan(self, window: int | None, cross: bool, chunk: int) -> tuple[torch.Tensor, int, int]:
        """The ``[n, 8]`` int64 plan, one row per chunk of ``chunks(chunk)``: req_to_token row, first
        cached position read, cached keys read, first query token, queries, position of the first
        query, the request's first new token, the chunk's first query within the request; and the
        most keys and the most queries of any row."""
        key = (window, cross, chunk)
        got = self._plan.get(key)
        if got is None and self.mode is ForwardMode.DECODE and not cross and _DECODE_PLAN:
            got = self._plan[key] = self._decode_plan(window)
        if got is None:
            rows = array.array("q")  # the table's values, row after row (one buffer: no nested list to convert)
            most_keys = most_q = 0
            for i, a0, nq in self.chunks(chunk):
                p = self.prefix[i]
                if cross:
                    start, cached, new = 0, (self.enc[i] if self.enc else 0), 0
                else:
                    # cached keys from the window's start for the chunk's first query (its later
                    # queries mask more); none when the window ends inside the new tokens
                    start = 0 if window is None else min(p, max(0, p + a0 - window))
                    cached, new = p - start, a0 + nq
                rows.extend((self.rows[i], start, cached, self.q_off[i] + a0, nq, p + a0, self.q_off[i], a0))
                most_keys, most_q = max(most_keys, cached + new), max(most_q, nq)
            got = self._plan[key] = (_table(rows), most_keys, most_q)
        return got


    def _decode_plan(self, window: int | None) -> tuple[torch.Tensor, int, int]:
        """``plan`` of a DECODE forward's self-attention: one work row per request holding its one new token,
        whatever the chunk (what the general loop gives, without the chunk list): ``(row, start, cached, i, 1,
        p, i, 0)`` for request ``i`` with ``p`` cached tokens, ``start`` the window's first."""
        rows, most = decode_rows(self.rows, self.prefix, window)
        return _table(rows), most, 1 if self.rows else 0


#: a DECODE forward's work rows through ``FusedMeta._decode_plan`` (tests switch it off to compare)
_DECODE_PLAN = True


def _table(values: array.array) -> torch.Tensor:
    """int64 ``[n, 8]`` from ``values`` (row after row), through the array's buffer (~1 µs; ``torch.tensor`` of
    a nested list costs ~6 µs for one row). The tensor keeps the array alive."""
    if not values:
        return torch.zeros((0, 8), dtype=torch.int64)
    return torch.frombuffer(values, dtype=torch.int64).view(-1, 8)


def decode_rows(rows: list[int], prefix: list[int], window: int | None, head: tuple[int, ...] = ()
                ) -> tuple[array.array, int]:
    """A DECODE forward's self-attention work rows as int64 values, row after row, after ``head`` (a ``work``
    header's values, or nothing): ``(row, start, cached, i, 1, p, i, 0)`` for request ``i`` with ``p`` cached
    tokens, ``start`` the window's first; and the most keys of any row (its cached keys and its new one)."""
    values = array.array("q", head)
    most = 0
    for i, (r, p) in enumerate(zip(rows, prefix)):
        start = 0 if window is None else min(p, max(0, p - window))
        values.extend((r, start, p - start, i, 1, p, i, 0))
        if p - start + 1 > most:
            most = p - start + 1
    return values, most


class DecodeRows:
    """How a DECODE forward's self-attention ``work`` (header and rows in one ``array`` buffer ``buf``,
    ``FusedForward.work`` the tensor over it) was made, so that the next decode forward of as many requests rewrites
    ``buf`` in place where the split is the same (``CpuFusedBackend._carry``) instead of building a new tensor: the
    window, the layer geometry the scratch depends on (``_decode_values``'s) and the KV heads per work item chosen."""

    __slots__ = ("window", "geometry", "per_item", "buf")

    def __init__(self, window: int | None, geometry: tuple[Any, ...], per_item: int, buf: array.array) -> None:
        self.window, self.geometry, self.per_item, self.buf = window, geometry, per_item, buf


#: a decode forward following a decode forward of as many requests rewrites the previous one's work rows in place
#: and keeps its prepared calls (``CpuFusedBackend._carry``; tests switch it off to compare)
_CARRY = True


class FusedCall:
    """One layer's call in one forward, prepared on its first call (``FusedMeta.calls``): the work (what
    ``CpuFusedBackend._work`` answered), and for a ``FusedForward`` over an unquantized self-attention
    cache the op's arguments between q, the new K/V and the output: ``head`` (the layer's caches,
    ``req_to_token``, the layer's params, the forward's work tensor). ``whole``: ``head`` is set and the op
    takes every request of the forward (so ``attend_write`` gives the whole output: ``compute_and_write``).
    Found again only for the same layer object, query dtype and thread count."""

    __slots__ = ("layer", "dtype", "threads", "fl", "work", "head", "whole")

    def __init__(self, layer: Any, dtype: torch.dtype, threads: int, fl: FusedLayer, work: Work,
                 head: tuple[Any, ...] | None, whole: bool = False) -> None:
        self.layer, self.dtype, self.threads, self.fl, self.work = layer, dtype, threads, fl, work
        self.head, self.whole = head, whole


class CpuFusedBackend(TorchNativeBackend):
    """The fused C++ CPU kernel (torch op ``attnplug_cpu_fused::attend``); torch_native's paths for
    long extends."""

    capabilities = CAPABILITIES
    backend_name = NAME

    def __init__(self, ctx: Any, **kw: Any) -> None:
        super().__init__(ctx, **kw)
        if self.device.type != "cpu":
            raise BackendUnavailableError(NAME, [f"runs on CPU only (this backend is on {self.device.type})"], "")
        op, why = kernel.load()
        if op is None:
            raise BackendUnavailableError(NAME, [str(why)], "pip install attnplug-cpu-fused with a C++ compiler")
        self._op: Callable[..., Any] = op
        self._tiled_op: Callable[..., Any] = torch.ops.attnplug_cpu_fused.extend_tiled.default
        #: ``attend_write``: the op and the K/V write of the skeleton in one call (``compute_and_write``)
        self._write_op: Callable[..., Any] = torch.ops.attnplug_cpu_fused.attend_write.default
        #: a forward whose every request goes through the op, over an unquantized ``nhd`` cache of the model
        #: dtype, attends and writes its new K/V with ``attend_write`` (tests switch it off to compare)
        self.fused_write = True
        #: long extends (more than ``FUSED_MAX_QUERIES`` new tokens) through the tiled kernel where the
        #: layer fits it (``tiled_fits``), else torch_native's SDPA path
        self.tiled = True
        #: the tiled kernel's instruction set (``kernel.TILED_ISAS``; 0: the best this CPU runs; tests pin one)
        self.tiled_isa = 0
        #: the kernel variant this process runs (``avx512bf16``, ``avx512``, ``avx2``, ``portable``)
        self.isa = kernel.isa()
        #: the tiled extend kernel's body this process runs at ``tiled_isa = 0`` (a ``kernel.TILED_ISAS`` name);
        #: ``amx`` also means bf16 decode runs its scores and value sum through AMX tiles (same check, amx.h)
        self.tiled_body = {v: k for k, v in kernel.TILED_ISAS.items()}[int(torch.ops.attnplug_cpu_fused.tiled_isa())]
        #: what a bf16 long extend runs at ``tiled_isa = 0`` (``amx``, ``vdpbf16ps``, ``widened``: to float32 and
        #: the FMA tiles) and why: without AMX, by ``vdpbf16ps``'s rate measured once a process
        #: (``kernel.tiled_bf16_body``)
        self.tiled_bf16_body, self.tiled_bf16_why = kernel.tiled_bf16_body()
        #: the last DECODE forward's metadata (``build_metadata``: the next one may carry its work and calls)
        self._last_decode: FusedMeta | None = None

    def build_metadata(self, batch: Any) -> FusedMeta:
        meta = FusedMeta(batch, self.cache)
        if meta.mode is ForwardMode.DECODE:
            prev, self._last_decode = self._last_decode, meta
            if prev is not None and _CARRY and prev.work and len(prev.rows) == len(meta.rows):
                self._carry(prev, meta)
        else:
            self._last_decode = None
        return meta

    def _carry(self, prev: FusedMeta, meta: FusedMeta) -> None:
        """``meta`` (a DECODE forward) takes ``prev``'s work and prepared calls (``prev``: the previous decode
        forward of as many requests) where every work ``prev`` made is a decode self-attention work whose split
        this forward keeps: each ``DecodeRows`` buffer is rewritten in place with this forward's header and rows,
        the values ``_decode_work`` would build (the same lengths: only the values move). A prepared call is kept
        only while the layer's plan is the one it was made from and the cache's ``req_to_token`` the tensor it
        holds; ``_call`` checks its layer, dtype and thread count as for a call made in this forward. Anything
        else: nothing is carried, the forward builds its own."""
        threads = torch.get_num_threads()
        renewed = []
        for key, fw in prev.work.items():
            dr = fw.rows if isinstance(fw, FusedForward) else None
            if dr is None or key[1] != threads:
                return
            values, per_item = self._decode_values(dr.window, dr.geometry, meta, threads)
            if per_item != dr.per_item or len(values) != len(dr.buf):
                return
            renewed.append((dr.buf, values))
        for buf, values in renewed:
            buf[:] = values  # the same length: the tensor over the buffer sees the new rows (no reallocation)
        r2t, plans = self.cache.req_to_token, self._layer_plans
        calls = {}
        for lid, call in prev.calls.items():
            plan = plans.get(lid)
            if plan is not None and plan.layer is call.layer and plan.kernel is call.fl and \
                    (call.head is None or call.head[2] is r2t):
                calls[lid] = call
        meta.work, meta.calls, meta.carried = prev.work, calls, True

    def runtime_notes(self) -> list[str]:
        amx = self.isa == "avx512bf16" and self.tiled_body == "amx"
        return [f"kernel variant {self.isa} (of {', '.join(kernel.ISAS)}; chosen by cpuid at load); decode and "
                f"extends of <= {FUSED_MAX_QUERIES} new tokens through the kernel"
                f"{' (bf16: scores and value sum through AMX tiles)' if amx else ''}, longer extends through the "
                f"tiled extend kernel's {self.tiled_body} body (of {', '.join(kernel.TILED_ISAS)}; chosen by cpuid "
                f"at load) where the layer fits it, else torch_native's SDPA path; bf16 long extends: "
                f"{self.tiled_bf16_why}"]

    # -- per layer -----------------------------------------------------------
    def plan_layer(self, layer: Any) -> FusedLayer:
        """The op's arguments that depend only on the layer, built once per layer object."""
        cache, lid = self.cache, layer.layer_id
        cross = layer.is_cross_attention
        window = None if cross else layer.sliding_window
        sinks = None
        if layer.sinks is not None:
            sinks = torch.as_tensor(layer.sinks).detach().to(device=self.device, dtype=_F32).reshape(
                layer.num_heads).contiguous()
        kc, vc = cache.get_kv(lid)
        geometry = (window, cross, layer.num_kv_heads, layer.gqa_group_size, layer.head_dim, layer.v_head_dim)
        win, scale, cap = -1 if window is None else int(window), float(layer.scaling), float(layer.logit_cap or 0.0)
        params = layer_params(layer.gqa_group_size, win, scale, cap, 1.0, 1.0, sinks)
        return FusedLayer(kc, vc, sinks, win, cross, scale, cap, torch.zeros(4, dtype=torch.int64), geometry,
                          bool(layer.uses_bidirectional), params)

    # -- per forward ------------------------------------------------------------
    def _work(self, q: torch.Tensor, layer: Any, meta: FusedMeta, fl: FusedLayer) -> Work:
        threads = torch.get_num_threads()
        key = (q.dtype, threads, fl.geometry)
        got = meta.work.get(key)
        if got is None:
            got = meta.work[key] = self._prepare(layer, meta, threads)
        return got

    def _prepare(self, layer: Any, meta: FusedMeta, threads: int) -> Work:
        G, D, Dv, Hkv = layer.gqa_group_size, layer.head_dim, layer.v_head_dim, layer.num_kv_heads
        cross = layer.is_cross_attention
        window = None if cross else layer.sliding_window
        aim = min(self.max_workspace_bytes, FUSED_SCRATCH_BYTES)
        # a bf16 layer may run its scores and value sum on AMX tiles, whose buffer counts too (over-counted
        # where the kernel declines the tiles for a layer: the workspace limit is never under-counted)
        amx = self.tiled_body == "amx" and self.isa == "avx512bf16" and self.cache.dtype == torch.bfloat16
        if meta.mode is ForwardMode.DECODE and not cross and _DECODE_PLAN and meta.rows:
            return self._decode_work(window, (G, D, Dv, Hkv, amx), meta, threads)
        # work items are (chunk of a request's queries, KV heads): all heads unless that leaves
        # threads idle, then fewer heads and shorter chunks until the scratch is under the aim
        chunk = FUSED_QUERY_CHUNK
        while True:
            plan, most_keys, most_q = meta.plan(window, cross, chunk)
            B = plan.shape[0]
            if B == 0:
                return NO_REQUESTS
            per_item = Hkv if B >= 2 * threads else max(1, Hkv * B // (2 * threads))

            def scratch(heads: int) -> int:
                return kernel.scratch_bytes(threads, heads, most_q, G, most_keys, D, Dv, amx)  # noqa: B023  # called in this iteration

            while per_item > 1 and scratch(per_item) > aim:
                per_item = (per_item + 1) // 2
            if most_q == 1 or scratch(per_item) <= aim:
                break
            chunk = max(1, most_q // 2)
        need = scratch(per_item)
        if need > self.max_workspace_bytes:
            return Declined(f"the kernel's scratch ({need} bytes) exceeds max_workspace_bytes="
                            f"{self.max_workspace_bytes}")
        mask = None if cross else meta.mask(chunk)
        # a decode forward's work rows are its requests in order (one query each), whatever the chunk
        requests = list(range(B)) if meta.mode is ForwardMode.DECODE else [i for i, _, _ in meta.chunks(chunk)]
        return FusedForward(plan, mask, per_item, requests, work_tensor(plan, mask, per_item))

    def _decode_values(self, window: int | None, geometry: tuple[Any, ...], meta: FusedMeta,
                       threads: int) -> tuple[array.array, int | Declined]:
        """A DECODE forward's self-attention ``work`` values (header, then one row per request: ``decode_rows``) and
        the KV heads per work item (``_prepare``'s split: every head unless that leaves threads idle, halved while
        the scratch is over the aim; one query a row), or the ``Declined`` for a scratch over the workspace
        limit."""
        G, D, Dv, Hkv, amx = geometry
        aim = min(self.max_workspace_bytes, FUSED_SCRATCH_BYTES)
        B = len(meta.rows)
        # the header (its KV heads per item set below), then the rows, in one buffer
        values, most_keys = decode_rows(meta.rows, meta.prefix, window, (B, 0, 0, 0, 0, 0, 0, 0))
        per_item = Hkv if B >= 2 * threads else max(1, Hkv * B // (2 * threads))
        need = kernel.scratch_bytes(threads, per_item, 1, G, most_keys, D, Dv, amx)
        while per_item > 1 and need > aim:
            per_item = (per_item + 1) // 2
            need = kernel.scratch_bytes(threads, per_item, 1, G, most_keys, D, Dv, amx)
        if need > self.max_workspace_bytes:
            return values, Declined(f"the kernel's scratch ({need} bytes) exceeds max_workspace_bytes="
                                    f"{self.max_workspace_bytes}")
        values[1] = per_item
        return values, per_item

    def _decode_work(self, window: int | None, geometry: tuple[Any, ...], meta: FusedMeta, threads: int) -> Work:
        """``_prepare`` for a DECODE forward's self-attention: the rows ``plan`` gives (``_decode_plan``) and the
        header ``work_tensor`` puts before them, built in one buffer (no header tensor, no concatenation); the
        ``DecodeRows`` record lets the next decode forward rewrite it (``_carry``)."""
        values, per_item = self._decode_values(window, geometry, meta, threads)
        if isinstance(per_item, Declined):
            return per_item
        work = _table(values)
        return FusedForward(work[1:], None, per_item, list(range(len(meta.rows))), work,
                            DecodeRows(window, geometry, per_item, values))

    # -- the call -----------------------------------------------------------------
    def _args(self, q: torch.Tensor, k: Any, v: Any, layer: Any, fl: FusedLayer,
              fw: FusedForward, out: torch.Tensor) -> tuple[Any, ...]:
        kn = vn = None
        if not fl.cross:
            if self.cache.quantized:  # the new tokens as the cache stores them, dequantized (float32)
                k, v = self._stored(layer, k, v)
            elif k.dtype != q.dtype or v.dtype != q.dtype:
                k, v = k.to(q.dtype), v.to(q.dtype)
            kn = k if k.stride(-1) == 1 else k.contiguous()
            vn = v if v.stride(-1) == 1 else v.contiguous()
        q3 = q if q.stride(-1) == 1 else q.contiguous()
        params = fl.params
        if self.cache.quantized:  # the cache's current scales
            ks, vs = self.cache.kv_scales(layer.layer_id)
            params = layer_params(layer.gqa_group_size, fl.window, fl.scale, fl.cap, float(ks), float(vs), fl.sinks)
        return (q3, kn, vn, fl.k_cache, fl.v_cache, self.cache.req_to_token, params, fw.work, out)

    def _call(self, q: torch.Tensor, layer: Any, meta: FusedMeta) -> FusedCall:
        """``layer``'s prepared call in this forward (``FusedMeta.calls``), made on its first call."""
        threads = torch.get_num_threads()
        call = meta.calls.get(id(layer))
        if call is None or call.layer is not layer or call.dtype != q.dtype or call.threads != threads:
            fl = self.layer_plan(layer).kernel
            work: Work | None = BIDIRECTIONAL if fl.bidirectional else meta.work.get((q.dtype, threads, fl.geometry))
            if work is None:  # ``_work``'s answer, made on the first layer of this geometry in the forward
                work = meta.work[(q.dtype, threads, fl.geometry)] = self._prepare(layer, meta, threads)
            head = None
            whole = False
            if isinstance(work, FusedForward) and not fl.cross and not self.cache.quantized:
                head = (fl.k_cache, fl.v_cache, self.cache.req_to_token, fl.params, work.work)
                whole = len(meta.fused_requests()) == len(meta.rows)
            call = meta.calls[id(layer)] = FusedCall(layer, q.dtype, threads, fl, work, head, whole)
        return call

    def compute_and_write(self, compute: Callable[..., torch.Tensor], cache: Any, plan: Any, loc: torch.Tensor,
                          q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: Any, batch: Any,
                          meta: Any) -> torch.Tensor:
        """The skeleton's compute and KV write (``PagedBackend.compute_and_write``): where every request of the
        forward goes through the op (``FusedCall.whole``) and the new K/V are stored as they are (an unquantized
        ``nhd`` cache in q's dtype, ``write_new_kv``'s two index copies), one ``attend_write`` call attends,
        allocates the output and, once the attention returned, writes the rows at ``loc``; anything else (and
        ``fused_write = False``) computes and then writes as the skeleton does. The op checks every argument
        and slot before it writes, so a call that raises writes nothing."""
        if self.fused_write and plan.nhd and k.dtype == q.dtype and v.dtype == q.dtype and q.dtype == cache.dtype:
            call = self._call(q, layer, meta)
            if call.whole and q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1:
                try:
                    out: torch.Tensor = self._write_op(q, k, v, *call.head, loc)  # type: ignore[misc]
                    return out
                except RuntimeError as exc:
                    if "attnplug_cpu_fused::attend failed" not in str(exc):
                        raise
                    self._failed(call.fl, call.work, layer, meta, exc)  # type: ignore[arg-type]  # whole: a FusedForward
        return super().compute_and_write(compute, cache, plan, loc, q, k, v, layer, batch, meta)

    def _attend_fused(self, q: torch.Tensor, k: Any, v: Any, layer: Any, meta: FusedMeta,
                      out: torch.Tensor) -> Work:
        """Attend ``meta.fused_requests()`` through the op into their rows of ``out``; what was done."""
        call = self._call(q, layer, meta)
        fw = call.work
        if not isinstance(fw, FusedForward):
            return fw
        try:
            head = call.head
            if head is not None and k.dtype == q.dtype and v.dtype == q.dtype and q.stride(-1) == 1 \
                    and k.stride(-1) == 1 and v.stride(-1) == 1:  # the usual call: nothing to convert
                self._op(q, k, v, *head, out)
            else:
                self._op(*self._args(q, k, v, layer, call.fl, fw, out))
        except RuntimeError as exc:
            if "attnplug_cpu_fused::attend failed" not in str(exc):
                raise
            self._failed(call.fl, fw, layer, meta, exc)
        return fw

    def _failed(self, fl: FusedLayer, fw: FusedForward, layer: Any, meta: FusedMeta,
                exc: Exception) -> None:  # pragma: no cover  (error paths: tests/plugins/test_forward_robustness.py)
        """Raise the error the kernel's record (``fw.work``'s header) stands for."""
        code, work_row, pos, value = (int(x) for x in fw.work[0, kernel.WORK_ERR:].tolist())
        if code == kernel.RC_BAD_SLOT:
            i = fw.requests[work_row]
            raise ShapeError(
                f"{NAME}: request {i} (req_to_token row {meta.rows[i]}): position {pos} maps to slot {value}, "
                f"which is out of range (expected 0 <= slot < num_slots={self.cache.num_slots}); req_to_token "
                f"changed after init_forward_metadata checked it (layer {layer.layer_id}); nothing was written"
            ) from None
        if code == kernel.RC_NO_MEMORY:
            raise ResourceLimitError(
                f"{NAME}: the fused CPU kernel could not allocate its scratch (about {value / 2**20:.1f} MiB for a "
                f"thread) for layer {layer.layer_id}; lower BuildContext.max_workspace_bytes or split the batch"
            ) from None
        if code == kernel.RC_SCRATCH_PLAN:
            raise RuntimeError(
                f"{NAME}: the fused CPU kernel found work row {work_row} needing {value} padded keys, more than "
                f"the scratch it sized for this call (layer {layer.layer_id}): a bug in attention.cpp's scratch "
                f"plan; nothing was read past the scratch") from None
        # the capabilities admitted a layer the kernel refuses: the two disagree
        raise RuntimeError(f"{NAME}: the fused CPU kernel refused layer {layer.layer_id} although its declared "
                           f"capabilities admit it: {exc}") from None

    # -- long extends: the tiled kernel -------------------------------------------
    def tiled_fits(self, q: torch.Tensor, layer: Any, meta: FusedMeta) -> str | None:
        """``None`` when the tiled extend kernel takes this layer's long extends in this forward, else
        why torch_native's SDPA path runs them."""
        if not self.tiled:
            return "tiled=False"
        if layer.uses_bidirectional:
            return "a bidirectional layer (the tiled kernel masks causally)"
        if q.dtype not in (_F32, torch.bfloat16) or self.cache.quantized or self.cache.dtype != q.dtype:
            return f"a {self.cache.dtype} cache under a {q.dtype} model (the tiled kernel takes float32 and bfloat16)"
        if layer.is_cross_attention:
            return "cross-attention (the tiled kernel attends over the request's own tokens)"
        if layer.gqa_group_size > 64:
            return f"{layer.gqa_group_size} query heads per KV head (the tiled kernel takes up to 64)"
        if meta.custom_mask is not None:
            return "a target-verify mask (the tiled kernel masks causally)"
        need = kernel.tiled_scratch_bytes(torch.get_num_threads(), layer.head_dim, layer.v_head_dim)
        if need > self.max_workspace_bytes:
            return f"the tiled kernel's scratch ({need} bytes) is over the workspace limit"
        return None

    def _attend_tiled(self, q: torch.Tensor, k: Any, v: Any, layer: Any, meta: FusedMeta,
                      out: torch.Tensor) -> bool:
        """Attend ``meta.tiled_requests()`` through the tiled op into their rows of ``out``; ``False``
        (nothing written) when the layer does not fit it (``tiled_fits``)."""
        key = (q.dtype, id(layer))
        if key not in meta.tiled_why:
            meta.tiled_why[key] = self.tiled_fits(q, layer, meta)
        if meta.tiled_why[key] is not None:
            return False
        fl = self.layer_plan(layer).kernel
        window = layer.sliding_window
        plan = meta.tiled_plan(window)
        q3 = q if q.stride(-1) == 1 else q.contiguous()
        if k.dtype != q.dtype or v.dtype != q.dtype:
            k, v = k.to(q.dtype), v.to(q.dtype)
        kn = k if k.stride(-1) == 1 else k.contiguous()
        vn = v if v.stride(-1) == 1 else v.contiguous()
        try:
            self._tiled_op(q3, kn, vn, fl.k_cache, fl.v_cache, self.cache.req_to_token, plan, fl.sinks, out, fl.err,
                           layer.gqa_group_size, -1 if window is None else int(window), self.tiled_isa, fl.scale,
                           fl.cap)
        except RuntimeError as exc:
            if "attnplug_cpu_fused::extend_tiled failed" not in str(exc):
                raise
            self._tiled_failed(fl, layer, meta, exc)
        return True

    def _tiled_failed(self, fl: FusedLayer, layer: Any, meta: FusedMeta,
                      exc: Exception) -> None:  # pragma: no cover  (error paths: tests/plugins/test_cpu_fused_tiled.py)
        code, row, pos, value = (int(x) for x in fl.err.tolist())
        if code == kernel.RC_BAD_SLOT:
            i = meta.tiled_requests()[row]
            raise ShapeError(
                f"{NAME}: request {i} (req_to_token row {meta.rows[i]}): position {pos} maps to slot {value}, "
                f"outside the cache's {self.cache.num_slots} slots (req_to_token changed after the batch was "
                f"checked)") from None
        if code == kernel.RC_NO_MEMORY:
            raise ResourceLimitError(f"{NAME}: the tiled CPU kernel could not allocate its scratch "
                                     f"({value} bytes per thread, layer {layer.layer_id})") from None
        if code == kernel.RC_ISA:
            raise ValueError(f"{NAME}: tiled_isa={self.tiled_isa} is not available on this CPU (best: "
                             f"{int(torch.ops.attnplug_cpu_fused.tiled_isa())})") from None
        raise RuntimeError(f"{NAME}: the tiled CPU kernel refused layer {layer.layer_id} although tiled_fits "
                           f"admitted it: {exc}") from None

    def compute_decode(self, q: torch.Tensor, k: Any, v: Any, layer: Any, batch: Any, meta: Any) -> torch.Tensor:
        out = self.empty_output(q, layer)
        if isinstance(self._attend_fused(q, k, v, layer, meta, out), Declined):
            return super().compute_decode(q, k, v, layer, batch, meta)
        return out

    def compute_extend(self, q: torch.Tensor, k: Any, v: Any, layer: Any, batch: Any, meta: Any) -> torch.Tensor:
        out = self.empty_output(q, layer)
        work = self._attend_fused(q, k, v, layer, meta, out)
        if isinstance(work, Declined):
            return super().compute_extend(q, k, v, layer, batch, meta)
        done = frozenset(meta.fused_requests()) if isinstance(work, FusedForward) else frozenset()
        if meta.tiled_requests() and self._attend_tiled(q, k, v, layer, meta, out):
            done = done | frozenset(meta.tiled_requests())
        if len(done) == len(meta.rows):
            return out
        return self.extend_requests(q, k, v, layer, meta, out, skip=done)

    def kernel_call(self, q: Any, k: Any, v: Any, layer: Any,
                    batch: Any) -> Any:  # pragma: no cover  (bench --overhead's hook: tests/fast/test_hot_path.py)
        """The op with this forward's prepared arguments (only the output made per call) and the two
        index copies of the K/V write, when every request goes through the kernel (``attend_write`` alone where
        a forward calls it: ``compute_and_write``); else the default."""
        meta = self.forward_metadata(batch)
        fl = self.layer_plan(layer).kernel
        out = self.empty_output(q, layer)
        fw = self._work(q, layer, meta, fl)
        if layer.is_cross_attention or self.cache.quantized or fl.bidirectional or not isinstance(fw, FusedForward) or \
                len(meta.fused_requests()) != len(meta.rows):
            return super().kernel_call(q, k, v, layer, batch)
        if self.fused_write and self.layer_plan(layer).nhd and k.dtype == q.dtype == v.dtype == self.cache.dtype:
            a = self._args(q, k, v, layer, fl, fw, out)
            wargs = (*a[:8], batch.out_cache_loc.to(torch.int64).contiguous())
            wop = self._write_op
            return lambda: wop(*wargs)
        args = list(self._args(q, k, v, layer, fl, fw, out))
        op, write = self._op, self.raw_write(layer, batch, k, v)
        shape, dtype = tuple(out.shape), out.dtype

        def call() -> torch.Tensor:
            o = torch.empty(shape, dtype=dtype)
            args[8] = o
            op(*args)
            write()
            return o
        return call


