"""In-process stand-ins for the GPU/CPU kernel plugins, for the resolution tests.

Each module is one plugin "distribution" with realistic capabilities, probes
(read from ``HostInfo``, so any machine can be described by hand) and
priorities, and carries its part of the gpt-oss family's overrides: each
plugin declares only overrides that pick its own backend. ``registry(host)``
loads them together with the real ``attnplug-torch-native`` descriptor.
"""

from __future__ import annotations

from typing import Any

from attnplug.host import HostInfo
from attnplug.registry import PluginSource, Registry, in_process_source

from . import aiter, fa3, flashinfer, intel_amx, triton, trtllm_mha

PLUGINS = {
    "attnplug-fa3": fa3,
    "attnplug-flashinfer": flashinfer,
    "attnplug-trtllm-mha": trtllm_mha,
    "attnplug-aiter": aiter,
    "attnplug-intel-amx": intel_amx,
    "attnplug-triton": triton,
}

GPT_OSS = "GptOssForCausalLM"


def sources(*extra: Any, only: tuple[str, ...] | None = None) -> list[PluginSource]:
    import attnplug_torch_native

    out = [in_process_source(attnplug_torch_native, "attnplug-torch-native", "0.1.0")]
    for dist, module in PLUGINS.items():
        if only is None or dist in only:
            out.append(in_process_source(module, dist, "1.0.0"))
    out.extend(extra)
    return out


def registry(host: HostInfo | None = None, *extra: Any, only: tuple[str, ...] | None = None) -> Registry:
    reg = Registry(host=host)
    reg.load_sources(sources(*extra, only=only))
    return reg
