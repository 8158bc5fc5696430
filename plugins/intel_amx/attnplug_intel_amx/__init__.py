"""Descriptor module of the ``intel_amx`` backend: sgl-kernel's CPU attention ops on Intel AMX (light).

The ops are ``torch.ops.sgl_kernel.decode_attention_cpu`` and
``torch.ops.sgl_kernel.extend_attention_cpu`` from the CPU build of
``sgl-kernel`` (what SGLang's ``IntelAMXAttnBackend`` calls). They use AMX
tiles (brgemm) for bf16/fp16, so the CPU needs the ``amx_bf16`` and
``amx_tile`` flags (Sapphire Rapids and later). The kernel module
``attnplug_intel_amx.backend`` is imported only when the backend is built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from attnplug import BackendDescriptor, Capabilities, hookimpl
from attnplug.probes import library_missing

if TYPE_CHECKING:
    from attnplug import AttentionConfig, HostInfo
    from attnplug.hookspecs import RegisterArchOverride, RegisterBackend

NAME = "intel_amx"
LIBRARY = "sgl-kernel"
AMX_FLAGS = ("amx_bf16", "amx_tile")
#: extend_attention_cpu checks ``head_size % 32 == 0`` and ``head_size_v % 32 == 0`` (it transposes by
#: 512-bit rows; sgl-kernel/csrc/cpu/extend.cpp); a layer runs extend and decode, so both ops live by it.
HEAD_DIM_MULTIPLE = 32
#: The head dims that rule allows, as the capabilities' list (up to 1024: MLA-sized dims included).
HEAD_DIMS = tuple(range(HEAD_DIM_MULTIPLE, 1025, HEAD_DIM_MULTIPLE))

CAPABILITIES = Capabilities(
    dtypes=("float16", "bfloat16"),  # the ops dispatch on the reduced floating types only
    kv_cache_dtypes=("float16", "bfloat16"),
    kv_cache_dtype_follows_model=True,  # the ops take q and the cache in one dtype
    head_dims=HEAD_DIMS,  # multiples of 32 (the extend op's check); the V head dim: backend_reasons
    v_head_dim_differs=True,  # head_size_v is its own argument of both ops
    page_sizes=None,  # the ops read slots through req_to_token: any page size
    gqa=True,
    mqa=True,
    # window (sliding_window_size + 1 keys) and sinks (in the query's dtype): newer sgl-kernel builds whose
    # op schema has them; an older build refuses such layers in not_supported_reasons
    sliding_window=True,
    logit_softcap=True,  # logit_cap
    sinks=True,
    cross_attention=False,
    speculative_verify=False,
    draft_extend=False,
    cuda_graph=False,
    deterministic=False,
    devices=("cpu",),
)


def probe(host: HostInfo) -> list[str]:
    """Why intel_amx cannot run on ``host``, in words (reads ``HostInfo`` only)."""
    reasons: list[str] = []
    missing = [f for f in AMX_FLAGS if f not in host.cpu_flags]
    if missing:
        reasons.append(f"needs AMX (cpu flags {' and '.join(AMX_FLAGS)}); this CPU lacks {', '.join(missing)}")
    # any of sgl-kernel / sglang-kernel / sglang-kernel-cpu (the CPU build's upstream packaging name)
    reasons.extend(library_missing(LIBRARY, "the CPU build of sgl-kernel, distribution sglang-kernel-cpu")(host))
    if host.platform != "cpu":
        reasons.append(f"serves CPU-only hosts (sgl-kernel there is the CPU build); this host is {host.platform}")
    return reasons


@hookimpl
def attnplug_register_backends(register: RegisterBackend) -> None:
    register(
        BackendDescriptor(
            name=NAME,
            factory="attnplug_intel_amx.backend:create",
            capabilities=CAPABILITIES,
            probe=probe,
            priority={"cpu": 30},
            library=LIBRARY,
            # no version floor: the CPU build is compiled from source and its version does not say which op
            # arguments it has; the kernel module binds every call to the ops' schema instead
            min_library_version=None,
            description="sgl-kernel CPU decode/extend attention ops on Intel AMX",
        )
    )


def gpt_oss_on_amx(host: HostInfo, config: AttentionConfig) -> dict[str, Any]:
    """gpt-oss on an AMX CPU prefers intel_amx"""
    return {"attention_backend": NAME} if host.platform == "cpu" and host.has_amx else {}


@hookimpl
def attnplug_arch_overrides(register: RegisterArchOverride) -> None:
    register("GptOssForCausalLM", gpt_oss_on_amx)
