"""Kernel module of the ``intel_amx`` backend: sgl-kernel's CPU decode/extend attention ops.

Imported only when the backend is built; ``sgl_kernel`` (which registers
``torch.ops.sgl_kernel.*``) is imported inside ``load_ops``. The ops' schema
is read once and every call is bound to it by argument name: builds whose ops take ``sliding_window_size`` and ``sinks``
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

from attnplug import BuildContext, ForwardBatch, LayerSpec, PagedBackend
from attnplug.errors import BackendUnavailableError, ShapeError

from . import CAPABILITIES, HEAD_DIM_MULTIPLE, LIBRARY, NAME
from .metadata import AmxMetadata, build_metadata, window_arg

#: Every library op this backend calls.
LIBRARY_CALLS = ("torch.ops.sgl_kernel.decode_attention_cpu", "torch.ops.sgl_kernel.extend_attention_cpu")

#: What this plugin can supply to each op, by the names SGLang's callers and sgl-kernel's schemas use.
#: The ops are called BY SCHEMA: the argument list of the build actually loaded
#: (``torch.ops.sgl_kernel.<op>.default._schema.arguments``) is read once and every argument is filled by
#: its name, in the schema's order. Positions are not stable across sgl-kernel builds: newer builds append
#: ``is_cross_attention, sliding_window_size, encoder_lens, sinks`` (and ``tree_mask``, ``is_causal`` on
#: extend) after ``logit_cap``, and SGLang's PR #32733 (fp8 KV on CPU, SGLang 0.5.23) inserts ``k_scale,
#: v_scale`` right after the KV buffers.
KNOWN_ARGS: dict[str, frozenset[str]] = {
    "decode_attention_cpu": frozenset((
        "query", "k_cache", "v_cache", "output", "key", "value", "loc", "attn_logits", "req_to_token",
        "req_pool_indices", "seq_lens", "sm_scale", "logit_cap", "k_scale", "v_scale", "is_cross_attention",
        "sliding_window_size", "encoder_lens", "sinks")),
    "extend_attention_cpu": frozenset((
        "q_extend", "k_extend", "v_extend", "o_extend", "k_buffer", "v_buffer", "req_to_token",
        "req_pool_indices", "seq_lens", "extend_seq_lens", "extend_start_loc", "max_len_extend", "sm_scale",
        "logit_cap", "k_scale", "v_scale", "is_cross_attention", "sliding_window_size", "encoder_lens", "sinks",
        "tree_mask", "is_causal")),
}
#: Other spellings of those names in sgl-kernel's registrations (the decode op's schema spells its value
#: buffer ``v_cahce``; some builds name the buffers ``k_buffer``/``v_buffer`` on both ops).
ALIASES: dict[str, dict[str, str]] = {
    "decode_attention_cpu": {"v_cahce": "v_cache", "k_buffer": "k_cache", "v_buffer": "v_cache"},
    "extend_attention_cpu": {"k_cache": "k_buffer", "v_cache": "v_buffer", "v_cahce": "v_buffer"},
}
#: The arguments a layer with a sliding window / with sinks needs the schema to have.
WINDOW_ARGS = ("sliding_window_size",)
SINK_ARGS = ("sinks",)


@dataclasses.dataclass(frozen=True)
class BoundOp:
    """One op and the names of its schema's arguments, in order, as this plugin supplies them
    (``None``: an argument the plugin does not know but the schema gives a default, passed as that)."""

    op: Callable[..., Any]
    name: str
    names: tuple[str | None, ...]
    defaults: tuple[Any, ...]
    schema: str

    def has(self, arg: str) -> bool:
        return arg in self.names

    def __call__(self, values: dict[str, Any]) -> Any:
        """Call the op with every schema argument filled from ``values`` by name, in schema order."""
        return self.op(*[values[n] if n is not None else d for n, d in zip(self.names, self.defaults)])


def bind_schema(op: Any, name: str) -> BoundOp:
    """``op``'s schema read into a ``BoundOp``; ``BackendUnavailableError`` naming the op and the argument
    when the schema has a required argument this plugin does not know (a newer build: calling it would put
    values in the wrong slots)."""
    try:
        schema = op.default._schema
        args = list(schema.arguments)
    except (AttributeError, RuntimeError) as exc:
        raise BackendUnavailableError(NAME, [f"cannot read the schema of torch.ops.sgl_kernel.{name} ({exc})"],
                                      f"install a CPU build of {LIBRARY} that registers its ops with schemas") from exc
    known, aliases = KNOWN_ARGS[name], ALIASES[name]
    names: list[str | None] = []
    defaults: list[Any] = []
    unknown: list[str] = []
    for a in args:
        canon = aliases.get(a.name, a.name)
        if canon in known:
            names.append(canon)
            defaults.append(None)
        elif a.has_default_value():
            names.append(None)
            defaults.append(a.default_value)
        else:
            unknown.append(f"{a.name} ({a.type})")
    if unknown:
        raise BackendUnavailableError(
            NAME, [f"torch.ops.sgl_kernel.{name} has argument(s) {', '.join(unknown)} that {NAME} does not know "
                   f"how to fill (schema: {schema}); it supplies {', '.join(sorted(known))}"],
            f"use an sgl-kernel CPU build whose {name} schema {NAME} knows, or update attnplug-intel-amx")
    missing = [n for n in ("sm_scale", "logit_cap", "req_to_token") if n not in names]
    if missing:
        raise BackendUnavailableError(NAME, [f"torch.ops.sgl_kernel.{name}'s schema lacks {', '.join(missing)} "
                                             f"(schema: {schema})"], f"install the CPU build of {LIBRARY}")
    return BoundOp(op, name, tuple(names), tuple(defaults), str(schema))


@dataclasses.dataclass(frozen=True)
class Ops:
    """sgl-kernel's two CPU attention ops, each bound to the schema of the build loaded."""

    decode: BoundOp
    extend: BoundOp

    @classmethod
    def from_ops(cls, decode: Any, extend: Any) -> "Ops":
        return cls(bind_schema(decode, "decode_attention_cpu"), bind_schema(extend, "extend_attention_cpu"))

    def lacks(self, args: tuple[str, ...]) -> bool:
        """Whether either op's schema lacks one of ``args``."""
        return not all(op.has(a) for op in (self.decode, self.extend) for a in args)


