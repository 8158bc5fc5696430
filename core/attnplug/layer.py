"""Description of one attention layer, as the engine's model code knows it."""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only: importing this module loads no torch
    import torch


__all__ = ["ABSORBED", "BIDIRECTIONAL", "CAUSAL", "CAUSALITIES", "MLA_FORMS", "NO_WINDOW_FROM", "UNABSORBED", "LayerSpec",
           "MLASpec"]

#: ``LayerSpec.causality`` values: causal (the default) and bidirectional (non-causal self-attention).
CAUSAL = "causal"
BIDIRECTIONAL = "bidirectional"
CAUSALITIES: tuple[str, ...] = (CAUSAL, BIDIRECTIONAL)
#: a sliding window this wide or wider is no window (``LayerSpec`` stores ``None``): positions are int32
NO_WINDOW_FROM = 2 ** 31 - 1

#: ``ForwardBatch.mla_form`` values: the two ways a host computes an MLA layer (docs/mla.md)
ABSORBED = "absorbed"
UNABSORBED = "unabsorbed"
MLA_FORMS: tuple[str, ...] = (ABSORBED, UNABSORBED)


@dataclasses.dataclass(frozen=True, eq=False)
class MLASpec:
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2): what makes a ``LayerSpec`` an MLA layer.

    The cache stores per token ONE latent row ``c_kv ++ k_pe`` of ``kv_lora_rank + qk_rope_head_dim``
    values (576 in DeepSeek-V3) in its single "KV head"; there is no separate V: the values are the
    row's first ``kv_lora_rank`` entries. ``w_kc`` (``[num_heads, qk_nope_head_dim, kv_lora_rank]``) and
    ``w_vc`` (``[num_heads, kv_lora_rank, v_head_dim]``) are the model's ``kv_b_proj`` split per head;
    only the unabsorbed form needs them (``None`` otherwise). Head ``h``'s decompressed key is
    ``[c_kv @ w_kc[h]^T, k_pe]`` and its value ``c_kv @ w_vc[h]``.
    """

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    w_kc: Any = None
    w_vc: Any = None

    def __post_init__(self) -> None:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"MLASpec.{name}={value!r} (expected a positive integer)")

    @property
    def latent_dim(self) -> int:
        """Width of one cached latent row: ``kv_lora_rank + qk_rope_head_dim``."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        """Per-head query/key width of the unabsorbed form: ``qk_nope_head_dim + qk_rope_head_dim``."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def has_weights(self) -> bool:
        """Whether ``w_kc`` and ``w_vc`` are given (what the unabsorbed form needs)."""
        return self.w_kc is not None and self.w_vc is not None

    def latent_reasons(self, dims: tuple[int, int], kernels: str) -> list[str]:
        """``[]`` where this latent is ``dims`` (``kv_lora_rank``, ``qk_rope_head_dim``), else the one reason:
        the layer's latent and what ``kernels`` (e.g. ``"aiter's MLA decode kernels"``) exist for."""
        if (self.kv_lora_rank, self.qk_rope_head_dim) == tuple(dims):
            return []
        return [f"MLA kv_lora_rank={self.kv_lora_rank}, qk_rope_head_dim={self.qk_rope_head_dim} ({kernels} exist "
                f"for {dims[0]} + {dims[1]})"]

    def check_weights(self, num_heads: int) -> None:
        """``w_kc`` / ``w_vc`` (where given) have the per-head shapes; a ``ValueError`` naming the field."""
        want = {"w_kc": (num_heads, self.qk_nope_head_dim, self.kv_lora_rank),
                "w_vc": (num_heads, self.kv_lora_rank, self.v_head_dim)}
        for name, shape in want.items():
            w = getattr(self, name)
            if w is None:
                continue
            got = tuple(getattr(w, "shape", ()))
            if got != shape:
                raise ValueError(f"LayerSpec.mla.{name} has shape {got}, expected {shape} "
                                 f"(num_heads, {'qk_nope_head_dim, kv_lora_rank' if name == 'w_kc' else 'kv_lora_rank, v_head_dim'})")


