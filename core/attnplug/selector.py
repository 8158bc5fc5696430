"""The one rule that says which half of the pair serves a forward.

``HybridBackend`` and model-facing dispatch both call these functions; no
other mode-to-half table exists anywhere (a test checks).
"""

from __future__ import annotations

from typing import Literal, Protocol

from .config import AttentionConfig
from .modes import ForwardMode

__all__ = ["backend_name_for_mode", "half_for_mode"]

Half = Literal["prefill", "decode"]


class _Stamped(Protocol):
    prefill_attention_backend_str: str | None
    decode_attention_backend_str: str | None


def half_for_mode(mode: ForwardMode, speculative_attention_mode: str = "prefill") -> Half:
    """Decode and idle -> decode; target-verify and draft-extend-v2 -> the half
    named by ``speculative_attention_mode``; everything else -> prefill."""
    if mode is ForwardMode.DECODE or mode is ForwardMode.IDLE:
        return "decode"
    if mode is ForwardMode.TARGET_VERIFY or mode is ForwardMode.DRAFT_EXTEND_V2:
        return "decode" if speculative_attention_mode == "decode" else "prefill"
    return "prefill"


def backend_name_for_mode(
    mode: ForwardMode,
    config: AttentionConfig,
    backend: _Stamped | None = None,
) -> str | None:
    """The kernel name serving ``mode``.

    Prefers the stamp on ``backend`` (the backend serving this forward) and
    falls back to the configured pair only when that half is unstamped.
    """
    half = half_for_mode(mode, config.speculative_attention_mode)
    if backend is not None:
        stamp = (
            backend.decode_attention_backend_str if half == "decode" else backend.prefill_attention_backend_str
        )
        if stamp is not None:
            return stamp
    prefill, decode = config.attention_backends()
    return decode if half == "decode" else prefill
