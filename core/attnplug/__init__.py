"""attnplug: a pluggable attention-backend framework for LLM serving engines.

The public names are re-exported lazily, so ``import attnplug`` loads neither
torch nor any plugin; torch is imported only by the modules that need it
(``batch``, ``kvcache``) when they are first used.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    "AttentionBackend": "backend",
    "OPTIONAL_METHODS": "backend",
    "MetadataGuard": "backend",
    "PagedBackend": "paged",
    "AttentionConfig": "config",
    "add_attention_args": "config",
    "config_from_args": "config",
    "ForwardMode": "modes",
    "half_for_mode": "selector",
    "backend_name_for_mode": "selector",
    "Capabilities": "capabilities",
    "support_reasons": "capabilities",
    "LayerSpec": "layer",
    "BuildContext": "context",
    "HostInfo": "host",
    "detect_host": "host",
    "BackendDescriptor": "descriptor",
    "Availability": "descriptor",
    "module_missing": "descriptor",
    "hookimpl": "hookspecs",
    "Registry": "registry",
    "default_registry": "registry",
    "HybridBackend": "hybrid",
    "BackendWrapper": "wrapper",
    "stamp": "stamps",
    "copy_stamps": "stamps",
    "ForwardBatch": "batch",
    "PagedKVCache": "kvcache",
    "PageAllocator": "kvcache",
    "AttnplugError": "errors",
    "ResourceLimitError": "errors",
    "PluginError": "errors",
    "BackendConflictError": "errors",
    "UnknownBackendError": "errors",
    "BackendUnavailableError": "errors",
    "NotSupportedError": "errors",
    "ShapeError": "errors",
    "MetadataNotInitializedError": "errors",
    "ConfigError": "errors",
    "NoForwardContextError": "errors",
    "build_draft_backends": "speculative",
    "DraftBackends": "speculative",
    "MultiStepDraftBackend": "speculative",
    "SidecarWrapper": "speculative",
    "kernel_for_forward": "speculative",
    "draft_backend_name": "speculative",
    "target_verify_backend_name": "speculative",
    "current_backend": "forward_context",
    "ForwardFrame": "forward_context",
    "library_missing": "descriptor",
    "assert_no_base_field_reads": "guard",
    "find_base_field_reads": "guard",
    "GuardError": "guard",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'attnplug' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
