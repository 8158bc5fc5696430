"""Descriptor module of the ``aiter`` backend (light: no torch, no aiter import here).

The kernel module ``attnplug_aiter.backend`` is imported only when the backend
is built; ``attnplug_aiter.metadata`` (torch only) translates a
``ForwardBatch`` into aiter's token-level ``kv_indptr``/``kv_indices`` layout.
Also declares this plugin's piece of the gpt-oss family rule: aiter on ROCm.
"""

from __future__ import annotations

from typing import Any

from attnplug import BackendDescriptor, Capabilities, HostInfo, hookimpl
from attnplug.probes import library_missing
from attnplug.hookspecs import RegisterArchOverride, RegisterBackend

NAME = "aiter"
#: AMD's aiter is the distribution ``amd-aiter`` (module ``aiter``). The PyPI distribution named
#: ``aiter`` is an unrelated async-iterator package: it never counts as the kernel library.
LIBRARY = "amd-aiter"
MODULE = "aiter"
#: Floor: ``mha_batch_prefill_func(..., kv_last_page_lens=, sink_ptr=)`` (attention sinks,
#: "Enable gptoss_sink") first ships in aiter v0.1.10; ``paged_attention_ragged`` is older.
MIN_LIBRARY_VERSION = "0.1.10"
#: CDNA3 (MI300X/MI325X) and CDNA4 (MI350X/MI355X): the targets aiter's kernels are built for.
SUPPORTED_GFX = ("gfx942", "gfx950")

CAPABILITIES = Capabilities(
    dtypes=("float16", "bfloat16"),
    # fp8 KV is not claimed: on gfx942 aiter's fp8 is float8_e4m3fnuz, another encoding than the
    # cache's float8_e4m3fn (bias 8 vs 7); on gfx950 the encodings agree, but the fp8 paths that
    # take the scales (paged_attention_ragged k_scale/v_scale, mha_batch_prefill_func descales
    # from v0.1.10) are unverified for bf16 queries over an fp8 cache. See README.
    kv_cache_dtypes=("float16", "bfloat16"),
    # paged_attention_ragged dispatches head sizes 64 and 128 only.
    head_dims=(64, 128),
    v_head_dim_differs=False,
    page_sizes=None,  # token-level indices (block_size=1): any cache page size maps
    gqa=True,  # paged_attention_ragged: GQA ratio 1..16 (checked per layer)
    mqa=True,
    sliding_window=True,  # prefill: window_size=(W, 0); decode/verify: indices trimmed to the window
    logit_softcap=True,  # logits_soft_cap on both kernels
    sinks=True,  # mha_batch_prefill_func(sink_ptr=) from aiter 0.1.10
    cross_attention=False,
    speculative_verify=True,  # tree masks: one ragged "sequence" per draft token
    draft_extend=True,
    cuda_graph=True,  # decode: fixed kv_indptr/kv_indices buffers, fixed partition count
    deterministic=False,  # split-KV partitions reduce in an order that depends on the batch
    devices=("rocm",),
    # MLA: absorbed decode through aiter.mla.mla_decode_fwd (bf16, 16/128 heads, 512 + 64: backend.mla_reasons);
    # no extend-shaped form (mla_prefill_fwd is not bound), no unabsorbed form
    mla_forms={"decode": ("absorbed",)},
)


def probe(host: HostInfo) -> list[str]:
    """Why aiter cannot run on ``host`` (reads ``HostInfo`` only: recorded hosts answer too)."""
    reasons = list(library_missing(LIBRARY, "build amd-aiter from https://github.com/ROCm/aiter (>= v0.1.10) on a ROCm host")(host))
    if host.gfx_arch not in SUPPORTED_GFX:
        where = host.gfx_arch or host.platform
        reasons.append(f"needs an MI300/MI350 GPU (gfx942/gfx950); this host is {where}")
    return reasons


@hookimpl
def attnplug_register_backends(register: RegisterBackend) -> None:
    register(
        BackendDescriptor(
            name=NAME,
            factory="attnplug_aiter.backend:create",
            capabilities=CAPABILITIES,
            probe=probe,
            priority={"rocm": 50},
            library=LIBRARY,
            min_library_version=MIN_LIBRARY_VERSION,
            description="AMD aiter: mha_batch_prefill_func extend, paged_attention_ragged decode (gfx942/gfx950)",
        )
    )


def gpt_oss_on_rocm(host: HostInfo, config: Any) -> dict[str, Any]:
    """gpt-oss on ROCm prefers aiter"""
    return {"attention_backend": NAME} if host.platform == "rocm" else {}


@hookimpl
def attnplug_arch_overrides(register: RegisterArchOverride) -> None:
    register("GptOssForCausalLM", gpt_oss_on_rocm)
