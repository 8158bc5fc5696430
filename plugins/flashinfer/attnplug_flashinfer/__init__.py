"""Descriptor module of the ``flashinfer`` backend (light: no torch, no flashinfer import here).

The kernel module ``attnplug_flashinfer.backend`` is imported only when the
backend is built; ``attnplug_flashinfer.metadata`` (torch only) translates a
``ForwardBatch`` into FlashInfer's paged layout.

This plugin also ships the diffusion-LM forcing rule: diffusion-LM decoding
runs on flashinfer with CUDA graphs.
"""

from __future__ import annotations

from typing import Any

from attnplug import BackendDescriptor, Capabilities, HostInfo, hookimpl
from attnplug.probes import library_missing
from attnplug.hookspecs import RegisterBackend, RegisterResolutionRule

NAME = "flashinfer"
LIBRARY = "flashinfer-python"
#: Floor: ``plan(..., fixed_split_size=, disable_split_kv=)`` (deterministic mode) and
#: ``head_dim_vo``/``window_left``/``logits_soft_cap`` on every wrapper exist from here on.
MIN_LIBRARY_VERSION = "0.5.0"
#: FlashInfer runs on SM75+, but bfloat16 needs SM80; the envelope is one set of dtypes, so SM80.
MIN_COMPUTE_CAPABILITY = (8, 0)

CAPABILITIES = Capabilities(
    dtypes=("float16", "bfloat16"),
    # fp8 KV with fp16/bf16 queries: the FA2 prefill/decode kernels take kv_data_type separately
    # (the prefill wrappers are pinned to backend="fa2" for fp8 KV: "auto" picks FA3 on SM90).
    kv_cache_dtypes=("float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"),
    # The head dims FlashInfer's prebuilt/tested FA2 kernels cover (tests parametrise 64/128/256).
    head_dims=(64, 128, 256),
    v_head_dim_differs=False,
    page_sizes=None,  # paged_kv_last_page_len lets any page size through
    gqa=True,
    mqa=True,
    sliding_window=True,  # plan(window_left=W): keys j >= p - W, the LayerSpec convention
    logit_softcap=True,  # plan(logits_soft_cap=cap)
    # Not claimed: FlashInfer's ``sinks`` argument is honoured by its trtllm-gen kernels
    # (SM100, see trtllm_mha), not by the FA2 paged kernels this backend plans.
    sinks=False,
    cross_attention=False,
    speculative_verify=True,  # plan(custom_mask=...) over prefix + draft tokens
    draft_extend=True,
    cuda_graph=True,  # wrappers built with use_cuda_graph=True over fixed buffers
    # config.deterministic: disable_split_kv=True on every plan and the prefill wrappers pinned to
    # backend="fa2" (FA3 on SM90 ignores the split arguments); see backend.split_arguments
    deterministic=True,
    devices=("cuda",),
    min_compute_capability=MIN_COMPUTE_CAPABILITY,
    # MLA (docs/mla.md): the absorbed form through BatchMLAPagedAttentionWrapper (latent 512 + 64, the model
    # dtype), decode and causal extend; no unabsorbed form (the host decompresses and runs ordinary attention
    # with v_head_dim != head_dim, which this backend does not claim either), no tree-masked verify
    mla_forms={"decode": ("absorbed",), "extend": ("absorbed",)},
)


def probe(host: HostInfo) -> list[str]:
    """Why flashinfer cannot run on ``host`` (reads ``HostInfo`` only: recorded hosts answer too)."""
    reasons = list(library_missing(LIBRARY, "pip install 'attnplug-flashinfer[kernels]'")(host))
    if host.platform == "cuda" and host.compute_capability is None:
        reasons.append("CUDA host without a recorded compute capability (FlashInfer needs SM80+)")
    return reasons


def priority(host: HostInfo) -> int | None:
    """The CUDA default below fa3 on SM90 (60) and above triton (20) everywhere on CUDA."""
    return 50 if host.platform == "cuda" else None


@hookimpl
def attnplug_register_backends(register: RegisterBackend) -> None:
    register(
        BackendDescriptor(
            name=NAME,
            factory="attnplug_flashinfer.backend:create",
            capabilities=CAPABILITIES,
            probe=probe,
            priority=priority,
            library=LIBRARY,
            min_library_version=MIN_LIBRARY_VERSION,
            description="FlashInfer paged prefill/decode (FA2 kernels), custom-mask verify, CUDA graphs",
        )
    )


def diffusion_lm_needs_flashinfer(host: HostInfo, config: Any, registry: Any) -> dict[str, Any]:
    """diffusion-LM decoding runs on flashinfer with CUDA graphs"""
    if config.extra.get("diffusion_lm") and host.platform == "cuda":
        return {"attention_backend": NAME, "cuda_graph": True}
    return {}


@hookimpl
def attnplug_resolution_rules(register: RegisterResolutionRule) -> None:
    register("diffusion_lm_flashinfer", "force", diffusion_lm_needs_flashinfer)
