"""The resolution chain: from user configuration, architecture and host to a resolved pair.

``resolve(config, arch=None, host=None, registry=None) -> Resolution`` runs
the user's choices through per-architecture overrides, forcing rules, the
platform default fill, compatibility fallback and the checks. It returns a
new ``AttentionConfig`` plus a record of every declaration, and writes no
global state. See ``docs/resolution.md``.
"""

from __future__ import annotations

from .chain import resolve, trace
from .explain import Candidate, Resolution
from .passes import (
    AUTO,
    DEFAULT_PASSES,
    ArchOverride,
    Declaration,
    Pass,
    Record,
    ResolutionRule,
    collect_arch_overrides,
    collect_resolution_rules,
)

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
    "resolve",
    "trace",
]
