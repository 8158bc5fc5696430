"""Stand-in for ``attnplug-trtllm-mha``: TensorRT-LLM MHA kernels via flashinfer-python >= 0.6.0 (SM100)."""

from attnplug import BackendDescriptor, Capabilities, hookimpl

from ._probes import all_of, needs_library, sm_in

CAPS = Capabilities(
    dtypes=("float16", "bfloat16"), kv_cache_dtypes=("float16", "bfloat16", "float8_e4m3fn"),
    kv_cache_dtype_follows_model=True,
    page_sizes=(16, 32, 64), sliding_window=True, sinks=True, speculative_verify=False, draft_extend=True,
    cuda_graph=True, deterministic=False, devices=("cuda",), min_compute_capability=(10, 0),
)


@hookimpl
def attnplug_register_backends(register):
    register(BackendDescriptor(
        name="trtllm_mha", factory="tests.dists_resolution._probes:not_a_backend", capabilities=CAPS,
        probe=all_of(sm_in((100, 103)), needs_library("flashinfer-python")), priority={"cuda": 40},
        library="flashinfer-python", min_library_version="0.6.0",
    ))


def gpt_oss_on_blackwell(host, config):
    """gpt-oss on SM100 prefers trtllm_mha"""
    return {"attention_backend": "trtllm_mha"} if host.sm() in (100, 103) else {}


def trtllm_page_size(host, config, registry):
    """trtllm_mha kernels run on 64-token pages; fill page_size when a half uses it"""
    if "trtllm_mha" in config.attention_backends() and config.page_size is None:
        return {"page_size": 64}
    return {}


@hookimpl
def attnplug_arch_overrides(register):
    register("GptOssForCausalLM", gpt_oss_on_blackwell)


@hookimpl
def attnplug_resolution_rules(register):
    register("trtllm_mha_page_size", "fallback", trtllm_page_size)
