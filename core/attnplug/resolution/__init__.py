"""The resolution chain: from user configuration, architecture and host to a resolved pair.

``resolve(config, arch=None, host=None, registry=None) -> Resolution`` runs
the user's choices through per-architecture overrides, forcing rules, the
platform default fill, compatibility fallback and the checks. It returns a
new ``AttentionConfig`` plus a record of every declaration, and writes no
global state. See ``docs/resolution.md``.
"""

from __future__ import annotations

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
    "host_view",
    "resolve",
    "trace",
]

