"""The registered passes of the resolution chain and their provenance records.

A pass is data plus a function: ``Pass(name, fields, run)``. ``run(state)``
returns the declarations it makes, each ``Declaration(source, rule, fields)``;
the chain (``chain.py``) applies them in order, last writer wins, and records
every one as a ``Record`` -- what was declared, what was applied, and what was
overruled because the user pinned it.

The core passes hold no architecture or hardware knowledge: per-architecture
overrides and forcing/fallback rules arrive from plugins through the
``attnplug_arch_overrides`` and ``attnplug_resolution_rules`` hooks, and the
platform default comes from the priorities plugins declare per host.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Sequence

from ..capabilities import host_layer_reasons, layer_reasons, mla_reasons, support_reasons
from ..config import AttentionConfig
from ..dtypes import kv_dtype_name
from ..errors import PluginError
from ..hookspecs import RegisterArchOverride, RegisterResolutionRule
from ..host import HostInfo
from ..isolation import call_plugin, echo_output
from ..layer import LayerSpec
from ..modes import ForwardMode
from ..selector import half_for_mode

if TYPE_CHECKING:
    from ..registry import Registry

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


# -- collecting plugin declarations ---------------------------------------
def _doc_line(fn: Any) -> str:
    doc = (getattr(fn, "__doc__", None) or "").strip()
    return doc.splitlines()[0] if doc else ""


def collect_arch_overrides(registry: "Registry") -> list[ArchOverride]:
    """Every per-architecture override the loaded plugins declare, in application order."""
    found: list[ArchOverride] = []

    def bound(dist: str) -> dict[str, RegisterArchOverride]:
        def register(arch: str | Iterable[str], rule: Any, *, name: str | None = None,
                     precedence: int = 0, description: str | None = None) -> None:
            archs = (arch,) if isinstance(arch, str) else tuple(arch) if isinstance(arch, (list, tuple)) else ()
            if not archs or not all(isinstance(a, str) and a for a in archs):
                raise PluginError(dist, f"attnplug_arch_overrides: arch must be a name or names, got {arch!r}")
            if not callable(rule):
                raise PluginError(dist, f"attnplug_arch_overrides: rule for {archs} is not callable")
            if not isinstance(precedence, int) or isinstance(precedence, bool):
                raise PluginError(dist, f"attnplug_arch_overrides: precedence={precedence!r} must be an int")
            label = name or getattr(rule, "__name__", "rule")
            found.append(ArchOverride(archs, rule, dist, str(label), precedence,
                                      description if description is not None else _doc_line(rule), len(found)))

        return {"register": register}

    registry.call_hook("attnplug_arch_overrides", per_plugin=bound)
    return sorted(found, key=lambda o: (o.precedence, o.distribution, o.index))


def collect_resolution_rules(registry: "Registry") -> list[ResolutionRule]:
    """Every forcing/fallback rule the loaded plugins declare, by stage, distribution, order."""
    found: list[ResolutionRule] = []

    def bound(dist: str) -> dict[str, RegisterResolutionRule]:
        def register(name: str, stage: str, rule: Any, *, description: str | None = None) -> None:
            if stage not in STAGES:
                raise PluginError(dist, f"resolution rule {name!r}: stage={stage!r} (expected one of {STAGES})")
            if not callable(rule):
                raise PluginError(dist, f"resolution rule {name!r} is not callable")
            found.append(ResolutionRule(str(name), stage, rule, dist,
                                        description if description is not None else _doc_line(rule), len(found)))

        return {"register": register}

    registry.call_hook("attnplug_resolution_rules", per_plugin=bound)
    return sorted(found, key=lambda r: (STAGES.index(r.stage), r.distribution, r.index))


# -- what serves a configuration ------------------------------------------
def speculative_enabled(config: AttentionConfig) -> bool:
    """Speculative decoding is on when a draft backend or ``extra["speculative_algorithm"]`` is set."""
    return config.speculative_draft_attention_backend is not None or bool(config.extra.get("speculative_algorithm"))


def support_problems(registry: "Registry", name: str, config: AttentionConfig, half: str,
                     layers: Sequence[LayerSpec] = ()) -> list[str]:
    """Why backend ``name`` cannot serve ``half`` of ``config`` (capabilities only; and the model's
    attention ``layers`` when the host gives them); empty when it can."""
    caps = registry.get(name).capabilities
    reasons = support_reasons(
        caps, dtype=config.dtype, kv_cache_dtype=kv_dtype_name(config.kv_cache_dtype, config.dtype),
        page_size=config.page_size,
        kv_layout=config.kv_layout, cuda_graph=config.cuda_graph, deterministic=config.deterministic,
    )
    if speculative_enabled(config):
        for mode in (ForwardMode.TARGET_VERIFY,):
            if half_for_mode(mode, config.speculative_attention_mode) == half:
                reasons.extend(support_reasons(caps, mode=mode))
    # an MLA layer runs in both halves' mode kinds: the decode half needs a decode form, the prefill half
    # an extend form (and target-verify, in whichever half serves it, an extend form)
    mla_kinds = ["decode"] if half == "decode" else ["extend"]
    if speculative_enabled(config) and "extend" not in mla_kinds and \
            half_for_mode(ForwardMode.TARGET_VERIFY, config.speculative_attention_mode) == half:
        mla_kinds.append("extend")
    for layer in layers:
        layer_kind = (mla_reasons(caps, mla_kinds, None, name)
                      if getattr(layer, "mla", None) is not None and caps.mla else [])
        for reason in layer_reasons(caps, layer, backend=name) + layer_kind:
            text = f"layer {layer.layer_id}: {reason}"
            if not any(r.endswith(reason) for r in reasons):  # one line per reason, naming its first layer
                reasons.append(text)
    return reasons


def serve_problems(registry: "Registry", host: HostInfo, name: str, config: AttentionConfig, half: str,
                   layers: Sequence[LayerSpec] = ()) -> list[str]:
    """Availability on ``host`` plus support for ``half`` of ``config`` (and ``layers``); empty when ``name``
    serves it."""
    avail = registry.availability(name, host)
    caps = registry.get(name).capabilities
    host_only = list(dict.fromkeys(f"layer {layer.layer_id}: {r}" for layer in layers
                                   for r in host_layer_reasons(caps, layer, host)))
    return list(avail.reasons) + support_problems(registry, name, config, half, layers) + host_only[:1]


def ranked(registry: "Registry", host: HostInfo) -> list[tuple[str, int]]:
    """Backends with a default priority on ``host``, best first (ties by name)."""
    out = []
    for name in registry.names():
        prio = registry.priority(name, host)
        if prio is not None:
            out.append((name, int(prio)))
    return sorted(out, key=lambda x: (-x[1], x[0]))


def best_for(registry: "Registry", host: HostInfo, config: AttentionConfig, half: str,
             exclude: Iterable[str] = (), layers: Sequence[LayerSpec] = ()) -> str | None:
    """The highest-priority backend that is available on ``host`` and supports ``half`` of ``config``."""
    skip = set(exclude)
    for name, _ in ranked(registry, host):
        if name not in skip and not serve_problems(registry, host, name, config, half, layers):
            return name
    return None


def half_declaration(config: AttentionConfig, wanted: Mapping[str, str]) -> dict[str, Any]:
    """The fields that set the halves in ``wanted``.

    Halves that follow the base field (their own field unset) move through the
    base field when they all move to one backend; every other half through its
    own field. The base field is never read: a half follows it exactly when its
    own field is ``None``.
    """
    own = {"prefill": config.prefill_attention_backend, "decode": config.decode_attention_backend}
    via_base = [h for h in HALVES if own[h] is None]
    if via_base and all(h in wanted for h in via_base) and len({wanted[h] for h in via_base}) == 1:
        fields: dict[str, Any] = {BASE_FIELD: wanted[via_base[0]]}
        fields.update({HALF_FIELDS[h]: wanted[h] for h in HALVES if h in wanted and h not in via_base})
        return fields
    return {HALF_FIELDS[h]: wanted[h] for h in HALVES if h in wanted}


# -- the passes --------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class State:
    """What a pass sees: the configuration so far and the inputs (read-only)."""

    config: AttentionConfig
    arch: str | None
    host: HostInfo
    registry: "Registry"
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


def _call_rule(source: str, label: str, fn: Callable[[], Any]) -> dict[str, Any]:
    if source == CORE:
        out = fn()
    else:
        out, printed = call_plugin(source, f"resolution rule {label!r}", fn)
        echo_output(source, f"resolution rule {label!r}", printed)
    if out is None:
        return {}
    if not isinstance(out, Mapping):
        raise PluginError(source, f"resolution rule {label!r} returned {out!r}; it must return a dict of fields")
    return dict(out)


def run_arch_overrides(state: State) -> list[Declaration]:
    if state.arch is None:
        return []
    out = []
    for o in state.overrides:
        if state.arch not in o.archs:
            continue
        label = f"{state.arch}: {o.name}"
        fields = _call_rule(o.distribution, label, lambda o=o: o.rule(state.host, state.config))
        if fields:
            out.append(Declaration(o.distribution, label, fields))
    return out


def _run_stage(stage: str) -> Callable[[State], list[Declaration]]:
    def run(state: State) -> list[Declaration]:
        out = []
        for r in state.rules:
            if r.stage != stage:
                continue
            fields = _call_rule(r.distribution, r.name,
                                lambda r=r: r.rule(state.host, state.config, state.registry))
            if fields:
                out.append(Declaration(r.distribution, r.name, fields))
        return out

    run.__name__ = f"run_{stage}_rules"
    return run


def run_default_fill(state: State) -> list[Declaration]:
    """Fill every half that is unset or ``auto`` with the best backend by priority that serves it."""
    pair = dict(zip(HALVES, state.config.attention_backends()))
    wanted: dict[str, str] = {}
    for half in HALVES:
        if pair[half] is None or pair[half] == AUTO:
            best = best_for(state.registry, state.host, state.config, half, layers=state.layers)
            if best is not None:
                wanted[half] = best
    if not wanted:
        return []
    fields = half_declaration(state.config, wanted)
    rule = "; ".join(f"{h}: {n} (priority {state.registry.priority(n, state.host)})"
                     for h, n in wanted.items())
    return [Declaration(CORE, f"highest priority serving this configuration on {state.host.platform}: {rule}",
                        fields)]


def run_compat_fallback(state: State) -> list[Declaration]:
    """Replace a half chosen by a pass that cannot serve here by the next backend by priority."""
    pair = dict(zip(HALVES, state.config.attention_backends()))
    wanted: dict[str, str] = {}
    why: list[str] = []
    for half in HALVES:
        name = pair[half]
        if name is None or name == AUTO or half in state.pinned_halves:
            continue  # unfilled halves and the user's choices are for the checks
        problems = serve_problems(state.registry, state.host, name, state.config, half, state.layers)
        if not problems:
            continue
        best = best_for(state.registry, state.host, state.config, half, exclude=(name,), layers=state.layers)
        if best is not None:
            wanted[half] = best
            why.append(f"{half} half {name!r} cannot serve here ({'; '.join(problems)}); next by priority: {best}")
    if not wanted:
        return []
    return [Declaration(CORE, " / ".join(why), half_declaration(state.config, wanted))]


def shared_layouts(registry: "Registry", prefill: str, decode: str) -> list[str]:
    """KV layouts both backends read, defined by the core or an installed plugin; the decode half's
    preference first (decode reads the whole cache every step), then the prefill half's, then the rest."""
    cp, cd = registry.get(prefill).capabilities, registry.get(decode).capabilities
    known = registry.layout_names()
    order = list(cd.kv_layouts or ()) + list(cp.kv_layouts or ()) + list(known)
    return [x for x in dict.fromkeys(order) if x in known and cp.reads_layout(x) and cd.reads_layout(x)]


