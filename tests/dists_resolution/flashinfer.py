"""Stand-in for ``attnplug-flashinfer`` (flashinfer-python >= 0.5.0); also ships the
diffusion-LM forcing rule (that mode needs flashinfer with CUDA graphs)."""

from attnplug import BackendDescriptor, Capabilities, hookimpl

from ._probes import needs_library

CAPS = Capabilities(
    dtypes=("float16", "bfloat16"), kv_cache_dtypes=("float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"),
    sliding_window=True, logit_softcap=True, speculative_verify=True, draft_extend=True,
    cuda_graph=True, deterministic=True, devices=("cuda",), min_compute_capability=(8, 0),
)


@hookimpl
def attnplug_register_backends(register):
    register(BackendDescriptor(
        name="flashinfer", factory="tests.dists_resolution._probes:not_a_backend", capabilities=CAPS,
        probe=needs_library("flashinfer-python"), priority={"cuda": 50},
        library="flashinfer-python", min_library_version="0.5.0",
    ))


def diffusion_lm_needs_flashinfer(host, config, registry):
    """diffusion-LM decoding runs on flashinfer with CUDA graphs"""
    if config.extra.get("diffusion_lm") and host.platform == "cuda":
        return {"attention_backend": "flashinfer", "cuda_graph": True}
    return {}


@hookimpl
def attnplug_resolution_rules(register):
    register("diffusion_lm_flashinfer", "force", diffusion_lm_needs_flashinfer)
