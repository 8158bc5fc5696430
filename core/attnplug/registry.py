"""Discovery of plugins and building of backends.

``Registry.discover()`` reads the ``attnplug.backends`` entry points (one per
plugin distribution; de-duplicated; filtered by ``ATTNPLUG_PLUGINS`` and
``ATTNPLUG_DISABLE_PLUGINS``), imports each light descriptor module, and asks
it to register its backends through the pluggy hooks. A plugin whose import
or hook raises is set aside with its distribution, version and error; the
others keep working. ``default_registry()`` discovers once per process.

``Registry.build()`` is the only place a backend is constructed: it validates
the factory's ``(effective_name, backend)`` and writes the stamps.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.metadata as md
import os
import warnings
from typing import Any, Callable, Iterable, Mapping

import pluggy

from . import hookspecs
from .backend import AttentionBackend
from .descriptor import Availability, BackendDescriptor
from .errors import (
    AttnplugError,
    BackendConflictError,
    BackendUnavailableError,
    PluginError,
    UnknownBackendError,
)
from .host import HostInfo, detect_host
from .stamps import stamp

ENTRY_POINT_GROUP = "attnplug.backends"
ENV_ALLOW = "ATTNPLUG_PLUGINS"
ENV_DENY = "ATTNPLUG_DISABLE_PLUGINS"


@dataclasses.dataclass
class PluginRecord:
    """One discovered plugin (an entry point of one distribution)."""

    name: str  # entry-point name
    distribution: str
    version: str
    module: str
    status: str = "loaded"  # "loaded" | "failed" | "filtered"
    error: str | None = None
    backends: list[str] = dataclasses.field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class PluginSource:
    """Where a plugin comes from: an entry point, or an in-process module (tests, built-ins)."""

    name: str
    distribution: str
    version: str
    module: str
    loader: Callable[[], Any]


def _norm(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def _split_env(value: str | None) -> list[str]:
    return [x.strip() for x in (value or "").split(",") if x.strip()]


def entry_point_sources(group: str = ENTRY_POINT_GROUP) -> tuple[list[PluginSource], list[str]]:
    """Every plugin entry point of ``group``, one per (distribution, entry-point name).

    Only distributions that declare such an entry point have their metadata
    read. ``importlib.metadata`` keeps the first copy of a distribution found
    on ``sys.path``; copies shadowed behind it (an editable install next to
    stale metadata) are reported in the returned notes, never registered twice.
    """
    sources: list[PluginSource] = []
    seen: set[tuple[str, str]] = set()
    for ep in md.entry_points(group=group):
        dist = ep.dist
        dist_name = dist.name if dist is not None else ep.module
        version = dist.version if dist is not None else "?"
        key = (_norm(dist_name), ep.name)
        if key in seen:
            continue
        seen.add(key)
        sources.append(PluginSource(ep.name, dist_name, version, ep.value, ep.load))
    return sources, _shadowed_copies({s.distribution: s.version for s in sources})


def _shadowed_copies(dists: Mapping[str, str]) -> list[str]:
    """Notes for plugin distributions that have more than one metadata folder on ``sys.path``."""
    import sys
    from pathlib import Path

    notes = []
    for name, version in dists.items():
        stem = _norm(name).replace("-", "_")
        copies = []
        for entry in sys.path:
            try:
                base = Path(entry or ".")
                for info in list(base.glob(f"{stem}-*.dist-info")) + list(base.glob(f"{stem}-*.egg-info")):
                    if info.is_dir():
                        copies.append(info)
            except OSError:
                continue
        if len(copies) > 1:
            others = [c.name for c in copies[1:]]
            notes.append(
                f"duplicate metadata for distribution {name!r}: using version {version} found first on "
                f"sys.path; ignored {', '.join(others)}"
            )
    return notes


class Registry:
    """The backends known to this process. Holds no backend *choice*: that is
    the resolved configuration's, and stamps are the built backends'."""

    def __init__(self, host: HostInfo | None = None) -> None:
        self._host = host
        self.plugins: list[PluginRecord] = []
        self.descriptors: dict[str, BackendDescriptor] = {}
        self._aliases: dict[str, tuple[str, bool]] = {}  # alias -> (canonical, deprecated)
        self._alias_owner: dict[str, str] = {}  # alias -> distribution
        self.problems: list[str] = []
        #: names/aliases claimed by two distributions: unusable, reported naming both
        self.conflicts: dict[str, BackendConflictError] = {}
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self._availability: dict[tuple[str, HostInfo], Availability] = {}
        self._resolved: dict[tuple[str, HostInfo], str] = {}

    # -- discovery -----------------------------------------------------
    @classmethod
    def discover(
        cls,
        *,
        env: Mapping[str, str] | None = None,
        host: HostInfo | None = None,
        extra: Iterable[PluginSource] = (),
    ) -> "Registry":
        """Discover entry-point plugins (plus ``extra`` in-process sources) and load them."""
        reg = cls(host)
        sources, notes = entry_point_sources()
        reg.problems.extend(notes)
        reg.load_sources(list(sources) + list(extra), env=os.environ if env is None else env)
        return reg

    def load_sources(self, sources: list[PluginSource], env: Mapping[str, str] | None = None) -> None:
        env = {} if env is None else env
        allow, deny = _split_env(env.get(ENV_ALLOW)), _split_env(env.get(ENV_DENY))
        known = {_norm(s.name) for s in sources} | {_norm(s.distribution) for s in sources}
        for var, names in ((ENV_ALLOW, allow), (ENV_DENY, deny)):
            for n in names:
                if _norm(n) not in known:
                    self.problems.append(
                        f"{var} names {n!r}, which is no installed plugin "
                        f"(installed: {', '.join(sorted(s.distribution for s in sources)) or 'none'})"
                    )
        allow_set, deny_set = {_norm(n) for n in allow}, {_norm(n) for n in deny}
        for src in sources:
            keys = {_norm(src.name), _norm(src.distribution)}
            record = PluginRecord(src.name, src.distribution, src.version, src.module)
            self.plugins.append(record)
            if allow and not keys & allow_set:
                record.status, record.error = "filtered", f"not in {ENV_ALLOW}"
                continue
            if keys & deny_set:
                record.status, record.error = "filtered", f"listed in {ENV_DENY}"
                continue
            self._load_one(src, record)

    def _load_one(self, src: PluginSource, record: PluginRecord) -> None:
        try:
            module = src.loader()
        except Exception as exc:
            record.status, record.error = "failed", f"import of {src.module!r} raised {type(exc).__name__}: {exc}"
            return
        try:
            self.pm.register(module, name=src.distribution)
        except Exception as exc:  # pluggy validation (bad hook signature) or double registration
            record.status, record.error = "failed", f"{type(exc).__name__}: {exc}"
            return
        staged: list[BackendDescriptor] = []

        def register(descriptor: BackendDescriptor) -> None:
            staged.append(self._validated(descriptor, src))

        impls = [i for i in self.pm.hook.attnplug_register_backends.get_hookimpls() if i.plugin is module]
        try:
            for impl in impls:
                impl.function(register=register)
        except Exception as exc:
            self.pm.unregister(module)
            record.status = "failed"
            record.error = f"hook attnplug_register_backends raised {type(exc).__name__}: {exc}"
            return
        self._commit(staged, src)
        record.backends = [d.name for d in staged if self.descriptors.get(d.name) is d]

    def _validated(self, d: Any, src: PluginSource) -> BackendDescriptor:
        if not isinstance(d, BackendDescriptor):
            raise PluginError(src.distribution, f"register() takes a BackendDescriptor, got {type(d).__name__}")
        if not d.name or not d.name.replace("_", "").isalnum() or d.name != d.name.lower():
            raise PluginError(src.distribution, f"backend name {d.name!r} must be lower-case letters, digits, '_'")
        if isinstance(d.factory, str) and ":" not in d.factory:
            raise PluginError(src.distribution, f"backend {d.name!r}: factory {d.factory!r} must be 'module:function'")
        return dataclasses.replace(d, distribution=src.distribution, version=src.version)

    def _commit(self, staged: list[BackendDescriptor], src: PluginSource) -> None:
        """Add a plugin's descriptors. A name or alias another distribution already
        holds becomes a conflict: unusable for both, reported naming both."""
        claimed: dict[str, str] = {}
        for d in staged:
            name_conflict = self._claim(d.name, "backend name", src.distribution, claimed)
            if not name_conflict:
                self.descriptors[d.name] = d
            for alias, deprecated in [(a, False) for a in d.aliases] + [(a, True) for a in d.deprecated_aliases]:
                # aliases are claimed even when the name conflicts, so their clashes are reported too
                if not self._claim(alias, "alias", src.distribution, claimed):
                    self._aliases[alias] = (d.name, deprecated)
                    self._alias_owner[alias] = src.distribution

    def _claim(self, name: str, what: str, dist: str, claimed: dict[str, str]) -> bool:
        """Record ``dist``'s claim on ``name``; True when it conflicts with another distribution."""
        if name in self.conflicts:
            first = self.conflicts[name].distributions[0]
            self.conflicts[name] = BackendConflictError(name, first, dist, what)
            return True
        owner = self._owner_of(name) or claimed.get(name)
        claimed[name] = dist
        if owner is None:
            return False
        self.conflicts[name] = BackendConflictError(name, owner, dist, what)
        # the first owner loses the name too: neither wins silently. Aliases that point at a
        # conflicted name stay recorded (so later clashes on them are reported) and resolve to
        # the conflict error.
        self.descriptors.pop(name, None)
        self._aliases.pop(name, None)
        return True

    def _owner_of(self, name: str) -> str | None:
        if name in self.descriptors:
            return self.descriptors[name].distribution
        return self._alias_owner.get(name)

    # -- queries -------------------------------------------------------
    @property
    def host(self) -> HostInfo:
        if self._host is None:
            libs = tuple(sorted({d.library for d in self.descriptors.values() if d.library}))
            self._host = detect_host(libs)
        return self._host

    def names(self) -> list[str]:
        return sorted(self.descriptors)

    def aliases(self) -> dict[str, tuple[str, bool]]:
        return dict(self._aliases)

    def get(self, name: str) -> BackendDescriptor:
        if name in self.conflicts:
            raise self.conflicts[name]
        try:
            return self.descriptors[name]
        except KeyError:
            raise UnknownBackendError(self._unknown_message(name, self.host)) from None

    def failed_plugins(self) -> list[PluginRecord]:
        return [p for p in self.plugins if p.status == "failed"]

    def availability(self, name: str, host: HostInfo | None = None) -> Availability:
        host = host or self.host
        key = (name, host)
        if key not in self._availability:
            self._availability[key] = self.get(name).check_availability(host)
        return self._availability[key]

    def available_names(self, host: HostInfo | None = None) -> list[str]:
        return [n for n in self.names() if self.availability(n, host)]

    def canonical(self, name: str, host: HostInfo | None = None) -> str:
        """Resolve ``name`` (canonical, alias, deprecated alias or host-dependent) to a canonical name.

        Deprecated aliases warn with the replacement. Host-dependent names are
        answered by the ``attnplug_resolve_name`` hook once per (name, host).
        """
        if name in self.conflicts:
            raise self.conflicts[name]
        if name in self.descriptors:
            return name
        if name in self._aliases:
            canonical, deprecated = self._aliases[name]
            if canonical in self.conflicts:
                raise self.conflicts[canonical]
            if deprecated:
                warnings.warn(
                    f"attention backend name {name!r} is deprecated; use {canonical!r}",
                    DeprecationWarning,
                    stacklevel=2,
                )
            return canonical
        host = host or self.host
        key = (name, host)
        if key not in self._resolved:
            self._resolved[key] = self._resolve_by_hook(name, host)
        return self._resolved[key]

    def _resolve_by_hook(self, name: str, host: HostInfo) -> str:
        answers: list[tuple[str, str]] = []
        for impl in self.pm.hook.attnplug_resolve_name.get_hookimpls():
            dist = self.pm.get_name(impl.plugin) or "?"
            try:
                result = impl.function(name=name, host=host)
            except Exception as exc:
                raise PluginError(dist, f"attnplug_resolve_name({name!r}) raised {type(exc).__name__}: {exc}") from exc
            if result is not None:
                answers.append((dist, result))
        if not answers:
            raise UnknownBackendError(self._unknown_message(name, host))
        if len({a for _, a in answers}) > 1:
            raise AttnplugError(
                f"name {name!r} is resolved differently by "
                + ", ".join(f"{d!r} -> {a!r}" for d, a in answers)
            )
        dist, result = answers[0]
        if result not in self.descriptors:
            raise PluginError(dist, f"resolved {name!r} to {result!r}, which is not a registered backend name")
        return result

    def _unknown_message(self, name: str, host: HostInfo) -> str:
        avail = [n for n in self.names() if self.availability(n, host)]
        unavail = [f"{n} ({'; '.join(self.availability(n, host).reasons)})" for n in self.names()
                   if not self.availability(n, host)]
        msg = f"unknown attention backend {name!r}. Available here: {', '.join(avail) or 'none'}"
        if unavail:
            msg += f". Registered but unavailable: {', '.join(unavail)}"
        if self.conflicts:
            msg += ". Conflicts: " + "; ".join(str(e) for e in self.conflicts.values())
        failed = self.failed_plugins()
        if failed:
            msg += ". Plugins set aside: " + ", ".join(f"{p.distribution} ({p.error})" for p in failed)
        return msg + ". Run `attnplug list` for details."

    # -- building ------------------------------------------------------
    def build(self, name: str, ctx: Any) -> tuple[str, AttentionBackend]:
        """Build backend ``name`` for ``ctx``; returns the stamped ``(effective_name, backend)``."""
        host = ctx.host
        canonical = self.canonical(name, host)
        desc = self.descriptors[canonical]
        avail = self.availability(canonical, host)
        if not avail:
            others = [n for n in self.available_names(host) if n != canonical]
            raise BackendUnavailableError(canonical, avail.reasons, f"Available here: {', '.join(others) or 'none'}")
        try:
            factory = desc.load_factory()
        except Exception as exc:
            raise PluginError(
                desc.distribution, f"cannot load factory {desc.factory!r} of backend {canonical!r}: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        try:
            result = factory(ctx)
        except AttnplugError:
            raise  # already names what is at fault (e.g. NotSupportedError)
        except Exception as exc:
            raise PluginError(
                desc.distribution, f"factory of backend {canonical!r} raised {type(exc).__name__}: {exc}"
            ) from exc
        effective, backend = self.validate_factory_result(result, desc)
        stamp(backend, effective)
        return effective, backend

    def validate_factory_result(self, result: Any, desc: BackendDescriptor) -> tuple[str, AttentionBackend]:
        where = f"factory of backend {desc.name!r} returned"
        if result is None:
            raise PluginError(desc.distribution, f"{where} None; it must return (effective_name, backend)")
        if isinstance(result, AttentionBackend):
            raise PluginError(
                desc.distribution,
                f"{where} a bare {type(result).__name__}; it must return (effective_name, backend)",
            )
        if not isinstance(result, tuple) or len(result) != 2:
            raise PluginError(desc.distribution, f"{where} {result!r}; it must return (effective_name, backend)")
        effective, backend = result
        if not isinstance(effective, str):
            raise PluginError(desc.distribution, f"{where} effective name {effective!r}; it must be a str")
        if effective in self._aliases:
            raise PluginError(
                desc.distribution,
                f"{where} the alias {effective!r} as its effective name; return the canonical name "
                f"{self._aliases[effective][0]!r}",
            )
        if effective not in self.descriptors:
            raise PluginError(
                desc.distribution,
                f"{where} effective name {effective!r}, which is not a registered backend "
                f"(registered: {', '.join(self.names())})",
            )
        if not isinstance(backend, AttentionBackend):
            raise PluginError(
                desc.distribution,
                f"{where} ({effective!r}, {type(backend).__name__}); the backend must subclass "
                f"attnplug.AttentionBackend",
            )
        return effective, backend

    def build_pair(self, ctx: Any) -> AttentionBackend:
        """Build the backend serving ``ctx.config``'s resolved pair: one backend, or a
        ``HybridBackend`` when the halves differ."""
        from .hybrid import HybridBackend

        prefill, decode = ctx.config.attention_backends()
        if prefill is None or decode is None:
            raise AttnplugError(
                f"the attention pair is not resolved (prefill={prefill!r}, decode={decode!r}); "
                f"run attnplug.resolve(config) first or set --attention-backend"
            )
        host = ctx.host
        p, d = self.canonical(prefill, host), self.canonical(decode, host)
        _, pb = self.build(p, ctx)
        if p == d:
            return pb
        _, db = self.build(d, ctx)
        return HybridBackend(pb, db, ctx.config.speculative_attention_mode)


@functools.lru_cache(maxsize=1)
def default_registry() -> Registry:
    """The process's registry, discovered once from the installed entry points."""
    return Registry.discover()


def in_process_source(module: Any, distribution: str, version: str = "0", name: str | None = None) -> PluginSource:
    """A ``PluginSource`` for a module already imported (tests; hosts embedding a plugin)."""
    return PluginSource(name or distribution, distribution, version, getattr(module, "__name__", "?"),
                        lambda: module)


def import_source(module_name: str, distribution: str, version: str = "0") -> PluginSource:
    return PluginSource(module_name, distribution, version, module_name,
                        lambda: importlib.import_module(module_name))
