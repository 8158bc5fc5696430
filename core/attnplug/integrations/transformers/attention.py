"""The attention function transformers calls, registered as ``"attnplug"``.

transformers' attention modules compute q/k/v (rotary applied), call
``cache.update`` and then ``attention_interface(module, query, key, value,
attention_mask, scaling=..., dropout=..., **kwargs)`` with the layer's own
keyword arguments (``sliding_window``, ``softcap``, ``s_aux`` …) and
whatever the caller passed to ``model(...)``. The runner passes one
:class:`Forward` as ``attnplug_forward=...``: the backend serving this forward,
its ``ForwardBatch`` (metadata already built, once) and the layer specs. Model
code reads nothing global; the registration is transformers' own name table.

The whole ragged batch arrives as one packed sequence (``query`` is
``[1, heads, tokens, head_dim]``), so no padding token reaches attention and
transformers builds no mask (``"attnplug"`` has no mask function).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from attnplug import AttnplugError, LayerSpec

from .layers import attnplug_sliding_window

__all__ = ["ATTENTION_NAME", "FORWARD_KWARG", "Forward", "LayerCall", "attnplug_attention_forward", "layer_calls",
           "register_attention"]

#: The name under which the function is registered with transformers' AttentionInterface.
ATTENTION_NAME = "attnplug"
#: The keyword the runner passes to ``model(...)``; transformers hands it down to every layer.
FORWARD_KWARG = "attnplug_forward"


class LayerCall:
    """What every attention call of one layer must pass, read off its ``LayerSpec`` once (the runner builds
    one per layer at construction; ``layer_calls``). ``matches`` compares a call with it in a few reads;
    a call that does not match exactly runs the full ``_check_layer_kwargs``, which words the error (or
    accepts a scaling within its tolerance)."""

    __slots__ = ("layer", "scaling", "hf_window", "cap", "causal", "sinks")

    def __init__(self, layer: LayerSpec) -> None:
        self.layer = layer
        self.scaling = layer.scaling
        #: the window as transformers passes it (``W`` keys, self included; attnplug's is ``W - 1``)
        self.hf_window = None if layer.sliding_window is None else layer.sliding_window + 1
        self.cap = layer.logit_cap or None
        self.causal = layer.causality == "causal"
        self.sinks = layer.sinks is not None

    def matches(self, module: Any, scaling: float | None, dropout: float, attention_mask: Any,
                kwargs: dict[str, Any]) -> bool:
        """The call passes exactly what the spec says (``True`` implies ``_check_layer_kwargs`` passes)."""
        if attention_mask is not None or dropout or (scaling is not None and scaling != self.scaling):
            return False
        window = kwargs.get("sliding_window")
        if window != self.hf_window or (window is not None and type(window) is not int):
            return False
        if (kwargs.get("softcap") or None) != self.cap or (kwargs.get("s_aux") is None) == self.sinks:
            return False
        is_causal = kwargs.get("is_causal")
        if is_causal is None:
            is_causal = getattr(module, "is_causal", True)
        return bool(is_causal) == self.causal


def layer_calls(layers: Sequence[LayerSpec]) -> tuple[LayerCall, ...]:
    """One ``LayerCall`` per layer, in layer order."""
    return tuple(LayerCall(layer) for layer in layers)


class Forward:
    """What one forward's attention calls share: the backend, the batch, the layer specs (and their
    ``LayerCall``s, when the runner passes them: else every call runs the full keyword check)."""

    __slots__ = ("backend", "batch", "layers", "calls", "cache", "plans")

    def __init__(self, backend: Any, batch: Any, layers: Sequence[LayerSpec], cache: Any = None,
                 plans: Sequence[LayerCall] | None = None) -> None:
        self.backend = backend
        self.batch = batch
        self.layers = layers
        self.calls = 0
        #: the ``AttnplugCache`` of this forward (an MLA layer reads the latents its ``update`` received)
        self.cache = cache
        self.plans = plans

    def attend(self, module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: Any, scaling: float | None, dropout: float, kwargs: dict[str, Any]) -> torch.Tensor:
        layer_idx = getattr(module, "layer_idx", None)
        if not isinstance(layer_idx, int) or not 0 <= layer_idx < len(self.layers):
            raise AttnplugError(f"attention module {type(module).__name__} has layer_idx={layer_idx!r}, "
                                f"expected 0 … {len(self.layers) - 1}")
        layer = self.layers[layer_idx]
        plan = None if self.plans is None else self.plans[layer_idx]
        if plan is None or plan.layer is not layer or not plan.matches(module, scaling, dropout, attention_mask,
                                                                      kwargs):
            _check_layer_kwargs(layer, module, scaling, dropout, attention_mask, kwargs)
        if query.shape[0] != 1:
            raise AttnplugError(f"layer {layer_idx}: query batch dimension is {query.shape[0]}; the runner "
                                f"packs every request into one ragged sequence (expected 1)")
        if layer.mla is not None:  # served from the latent rows (mla.py)
            from .mla import attend_mla

            last = None if self.cache is None else self.cache.layers[layer_idx].last
            out = attend_mla(self.backend, self.batch, layer, module, query, last)
            self.calls += 1
            return out
        if query.shape[2] == 1:  # one token (a decode step at batch 1): [1, heads, 1, d] -> [1, heads, d], a view
            q, k, v = query.squeeze(2).contiguous(), key.squeeze(2).contiguous(), value.squeeze(2).contiguous()
        else:
            q = query[0].transpose(0, 1).contiguous()  # [tokens, heads, head_dim]
            k = key[0].transpose(0, 1).contiguous()
            v = value[0].transpose(0, 1).contiguous()
        out = self.backend.forward(q, k, v, layer, self.batch)  # writes k/v into the paged cache
        self.calls += 1
        return out.unsqueeze(0)  # [1, tokens, heads, v_head_dim], as transformers expects


def attnplug_attention_forward(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature; serves the call through attnplug."""
    fwd = kwargs.pop(FORWARD_KWARG, None)
    if not isinstance(fwd, Forward):
        raise AttnplugError(
            f"attention implementation {ATTENTION_NAME!r} was called without {FORWARD_KWARG}=...: run the model "
            f"through attnplug.integrations.transformers.TransformersRunner, which builds the batch and passes it"
        )
    return fwd.attend(module, query, key, value, attention_mask, scaling, dropout, kwargs), None


