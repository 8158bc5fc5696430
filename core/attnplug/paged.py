"""``PagedBackend``: the forward skeleton every backend over the canonical paged cache shares.

A backend author subclasses ``PagedBackend`` and implements only what is
specific to a kernel:

* ``build_metadata(batch)`` — this forward's kernel inputs, built once and
  shared by every layer (default: nothing beyond the batch);
* ``compute_extend(q, k, v, layer, batch, meta)`` — every extend-shaped mode
  (EXTEND, MIXED, TARGET_VERIFY, DRAFT_EXTEND, DRAFT_EXTEND_V2);
* ``compute_decode(...)`` — DECODE (default: ``compute_extend``).

The base does the rest, once, in this order:

1. **per forward** (``init_forward_metadata``): the mode is claimed; every index
   the forward will use is in bounds — ``req_pool_indices`` against the
   ``req_to_token`` rows, ``out_cache_loc`` against the slots, ``seq_lens`` /
   ``encoder_lens`` against ``max_context_len``, and every cached position a
   request reads maps to a real slot (an unassigned ``-1`` or a wild entry is an
   error naming the request, the position and the value); and for a backend that
   declares ``reads_page_table`` (its kernel finds a position's slot through the page
   of the position's page start, as ``PagedKVCache.page_table`` builds it), that every
   position it reads is page-aligned (``PagedKVCache.check_page_aligned``): a mapping
   a page table cannot express would otherwise read another request's K/V. These need
   a reduction over the batch, so they run here once, never per layer;
2. **per layer** (``forward``): structural checks that need no reduction —
   ``layer_id`` in range, q/k/v shapes, a claimed dtype, one device, cache rows
   that match the layer, ``k``/``v`` present for self-attention, and the
   layer-support verdict. What depends only on the layer (``layer_id`` in range,
   the cache rows, the verdict) is checked once, when the layer's plan
   (``LayerPlan``, cached per ``LayerSpec`` object) is built; what depends only on
   the forward (mode, token count, which compute runs, the int64 write slots) is
   recorded once per forward by ``init_forward_metadata``; each call then compares
   q/k/v's shapes, dtypes and device with the two (a few attribute reads) and
   falls back to the full ``check_forward`` for its error message when one differs;
3. the **KV write**, placed so that a forward that raises writes nothing:
   ``new_kv_source = "args"`` (the kernel takes this forward's K/V from its
   arguments): compute first, write after it returned; ``"cache"`` (the kernel
   reads them from the cache): write, compute, and restore the overwritten rows
   if the kernel raises or ``save_kv_cache=False``;
4. **compute**: ``compute_decode`` or ``compute_extend``, chosen by the batch's
   mode (not by which protocol method was called).

Output contract: a forward returns a fresh ``[tokens, num_heads, v_head_dim]``
tensor in the query dtype that the caller owns; no later layer or forward
writes into it.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from .backend import AttentionBackend, MetadataGuard
from .batch import ForwardBatch, ValidationRecord, _version, check_mla_qkv, check_qkv, counters_of
from .capabilities import support_reasons
from .support import SupportQuery
from .support import reasons as support_reasons_of
from .errors import AttnplugError, ConfigError, NotSupportedError, ResourceLimitError, ShapeError
from .layer import UNABSORBED, LayerSpec
from .modes import ForwardMode

if TYPE_CHECKING:
    from .build_context import BuildContext
    from .kvcache import PagedKVCache


def format_bytes(n: int | float) -> str:
    """``n`` bytes for a message, in the largest binary unit that keeps it at least 1 (``"4.00 KiB"``,
    ``"1.50 GiB"``, ``"512 B"``): a small workspace limit never reads "0.00 GiB"."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if abs(n) >= 1 << shift:
            return f"{n / (1 << shift):.2f} {unit}"
    return f"{int(n)} B"

__all__ = ["LayerPlan", "PagedBackend"]


def _load_speedups(env: Any = os.environ) -> tuple[Any, Any, str]:
    """``(layer_ok, expectation, note)`` of the optional attnplug-speedups package (the per-layer check of a planned
    layer compiled: ``speedups/``), or ``(None, None, note)`` with why not; ``ATTNPLUG_SPEEDUPS=0`` turns it off,
    ``1`` or unset uses it when it imports. ``note`` is what ``attnplug doctor`` prints."""
    setting = env.get("ATTNPLUG_SPEEDUPS", "").strip()
    if setting not in ("", "0", "1"):
        raise ConfigError(f"ATTNPLUG_SPEEDUPS={setting!r}: expected 0 (the Python per-layer check) or 1 (the "
                          f"compiled check of attnplug-speedups where it is installed)")
    if setting == "0":
        return None, None, "off (ATTNPLUG_SPEEDUPS=0): the per-layer check runs in Python"
    try:
        sp = importlib.import_module("attnplug_speedups")  # (optional, compiled: typed through its two calls)
    except ModuleNotFoundError as exc:
        if exc.name not in ("attnplug_speedups", "attnplug_speedups._C"):
            raise
        return None, None, "not installed (pip install ./speedups): the per-layer check runs in Python"
    except ImportError as exc:  # installed, but built for another torch or Python
        return None, None, f"installed but not loadable ({exc}): the per-layer check runs in Python; rebuild it"
    return sp.layer_ok, sp.expectation, "in use: a planned layer's per-layer check is one compiled call"


#: attnplug-speedups' two calls (``None`` without it) and the line doctor prints: read once, when this module loads
_layer_ok, _expectation, SPEEDUPS_NOTE = _load_speedups()


