"""Every exception attnplug raises.

Each error names the thing at fault (the backend, the plugin's distribution,
the field) and, where there is one, the remedy. User-facing checks raise
these; they never use ``assert``.
"""

from __future__ import annotations

__all__ = [
    "AttnplugError", "BackendConflictError", "BackendUnavailableError", "ConfigError", "HostInfoError",
    "KVLayoutError", "MetadataNotInitializedError", "NoForwardContextError", "NotSupportedError",
    "PluginError", "PluginFilterError", "ResourceLimitError", "ShapeError", "UnknownBackendError",
]


class AttnplugError(Exception):
    """Base class of every attnplug error."""


class ConfigError(AttnplugError, ValueError):
    """An attention configuration value is invalid (names the field)."""


class PluginFilterError(ConfigError):
    """``ATTNPLUG_PLUGINS`` / ``ATTNPLUG_DISABLE_PLUGINS`` is malformed (e.g. set but naming nothing)."""


class HostInfoError(ConfigError):
    """A recorded host (``ATTNPLUG_HOST_JSON``, ``--host-json``, ``HostInfo(...)``) is malformed.

    The message names the source (variable or flag), the file, the field and the expected type.
    """


class PluginError(AttnplugError):
    """A plugin broke its contract. Carries the distribution at fault."""

    def __init__(self, distribution: str, message: str) -> None:
        self.distribution = distribution
        #: the message without the distribution prefix
        self.detail = message
        super().__init__(f"plugin distribution {distribution!r}: {message}")


class BackendConflictError(PluginError):
    """Two distributions register the same backend name or alias."""

    def __init__(self, name: str, first: str, second: str, what: str = "backend name") -> None:
        self.name = name
        self.distributions = (first, second)
        #: ``"backend name"`` or ``"alias"``
        self.what = what
        AttnplugError.__init__(
            self,
            f"{what} {name!r} is registered by two distributions: {first!r} and {second!r}; "
            f"uninstall one, or filter with ATTNPLUG_DISABLE_PLUGINS",
        )
        self.distribution = second
        self.detail = str(self)


class UnknownBackendError(AttnplugError, KeyError):
    """A backend name is neither registered nor an alias."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class BackendUnavailableError(AttnplugError):
    """A registered backend cannot run on this host (carries the reasons)."""

    def __init__(self, name: str, reasons: list[str] | tuple[str, ...], hint: str = "") -> None:
        self.name = name
        self.reasons = tuple(reasons)
        msg = f"attention backend {name!r} is unavailable on this host: " + "; ".join(self.reasons)
        if hint:
            msg += f". {hint}"
        super().__init__(msg)


class NotSupportedError(AttnplugError, ValueError):
    """A backend cannot serve a given layer/configuration (carries the reasons)."""

    def __init__(self, name: str, reasons: list[str] | tuple[str, ...], what: str = "this layer") -> None:
        self.name = name
        self.reasons = tuple(reasons)
        super().__init__(f"attention backend {name!r} does not support {what}: " + "; ".join(self.reasons))


class ShapeError(AttnplugError, ValueError):
    """A tensor has the wrong shape or dtype; the message names the field, expected vs actual."""


class KVLayoutError(AttnplugError, ValueError):
    """The KV cache is in another layout than the caller reads (names both layouts and the way out)."""


class MetadataNotInitializedError(AttnplugError, RuntimeError):
    """``forward`` was called before ``init_forward_metadata`` for this batch."""


class NoForwardContextError(AttnplugError, RuntimeError):
    """Model code asked for the current backend outside any forward (or outside this runner's)."""


class ResourceLimitError(AttnplugError, MemoryError):
    """Work would exceed a documented size limit; names the limit and the setting that raises it."""