@dataclasses.dataclass(frozen=True, eq=False)
class LayerSpec:
    """One attention layer.

    Shapes used with this layer: ``q`` is ``[tokens, num_heads, head_dim]``,
    ``k`` is ``[tokens, num_kv_heads, head_dim]``, ``v`` is
    ``[tokens, num_kv_heads, v_head_dim]`` and the output is
    ``[tokens, num_heads, v_head_dim]``.

    ``sliding_window``: a query at position ``p`` sees keys at positions
    ``p - sliding_window <= j <= p`` (the "window_left" convention of
    flash-attention and flashinfer: ``sliding_window + 1`` keys at most);
    ``None`` means unlimited. A window of ``NO_WINDOW_FROM`` (2**31 - 1) or more
    covers every position a request can have (kernels take int32 positions) and
    is stored as ``None``, here, once, before any kernel sees it: no kernel or
    library truncates it to 32 bits (a 2**32 window must not become 0). The
    window is an ``int >= 0`` (a bool or a float is refused). ``logit_cap``:
    scores become ``cap * tanh(score / cap)`` after scaling; ``None`` or 0
    disables it; otherwise a finite number > 0 (a negative, NaN or infinite cap
    is refused).
    ``sinks``: one logit per query head (a tensor of ``num_heads`` floats) that
    joins every softmax denominator and contributes no value (gpt-oss style).
    ``is_cross_attention``: queries attend, without a causal mask, to the
    ``encoder_lens[i]`` cached tokens at the start of the request's slots.
    ``causality``: ``"causal"`` (the default: a query at position ``p`` sees
    keys ``j <= p``) or ``"bidirectional"`` (encoders, embedding models: every
    key of its request, cached and new, ``|p - j| <= sliding_window`` with a
    window; a feature backends declare as ``Capabilities.bidirectional``).

    ``mla``: an ``MLASpec`` makes this an MLA layer (docs/mla.md). Then ``num_kv_heads`` must be 1,
    ``head_dim`` the latent row width ``kv_lora_rank + qk_rope_head_dim`` (576 in DeepSeek-V3) and
    ``v_head_dim`` ``kv_lora_rank`` (its default); ``scaling`` defaults to
    ``1/sqrt(qk_nope_head_dim + qk_rope_head_dim)`` (not ``1/sqrt(head_dim)``; a host using YaRN passes
    the mscale² product here), the same in both forms. Sliding window, soft-cap, sinks, cross-attention
    and bidirectional attention are not part of the MLA contract and are refused with it. Shapes per
    form (``ForwardBatch.mla_form``): absorbed: ``q [T, H, head_dim]``, output ``[T, H, kv_lora_rank]``;
    unabsorbed: ``q [T, H, qk_nope + qk_rope]``, output ``[T, H, mla.v_head_dim]``; in both ``k`` is
    the new tokens' latent rows ``[T, 1, head_dim]`` (written to the cache) and ``v`` is ``None``.
    """

    layer_id: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    #: typed as what a built object holds: the default ``None`` (omit the argument) means ``head_dim``,
    #: filled by ``__post_init__``
    v_head_dim: int = None  # type: ignore[assignment]
    #: typed as what a built object holds: the default ``None`` (omit the argument) means
    #: ``1/sqrt(head_dim)``, filled by ``__post_init__``
    scaling: float = None  # type: ignore[assignment]
    logit_cap: float | None = None
    sliding_window: int | None = None
    sinks: torch.Tensor | Sequence[float] | None = None
    is_cross_attention: bool = False
    causality: str = "causal"
    mla: MLASpec | None = None

    def __post_init__(self) -> None:
        for name in ("num_heads", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"LayerSpec.{name}={value!r} (expected a positive integer)")
        if self.mla is not None:
            self._check_mla()
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"LayerSpec.num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.v_head_dim is None:
            object.__setattr__(self, "v_head_dim", self.head_dim)
        if self.scaling is None:
            object.__setattr__(self, "scaling", 1.0 / math.sqrt(self.head_dim))
        w = self.sliding_window
        if w is not None:
            if isinstance(w, bool) or not isinstance(w, numbers.Integral) or w < 0:
                raise ValueError(f"LayerSpec.sliding_window={w!r} (expected an int >= 0, or None for no window)")
            # wider than any position: no window (never truncated to 32 bits)
            object.__setattr__(self, "sliding_window", None if w >= NO_WINDOW_FROM else int(w))
        cap = self.logit_cap
        if cap is not None:
            if isinstance(cap, bool) or not isinstance(cap, numbers.Real) or not (
                    cap == 0 or (cap > 0 and math.isfinite(cap))):
                raise ValueError(f"LayerSpec.logit_cap={cap!r} (expected a finite number > 0, or None / 0 for no "
                                 f"soft-cap)")
        sc = self.scaling
        if isinstance(sc, bool) or not isinstance(sc, numbers.Real) or not math.isfinite(sc):
            raise ValueError(f"LayerSpec.scaling={sc!r} (expected a finite number)")
        if self.sinks is not None and tuple(getattr(self.sinks, "shape", (len(self.sinks),))) != (self.num_heads,):
            raise ValueError(
                f"LayerSpec.sinks has shape {tuple(getattr(self.sinks, 'shape', ()))}, expected ({self.num_heads},)"
            )
        if self.causality not in CAUSALITIES:
            raise ValueError(f"LayerSpec.causality={self.causality!r} (expected one of {', '.join(CAUSALITIES)})")

    def _check_mla(self) -> None:
        m = self.mla
        if not isinstance(m, MLASpec):
            raise ValueError(f"LayerSpec.mla={m!r} (expected an attnplug.layer.MLASpec or None)")
        if self.num_kv_heads != 1:
            raise ValueError(f"LayerSpec.num_kv_heads={self.num_kv_heads} for an MLA layer (expected 1: one latent "
                             f"row per token)")
        if self.head_dim != m.latent_dim:
            raise ValueError(f"LayerSpec.head_dim={self.head_dim} for an MLA layer (expected kv_lora_rank + "
                             f"qk_rope_head_dim = {m.kv_lora_rank} + {m.qk_rope_head_dim} = {m.latent_dim})")
        if self.v_head_dim is None:
            object.__setattr__(self, "v_head_dim", m.kv_lora_rank)
        elif self.v_head_dim != m.kv_lora_rank:
            raise ValueError(f"LayerSpec.v_head_dim={self.v_head_dim} for an MLA layer (expected kv_lora_rank = "
                             f"{m.kv_lora_rank}: the values are the latent row's first kv_lora_rank entries)")
        if self.scaling is None:
            object.__setattr__(self, "scaling", 1.0 / math.sqrt(m.qk_head_dim))
        extras = [name for name, on in (
            ("sliding_window", self.sliding_window is not None and not (
                isinstance(self.sliding_window, int) and self.sliding_window >= NO_WINDOW_FROM)), ("logit_cap", bool(self.logit_cap)),
            ("sinks", self.sinks is not None), ("is_cross_attention", self.is_cross_attention),
            ("causality", self.causality != CAUSAL)) if on]
        if extras:
            raise ValueError(f"LayerSpec.{extras[0]}={getattr(self, extras[0])!r} with an MLA layer (the MLA "
                             f"contract has no {extras[0]}; expected the default)")
        m.check_weights(self.num_heads)

    def query_dim(self, form: str = ABSORBED) -> int:
        """Per-head width of ``q``: ``head_dim``; an MLA layer in the unabsorbed form: nope + rope."""
        return self.mla.qk_head_dim if self.mla is not None and form == UNABSORBED else self.head_dim

    def output_dim(self, form: str = ABSORBED) -> int:
        """Per-head width of the output: ``v_head_dim``; an MLA layer in the unabsorbed form: ``mla.v_head_dim``."""
        return self.mla.v_head_dim if self.mla is not None and form == UNABSORBED else self.v_head_dim

    @property
    def is_mla(self) -> bool:
        """Whether this is an MLA layer (``mla`` set)."""
        return self.mla is not None

    @property
    def uses_bidirectional(self) -> bool:
        return self.causality == BIDIRECTIONAL

    @property
    def gqa_group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def uses_softcap(self) -> bool:
        return bool(self.logit_cap)

    @property
    def uses_sliding_window(self) -> bool:
        return self.sliding_window is not None

    @property
    def uses_sinks(self) -> bool:
        return self.sinks is not None

    def describe(self) -> str:
        """A short description of the layer's shape and features, for errors and logs
        (``"heads 8/2, head_dim 64, sliding window 4095, sinks"``)."""
        if self.mla is not None:
            m = self.mla
            return (f"MLA, heads {self.num_heads}, latent {m.kv_lora_rank}+{m.qk_rope_head_dim}, "
                    f"qk_nope {m.qk_nope_head_dim}, v_head_dim {m.v_head_dim}"
                    + ("" if m.has_weights else ", no w_kc/w_vc (absorbed form only)"))
        parts = [f"heads {self.num_heads}/{self.num_kv_heads}", f"head_dim {self.head_dim}"]
        if self.v_head_dim != self.head_dim:
            parts.append(f"v_head_dim {self.v_head_dim}")
        if self.sliding_window is not None:
            parts.append(f"sliding window {self.sliding_window}")
        if self.logit_cap:
            parts.append(f"soft-cap {self.logit_cap:g}")
        if self.sinks is not None:
            parts.append("sinks")
        if self.uses_bidirectional:
            parts.append("bidirectional")
        return ", ".join(parts)
