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

import functools
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Sequence, cast

from .. import support
from ..config import AttentionConfig
from ..errors import PluginError
from ..layer import LayerSpec
from ..support import SupportQuery
from .vocabulary import AUTO, BASE_FIELD, CORE, HALF_FIELDS, HALVES, PAIR_FIELDS, Declaration, Pass, State

if TYPE_CHECKING:
    from ..hostview import HostView


# -- what serves a configuration ------------------------------------------
def speculative_enabled(config: AttentionConfig) -> bool:
    """Speculative decoding is on when a draft backend or ``extra["speculative_algorithm"]`` is set."""
    return config.speculative_draft_attention_backend is not None or bool(config.extra.get("speculative_algorithm"))


def support_problems(view: Any, name: str, config: AttentionConfig, half: str,
                     layers: Sequence[LayerSpec] = ()) -> list[str]:
    """Why backend ``name`` cannot serve ``half`` of ``config`` (capabilities only; and the model's
    attention ``layers`` when the host gives them); empty when it can. The support query's answer."""
    query = SupportQuery.from_config(config, half, tuple(layers)).replace(backend=name)
    return support.reasons(query, view.get(name).capabilities)


def serve_problems(view: "HostView", name: str, config: AttentionConfig, half: str,
                   layers: Sequence[LayerSpec] = ()) -> list[str]:
    """Availability on the view's host plus support for ``half`` of ``config`` (and ``layers``, on this
    host); empty when ``name`` serves it."""
    caps = view.get(name).capabilities
    query = SupportQuery.from_config(config, half, tuple(layers), host=view.host).replace(backend=name)
    return list(view.backends[name].availability.reasons) + support.reasons(query, caps)


def best_for(view: "HostView", config: AttentionConfig, half: str,
             exclude: Iterable[str] = (), layers: Sequence[LayerSpec] = ()) -> str | None:
    """The highest-priority backend that is available on the view's host and supports ``half`` of ``config``."""
    skip = set(exclude)
    for name, _ in view.ranked():
        if name not in skip and not serve_problems(view, name, config, half, layers):
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


def _call_rule(view: "HostView", source: str, label: str, fn: Callable[[], Any]) -> dict[str, Any]:
    out = fn() if source == CORE else view.run_rule(source, f"resolution rule {label!r}", fn)
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
        fields = _call_rule(state.view, o.distribution, label, functools.partial(o.rule, state.host, state.config))
        if fields:
            out.append(Declaration(o.distribution, label, fields))
    return out


def _run_stage(stage: str) -> Callable[[State], list[Declaration]]:
    def run(state: State) -> list[Declaration]:
        out = []
        for r in state.rules:
            if r.stage != stage:
                continue
            fields = _call_rule(state.view, r.distribution, r.name,
                                functools.partial(r.rule, state.host, state.config, state.view))
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
            best = best_for(state.view, state.config, half, layers=state.layers)
            if best is not None:
                wanted[half] = best
    if not wanted:
        return []
    fields = half_declaration(state.config, wanted)
    rule = "; ".join(f"{h}: {n} (priority {state.view.priority(n)})"
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
        problems = serve_problems(state.view, name, state.config, half, state.layers)
        if not problems:
            continue
        best = best_for(state.view, state.config, half, exclude=(name,), layers=state.layers)
        if best is not None:
            wanted[half] = best
            why.append(f"{half} half {name!r} cannot serve here ({'; '.join(problems)}); next by priority: {best}")
    if not wanted:
        return []
    return [Declaration(CORE, " / ".join(why), half_declaration(state.config, wanted))]


def shared_layouts(view: "HostView", prefill: str, decode: str) -> list[str]:
    """KV layouts both backends read, defined by the core or an installed plugin; the decode half's
    preference first (decode reads the whole cache every step), then the prefill half's, then the rest."""
    cp, cd = view.get(prefill).capabilities, view.get(decode).capabilities
    known = view.layout_names()
    order = list(cd.kv_layouts or ()) + list(cp.kv_layouts or ()) + list(known)
    return [x for x in dict.fromkeys(order) if x in known and cp.reads_layout(x) and cd.reads_layout(x)]


def layout_words(view: "HostView", name: str) -> str:
    """``"<name> reads nhd, hnd"``: the layouts a backend declares, for explanations and errors."""
    return f"{name} reads {view.get(name).capabilities.layouts_text()}"


def run_kv_layout(state: State) -> list[Declaration]:
    """One cache serves both halves: pick the first KV layout both read, or replace a half the user
    did not choose by the best backend that shares a layout with the other half."""
    reg, cfg = state.view, state.config
    pair = dict(zip(HALVES, cfg.attention_backends()))
    if cfg.kv_layout is not None or any(n is None or n == AUTO or n not in reg.backends for n in pair.values()):
        return []  # the user's layout (or an unfilled half) is for the checks
    p, d = cast(str, pair["prefill"]), cast(str, pair["decode"])  # both filled and registered (above)
    shared = shared_layouts(reg, p, d)
    if shared:
        return [Declaration(CORE, f"one cache serves both halves ({layout_words(reg, p)}; {layout_words(reg, d)}): "
                            f"first shared layout {shared[0]}", {"kv_layout": shared[0]})]
    for half in ("prefill", "decode"):  # keep the decode half when neither was the user's choice
        if half in state.pinned_halves:
            continue
        other = pair["decode" if half == "prefill" else "prefill"]
        for name, _ in reg.ranked():
            if name == pair[half] or serve_problems(reg, name, cfg, half, state.layers):
                continue
            both = shared_layouts(reg, *((name, other) if half == "prefill" else (other, name)))
            if both:
                fields = half_declaration(cfg, {half: name})
                fields["kv_layout"] = both[0]
                moved, other = cast(str, pair[half]), cast(str, other)
                return [Declaration(CORE, f"{layout_words(reg, moved)} but {layout_words(reg, other)}: the "
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
