"""``BackendDescriptor``: what a plugin registers for one backend.

Everything here is data or a light callable: reading a descriptor never
imports torch or a kernel library. ``factory`` is a ``"module:function"``
path imported only when the backend is built.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import re
from typing import Any, Callable, Mapping

from .capabilities import MLA_MODE_KINDS, Capabilities
from .layer import MLA_FORMS
from .errors import PluginError
from .host import PLATFORMS, HostInfo
from .isolation import call_plugin, describe_exception, echo_output
from .probes import (  # noqa: F401  (re-exported: their home before probes.py defined them)
    Probe,
    installed_library,
    library_missing,
    module_missing,
    version_key,
    version_tuple,
)


@dataclasses.dataclass(frozen=True)
class Availability:
    available: bool
    reasons: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return self.available


@dataclasses.dataclass(frozen=True)
class BackendDescriptor:
    """One backend, as a plugin declares it.

    ``name``: the canonical name. ``factory``: ``"module:function"`` (or a
    callable) taking a ``BuildContext`` and returning ``(effective_name,
    backend)``. ``capabilities``: the claimed envelope. ``probe``: says why the
    backend is unavailable on a host (light: look for a module with
    ``importlib.util.find_spec``, read ``HostInfo``; never import the kernel
    library). ``aliases``: other names for it; ``deprecated_aliases`` map an
    old name to this one with a ``DeprecationWarning``. ``priority``: per
    platform (``{"cpu": 10, "cuda": 50}``) or a callable of ``HostInfo``;
    ``None``/missing means "never a default here". ``library`` and
    ``min_library_version``: the kernel-library distribution and its floor.
    ``delegates_to``: other distributions' backend names the factory may
    answer with (an explicit delegation; see ``Registry.build``).
    ``kv_layout_factories``: KV-cache layouts this plugin defines, ``{name:
    "module:attr"}`` naming a ``kvlayout.KVLayout`` subclass (imported only when
    a cache is allocated in it; ``Registry.kv_layout``).
    ``conformance_level``: the conformance level (``"MAJOR.MINOR"``) its publisher ran
    ``pytest --backend=<name> --conformance-level=...`` at; ``attnplug doctor`` shows it.
    ``distribution`` and ``version`` are filled in by the registry. Every
    field's type is checked when the plugin registers the descriptor
    (``descriptor_problems``).
    """

    name: str
    factory: str | Callable[..., Any]
    capabilities: Capabilities = Capabilities()
    probe: Probe | None = None
    aliases: tuple[str, ...] = ()
    deprecated_aliases: tuple[str, ...] = ()
    priority: Any = dataclasses.field(default_factory=dict)
    library: str | None = None
    min_library_version: str | None = None
    description: str = ""
    #: canonical names of *other* distributions' backends this factory may answer with (a
    #: declared delegation); without it a factory may only answer names of its own distribution
    delegates_to: tuple[str, ...] = ()
    kv_layout_factories: Mapping[str, str] = dataclasses.field(default_factory=dict)
    #: the conformance level the publisher checked it at (docs/conformance.md#conformance-levels)
    conformance_level: str | None = None
    distribution: str = ""
    version: str = ""

    def __post_init__(self) -> None:
        # lists become tuples; anything else (a bare string!) is kept as given and refused
        # by ``descriptor_problems`` at registration, never split into characters
        for name in ("aliases", "deprecated_aliases", "delegates_to"):
            value = getattr(self, name)
            if isinstance(value, list):
                object.__setattr__(self, name, tuple(value))

    def all_aliases(self) -> tuple[str, ...]:
        """Aliases and deprecated aliases together."""
        return self.aliases + self.deprecated_aliases

    def priority_on(self, host: HostInfo) -> int | None:
        """The default priority on ``host`` (``None``: never a default there).

        A priority function that raises, or returns anything but an ``int`` or
        ``None``, is a ``PluginError`` naming this descriptor's distribution.
        """
        if callable(self.priority):
            value, out = call_plugin(self.distribution, f"priority function of backend {self.name!r}",
                                     self.priority, host)
            echo_output(self.distribution, f"priority function of backend {self.name!r}", out)
        else:
            value = dict(self.priority).get(host.platform)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise PluginError(self.distribution, f"backend {self.name!r}: field 'priority' gave {value!r} "
                              f"({type(value).__name__}) on {host.platform}; expected an int or None")
        return value

    def check_availability(self, host: HostInfo) -> Availability:
        """Run the probe; a probe that raises makes the backend unavailable with that error as the reason."""
        reasons: list[str] = []
        devices = self.capabilities.devices
        if host.platform not in devices and "cpu" not in devices:  # every host has a CPU
            reasons.append(f"needs a {'/'.join(self.capabilities.devices)} device; this host is {host.platform}")
        cc_min = self.capabilities.min_compute_capability
        if cc_min is not None and host.platform == "cuda" and host.compute_capability is not None:
            if tuple(host.compute_capability) < tuple(cc_min):
                reasons.append(
                    f"needs compute capability >= {cc_min[0]}.{cc_min[1]}; "
                    f"this GPU is {host.compute_capability[0]}.{host.compute_capability[1]}"
                )
        if self.probe is not None:
            what = f"availability probe of backend {self.name!r}"
            try:
                found, out = call_plugin(self.distribution, what, self.probe, host)
            except PluginError as exc:  # a failing probe is a reason in words, not a crash
                cause = exc.__cause__ if exc.__cause__ is not None else exc
                reasons.append(f"availability probe raised {describe_exception(cause)}")
            else:
                echo_output(self.distribution, what, out)
                reasons.extend(probe_reasons(self, found))
        return Availability(not reasons, tuple(reasons))

    def library_floor_problem(self, host: HostInfo) -> str | None:
        """A sentence when the installed kernel library is older than the declared floor."""
        if not self.library or not self.min_library_version:
            return None
        found = installed_library(host, self.library)
        if found is None:
            return None  # absence is an availability matter, reported by the probe
        dist, have = found
        if version_key(have) < version_key(self.min_library_version):
            named = self.library if dist == self.library else f"{self.library} (installed as {dist})"
            return (
                f"backend {self.name!r} ({self.distribution}) needs {named} >= "
                f"{self.min_library_version}, found {have}"
            )
        return None

    def load_factory(self) -> Callable[..., Any]:
        """Import and return the factory named by ``factory`` (``"module:function"``), or the callable itself."""
        if callable(self.factory):
            return self.factory
        module_name, _, attr = self.factory.partition(":")
        module = importlib.import_module(module_name)
        factory: Callable[..., Any] = getattr(module, attr)
        if not callable(factory):
            raise TypeError(f"{self.factory!r} is a {type(factory).__name__}, not a callable")
        return factory

    def to_dict(self) -> dict[str, Any]:
        """The descriptor as JSON-ready data (the probe and factory by name)."""
        return {
            "name": self.name,
            "distribution": self.distribution,
            "version": self.version,
            "aliases": list(self.aliases),
            "deprecated_aliases": list(self.deprecated_aliases),
            "delegates_to": list(self.delegates_to),
            "kv_layout_factories": dict(self.kv_layout_factories),
            "factory": self.factory if isinstance(self.factory, str) else repr(self.factory),
            "library": self.library,
            "min_library_version": self.min_library_version,
            "description": self.description,
            "conformance_level": self.conformance_level,
            "capabilities": self.capabilities.to_dict(),
        }


def probe_reasons(desc: "BackendDescriptor", found: Any) -> list[str]:
    """A probe's answer as reasons: ``None`` or a list/tuple of ``str``; anything else is a
    ``PluginError`` naming the field, the expected type and the distribution."""
    if found is None:
        return []
    if isinstance(found, (list, tuple)) and all(isinstance(r, str) for r in found):
        return list(found)
    raise PluginError(desc.distribution, f"backend {desc.name!r}: field 'probe' returned {found!r} "
                      f"({type(found).__name__}); expected a list of reason strings (empty when available)")


def _is_names(value: Any) -> bool:
    return isinstance(value, tuple) and all(isinstance(v, str) and v for v in value)


def _type_of(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def descriptor_problems(d: "BackendDescriptor") -> list[str]:
    """Every field of ``d`` with the wrong type, as ``"field 'x': expected ..., got ..."``.

    Run by the registry when a plugin registers ``d``: a descriptor with any
    problem sets its plugin aside. Callables (probe, priority function,
    factory) are checked again for what they return when they are called.
    """
    out: list[str] = []

    def bad(field: str, expected: str, value: Any) -> None:
        out.append(f"field {field!r}: expected {expected}, got {_type_of(value)}")

    if not isinstance(d.name, str):
        bad("name", "a str", d.name)
    if not (callable(d.factory) or (isinstance(d.factory, str) and ":" in d.factory)):
        bad("factory", "a 'module:function' str or a callable", d.factory)
    if not isinstance(d.capabilities, Capabilities):
        bad("capabilities", "an attnplug.Capabilities", d.capabilities)
    else:
        out.extend(capabilities_problems(d.capabilities))
    if d.probe is not None and not callable(d.probe):
        bad("probe", "a callable probe(host) -> list[str], or None", d.probe)
    for field in ("aliases", "deprecated_aliases", "delegates_to"):
        if not _is_names(getattr(d, field)):
            bad(field, "a tuple of non-empty str names", getattr(d, field))
    prio = d.priority
    if prio is None:
        pass
    elif isinstance(prio, Mapping):
        for key, value in prio.items():
            if key not in PLATFORMS:
                out.append(f"field 'priority': key {key!r} is not a platform (expected one of {PLATFORMS})")
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                bad(f"priority[{key!r}]", "an int or None", value)
    elif not callable(prio):
        bad("priority", "a dict {platform: int} or a callable priority(host) -> int | None", prio)
    for field in ("library", "min_library_version"):
        value = getattr(d, field)
        if value is not None and not isinstance(value, str):
            bad(field, "a str or None", value)
    if not isinstance(d.description, str):
        bad("description", "a str", d.description)
    level = d.conformance_level
    if level is not None and not (isinstance(level, str) and re.fullmatch(r"\d+\.\d+", level)):
        bad("conformance_level", "a 'MAJOR.MINOR' str such as '0.1', or None", level)
    layouts = d.kv_layout_factories
    if not (isinstance(layouts, Mapping) and all(
            isinstance(k, str) and k and isinstance(v, str) and ":" in v for k, v in layouts.items())):
        bad("kv_layout_factories", "a dict {layout name: 'module:attr'}", layouts)
    return out


_BOOL_CAPS = ("v_head_dim_differs", "gqa", "mqa", "sliding_window", "logit_softcap", "sinks", "cross_attention",
              "bidirectional", "speculative_verify", "draft_extend", "cuda_graph", "deterministic")


def capabilities_problems(caps: Capabilities) -> list[str]:
    """Fields of a ``Capabilities`` with the wrong type (it is plain data; nothing checks it on construction)."""
    out: list[str] = []

    def bad(field: str, expected: str) -> None:
        out.append(f"field 'capabilities.{field}': expected {expected}, got {_type_of(getattr(caps, field))}")

    for field in _BOOL_CAPS:
        if not isinstance(getattr(caps, field), bool):
            bad(field, "a bool")
    for field in ("head_dims", "page_sizes", "sinks_sms"):
        value = getattr(caps, field)
        if value is not None and not (isinstance(value, tuple) and value and all(
                isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)):
            bad(field, "None (any) or a non-empty tuple of positive ints")
    m = caps.head_dim_multiple_of
    if m is not None and not (isinstance(m, int) and not isinstance(m, bool) and m > 0):
        bad("head_dim_multiple_of", "None (no rule) or a positive int")
    if not (isinstance(caps.devices, tuple) and caps.devices and all(d in PLATFORMS for d in caps.devices)):
        bad("devices", f"a non-empty tuple of platforms from {PLATFORMS}")
    lay = caps.kv_layouts
    if lay is not None and not (isinstance(lay, tuple) and lay and all(isinstance(x, str) and x for x in lay)):
        bad("kv_layouts", "None (any layout, through read_kv/set_kv) or a non-empty tuple of layout names")
    forms = caps.mla_forms
    if not (hasattr(forms, "items") and all(
            kind in MLA_MODE_KINDS and isinstance(f, tuple) and all(x in MLA_FORMS for x in f)
            for kind, f in forms.items())):
        bad("mla_forms", f"a mapping from {'/'.join(MLA_MODE_KINDS)} to a tuple of forms from {MLA_FORMS}")
    cc = caps.min_compute_capability
    if cc is not None and not (isinstance(cc, tuple) and len(cc) == 2 and all(
            isinstance(v, int) and not isinstance(v, bool) for v in cc)):
        bad("min_compute_capability", "None or (major, minor) ints")
    return out
