"""Kernel module of the ``intel_amx`` backend: sgl-kernel's CPU decode/extend attention ops.

Imported only when the backend is built; ``sgl_kernel`` (which registers
``torch.ops.sgl_kernel.*``) is imported inside ``load_ops``. The ops' schema
is read once: builds whose ops take ``sliding_window_size`` and ``sinks``
(recent sgl-kernel) serve windowed and sink layers; older builds refuse them
in ``not_supported_reasons`` and at forward.

Extend: the new K/V are written at ``out_cache_loc`` (``save_kv_cache``),
and the op reads the prefix from the cache and the new tokens from
``k_extend``/``v_extend``. Decode: the op writes ``key``/``value`` at ``loc``
itself; with ``save_kv_cache=False`` the overwritten rows are restored after
the call.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from attnplug.backend import AttentionBackend, MetadataGuard
from attnplug.batch import check_qkv
from attnplug.errors import AttnplugError, BackendUnavailableError, ShapeError

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


class IntelAmxBackend(AttentionBackend):
    """sgl-kernel CPU attention over the canonical slot buffers and ``req_to_token``."""

    capabilities = CAPABILITIES

    def __init__(self, ctx: Any, *, ops: Ops | None = None) -> None:
        self.ops = ops or load_ops()
        self.ctx = ctx
        self.kv_cache = ctx.kv_cache
        self._guard = MetadataGuard(NAME)
        self.metadata_builds = 0

    def not_supported_reasons(self, layer: Any, ctx: Any = None) -> list[str]:
        reasons = super().not_supported_reasons(layer, ctx)
        if not self.ops.extended:
            old = f"this {LIBRARY} build's ops have no sliding_window_size/sinks arguments (a newer build has)"
            if layer.uses_sliding_window:
                reasons.append(f"sliding_window={layer.sliding_window}: {old}")
            if layer.uses_sinks:
                reasons.append(f"attention sinks: {old}")
        if ctx is not None and ctx.kv_cache_dtype != ctx.dtype:
            reasons.append(f"kv_cache_dtype={ctx.kv_cache_dtype} with dtype={ctx.dtype}: the ops need one dtype")
        return reasons

    # -- metadata ----------------------------------------------------------
    def init_forward_metadata(self, batch: Any) -> None:
        meta = build_metadata(batch, self._cache().req_to_token)
        self.metadata_builds += 1
        self._guard.set(batch, meta)

    # -- forward -------------------------------------------------------------
    def forward_extend(self, q: Any, k: Any, v: Any, layer: Any, batch: Any, save_kv_cache: bool = True) -> Any:
        return self._run(q, k, v, layer, batch, save_kv_cache)

    def forward_decode(self, q: Any, k: Any, v: Any, layer: Any, batch: Any, save_kv_cache: bool = True) -> Any:
        return self._run(q, k, v, layer, batch, save_kv_cache)

    def _cache(self) -> Any:
        if self.kv_cache is None:
            raise AttnplugError(f"{NAME} was built without a KV cache (BuildContext.kv_cache is None); "
                                f"build it with the engine's PagedKVCache to run forwards")
        return self.kv_cache

    def _run(self, q: torch.Tensor, k: Any, v: Any, layer: Any, batch: Any, save_kv_cache: bool) -> torch.Tensor:
        meta: AmxMetadata | None = self._guard.require(batch)
        if meta is None:
            return q.new_empty((0, layer.num_heads, layer.v_head_dim))
        check_qkv(q, k, v, layer, batch.num_tokens)
        if k is None:
            raise ShapeError(f"{NAME}: k and v are None for layer {layer.layer_id}; "
                             f"cross-attention is not supported, self-attention needs the new K/V")
        self.require_supported(layer)  # memoised per layer: not re-derived every forward
        out = q.new_empty((q.shape[0], layer.num_heads, layer.v_head_dim))
        if meta.num_tokens == 0:
            return out
        cache = self._cache()
        kb, vb = cache.get_kv(layer.layer_id)
        r2t = cache.req_to_token
        named: dict[str, Any] = {}
        if self.ops.extended:  # by name: the schema's positions after logit_cap moved upstream
            sinks = None if layer.sinks is None else \
                torch.as_tensor(layer.sinks).detach().to(device=q.device, dtype=SINKS_DTYPE)
            named = dict(is_cross_attention=False, sliding_window_size=window_arg(layer.sliding_window),
                         encoder_lens=None, sinks=sinks)
        scale, cap = float(layer.scaling), float(layer.logit_cap or 0.0)
        if meta.decode:
            with cache.staged(layer.layer_id, batch.out_cache_loc, keep=save_kv_cache):  # the op writes them
                self.ops.decode(q.contiguous(), kb, vb, out, k.to(kb.dtype), v.to(vb.dtype), batch.out_cache_loc,
                                meta.attn_logits(layer.num_heads, layer.v_head_dim), r2t, meta.req_pool_indices,
                                meta.seq_lens, scale, cap, **named)
            return out
        if save_kv_cache:
            cache.set_kv(layer.layer_id, batch.out_cache_loc, k, v)
        self.ops.extend(q.contiguous(), k.contiguous(), v.contiguous(), out, kb, vb, r2t, meta.req_pool_indices,
                        meta.seq_lens, meta.extend_seq_lens, meta.extend_start_loc, meta.max_len_extend,
                        scale, cap, **named)
        return out
