"""The plugin contract: pluggy hook specifications.

A plugin is a light *descriptor module* named by an ``attnplug.backends``
entry point. It implements any of these hooks with ``@attnplug.hookimpl``.
It must not import torch or a kernel library at import time: the kernel
module is named by ``BackendDescriptor.factory`` and imported only when the
backend is built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Protocol

import pluggy

if TYPE_CHECKING:
    from .config import AttentionConfig
    from .descriptor import BackendDescriptor
    from .host import HostInfo

__all__ = [
    "RegisterArchOverride", "RegisterBackend", "RegisterResolutionRule", "all_hook_names",
    "attnplug_arch_overrides", "attnplug_check_config", "attnplug_register_backends",
    "attnplug_resolution_rules", "attnplug_resolve_name", "hookimpl", "hookspec",
]

PROJECT = "attnplug"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


class RegisterBackend(Protocol):
    """The ``register`` callable of ``attnplug_register_backends``."""

    def __call__(self, descriptor: "BackendDescriptor") -> None: ...


class RegisterArchOverride(Protocol):
    """The ``register`` callable of ``attnplug_arch_overrides``."""

    def __call__(
        self,
        arch: "str | Iterable[str]",
        rule: "Callable[[HostInfo, AttentionConfig], Mapping[str, Any] | None]",
        *,
        name: str | None = None,
        precedence: int = 0,
        description: str | None = None,
    ) -> None: ...


class RegisterResolutionRule(Protocol):
    """The ``register`` callable of ``attnplug_resolution_rules``."""

    def __call__(
        self,
        name: str,
        stage: str,
        rule: "Callable[..., Mapping[str, Any] | None]",
        *,
        description: str | None = None,
    ) -> None: ...


@hookspec
def attnplug_register_backends(register: RegisterBackend) -> None:
    """Register this plugin's backends by calling ``register(descriptor)`` once per backend.

    ``register`` validates each descriptor at once and raises ``PluginError``
    naming this plugin's distribution when it is malformed. The registry fills
    in the distribution and version; a plugin never sets them.
    """


@hookspec
def attnplug_resolve_name(name: str, host: "HostInfo") -> "str | None":
    """Resolve a host-dependent name (e.g. ``"hybrid_cpu"``) to a canonical backend name on ``host``.

    Return ``None`` when ``name`` is not yours; anything other than a ``str``
    or ``None`` is a ``PluginError`` naming this plugin. Called at load time, once per
    (name, host); the answer is cached. Plain aliases need no hook: declare
    them in ``BackendDescriptor.aliases``.
    """


@hookspec
def attnplug_arch_overrides(register: RegisterArchOverride) -> None:
    """Declare per-architecture overrides for the resolution chain.

    Call ``register(arch_or_archs, rule, *, name=None, precedence=0,
    description=None)`` where ``rule(host, config) -> dict`` returns the
    configuration fields it declares for that architecture (or ``{}``).
    Overrides apply by ascending precedence, then distribution, then
    registration order; the last writer wins, so a family catch-all uses a
    negative precedence. A plugin declares overrides that pick *its own*
    backend. Declarations are recorded with this plugin's distribution and can
    be explained (``attnplug resolve --list-overrides``).
    """


@hookspec
def attnplug_resolution_rules(register: RegisterResolutionRule) -> None:
    """Declare compatibility-fallback and forcing rules for the resolution chain.

    Call ``register(name, stage, rule, *, description=None)``; ``stage`` is
    ``"fallback"`` or ``"force"`` and ``rule(host, config, view) -> dict``
    returns the fields it declares (``view``: the frozen ``HostView`` of ``host``,
    read-only -- names, descriptors, availability and priority there). ``force`` rules run right after the
    architecture overrides; ``fallback`` rules run after the core's
    availability fallback, so they see a pair that can run here. Rules never
    override a field the user set.
    """


@hookspec
def attnplug_check_config(config: "AttentionConfig", host: "HostInfo") -> "list[str] | None":
    """Return problems (sentences) with a resolved ``config`` on ``host``, or ``None``.

    Any problem fails resolution with a ``ValueError`` naming this plugin. A
    return value that is not ``None`` or a list of strings (a bare string, a
    dict) is a ``PluginError`` naming this plugin, never one problem per
    character.
    """


def all_hook_names() -> tuple[str, ...]:
    return tuple(n for n, v in globals().items() if n.startswith("attnplug_") and callable(v))


