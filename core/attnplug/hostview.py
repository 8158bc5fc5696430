"""The frozen per-host view: what a registry knows about one host, answered once.

Settling a registry for a host (:func:`attnplug.settle.settle`) runs every plugin probe, priority
function and collecting hook once and freezes the answers here: name -> descriptor, availability,
priority and library-floor problem, the aliases and conflicts, the per-architecture overrides,
resolution rules the plugins declared, and the KV layouts. ``resolve``,
``trace`` and ``explain`` read only a view; reading one runs no plugin code.

Two doors lead back out, both held as callables the registry hands over (``ViewPorts``), never as
the registry itself: a host-dependent name no table holds is answered by the plugins'
``attnplug_resolve_name`` hook (once per name and host, then cached by the registry), and a plugin
whose configuration rule breaks the contract during a resolution is set aside with ``without()``,
which returns the view settled again without it. Running a declared rule (it reads the
configuration, so it runs per resolution) goes through ``run_rule``, and the plugins' configuration
checks through ``check_config``: plugin code, isolated.
"""

from __future__ import annotations

import dataclasses
import warnings
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Callable, Mapping

from .errors import BackendConflictError, UnknownBackendError
from .host import HostInfo

if TYPE_CHECKING:
    from .capabilities import Capabilities
    from .config import AttentionConfig
    from .descriptor import Availability, BackendDescriptor
    from .resolution.vocabulary import ArchOverride, ResolutionRule


@dataclasses.dataclass(frozen=True)
class BackendOnHost:
    """One registered backend as settled for a host."""

    descriptor: "BackendDescriptor"
    availability: "Availability"
    #: the default priority here; ``None``: never a default on this host
    priority: int | None
    #: a sentence when the installed kernel library is older than the declared floor
    floor_problem: str | None

    @property
    def name(self) -> str:
        return self.descriptor.name

    @property
    def capabilities(self) -> "Capabilities":
        return self.descriptor.capabilities


@dataclasses.dataclass(frozen=True)
class ViewPorts:
    """The callables a registry hands a view (the only ways out of it; see the module doc)."""

    #: a name no table holds -> its canonical name on the view's host (the ``attnplug_resolve_name`` hook)
    resolve_name: Callable[[str], str]
    #: ``(distribution, why)`` -> the view settled again after setting that plugin aside
    without: Callable[[str, str], "HostView"]
    #: ``(distribution, what, fn, *args)`` -> what ``fn`` returned, run as plugin code
    run: Callable[..., Any]
    #: a resolved configuration -> ``(distribution, problems)`` of every ``attnplug_check_config``
    check_config: Callable[["AttentionConfig"], list[tuple[str, Any]]]
    #: the message of an unknown name (what is installed, filtered, set aside)
    unknown_message: Callable[[str], str]
    #: whether a missing name may be missing because a plugin is at fault (not misspelt or filtered)
    removed_by_plugin_fault: Callable[[str], bool]


@dataclasses.dataclass(frozen=True, eq=False)
class HostView:
    """A registry settled for ``host``: immutable, and read without running plugin code."""

    host: HostInfo
    #: canonical name -> the backend on this host, sorted by name
    backends: Mapping[str, BackendOnHost]
    #: alias -> (canonical name, deprecated?)
    aliases: Mapping[str, tuple[str, bool]]
    #: names and aliases two distributions claim: unusable, reported naming both
    conflicts: Mapping[str, BackendConflictError]
    overrides: tuple["ArchOverride", ...]
    rules: tuple["ResolutionRule", ...]
    #: every usable KV layout -> who defines it (``"core"`` or a distribution)
    layouts: Mapping[str, str]
    layout_conflicts: Mapping[str, str]
    #: distribution -> why: plugins whose resolution hook broke the contract while this view was settled
    set_aside: Mapping[str, str]
    #: distributions of the plugins loaded (not filtered, failed or set aside) when it was settled
    loaded: frozenset[str]
    ports: ViewPorts = dataclasses.field(repr=False)

    def __post_init__(self) -> None:
        for field in ("backends", "aliases", "conflicts", "layouts", "layout_conflicts", "set_aside"):
            object.__setattr__(self, field, MappingProxyType(dict(getattr(self, field))))

    # -- names -------------------------------------------------------------
    def names(self) -> list[str]:
        """Canonical names of every registered backend, sorted."""
        return list(self.backends)

    def get(self, name: str) -> "BackendDescriptor":
        """The descriptor of canonical ``name``; the conflict, or ``UnknownBackendError``, otherwise."""
        if name in self.conflicts:
            raise self.conflicts[name]
        entry = self.backends.get(name)
        if entry is None:
            raise UnknownBackendError(self.ports.unknown_message(name))
        return entry.descriptor

    @property
    def descriptors(self) -> Mapping[str, "BackendDescriptor"]:
        return {n: b.descriptor for n, b in self.backends.items()}

    def canonical(self, name: str, host: HostInfo | None = None) -> str:
        """``name`` (canonical, alias, deprecated alias or host-dependent) as a canonical name.

        A deprecated alias warns with the replacement; a name no table holds is asked of the
        plugins' ``attnplug_resolve_name`` hook (once per name and host)."""
        if not isinstance(name, str) or not name:
            raise UnknownBackendError(f"attention backend name {name!r}: expected a non-empty str")
        if name in self.conflicts:
            raise self.conflicts[name]
        if name in self.backends:
            return name
        if name in self.aliases:
            canonical, deprecated = self.aliases[name]
            if canonical in self.conflicts:
                raise self.conflicts[canonical]
            if deprecated:
                warnings.warn(f"attention backend name {name!r} is deprecated; use {canonical!r}",
                              DeprecationWarning, stacklevel=2)
            return canonical
        return self.ports.resolve_name(name)

    # -- this host -----------------------------------------------------------
    def availability(self, name: str, host: HostInfo | None = None) -> "Availability":
        """Whether ``name`` runs on this host, with the reasons when not."""
        self.get(name)
        return self.backends[name].availability

    def priority(self, name: str, host: HostInfo | None = None) -> int | None:
        """``name``'s default priority on this host (``None``: never a default here)."""
        self.get(name)
        return self.backends[name].priority

    def capabilities(self, name: str) -> "Capabilities":
        return self.get(name).capabilities

    def available_names(self, host: HostInfo | None = None) -> list[str]:
        """Canonical names of the backends available on this host."""
        return [n for n, b in self.backends.items() if b.availability]

    def ranked(self) -> list[tuple[str, int]]:
        """Backends with a default priority on this host, best first (ties by name)."""
        out = [(n, b.priority) for n, b in self.backends.items() if b.priority is not None]
        return sorted(out, key=lambda x: (-x[1], x[0]))

    def layout_names(self) -> dict[str, str]:
        """Every usable KV layout: name -> who defines it."""
        return dict(self.layouts)

    # -- the two doors out -----------------------------------------------------
    def run_rule(self, distribution: str, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """Run a rule a plugin declared (plugin code, isolated: anything raised names the distribution)."""
        return self.ports.run(distribution, what, fn, *args)

    def check_config(self, config: "AttentionConfig") -> list[tuple[str, Any]]:
        """Every plugin's ``attnplug_check_config`` answer for a resolved ``config`` (plugin code)."""
        return self.ports.check_config(config)

    def without(self, distribution: str, why: str) -> "HostView":
        """This host's view with ``distribution`` set aside (it broke the contract, ``why``)."""
        return self.ports.without(distribution, why)

    def removed_by_plugin_fault(self, name: str) -> bool:
        return self.ports.removed_by_plugin_fault(name)
