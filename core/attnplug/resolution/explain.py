"""A resolution and its explanation: ``Resolution``/``Candidate`` (the result the chain
returns), text for people, a dict for ``--json``.

Imports only ``vocabulary`` (never ``chain``): the chain builds a ``Resolution``;
this module reads one.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from ..config import AttentionConfig
from ..host import HostInfo
from .vocabulary import HALVES, PAIR_FIELDS, ArchOverride, Record, ResolutionRule


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One registered backend as resolution saw it on this host."""

    name: str
    distribution: str
    version: str
    priority: int | None
    available: bool
    #: half -> why it cannot serve that half (availability and support); empty when it can
    problems: Mapping[str, tuple[str, ...]]
    floor_problem: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "distribution": self.distribution, "version": self.version,
                "priority": self.priority, "available": self.available,
                "problems": {h: list(p) for h, p in self.problems.items()}, "floor_problem": self.floor_problem}


@dataclasses.dataclass(frozen=True)
class Resolution:
    """The resolved configuration and how it came to be.

    ``records`` are every declaration in order (``Record.as_tuple()`` is
    ``(pass name, source distribution, {field: value})``); ``pinned`` the
    fields the user set (canonical names; ``auto`` as given); ``error`` the exception when resolution failed
    (``trace`` only; ``resolve`` raises it).
    """

    config: AttentionConfig
    user_config: AttentionConfig
    arch: str | None
    host: HostInfo
    records: tuple[Record, ...]
    pinned: Mapping[str, Any]
    passes: tuple[tuple[str, str], ...]
    candidates: tuple[Candidate, ...] = ()
    conflicts: Mapping[str, str] = dataclasses.field(default_factory=dict)
    error: BaseException | None = None
    #: distribution -> why: plugins whose resolution hook broke the contract during this resolution
    #: (raised, or answered with a malformed value); set aside, and the chain ran again without them
    set_aside: Mapping[str, str] = dataclasses.field(default_factory=dict)

    @property
    def pair(self) -> tuple[str | None, str | None]:
        return self.config.attention_backends()

    @property
    def ok(self) -> bool:
        return self.error is None

    def overruled(self) -> list[tuple[Record, str, Any, str]]:
        """``(record, field, declared value, reason)`` for every declaration the user's choices overruled."""
        return [(r, f, r.declared.get(f), why) for r in self.records for f, why in r.overruled.items()]

    def rejected(self) -> dict[str, list[str]]:
        """Every registered backend not in the resolved pair, with the reasons it was not chosen."""
        return rejected_reasons(self)

    def to_dict(self) -> dict[str, Any]:
        return to_dict(self)

    def explain(self) -> str:
        return explain_text(self)




def rejected_reasons(res: "Resolution") -> dict[str, list[str]]:
    """Every registered backend not in the resolved pair -> why it was not chosen."""
    pair = dict(zip(HALVES, res.pair)) if res.ok else {}
    chosen = set(pair.values())
    out: dict[str, list[str]] = {}
    for c in res.candidates:
        if c.name in chosen:
            continue
        reasons: list[str] = []
        by_half = {h: list(c.problems.get(h, ())) for h in HALVES}
        common = [p for p in by_half["prefill"] if p in by_half["decode"]]
        reasons.extend(common)
        for h in HALVES:
            reasons.extend(f"{h} half: {p}" for p in by_half[h] if p not in common)
        if c.floor_problem:
            reasons.append(c.floor_problem)
        if not reasons:
            if c.priority is None:
                reasons.append(f"serves this configuration, but declares no default priority on {res.host.platform}")
            elif pair:
                beat = ", ".join(f"{h}: {n}" for h, n in pair.items())
                reasons.append(f"serves this configuration (priority {c.priority}); not chosen ({beat})")
            else:
                reasons.append(f"serves this configuration (priority {c.priority})")
        out[c.name] = reasons
    for name, msg in res.conflicts.items():
        out.setdefault(name, []).append(msg)
    return out


