"""attnplug: a pluggable attention-backend framework for LLM serving engines.

The public names are re-exported lazily, so ``import attnplug`` loads neither
torch nor any plugin; torch is imported only by the modules that need it
(``batch``, ``kvcache``) when they are first used.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.4.0"

#: The public surface: what a host engine and a backend author need (see docs/api.md).
#: Everything else lives in namespaces imported on purpose (``PUBLIC_NAMESPACES``):
#: ``attnplug.errors`` (every exception), ``attnplug.speculative``, ``attnplug.guard``,
#: ``attnplug.resolution``, ``attnplug.dtypes``, ``attnplug.testing`` (the conformance suite
#: and reference), ``attnplug.capabilities`` (``support_reasons``), ``attnplug.kvcache``
#: (``indptr``, ``UNASSIGNED``), ``attnplug.kvlayout`` (KV-cache layouts), ``attnplug.probes``
#: (installed-library helpers), ``attnplug.layer`` (``MLASpec``, the MLA forms).
_EXPORTS: dict[str, str] = {
    # configuration and choice (hosts)
    "AttentionConfig": "config",
    "add_attention_args": "config",
    "config_from_args": "config",
    "ForwardMode": "modes",
    "backend_name_for_mode": "selector",
    "half_for_mode": "selector",
    "resolve": "resolution",
    "Registry": "registry",
    "default_registry": "registry",
    "HostInfo": "host",
    "detect_host": "host",
    # one forward (hosts and backends)
    "BuildContext": "context",
    "LayerSpec": "layer",
    "ForwardBatch": "batch",
    "PagedKVCache": "kvcache",
    "PageAllocator": "kvcache",
    "KVLayout": "kvlayout",
    # writing a backend
    "AttentionBackend": "backend",
    "PagedBackend": "paged",
    "BackendWrapper": "wrapper",
    "HybridBackend": "hybrid",
    "Capabilities": "capabilities",
    "BackendDescriptor": "descriptor",
    "Availability": "descriptor",
    "module_missing": "descriptor",
    "library_missing": "descriptor",
    "version_tuple": "descriptor",
    "hookimpl": "hookspecs",
    # errors (the rest are in attnplug.errors)
    "AttnplugError": "errors",
    "ShapeError": "errors",
    "NotSupportedError": "errors",
}

#: Namespaces that are public as a whole (a plugin may import any of their names).
PUBLIC_NAMESPACES: tuple[str, ...] = (
    "attnplug.errors", "attnplug.speculative", "attnplug.guard", "attnplug.resolution",
    "attnplug.dtypes", "attnplug.testing", "attnplug.integrations", "attnplug.forward_context",
    "attnplug.capabilities", "attnplug.kvcache", "attnplug.kvlayout", "attnplug.probes", "attnplug.layer",
)

__all__ = sorted(_EXPORTS) + ["__version__"]

#: Names that were top-level before the surface was trimmed; still resolvable so old imports
#: keep working, but not public (not in ``__all__``): import them from their module instead.
_MOVED: dict[str, str] = {
    "OPTIONAL_METHODS": "backend", "MetadataGuard": "backend", "support_reasons": "capabilities",
    "stamp": "stamps", "copy_stamps": "stamps", "ResourceLimitError": "errors",
    "PluginError": "errors", "BackendConflictError": "errors", "UnknownBackendError": "errors",
    "BackendUnavailableError": "errors", "MetadataNotInitializedError": "errors", "ConfigError": "errors",
    "NoForwardContextError": "errors", "build_draft_backends": "speculative", "DraftBackends": "speculative",
    "MultiStepDraftBackend": "speculative", "SidecarWrapper": "speculative",
    "kernel_for_forward": "speculative", "draft_backend_name": "speculative",
    "target_verify_backend_name": "speculative", "current_backend": "forward_context",
    "ForwardFrame": "forward_context", "assert_no_base_field_reads": "guard",
    "find_base_field_reads": "guard", "GuardError": "guard",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name) or _MOVED.get(name)
    if module is None:
        raise AttributeError(f"module 'attnplug' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
