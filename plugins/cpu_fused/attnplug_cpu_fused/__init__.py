"""Descriptor module of the ``cpu_fused`` backend (light: no torch import here).

``cpu_fused`` is the fused C++ CPU kernel (``csrc/attention.cpp``): paged attention in one pass over
the cache, compiled at install once per instruction set and registered as the torch op
``attnplug_cpu_fused::attend``. The kernel module ``attnplug_cpu_fused.backend`` is imported only when
the backend is built.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import platform
from typing import Any

from attnplug import BackendDescriptor, hookimpl
from attnplug_torch_native import CAPABILITIES as TORCH_NATIVE_CAPABILITIES

NAME = "cpu_fused"
#: rows of 16 floats: the kernel's head dims (K and V) are multiples of this
HEAD_DIM_MULTIPLE = 16

#: torch_native's envelope: what the kernel does not take runs torch_native's paths (this backend subclasses
#: torch_native's; e.g. bidirectional layers, since the kernel masks causally), narrowed to what the
#: kernel's in-place reads allow
CAPABILITIES = dataclasses.replace(
    TORCH_NATIVE_CAPABILITIES,
    # the kernel reads the model dtype as stored, or fp8 (stored * the layer's scale, widened in registers)
    kv_cache_dtype_follows_model=True,
    # rows are read in place through req_to_token: the core's nhd layout only
    kv_layouts=("nhd",),
    head_dim_multiple_of=HEAD_DIM_MULTIPLE,
    devices=("cpu",),
    mla_forms={},  # no MLA claim: torch_native serves MLA models
)


def _library_built() -> bool:
    here = os.path.dirname(os.path.abspath(__file__))
    return bool(glob.glob(os.path.join(here, "_C*.so")))


def probe(host: Any) -> list[str]:
    """Why cpu_fused cannot run on ``host``, in words (looks for the compiled library; imports nothing)."""
    reasons: list[str] = []
    if host.platform != "cpu":
        reasons.append(f"serves CPU hosts (the fused C++ CPU kernel); this host is {host.platform}")
    machine = platform.machine().lower()
    if machine not in ("x86_64", "amd64"):
        reasons.append(f"no compiled kernel for this CPU / platform: the kernel is built for x86-64 only (this "
                       f"machine: {platform.machine()})")
    elif not _library_built():
        reasons.append("no compiled kernel for this CPU / platform: attnplug_cpu_fused/_C*.so is missing (installed "
                       "without its extension; reinstall attnplug-cpu-fused with a C++ compiler, or from a wheel)")
    return reasons


@hookimpl
def attnplug_register_backends(register):  # type: ignore[no-untyped-def]
    register(
        BackendDescriptor(
            name=NAME,
            factory="attnplug_cpu_fused.backend:create",
            capabilities=CAPABILITIES,
            conformance_level="0.4",  # MLA cases skip: no MLA claim (torch_native serves MLA models)
            probe=probe,
            # above torch_native (10) and vllm_cpu (20) on CPU: it measured faster than vLLM's CPU op in
            # decode (docs/performance.md, "cpu_fused and vllm_cpu"); below intel_amx (30) on AMX hosts
            priority={"cpu": 25},
            library="torch",
            description=("the fused C++ CPU kernel: paged attention in one pass over the nhd cache (AVX-512 BF16, "
                         "AVX-512, AVX2 or portable, chosen at load), built at install, a torch op; long extends "
                         "and what it does not take through torch_native's paths"),
        )
    )
