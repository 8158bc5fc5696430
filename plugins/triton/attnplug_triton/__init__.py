"""Descriptor module of the ``triton`` backend (light: imports neither torch nor triton).

The kernel module ``attnplug_triton.backend`` (and through it ``triton``) is
imported only when the backend is built.

Availability: the ``triton`` distribution must be installed (read from
``HostInfo.libraries``, so a recorded host answers for itself). On a CUDA or
ROCm host that is all. Elsewhere the kernels can only run in Triton's
interpreter on CPU tensors, which Triton switches on with ``TRITON_INTERPRET``
(read when ``triton`` is first imported); without it the backend is
unavailable. The interpreter is for testing: the backend has no default
priority on CPU, so it runs there only when asked for by name.

It also ships the gpt-oss family's catch-all preference (``triton`` wherever
no more specific override applies) and the model fact "mxfp4-quantised
gpt-oss runs in bfloat16" (see docs/resolution.md, "Who ships the gpt-oss
family's overrides").
"""

from __future__ import annotations

import os
from typing import Any

from attnplug import BackendDescriptor, Capabilities, hookimpl
from attnplug.probes import library_missing
from attnplug.hookspecs import RegisterArchOverride, RegisterBackend

NAME = "triton"
LIBRARY = "triton"
MIN_LIBRARY_VERSION = "3.0"
#: Values of ``TRITON_INTERPRET`` that Triton reads as "on" (case-insensitive), as Triton does.
INTERPRET_ON = ("1", "true", "on", "yes")
#: Platforms the kernels are compiled for; anywhere else only the interpreter runs them.
GPU_PLATFORMS = ("cuda", "rocm")
GPT_OSS = "GptOssForCausalLM"

CAPABILITIES = Capabilities(
    dtypes=("float32", "float16", "bfloat16"),
    # K/V blocks are converted to the model dtype as they are loaded; fp8 blocks are dequantized
    # (stored * the layer's scale, in float32) one block at a time
    kv_cache_dtypes=("float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"),
    # any head dim: tiles are padded to a power of two and masked
    head_dims=None,
    v_head_dim_differs=True,
    page_sizes=None,  # keys are addressed per token through req_to_token
    gqa=True,
    mqa=True,
    sliding_window=True,
    logit_softcap=True,
    sinks=True,
    cross_attention=True,
    bidirectional=True,  # IS_CAUSAL=False: the kernel's key range reaches past the query
    speculative_verify=True,  # incl. the custom (tree) mask
    draft_extend=True,
    # Not claimed: the metadata holds host-side grid sizes and per-forward tensors, not
    # persistent capture buffers, and capture/replay has not been run on a GPU.
    cuda_graph=False,
    # Block sizes and the decode split length are fixed per backend, never derived from the
    # batch, so a request's arithmetic is the same alone or batched (checked by the suite).
    deterministic=True,
    devices=("cpu", "cuda", "rocm"),
    # MLA (docs/mla.md): both forms in every mode. Absorbed: the same kernel as MQA, the latent rows
    # both keys and (their first kv_lora_rank entries) values; unabsorbed: _mla_decompress_kernel builds
    # the per-head keys/values of the cached prefix and the new rows, then the same kernel
    mla_forms={"decode": ("absorbed", "unabsorbed"), "extend": ("absorbed", "unabsorbed")},
)

#: Distributions that provide the ``triton`` module: PyPI's, and the builds that ROCm and
#: nightly torch wheels depend on under other names.
TRITON_DISTRIBUTIONS = (LIBRARY, "pytorch-triton", "pytorch-triton-rocm")
_library_missing = library_missing(LIBRARY, "pip install triton")


def _triton_missing(host: Any) -> list[str]:
    if any(host.library_version(d) is not None for d in TRITON_DISTRIBUTIONS):
        return []
    return _library_missing(host)


def interpreter_enabled(environ: Any = None) -> bool:
    """Whether ``TRITON_INTERPRET`` asks Triton for its interpreter (the values Triton accepts)."""
    env = os.environ if environ is None else environ
    return str(env.get("TRITON_INTERPRET", "")).strip().lower() in INTERPRET_ON


def probe(host: Any) -> list[str]:
    """Why ``triton`` cannot run on ``host`` (empty when it can); imports nothing."""
    missing = _triton_missing(host)
    if missing:
        return missing
    if host.platform in GPU_PLATFORMS or interpreter_enabled():
        return []
    if host.platform == "cpu":
        return ["no GPU; set TRITON_INTERPRET=1 to run the kernels in Triton's interpreter on CPU"]
    return [
        f"the kernels are built for CUDA and ROCm GPUs, this host is {host.platform}; "
        f"set TRITON_INTERPRET=1 to run them in Triton's interpreter on CPU"
    ]


@hookimpl
def attnplug_register_backends(register: RegisterBackend) -> None:
    register(
        BackendDescriptor(
            name=NAME,
            factory="attnplug_triton.backend:create",
            capabilities=CAPABILITIES,
            # the level this repository's CI runs its suite at (tox -e tests: pytest --backend=all)
            conformance_level="0.4",  # incl. the MLA families (docs/mla.md)
            probe=probe,
            # Portable default on GPUs: below the vendor libraries (fa3, flashinfer, aiter), above
            # torch_native. None on CPU: the interpreter is for testing, never a default.
            priority={"cuda": 20, "rocm": 20},
            library=LIBRARY,
            min_library_version=MIN_LIBRARY_VERSION,
            description="paged attention in Triton: split-KV decode, extend over a paged prefix",
        )
    )


def gpt_oss_default(host: Any, config: Any) -> dict[str, Any]:
    """gpt-oss prefers triton on GPUs where no more specific override applies"""
    # Only where the kernels are compiled: on a CPU, Triton's interpreter (TRITON_INTERPRET=1)
    # makes the backend available for testing, but it must never become a model's preference.
    return {"attention_backend": NAME} if host.platform in GPU_PLATFORMS else {}


def gpt_oss_mxfp4_dtype(host: Any, config: Any) -> dict[str, Any]:
    """mxfp4-quantised gpt-oss runs its activations in bfloat16"""
    return {"dtype": "bfloat16"} if config.extra.get("quantization") == "mxfp4" else {}


@hookimpl
def attnplug_arch_overrides(register: RegisterArchOverride) -> None:
    # The family catch-all: a negative precedence so every plugin's specific override
    # (fa3 on SM90, trtllm_mha on SM100, aiter on ROCm, intel_amx on AMX CPUs) applies later and wins.
    register(GPT_OSS, gpt_oss_default, name="gpt_oss_default", precedence=-10)
    register(GPT_OSS, gpt_oss_mxfp4_dtype, name="gpt_oss_mxfp4_dtype")
