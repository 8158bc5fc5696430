"""The table of KV layouts: the core's (``kvlayout.BUILTIN_LAYOUTS``) and those plugins define.

A plugin names its layouts in ``BackendDescriptor.kv_layout_factories`` (``{name: "module:attr"}``);
the registry records each claim here (``claim``). Two distributions defining one name, or a plugin
redefining a core layout, make it unusable, naming both. ``get`` imports a plugin's layout on first
use, as plugin code (``isolation``), and checks it is a ``KVLayout`` of that name.
"""

from __future__ import annotations

from typing import Any

from .errors import ConfigError, PluginError
from .isolation import call_plugin, echo_output
from .kvlayout import BUILTIN_LAYOUTS, KVLayout, builtin_layout

__all__ = ["LayoutTable"]


class LayoutTable:
    """KV layouts by name: who defines each, the unusable ones and why, the ones built so far."""

    def __init__(self) -> None:
        #: name -> (distribution, "module:attr") of the layouts plugins define
        self.sources: dict[str, tuple[str, str]] = {}
        #: name -> why it is unusable
        self.conflicts: dict[str, str] = {}
        self._built: dict[str, KVLayout] = {}

    def claim(self, name: str, path: str, dist: str) -> None:
        """Record ``dist``'s definition of KV layout ``name``; a clash makes it unusable, naming both."""
        if name in BUILTIN_LAYOUTS:
            self.conflicts[name] = f"plugin {dist!r} redefines the core's layout {name!r} (ignored)"
            return
        owner = self.sources.get(name)
        if owner is not None and owner != (dist, path):
            self.conflicts[name] = (f"KV layout {name!r} is defined by both {owner[0]!r} ({owner[1]}) and "
                                     f"{dist!r} ({path}); neither is used")
            return
        if name not in self.conflicts:
            self.sources[name] = (dist, path)

    def names(self) -> dict[str, str]:
        """Every usable KV layout: name -> who defines it (``"core"`` or a distribution)."""
        out = {n: "core" for n in BUILTIN_LAYOUTS}
        out.update({n: dist for n, (dist, _) in self.sources.items() if n not in self.conflicts})
        return out

    def get(self, name: str) -> KVLayout:
        """The ``KVLayout`` called ``name`` (the core's, or a plugin's, imported on first use)."""
        if name in BUILTIN_LAYOUTS:
            return builtin_layout(name)
        if name in self._built:
            return self._built[name]
        if name in self.conflicts:
            raise ConfigError(self.conflicts[name])
        if name not in self.sources:
            raise ConfigError(f"KV layout {name!r} is not defined by the core or any installed plugin (known: "
                              f"{', '.join(sorted(self.names()))})")
        dist, path = self.sources[name]
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
        self._built[name] = layout
        return layout
