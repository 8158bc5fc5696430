"""Stand-in for ``attnplug-fa3``: FlashAttention-3 kernels shipped in sgl-kernel (SM80/SM90)."""

from attnplug import BackendDescriptor, Capabilities, hookimpl

from ._probes import all_of, needs_library, sm_in

CAPS = Capabilities(
    dtypes=("float16", "bfloat16"), kv_cache_dtypes=("float16", "bfloat16", "float8_e4m3fn"),
    kv_cache_dtype_follows_model=True,
    sliding_window=True, logit_softcap=True, sinks=True, speculative_verify=True, draft_extend=True,
    cuda_graph=True, deterministic=True, devices=("cuda",), min_compute_capability=(8, 0),
)


def _priority(host):
    return {90: 60, 80: 30}.get(host.sm()) if host.platform == "cuda" else None


@hookimpl
def attnplug_register_backends(register):
    register(BackendDescriptor(
        name="fa3", factory="tests.dists_resolution._probes:not_a_backend", capabilities=CAPS,
        probe=all_of(sm_in((80, 86, 89, 90)), needs_library("sgl-kernel")),
        aliases=("flash_attention_3",), deprecated_aliases=("flashattention3",),
        priority=_priority, library="sgl-kernel", min_library_version="0.3.0",
    ))


def gpt_oss_on_hopper(host, config):
    """gpt-oss on SM90 prefers fa3"""
    return {"attention_backend": "fa3"} if host.sm() == 90 else {}


@hookimpl
def attnplug_arch_overrides(register):
    register("GptOssForCausalLM", gpt_oss_on_hopper)
