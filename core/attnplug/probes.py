"""What is installed on a host, for plugin descriptors and kernel modules (a public namespace).

Light helpers: none imports torch or a kernel library. ``module_missing`` and
``library_missing`` build availability probes; ``installed_library`` says which
distribution of a same-module family (sgl-kernel / sglang-kernel /
sglang-kernel-cpu; amd-aiter) a host record holds; ``module_provider`` finds
the installed distribution whose files hold a module; ``version_tuple`` and
``version_key`` order versions for library floors (``version_key`` tells
``0.3.4.post1`` from ``0.3.4``).
"""

from __future__ import annotations

from .descriptor import installed_library, library_missing, module_missing, version_key, version_tuple
from .host import SAME_MODULE_DISTRIBUTIONS, module_provider

__all__ = [
    "SAME_MODULE_DISTRIBUTIONS",
    "installed_library",
    "library_missing",
    "module_missing",
    "module_provider",
    "version_key",
    "version_tuple",
]
