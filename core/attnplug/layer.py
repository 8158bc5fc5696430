"""Description of one attention layer, as the engine's model code knows it."""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: importing this module loads no torch
    import torch


#: ``LayerSpec.causality`` values: causal (the default) and bidirectional (non-causal self-attention).
CAUSAL = "causal"
BIDIRECTIONAL = "bidirectional"
CAUSALITIES: tuple[str, ...] = (CAUSAL, BIDIRECTIONAL)
#: a sliding window this wide or wider is no window (``LayerSpec`` stores ``None``): positions are int32
NO_WINDOW_FROM = 2 ** 31 - 1


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

    def __post_init__(self) -> None:
        for name in ("num_heads", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"LayerSpec.{name}={value!r} (expected a positive integer)")
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
