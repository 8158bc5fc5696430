"""The one support query: what is asked of a backend, and every reason its capabilities refuse it.

``SupportQuery`` is one frozen description of what is asked (dtype, KV-cache dtype, KV layout, forward
modes, device, host, head dim, layers, page size, CUDA graphs, determinism, a library floor). It is
built from a build context (``from_context``), from one half of a configuration (``from_config``), or
by the conformance suite from a case; ``reasons(query, caps)`` turns it and a ``Capabilities`` into
every reason, worded once: the generic checks of ``capabilities.support_reasons``, each layer's
reasons (one line per reason, naming the first layer that needs it), the claims that hold on some
GPUs only (the first such layer), and the library floor. ``Registry.build``, the resolution chain,
the suite, ``attnplug doctor`` and ``attnplug bench`` all ask it; ``AttentionBackend.not_supported_reasons``
asks it for one layer.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from .capabilities import (Capabilities, host_layer_reasons, layer_reasons, mla_mode_kind, mla_reasons,
                           support_reasons)
from .dtypes import dtype_name, kv_dtype_name
from .layer import LayerSpec
from .modes import ForwardMode
from .selector import half_for_mode

if TYPE_CHECKING:
    from .config import AttentionConfig
    from .host import HostInfo

__all__ = ["SupportQuery", "device_kind", "reasons"]


def device_kind(device: Any, host: "HostInfo | None" = None) -> str:
    """The platform a torch device runs on: ``"cuda:0"`` -> ``"cuda"``; ``"cuda"`` on a ROCm host ->
    ``"rocm"`` (torch names ROCm devices ``cuda``)."""
    kind = str(device).split(":", 1)[0]
    if kind == "cuda" and host is not None and getattr(host, "platform", None) == "rocm":
        return "rocm"
    return kind


@dataclasses.dataclass(frozen=True)
class SupportQuery:
    """What is asked of a backend. A field left ``None`` (or empty) is not asked."""

    dtype: str | None = None
    kv_cache_dtype: str | None = None
    kv_layout: str | None = None
    #: forward modes that must be claimed
    modes: tuple[ForwardMode, ...] = ()
    #: the platform the backend runs on (``device_kind``)
    device: str | None = None
    #: the host, for claims that hold on some GPUs only
    host: "HostInfo | None" = None
    #: the head dim every layer of a build context shares
    head_dim: int | None = None
    layers: tuple[LayerSpec, ...] = ()
    page_size: int | None = None
    cuda_graph: bool | None = None
    deterministic: bool | None = None
    #: a sentence when the kernel library installed is older than the backend's floor (the registry's
    #: verdict for the host: ``HostView.backends[name].floor_problem``)
    floor_problem: str | None = None
    #: name each layer reason's layer (``"layer 3: ..."``); off for a query about one layer, whose
    #: reasons are that layer's (``not_supported_reasons``, a suite case)
    name_layers: bool = True
    #: MLA layers (``LayerSpec.mla``): the batch's form (``ForwardBatch.mla_form``) and the mode kinds
    #: (``"decode"``/``"extend"``) it must be claimed in; kinds ``None``: those of ``modes``
    mla_form: str | None = None
    mla_kinds: tuple[str, ...] | None = None
    #: the backend named in MLA refusals ("MLA layer (absorbed decode) not supported by <backend>")
    backend: str | None = None

    @classmethod
    def from_context(cls, ctx: Any, floor_problem: str | None = None) -> "SupportQuery":
        """What a build context asks: its dtypes, page size, device, head dim, cache layout, layers, host."""
        host = getattr(ctx, "host", None)
        layout = getattr(getattr(ctx, "kv_cache", None), "layout", None)
        return cls(dtype=_name(ctx.dtype), kv_cache_dtype=_name(ctx.kv_cache_dtype),
                   page_size=ctx.page_size, device=device_kind(getattr(ctx, "device", "cpu"), host),
                   kv_layout=getattr(layout, "name", None), head_dim=getattr(ctx, "head_dim", None),
                   layers=tuple(getattr(ctx, "layers", ()) or ()), host=host, floor_problem=floor_problem)

    @classmethod
    def from_config(cls, config: "AttentionConfig", half: str, layers: tuple[LayerSpec, ...] = (),
                    host: "HostInfo | None" = None) -> "SupportQuery":
        """What ``half`` (``"prefill"``/``"decode"``) of a configuration asks: its dtypes, page size, layout,
        CUDA graphs, determinism, target-verify when speculative decoding sends it to this half."""
        modes: tuple[ForwardMode, ...] = ()
        speculative = config.speculative_draft_attention_backend is not None or \
            bool(config.extra.get("speculative_algorithm"))
        if speculative and half_for_mode(ForwardMode.TARGET_VERIFY, config.speculative_attention_mode) == half:
            modes = (ForwardMode.TARGET_VERIFY,)
        # an MLA layer runs in both halves' mode kinds: the decode half needs a decode form, the prefill
        # half an extend form (and target-verify, in whichever half serves it, an extend form)
        kinds: tuple[str, ...] = ("decode",) if half == "decode" else ("extend",)
        if modes and "extend" not in kinds:
            kinds += ("extend",)
        return cls(dtype=config.dtype, kv_cache_dtype=kv_dtype_name(config.kv_cache_dtype, config.dtype),
                   page_size=config.page_size, kv_layout=config.kv_layout, cuda_graph=config.cuda_graph,
                   deterministic=config.deterministic, modes=modes, layers=tuple(layers), host=host,
                   mla_kinds=kinds)

    def replace(self, **changes: Any) -> "SupportQuery":
        return dataclasses.replace(self, **changes)


def _name(dtype: Any) -> str | None:
    return None if dtype is None else dtype_name(dtype)


def reasons(query: SupportQuery, caps: Capabilities) -> list[str]:
    """Every reason ``caps`` cannot serve ``query``; empty when it can (see the module doc)."""
    out = support_reasons(caps, dtype=query.dtype, kv_cache_dtype=query.kv_cache_dtype, page_size=query.page_size,
                          kv_layout=query.kv_layout, device=query.device,
                          mode=query.modes[0] if query.modes else None, cuda_graph=query.cuda_graph,
                          deterministic=query.deterministic)
    for mode in query.modes[1:]:
        out.extend(support_reasons(caps, mode=mode))
    # an MLA model's head_dim is its latent row width: the MLA claim (mla_forms) decides, not head_dims
    all_mla = bool(query.layers) and all(layer.mla is not None for layer in query.layers)
    if query.head_dim is not None and caps.head_dims is not None and query.head_dim not in caps.head_dims \
            and not all_mla:
        out.append(f"head_dim={query.head_dim} (supported: {', '.join(str(d) for d in caps.head_dims)})")
    kinds = query.mla_kinds
    if kinds is None and query.modes:
        kinds = tuple(dict.fromkeys(mla_mode_kind(m) for m in query.modes))
    for layer in query.layers:
        found = layer_reasons(caps, layer, backend=query.backend)
        if layer.mla is not None and caps.mla and (kinds or query.mla_form is not None):
            found += [r for r in mla_reasons(caps, kinds or None, query.mla_form, query.backend) if r not in found]
        for reason in found:
            if not query.name_layers:
                out.append(reason)
            elif not any(r.endswith(reason) for r in out):  # one line per reason, naming its first layer
                out.append(f"layer {layer.layer_id}: {reason}")
    if query.host is not None:
        host_only = list(dict.fromkeys(f"layer {layer.layer_id}: {r}" for layer in query.layers
                                       for r in host_layer_reasons(caps, layer, query.host)))
        out.extend(host_only[:1])
    if query.floor_problem:
        out.append(query.floor_problem)
    return out