def to_dict(res: "Resolution") -> dict[str, Any]:
    prefill, decode = res.pair
    return {
        "ok": res.ok,
        "error": None if res.error is None else f"{type(res.error).__name__}: {res.error}",
        "arch": res.arch,
        "host": res.host.to_dict(),
        "pair": {"prefill": prefill, "decode": decode},
        "config": res.config.to_dict(),
        "user_config": res.user_config.to_dict(),
        "pinned": dict(res.pinned),
        "passes": [{"name": n, "description": d} for n, d in res.passes],
        "records": [r.to_dict() for r in res.records],
        "overruled": [{"pass": r.pass_name, "source": r.source, "field": f, "value": v, "reason": why}
                      for r, f, v, why in res.overruled()],
        "candidates": [c.to_dict() for c in res.candidates],
        "rejected": rejected_reasons(res),
        "set_aside": dict(res.set_aside),
    }


def _fields(d: Any) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in d.items()) or "-"


def explain_text(res: "Resolution") -> str:
    lines = [f"host: {res.host.describe()}", f"arch: {res.arch or '(none given)'}"]
    prefill, decode = res.pair
    if res.ok:
        lines.append(f"resolved pair: prefill={prefill} decode={decode}")
    else:
        lines.append(f"resolution FAILED: {type(res.error).__name__}: {res.error}")
        lines.append(f"pair so far: prefill={prefill} decode={decode}")
    for dist, why in res.set_aside.items():
        lines.append(f"plugin {dist} set aside (its resolution hook broke the contract; resolved without it): {why}")
    lines.append("")
    lines.append("pinned (set by you; no pass may change them): " + _fields(res.pinned))
    lines.append("")
    lines.append("passes, in order (a later writer wins):")
    by_pass: dict[str, list[Any]] = {}
    for r in res.records:
        by_pass.setdefault(r.pass_name, []).append(r)
    for r in by_pass.get("user", []):
        lines.append(f"  0. user: {_fields(r.declared)}  ({r.rule})")
        if r.applied != r.declared:
            lines.append(f"       as canonical names: {_fields(r.applied)}")
    for i, (name, desc) in enumerate(res.passes, 1):
        lines.append(f"  {i}. {name}: {desc}")
        recs = by_pass.get(name, [])
        if not recs:
            lines.append("       (no declarations)")
        for r in recs:
            lines.append(f"       [{r.source}] {r.rule}")
            lines.append(f"         declared {_fields(r.declared)}")
            if r.applied != r.declared:
                lines.append(f"         applied  {_fields(r.applied)}")
            for f, why in r.overruled.items():
                lines.append(f"         overruled {f}={r.declared.get(f)!r}: {why}")
            if any(f in PAIR_FIELDS for f in r.applied):
                lines.append(f"         pair now: prefill={r.pair[0]} decode={r.pair[1]}")
    over = res.overruled()
    lines.append("")
    lines.append("overruled declarations:" + (" none" if not over else ""))
    for r, f, v, why in over:
        lines.append(f"  {r.pass_name} [{r.source}] {f}={v!r}: {why}")
    lines.append("")
    lines.append("rejected backends:")
    rejected = rejected_reasons(res)
    if not rejected:
        lines.append("  none")
    for name, reasons in rejected.items():
        cand = next((c for c in res.candidates if c.name == name), None)
        where = f" ({cand.distribution} {cand.version})" if cand else ""
        lines.append(f"  {name}{where}: " + "; ".join(reasons))
    return "\n".join(lines)


def overrides_table(overrides: list[ArchOverride], rules: list[ResolutionRule]) -> str:
    lines = ["per-architecture overrides (applied in this order; the last writer wins):"]
    if not overrides:
        lines.append("  none declared by the installed plugins")
    for o in overrides:
        desc = f" -- {o.description}" if o.description else ""
        lines.append(f"  {', '.join(o.archs)}: {o.name} [{o.distribution}] precedence={o.precedence}{desc}")
    lines.append("resolution rules:")
    if not rules:
        lines.append("  none declared by the installed plugins")
    for r in rules:
        desc = f" -- {r.description}" if r.description else ""
        lines.append(f"  {r.stage}: {r.name} [{r.distribution}]{desc}")
    return "\n".join(lines)