def register_attention() -> None:
    """Register :func:`attnplug_attention_forward` with transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, attnplug_attention_forward)


def _check_layer_kwargs(layer: LayerSpec, module: Any, scaling: float | None, dropout: float,
                        attention_mask: Any, kwargs: dict[str, Any]) -> None:
    """What the model passes for this call must be what the spec says (else the spec is stale)."""
    lid = layer.layer_id
    if attention_mask is not None:
        raise AttnplugError(f"layer {lid}: got an attention mask; attnplug masks by position (causal, window), "
                            f"so custom masks are not served")
    if dropout:
        raise AttnplugError(f"layer {lid}: attention dropout={dropout} (the model is in training mode; "
                            f"call model.eval())")
    if scaling is not None and not math.isclose(scaling, layer.scaling, rel_tol=1e-6):
        raise AttnplugError(f"layer {lid}: the model passes scaling={scaling}, the LayerSpec has {layer.scaling}")
    window = kwargs.get("sliding_window")
    if attnplug_sliding_window(window) != layer.sliding_window:
        raise AttnplugError(f"layer {lid}: the model passes sliding_window={window} (transformers: {window} keys), "
                            f"the LayerSpec has sliding_window={layer.sliding_window} "
                            f"(expected {None if window is None else window - 1})")
    cap = kwargs.get("softcap")
    if (cap or None) != (layer.logit_cap or None):
        raise AttnplugError(f"layer {lid}: the model passes softcap={cap}, the LayerSpec has logit_cap={layer.logit_cap}")
    is_causal = kwargs.get("is_causal")
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    if bool(is_causal) != (layer.causality == "causal"):
        raise AttnplugError(f"layer {lid}: the model's attention is {'causal' if is_causal else 'bidirectional'} "
                            f"(is_causal={is_causal}), the LayerSpec has causality={layer.causality!r}")
    sinks = kwargs.get("s_aux")
    if (sinks is None) != (layer.sinks is None):
        raise AttnplugError(f"layer {lid}: the model passes sinks={'yes' if sinks is not None else 'none'}, "
                            f"the LayerSpec has {'sinks' if layer.sinks is not None else 'none'}")
