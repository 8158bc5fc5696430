"""Finding plugins: entry points, the allow/deny environment, importing descriptor modules.

``entry_point_sources()`` lists the ``attnplug.backends`` entry points (one
per distribution and entry-point name; shadowed duplicate metadata reported,
never loaded twice). ``plugin_filter()`` reads ``ATTNPLUG_PLUGINS`` and
``ATTNPLUG_DISABLE_PLUGINS``. ``load_sources()`` imports every source the
filter lets through -- as plugin code, through :mod:`attnplug.isolation`, so
whatever it raises or prints is recorded against its distribution -- and
hands the module to the ``register`` callable it was given (the registry's, which asks it to
register its backends); this module knows no registry.

The environment, as documented in ``docs/plugins.md``: both variables are
comma-separated lists of distribution or entry-point names (``_``/``-``/``.``
and case do not matter). Unset or empty means "no filter". A value that is
set but names nothing (``","``, ``" , "``) is a :class:`PluginFilterError`:
an allow-list that names nothing is a mistake, not "everything".
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata as md
import sys
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from .errors import PluginError, PluginFilterError
from .isolation import call_plugin, output_note

ENTRY_POINT_GROUP = "attnplug.backends"
ENV_ALLOW = "ATTNPLUG_PLUGINS"
ENV_DENY = "ATTNPLUG_DISABLE_PLUGINS"


@dataclasses.dataclass
class PluginRecord:
    """One discovered plugin (an entry point of one distribution).

    ``status`` is ``"loaded"``, ``"failed"`` (its error says why, naming what
    raised) or ``"filtered"`` (its error names the variable that removed it).
    ``output`` holds what it printed to stdout while loading (kept out of the
    program's output).
    """

    name: str  # entry-point name
    distribution: str
    version: str
    module: str
    status: str = "loaded"  # "loaded" | "failed" | "filtered"
    error: str | None = None
    backends: list[str] = dataclasses.field(default_factory=list)
    output: str = ""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def keys(self) -> set[str]:
        """The normalised names an environment list may use for this plugin."""
        return {norm(self.name), norm(self.distribution)}


@dataclasses.dataclass(frozen=True)
class PluginSource:
    """Where a plugin comes from: an entry point, or an in-process module (tests, built-ins)."""

    name: str
    distribution: str
    version: str
    module: str
    loader: Callable[[], Any]


def norm(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


@dataclasses.dataclass(frozen=True)
class PluginFilter:
    """The parsed ``ATTNPLUG_PLUGINS`` / ``ATTNPLUG_DISABLE_PLUGINS``."""

    allow: tuple[str, ...] = ()
    deny: tuple[str, ...] = ()
    allow_set: bool = False
    raw_allow: str = ""
    raw_deny: str = ""

    def reason_filtered(self, record: PluginRecord) -> str | None:
        """Which variable removes ``record``, in words; ``None`` when it loads."""
        keys = record.keys()
        if self.allow_set and not keys & {norm(n) for n in self.allow}:
            return f"filtered out by {ENV_ALLOW}={self.raw_allow!r} (it is not listed there)"
        if keys & {norm(n) for n in self.deny}:
            return f"filtered out by {ENV_DENY}={self.raw_deny!r} (it is listed there)"
        return None


def _names(var: str, value: str | None) -> tuple[tuple[str, ...], bool]:
    if value is None or value == "":
        return (), False
    names = tuple(x.strip() for x in value.split(",") if x.strip())
    if not names:
        raise PluginFilterError(
            f"{var}={value!r} names no plugin; give comma-separated distribution or entry-point names "
            f"(e.g. {var}=attnplug-torch-native), or unset it to load every installed plugin"
        )
    return names, True


def plugin_filter(env: Mapping[str, str]) -> PluginFilter:
    """Parse the environment; raises :class:`PluginFilterError` for a list that names nothing."""
    allow, allow_set = _names(ENV_ALLOW, env.get(ENV_ALLOW))
    deny, _ = _names(ENV_DENY, env.get(ENV_DENY))
    return PluginFilter(allow, deny, allow_set, env.get(ENV_ALLOW) or "", env.get(ENV_DENY) or "")


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
        key = (norm(dist_name), ep.name)
        if key in seen:
            continue
        seen.add(key)
        sources.append(PluginSource(ep.name, dist_name, version, ep.value, ep.load))
    return sources, _shadowed_copies({s.distribution: s.version for s in sources})


def _shadowed_copies(dists: Mapping[str, str]) -> list[str]:
    """Notes for plugin distributions that have more than one metadata folder on ``sys.path``."""
    notes = []
    for name, version in dists.items():
        stem = norm(name).replace("-", "_")
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


#: ``register(module, source, record)``: hands a loaded descriptor module to whoever keeps the names
Register = Callable[[Any, "PluginSource", PluginRecord], None]


def load_sources(sources: Iterable[PluginSource], env: Mapping[str, str], *, register: Register,
                 add: Callable[[PluginRecord], None], note: Callable[[str], None]) -> None:
    """Filter and import ``sources``; each gets a ``PluginRecord`` (``add``), each loaded module goes to
    ``register``, and what is worth telling (a filter naming nothing installed, a plugin that printed
    while importing) to ``note``. Knows no registry: the caller passes these three callables."""
    sources = list(sources)
    flt = plugin_filter(env)
    known = {norm(s.name) for s in sources} | {norm(s.distribution) for s in sources}
    for var, names in ((ENV_ALLOW, flt.allow), (ENV_DENY, flt.deny)):
        for n in names:
            if norm(n) not in known:
                note(f"{var} names {n!r}, which is no installed plugin "
                     f"(installed: {', '.join(sorted(s.distribution for s in sources)) or 'none'})")
    for src in sources:
        record = PluginRecord(src.name, src.distribution, src.version, src.module)
        add(record)
        why = flt.reason_filtered(record)
        if why is not None:
            record.status, record.error = "filtered", why
            continue
        what = f"import of {src.module!r}"
        try:
            module, out = call_plugin(src.distribution, what, src.loader)
        except PluginError as exc:
            record.status, record.error = "failed", exc.detail
            continue
        if out:
            record.output += out
            note(output_note(record.distribution, what, out))
        register(module, src, record)


def in_process_source(module: Any, distribution: str, version: str = "0", name: str | None = None) -> PluginSource:
    """A ``PluginSource`` for a module already imported (tests; hosts embedding a plugin)."""
    return PluginSource(name or distribution, distribution, version, getattr(module, "__name__", "?"),
                        lambda: module)


def import_source(module_name: str, distribution: str, version: str = "0") -> PluginSource:
    """A ``PluginSource`` that imports ``module_name`` when loaded."""
    return PluginSource(module_name, distribution, version, module_name,
                        lambda: importlib.import_module(module_name))
