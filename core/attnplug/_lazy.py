"""Lazy re-exports (PEP 562) for a package's public names: each name's module is imported on first use,
so importing the package stays cheap (``import attnplug`` loads no torch; the transformers integration
loads no transformers until a name is used)."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(package: str, exports: Mapping[str, str], namespace: dict[str, Any],
                 names: list[str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of ``package``: ``exports`` maps a public name to the submodule
    (relative to ``package``) that defines it; a name, once loaded, is kept in ``namespace`` (the package's
    globals) so later lookups never reach ``__getattr__``; ``dir()`` lists ``names`` (its ``__all__``)."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f".{module}", package), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return names

    return __getattr__, __dir__
