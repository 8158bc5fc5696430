"""One ``LayerSpec`` per decoder layer of a transformers model.

Read from the attention modules themselves (what their ``forward`` passes to
the attention function: ``head_dim``, ``scaling``, ``sliding_window``,
``attn_logit_softcapping``, ``sinks``) and from the config (head counts,
``layer_types``), so a spec describes exactly the computation the model asks
for.

Sliding window, the one convention that differs: in transformers a
``sliding_window`` of ``W`` lets a query at position ``p`` see keys
``p - W < j <= p`` (``W`` keys, itself included; ``masking_utils.
sliding_window_overlay`` is ``kv_idx > q_idx - sliding_window`` and the
flash-attention path passes ``window_size=(W - 1, W - 1)``). attnplug's
``LayerSpec.sliding_window`` is flash-attention's ``window_left``: keys
``p - sliding_window <= j <= p``. So ``W`` becomes ``W - 1``
(:func:`attnplug_sliding_window`).
"""

from __future__ import annotations

from typing import Any

from attnplug import LayerSpec, NotSupportedError

#: transformers layer types this integration serves (others are refused by name).
SERVED_LAYER_TYPES = ("full_attention", "sliding_attention")


def attnplug_sliding_window(hf_window: int | None) -> int | None:
    """transformers' ``sliding_window`` (``W`` keys, self included) -> attnplug's (``W - 1``)."""
    if hf_window is None:
        return None
    if not isinstance(hf_window, int) or hf_window < 1:
        raise ValueError(f"transformers sliding_window={hf_window!r} (expected a positive integer or None)")
    return hf_window - 1


def attention_modules(model: Any) -> list[Any]:
    """The self-attention module of every decoder layer, indexed by ``layer_idx``."""
    found: dict[int, Any] = {}
    for name, module in model.named_modules():
        idx = getattr(module, "layer_idx", None)
        if isinstance(idx, int) and hasattr(module, "head_dim") and hasattr(module, "scaling"):
            if idx in found:
                raise NotSupportedError(
                    "attnplug", [f"two attention modules claim layer_idx={idx} (second: {name!r})"]
                )
            found[idx] = module
    n = getattr(model.config, "num_hidden_layers", len(found))
    if sorted(found) != list(range(n)):
        raise NotSupportedError(
            "attnplug",
            [f"{type(model).__name__}: found attention modules for layers {sorted(found)}, expected 0 … {n - 1} "
             f"(modules with layer_idx, head_dim and scaling)"],
        )
    return [found[i] for i in range(n)]


def layer_types(config: Any) -> list[str]:
    """``config.layer_types``, or all ``full_attention`` when the config has none."""
    n = config.num_hidden_layers
    types = getattr(config, "layer_types", None)
    return list(types) if types is not None else ["full_attention"] * n


def layer_specs(model: Any) -> tuple[LayerSpec, ...]:
    """One ``LayerSpec`` per decoder layer; refuses layer types it cannot express."""
    config = model.config
    types = layer_types(config)
    specs = []
    for i, module in enumerate(attention_modules(model)):
        kind = types[i]
        if kind not in SERVED_LAYER_TYPES:
            raise NotSupportedError(
                "attnplug", [f"layer {i}: layer type {kind!r} (served: {', '.join(SERVED_LAYER_TYPES)})"]
            )
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        groups = getattr(module, "num_key_value_groups", heads // kv_heads)
        if heads // groups != kv_heads:
            raise NotSupportedError(
                "attnplug", [f"layer {i}: num_key_value_groups={groups} disagrees with "
                             f"num_attention_heads={heads} / num_key_value_heads={kv_heads}"]
            )
        window = getattr(module, "sliding_window", None)
        if window is None and kind == "sliding_attention":
            window = getattr(config, "sliding_window", None)
        if kind == "full_attention":
            window = None
        cap = getattr(module, "attn_logit_softcapping", None)
        if cap is None:
            cap = getattr(config, "attn_logit_softcapping", None)
        sinks = getattr(module, "sinks", None)
        specs.append(LayerSpec(
            layer_id=i,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=int(module.head_dim),
            scaling=float(module.scaling),
            logit_cap=float(cap) if cap else None,
            sliding_window=attnplug_sliding_window(window),
            sinks=None if sinks is None else sinks.detach(),
        ))
    return tuple(specs)


def describe(spec: LayerSpec) -> str:
    """A short human description of a layer's features (used in errors and docs)."""
    parts = [f"heads {spec.num_heads}/{spec.num_kv_heads}", f"head_dim {spec.head_dim}"]
    if spec.sliding_window is not None:
        parts.append(f"sliding window {spec.sliding_window}")
    if spec.logit_cap:
        parts.append(f"soft-cap {spec.logit_cap:g}")
    if spec.sinks is not None:
        parts.append("sinks")
    return ", ".join(parts)
