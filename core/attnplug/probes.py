"""What is installed on a host, for plugin descriptors and kernel modules (a public namespace).

Light helpers: none imports torch or a kernel library. ``module_missing`` and
``library_missing`` build availability probes; ``installed_library`` says which
distribution of a same-module family (sgl-kernel / sglang-kernel /
sglang-kernel-cpu; amd-aiter) a host record holds; ``module_provider`` finds
the installed distribution whose files hold a module; ``version_tuple`` and
``version_key`` order versions for library floors (``version_key`` tells
``0.3.4.post1`` from ``0.3.4``). ``fp8_kv_sm_problems`` is the configuration
check of a plugin whose fp8 KV path is built for some GPUs only.
"""

from __future__ import annotations

import importlib.util
import re
from typing import TYPE_CHECKING, Any, Callable

from .dtypes import kv_dtype_name
from .host import SAME_MODULE_DISTRIBUTIONS, HostInfo, equivalent_distributions, module_provider

if TYPE_CHECKING:
    from .config import AttentionConfig

__all__ = [
    "SAME_MODULE_DISTRIBUTIONS",
    "Probe",
    "fp8_kv_sm_problems",
    "installed_library",
    "library_missing",
    "module_missing",
    "module_provider",
    "version_key",
    "version_tuple",
]

#: ``probe(host) -> reasons``; an empty list means available.
Probe = Callable[[HostInfo], "list[str]"]


def module_missing(module: str, install_hint: str = "") -> Probe:
    """A probe: unavailable when ``module`` cannot be found (checked with find_spec; not imported)."""

    def probe(host: HostInfo) -> list[str]:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError) as exc:
            return [f"{type(exc).__name__} while looking for module {module!r}: {exc}"]
        if found:
            return []
        msg = f"ModuleNotFoundError: No module named {module!r}"
        return [msg + (f" ({install_hint})" if install_hint else "")]

    return probe


def installed_library(host: HostInfo, distribution: str) -> tuple[str, str] | None:
    """``(distribution, version)`` of whichever distribution providing ``distribution``'s module is
    installed on ``host`` (``sgl-kernel`` is also found as ``sglang-kernel`` / ``sglang-kernel-cpu``;
    see ``host.SAME_MODULE_DISTRIBUTIONS``), or ``None``."""
    for name in equivalent_distributions(distribution):
        version = host.library_version(name)
        if version is not None:
            return name, version
    return None


def library_missing(distribution: str, install_hint: str = "") -> Probe:
    """A probe that reads ``HostInfo.libraries`` (so it also answers for a recorded host,
    ``--host-json``): unavailable when no distribution providing ``distribution``'s module
    is installed there (any name of its ``SAME_MODULE_DISTRIBUTIONS`` group counts)."""

    def probe(host: HostInfo) -> list[str]:
        if installed_library(host, distribution) is not None:
            return []
        names = equivalent_distributions(distribution)
        which = repr(distribution) if len(names) == 1 else " / ".join(repr(n) for n in names)
        msg = f"kernel library {which} is not installed"
        return [msg + (f" ({install_hint})" if install_hint else "")]

    return probe


def fp8_kv_sm_problems(name: str, config: AttentionConfig, host: HostInfo, sms: tuple[int, ...], runs_on: str,
                       advice: str = "") -> list[str]:
    """Why a configuration using backend ``name`` (either half) cannot keep an fp8 KV cache on ``host``: a
    CUDA GPU whose SM is not in ``sms``, the GPUs the backend's fp8 path is built for (an unknown SM is not
    refused). ``runs_on`` words where that path runs (``"... runs on Hopper (SM90)"``), ``advice`` what to
    do instead. A plugin's ``attnplug_check_config`` returns it."""
    if name not in config.attention_backends() or host.platform != "cuda":
        return []
    kv = kv_dtype_name(config.kv_cache_dtype, config.dtype)
    sm = host.sm()
    if kv is None or not kv.startswith("float8") or sm is None or sm in sms:
        return []
    return [f"kv_cache_dtype={kv} with attention backend {name!r}: {runs_on} only; this GPU is SM{sm}"
            + (f". {advice}" if advice else "")]


def version_tuple(text: str) -> tuple[int, ...]:
    """The leading numeric release segments: ``"0.5.0rc1+cu128"`` -> ``(0, 5, 0)``,
    ``"0.1.10.post1"`` -> ``(0, 1, 10)``. Enough to compare against a floor."""
    out: list[int] = []
    for part in text.split("+", 1)[0].split("."):
        digits = ""
        for ch in part:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            break
        out.append(int(digits))
        if digits != part:
            break
    return tuple(out)


def version_key(text: str) -> tuple[Any, ...]:
    """A sort key that orders releases as PEP 440 does for the forms kernel libraries use:
    ``0.3.4rc1 < 0.3.4 < 0.3.4.post1 < 0.3.5``; a local tag (``+cu128``) is ignored. Unlike
    ``version_tuple`` it tells a ``.postN`` floor (sgl-kernel 0.3.4.post1) from its base release."""
    m = re.match(r"^\s*v?(\d+(?:\.\d+)*)(?:[-_.]?(a|b|rc|alpha|beta|c)[-_.]?(\d*))?"
                 r"(?:[-_.]?(post|rev|r)[-_.]?(\d*))?(?:[-_.]?(dev)[-_.]?(\d*))?", text.split("+", 1)[0].lower())
    if not m:
        return (version_tuple(text), 0, 0, 0)
    release = tuple(int(x) for x in m.group(1).split("."))
    while len(release) > 1 and release[-1] == 0:
        release = release[:-1]
    pre_rank = {"a": -3, "alpha": -3, "b": -2, "beta": -2, "rc": -1, "c": -1}.get(m.group(2) or "", 0)
    pre = (pre_rank, int(m.group(3) or 0)) if m.group(2) else (0, 0)
    post = int(m.group(5) or 0) + 1 if m.group(4) else 0
    dev = -1 if m.group(6) else 0
    return (release, pre, post, dev)
