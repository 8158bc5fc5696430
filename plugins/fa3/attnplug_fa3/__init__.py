"""Descriptor module of the ``fa3`` backend: FlashAttention-3 paged attention (light: no torch here).

The kernel comes from one of two distributions, looked up in ``HostInfo``
(never imported here):

* ``sgl-kernel`` (``sgl_kernel.flash_attn.flash_attn_with_kvcache``), the FA3
  build SGLang's ``FlashAttentionBackend`` calls: SM80/86/87/89 and SM90,
  attention sinks included;
* ``flash-attn-3`` (module ``flash_attn_interface``), the upstream Hopper
  build: SM90 only here (no attention sinks).

The kernel module ``attnplug_fa3.backend`` is imported only when the backend is built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from attnplug import BackendDescriptor, Capabilities, hookimpl
from attnplug.probes import fp8_kv_sm_problems, installed_library, library_missing
from attnplug.hookspecs import RegisterArchOverride, RegisterBackend

if TYPE_CHECKING:
    from attnplug import AttentionConfig, HostInfo

NAME = "fa3"

#: The kernel distributions, in the order the kernel module tries them. ``sgl-kernel`` also
#: stands for its successor names ``sglang-kernel`` / ``sglang-kernel-cpu`` (same ``sgl_kernel``
#: module; see ``attnplug.host.SAME_MODULE_DISTRIBUTIONS``).
SGL_KERNEL = "sgl-kernel"
FLASH_ATTN_3 = "flash-attn-3"

#: The floor for every layer: ``flash_attn_with_kvcache(page_table=, cu_seqlens_q=, num_splits=, softcap=)``.
MIN_SGL_KERNEL = "0.3.0"
#: ``sinks=`` first exists in sgl-kernel 0.3.4.post1 (0.3.4's wrapper has no such parameter): a
#: layer with sinks needs this; layers without sinks run from ``MIN_SGL_KERNEL`` on.
MIN_SGL_KERNEL_SINKS = "0.3.4.post1"

#: GPUs sgl-kernel builds FA3 for (``is_fa3_supported``: major 8 or 9, CUDA >= 12.3).
SGL_KERNEL_SMS = (80, 86, 87, 89, 90)
#: The upstream flash-attn-3 (hopper/) build: H100/H800-class GPUs.
FLASH_ATTN_3_SMS = (90,)
#: FA3's fp8 path (e4m3 q/K/V with descale factors) is built for Hopper only.
FP8_KV_SMS = (90,)
#: sgl-kernel's FA3 applies ``sinks=`` in its SM90 kernel only: on SM80/86/87/89 the argument is accepted
#: and ignored (wrong output, nothing raised), so sink layers are refused there (backend_reasons).
SINKS_SMS = (90,)

#: FA3 rounds the head dim up to an instantiated one (64, 96, 128, 192, 256); it must be a multiple of 8,
#: and of 16 on the fp8 path (``FP8_HEAD_DIM_MULTIPLE``, refused per layer by the kernel module).
HEAD_DIMS = tuple(range(8, 257, 8))
FP8_HEAD_DIM_MULTIPLE = 16

CAPABILITIES = Capabilities(
    dtypes=("float16", "bfloat16"),
    # fp8 KV: the query is quantized to e4m3 as well (FA3's fp8 path) and the cache's per-tensor
    # scales go in as k_descale/v_descale; Hopper only (attnplug_check_config, backend_reasons)
    kv_cache_dtypes=("float16", "bfloat16", "float8_e4m3fn"),
    kv_cache_dtype_follows_model=True,  # flash_attn_with_kvcache takes q and a 16-bit cache in one dtype
    head_dims=HEAD_DIMS,
    v_head_dim_differs=False,
    page_sizes=None,  # paged KV of any page size (a page table of page ids; page size 1 = token table)
    gqa=True,
    mqa=True,
    sliding_window=True,  # window_size=(left, 0)
    logit_softcap=True,  # softcap=
    sinks=True,  # sinks= (sgl-kernel >= 0.3.4.post1; bfloat16, the C++ checks it)
    sinks_sms=SINKS_SMS,  # ... applied by the SM90 kernel only: resolution moves sink layers elsewhere
    cross_attention=False,
    speculative_verify=True,  # chain: causal; custom mask: one query per row over its visible slots
    draft_extend=True,
    cuda_graph=True,
    deterministic=True,  # built with num_splits=1 when the configuration asks for determinism
    devices=("cuda",),
    min_compute_capability=(8, 0),
    # MLA: the absorbed form in every mode through flash_attn_with_kvcache(qv=) (SGLang's FA3 MLA mode);
    # SM90, 16-bit latent, rope <= 64, rank <= 512 (backend.mla_reasons); no unabsorbed form
    mla_forms={"decode": ("absorbed",), "extend": ("absorbed",)},
)


def provider(host: Any) -> str | None:
    """The kernel distribution the backend would use on ``host`` (``None``: neither is installed)."""
    if installed_library(host, SGL_KERNEL) is not None:
        return SGL_KERNEL
    if host.library_version(FLASH_ATTN_3) is not None:
        return FLASH_ATTN_3
    return None


def probe(host: Any) -> list[str]:
    """Why FA3 cannot run on ``host``, in words (reads ``HostInfo`` only)."""
    reasons: list[str] = []
    which = provider(host)
    if which is None:
        reasons.extend(library_missing(
            SGL_KERNEL, "pip install sgl-kernel; or the upstream Hopper build, distribution 'flash-attn-3'")(host))
    if host.platform != "cuda":
        return reasons  # the core already says the backend needs a CUDA device
    sm = host.sm()
    if sm is None:
        reasons.append(f"needs an NVIDIA GPU of SM{'/'.join(map(str, SGL_KERNEL_SMS))}; "
                       f"this host's compute capability is unknown")
    elif which == FLASH_ATTN_3 and sm not in FLASH_ATTN_3_SMS:
        reasons.append(f"flash-attn-3 (upstream FA3) runs on Hopper SM90 only; this GPU is SM{sm} "
                       f"(sgl-kernel's FA3 build also covers SM80-89)")
    elif sm not in SGL_KERNEL_SMS:
        reasons.append(f"FA3 kernels are built for SM{'/'.join(map(str, SGL_KERNEL_SMS))} only; this GPU is SM{sm}")
    return reasons


def priority(host: Any) -> int | None:
    """The default on Hopper; a lower default on A100-class GPUs; never a default elsewhere."""
    if host.platform != "cuda":
        return None
    return {90: 60, 80: 30}.get(host.sm())


@hookimpl
def attnplug_register_backends(register: RegisterBackend) -> None:
    register(
        BackendDescriptor(
            name=NAME,
            factory="attnplug_fa3.backend:create",
            capabilities=CAPABILITIES,
            probe=probe,
            aliases=("flash_attention_3",),
            deprecated_aliases=("flashattention3",),
            priority=priority,
            library=SGL_KERNEL,
            # the floor for layers without sinks; a sink layer needs MIN_SGL_KERNEL_SINKS (checked per layer)
            min_library_version=MIN_SGL_KERNEL,
            description="FlashAttention-3 flash_attn_with_kvcache over a page table (sgl-kernel or flash-attn-3)",
        )
    )


def fp8_kv_problems(config: Any, host: Any) -> list[str]:
    """Why a configuration using fa3 cannot keep an fp8 KV cache on ``host`` (FA3's fp8 path is SM90 only)."""
    return fp8_kv_sm_problems(NAME, config, host, FP8_KV_SMS,
                              f"FA3's fp8 path runs on Hopper (SM{'/'.join(map(str, FP8_KV_SMS))})",
                              "Use kv_cache_dtype=auto, or a backend with fp8 KV here (e.g. flashinfer)")


@hookimpl
def attnplug_check_config(config: AttentionConfig, host: HostInfo) -> list[str] | None:
    return fp8_kv_problems(config, host) or None


def gpt_oss_on_hopper(host: Any, config: Any) -> dict[str, Any]:
    """gpt-oss on SM90 prefers fa3"""
    return {"attention_backend": NAME} if host.platform == "cuda" and host.sm() == 90 else {}


@hookimpl
def attnplug_arch_overrides(register: RegisterArchOverride) -> None:
    register("GptOssForCausalLM", gpt_oss_on_hopper)
