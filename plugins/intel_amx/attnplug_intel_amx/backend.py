"""Kernel module of the ``intel_amx`` backend: sgl-kernel's CPU decode/extend attention ops.

Imported only when the backend is built; ``sgl_kernel`` (which registers
``torch.ops.sgl_kernel.*``) is imported inside ``load_ops``. The ops' schema
is read once: builds whose ops take ``sliding_window_size`` and ``sinks``
(recent sgl-kernel) serve windowed and sink layers; older builds refuse them
in ``not_supported_reasons`` and at forward.

On the core's ``PagedBackend`` (``new_kv_source = "cache"``: the base writes
the new K/V at ``out_cache_loc`` before the op and restores the rows after a
``save_kv_cache=False`` forward). Extend (``compute_extend``): the op reads
the prefix from the cache and the new tokens from ``k_extend``/``v_extend``.
Decode (``compute_decode``): the op writes ``key``/``value`` at ``loc``
itself, then reads them back through ``req_to_token``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from attnplug import PagedBackend
from attnplug.errors import BackendUnavailableError

from . import CAPABILITIES, LIBRARY, NAME
from .metadata import AmxMetadata, build_metadata, window_arg

#: schema arguments of the newer ops (after ``logit_cap``). They are passed BY NAME: a later
#: upstream change inserted KV-scale arguments (fp8 KV on CPU) into the schema, so positions past
#: ``logit_cap`` are not stable; names are, and the schema is read to see which ones exist.
EXTENDED_ARGS = ("is_cross_attention", "sliding_window_size", "encoder_lens", "sinks")
#: Every library op this backend calls.
LIBRARY_CALLS = ("torch.ops.sgl_kernel.decode_attention_cpu", "torch.ops.sgl_kernel.extend_attention_cpu")
#: the dtype the sinks are handed to the ops in (unverified against the CPU build's source)
SINKS_DTYPE = torch.float32


@dataclasses.dataclass(frozen=True)
class Ops:
    decode: Callable[..., Any]
    extend: Callable[..., Any]
    #: the ops take (is_cross_attention, sliding_window_size, encoder_lens, sinks) after logit_cap
    extended: bool


def _arg_names(op: Any) -> tuple[str, ...]:
    try:
        return tuple(a.name for a in op.default._schema.arguments)
    except AttributeError:
        return ()


def load_ops() -> Ops:
    """sgl-kernel's CPU ops, and whether their schema has the window/sinks arguments."""
    try:
        import sgl_kernel  # type: ignore[import-not-found]  # noqa: F401  (registers torch.ops.sgl_kernel)
    except ImportError as exc:
        raise BackendUnavailableError(NAME, [f"{type(exc).__name__}: {exc}"],
                                      f"install the CPU build of {LIBRARY}") from exc
    ns = torch.ops.sgl_kernel
    try:
        decode, extend = ns.decode_attention_cpu, ns.extend_attention_cpu
    except (AttributeError, RuntimeError) as exc:
        raise BackendUnavailableError(NAME, [f"this {LIBRARY} build has no CPU attention ops ({exc})"],
                                      f"install the CPU build of {LIBRARY}") from exc
    names = set(_arg_names(decode)) & set(_arg_names(extend))
    return Ops(decode, extend, extended=all(a in names for a in EXTENDED_ARGS))


def create(ctx: Any) -> tuple[str, "IntelAmxBackend"]:
    """Factory named by the descriptor: ``(effective_name, backend)``."""
    return NAME, IntelAmxBackend(ctx)


class IntelAmxBackend(PagedBackend):
    """sgl-kernel CPU attention over the canonical slot buffers and ``req_to_token``."""

    capabilities = CAPABILITIES
    backend_name = NAME
    #: the decode op writes this forward's K/V at ``loc`` itself and reads them back through
    #: ``req_to_token``, so the base stages the write (and restores it for ``save_kv_cache=False``)
    new_kv_source = "cache"

    def __init__(self, ctx: Any, *, ops: Ops | None = None) -> None:
        self.ops = ops or load_ops()
        super().__init__(ctx)

    def backend_reasons(self, layer: Any, ctx: Any) -> list[str]:
        reasons = []
        if not self.ops.extended:
            old = f"this {LIBRARY} build's ops have no sliding_window_size/sinks arguments (a newer build has)"
            if layer.uses_sliding_window:
                reasons.append(f"sliding_window={layer.sliding_window}: {old}")
            if layer.uses_sinks:
                reasons.append(f"attention sinks: {old}")
        return reasons

    # -- metadata ----------------------------------------------------------
    def build_metadata(self, batch: Any) -> AmxMetadata:
        return build_metadata(batch, self.cache.req_to_token)

    # -- forward -------------------------------------------------------------
    def _common(self, q: torch.Tensor, layer: Any) -> tuple[Any, ...]:
        """What both ops take besides their own inputs: a fresh output, the layer's buffers, the table,
        scale, soft-cap, and the newer ops' trailing (is_cross_attention, sliding_window_size,
        encoder_lens, sinks)."""
        out = q.new_empty((q.shape[0], layer.num_heads, layer.v_head_dim))
        kb, vb = self.cache.get_kv(layer.layer_id)
        named: dict[str, Any] = {}
        if self.ops.extended:  # by name: the schema's positions after logit_cap moved upstream
            sinks = None if layer.sinks is None else \
                torch.as_tensor(layer.sinks).detach().to(device=q.device, dtype=SINKS_DTYPE)
            named = dict(is_cross_attention=False, sliding_window_size=window_arg(layer.sliding_window),
                         encoder_lens=None, sinks=sinks)
        return out, kb, vb, self.cache.req_to_token, float(layer.scaling), float(layer.logit_cap or 0.0), named

    def compute_decode(self, q: torch.Tensor, k: Any, v: Any, layer: Any, batch: Any,
                       meta: AmxMetadata) -> torch.Tensor:
        out, kb, vb, r2t, scale, cap, named = self._common(q, layer)
        self.ops.decode(q.contiguous(), kb, vb, out, k.to(kb.dtype), v.to(vb.dtype), batch.out_cache_loc,
                        meta.attn_logits(layer.num_heads, layer.v_head_dim), r2t, meta.req_pool_indices,
                        meta.seq_lens, scale, cap, **named)
        return out

    def compute_extend(self, q: torch.Tensor, k: Any, v: Any, layer: Any, batch: Any,
                       meta: AmxMetadata) -> torch.Tensor:
        out, kb, vb, r2t, scale, cap, named = self._common(q, layer)
        self.ops.extend(q.contiguous(), k.contiguous(), v.contiguous(), out, kb, vb, r2t, meta.req_pool_indices,
                        meta.seq_lens, meta.extend_seq_lens, meta.extend_start_loc, meta.max_len_extend,
                        scale, cap, **named)
        return out
