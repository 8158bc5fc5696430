"""attnplug: a pluggable attention-backend framework for LLM serving engines.

The public names are re-exported lazily, so ``import attnplug`` loads neither
torch nor any plugin; torch is imported only by the modules that need it
(``batch``, ``kvcache``) when they are first used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._lazy import lazy_exports

__version__ = "0.4.0"

if TYPE_CHECKING:  # the same names for type checkers; at run time they load on first use
    from .backend import AttentionBackend as AttentionBackend
    from .batch import ForwardBatch as ForwardBatch
    from .build_context import BuildContext as BuildContext
    from .capabilities import Capabilities as Capabilities
    from .config import AttentionConfig as AttentionConfig
    from .descriptor import Availability as Availability, BackendDescriptor as BackendDescriptor
    from .errors import AttnplugError as AttnplugError
    from .errors import NotSupportedError as NotSupportedError
    from .errors import ShapeError as ShapeError
    from .hookspecs import hookimpl as hookimpl
    from .host import HostInfo as HostInfo
    from .hybrid import HybridBackend as HybridBackend
    from .kvcache import PageAllocator as PageAllocator, PagedKVCache as PagedKVCache
    from .layer import LayerSpec as LayerSpec
    from .modes import ForwardMode as ForwardMode
    from .paged import PagedBackend as PagedBackend
    from .registry import Registry as Registry, default_registry as default_registry
    from .resolution import resolve as resolve
    from .wrapper import BackendWrapper as BackendWrapper


#: The public surface: what a host engine and a backend author need (see docs/api.md).
#: Everything else lives in namespaces imported on purpose (``PUBLIC_NAMESPACES``):
#: ``attnplug.errors`` (every exception), ``attnplug.speculative``, ``attnplug.guard``,
#: ``attnplug.resolution``, ``attnplug.dtypes``, ``attnplug.testing`` (the conformance suite
#: and reference), ``attnplug.capabilities`` (``support_reasons``), ``attnplug.kvcache``
#: (``indptr``, ``UNASSIGNED``), ``attnplug.kvlayout`` (``KVLayout`` and the KV-cache layouts),
#: ``attnplug.probes`` (installed-library helpers: ``module_missing``, ``library_missing``,
#: ``version_tuple``), ``attnplug.config`` (``add_attention_args``, ``config_from_args``),
#: ``attnplug.selector`` (``half_for_mode``, ``backend_name_for_mode``), ``attnplug.host``
#: (``detect_host``), ``attnplug.hookspecs`` (the typed ``Register*`` callables a plugin's hooks
#: receive), ``attnplug.stamps`` (``stamp``, ``copy_stamps``),
#: ``attnplug.layer`` (``MLASpec``, the MLA forms).
_EXPORTS: dict[str, str] = {
    # configuration and choice (hosts)
    "AttentionConfig": "config",
    "ForwardMode": "modes",
    "resolve": "resolution",
    "Registry": "registry",
    "default_registry": "registry",
    "HostInfo": "host",
    # one forward (hosts and backends)
    "BuildContext": "build_context",
    "LayerSpec": "layer",
    "ForwardBatch": "batch",
    "PagedKVCache": "kvcache",
    "PageAllocator": "kvcache",
    # writing a backend
    "AttentionBackend": "backend",
    "PagedBackend": "paged",
    "BackendWrapper": "wrapper",
    "HybridBackend": "hybrid",
    "Capabilities": "capabilities",
    "BackendDescriptor": "descriptor",
    "Availability": "descriptor",
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
    "attnplug.config", "attnplug.selector", "attnplug.host", "attnplug.hookspecs", "attnplug.stamps",
)

__all__ = sorted(_EXPORTS) + ["__version__"]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals(), __all__)
