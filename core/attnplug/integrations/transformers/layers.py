"""One ``LayerSpec`` per attention layer of a transformers model: what its forward really passes.

The spec is **derived from a probe forward**, not from config fields whose
meaning varies by family. Before serving, the model runs once on a few tokens
with a recording function registered in transformers' ``AttentionInterface``
(``"attnplug_probe"``, :func:`probe`): every attention call is recorded with
the module that made it, its ``query``/``key``/``value`` shapes (heads, KV
heads, head dim, V head dim) and the keyword arguments the layer passes
(``scaling``, ``sliding_window``, ``softcap``, ``s_aux``, ``is_causal`` or the
module's ``is_causal``). The spec of each layer is built from that record, so
a field the model stores but never passes (Gemma3 stores
``attn_logit_softcapping`` and passes no soft-cap in this transformers
version) is not claimed, and a window passed only from ``config.sliding_window``
(Mistral, Phi-3, Starcoder2: no ``layer_types``) is served. Where what the
module or config says differs from what the forward passes, the spec follows
the forward and :class:`Derivation` keeps a note; where the module's own shape
attributes (head dim under its common names, head counts) disagree with the
tensors it passes, the layer is refused, naming the field.

Everything that cannot be served is refused before the first forward with a
:class:`ModelNotServedError` (a ``NotSupportedError``) naming the model family
(``config.model_type`` and the class), what was looked for, why, and what to
do: layer types other than full and sliding attention (by name, e.g.
``linear_attention``), models whose attention does not go through
``AttentionInterface``, encoder-decoder models, layers whose attention gets a
mask the model built itself or arguments attnplug does not apply, and models
whose attention inputs ignore ``position_ids`` (a packed ragged batch carries
each token's position there).

Sliding window, the one convention that differs: in transformers a
``sliding_window`` of ``W`` lets a query at position ``p`` see keys
``p - W < j <= p`` (``W`` keys, itself included; ``masking_utils.
sliding_window_overlay`` is ``kv_idx > q_idx - sliding_window`` and the
flash-attention path passes ``window_size=(W - 1, W - 1)``). attnplug's
``LayerSpec.sliding_window`` is flash-attention's ``window_left``: keys
``p - sliding_window <= j <= p``. So ``W`` becomes ``W - 1``
(:func:`attnplug_sliding_window`). A bidirectional layer with a window
(EmbeddingGemma) sees ``|p - j| < W`` in transformers (``|p - j| <= W - 1``
in attnplug), the same translation.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence, cast

from attnplug import LayerSpec, NotSupportedError

__all__ = [
    "HEAD_DIM_NAMES",
    "LAYER_TYPE_REASONS",
    "MASK_PROBE_TOKENS",
    "PASS_THROUGH_KWARGS",
    "PROBE_MASK_NAME",
    "PROBE_NAME",
    "PROBE_SHIFT",
    "PROBE_TOKENS",
    "SERVED_LAYER_TYPES",
    "SPEC_KWARGS",
    "Call",
    "Derivation",
    "ModelNotServedError",
    "attnplug_sliding_window",
    "derive",
    "family_of",
    "head_dim_of",
    "layer_specs",
    "layer_types",
    "probe",
    "refuse_structure",
]

#: transformers layer types this integration serves (others are refused by name).
SERVED_LAYER_TYPES = ("full_attention", "sliding_attention")
#: why a layer type is not served (the refusal says it by name; unknown types get a generic reason).
LAYER_TYPE_REASONS = {
    "linear_attention": "a linear-attention layer (a recurrent state updated per token, not attention over a KV "
                        "cache)",
    "chunked_attention": "chunked local attention (keys in fixed position chunks), which a LayerSpec cannot "
                         "express",
    "mamba": "a state-space (Mamba) layer with a recurrent state, not attention over a KV cache",
    "conv": "a convolution layer with its own state, not attention over a KV cache",
    "hybrid": "a layer mixing attention with a recurrent state",
}
#: where the head size is looked for, on the attention module then on the config, in this order.
HEAD_DIM_NAMES = ("head_dim", "head_size", "attention_head_size", "d_head", "kv_channels")
#: per-call keyword arguments that are plumbing, not attention semantics (any value is accepted).
PASS_THROUGH_KWARGS = frozenset({
    "position_ids", "cache_position", "use_cache", "output_attentions", "return_dict", "token_type_ids",
    "attnplug_forward", "layer_idx", "output_hidden_states", "logits_to_keep", "position_embeddings",
})
#: per-call keyword arguments the spec is derived from (and checked against at every call).
SPEC_KWARGS = frozenset({"sliding_window", "softcap", "s_aux", "is_causal"})

#: the name of the recording function registered with transformers' AttentionInterface.
PROBE_NAME = "attnplug_probe"
#: the same with a mask function (the mask probe: the mask the model's own mask code means, per layer)
PROBE_MASK_NAME = "attnplug_probe_masks"
#: tokens of the mask probe: windows up to this many keys are checked against the model's mask
MASK_PROBE_TOKENS = 24
#: tokens the probe forward runs on, and the shift of the second run's positions (``position_ids`` check).
PROBE_TOKENS = 4
PROBE_SHIFT = 7


class ModelNotServedError(NotSupportedError):
    """A model (or one of its layers) the integration does not serve, refused before the first forward.

    ``family`` is ``config.model_type``, ``model_class`` the class name; ``reasons`` say what was
    looked for and why it is not served (by layer where it is one layer); ``remedy`` what to do.
    """

    def __init__(self, model: Any, reasons: Sequence[str], remedy: str) -> None:
        self.family, self.model_class = family_of(model)
        self.remedy = remedy
        super().__init__("attnplug", list(reasons), what=f"model family {self.family!r} ({self.model_class})")
        self.args = (f"{self.args[0]}. What to do: {remedy}",)


def family_of(model: Any) -> tuple[str, str]:
    """``(config.model_type, class name)`` of a model."""
    config = getattr(model, "config", None)
    return str(getattr(config, "model_type", None) or "?"), type(model).__name__


def attnplug_sliding_window(hf_window: int | None) -> int | None:
    """transformers' ``sliding_window`` (``W`` keys, self included) -> attnplug's (``W - 1``)."""
    if hf_window is None:
        return None
    if not isinstance(hf_window, int) or isinstance(hf_window, bool) or hf_window < 1:
        raise ValueError(f"transformers sliding_window={hf_window!r} (expected a positive integer or None)")
    return hf_window - 1


def layer_types(config: Any) -> list[str] | None:
    """``config.layer_types`` (``None`` when the config has none)."""
    types = getattr(config, "layer_types", None)
    return None if types is None else list(types)


def head_dim_of(module: Any, config: Any) -> tuple[int | None, str]:
    """The head size a module or its config names, and where it was found (``HEAD_DIM_NAMES``, then
    ``hidden_size / num_attention_heads``); ``(None, what was looked for)`` when nowhere."""
    for owner, label in ((module, "the attention module"), (config, "config")):
        for name in HEAD_DIM_NAMES:
            value = getattr(owner, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value, f"{label}.{name}"
    hidden, heads = getattr(config, "hidden_size", None), getattr(config, "num_attention_heads", None)
    if isinstance(hidden, int) and isinstance(heads, int) and heads > 0 and hidden % heads == 0:
        return hidden // heads, "config.hidden_size / config.num_attention_heads"
    return None, f"{', '.join(HEAD_DIM_NAMES)} on the attention module and config, or hidden_size / num_attention_heads"


# -- the probe ------------------------------------------------------------------
@dataclasses.dataclass
class Call:
    """One attention call of the probe forward: who made it and what it passed."""

    module: Any
    layer_idx: Any
    num_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    scaling: float | None
    dropout: float
    has_mask: bool
    kwargs: dict[str, Any]
    is_causal: bool
    #: the query and key (for the position check of the second run)
    qk: tuple[Any, Any]
    #: the boolean mask transformers' mask functions built for this layer (the mask probe only)
    mask: Any = None


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[Call] = []

    def __call__(self, module: Any, query: Any, key: Any, value: Any, attention_mask: Any,
                 scaling: float | None = None, dropout: float = 0.0, **kwargs: Any) -> tuple[Any, None]:
        import torch

        is_causal = kwargs.get("is_causal")
        if is_causal is None:
            is_causal = getattr(module, "is_causal", True)
        self.calls.append(Call(
            module=module, layer_idx=getattr(module, "layer_idx", None), num_heads=int(query.shape[1]),
            num_kv_heads=int(key.shape[1]), head_dim=int(query.shape[-1]), v_head_dim=int(value.shape[-1]),
            scaling=None if scaling is None else float(scaling), dropout=float(dropout or 0.0),
            has_mask=attention_mask is not None, kwargs=dict(kwargs), is_causal=bool(is_causal),
            qk=(query.detach().float().clone(), key.detach().float().clone()),
            mask=attention_mask.detach().clone() if hasattr(attention_mask, "detach") else None,
        ))
        b, h, t = query.shape[0], query.shape[1], query.shape[2]
        return torch.zeros(b, t, h, value.shape[-1], dtype=query.dtype, device=query.device), None


def _bool_mask(*args: Any, **kwargs: Any) -> Any:
    """transformers' SDPA mask function, never skipped: the boolean mask the model's mask functions mean."""
    from transformers.masking_utils import sdpa_mask

    for k in ("allow_is_causal_skip", "allow_is_bidirectional_skip", "allow_torch_fix"):
        kwargs.pop(k, None)
    return sdpa_mask(*args, allow_is_causal_skip=False, allow_is_bidirectional_skip=False, **kwargs)


def probe(model: Any, shift: int = 0, tokens: int = PROBE_TOKENS, masks: bool = False) -> list[Call]:
    """Run ``model`` once on ``tokens`` tokens at positions ``shift …`` with the recording attention
    function; the model's attention implementation is restored afterwards. With ``masks``, the recording
    implementation also has a mask function, so each call records the mask the model builds (else the
    model builds none through transformers' mask functions, as under ``"attnplug"``). Refuses
    (``ModelNotServedError``) a model that does not take an attention implementation through
    ``AttentionInterface``."""
    import torch
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    recorder = _Recorder()
    name = PROBE_MASK_NAME if masks else PROBE_NAME
    AttentionInterface.register(name, recorder)
    if masks:
        ALL_MASK_ATTENTION_FUNCTIONS.register(name, _bool_mask)
    config = model.config
    before = config._attn_implementation
    training = model.training
    try:
        model.set_attn_implementation(name)
        if config._attn_implementation != name:
            raise ModelNotServedError(model, [
                f"{type(model).__name__} does not route attention through transformers' AttentionInterface "
                f"(attn_implementation stays {config._attn_implementation!r}; its attention is computed inside "
                f"the model's own code, where attnplug cannot reach)"],
                "use a model whose transformers implementation takes attn_implementation (most decoder models "
                "do), or run this one with transformers' own attention")
        model.eval()
        param = next(model.parameters())
        vocab = int(getattr(config, "vocab_size", 0) or 0) or 1000
        ids = (torch.arange(tokens, device=param.device) % max(1, vocab - 1) + 1)[None]
        positions = torch.arange(shift, shift + tokens, device=param.device)[None]
        with torch.inference_mode():
            model(input_ids=ids, position_ids=positions, use_cache=False)
    finally:
        if config._attn_implementation == name:
            model.set_attn_implementation(before)
        model.train(training)
    return recorder.calls


# -- the derivation ----------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Derivation:
    """The specs (indexed by ``layer_idx``), the probe's calls, and notes where the module or config
    says something the forward does not pass (the spec follows the forward)."""

    specs: tuple[LayerSpec, ...]
    calls: tuple[Call, ...]
    notes: tuple[str, ...] = ()


def refuse_structure(model: Any) -> None:
    """Refusals readable without running the model: encoder-decoder, and layer types not served."""
    config = model.config
    if getattr(config, "is_encoder_decoder", False):
        raise ModelNotServedError(model, [
            "an encoder-decoder model: its decoder's cross-attention reads the encoder's K/V, which the "
            "integration's cache (one self-attention K/V per request and layer) does not hold"],
            "serve a decoder-only model (the family's *ForCausalLM class where transformers has one), or run "
            "this one with transformers' own attention")
    types = layer_types(config)
    if types is not None:
        odd = [(i, t) for i, t in enumerate(types) if t not in SERVED_LAYER_TYPES]
        if odd:
            kinds = sorted({t for _, t in odd})
            reasons = [f"layers {[i for i, t in odd if t == k]} are of type {k!r} (config.layer_types): "
                       f"{LAYER_TYPE_REASONS.get(k, 'not a self-attention layer over a KV cache')}" for k in kinds]
            raise ModelNotServedError(model, reasons + [f"served layer types: {', '.join(SERVED_LAYER_TYPES)}"],
                                      "serve a model whose layers are all full or sliding-window attention")


def derive(model: Any) -> Derivation:
    """The layer specs of ``model`` from a probe forward (see the module docstring); refuses what it
    cannot serve with :class:`ModelNotServedError`."""
    refuse_structure(model)
    calls = probe(model)
    if not calls:
        raise ModelNotServedError(model, [
            "no attention call went through transformers' AttentionInterface in a forward (its attention is "
            "computed by the model's own code)"],
            "use a model whose attention layers call the configured attention function")
    config = model.config
    by_layer: dict[int, list[Call]] = {}
    reasons: list[str] = []
    for c in calls:
        if not isinstance(c.layer_idx, int) or isinstance(c.layer_idx, bool):
            reasons.append(f"attention module {type(c.module).__name__} has no integer layer_idx "
                           f"(it has {c.layer_idx!r}); the cache is indexed by layer")
            continue
        by_layer.setdefault(c.layer_idx, []).append(c)
    n = len(by_layer)
    if not reasons and sorted(by_layer) != list(range(n)):
        reasons.append(f"the attention calls name layers {sorted(by_layer)}, expected 0 … {n - 1}")
    for i, cs in sorted(by_layer.items()):
        if len(cs) > 1 or any(c.module is not cs[0].module for c in cs):
            reasons.append(f"layer {i}: attention was called {len(cs)} times in one forward "
                           f"({', '.join(type(c.module).__name__ for c in cs)}); one call per layer is served")
    if reasons:
        raise ModelNotServedError(model, reasons, "this model's attention layout is not served by attnplug")
    notes: list[str] = []
    specs: list[LayerSpec] = []
    for i in range(n):
        c = by_layer[i][0]
        spec, why, said = _spec(i, c, config)
        if why:
            reasons += [f"layer {i}: {w}" for w in why]
        else:
            specs.append(cast(LayerSpec, spec))  # no reasons: _spec built one
        notes += [f"layer {i}: {s}" for s in said]
    if reasons:
        raise ModelNotServedError(model, reasons, "the layers named cannot be expressed as attnplug LayerSpecs; "
                                                  "run this model with transformers' own attention")
    _check_positions(model, calls)
    _check_masks(model, specs)
    return Derivation(tuple(specs), tuple(calls), tuple(notes))


def _check_masks(model: Any, specs: Sequence[LayerSpec]) -> None:
    """The mask transformers' mask functions build for each layer (``MASK_PROBE_TOKENS`` tokens) must be the
    one its spec implies (causal or bidirectional, window): a window or causality that lives in the model's
    mask but not in its attention arguments (which is all that reaches attnplug) is refused by layer."""
    import torch

    calls = probe(model, tokens=MASK_PROBE_TOKENS, masks=True)
    n = MASK_PROBE_TOKENS
    pos = torch.arange(n)
    reasons = []
    for c in calls:
        i = c.layer_idx
        if c.mask is None or not isinstance(i, int) or not 0 <= i < len(specs) or c.mask.dtype != torch.bool:
            continue
        got = c.mask.reshape(-1, n, c.mask.shape[-1])[0, :, -n:].cpu()
        spec = specs[i]
        want = torch.ones(n, n, dtype=torch.bool) if spec.uses_bidirectional else pos[None, :] <= pos[:, None]
        if spec.sliding_window is not None:
            want &= (pos[:, None] - pos[None, :]).abs() <= spec.sliding_window
        if not torch.equal(got, want):
            q, k = (int(x) for x in (got != want).nonzero()[0])
            seen = int(got[-1].sum())
            reasons.append(
                f"layer {i}: the model's own mask is not what its attention arguments say (mask: query {q} "
                f"{'sees' if got[q, k] else 'does not see'} key {k}, the last of {n} queries sees {seen} keys; "
                f"arguments: sliding_window={c.kwargs.get('sliding_window')}, is_causal={c.is_causal}); attnplug, "
                f"like transformers' flash-attention path, receives only the arguments")
    if reasons:
        raise ModelNotServedError(model, reasons, "run this model with transformers' own attention (eager or sdpa)")


def _spec(i: int, c: Call, config: Any) -> tuple[LayerSpec | None, list[str], list[str]]:
    """The spec of layer ``i`` from its call ``c``; ``(spec, refusals, notes)``."""
    why: list[str] = []
    said: list[str] = []
    module = c.module
    name = type(module).__name__
    # the module's shape attributes must describe the tensors it passes
    dim, where = head_dim_of(module, config)
    if dim is None:
        why.append(f"{name}: no head size found (looked for {where})")
    elif dim != c.head_dim and not hasattr(module, "qk_head_dim"):
        why.append(f"head_dim: {where}={dim}, but {name} passes queries of head dim {c.head_dim}")
    groups = getattr(module, "num_key_value_groups", None)
    if isinstance(groups, int) and groups > 0 and c.num_heads // groups != c.num_kv_heads:
        why.append(f"num_key_value_groups: {name}.num_key_value_groups={groups}, but it passes {c.num_heads} "
                   f"query heads and {c.num_kv_heads} KV heads")
    if c.num_heads % c.num_kv_heads:
        why.append(f"num_kv_heads: {c.num_heads} query heads are not a multiple of {c.num_kv_heads} KV heads")
    if c.has_mask:
        why.append(f"attention_mask: {name} gets a mask the model built itself (not through transformers' mask "
                   f"interface); attnplug masks by position (causal or bidirectional, window)")
    if c.dropout:
        why.append(f"dropout={c.dropout} in eval mode")
    extra = sorted(k for k, v in c.kwargs.items()
                   if k not in PASS_THROUGH_KWARGS and k not in SPEC_KWARGS and v is not None and v is not False)
    if extra:
        why.append(f"{name} passes {', '.join(extra)} to its attention function, which attnplug does not apply")
    window = c.kwargs.get("sliding_window")
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        why.append(f"sliding_window={window!r} (expected a positive integer)")
        window = None
    cap = c.kwargs.get("softcap")
    if cap is not None and not (isinstance(cap, (int, float)) and math.isfinite(cap) and cap >= 0):
        why.append(f"softcap={cap!r} (expected a non-negative number)")
        cap = None
    sinks = c.kwargs.get("s_aux")
    if sinks is not None and tuple(getattr(sinks, "shape", ())) != (c.num_heads,):
        why.append(f"s_aux of shape {tuple(getattr(sinks, 'shape', ()))} (expected one sink per query head, "
                   f"({c.num_heads},))")
        sinks = None
    # what the module or config says but the forward does not pass: the spec follows the forward
    stored_cap = getattr(module, "attn_logit_softcapping", None)
    if stored_cap is None:
        stored_cap = getattr(config, "attn_logit_softcapping", None)
    if stored_cap and not cap:
        said.append(f"attn_logit_softcapping={stored_cap} is stored but the forward passes no softcap: not applied")
    stored_window = getattr(module, "sliding_window", None)
    if isinstance(stored_window, int) and stored_window != window:
        said.append(f"{name}.sliding_window={stored_window} but the forward passes sliding_window={window}")
    if why:
        return None, why, said
    scaling = c.scaling if c.scaling is not None else 1.0 / math.sqrt(c.head_dim)
    spec = LayerSpec(
        layer_id=i, num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
        v_head_dim=c.v_head_dim, scaling=float(scaling), logit_cap=float(cap) if cap else None,
        sliding_window=attnplug_sliding_window(window), sinks=None if sinks is None else sinks.detach(),
        causality="causal" if c.is_causal else "bidirectional",
    )
    return spec, why, said


def _check_positions(model: Any, first: list[Call]) -> None:
    """A second probe at shifted positions: some attention input must change, else the model ignores
    ``position_ids`` and a packed ragged batch would put every request at the first one's positions."""
    import torch

    second = probe(model, shift=PROBE_SHIFT)
    if len(second) != len(first):
        raise ModelNotServedError(model, [
            f"the probe forward made {len(first)} attention calls at positions 0 … and {len(second)} at positions "
            f"{PROBE_SHIFT} …; the layer structure depends on the input"], "run it with transformers' own attention")
    moved = any(not (torch.equal(a.qk[0], b.qk[0]) and torch.equal(a.qk[1], b.qk[1])) for a, b in zip(first, second))
    if not moved:
        raise ModelNotServedError(model, [
            "position_ids: the model's attention inputs do not change with position_ids (it derives positions "
            "itself, from the cache or from absolute position embeddings indexed by the input length), so a "
            "packed ragged batch cannot carry each request's positions"],
            "serve a model that takes position_ids (rotary or position-id-indexed embeddings)")


def layer_specs(model: Any) -> tuple[LayerSpec, ...]:
    """One ``LayerSpec`` per attention layer (``derive(model).specs``)."""
    return derive(model).specs

