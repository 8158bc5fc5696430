"""Stand-in for ``attnplug-aiter``: AMD aiter kernels on gfx942/gfx950."""

from attnplug import BackendDescriptor, Capabilities, hookimpl

from ._probes import needs_library

CAPS = Capabilities(
    dtypes=("float16", "bfloat16"), kv_cache_dtypes=("float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"),
    sliding_window=True, sinks=True, speculative_verify=True, draft_extend=True, cuda_graph=True,
    deterministic=False, devices=("rocm",),
)


def _probe(host):
    reasons = needs_library("aiter")(host)
    if host.gfx_arch not in ("gfx942", "gfx950"):
        reasons.append(f"needs an MI300/MI350 GPU (gfx942/gfx950); this host is {host.gfx_arch or host.platform}")
    return reasons


@hookimpl
def attnplug_register_backends(register):
    register(BackendDescriptor(
        name="aiter", factory="tests.dists_resolution._probes:not_a_backend", capabilities=CAPS,
        probe=_probe, priority={"rocm": 50}, library="aiter",
    ))


def gpt_oss_on_rocm(host, config):
    """gpt-oss on ROCm prefers aiter"""
    return {"attention_backend": "aiter"} if host.platform == "rocm" else {}


@hookimpl
def attnplug_arch_overrides(register):
    register("GptOssForCausalLM", gpt_oss_on_rocm)


@hookimpl
def attnplug_check_config(config, host):
    if "aiter" in config.attention_backends() and config.kv_cache_dtype in ("fp8_e5m2", "float8_e5m2"):
        return [f"aiter on {host.gfx_arch} stores fp8 KV as float8_e4m3fn; float8_e5m2 is not supported"]
    return None