def layout_words(registry: "Registry", name: str) -> str:
    """``"<name> reads nhd, hnd"``: the layouts a backend declares, for explanations and errors."""
    return f"{name} reads {registry.get(name).capabilities.layouts_text()}"


def run_kv_layout(state: State) -> list[Declaration]:
    """One cache serves both halves: pick the first KV layout both read, or replace a half the user
    did not choose by the best backend that shares a layout with the other half."""
    reg, cfg = state.registry, state.config
    pair = dict(zip(HALVES, cfg.attention_backends()))
    if cfg.kv_layout is not None or any(n is None or n == AUTO or n not in reg.descriptors for n in pair.values()):
        return []  # the user's layout (or an unfilled half) is for the checks
    p, d = pair["prefill"], pair["decode"]
    shared = shared_layouts(reg, p, d)
    if shared:
        return [Declaration(CORE, f"one cache serves both halves ({layout_words(reg, p)}; {layout_words(reg, d)}): "
                            f"first shared layout {shared[0]}", {"kv_layout": shared[0]})]
    for half in ("prefill", "decode"):  # keep the decode half when neither was the user's choice
        if half in state.pinned_halves:
            continue
        other = pair["decode" if half == "prefill" else "prefill"]
        for name, _ in ranked(reg, state.host):
            if name == pair[half] or serve_problems(reg, state.host, name, cfg, half, state.layers):
                continue
            both = shared_layouts(reg, *((name, other) if half == "prefill" else (other, name)))
            if both:
                fields = half_declaration(cfg, {half: name})
                fields["kv_layout"] = both[0]
                return [Declaration(CORE, f"{layout_words(reg, pair[half])} but {layout_words(reg, other)}: the "
                                    f"{half} half moves to {name}, the best backend sharing layout {both[0]}",
                                    fields)]
    return []


#: The chain, in order. Plugins extend it through hooks, not by adding passes.
DEFAULT_PASSES: tuple[Pass, ...] = (
    Pass("arch_overrides", None, run_arch_overrides,
         description="per-architecture overrides declared by plugins (attnplug_arch_overrides)"),
    Pass("force_rules", None, _run_stage("force"),
         description="mode rules that force a backend or feature (attnplug_resolution_rules, stage 'force')"),
    Pass("default_fill", PAIR_FIELDS, run_default_fill, fills_auto=True,
         description="highest-priority backend available here that supports the configuration"),
    Pass("compat_fallback", PAIR_FIELDS, run_compat_fallback,
         description="a backend chosen by a pass that cannot serve here falls back to the next by priority"),
    Pass("fallback_rules", None, _run_stage("fallback"),
         description="compatibility rules declared by plugins (attnplug_resolution_rules, stage 'fallback')"),
    Pass("kv_layout", PAIR_FIELDS | {"kv_layout"}, run_kv_layout,
         description="one KV cache serves both halves: the first layout both read (kvlayout.py)"),
)


def _plain(mapping: Mapping[str, Any]) -> dict[str, Any]:
    return {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in mapping.items()}