class LayerPlan:
    """What one layer's forwards share, built once per layer object (``PagedBackend.layer_plan``).

    Built only after the layer passed ``check_forward`` (``layer_id`` in range, the cache rows, the
    support verdict), so a layer with a plan needs none of those again. ``kernel`` is what the
    backend's ``plan_layer`` returned for it (its per-layer kernel arguments; ``None`` by default).
    """

    __slots__ = ("layer", "layer_id", "q_rest", "k_rest", "v_rest", "cross", "staged", "kernel", "storage", "nhd",
                 "checked_call", "mla", "cpu", "plain_dtype", "next", "kb", "vb", "tokens", "q_shape",
                 "k_shape", "v_shape", "dtype", "fast", "inline")

    def __init__(self, layer: LayerSpec, staged: bool, cache: PagedKVCache | None = None) -> None:
        self.layer = layer  # held: the plan is found by id(layer), which must not be reused meanwhile
        self.layer_id = layer.layer_id
        self.q_rest = (layer.num_heads, layer.head_dim)
        self.k_rest = (layer.num_kv_heads, layer.head_dim)
        self.v_rest = (layer.num_kv_heads, layer.v_head_dim)
        self.cross = bool(layer.is_cross_attention)
        #: an MLA layer (``LayerSpec.mla``): its forwards take ``_forward_mla``
        self.mla = getattr(layer, "mla", None) is not None
        #: the KV write is staged around the kernel (``new_kv_source == "cache"``, self-attention)
        self.staged = staged and not self.cross
        self.kernel: Any = None  # what the backend's plan_layer returned: its own type
        #: the layer's storage in the cache (its layout's tensors), for writes with nothing left to check
        #: (``PagedBackend._write``); ``nhd``: two index copies of an unquantized ``nhd`` cache, else the
        #: layout's own write
        self.storage: Any = None if cache is None else cache.layer_storage(self.layer_id)
        #: ``storage``'s two tensors where it has two (``nhd``: K and V rows), for the skeleton's plain write
        pair = self.storage if isinstance(self.storage, tuple) and len(self.storage) == 2 else (None, None)
        self.kb: torch.Tensor | None = pair[0]
        self.vb: torch.Tensor | None = pair[1]
        #: the per-call check's expected shapes at the last token count (``tokens``), held as slots (one object
        #: fewer to read than a tuple of them), and the query dtype the layer's last full check passed with
        self.tokens = -1
        self.q_shape: tuple[int, ...] = ()
        self.k_shape: tuple[int, ...] = ()
        self.v_shape: tuple[int, ...] = ()
        self.dtype: torch.dtype | None = None
        #: attnplug-speedups' expectation of this layer's calls (``_expectation``: q/k/v's heads and dims, the
        #: checked dtype and device type), set by a full check of a self-attention layer whose K/V are written
        #: after its compute (not staged, no checked call); ``None``: the Python per-call check
        self.fast: bytes | None = None
        #: a call ``fast`` passes ends in the inline plain write (else in ``PagedBackend.compute_and_write``)
        self.inline = False
        self.nhd = cache is not None and cache.layout.name == "nhd" and not cache.quantized
        #: the backend's self-checking call of this layer (``PagedBackend.checked_layer_call``; ``None``: none)
        self.checked_call: Callable[..., torch.Tensor | None] | None = None
        #: the backend's per-call constants, held here (the skeleton reads the plan anyway; a slot is cheaper
        #: than the backend's ``__dict__`` once a kernel has evicted both): whether the cache is on the CPU, and the dtype of a self-attention layer's plain write (``PagedBackend._forward``:
        #: two index copies into an unquantized ``nhd`` cache of that dtype, the write after the compute; ``None``
        #: where the backend writes another way)
        self.cpu = cache is not None and cache.device.type == "cpu"
        self.plain_dtype: torch.dtype | None = None
        #: the plan of the layer that followed this one in the backend's last forward (``PagedBackend._forward``
        #: expects it next: the plan is then found without a dictionary lookup); ``None``: not known
        self.next: LayerPlan | None = None


class _NoCounter:
    """Stands for an absent write counter among ``_Forward``'s first two: it reads 0, recorded as 0."""

    __slots__ = ()
    _version = 0


_NO_COUNTER = _NoCounter()

#: ``_Forward.prev`` at a forward's start: the first plan found becomes the backend's ``_first_plan``
_CHAIN_START: Any = object()

#: ``_Forward.watch`` of a batch whose validation record is replaced whenever an index field is
#: (``ForwardBatch.__setattr__``): the per-layer guard reads the record's identity only
_RECORD_TRACKS_FIELDS: Any = object()
_BATCH_SETATTR = ForwardBatch.__setattr__


class _Forward:
    """What every layer of one forward shares that ``init_forward_metadata`` knows: recorded once."""

    __slots__ = ("batch", "meta", "idle", "num_tokens", "compute", "loc", "has_encoder", "changed", "fields", "snap",
                 "watch", "counters", "r2t", "r2t_version", "trusted", "expect", "prev", "c0", "v0", "c1", "v1", "more",
                 "cx", "__weakref__")

    def __init__(self, backend: PagedBackend, batch: ForwardBatch, meta: Any) -> None:
        self.batch, self.meta = batch, meta
        mode = batch.forward_mode
        self.idle = mode is ForwardMode.IDLE
        self.num_tokens = batch.num_tokens
        #: the compute this forward's mode runs; a backend keeping the default ``compute_decode`` (which only calls
        #: ``compute_extend``) gets ``compute_extend`` itself (one Python frame less a layer)
        self.compute = backend.compute_decode if mode is ForwardMode.DECODE and \
            type(backend).compute_decode is not PagedBackend.compute_decode else backend.compute_extend
        #: the write slots as int64 (what the cache's writes index with), converted once per forward; a host
        #: running under ``torch.inference_mode`` (vLLM, the transformers runner) hands inference tensors, which
        #: keep no write counter: their int64 copy is made outside inference mode, so it keeps one and what a
        #: layout memoises per slot tensor (vllm_cpu's snapshot index) is built once per forward, not per layer
        loc = batch.out_cache_loc
        if not self.idle:
            if loc.is_inference():
                with torch.inference_mode(False):
                    loc = loc.to(torch.int64, copy=True)
            elif loc.dtype is not torch.int64:  # (``to`` of an int64 tensor is the tensor itself)
                loc = loc.to(torch.int64)
        self.loc = loc
        self.has_encoder = batch.encoder_lens is not None
        #: ``ForwardBatch.changed_since_validate`` (a version-counter read per field, no sync): run per
        #: layer, so an index field changed after ``init_forward_metadata`` is refused at every layer
        self.changed = getattr(batch, "changed_since_validate", None)
        #: the same test without its call, for the per-layer check (``PagedBackend._forward``): the batch's
        #: ``__dict__``, the validation record ``changed_since_validate`` compares with (``ForwardBatch.validate``
        #: replaces it: then the per-layer check asks ``changed_since_validate`` itself), and that record's
        #: ``(field, tensor, version)`` entries; ``None`` where the batch keeps no record (never "changed")
        d = getattr(batch, "__dict__", None)
        snap = None if self.changed is None or d is None else d.get("_validated")
        self.fields, self.snap = d, snap
        #: ``watch``: the ``(field, tensor)`` pairs (each field still holds its object); ``counters``: one
        #: ``(tensor, version)`` per write counter among them — fields that are views of one buffer share its
        #: counter (``ForwardBatch.decode`` from host ints makes them so), read once through the buffer, so a
        #: layer touches one counter for the lot instead of one per field (after a kernel that streamed the
        #: caches each is a miss). Fields recorded with different versions of one counter: never "unchanged"
        self.watch: tuple[tuple[str, Any], ...] | None = None
        self.counters: tuple[tuple[Any, int], ...] = ()
        #: the validation record not superseded since (``ValidationRecord.watch``: the record sets it ``False``),
        #: where the batch's setter replaces the record whenever a field is (``watch is _RECORD_TRACKS_FIELDS``):
        #: the per-layer guard reads this flag; ``False`` from the start: it compares the batch's record instead
        self.trusted = False
        #: the plan chain (``LayerPlan.next``): the plan expected at the next layer, and the last layer's plan
        #: (``_CHAIN_START`` before the first; ``None``: a layer without a plan ran, nothing to link to)
        self.expect: LayerPlan | None = backend._first_plan
        self.prev: Any = _CHAIN_START
        if snap is not None:
            # a ``ForwardBatch`` (its own setter) whose fields are the recorded objects now: a replacement from
            # here on replaces the record (``ForwardBatch.__setattr__``), so the record's identity stands for
            # every field's
            tracks = type(batch).__setattr__ is _BATCH_SETATTR
            if tracks:
                for f, (t, _) in snap.items():
                    if d.get(f) is not t:  # type: ignore[union-attr]  # (snap: d is set)
                        tracks = False
                        break
            if tracks:
                self.watch = _RECORD_TRACKS_FIELDS
                if snap.__class__ is ValidationRecord and not snap.superseded:
                    self.trusted = True
                    snap.watch(self)
            else:
                self.watch = tuple((f, t) for f, (t, _) in snap.items())
            # one counter per buffer, read through ``out_cache_loc`` where it is a view of it (``counters_of``)
            self.counters = snap.counters() if snap.__class__ is ValidationRecord else counters_of(snap)
        #: ``req_to_token``'s in-place write counter when the forward was checked (``None``: an inference
        #: tensor, which keeps none, or no cache: a backend built to be inspected may still run an IDLE
        #: forward): a write into it before a layer runs re-checks that layer's call; read per layer as one of
        #: ``counters``
        self.r2t: Any = None if backend.kv_cache is None else backend.kv_cache.req_to_token
        self.r2t_version = _version(self.r2t)
        if self.r2t_version is not None:
            self.counters += ((self.r2t, self.r2t_version),)
        #: ``counters`` as the per-layer guard reads them: the first two as slots (``_NO_COUNTER``, which reads 0,
        #: where there are fewer), the rest in ``more`` (one object fewer to read per counter than the tuples)
        first = self.counters[:2] + ((_NO_COUNTER, 0),) * (2 - min(2, len(self.counters)))
        (self.c0, self.v0), (self.c1, self.v1) = first
        self.more = self.counters[2:]
        #: what attnplug-speedups' ``layer_ok`` reads of this forward: the token count, then each counter and its
        #: recorded version (``None``: no compiled check this forward)
        self.cx: tuple[Any, ...] | None = None
        if _layer_ok is not None and not self.idle and type(self.num_tokens) is int and self.num_tokens > 0:
            self.cx = (self.num_tokens,) + tuple(x for pair in self.counters for x in pair)


