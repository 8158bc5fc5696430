"""``AttentionBackend``: the protocol every backend implements.

Required: ``init_forward_metadata``, ``forward_extend``, ``forward_decode``.
Provided: ``forward`` (dispatch by mode), ``not_supported_reasons`` (generic
checks from the declared ``capabilities``) and the optional hooks in
``OPTIONAL_METHODS``, each with an explicit default, so containers and
wrappers can forward every one of them without ``hasattr``.
"""

from __future__ import annotations

import weakref
from typing import Any, ClassVar

from .capabilities import Capabilities, support_reasons
from .errors import MetadataNotInitializedError, NotSupportedError
from .modes import ForwardMode

#: Methods every backend must implement.
REQUIRED_METHODS: tuple[str, ...] = ("init_forward_metadata", "forward_extend", "forward_decode")

#: Optional methods; each has a default here, and every container/wrapper forwards all of them.
OPTIONAL_METHODS: tuple[str, ...] = (
    "init_cuda_graph_state",
    "init_forward_metadata_capture_cuda_graph",
    "init_forward_metadata_replay_cuda_graph",
    "get_cuda_graph_seq_len_fill_value",
    "on_after_cuda_graph_warmup",
)

#: Every method a container or wrapper must route (checked by tests for each container class).
PROTOCOL_METHODS: tuple[str, ...] = REQUIRED_METHODS + ("forward", "not_supported_reasons") + OPTIONAL_METHODS


class AttentionBackend:
    """Base class of every attention backend.

    The two stamps say which kernel serves each half; the registry writes the
    factory's effective name into them. Model code reads the stamp of the
    backend serving the current forward, never process-global state.
    """

    capabilities: ClassVar[Capabilities] = Capabilities()
    #: A container whose per-step children are handed to the forward context
    #: sets this; the registry then stamps every child.
    stamps_children: ClassVar[bool] = False

    prefill_attention_backend_str: str | None = None
    decode_attention_backend_str: str | None = None

    # -- description ---------------------------------------------------
    def not_supported_reasons(self, layer: Any, ctx: Any = None) -> list[str]:
        """Sentences saying why this backend cannot serve ``layer`` (under ``ctx``, by default the build
        context the registry recorded on the backend); empty if it can."""
        kw: dict[str, Any] = {}
        if ctx is None:
            ctx = self.__dict__.get("ctx")
        if ctx is not None:
            kw = dict(dtype=ctx.dtype, kv_cache_dtype=ctx.kv_cache_dtype, page_size=ctx.page_size, device=ctx.device)
        name = getattr(self, "prefill_attention_backend_str", None) or getattr(self, "name", None)
        return support_reasons(type(self).capabilities, layer, backend=name if isinstance(name, str) else None, **kw)

    def children(self) -> tuple["AttentionBackend", ...]:
        """Backends this one contains (containers and wrappers override)."""
        return ()

    def runtime_notes(self) -> list[str]:
        """What this built backend chose at run time that its capabilities do not say (a kernel
        path taken or not, and why); ``attnplug doctor`` and ``attnplug bench`` print them through
        ``runtime_notes_of``. Default: the notes of ``children()`` (none for a leaf backend)."""
        notes: list[str] = []
        for child in self.children():
            notes.extend(n for n in runtime_notes_of(child) if n not in notes)
        return notes

    def layer_reasons(self, layer: Any) -> list[str]:
        """Why ``layer`` cannot run here whatever the forward (``require_supported`` memoises it).
        Default: ``not_supported_reasons(layer)``; a backend may narrow it to its own checks."""
        return self.not_supported_reasons(layer)

    def require_supported(self, layer: Any) -> None:
        """Raise ``NotSupportedError`` when ``layer`` cannot run here.

        For backends that check layers inside ``forward``: the verdict is computed
        once per layer object (a ``LayerSpec`` is frozen) and memoised, so each
        later forward of that layer pays one dictionary lookup.
        """
        verdicts = self.__dict__.get("_layer_verdicts")
        if verdicts is None:
            verdicts = self.__dict__["_layer_verdicts"] = weakref.WeakKeyDictionary()
        try:
            reasons = verdicts.get(layer)
        except TypeError:  # a layer object that cannot be weakly referenced: check every time
            reasons = tuple(self.layer_reasons(layer))
        else:
            if reasons is None:
                reasons = verdicts[layer] = tuple(self.layer_reasons(layer))
        if reasons:
            name = self.prefill_attention_backend_str or getattr(self, "backend_name", "") or type(self).__name__
            raise NotSupportedError(name, reasons)

    # -- required ------------------------------------------------------
    def init_forward_metadata(self, batch: Any) -> None:
        """Build this forward's metadata once; every layer then reuses it."""
        raise NotImplementedError(f"{type(self).__name__} does not implement init_forward_metadata")

    def forward_extend(self, q: Any, k: Any, v: Any, layer: Any, batch: Any, save_kv_cache: bool = True) -> Any:
        """Attention for an extend-shaped batch (every mode but DECODE and IDLE); writes the new K/V unless ``save_kv_cache=False``."""
        raise NotImplementedError(f"{type(self).__name__} does not implement forward_extend")

    def forward_decode(self, q: Any, k: Any, v: Any, layer: Any, batch: Any, save_kv_cache: bool = True) -> Any:
        """Attention for a DECODE batch (one new token per request); writes the new K/V unless ``save_kv_cache=False``."""
        raise NotImplementedError(f"{type(self).__name__} does not implement forward_decode")

    # -- dispatch ------------------------------------------------------
    def forward(self, q: Any, k: Any, v: Any, layer: Any, batch: Any, save_kv_cache: bool = True) -> Any:
        """Dispatch by ``batch.forward_mode``: idle returns an empty ``[0, heads, v_head_dim]`` output."""
        mode = batch.forward_mode
        if mode is ForwardMode.DECODE:
            return self.forward_decode(q, k, v, layer, batch, save_kv_cache)
        if mode is ForwardMode.IDLE:
            dv = layer.v_head_dim if getattr(layer, "mla", None) is None else layer.output_dim(batch.mla_form)
            return q.new_empty((0, layer.num_heads, dv))
        return self.forward_extend(q, k, v, layer, batch, save_kv_cache)

    # -- optional (explicit defaults) ------------------------------------
    def init_cuda_graph_state(self, max_batch_size: int, max_num_tokens: int) -> None:
        """Allocate buffers that captured graphs will read. Default: nothing to allocate."""
        return None

    def init_forward_metadata_capture_cuda_graph(self, batch: Any) -> None:
        """Metadata for a forward being captured. Default: the eager path's metadata."""
        self.init_forward_metadata(batch)

    def init_forward_metadata_replay_cuda_graph(self, batch: Any) -> None:
        """Refresh captured buffers before a replay. Default: the eager path's metadata."""
        self.init_forward_metadata(batch)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        """Sequence length used to pad unused graph slots. Default: 1."""
        return 1

    def on_after_cuda_graph_warmup(self) -> None:
        """Called once after warm-up forwards, before capture. Default: nothing."""
        return None


