"""Descriptor module of the ``trtllm_mha`` backend: TensorRT-LLM MHA kernels through flashinfer (light).

The kernels are trtllm-gen's paged FMHA, reached through
``flashinfer.decode.trtllm_batch_decode_with_kv_cache`` and
``flashinfer.prefill.trtllm_batch_context_with_kv_cache`` (distribution
``flashinfer-python``). They run on Blackwell datacenter GPUs (SM100/SM103)
and read the cache in pages of 16, 32 or 64 tokens.

Page size: the kernels need 16/32/64-token pages. ``page_sizes`` says so
(a configuration with another page size is refused with that reason), and a
fallback rule fills ``page_size=64`` when a half uses ``trtllm_mha`` and no
page size was set — the engine-side equivalent of SGLang forcing 64, but
declared, recorded and never over a value the user set.

The kernel module ``attnplug_trtllm_mha.backend`` is imported only when the backend is built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from attnplug import BackendDescriptor, Capabilities, hookimpl
from attnplug.probes import fp8_kv_sm_problems, library_missing
from attnplug.hookspecs import RegisterArchOverride, RegisterBackend, RegisterResolutionRule

if TYPE_CHECKING:
    from attnplug import AttentionConfig, HostInfo

NAME = "trtllm_mha"
LIBRARY = "flashinfer-python"
MIN_VERSION = "0.6.0"

#: trtllm-gen FMHA cubins ship for Blackwell datacenter parts only (SM100 B200/GB200, SM103 B300/GB300).
SMS = (100, 103)
PAGE_SIZES = (16, 32, 64)
DEFAULT_PAGE_SIZE = 64

CAPABILITIES = Capabilities(
    dtypes=("float16", "bfloat16"),
    # fp8 KV: the query is quantized to e4m3 (trtllm-gen's fp8 path) and the cache's per-tensor
    # scales are folded into the fused bmm scales (backend.bmm_scales); SM100 family only
    kv_cache_dtypes=("float16", "bfloat16", "float8_e4m3fn"),
    kv_cache_dtype_follows_model=True,  # the query and a 16-bit cache share one dtype
    head_dims=(64, 128, 256),
    v_head_dim_differs=False,
    page_sizes=PAGE_SIZES,
    gqa=True,
    mqa=True,
    sliding_window=True,  # window_left
    logit_softcap=False,  # the trtllm entry points take no soft-cap
    sinks=True,  # sinks= (float32 per query head)
    cross_attention=False,
    # not claimed: a custom (tree) draft mask needs trtllm-gen's packed mask format; see README
    speculative_verify=False,
    draft_extend=True,
    cuda_graph=True,
    deterministic=False,  # split-KV reductions depend on the batch shape
    devices=("cuda",),
    min_compute_capability=(10, 0),
    # MLA (docs/mla.md): absorbed decode through flashinfer's trtllm_batch_decode_with_kv_cache_mla (latent
    # 512 + 64, pages of 32 or 64, the model dtype or an e4m3 latent); extend-shaped MLA forwards and the
    # unabsorbed form are not claimed (trtllm_prefill_with_kv_cache_mla is not bound yet)
    mla_forms={"decode": ("absorbed",)},
)


def probe(host: Any) -> list[str]:
    """Why trtllm_mha cannot run on ``host``, in words (reads ``HostInfo`` only)."""
    reasons = list(library_missing(LIBRARY, f"pip install '{LIBRARY}>={MIN_VERSION}'")(host))
    if host.platform != "cuda":
        return reasons  # the core already says the backend needs a CUDA device
    sm = host.sm()
    if sm not in SMS:
        where = f"SM{sm}" if sm is not None else "a GPU of unknown compute capability"
        reasons.append(f"needs a Blackwell GPU of SM{'/'.join(map(str, SMS))} (trtllm-gen kernels); this host is {where}")
    return reasons


def fp8_kv_problems(config: Any, host: Any) -> list[str]:
    """Why a configuration using trtllm_mha cannot keep an fp8 KV cache on ``host``: trtllm-gen's fp8
    kernels ship for the SM100 family only (the same cubins as its 16-bit ones)."""
    return fp8_kv_sm_problems(NAME, config, host, SMS, f"trtllm-gen's fp8 KV kernels run on SM{'/'.join(map(str, SMS))} "
                              "(Blackwell datacenter GPUs)")


@hookimpl
def attnplug_check_config(config: AttentionConfig, host: HostInfo) -> list[str] | None:
    return fp8_kv_problems(config, host) or None


@hookimpl
def attnplug_register_backends(register: RegisterBackend) -> None:
    register(
        BackendDescriptor(
            name=NAME,
            factory="attnplug_trtllm_mha.backend:create",
            capabilities=CAPABILITIES,
            probe=probe,
            priority={"cuda": 40},
            library=LIBRARY,
            min_library_version=MIN_VERSION,
            description="TensorRT-LLM MHA (trtllm-gen) paged kernels via flashinfer; 16/32/64-token pages",
        )
    )


def gpt_oss_on_blackwell(host: Any, config: Any) -> dict[str, Any]:
    """gpt-oss on SM100 prefers trtllm_mha"""
    return {"attention_backend": NAME} if host.platform == "cuda" and host.sm() in SMS else {}


def trtllm_page_size(host: Any, config: Any, registry: Any) -> dict[str, Any]:
    """trtllm_mha kernels run on 64-token pages; fill page_size when a half uses it"""
    if NAME in config.attention_backends() and config.page_size is None:
        return {"page_size": DEFAULT_PAGE_SIZE}
    return {}


@hookimpl
def attnplug_arch_overrides(register: RegisterArchOverride) -> None:
    register("GptOssForCausalLM", gpt_oss_on_blackwell)


@hookimpl
def attnplug_resolution_rules(register: RegisterResolutionRule) -> None:
    register("trtllm_mha_page_size", "fallback", trtllm_page_size)