def load_ops() -> Ops:
    """sgl-kernel's CPU ops, bound to their schemas."""
    try:
        import sgl_kernel  # noqa: F401  (registers torch.ops.sgl_kernel)
    except ImportError as exc:
        raise BackendUnavailableError(NAME, [f"{type(exc).__name__}: {exc}"],
                                      f"install the CPU build of {LIBRARY}") from exc
    ns = torch.ops.sgl_kernel
    try:
        decode, extend = ns.decode_attention_cpu, ns.extend_attention_cpu
    except (AttributeError, RuntimeError) as exc:
        raise BackendUnavailableError(NAME, [f"this {LIBRARY} build has no CPU attention ops ({exc})"],
                                      f"install the CPU build of {LIBRARY}") from exc
    return Ops.from_ops(decode, extend)


def create(ctx: BuildContext) -> tuple[str, IntelAmxBackend]:
    """Factory named by the descriptor: ``(effective_name, backend)``."""
    return NAME, IntelAmxBackend(ctx)


class IntelAmxBackend(PagedBackend):
    """sgl-kernel CPU attention over the canonical slot buffers and ``req_to_token``."""

    capabilities = CAPABILITIES
    backend_name = NAME
    #: the decode op writes this forward's K/V at ``loc`` itself and reads them back through
    #: ``req_to_token``, so the base stages the write (and restores it for ``save_kv_cache=False``)
    new_kv_source = "cache"

    def __init__(self, ctx: BuildContext, *, ops: Ops | None = None) -> None:
        self.ops = ops or load_ops()
        super().__init__(ctx)

    def backend_reasons(self, layer: LayerSpec | None, ctx: BuildContext | None) -> list[str]:
        reasons: list[str] = []
        if layer is None:
            return reasons
        old = "this {lib} build's ops have no {args} argument (a newer build has)"
        if layer.uses_sliding_window and self.ops.lacks(WINDOW_ARGS):
            reasons.append(f"sliding_window={layer.sliding_window}: " + old.format(lib=LIBRARY, args=WINDOW_ARGS[0]))
        if layer.uses_sinks and self.ops.lacks(SINK_ARGS):
            reasons.append("attention sinks: " + old.format(lib=LIBRARY, args=SINK_ARGS[0]))
        if layer.v_head_dim % HEAD_DIM_MULTIPLE:  # head_dim is in the declared capabilities' head_dims
            reasons.append(f"v_head_dim={layer.v_head_dim}: extend_attention_cpu needs value head dims that are "
                           f"multiples of {HEAD_DIM_MULTIPLE} (it transposes by 512-bit rows)")
        return reasons

    # -- metadata ----------------------------------------------------------
    def build_metadata(self, batch: ForwardBatch) -> AmxMetadata | None:
        return build_metadata(batch, self.cache.req_to_token)

    # -- forward -------------------------------------------------------------
    def _common(self, q: torch.Tensor, layer: LayerSpec) -> dict[str, Any]:
        """What both ops take besides their own inputs, by schema name: the layer's scale and soft-cap,
        the KV scales (1.0 unless the cache is fp8), and the newer ops' window/sinks/cross-attention
        arguments. Sinks go in the query's dtype: the ops read them through ``data_ptr<scalar_t>()``."""
        k_scale, v_scale = self.cache.kv_scales(layer.layer_id) if self.cache.quantized else (1.0, 1.0)
        sinks = None if layer.sinks is None else \
            torch.as_tensor(layer.sinks).detach().to(device=q.device, dtype=q.dtype).contiguous()
        return dict(req_to_token=self.cache.req_to_token, sm_scale=float(layer.scaling),
                    logit_cap=float(layer.logit_cap or 0.0), k_scale=float(k_scale), v_scale=float(v_scale),
                    is_cross_attention=False, sliding_window_size=window_arg(layer.sliding_window),
                    encoder_lens=None, sinks=sinks)

    def _operands(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                  layer: LayerSpec) -> tuple[torch.Tensor, ...]:
        """Both ops' tensors: this forward's K/V, a fresh output ``[tokens, heads, v_head_dim]`` and the layer's
        K and V buffers."""
        k, v = _new_kv(k, v)
        kb, vb = self.cache.get_kv(layer.layer_id)
        return k, v, q.new_empty((q.shape[0], layer.num_heads, layer.v_head_dim)), kb, vb

    def compute_decode(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, layer: LayerSpec,
                       batch: ForwardBatch, meta: AmxMetadata) -> torch.Tensor:
        k, v, out, kb, vb = self._operands(q, k, v, layer)
        self.ops.decode(dict(
            self._common(q, layer), query=q.contiguous(), k_cache=kb, v_cache=vb, output=out, key=k.to(kb.dtype),
            value=v.to(vb.dtype), loc=batch.out_cache_loc, attn_logits=meta.attn_logits(layer.num_heads, layer.v_head_dim),
            req_pool_indices=meta.req_pool_indices, seq_lens=meta.seq_lens))
        return out

    def compute_extend(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, layer: LayerSpec,
                       batch: ForwardBatch, meta: AmxMetadata) -> torch.Tensor:
        k, v, out, kb, vb = self._operands(q, k, v, layer)
        self.ops.extend(dict(
            self._common(q, layer), q_extend=q.contiguous(), k_extend=k.contiguous(), v_extend=v.contiguous(),
            o_extend=out, k_buffer=kb, v_buffer=vb, req_pool_indices=meta.req_pool_indices, seq_lens=meta.seq_lens,
            extend_seq_lens=meta.extend_seq_lens, extend_start_loc=meta.extend_start_loc,
            max_len_extend=meta.max_len_extend, tree_mask=None, is_causal=True))
        return out


def _new_kv(k: torch.Tensor | None, v: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """This forward's K/V: the skeleton passes ``None`` only for cross-attention, which intel_amx does not
    claim (its ``not_supported_reasons`` refuses such a layer before a forward)."""
    if k is None or v is None:
        raise ShapeError(f"{NAME}: k and v are None (cross-attention is not supported by this backend)")
    return k, v