class PagedBackend(AttentionBackend):
    """Base class of backends over ``PagedKVCache``; see the module docstring for the steps."""

    #: name used in errors before the registry stamps the backend (set it to the canonical name)
    backend_name: ClassVar[str] = ""
    #: where the kernel reads this forward's new K/V: ``"args"`` or ``"cache"`` (see module docstring)
    new_kv_source: ClassVar[str] = "args"
    #: the kernel reads the cache through a page table (one page per ``page_size`` positions), not slot
    #: by slot: every forward then refuses a ``req_to_token`` that is not page-aligned (a declared
    #: requirement, checked by ``init_forward_metadata``; backends reading token by token leave it False)
    reads_page_table: ClassVar[bool] = False

    ctx: BuildContext  # always set: a paged backend is built with a context
    _first_plan: LayerPlan | None = None  # (``__init__`` sets it; here for a subclass that skips it)

    def __init__(self, ctx: BuildContext) -> None:
        self.ctx = ctx
        self.kv_cache = ctx.kv_cache
        self.device = torch.device(ctx.device if ctx.kv_cache is None else ctx.kv_cache.device)
        #: bound on any one workspace a kernel allocates (``BuildContext.max_workspace_bytes``)
        self.max_workspace_bytes = int(getattr(ctx, "max_workspace_bytes", 4 << 30))
        self._guard = MetadataGuard(self.name)
        #: how many times metadata was built (tests: once per forward, whatever the layer count)
        self.metadata_builds = 0
        #: the claimed dtypes as torch dtypes, for the per-layer check (built once, here)
        self._claimed_torch = frozenset(
            getattr(torch, n) for n in type(self).capabilities.dtypes if hasattr(torch, n)
        )
        #: per layer object: its ``LayerPlan`` (keyed by ``id(layer)``; the plan holds the layer)
        self._layer_plans: dict[int, LayerPlan] = {}
        #: this forward's record (``_Forward``), set by ``init_forward_metadata``
        self._fwd: _Forward | None = None
        #: the plan of the first layer of the last forward (the start of the plan chain, ``LayerPlan.next``)
        self._first_plan: LayerPlan | None = None
        self._device_type = None if self.kv_cache is None else self.kv_cache.device.type
        #: the cache is on the CPU: the per-call device check reads ``Tensor.is_cpu`` (one flag) instead of
        #: ``Tensor.device.type`` (a device object and a string made per read: ~10 µs a layer with cold caches)
        self._on_cpu = self._device_type == "cpu"
        #: the caller's output buffer during a ``forward_into`` call (``None`` otherwise): a compute whose kernel
        #: writes its output in place may take it (``output_buffer``) instead of allocating
        self._into: torch.Tensor | None = None

    # -- identity --------------------------------------------------------------
    @property
    def name(self) -> str:
        """The stamp once built through the registry; the class's ``backend_name`` before."""
        return self.prefill_attention_backend_str or type(self).backend_name or type(self).__name__

    @property
    def cache(self) -> PagedKVCache:
        """The engine's ``PagedKVCache`` (an error naming the backend when it was built without one)."""
        if self.kv_cache is None:
            raise AttnplugError(
                f"{self.name} was built without a KV cache (BuildContext.kv_cache is None); "
                f"build it with the engine's PagedKVCache to run forwards"
            )
        return self.kv_cache

    def not_supported_reasons(self, layer: LayerSpec | None, ctx: BuildContext | None = None) -> list[str]:
        """Generic reasons from the declared capabilities, then ``backend_reasons``, under ``ctx`` or else
        the build context."""
        ctx = self.ctx if ctx is None else ctx
        return super().not_supported_reasons(layer, ctx) + self.backend_reasons(layer, ctx)

    def layer_reasons(self, layer: LayerSpec) -> list[str]:
        """The per-layer verdict (memoised by ``require_supported``): generic layer reasons, then
        ``backend_reasons(layer, None)``."""
        return support_reasons(type(self).capabilities, layer, backend=self.name) + self.backend_reasons(layer, None)

    def backend_reasons(self, layer: LayerSpec | None, ctx: BuildContext | None) -> list[str]:
        """Reasons the declared capabilities cannot express (override; default: none).

        Called with ``ctx=None`` for the per-layer verdict taken at forward (reasons that depend
        only on the layer and this built backend), and with a ``BuildContext`` from
        ``not_supported_reasons`` (add the context's reasons then). Word them as the generic
        reasons are: ``"<field>=<value> (<what is supported>)"``. Default: an MLA layer's
        ``mla_reasons``, none for other layers.
        """
        if getattr(layer, "mla", None) is not None:
            return self.mla_reasons(layer, ctx)  # type: ignore[arg-type]  # an MLA layer is a LayerSpec
        return []

    def mla_reasons(self, layer: LayerSpec, ctx: BuildContext | None) -> list[str]:
        """Why this backend's MLA kernels cannot serve MLA ``layer`` beyond what ``Capabilities.mla_forms``
        declares (the latent they exist for, page sizes, dtypes); asked by the default ``backend_reasons``
        (override; default: none)."""
        return []

    # -- to implement ----------------------------------------------------------
    def build_metadata(self, batch: ForwardBatch) -> Any:
        """This forward's kernel inputs (called once per forward, never for IDLE). Default: ``None``."""
        return None

    def compute_extend(
        self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, layer: LayerSpec,
        batch: ForwardBatch, meta: Any
    ) -> torch.Tensor:
        """Attention for an extend-shaped batch; returns ``[tokens, num_heads, v_head_dim]``."""
        raise NotImplementedError(f"{type(self).__name__} does not implement compute_extend")

    def compute_decode(
        self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, layer: LayerSpec,
        batch: ForwardBatch, meta: Any
    ) -> torch.Tensor:
        """Attention for a DECODE batch. Default: ``compute_extend`` (one kernel for every mode)."""
        return self.compute_extend(q, k, v, layer, batch, meta)

    def plan_layer(self, layer: LayerSpec) -> Any:
        """This backend's per-layer kernel arguments (``LayerPlan.kernel``), built once per layer object
        after the layer passed every check; read it back in a compute with ``layer_plan(layer).kernel``.
        Default: ``None``."""
        return None

    def checked_layer_call(self, plan: LayerPlan) -> Callable[..., torch.Tensor | None] | None:
        """A call that runs one planned layer's whole forward and checks its own arguments, for a backend
        whose compiled kernel can (``LayerPlan.checked_call``; default ``None``: none). The skeleton tries
        it after the per-forward checks (the plan is this layer's, the batch's index fields and
        ``req_to_token`` unchanged since ``init_forward_metadata``) and before its per-call q/k/v checks:
        ``call(q, k, v, meta, loc, save_kv_cache)`` (``meta`` the forward's metadata, ``loc`` its int64
        write slots). It either returns the layer's output, having done everything ``forward`` does
        (q/k/v's shapes, dtypes, devices and strides checked; the K/V write, kept only when
        ``save_kv_cache``; the cache as it was when it raises; outputs of non-finite inputs as the
        reference's), or returns ``None`` having changed nothing, and the skeleton's checked path runs.
        It must return ``None`` for any argument it cannot check itself (docs/reliability.md)."""
        return None

    def layer_plan(self, layer: LayerSpec) -> LayerPlan:
        """The plan of ``layer`` (built by its first forward); a layer with no plan yet gets one after
        its layer-only checks (``check_layer_id``, ``check_layer_rows``, the support verdict) pass."""
        plan = self._layer_plans.get(id(layer))
        if plan is not None and plan.layer is layer:
            return plan
        cache = self.cache
        cache.check_layer_id(layer.layer_id)
        cache.check_layer_rows(layer)
        self.require_supported(layer)
        plan = LayerPlan(layer, type(self).new_kv_source == "cache", cache)
        plan.kernel = self.plan_layer(layer)
        plan.checked_call = self.checked_layer_call(plan)
        plan.cpu = self._on_cpu
        if self._plain_write and plan.nhd and not plan.staged and not plan.cross:
            plan.plain_dtype = cache.dtype
        if isinstance(layer, LayerSpec):  # frozen: what was checked stays true; other objects: every call
            self._layer_plans[id(layer)] = plan
            self._unlink_plans()
        return plan

    # -- attention sinks as a kernel reads them ----------------------------------------
    #: the torch dtype a kernel reads attention sinks in (``device_sinks``; ``None``: float32)
    sinks_dtype: ClassVar[torch.dtype | None] = None

    def device_sinks(self, layer: LayerSpec) -> torch.Tensor | None:
        """``layer``'s sinks as a kernel reads them (``sinks_dtype``, one per query head, on this backend's
        device, contiguous), converted ONCE per layer and kept: a host-to-device copy or a cast is refused
        inside CUDA-graph capture, so the capture hooks call ``prepare_sinks`` before capture and a captured
        kernel reads the kept tensor on replay. Another sinks object for the layer converts again (the
        source is held, so its ``id`` stays its own); ``None`` for a layer without sinks."""
        if layer.sinks is None:
            return None
        kept: dict[tuple[int, int], tuple[object, torch.Tensor]] = self.__dict__.setdefault("_kept_sinks", {})
        key = (layer.layer_id, id(layer.sinks))
        hit = kept.get(key)
        if hit is None or hit[0] is not layer.sinks:
            dtype = type(self).sinks_dtype or torch.float32
            hit = kept[key] = (layer.sinks, torch.as_tensor(layer.sinks).detach().to(
                device=self.device, dtype=dtype).contiguous())
        return hit[1]

    def prepare_sinks(self) -> None:
        """Convert the sinks of every layer the build context lists (call it outside any captured region)."""
        for layer in tuple(self.ctx.layers or ()):
            self.device_sinks(layer)

    # -- per forward -------------------------------------------------------------
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Validate the batch against the cache (once per forward), then build the metadata."""
        mode = batch.forward_mode
        meta = None
        if mode is not ForwardMode.IDLE:
            if not type(self).capabilities.supports_mode(mode):
                raise NotSupportedError(self.name, support_reasons(type(self).capabilities, mode=mode))
            self.check_batch(batch)
            if type(self).reads_page_table:
                self.check_page_aligned(batch)
            meta = self.build_metadata(batch)
        self.metadata_builds += 1
        self._fwd = None
        self._guard.set(batch, meta)
        self._fwd = _Forward(self, batch, meta)

    def forward_metadata(self, batch: ForwardBatch) -> Any:
        """The metadata ``init_forward_metadata`` built for ``batch`` (``MetadataNotInitializedError`` for
        another batch). CUDA-graph hooks call ``init_forward_metadata`` and then move this into their
        static buffers in place (``graph_metadata`` does both for tensor fields)."""
        return self._guard.require(batch)

    def graph_metadata(self, batch: ForwardBatch, buffers: dict[str, torch.Tensor] | None) -> Any:
        """For the CUDA-graph capture/replay hooks: ``init_forward_metadata(batch)`` (every check
        included), then each metadata field named in ``buffers`` copied into the front of that static
        buffer (a 2-D one zeroed past the copied rows' width) and pointed at the slice, so captured
        kernels read the same addresses on every replay. ``buffers`` is what ``init_cuda_graph_state``
        allocated (``None``: not called yet, an error). Returns the metadata (``None`` when idle).
        """
        if buffers is None:
            raise AttnplugError(f"{self.name}: call init_cuda_graph_state(max_batch_size, max_num_tokens) "
                                f"before capture")
        self.init_forward_metadata(batch)
        meta = self.forward_metadata(batch)
        if meta is None:
            return None
        try:
            for field, buf in buffers.items():
                src = getattr(meta, field)
                n = src.shape[0]
                if n > buf.shape[0] or src.shape[1:] > buf.shape[1:]:
                    raise ShapeError(
                        f"{self.name}: {field} of shape {tuple(src.shape)} for a batch of {batch.batch_size} "
                        f"requests exceeds its CUDA-graph buffer {tuple(buf.shape)} (init_cuda_graph_state's "
                        f"max_batch_size / BuildContext.max_context_len)"
                    )
                if src.dim() == 2:
                    buf[:n].zero_()
                    buf[:n, :src.shape[1]].copy_(src)
                else:
                    buf[:n].copy_(src)
                setattr(meta, field, buf[:n])
        except BaseException:
            self._guard.set(None, None)  # no forward may run on half-moved metadata
            self._fwd = None
            raise
        return meta

    def check_batch(self, batch: ForwardBatch) -> None:
        """Every index this forward uses is in bounds (one pass, on the batch's device)."""
        cache = self.cache
        cache.check_batch(batch, new_tokens_mapped=type(self).new_kv_source == "cache")

    def check_page_aligned(self, batch: ForwardBatch) -> None:
        """Every position this forward reads through the page table is page-aligned (``reads_page_table``
        backends; one pass over the batch): the cached prefix, the new tokens too when the kernel reads
        them from the cache, the encoder tokens of cross-attention."""
        b = batch
        lens = list(b.seq_lens_cpu if type(self).new_kv_source == "cache" else b.extend_prefix_lens_cpu)
        if b.encoder_lens is not None:
            lens = [max(n, int(e)) for n, e in zip(lens, b.encoder_lens.tolist())]
        self.cache.check_page_aligned(b.req_pool_indices_cpu, lens, who=self.name)

    # -- per layer -----------------------------------------------------------------
    def forward_into(
        self, out: torch.Tensor, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, layer: LayerSpec,
        batch: ForwardBatch, save_kv_cache: bool = True,
    ) -> torch.Tensor:
        """``forward``, the result written into the caller's ``out`` (a host's own output buffer, e.g. vLLM's
        ``output``): every check, the write order and the undo are ``forward``'s. A compute whose kernel writes
        its output in place takes ``out`` when it is exactly the output it would allocate (``output_buffer``:
        ``[tokens, num_heads, v_head_dim]``, the query dtype and device, contiguous), saving the allocation
        and the host's copy; otherwise the fresh result is copied into ``out``, which must then have its
        shape (a ``ShapeError`` names both). Returns ``out``. Its contents are unspecified if the forward
        raises."""
        self._into = out
        try:
            res = self.forward(q, k, v, layer, batch, save_kv_cache)
        finally:
            self._into = None
        if res is not out:
            if res.shape != out.shape:
                raise ShapeError(f"{self.name}: forward_into: out has shape {tuple(out.shape)}, the forward's output "
                                 f"{tuple(res.shape)} (tokens, num_heads, v_head_dim)")
            out.copy_(res)
        return out

    def output_buffer(self, q: torch.Tensor, shape: tuple[int, int, int]) -> torch.Tensor | None:
        """For a compute whose kernel writes its output in place: the caller's buffer of a ``forward_into``
        call when it is exactly a fresh output of ``shape`` in q's dtype and device (contiguous), else
        ``None`` (allocate as usual). Taken at most once per call (a compute that runs its kernel twice
        allocates the second time)."""
        out = self._into
        if out is None or out.shape != shape or out.dtype != q.dtype or out.device != q.device or \
                not out.is_contiguous():
            return None
        self._into = None
        return out

    #: the class keeps ``forward_decode`` / ``forward_extend`` (the dispatching ``forward`` goes straight to
    #: ``_forward``); set per class by ``__init_subclass__``
    _direct: ClassVar[bool] = True
    #: the class keeps ``compute_and_write`` and ``write_new_kv``: ``_forward`` runs their usual case (compute, then
    #: two index copies into an unquantized ``nhd`` cache of the model dtype) inline; set per class by
    #: ``__init_subclass__``
    _plain_write: ClassVar[bool] = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Once per subclass: ``_direct`` and ``_plain_write``; and a subclass keeping the skeleton's
        ``forward_decode`` / ``forward_extend`` and defining no ``forward`` gets ``_forward`` itself as its
        ``forward`` (a class attribute: nothing per instance); one overriding either gets the dispatching
        ``forward`` below back, even where its parent had the skeleton's."""
        super().__init_subclass__(**kwargs)
        cls._direct = direct = cls.forward_decode is PagedBackend.forward_decode and \
            cls.forward_extend is PagedBackend.forward_extend
        cls._plain_write = cls.compute_and_write is PagedBackend.compute_and_write and \
            cls.write_new_kv is PagedBackend.write_new_kv
        if "forward" in cls.__dict__:
            return
        inherited = cls.forward
        if direct and inherited is PagedBackend.forward:
            cls.forward = PagedBackend._forward  # type: ignore[method-assign]
        elif not direct and inherited is PagedBackend._forward:
            cls.forward = PagedBackend.forward  # type: ignore[method-assign]

    def forward(
        self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, layer: LayerSpec,
        batch: ForwardBatch, save_kv_cache: bool = True,
    ) -> torch.Tensor:
        """``AttentionBackend.forward`` (dispatch by mode), straight into the skeleton when this class keeps the
        skeleton's ``forward_decode`` / ``forward_extend`` (both run ``_forward``, which picks the compute by the
        batch's mode); an IDLE batch or an overriding subclass takes the base dispatch. (A subclass keeping both
        has ``_forward`` itself as its ``forward``: ``__init_subclass__``.)"""
        if self._direct and batch.forward_mode is not ForwardMode.IDLE:
            return self._forward(q, k, v, layer, batch, save_kv_cache)
        return super().forward(q, k, v, layer, batch, save_kv_cache)

    def forward_extend(
        self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, layer: LayerSpec,
        batch: ForwardBatch, save_kv_cache: bool = True,
    ) -> torch.Tensor:
        """Run the skeleton (checks, KV write, compute); the kernel is chosen by the batch mode."""
        return self._forward(q, k, v, layer, batch, save_kv_cache)

    def forward_decode(
        self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, layer: LayerSpec,
        batch: ForwardBatch, save_kv_cache: bool = True,
    ) -> torch.Tensor:
        """Run the skeleton (checks, KV write, compute); the kernel is chosen by the batch mode."""
        return self._forward(q, k, v, layer, batch, save_kv_cache)

    def _forward(
        self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, layer: LayerSpec,
        batch: ForwardBatch, save_kv_cache: bool = True,
    ) -> torch.Tensor:
        """The skeleton (checks, KV write, compute; the kernel chosen by the batch's mode). Also **the** ``forward``
        of every class keeping the skeleton's ``forward_decode`` / ``forward_extend`` (``__init_subclass__``): a
        caller's ``backend.forward(...)`` lands here with no dispatch frame between (~3 µs a layer once the kernel
        has evicted it: the method lookups, the mode read). An IDLE batch without metadata gets
        ``AttentionBackend.forward``'s empty output, as the dispatch gave it."""
        # this forward's record, set with the metadata guard (``init_forward_metadata``) and cleared with it: its
        # batch is the guard's, its metadata the guard's (one object read where the guard's test read two)
        fwd = self._fwd
        if fwd is None or fwd.batch is not batch:
            guard = self._guard
            if guard._batch is not batch:  # (``MetadataGuard.require`` written out: it raises here)
                if batch.forward_mode is ForwardMode.IDLE:
                    return AttentionBackend.forward(self, q, k, v, layer, batch, save_kv_cache)
                guard.require(batch)
            fwd = self._fwd = _Forward(self, batch, guard._metadata)  # (the guard set another way)
        meta = fwd.meta
        # the layer's plan, found by identity (the layer object itself is not read: after a kernel that
        # streamed the caches every object read is a miss): the one the chain expects (the plan of the layer
        # that followed the last one in the last forward), else looked up; a plan knows whether its layer is MLA
        plan: Any = fwd.expect  # (a LayerPlan once the checks below passed)
        if plan is None or plan.layer is not layer:
            plan = self._find_plan(fwd, layer)
        else:
            fwd.prev = plan
            fwd.expect = plan.next
        if plan is None:
            if getattr(layer, "mla", None) is not None:
                out: torch.Tensor = self._forward_mla(q, k, v, layer, batch, save_kv_cache, fwd, meta)
                return out
        elif plan.mla:
            out = self._forward_mla(q, k, v, layer, batch, save_kv_cache, fwd, meta)
            return out
        if fwd.idle:
            return q.new_empty((0, layer.num_heads, layer.v_head_dim))
        T = fwd.num_tokens
        # the per-call checks against what the plan and the forward recorded; anything unexpected
        # (or a layer without a plan) runs the full check_forward, which raises the precise error
        # the batch and ``req_to_token`` unchanged since the forward was recorded (``_unchanged``; its usual case,
        # a ``ForwardBatch`` keeping its setter, written out: the record not superseded and one write counter
        # per buffer, ``req_to_token``'s among them — no call)
        ok = plan is not None and fwd.trusted
        if ok and (fx := plan.fast) is not None and save_kv_cache and _layer_ok(q, k, v, fx, fwd.cx):
            # attnplug-speedups: the write counters and q/k/v's shapes, dtypes and device types compared in one
            # compiled call, which answers True only where every check below would pass (``plan.fast`` is set for
            # a self-attention layer written after its compute: the two ways that case ends below, written out)
            if plan.inline:  # the plain write (``plain_dtype`` is the checked dtype)
                out = fwd.compute(q, k, v, layer, batch, meta)
                loc = fwd.loc
                plan.kb.index_copy_(0, loc, k)
                plan.vb.index_copy_(0, loc, v)
                return out
            return self.compute_and_write(fwd.compute, self.kv_cache, plan, fwd.loc, q, k, v, layer,  # type: ignore[arg-type]
                                          batch, meta)  # (a planned layer: the backend has a cache)
        if ok:
            if fwd.c0._version != fwd.v0 or fwd.c1._version != fwd.v1 or \
                    ((more := fwd.more) and any(t._version != ver for t, ver in more)):
                ok = False
        elif plan is not None:
            ok = self._unchanged(fwd)
        if not ok or (plan.cross and not fwd.has_encoder):  # (ok: a plan)
            plan = self._checked_plan(q, k, v, layer, batch)
        elif plan.checked_call is not None and (  # the backend's call checks q/k/v itself (None: it did nothing)
                done := plan.checked_call(q, k, v, meta, fwd.loc, save_kv_cache)) is not None:
            return done  # type: ignore[no-any-return]  # (LayerPlan.checked_call: a tensor or None)
        elif (dt := q.dtype) is not plan.dtype or not (q.is_cpu if (cpu := plan.cpu) else
                                                         q.device.type == self._device_type):
            plan = self._checked_plan(q, k, v, layer, batch)  # (also another dtype than the last call's: claimed?)
        else:
            if plan.tokens != T:  # the expected shapes at this forward's token count (kept while it stays)
                plan.q_shape, plan.k_shape, plan.v_shape = (T,) + plan.q_rest, (T,) + plan.k_rest, (T,) + plan.v_rest
                plan.tokens = T
            if q.shape != plan.q_shape or not (
                    (k is not None and v is not None and k.shape == plan.k_shape and v.shape == plan.v_shape
                     and k.dtype is dt and v.dtype is dt
                     and (k.is_cpu if cpu else k.device.type == self._device_type))
                    or (k is None and v is None and plan.cross)):
                plan = self._checked_plan(q, k, v, layer, batch)
            elif plan.plain_dtype is dt and save_kv_cache and T:
                # the usual case of ``compute_and_write`` and ``write_new_kv`` (the skeleton's own), written out
                # here: the compute, then two index copies into the plan's ``nhd`` storage (two Python frames and
                # the cache's attributes less a layer: ~2-3 µs once the kernel has evicted their code and data)
                out = fwd.compute(q, k, v, layer, batch, meta)
                loc = fwd.loc
                plan.kb.index_copy_(0, loc, k)  # (set with plain_dtype: an ``nhd`` cache's two tensors)
                plan.vb.index_copy_(0, loc, v)
                return out
        if T == 0:  # every request extends by 0 tokens: nothing to attend, nothing to write
            return self.empty_output(q, layer, 0)
        compute = fwd.compute
        if k is None or plan.cross:  # nothing of this forward to write
            return compute(q, k, v, layer, batch, meta)
        cache: PagedKVCache = self.kv_cache  # type: ignore[assignment]  # layer_plan found one
        loc = fwd.loc
        if plan.staged:  # the kernel reads the new K/V from the cache: write, compute, undo on error
            undo = self._snapshot(cache, plan, loc)
            self.write_new_kv(cache, plan, loc, k, v)  # type: ignore[arg-type]  # v is given with k (check_qkv)
            return self._compute_or_undo(cache, plan, loc, undo, save_kv_cache, compute, q, k, v, layer, batch, meta)
        if save_kv_cache:
            if plan.plain_dtype is k.dtype:  # (as above, for a call that took the full check)
                out = compute(q, k, v, layer, batch, meta)
                kb, vb = plan.storage
                kb.index_copy_(0, loc, k)
                vb.index_copy_(0, loc, v)
                return out
            return self.compute_and_write(compute, cache, plan, loc, q, k, v, layer, batch,  # type: ignore[arg-type]
                                          meta)  # (v is given with k: check_qkv)
        return compute(q, k, v, layer, batch, meta)

    def compute_and_write(self, compute: Callable[..., torch.Tensor], cache: PagedKVCache, plan: LayerPlan,
                          loc: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: LayerSpec,
                          batch: ForwardBatch, meta: Any) -> torch.Tensor:
        """A planned self-attention layer of a ``new_kv_source = "args"`` backend with ``save_kv_cache`` on:
        ``compute(q, k, v, layer, batch, meta)`` (the forward's ``compute_decode`` / ``compute_extend``), then
        ``write_new_kv``; a compute that raises writes nothing. A backend whose kernel can write the new K/V
        itself once its attention returned overrides it (cpu_fused: one op for both); the override returns what
        ``compute`` returns, writes exactly what ``write_new_kv`` writes, and nothing when it raises."""
        out = compute(q, k, v, layer, batch, meta)
        self.write_new_kv(cache, plan, loc, k, v)
        return out

    def _find_plan(self, fwd: _Forward, layer: LayerSpec) -> LayerPlan | None:
        """The plan of ``layer`` when the chain expected another (``_forward``): looked up by identity, linked
        after the previous layer's plan (or as the first of a forward) so the next forward finds it without
        the lookup; ``None`` for a layer without a plan yet (nothing linked to it)."""
        plan = self._layer_plans.get(id(layer))
        if plan is None or plan.layer is not layer:
            fwd.prev, fwd.expect = None, None
            return None
        prev = fwd.prev
        if prev is _CHAIN_START:
            self._first_plan = plan
        elif prev is not None:
            prev.next = plan
        fwd.prev, fwd.expect = plan, plan.next
        return plan

    def forget_layer_plans(self) -> None:
        """Drop every layer's plan (the next forward of each layer makes it again, after its layer checks) and
        the chain linking them."""
        self._unlink_plans()
        self._layer_plans.clear()

    def _unlink_plans(self) -> None:
        """Forget the plan chain (``LayerPlan.next``, the first plan, the current forward's expectation): done
        whenever a plan is stored, so the chain never leads to a plan the lookup would not give."""
        for plan in self._layer_plans.values():
            plan.next = None
        self._first_plan = None
        fwd = self._fwd
        if fwd is not None:
            fwd.prev, fwd.expect = None, None

    @staticmethod
    def _unchanged(fwd: _Forward) -> bool:
        """``fwd.batch.changed_since_validate() is None`` (no index field replaced or written in place since the
        validation this forward was checked with) and ``req_to_token`` not written since the forward was checked,
        read from what ``_Forward`` recorded: the validation record's identity (field by field for a batch whose
        setter does not replace the record on a replacement) and each distinct write counter, without the call.
        ``False`` also where the batch was validated again since: then ``check_forward`` asks
        ``changed_since_validate`` itself (the precise answer and words). ``_forward`` runs its usual case
        inline."""
        watch = fwd.watch
        if watch is None:
            if fwd.r2t_version is not None and fwd.r2t._version != fwd.r2t_version:
                return False
            return fwd.changed is None or fwd.changed() is None
        # a field replaced since replaces the record too (``ForwardBatch.__setattr__``): its identity covers both
        if fwd.fields.get("_validated") is not fwd.snap:  # type: ignore[union-attr]  # set with watch
            return False
        if watch is not _RECORD_TRACKS_FIELDS:  # a batch class without that setter: each field's identity
            d = fwd.fields
            for field, tensor in watch:
                if d.get(field) is not tensor:  # type: ignore[union-attr]
                    return False
        for tensor, version in fwd.counters:
            if tensor._version != version:
                return False
        return True

    def _checked_plan(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, layer: LayerSpec,
                      batch: ForwardBatch) -> LayerPlan:
        """The full ``check_forward`` (raising its precise error), then the layer's plan, which records q's dtype
        as the one its last full check passed with (``LayerPlan.dtype``: a later call of another dtype takes
        this check again)."""
        self.check_forward(q, k, v, layer, batch)
        plan = self.layer_plan(layer)
        plan.dtype = q.dtype
        # the compiled check's expectation for a self-attention layer written after its compute (not staged, no
        # checked call), and whether its calls end in the inline plain write (else ``compute_and_write``)
        plan.fast = None if _expectation is None or plan.cross or plan.mla or plan.staged or \
            plan.checked_call is not None else _expectation(q, *plan.q_rest, *plan.k_rest, *plan.v_rest)
        plan.inline = plan.plain_dtype is q.dtype
        return plan

    @staticmethod
    def _snapshot(cache: PagedKVCache, plan: LayerPlan, loc: torch.Tensor) -> tuple[Any, Any]:
        """What a staged write of ``loc`` will replace, taken before it: the layout's copy of the whole pages
        (``KVLayout.page_snapshot``, where that is cheaper) or the rows themselves (``cache.snapshot``)."""
        layout = cache.layout
        pages = layout.page_snapshot(plan.storage, cache.geometry, loc)
        return pages, (layout.read(plan.storage, cache.geometry, loc) if pages is None else None)

    @staticmethod
    def _undo(cache: PagedKVCache, plan: LayerPlan, loc: torch.Tensor, undo: tuple[Any, Any]) -> None:
        """Put back what a staged write replaced (``_snapshot``'s pages or rows)."""
        pages, old = undo
        if pages is None:
            cache.set_kv(plan.layer_id, loc, *old, checked=False, stored=True)
        else:
            cache.layout.restore_pages(plan.storage, pages)

    def _compute_or_undo(self, cache: PagedKVCache, plan: LayerPlan, loc: torch.Tensor, undo: tuple[Any, Any],
                         save_kv_cache: bool, compute: Callable[..., Any], *args: Any) -> torch.Tensor:
        """``compute(*args)`` after a staged write: the write undone if it raises (anything: the cache is left
        as it was before the forward) or when ``save_kv_cache`` is off."""
        try:
            out: torch.Tensor = compute(*args)
        except BaseException:
            self._undo(cache, plan, loc, undo)
            raise
        if not save_kv_cache:
            self._undo(cache, plan, loc, undo)
        return out

    def write_new_kv(self, cache: PagedKVCache, plan: LayerPlan, loc: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor) -> None:
        """The skeleton's write of this forward's K/V for a planned layer (every per-call check passed).
        Default: ``_write``. A backend may override it to write without the layout's own finite verdict
        when it checks the written values itself right after (vllm_cpu: one sum over the pages the
        forward's new tokens and unowned tails lie in); the override must then do that check on every
        call it skips the verdict for."""
        if plan.nhd and k.dtype == cache.dtype:  # ``_write``'s usual case, one frame less: two index copies
            kb, vb = plan.storage
            kb.index_copy_(0, loc, k)
            vb.index_copy_(0, loc, v)
        else:
            self._write(cache, plan, plan.layer_id, loc, k, v)

    @staticmethod
    def _write(cache: PagedKVCache, plan: LayerPlan, lid: int, loc: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> None:
        """``cache.set_kv(lid, loc, k, v, checked=False)`` for a call that passed the per-call checks (the
        slots bounded per forward, k/v of the plan's rows): straight into the plan's storage when k/v are
        already stored values (the cache dtype, not fp8), else through ``set_kv`` (conversion, quantization)."""
        if k.dtype != cache.dtype or cache.quantized:
            cache.set_kv(lid, loc, k, v, checked=False)
        elif plan.nhd:
            kb, vb = plan.storage
            kb.index_copy_(0, loc, k)
            vb.index_copy_(0, loc, v)
        else:
            cache.layout.write(plan.storage, cache.geometry, loc, k, v)


    def _forward_mla(self, q: Any, k: Any, v: Any, layer: Any, batch: Any, save_kv_cache: bool, fwd: Any,
                     meta: Any) -> Any:
        """An MLA layer's forward (docs/mla.md): the full structural check every call (``check_forward``,
        incl. the form claimed for this mode kind), the latent rows ``k`` written like K (staged around a
        ``new_kv_source == "cache"`` kernel), then ``compute_mla``."""
        if fwd.idle:
            return q.new_empty((0, layer.num_heads, layer.output_dim(batch.mla_form)))
        self.check_forward(q, k, v, layer, batch)
        plan = self.layer_plan(layer)
        T = fwd.num_tokens
        if T == 0:
            return q.new_empty((0, layer.num_heads, layer.output_dim(batch.mla_form)))
        cache: PagedKVCache = self.kv_cache  # type: ignore[assignment]  # layer_plan found one
        lid, loc = plan.layer_id, fwd.loc
        if plan.staged:
            undo = self._snapshot(cache, plan, loc)
            cache.set_kv(lid, loc, k, None, checked=False)
            return self._compute_or_undo(cache, plan, loc, undo, save_kv_cache, self.compute_mla, q, k, layer,
                                         batch, meta)
        out = self.compute_mla(q, k, layer, batch, meta)
        if save_kv_cache:
            cache.set_kv(lid, loc, k, None, checked=False)
        return out

    def compute_mla(self, q: Any, latent: Any, layer: Any, batch: Any, meta: Any) -> Any:
        """Attention of an MLA layer (``layer.mla``) in the form ``batch.mla_form`` and the mode
        ``batch.forward_mode``; ``latent`` is the new tokens' latent rows ``[T, 1, kv_lora_rank +
        qk_rope_head_dim]``. Returns ``[T, H, layer.output_dim(batch.mla_form)]`` in the query dtype.
        Override in a backend that claims ``Capabilities.mla_forms`` (the checks ran already: the form is
        claimed for this mode kind, the unabsorbed form has ``w_kc``/``w_vc``)."""
        raise NotImplementedError(f"{type(self).__name__} claims MLA forms but does not implement compute_mla")

    def mla_forward_reasons(self, layer: Any, batch: Any) -> list[str]:
        """Why this backend cannot run MLA ``layer`` in ``batch``'s form and mode kind (the claim, and the
        decompression weights the unabsorbed form needs); empty when it can."""
        form = batch.mla_form
        query = SupportQuery(modes=(batch.forward_mode,), layers=(layer,), name_layers=False, mla_form=form,
                             backend=self.name)
        reasons = support_reasons_of(query, type(self).capabilities)
        if form == UNABSORBED and not layer.mla.has_weights:
            missing = [n for n in ("w_kc", "w_vc") if getattr(layer.mla, n) is None]
            reasons.append(f"the unabsorbed MLA form decompresses the latent rows with LayerSpec.mla.w_kc and "
                           f"LayerSpec.mla.w_vc (kv_b_proj split per head); layer {layer.layer_id} has no "
                           f"{' / '.join(missing)}")
        return reasons

    def check_forward(
        self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, layer: LayerSpec, batch: ForwardBatch
    ) -> None:
        """Structural checks of one layer's call (no reductions, no device sync)."""
        cache = self.cache
        changed = batch.changed_since_validate() if hasattr(batch, "changed_since_validate") else None
        if changed is not None:
            raise ShapeError(
                f"{self.name}: ForwardBatch.{changed} changed after init_forward_metadata (the metadata describes "
                f"the old values); call init_forward_metadata(batch) again after changing a batch"
            )
        fwd = self._fwd
        if fwd is not None and fwd.batch is batch and fwd.r2t_version is not None and \
                (fwd.r2t is not cache.req_to_token or _version(cache.req_to_token) != fwd.r2t_version):
            self.check_batch(batch)  # a slot out of range: the precise error (request, position, slot)
            raise ShapeError(
                f"{self.name}: req_to_token was written after init_forward_metadata checked this forward (the "
                f"metadata describes the old table); call init_forward_metadata(batch) again after changing it"
            )
        cache.check_layer_id(layer.layer_id)
        if q.dtype not in self._claimed_torch:
            raise NotSupportedError(
                self.name, [f"dtype={str(q.dtype).replace('torch.', '')} "
                            f"(supported: {', '.join(type(self).capabilities.dtypes)})"]
            )
        if getattr(layer, "mla", None) is not None:
            check_mla_qkv(q, k, v, layer, batch.num_tokens, batch.mla_form)
            if q.device.type != cache.device.type or k is None or k.device.type != cache.device.type:
                raise ShapeError(f"{self.name}: q/k are on {q.device}, the KV cache of layer {layer.layer_id} on "
                                 f"{cache.device}")
            cache.check_layer_rows(layer)
            self.require_supported(layer)
            reasons = self.mla_forward_reasons(layer, batch)
            if reasons:
                kind = "decode" if batch.forward_mode is ForwardMode.DECODE else "extend"
                raise NotSupportedError(self.name, reasons,
                                        what=f"MLA layer {layer.layer_id} ({batch.mla_form} {kind})")
            return
        if k is None and v is None and not layer.is_cross_attention:
            raise ShapeError(
                f"{self.name}: k and v are None for self-attention layer {layer.layer_id}; "
                f"only cross-attention layers may omit them"
            )
        check_qkv(q, k, v, layer, batch.num_tokens)
        if q.device.type != cache.device.type or (k is not None and k.device.type != cache.device.type):
            raise ShapeError(
                f"{self.name}: q/k/v are on {q.device}, the KV cache of layer {layer.layer_id} on {cache.device}"
            )
        cache.check_layer_rows(layer)
        if layer.is_cross_attention and batch.encoder_lens is None:
            raise ShapeError(f"cross-attention layer {layer.layer_id} but ForwardBatch.encoder_lens is None")
        self.require_supported(layer)

    # -- measuring the skeleton's cost ---------------------------------------------------
    def kernel_call(
        self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, layer: LayerSpec, batch: ForwardBatch
    ) -> Callable[[], torch.Tensor]:
        """A zero-argument call of this backend's own kernel for one layer of ``batch``, every argument
        prepared beforehand: the KV write and the attention, the output allocated by each call as a
        forward does (``attnplug bench --overhead`` times ``forward`` above it: the framework's
        per-layer cost). Call after ``init_forward_metadata(batch)``; the layer must have passed a
        forward's checks (it is planned here). Default: the cache write of this forward's K/V (two
        index copies in the ``nhd`` layout) and ``compute_decode`` / ``compute_extend`` called
        directly, in the order ``new_kv_source`` says; a backend over a kernel library overrides it
        with the library's calls."""
        meta = self.forward_metadata(batch)
        self.layer_plan(layer)
        compute = self.compute_decode if batch.forward_mode is ForwardMode.DECODE else self.compute_extend
        write = self.raw_write(layer, batch, k, v)
        if type(self).new_kv_source == "cache":
            def call() -> torch.Tensor:
                write()
                return compute(q, k, v, layer, batch, meta)
        else:
            def call() -> torch.Tensor:
                out = compute(q, k, v, layer, batch, meta)
                write()
                return out
        return call

    def raw_write(
        self, layer: LayerSpec, batch: ForwardBatch, k: torch.Tensor | None, v: torch.Tensor | None
    ) -> Callable[[], None]:
        """For ``kernel_call``: a zero-argument call writing this forward's K/V of ``layer`` with nothing
        checked or converted per call (``index_copy_`` into an ``nhd`` cache of the model dtype, else
        the layout's write); a no-op for cross-attention or without K/V."""
        cache = self.cache
        if k is None or v is None or layer.is_cross_attention:
            return lambda: None
        loc = batch.out_cache_loc.to(torch.int64).contiguous()
        if cache.layout.name == "nhd" and not cache.quantized and k.dtype == cache.dtype:
            kb, vb = cache.get_kv(layer.layer_id)

            def nhd() -> None:
                kb.index_copy_(0, loc, k)
                vb.index_copy_(0, loc, v)
            return nhd
        storage, geometry = cache.layer_storage(layer.layer_id), cache.geometry
        ks, vs = cache.quantize(layer.layer_id, k, v)
        return lambda: cache.layout.write(storage, geometry, loc, ks, vs)

    # -- helpers for kernels ---------------------------------------------------------
    def check_workspace(self, nbytes: int, what: str) -> None:
        """Refuse, before allocating, a workspace larger than ``max_workspace_bytes``.

        Kernels call this where the work cannot be chunked further; the error names the
        limit and the setting that raises it.
        """
        if nbytes > self.max_workspace_bytes:
            raise ResourceLimitError(
                f"{self.name}: {what} needs {format_bytes(nbytes)}, above the workspace limit of "
                f"{format_bytes(self.max_workspace_bytes)} (BuildContext.max_workspace_bytes); "
                f"raise the limit or split the batch"
            )

    @staticmethod
    def empty_output(q: torch.Tensor, layer: LayerSpec, num_tokens: int | None = None) -> torch.Tensor:
        """A fresh ``[tokens, num_heads, v_head_dim]`` output in the query dtype."""
        n = q.shape[0] if num_tokens is None else num_tokens
        return q.new_empty((n, layer.num_heads, layer.v_head_dim))
