"""Settling a registry for a host: every plugin probe, priority function and collecting hook, once.

``settle(registry, host)`` asks each backend's priority function and probe about ``host``, reads
its library floor, and collects the per-architecture overrides and resolution rules the plugins
declare; the answers become one frozen :class:`~attnplug.hostview.HostView`. A plugin that breaks
the contract here (a malformed probe or priority answer, a collecting hook that raises or
registers a malformed rule) is set aside, and the host is settled again without it: setting a
plugin aside happens here, and through ``HostView.without`` (a rule that breaks the contract while
a resolution runs), never in the middle of a resolution.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterable

from .errors import PluginError
from .hookspecs import RegisterArchOverride, RegisterResolutionRule
from .host import HostInfo
from .hostview import BackendOnHost, HostView, ViewPorts
from .isolation import call_plugin, echo_output
from .resolution.vocabulary import STAGES, ArchOverride, ResolutionRule

if TYPE_CHECKING:
    from .registry import Registry


def settle(registry: "Registry", host: HostInfo) -> HostView:
    """``registry`` settled for ``host`` (see the module doc)."""
    hook_set_aside: dict[str, str] = {}
    while True:
        try:
            backends = {}
            for name in registry.names():
                desc = registry.descriptors[name]
                # the priority function is asked with the probe, so a malformed one is found before
                # the backend is chosen, not after
                priority = desc.priority_on(host)
                backends[name] = BackendOnHost(desc, desc.check_availability(host), priority,
                                               desc.library_floor_problem(host))
        except PluginError as exc:  # a probe or priority function broke the contract
            registry.set_aside(exc.distribution, exc.detail)
            continue
        try:
            overrides = collect_arch_overrides(registry)
            rules = collect_resolution_rules(registry)
        except PluginError as exc:
            if not _loaded(registry, exc.distribution):
                raise
            registry.set_aside(exc.distribution, exc.detail)
            hook_set_aside[exc.distribution] = exc.detail
            continue
        break
    return HostView(
        host=host, backends=backends, aliases=registry.aliases(), conflicts=dict(registry.conflicts),
        overrides=tuple(overrides), rules=tuple(rules), layouts=registry.layout_names(),
        layout_conflicts=dict(registry.layout_conflicts), set_aside=hook_set_aside,
        loaded=frozenset(p.distribution for p in registry.plugins if p.status == "loaded"),
        ports=_ports(registry, host))


def _loaded(registry: "Registry", distribution: str) -> bool:
    return any(p.distribution == distribution and p.status == "loaded" for p in registry.plugins)


def _ports(registry: "Registry", host: HostInfo) -> ViewPorts:
    def without(distribution: str, why: str) -> HostView:
        registry.set_aside(distribution, why)
        return registry.view(host)

    def run(distribution: str, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        out, printed = call_plugin(distribution, what, fn, *args)
        echo_output(distribution, what, printed)
        return out

    def check_config(config: Any) -> list[tuple[str, Any]]:
        return registry.call_hook("attnplug_check_config", config=config, host=host)

    return ViewPorts(resolve_name=lambda name: registry.resolve_name(name, host), without=without, run=run,
                     check_config=check_config,
                     unknown_message=lambda name: registry.unknown_message(name, host),
                     removed_by_plugin_fault=registry.removed_by_plugin_fault)


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
