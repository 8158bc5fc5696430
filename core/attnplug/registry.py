"""The backends known to this process: the name table, availability, hooks and building.

Finding plugins (entry points, the allow/deny environment, importing) is
:mod:`attnplug.discovery`'s; a loaded module comes here through
``register_plugin``, which asks it to register its backends. Every call into
plugin code goes through :mod:`attnplug.isolation` (anything raised or printed
is the plugin's); every hook is called through :meth:`Registry.call_hook`.

A plugin that breaks the contract -- raises while loading, registers a
malformed descriptor, or later answers with a value of the wrong type from a
probe or priority function -- is *set aside*: its backends, aliases and hooks
leave the table, its ``PluginRecord`` says ``failed`` and why (naming the
field, the expected type and the distribution), and every other plugin keeps
working. ``default_registry()`` discovers once per process, also under threads.

``Registry.build()`` is the only place a backend is constructed: it checks the
build context against the backend's declared capabilities, runs the factory,
validates its ``(effective_name, backend)`` and writes the stamps.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import warnings
from typing import Any, Callable, Iterable, Mapping

import pluggy

from . import hookspecs
from .backend import AttentionBackend
from .capabilities import host_layer_reasons, layer_reasons, support_reasons
from .descriptor import Availability, BackendDescriptor, descriptor_problems
from .discovery import (  # re-exported: the registry's public names before discovery moved out
    ENTRY_POINT_GROUP,
    ENV_ALLOW,
    ENV_DENY,
    PluginRecord,
    PluginSource,
    entry_point_sources,
    import_source,
    in_process_source,
    load_sources,
    norm,
)
from .errors import (
    AttnplugError,
    BackendConflictError,
    BackendUnavailableError,
    ConfigError,
    NotSupportedError,
    PluginError,
    UnknownBackendError,
)
from .host import HostInfo, detect_host
from .isolation import call_plugin, echo_output, output_note
from .kvlayout import BUILTIN_LAYOUTS, KVLayout, builtin_layout
from .stamps import stamp

__all__ = [
    "ENTRY_POINT_GROUP", "ENV_ALLOW", "ENV_DENY", "PluginRecord", "PluginSource", "Registry", "default_registry",
    "entry_point_sources", "import_source", "in_process_source",
]


def _is_str_list(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value)


#: hook -> (what its implementations may return, a check). Register-style hooks return nothing.
_HOOK_RESULTS: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "attnplug_resolve_name": ("a str or None", lambda v: v is None or isinstance(v, str)),
    "attnplug_check_config": ("a list of str or None", lambda v: v is None or _is_str_list(v)),
}


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
        self._pm = pluggy.PluginManager(hookspecs.PROJECT)
        self._pm.add_hookspecs(hookspecs)
        self._availability: dict[tuple[str, HostInfo], Availability] = {}
        self._resolved: dict[tuple[str, HostInfo], str] = {}
        #: name or alias -> (distribution, why) for plugins set aside after registering it
        self._set_aside: dict[str, tuple[str, str]] = {}
        #: KV layouts plugins define: name -> (distribution, "module:attr"); built ones cached in _layouts
        self.layout_sources: dict[str, tuple[str, str]] = {}
        #: layout name -> why it is unusable (two distributions define it, or a plugin redefines a core one)
        self.layout_conflicts: dict[str, str] = {}
        self._layouts: dict[str, KVLayout] = {}

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
        """Filter, import and register ``sources`` (see :mod:`attnplug.discovery`)."""
        load_sources(self, sources, {} if env is None else env)

    def register_plugin(self, module: Any, src: PluginSource, record: PluginRecord) -> None:
        """Add a loaded descriptor module: its hooks, then the backends it registers (all or none)."""
        try:
            self._pm.register(module, name=src.distribution)
        except Exception as exc:  # pluggy validation (bad hook signature) or double registration
            record.status, record.error = "failed", f"{type(exc).__name__}: {exc}"
            return
        staged: list[BackendDescriptor] = []

        def register(descriptor: BackendDescriptor) -> None:
            staged.append(self._validated(descriptor, src))

        def printed(dist: str, text: str) -> None:
            record.output += text
            self.problems.append(output_note(dist, "hook attnplug_register_backends", text))

        try:
            self.call_hook("attnplug_register_backends", only=src.distribution, on_output=printed,
                           register=register)
        except PluginError as exc:
            self._pm.unregister(module)
            record.status, record.error = "failed", exc.detail
            return
        self._commit(staged, src)
        record.backends = [d.name for d in staged if self.descriptors.get(d.name) is d]

    # -- hooks -----------------------------------------------------------
    def hook_distributions(self, hook: str) -> list[str]:
        """The distributions of loaded plugins implementing ``hook``, sorted."""
        caller = getattr(self._pm.hook, hook)
        return sorted({self._pm.get_name(i.plugin) or "?" for i in caller.get_hookimpls()})

    def call_hook(
        self,
        hook: str,
        *,
        only: str | None = None,
        per_plugin: Callable[[str], Mapping[str, Any]] | None = None,
        on_output: Callable[[str, str], None] | None = None,
        **kwargs: Any,
    ) -> list[tuple[str, Any]]:
        """Call ``hook`` on every loaded plugin implementing it (by distribution; ``only`` one).

        Returns ``(distribution, result)`` pairs. ``per_plugin(distribution)``
        adds keyword arguments for one plugin (a ``register`` callback bound to
        it). Anything a plugin raises, and a result of the wrong type, is a
        ``PluginError`` naming the distribution and the hook; what it prints
        goes to ``on_output(distribution, text)``, else to stderr, labelled.
        """
        caller = getattr(self._pm.hook, hook)
        impls = [(self._pm.get_name(i.plugin) or "?", i) for i in caller.get_hookimpls()]
        expected = _HOOK_RESULTS.get(hook)
        answers: list[tuple[str, Any]] = []
        for dist, impl in sorted(impls, key=lambda x: x[0]):
            if only is not None and dist != only:
                continue
            call_kwargs = dict(kwargs)
            if per_plugin is not None:
                call_kwargs.update(per_plugin(dist))
            result, out = call_plugin(dist, f"hook {hook}", impl.function, **call_kwargs)
            if out:
                if on_output is not None:
                    on_output(dist, out)
                else:
                    echo_output(dist, f"hook {hook}", out)
            if expected is not None and not expected[1](result):
                raise PluginError(dist, f"hook {hook} returned {result!r} ({type(result).__name__}); "
                                  f"expected {expected[0]}")
            answers.append((dist, result))
        return answers

    # -- the name table ------------------------------------------------
    def _validated(self, d: Any, src: PluginSource) -> BackendDescriptor:
        if not isinstance(d, BackendDescriptor):
            raise PluginError(src.distribution, f"register() takes a BackendDescriptor, got {type(d).__name__}")
        problems = descriptor_problems(d)
        if problems:
            label = d.name if isinstance(d.name, str) else "?"
            raise PluginError(src.distribution, f"backend {label!r}: " + "; ".join(problems))
        if not d.name or not d.name.replace("_", "").isalnum() or d.name != d.name.lower():
            raise PluginError(src.distribution, f"backend name {d.name!r} must be lower-case letters, digits, '_'")
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
            for layout, path in d.kv_layout_factories.items():
                self._claim_layout(layout, path, src.distribution)

    def _claim_layout(self, name: str, path: str, dist: str) -> None:
        """Record ``dist``'s definition of KV layout ``name``; a clash makes it unusable, naming both."""
        if name in BUILTIN_LAYOUTS:
            self.layout_conflicts[name] = f"plugin {dist!r} redefines the core's layout {name!r} (ignored)"
            return
        owner = self.layout_sources.get(name)
        if owner is not None and owner != (dist, path):
            self.layout_conflicts[name] = (f"KV layout {name!r} is defined by both {owner[0]!r} ({owner[1]}) and "
                                           f"{dist!r} ({path}); neither is used")
            return
        if name not in self.layout_conflicts:
            self.layout_sources[name] = (dist, path)

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

    def set_aside(self, distribution: str, why: str) -> None:
        """Take a plugin out after it broke the contract: its names, aliases and hooks leave
        the table; its record says ``failed`` with ``why``."""
        for name in [n for n, d in self.descriptors.items() if d.distribution == distribution]:
            del self.descriptors[name]
            self._set_aside[name] = (distribution, why)
        for alias in [a for a, owner in self._alias_owner.items() if owner == distribution]:
            self._aliases.pop(alias, None)
            del self._alias_owner[alias]
            self._set_aside[alias] = (distribution, why)
        plugin = self._pm.get_plugin(distribution)
        if plugin is not None:
            self._pm.unregister(plugin)
        for record in self.plugins:
            if record.distribution == distribution and record.status == "loaded":
                record.status, record.error = "failed", why
        self._resolved.clear()

    # -- queries -------------------------------------------------------
    @property
    def host(self) -> HostInfo:
        if self._host is None:
            libs = tuple(sorted({d.library for d in self.descriptors.values() if d.library}))
            self._host = detect_host(libs)
        return self._host

    def names(self) -> list[str]:
        """Canonical names of every registered backend, sorted."""
        return sorted(self.descriptors)

    def aliases(self) -> dict[str, tuple[str, bool]]:
        """Alias -> (canonical name, deprecated?)."""
        return dict(self._aliases)

    def get(self, name: str) -> BackendDescriptor:
        """``BackendDescriptor`` of ``name`` (canonical or alias); ``UnknownBackendError`` listing what is installed otherwise."""
        if name in self.conflicts:
            raise self.conflicts[name]
        try:
            return self.descriptors[name]
        except KeyError:
            raise UnknownBackendError(self._unknown_message(name, self.host)) from None

    def failed_plugins(self) -> list[PluginRecord]:
        """Plugins set aside (import error, broken hook, malformed value), with distribution and error."""
        return [p for p in self.plugins if p.status == "failed"]

    def filtered_plugins(self) -> list[PluginRecord]:
        """Plugins skipped by ``ATTNPLUG_PLUGINS`` / ``ATTNPLUG_DISABLE_PLUGINS``."""
        return [p for p in self.plugins if p.status == "filtered"]

    def availability(self, name: str, host: HostInfo | None = None) -> Availability:
        """Whether ``name`` can run on ``host``, with the reasons when not (cached per host)."""
        host = host or self.host
        if name in self._set_aside:
            return Availability(False, (f"set aside: {self._set_aside[name][1]}",))
        key = (name, host)
        if key not in self._availability:
            desc = self.get(name)
            try:
                # the priority function is asked here too, so a malformed one is found before
                # the backend is chosen, not after
                desc.priority_on(host)
                self._availability[key] = desc.check_availability(host)
            except PluginError as exc:  # a probe or priority function broke the contract
                self.set_aside(desc.distribution, exc.detail)
                return Availability(False, (f"set aside: {exc}",))
        return self._availability[key]

    def settle(self, host: HostInfo | None = None) -> None:
        """Ask every backend's probe and priority function about ``host`` now, so a plugin that
        breaks the contract is set aside before anything iterates the names (cached per host)."""
        for name in self.names():
            self.availability(name, host)

    def priority(self, name: str, host: HostInfo | None = None) -> int | None:
        """``name``'s default priority on ``host``; a priority function that raises or answers
        with the wrong type sets its plugin aside (and counts as no priority)."""
        if name in self._set_aside:
            return None
        desc = self.get(name)
        try:
            return desc.priority_on(host or self.host)
        except PluginError as exc:
            self.set_aside(desc.distribution, exc.detail)
            return None

    def available_names(self, host: HostInfo | None = None) -> list[str]:
        """Canonical names of the backends available on ``host``."""
        return [n for n in self.names() if self.availability(n, host)]

    def empty_hint(self) -> str:
        """What to say when no backend is registered: filtered, failed, or none installed."""
        filtered, failed = self.filtered_plugins(), self.failed_plugins()
        if filtered or failed:
            parts = [f"{p.distribution} ({p.error})" for p in failed]
            if filtered:
                parts.append(self._filtered_summary())
            return "no backends loaded: " + "; ".join(parts)
        return ("no backends found: install a plugin, e.g. `pip install -c constraints.txt ./plugins/torch_native` "
                "from an attnplug checkout (the plugin distributions are not published on PyPI yet)")

    def _filtered_summary(self) -> str:
        """The filtered plugins, grouped by the variable that removed them."""
        by_reason: dict[str, list[str]] = {}
        for p in self.filtered_plugins():
            by_reason.setdefault(p.error or "filtered", []).append(p.distribution)
        return "; ".join(f"{', '.join(dists)} ({why})" for why, dists in by_reason.items())

    def canonical(self, name: str, host: HostInfo | None = None) -> str:
        """Resolve ``name`` (canonical, alias, deprecated alias or host-dependent) to a canonical name.

        Deprecated aliases warn with the replacement. Host-dependent names are
        answered by the ``attnplug_resolve_name`` hook once per (name, host).
        """
        if not isinstance(name, str) or not name:
            raise UnknownBackendError(f"attention backend name {name!r}: expected a non-empty str")
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
        answers = [(d, a) for d, a in self.call_hook("attnplug_resolve_name", name=name, host=host) if a is not None]
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

    def why_missing(self, name: str) -> str | None:
        """When ``name`` is absent because a filter, a conflict or a set-aside plugin removed it: why."""
        if name in self.conflicts:
            return str(self.conflicts[name])
        if name in self._set_aside:
            dist, why = self._set_aside[name]
            return f"backend {name!r} belongs to plugin {dist!r}, which was set aside: {why}"
        key = norm(name)
        for p in self.plugins:
            if key in p.keys() and p.status == "filtered":
                return f"backend {name!r} comes from plugin {p.distribution!r} ({p.name}), which was {p.error}"
            if key in p.keys() and p.status == "failed":
                return f"backend {name!r} comes from plugin {p.distribution!r} ({p.name}), which failed to load: {p.error}"
        return None

    def removed_by_plugin_fault(self, name: str) -> bool:
        """Whether ``name`` may be missing because a plugin failed to load or was set aside (a plugin at
        fault), rather than misspelt or filtered out: its plugin was set aside, or some plugin failed
        before registering anything (its names are unknown, so ``name`` may be one of them)."""
        if name in self._set_aside:
            return True
        return any(p.status == "failed" and not p.backends for p in self.plugins)

    def _unknown_message(self, name: str, host: HostInfo) -> str:
        self.settle(host)
        avail = [n for n in self.names() if self.availability(n, host)]
        unavail = [f"{n} ({'; '.join(self.availability(n, host).reasons)})" for n in self.names()
                   if not self.availability(n, host)]
        why = self.why_missing(name)
        msg = f"unknown attention backend {name!r}" + (f": {why}" if why else "")
        msg += f". Available here: {', '.join(avail) or 'none'}"
        if unavail:
            msg += f". Registered but unavailable: {', '.join(unavail)}"
        if self.conflicts:
            msg += ". Conflicts: " + "; ".join(str(e) for e in self.conflicts.values())
        failed = self.failed_plugins()
        if failed:
            msg += ". Plugins set aside: " + ", ".join(f"{p.distribution} ({p.error})" for p in failed)
        if self.filtered_plugins():
            msg += ". Plugins filtered out: " + self._filtered_summary()
        return msg + ". Run `attnplug list` for details."

    # -- KV layouts ----------------------------------------------------
    def layout_names(self) -> dict[str, str]:
        """Every usable KV layout: name -> who defines it (``"core"`` or a distribution)."""
        out = {n: "core" for n in BUILTIN_LAYOUTS}
        out.update({n: dist for n, (dist, _) in self.layout_sources.items() if n not in self.layout_conflicts})
        return out

    def kv_layout(self, name: str) -> KVLayout:
        """The ``KVLayout`` called ``name`` (the core's, or a plugin's, imported on first use)."""
        if name in BUILTIN_LAYOUTS:
            return builtin_layout(name)
        if name in self._layouts:
            return self._layouts[name]
        if name in self.layout_conflicts:
            raise ConfigError(self.layout_conflicts[name])
        if name not in self.layout_sources:
            raise ConfigError(f"KV layout {name!r} is not defined by the core or any installed plugin (known: "
                              f"{', '.join(sorted(self.layout_names()))})")
        dist, path = self.layout_sources[name]
        module_name, _, attr = path.partition(":")

        def load() -> Any:
            import importlib

            return getattr(importlib.import_module(module_name), attr)

        what = f"loading KV layout {name!r} ({path})"
        cls, out = call_plugin(dist, what, load)
        echo_output(dist, what, out)
        layout = cls
        if isinstance(cls, type) and issubclass(cls, KVLayout):
            layout, out = call_plugin(dist, what, cls)
        if not isinstance(layout, KVLayout) or layout.name != name:
            raise PluginError(dist, f"{path} must be a KVLayout subclass whose name is {name!r}; got {cls!r}")
        self._layouts[name] = layout
        return layout

    # -- building ------------------------------------------------------
    def build_problems(self, desc: BackendDescriptor, ctx: Any) -> list[str]:
        """Why ``desc``'s declared capabilities cannot serve the build context ``ctx`` (the core's
        ``support_reasons``: dtype, KV-cache dtype, page size, device, head dims, the layers)."""
        device = str(getattr(ctx, "device", "cpu")).split(":", 1)[0]
        if device == "cuda" and ctx.host.platform == "rocm":
            device = "rocm"  # torch names ROCm devices "cuda"
        caps = desc.capabilities
        layout = getattr(getattr(ctx, "kv_cache", None), "layout", None)
        reasons = support_reasons(caps, dtype=ctx.dtype, kv_cache_dtype=ctx.kv_cache_dtype,
                                  page_size=ctx.page_size, device=device,
                                  kv_layout=getattr(layout, "name", None))
        layers = tuple(getattr(ctx, "layers", ()) or ())
        all_mla = bool(layers) and all(getattr(layer, "mla", None) is not None for layer in layers)
        # an MLA model's head_dim is its latent row width: the MLA claim (mla_forms) decides, not head_dims
        if caps.head_dims is not None and ctx.head_dim not in caps.head_dims and not all_mla:
            reasons.append(f"head_dim={ctx.head_dim} (supported: {', '.join(str(d) for d in caps.head_dims)})")
        for layer in getattr(ctx, "layers", ()) or ():
            for reason in layer_reasons(caps, layer) + host_layer_reasons(caps, layer, getattr(ctx, "host", None)):
                text = f"layer {getattr(layer, 'layer_id', '?')}: {reason}"
                if reason not in reasons and text not in reasons:
                    reasons.append(text)
        return reasons

    def build(self, name: str, ctx: Any) -> tuple[str, AttentionBackend]:
        """Build backend ``name`` for ``ctx``; returns the stamped ``(effective_name, backend)``.

        Refuses with ``NotSupportedError`` (the reasons of ``support_reasons``)
        when ``ctx`` asks for what the backend does not claim.
        """
        host = ctx.host
        canonical = self.canonical(name, host)
        desc = self.get(canonical)
        avail = self.availability(canonical, host)
        if not avail:
            others = [n for n in self.available_names(host) if n != canonical]
            raise BackendUnavailableError(canonical, avail.reasons, f"Available here: {', '.join(others) or 'none'}")
        problems = self.build_problems(desc, ctx)
        if problems:
            raise NotSupportedError(canonical, problems, what="the build context it was asked for "
                                    "(its declared capabilities do not claim it)")
        what = f"loading factory {desc.factory!r} of backend {canonical!r}"
        factory, out = call_plugin(desc.distribution, what, desc.load_factory)
        echo_output(desc.distribution, what, out)
        what = f"factory of backend {canonical!r}"
        try:
            result, out = call_plugin(desc.distribution, what, factory, ctx)
        except PluginError as exc:
            if isinstance(exc.__cause__, AttnplugError) and not isinstance(exc.__cause__, PluginError):
                raise exc.__cause__ from None  # already names what is at fault (e.g. NotSupportedError)
            raise
        echo_output(desc.distribution, what, out)
        effective, backend = self.validate_factory_result(result, desc)
        stamp(backend, effective)
        if getattr(backend, "ctx", None) is None:
            try:  # what it was built for: not_supported_reasons(layer) answers for it
                backend.ctx = ctx
            except AttributeError:  # pragma: no cover - a backend with __slots__ or a read-only ctx
                pass
        return effective, backend

    def validate_factory_result(self, result: Any, desc: BackendDescriptor) -> tuple[str, AttentionBackend]:
        """Check a factory's ``(effective_name, backend)``; ``PluginError`` naming the distribution otherwise."""
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
        owner = self.descriptors[effective].distribution
        if owner != desc.distribution and effective not in desc.delegates_to:
            raise PluginError(
                desc.distribution,
                f"{where} effective name {effective!r}, which belongs to distribution {owner!r}; a factory "
                f"answers a name of its own distribution, or one it declares in BackendDescriptor.delegates_to",
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


_default: Registry | None = None
_default_lock = threading.Lock()


def default_registry() -> Registry:
    """The process's registry, discovered once from the installed entry points.

    Thread-safe: threads that ask at once wait for the one discovery.
    """
    global _default
    reg = _default
    if reg is not None:
        return reg
    with _default_lock:
        if _default is None:
            _default = Registry.discover()
        return _default


def _reset_default_registry() -> None:
    """Forget the process's registry (tests only)."""
    global _default
    with _default_lock:
        _default = None


default_registry.cache_clear = _reset_default_registry  # type: ignore[attr-defined]
