"""The resolution chain: from user configuration, architecture and host to a resolved pair.

``resolve(config, arch=None, host=None, registry=None) -> Resolution`` runs
the user's choices through per-architecture overrides, forcing rules, the
platform default fill, compatibility fallback and the checks. It returns a
new ``AttentionConfig`` plus a record of every declaration, and writes no
global state. See ``docs/resolution.md``.
"""

from __future__ import annotations

from typing import Any

from .chain import host_view, resolve, trace
from .explain import Candidate, Resolution
from .passes import DEFAULT_PASSES
from .vocabulary import AUTO, ArchOverride, Declaration, Pass, Record, ResolutionRule

__all__ = [
    "AUTO",
    "DEFAULT_PASSES",
    "ArchOverride",
    "Candidate",
    "Declaration",
    "Pass",
    "Record",
    "Resolution",
    "ResolutionRule",
    "collect_arch_overrides",
    "collect_resolution_rules",
    "host_view",
    "resolve",
    "trace",
]


def __getattr__(name: str) -> Any:
    # the collectors run plugin hooks: they belong to settling a host (attnplug.settle), imported
    # only when asked for, so resolution's own modules never import the registry's world
    if name in ("collect_arch_overrides", "collect_resolution_rules"):
        from .. import settle

        return getattr(settle, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
