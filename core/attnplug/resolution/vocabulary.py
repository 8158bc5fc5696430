"""Resolution's vocabulary: the names, fields and records every part of the chain speaks.

``AUTO``/``CORE``/``USER``, the halves and the configuration fields a pass may declare; what a plugin
declares (``ArchOverride``, ``ResolutionRule``), what a pass returns (``Declaration``) and what the
chain records (``Record``); a pass (``Pass``) and what it sees (``State``). Data only: this module
calls nothing and imports no registry, descriptor or isolation.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, Mapping

from ..config import AttentionConfig
from ..host import HostInfo
from ..layer import LayerSpec

if TYPE_CHECKING:
    from ..hostview import HostView

#: The user's explicit "pick by priority" (the default fill), accepted for any backend field.
AUTO = "auto"
#: The distribution name recorded for the core's own passes.
CORE = "attnplug"
#: The source recorded for the user's own choices.
USER = "user"

HALVES: tuple[str, str] = ("prefill", "decode")
#: Half -> the config field naming only that half. The base field is never read outside config.py.
HALF_FIELDS: dict[str, str] = {"prefill": "prefill_attention_backend", "decode": "decode_attention_backend"}
BASE_FIELD = "attention_backend"  # used only as a dict-literal key / keyword below, never to read
CONFIG_FIELDS: frozenset[str] = frozenset(f.name for f in dataclasses.fields(AttentionConfig))
PAIR_FIELDS: frozenset[str] = frozenset({BASE_FIELD, *HALF_FIELDS.values()})
DRAFT_FIELD = "speculative_draft_attention_backend"
STAGES: tuple[str, ...] = ("force", "fallback")


@dataclasses.dataclass(frozen=True)
class Record:
    """One declaration, as recorded: ``(pass_name, source, declared)`` plus its outcome.

    ``source`` is the distribution that declared it (``"attnplug"`` for the
    core's passes, ``"user"`` for the user's choices). ``applied`` holds the
    fields that took effect (canonical names); ``overruled`` maps each field
    that did not to the reason (the user pinned it).
    """

    pass_name: str
    source: str
    declared: Mapping[str, Any]
    applied: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    overruled: Mapping[str, str] = dataclasses.field(default_factory=dict)
    rule: str = ""
    #: the (prefill, decode) pair after this declaration was applied
    pair: tuple[str | None, str | None] = (None, None)

    def as_tuple(self) -> tuple[str, str, dict[str, Any]]:
        return (self.pass_name, self.source, dict(self.declared))

    def to_dict(self) -> dict[str, Any]:
        return {"pass": self.pass_name, "source": self.source, "rule": self.rule,
                "declared": _plain(self.declared), "applied": _plain(self.applied),
                "overruled": dict(self.overruled), "pair": list(self.pair)}


@dataclasses.dataclass(frozen=True)
class Declaration:
    """What one rule of a pass declares: ``fields`` from ``source`` (a distribution)."""

    source: str
    rule: str
    fields: Mapping[str, Any]


@dataclasses.dataclass(frozen=True)
class ArchOverride:
    """A per-architecture override a plugin declared with ``register(arch, rule)``.

    Overrides run in ascending ``precedence``, then by distribution, then in
    registration order; the last writer wins, so a family's catch-all
    preference registers with a lower precedence than the specific ones.
    """

    archs: tuple[str, ...]
    rule: Callable[[HostInfo, AttentionConfig], Mapping[str, Any] | None]
    distribution: str
    name: str
    precedence: int = 0
    description: str = ""
    index: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"archs": list(self.archs), "distribution": self.distribution, "name": self.name,
                "precedence": self.precedence, "description": self.description}


@dataclasses.dataclass(frozen=True)
class ResolutionRule:
    """A forcing or compatibility-fallback rule from ``attnplug_resolution_rules``."""

    name: str
    stage: str
    rule: Callable[..., Mapping[str, Any] | None]
    distribution: str
    description: str = ""
    index: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "stage": self.stage, "distribution": self.distribution,
                "description": self.description}


# -- the passes --------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class State:
    """What a pass sees: the configuration so far and the inputs (read-only)."""

    config: AttentionConfig
    arch: str | None
    host: HostInfo
    #: the frozen per-host view: names, descriptors, availability and priority on ``host``
    view: "HostView"
    #: half -> the backend the user chose for it ("auto" until the default fill runs)
    pinned_halves: Mapping[str, str]
    overrides: tuple[ArchOverride, ...]
    rules: tuple[ResolutionRule, ...]
    #: the model's attention layers, when the host gave them (``resolve(..., layers=)``)
    layers: tuple[LayerSpec, ...] = ()


@dataclasses.dataclass(frozen=True)
class Pass:
    """A registered pass: its name, the fields it may declare (``None``: any config field),
    whether it may replace the user's ``auto``, and its function."""

    name: str
    fields: frozenset[str] | None
    run: Callable[[State], list[Declaration]]
    fills_auto: bool = False
    description: str = ""


def _plain(mapping: Mapping[str, Any]) -> dict[str, Any]:
    return {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in mapping.items()}
