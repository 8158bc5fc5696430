"""The chain: pinning, last-writer-wins, and the checks.

``resolve(config, arch, host, registry)`` is a pure function of its inputs: it
returns a new ``AttentionConfig`` and the records that explain it, and writes
no global state. ``trace(...)`` is the same but returns the partial result
with the error attached instead of raising (``attnplug resolve`` explains
failures with it).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Sequence, cast

from ..config import AttentionConfig
from ..errors import (AttnplugError, BackendConflictError, BackendUnavailableError, ConfigError, PluginError,
                      UnknownBackendError)
from ..host import HostInfo
from .explain import Candidate, Resolution
from .passes import DEFAULT_PASSES, layout_words, serve_problems, support_problems
from .vocabulary import (
    AUTO,
    CONFIG_FIELDS,
    CORE,
    DRAFT_FIELD,
    HALF_FIELDS,
    HALVES,
    PAIR_FIELDS,
    USER,
    Declaration,
    Pass,
    Record,
    State,
)

if TYPE_CHECKING:
    from ..hostview import HostView
    from ..registry import Registry

NAME_FIELDS: frozenset[str] = PAIR_FIELDS | {DRAFT_FIELD}


def resolve(
    config: AttentionConfig | None = None,
    arch: str | None = None,
    host: HostInfo | None = None,
    registry: "Registry | None" = None,
    layers: Sequence[Any] = (),
) -> Resolution:
    """Resolve ``config`` for ``arch`` on ``host``; raises on failure (see ``trace``).

    ``layers`` (the model's attention ``LayerSpec`` objects, when the host knows them) make every choice a
    pass makes, and every check, consider them: a backend that does not claim a layer's head dim,
    window, soft-cap, sinks … is not chosen, and the explanation says which layer."""
    result = trace(config, arch=arch, host=host, registry=registry, layers=layers)
    if result.error is not None:
        raise result.error
    return result


def trace(
    config: AttentionConfig | None = None,
    arch: str | None = None,
    host: HostInfo | None = None,
    registry: "Registry | HostView | None" = None,
    passes: Sequence[Pass] = DEFAULT_PASSES,
    layers: Sequence[Any] = (),
) -> Resolution:
    """Run the chain; never raises an ``AttnplugError``/``ValueError``: it is returned in ``error``.

    Reads only the registry's frozen view of ``host`` (``registry`` may be that view itself): the
    plugins' probes, priorities and collecting hooks ran when the host was settled, not here."""
    view = host_view(registry, host)
    config = AttentionConfig() if config is None else config
    set_aside: dict[str, str] = dict(view.set_aside)
    while True:
        chain = _Chain(config, arch, view, tuple(layers))
        try:
            chain.run(passes)
        except PluginError as exc:
            if not _sets_aside(view, exc):
                chain.error = exc
            else:
                # a plugin's rule raised or answered with a malformed value (check_config returning a
                # str, an override returning a list): the contract sets that plugin aside, and
                # resolution runs again for everyone else, over the host settled without it
                view = view.without(exc.distribution, exc.detail)
                set_aside[exc.distribution] = exc.detail
                set_aside.update(view.set_aside)
                continue
        except (AttnplugError, ValueError) as exc:
            chain.error = exc
        break
    result = chain.result()
    return dataclasses.replace(result, set_aside=set_aside) if set_aside else result


def host_view(registry: "Registry | HostView | None", host: HostInfo | None = None) -> "HostView":
    """The frozen view resolution reads: ``registry`` settled for ``host`` (the process's registry
    and this host when not given)."""
    if registry is None:
        from ..registry import default_registry

        registry = default_registry()
    if hasattr(registry, "view"):
        return registry.view(host)
    if host is not None and host != registry.host:
        raise ValueError(f"a view of host {registry.host.describe()} cannot resolve for {host.describe()}")
    return registry


def vet_hooks(registry: "Registry | HostView", host: HostInfo | None = None) -> dict[str, str]:
    """Ask every resolution rule now, the way settling asks every probe: the default resolution
    once, then once per architecture the plugins declare overrides for (what ``attnplug resolve
    [--arch A]`` does), so a plugin whose rule breaks the contract is set aside before ``attnplug
    list`` shows the table. Returns ``{distribution: why}`` of the plugins set aside."""
    view = host_view(registry, host)
    found = dict(trace(AttentionConfig(), registry=view).set_aside)
    view = host_view(registry, host) if found else view
    for arch in sorted({a for o in view.overrides for a in o.archs}):
        found.update(trace(AttentionConfig(), arch=arch, registry=view).set_aside)
        view = host_view(registry, host)
    return found


def _sets_aside(view: "HostView", exc: PluginError) -> bool:
    """Whether ``exc`` is a loaded plugin breaking the hook contract (set it aside), rather than a
    name conflict or a plugin that is already out."""
    if isinstance(exc, BackendConflictError):
        return False
    return exc.distribution in view.loaded


class _Chain:
    """One run of the chain. Holds the pins; every change goes through ``offer``."""

    def __init__(self, user: AttentionConfig, arch: str | None, view: "HostView",
                 layers: tuple[Any, ...] = ()) -> None:
        self.user, self.arch, self.host, self.view = user, arch, view.host, view
        self.layers = layers
        self.config = user
        self.records: list[Record] = []
        self.pins: dict[str, Any] = {}
        self.user_pins: dict[str, Any] = {}
        self.pinned_halves: dict[str, str] = {}
        self.passes_run: list[tuple[str, str]] = []
        self.error: BaseException | None = None

    # -- the user's choices --------------------------------------------
    def pin_user_choices(self) -> None:
        explicit = self.user.explicit_fields()
        canonical: dict[str, Any] = {}
        for field, value in explicit.items():
            canonical[field] = self.canonical_name(value, USER, field) if field in NAME_FIELDS else value
        # the user's "auto" for the draft backend means "the configured pair": not a choice
        if canonical.get(DRAFT_FIELD) == AUTO:
            canonical[DRAFT_FIELD] = None
        cfg = self.user.replace(**{f: v for f, v in canonical.items() if f in NAME_FIELDS})
        halves = dict(zip(HALVES, cfg.attention_backends()))
        own = {h: getattr(cfg, HALF_FIELDS[h]) for h in HALVES}
        note = ""
        if all(v is not None for v in own.values()) and cfg.replace(**{f: None for f in HALF_FIELDS.values()}) \
                .attention_backends()[0] == AUTO:
            # a base "auto" under two per-half choices is unused: drop it rather than leave "auto" behind
            cfg = cfg.replace(attention_backend=None)
            canonical = {f: v for f, v in canonical.items() if f not in PAIR_FIELDS or f in HALF_FIELDS.values()}
            note = "; the base 'auto' is unused (both halves name their own backend)"
        self.config = cfg
        self.pins = {f: v for f, v in canonical.items() if v is not None}
        self.pinned_halves = {h: n for h, n in halves.items() if n is not None}
        if explicit:
            self.records.append(Record("user", USER, dict(explicit), dict(self.pins), {},
                                       rule="fields you set are pinned" + note, pair=cfg.attention_backends()))
        self.user_pins = dict(self.pins)

    def canonical_name(self, value: Any, source: str, field: str) -> Any:
        if value is None or value == AUTO:
            return value
        if not isinstance(value, str):
            raise _plugin_error(source)(f"{field}={value!r} is not a backend name")
        if source == USER:
            try:
                return self.view.canonical(value)
            except UnknownBackendError as exc:
                flag = "--" + field.replace("_", "-")
                err = UnknownBackendError(f"{field}={value!r} (flag {flag}): {exc}")
                #: not the user's mistake: the name's plugin failed to load or was set aside
                err.plugin_fault = self.view.removed_by_plugin_fault(value)  # type: ignore[attr-defined]
                raise err from None
        try:
            return self.view.canonical(value)
        except PluginError:
            raise
        except AttnplugError as exc:
            raise PluginError(source, f"declared {field}={value!r}: {exc}") from exc

    # -- passes ----------------------------------------------------------
    def run(self, passes: Sequence[Pass]) -> None:
        self.pin_user_choices()
        for p in passes:
            self.passes_run.append((p.name, p.description))
            state = State(self.config, self.arch, self.host, self.view, dict(self.pinned_halves),
                          self.view.overrides, self.view.rules, self.layers)
            for decl in p.run(state):
                self.offer(p, decl)
        self.check()

    def offer(self, p: Pass, decl: Declaration) -> None:
        applied: dict[str, Any] = {}
        overruled: dict[str, str] = {}
        for field, value in decl.fields.items():
            if field not in CONFIG_FIELDS or (p.fields is not None and field not in p.fields):
                allowed = sorted(p.fields if p.fields is not None else CONFIG_FIELDS)
                raise _plugin_error(decl.source)(
                    f"{p.name} rule {decl.rule!r} declared unknown field {field!r} (allowed: {', '.join(allowed)})")
            if field in NAME_FIELDS:
                if value == AUTO or value is None:
                    raise _plugin_error(decl.source)(
                        f"{p.name} rule {decl.rule!r} declared {field}={value!r}; declare a backend name")
                value = self.canonical_name(value, decl.source, field)
            why = self._pin_conflict(p, field, value)
            if why:
                overruled[field] = why
                continue
            try:
                tentative = self.config.replace(**{field: value})
            except (TypeError, ValueError) as exc:
                raise _plugin_error(decl.source)(f"{p.name} rule {decl.rule!r} declared {field}={value!r}: {exc}") from exc
            why = self._half_conflict(p, tentative)
            if why:
                overruled[field] = why
                continue
            self.config = tentative
            applied[field] = value
        if p.fills_auto:  # the default fill's choices become what "auto" meant
            for field, value in applied.items():
                if self.pins.get(field) == AUTO:
                    self.pins[field] = value
            for half, name in zip(HALVES, self.config.attention_backends()):
                if self.pinned_halves.get(half) == AUTO and name is not None and name != AUTO:
                    self.pinned_halves[half] = name
        self.records.append(Record(p.name, decl.source, dict(decl.fields), applied, overruled, decl.rule,
                                   self.config.attention_backends()))

    def _pin_conflict(self, p: Pass, field: str, value: Any) -> str | None:
        if field not in self.pins or self.pins[field] == value:
            return None
        if p.fills_auto and self.pins[field] == AUTO:
            return None
        return f"pinned: you set {field}={self.pins[field]!r}"

    def _half_conflict(self, p: Pass, tentative: AttentionConfig) -> str | None:
        for half, new, old in zip(HALVES, tentative.attention_backends(), self.config.attention_backends()):
            want = self.pinned_halves.get(half)
            if want is None or new == old:
                continue
            if p.fills_auto and want == AUTO:
                continue
            return f"would change the {half} half you chose ({want!r})"
        return None

    # -- checks ------------------------------------------------------------
    def check(self) -> None:
        cfg, reg = self.config, self.view
        pair = dict(zip(HALVES, cfg.attention_backends()))
        for half in HALVES:
            name = pair[half]
            if name is None or name == AUTO:
                raise self.nothing_serves(half)
            if half not in self.pinned_halves:
                problems = serve_problems(reg, name, cfg, half, self.layers)
                if problems:
                    raise self.pass_choice_fails(half, name, problems)
                continue
            avail = reg.availability(name)
            if not avail:
                serving = self.serving(half)
                hint = (f"Backends that would serve this configuration here: {', '.join(serving)}"
                        if serving else "No backend serves this configuration here")
                raise BackendUnavailableError(name, list(avail.reasons), hint)
            if cfg.deterministic and not reg.get(name).capabilities.deterministic:
                raise ConfigError(self.deterministic_message(half, name))
            problems = support_problems(reg, name, cfg, half, self.layers)
            if problems:
                serving = self.serving(half)
                raise ConfigError(
                    f"attention backend {name!r} ({reg.get(name).distribution}) cannot serve the {half} half of "
                    f"this configuration: {'; '.join(problems)}. "
                    f"Backends that would: {', '.join(serving) or 'none here'}")
        used = list(dict.fromkeys(n for n in pair.values() if n is not None))
        draft = cfg.speculative_draft_attention_backend
        if draft is not None:
            avail = reg.availability(draft)
            if not avail:
                raise BackendUnavailableError(draft, list(avail.reasons),
                                              f"(the speculative draft backend) Available here: "
                                              f"{', '.join(reg.available_names()) or 'none'}")
            used.append(draft)
        for name in dict.fromkeys(used):
            desc = reg.get(name)
            problem = reg.backends[name].floor_problem
            if problem:
                halves = [h for h in HALVES if pair[h] == name] or ["draft"]
                raise ConfigError(
                    f"{problem}; the {' and '.join(halves)} half uses it. Upgrade {desc.library}, or choose "
                    f"another backend for that half (attnplug resolve explains the choice)")
        self.check_layout(cast(str, pair["prefill"]), cast(str, pair["decode"]))  # resolved names here
        self.check_hook(self.config)

    def check_layout(self, prefill: str, decode: str) -> None:
        """Both halves read the one KV layout (``run_kv_layout`` chose it, or the user did)."""
        reg, layout = self.view, self.config.kv_layout
        known = reg.layout_names()
        if layout is not None and layout not in known:
            why = reg.layout_conflicts.get(layout, "")
            raise ConfigError(f"kv_layout={layout!r} (flag --kv-layout) is not defined by the core or any installed "
                              f"plugin (known: {', '.join(sorted(known))}){'; ' + why if why else ''}")
        if layout is not None:
            return  # a half that cannot read it was rejected by support_problems above
        readers = {x: [n for n in reg.names() if reg.get(n).capabilities.reads_layout(x)] for x in known}
        hint = "; ".join(f"{x}: {', '.join(ns) or 'none'}" for x, ns in readers.items())
        raise ConfigError(
            f"the pair (prefill {prefill!r}, decode {decode!r}) shares no KV-cache layout, and one cache serves both "
            f"halves: {layout_words(reg, prefill)}; {layout_words(reg, decode)}. Choose halves that read a common "
            f"layout (backends by layout: {hint})")

    def check_hook(self, cfg: AttentionConfig) -> None:
        found: list[str] = []
        for dist, problems in self.view.check_config(cfg):
            found.extend(f"plugin {dist!r}: {p}" for p in (problems or []))
        if found:
            raise ConfigError("the resolved configuration fails plugin checks: " + "; ".join(found))

    def serving(self, half: str) -> list[str]:
        view = self.view
        return [n for n, _ in view.ranked() if not serve_problems(view, n, self.config, half, self.layers)] + \
            [n for n in view.names()
             if view.priority(n) is None and not serve_problems(view, n, self.config, half, self.layers)]

    def deterministic_message(self, half: str, name: str) -> str:
        reg = self.view
        det = [n for n in reg.names() if reg.get(n).capabilities.deterministic]
        here = [n for n in det if reg.availability(n)]
        return (f"deterministic inference needs a backend that declares deterministic output; {name!r} "
                f"(your choice for the {half} half) does not. Backends that do: {', '.join(det) or 'none'}"
                f" (available here: {', '.join(here) or 'none'})")

    def pass_choice_fails(self, half: str, name: str, problems: list[str]) -> AttnplugError:
        """A half a pass chose cannot serve, and nothing replaced it: name who chose it."""
        who = "a pass"
        for r in reversed(self.records):
            if any(f in PAIR_FIELDS for f in r.applied):
                who = f"{r.pass_name} [{r.source}] {r.rule!r}"
                break
        serving = self.serving(half)
        if not serving:
            return self.nothing_serves(half)
        return ConfigError(
            f"the {half} half {name!r}, declared by {who}, cannot serve here: {'; '.join(problems)}. "
            f"Backends that would: {', '.join(serving)}")

    def nothing_serves(self, half: str) -> AttnplugError:
        reg = self.view
        lines = []
        for n in reg.names():
            problems = serve_problems(reg, n, self.config, half, self.layers)
            if reg.priority(n) is None:
                problems.append(f"no default priority on {self.host.platform}")
            lines.append(f"{n} ({'; '.join(problems) or 'ok'})")
        msg = (f"no attention backend serves the {half} half of this configuration on this host "
               f"({self.host.describe()}). Rejected: {', '.join(lines) or 'no backends are installed'}")
        if self.config.deterministic:
            det = [n for n in reg.names() if reg.get(n).capabilities.deterministic]
            msg += f". Backends that declare deterministic output: {', '.join(det) or 'none'}"
        return ConfigError(msg)

    # -- result ------------------------------------------------------------
    def result(self) -> Resolution:
        reg, host = self.view, self.host
        cands = []
        for n, b in reg.backends.items():
            d = b.descriptor
            try:
                problems = {h: tuple(serve_problems(reg, n, self.config, h, self.layers)) for h in HALVES}
            except ValueError as exc:  # an invalid dtype in the config: say so per backend
                problems = {h: (str(exc),) for h in HALVES}
            cands.append(Candidate(n, d.distribution, d.version, b.priority, b.availability.available, problems,
                                   b.floor_problem))
        return Resolution(
            config=self.config, user_config=self.user, arch=self.arch, host=host, records=tuple(self.records),
            pinned=dict(self.user_pins), passes=tuple(self.passes_run), candidates=tuple(cands),
            conflicts={n: str(e) for n, e in reg.conflicts.items()}, error=self.error,
        )


def _plugin_error(source: str) -> Any:
    """An error class bound to ``source``: ``PluginError`` naming a plugin's distribution, else ``ConfigError``."""
    if source in (USER, CORE):
        return ConfigError

    def make(message: str) -> PluginError:
        return PluginError(source, message)

    return make