def runtime_notes_of(backend: AttentionBackend, distribution: str | None = None) -> list[str]:
    """``backend.runtime_notes()`` as strings, run as plugin code (``isolation.call_plugin``): a hook
    that raises anything (``SystemExit`` and a ``KeyboardInterrupt`` it raises itself included; a real
    Ctrl-C still stops), returns something other than a list of str (a bare string is one fault, never
    one note per character), or prints, becomes one note saying so, naming ``distribution`` when
    given. A plugin's failure never ends the command that asked, nor reaches its stdout."""
    from .errors import PluginError
    from .isolation import call_plugin, describe_exception

    who = f"plugin distribution {distribution!r}: " if distribution else ""
    try:
        notes, printed = call_plugin(distribution or "?", "runtime_notes()", backend.runtime_notes)
    except PluginError as exc:
        return [f"{who}runtime_notes() raised {describe_exception(exc.__cause__ or exc)}"]
    extra = [f"{who}runtime_notes() wrote to stdout (kept out of the output): {_short(printed.strip())}"] \
        if printed.strip() else []
    if notes is None:
        return extra
    if isinstance(notes, (list, tuple)) and all(isinstance(n, str) for n in notes):
        return list(notes) + extra
    return [f"{who}runtime_notes() returned {_short(notes)} ({type(notes).__name__}); expected a list of str"] + extra


def _short(value: Any, limit: int = 200) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class MetadataGuard:
    """Helper for backends: remembers the batch metadata was built for.

    ``require(batch)`` raises ``MetadataNotInitializedError`` when ``forward``
    runs on a batch ``init_forward_metadata`` did not see.
    """

    __slots__ = ("_batch", "_metadata", "_owner")

    def __init__(self, owner: str) -> None:
        self._owner = owner
        self._batch: Any = None
        self._metadata: Any = None

    def set(self, batch: Any, metadata: Any) -> None:
        self._batch, self._metadata = batch, metadata

    def require(self, batch: Any) -> Any:
        if self._batch is not batch:
            raise MetadataNotInitializedError(
                f"{self._owner}: forward called before init_forward_metadata for this batch "
                f"(call backend.init_forward_metadata(batch) once per forward, before the layers)"
            )
        return self._metadata
