"""Stand-in for ``attnplug-triton``: portable triton kernels (CUDA, ROCm, XPU).

Ships the gpt-oss family's catch-all ("triton otherwise", low precedence so
the specific overrides of other plugins win), the mxfp4 -> bfloat16 model
fact, and a host-dependent name ``hybrid_default``.
"""

from attnplug import BackendDescriptor, Capabilities, hookimpl

from ._probes import needs_library

CAPS = Capabilities(
    dtypes=("float32", "float16", "bfloat16"), kv_cache_dtypes=("float32", "float16", "bfloat16", "float8_e4m3fn"),
    sliding_window=True, logit_softcap=True, sinks=True, speculative_verify=True, draft_extend=True,
    cuda_graph=True, deterministic=True, devices=("cuda", "rocm", "xpu"),
)

RESOLVE_CALLS = []  # (name, host) per hook call: proves the registry caches per (name, host)


@hookimpl
def attnplug_register_backends(register):
    register(BackendDescriptor(
        name="triton", factory="tests.dists_resolution._probes:not_a_backend", capabilities=CAPS,
        probe=needs_library("triton"), aliases=("triton_attn",), priority={"cuda": 20, "rocm": 20, "xpu": 20},
        library="triton", min_library_version="3.0.0",
    ))


def gpt_oss_default(host, config):
    """gpt-oss prefers triton where no more specific override applies"""
    return {"attention_backend": "triton"}


def gpt_oss_mxfp4_dtype(host, config):
    """mxfp4-quantised gpt-oss runs its activations in bfloat16"""
    return {"dtype": "bfloat16"} if config.extra.get("quantization") == "mxfp4" else {}


@hookimpl
def attnplug_arch_overrides(register):
    register("GptOssForCausalLM", gpt_oss_default, precedence=-10)
    register("GptOssForCausalLM", gpt_oss_mxfp4_dtype)


@hookimpl
def attnplug_resolve_name(name, host):
    if name != "hybrid_default":
        return None
    RESOLVE_CALLS.append((name, host))
    if host.sm() == 90:
        return "fa3"
    if host.platform == "cpu":
        return "intel_amx" if host.has_amx else "torch_native"
    return "triton"
