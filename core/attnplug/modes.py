"""Forward modes of one forward pass and their predicates."""

from __future__ import annotations

import enum


class ForwardMode(enum.Enum):
    """What kind of forward pass a batch is.

    ``EXTEND``: prefill, possibly on top of a cached prefix. ``DECODE``: one new
    token per request. ``MIXED``: extends and decodes in one batch (served as an
    extend). ``IDLE``: zero tokens on this rank. ``TARGET_VERIFY``: the target
    model scores draft tokens. ``DRAFT_EXTEND`` / ``DRAFT_EXTEND_V2``: the draft
    model extends over accepted tokens.
    """

    EXTEND = "extend"
    DECODE = "decode"
    MIXED = "mixed"
    IDLE = "idle"
    TARGET_VERIFY = "target_verify"
    DRAFT_EXTEND = "draft_extend"
    DRAFT_EXTEND_V2 = "draft_extend_v2"

    def is_extend(self) -> bool:
        """True for every mode that runs extend-shaped attention (variable query lengths)."""
        return self in _EXTEND_LIKE

    def is_decode(self) -> bool:
        """DECODE."""
        return self is ForwardMode.DECODE

    def is_idle(self) -> bool:
        """IDLE (no tokens on this rank)."""
        return self is ForwardMode.IDLE

    def is_decode_or_idle(self) -> bool:
        """DECODE or IDLE: served by the decode half."""
        return self is ForwardMode.DECODE or self is ForwardMode.IDLE

    def is_mixed(self) -> bool:
        """MIXED (prefills and decodes in one extend-shaped batch)."""
        return self is ForwardMode.MIXED

    def is_target_verify(self) -> bool:
        """TARGET_VERIFY."""
        return self is ForwardMode.TARGET_VERIFY

    def is_draft_extend(self, include_v2: bool = True) -> bool:
        """DRAFT_EXTEND or DRAFT_EXTEND_V2."""
        if include_v2:
            return self is ForwardMode.DRAFT_EXTEND or self is ForwardMode.DRAFT_EXTEND_V2
        return self is ForwardMode.DRAFT_EXTEND

    def is_speculative(self) -> bool:
        """Target-verify or any draft-extend."""
        return self in _SPECULATIVE

    @classmethod
    def parse(cls, value: "str | ForwardMode") -> "ForwardMode":
        if isinstance(value, ForwardMode):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            names = ", ".join(m.value for m in cls)
            raise ValueError(f"unknown forward mode {value!r} (expected one of: {names})") from None


_EXTEND_LIKE = frozenset(
    {
        ForwardMode.EXTEND,
        ForwardMode.MIXED,
        ForwardMode.TARGET_VERIFY,
        ForwardMode.DRAFT_EXTEND,
        ForwardMode.DRAFT_EXTEND_V2,
    }
)
_SPECULATIVE = frozenset({ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND, ForwardMode.DRAFT_EXTEND_V2})
