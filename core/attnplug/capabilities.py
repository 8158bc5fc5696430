"""What a backend claims it can do, as typed data, and the generic checks.

Capabilities are class data on a backend and are registered with its
descriptor, so they are readable without building the backend or importing a
kernel library. ``support_reasons`` is written once here; backends only add
reasons specific to them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable

from .dtypes import BFLOAT16, FLOAT16, FLOAT32, FP8_DTYPES, dtype_name
from .layer import MLA_FORMS, LayerSpec
from .modes import ForwardMode

__all__ = ["MLA_MODE_KINDS", "RESTRICTIONS", "Capabilities", "MLAForms", "host_layer_reasons", "layer_reasons",
           "mla_mode_kind", "mla_reasons", "support_reasons"]

#: the mode kinds ``Capabilities.mla_forms`` is keyed by: ``"decode"`` (DECODE) and ``"extend"`` (every
#: other non-idle mode: extend, mixed, target-verify, draft-extend)
MLA_MODE_KINDS: tuple[str, ...] = ("decode", "extend")


def mla_mode_kind(mode: ForwardMode) -> str:
    """``"decode"`` for DECODE, ``"extend"`` for every other mode (verify and draft-extend count as extend)."""
    return "decode" if mode is ForwardMode.DECODE else "extend"


class MLAForms(dict):  # type: ignore[type-arg]
    """``Capabilities.mla_forms``: a read-only, hashable mapping ``{"decode"|"extend": (form, ...)}``."""

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(tuple(sorted(self.items())))

    def _readonly(self, *a: Any, **k: Any) -> None:
        raise TypeError("Capabilities.mla_forms is read-only (build a new Capabilities)")

    __setitem__ = __delitem__ = update = pop = popitem = clear = setdefault = _readonly  # type: ignore[assignment]


def _mla_forms(value: Any) -> Any:
    """``value`` as ``MLAForms`` (forms as tuples) when it is a mapping of the right shape; else as given
    (``descriptor.capabilities_problems`` names what is wrong)."""
    if not hasattr(value, "items"):
        return value
    items = list(value.items())
    if not all(isinstance(f, (tuple, list)) for _, f in items):
        return value
    return MLAForms((k, tuple(f)) for k, f in items)

#: Boolean fields where ``True`` claims *less* (a restriction, not a feature): a descriptor may set one
#: its backend class leaves unset, never the reverse; listings do not show them as features.
RESTRICTIONS: tuple[str, ...] = ("kv_cache_dtype_follows_model",)


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """The envelope a backend claims. Every claim is tested by the conformance suite.

    ``kv_cache_dtypes`` names the cache dtypes the backend reads at all; ``kv_cache_dtype_follows_model``
    narrows it for kernels that take the query and an unquantized cache in one dtype: with it set, a
    non-fp8 KV cache (16-bit, or float32) must be in the model dtype, so a ``bfloat16`` model with a
    ``float16`` cache is refused although both are listed. fp8 caches are governed by ``kv_cache_dtypes``
    alone (the kernel quantizes the query or dequantizes the cache itself).
    """

    dtypes: tuple[str, ...] = (FLOAT32, FLOAT16, BFLOAT16)
    #: KV-cache dtypes; empty means "the same as the model dtype only".
    kv_cache_dtypes: tuple[str, ...] = ()
    #: A non-fp8 (16-bit or float32) KV cache must be in the model dtype; fp8 caches are governed by
    #: ``kv_cache_dtypes`` alone. A restriction, not a feature: ``True`` claims less.
    kv_cache_dtype_follows_model: bool = False
    #: Supported head dims; ``None`` means any.
    head_dims: tuple[int, ...] | None = None
    #: Head dims (K and V) must be multiples of this (a kernel's vector width); ``None``: no such rule.
    head_dim_multiple_of: int | None = None
    v_head_dim_differs: bool = False
    #: Supported page sizes; ``None`` means any.
    page_sizes: tuple[int, ...] | None = None
    #: KV-cache layouts the backend reads and writes, preferred first (``kvlayout.py``); ``None`` means
    #: any layout, read and written only through ``PagedKVCache.read_kv``/``set_kv``.
    kv_layouts: tuple[str, ...] | None = ("nhd",)
    gqa: bool = True
    mqa: bool = True
    sliding_window: bool = False
    logit_softcap: bool = False
    sinks: bool = False
    cross_attention: bool = False
    #: non-causal self-attention (``LayerSpec.causality == "bidirectional"``: encoders, embedding models)
    bidirectional: bool = False
    speculative_verify: bool = False
    draft_extend: bool = False
    cuda_graph: bool = False
    deterministic: bool = False
    devices: tuple[str, ...] = ("cpu",)
    min_compute_capability: tuple[int, int] | None = None
    #: CUDA SMs (``HostInfo.sm()``: 80, 90, …) whose kernels apply attention sinks; ``None``: wherever the
    #: backend runs. A sink layer on another GPU is refused (``host_layer_reasons``) instead of silently
    #: computed without its sinks.
    sinks_sms: tuple[int, ...] | None = None
    #: MLA (``LayerSpec.mla``, docs/mla.md): per mode kind (``"decode"``; ``"extend"``, which also covers
    #: mixed, target-verify and draft-extend), the forms (``"absorbed"``, ``"unabsorbed"``) the backend
    #: computes. Empty (the default): no MLA layer at all. A read-only mapping (``MLAForms``).
    mla_forms: Any = dataclasses.field(default_factory=MLAForms)

    def __post_init__(self) -> None:
        object.__setattr__(self, "mla_forms", _mla_forms(self.mla_forms))
        object.__setattr__(self, "dtypes", tuple(dtype_name(d) for d in self.dtypes))
        object.__setattr__(self, "kv_cache_dtypes", tuple(dtype_name(d) for d in self.kv_cache_dtypes))
        if isinstance(self.kv_layouts, list):
            object.__setattr__(self, "kv_layouts", tuple(self.kv_layouts))

    def reads_layout(self, name: str) -> bool:
        """Whether the backend reads and writes a cache in layout ``name``."""
        return self.kv_layouts is None or name in self.kv_layouts

    def layouts_text(self) -> str:
        """The declared layouts as words (``any (through read_kv/set_kv)`` for ``None``)."""
        return "any (through read_kv/set_kv)" if self.kv_layouts is None else ", ".join(self.kv_layouts)

    def mla_forms_for(self, kind: str) -> tuple[str, ...]:
        """The MLA forms claimed for mode kind ``kind`` (``"decode"`` / ``"extend"``); ``()`` when none."""
        return tuple(self.mla_forms.get(kind, ()))

    @property
    def mla(self) -> bool:
        """Whether any MLA form is claimed."""
        return any(self.mla_forms.get(k) for k in MLA_MODE_KINDS)

    def supports_mode(self, mode: ForwardMode) -> bool:
        """Whether forwards of ``mode`` are claimed (verify and draft-extend are opt-in)."""
        if mode is ForwardMode.TARGET_VERIFY:
            return self.speculative_verify
        if mode is ForwardMode.DRAFT_EXTEND or mode is ForwardMode.DRAFT_EXTEND_V2:
            return self.draft_extend
        return True

    def to_dict(self) -> dict[str, Any]:
        """The claims as JSON-ready data (tuples become lists)."""
        d = dataclasses.asdict(self)
        for k, v in d.items():
            if isinstance(v, tuple):
                d[k] = list(v)
        d["mla_forms"] = {k: list(v) for k, v in self.mla_forms.items()}
        return d

    def summary(self) -> str:
        """A short human line: the claimed features, then the restrictions set (``RESTRICTIONS``)."""
        flags = [
            name
            for name in (
                "sliding_window", "logit_softcap", "sinks", "cross_attention", "bidirectional", "speculative_verify",
                "draft_extend", "cuda_graph", "deterministic",
            )
            if getattr(self, name)
        ]
        flags += [name for name in RESTRICTIONS if getattr(self, name)]
        if self.mla:
            flags.append("mla(" + ",".join(f"{k}:{'+'.join(self.mla_forms_for(k))}" for k in MLA_MODE_KINDS
                                           if self.mla_forms_for(k)) + ")")
        return f"dtypes={','.join(self.dtypes)} devices={','.join(self.devices)} " + " ".join(flags)


def support_reasons(
    caps: Capabilities,
    layer: LayerSpec | None = None,
    *,
    dtype: Any = None,
    kv_cache_dtype: Any = None,
    page_size: int | None = None,
    kv_layout: str | None = None,
    device: str | None = None,
    mode: ForwardMode | None = None,
    cuda_graph: bool | None = None,
    deterministic: bool | None = None,
    mla_form: str | None = None,
    backend: str | None = None,
) -> list[str]:
    """Sentences saying why ``caps`` cannot serve this problem; empty when it can.

    Arguments left as ``None`` are not checked. For an MLA ``layer``, ``mode`` and ``mla_form`` (the
    batch's ``ForwardBatch.mla_form``) narrow which MLA claim is checked (``mla_reasons``); ``backend``
    names the backend in those sentences.
    """
    reasons: list[str] = []
    if dtype is not None:
        name = dtype_name(dtype)
        if name not in caps.dtypes:
            reasons.append(f"dtype={name} (supported: {', '.join(caps.dtypes)})")
    if kv_cache_dtype is not None:
        kv = dtype_name(kv_cache_dtype)
        allowed = caps.kv_cache_dtypes or ((dtype_name(dtype),) if dtype is not None else caps.dtypes)
        if kv not in allowed:
            reasons.append(f"kv_cache_dtype={kv} (supported: {', '.join(allowed)})")
        elif caps.kv_cache_dtype_follows_model and dtype is not None and kv not in FP8_DTYPES \
                and kv != dtype_name(dtype):
            reasons.append(f"kv_cache_dtype={kv} with dtype={dtype_name(dtype)}: a non-fp8 KV cache must be in "
                           f"the model dtype (kv_cache_dtype_follows_model)")
    if page_size is not None and caps.page_sizes is not None and page_size not in caps.page_sizes:
        reasons.append(f"page_size={page_size} (supported: {_join(caps.page_sizes)})")
    if kv_layout is not None and not caps.reads_layout(kv_layout):
        reasons.append(f"kv_layout={kv_layout} (reads: {caps.layouts_text()})")
    if device is not None:
        kind = device.split(":", 1)[0]
        if kind not in caps.devices:
            reasons.append(f"device={kind} (supported: {', '.join(caps.devices)})")
    if mode is not None and not caps.supports_mode(mode):
        reasons.append(f"forward mode {mode.value} is not claimed")
    if cuda_graph and not caps.cuda_graph:
        reasons.append("CUDA-graph capture is not claimed")
    if deterministic and not caps.deterministic:
        reasons.append("deterministic (batch-invariant) output is not claimed")
    if layer is not None:
        reasons.extend(layer_reasons(caps, layer, backend=backend))
        if getattr(layer, "mla", None) is not None and caps.mla and (mode is not None or mla_form is not None):
            kinds = (mla_mode_kind(mode),) if mode is not None else None
            reasons.extend(r for r in mla_reasons(caps, kinds, mla_form, backend) if r not in reasons)
    return reasons


def mla_reasons(caps: Capabilities, kinds: Iterable[str] | None = None, form: str | None = None,
                backend: str | None = None) -> list[str]:
    """Why ``caps`` cannot serve an MLA layer in mode kinds ``kinds`` (``"decode"``/``"extend"``; ``None``:
    at least one form of any kind) with ``form`` (``None``: any form), as sentences naming the layer kind
    and the form (``"MLA layer (absorbed decode) not supported by torch_native (mla_forms: decode: none)"``).
    """
    by = f" by {backend}" if backend else ""
    if form is not None and form not in MLA_FORMS:
        return [f"MLA form {form!r} is not one of {', '.join(MLA_FORMS)} (ForwardBatch.mla_form)"]
    if kinds is None:
        if caps.mla:
            return []
        return [f"MLA layer not supported{by} (Capabilities.mla_forms claims no MLA form)"]
    out = []
    for kind in kinds:
        have = caps.mla_forms_for(kind)
        ok = form in have if form is not None else bool(have)
        if not ok:
            what = f"{form} {kind}" if form is not None else kind
            out.append(f"MLA layer ({what}) not supported{by} (mla_forms: {kind}: {', '.join(have) or 'none'})")
    return out


def layer_reasons(caps: Capabilities, layer: LayerSpec, backend: str | None = None) -> list[str]:
    reasons: list[str] = []
    if getattr(layer, "mla", None) is not None:
        # an MLA layer is its own kind: the head-dim / MQA claims describe ordinary attention kernels; what
        # decides is the MLA claim (any form here; per forward, the batch's form in its mode kind)
        return mla_reasons(caps, None, None, backend)
    if caps.head_dims is not None and layer.head_dim not in caps.head_dims:
        reasons.append(f"head_dim={layer.head_dim} (supported: {_join(caps.head_dims)})")
    m = caps.head_dim_multiple_of
    if m is not None:
        for field, dim in (("head_dim", layer.head_dim), ("v_head_dim", layer.v_head_dim)):
            if dim % m:
                reasons.append(f"{field}={dim} is not a multiple of {m} (head_dim_multiple_of)")
    if layer.v_head_dim != layer.head_dim and not caps.v_head_dim_differs:
        reasons.append(f"v_head_dim={layer.v_head_dim} differs from head_dim={layer.head_dim} (not claimed)")
    group = layer.gqa_group_size
    if layer.num_kv_heads == 1 and layer.num_heads > 1 and not caps.mqa:
        reasons.append(f"MQA (num_heads={layer.num_heads}, num_kv_heads=1) is not claimed")
    elif group > 1 and layer.num_kv_heads > 1 and not caps.gqa:
        reasons.append(f"GQA group size {group} is not claimed")
    if layer.uses_sliding_window and not caps.sliding_window:
        reasons.append(f"sliding_window={layer.sliding_window} is not claimed")
    if layer.uses_softcap and not caps.logit_softcap:
        reasons.append(f"logit_cap={layer.logit_cap} is not claimed")
    if layer.uses_sinks and not caps.sinks:
        reasons.append("attention sinks are not claimed")
    if layer.is_cross_attention and not caps.cross_attention:
        reasons.append("cross-attention is not claimed")
    if getattr(layer, "uses_bidirectional", False) and not caps.bidirectional:
        reasons.append("bidirectional (non-causal) attention is not claimed")
    return reasons


def host_layer_reasons(caps: Capabilities, layer: LayerSpec, host: Any) -> list[str]:
    """What ``caps`` cannot serve of ``layer`` on ``host`` (a ``HostInfo``): claims that hold on some GPUs only."""
    sms = caps.sinks_sms
    if sms is None or not layer.uses_sinks or host is None or getattr(host, "platform", None) != "cuda":
        return []
    sm = host.sm()
    if sm is None or sm in sms:
        return []
    return [f"attention sinks on SM{sm} (its kernels apply sinks on SM{'/'.join(map(str, sms))} only)"]


def _join(values: Iterable[Any]) -> str:
    return ", ".join(str(v) for v in values)
