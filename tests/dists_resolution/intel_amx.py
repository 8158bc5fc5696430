"""Stand-in for ``attnplug-intel-amx``: AMX tile kernels on Sapphire Rapids and later CPUs."""

from attnplug import BackendDescriptor, Capabilities, hookimpl

CAPS = Capabilities(
    dtypes=("float16", "bfloat16"), kv_cache_dtypes=("float16", "bfloat16"), kv_cache_dtype_follows_model=True,
    sliding_window=True, sinks=True, speculative_verify=False, draft_extend=False, deterministic=False, devices=("cpu",),
)


def _probe(host):
    return [] if host.has_amx else ["needs AMX (cpu flags amx_bf16 and amx_tile)"]


@hookimpl
def attnplug_register_backends(register):
    register(BackendDescriptor(
        name="intel_amx", factory="tests.dists_resolution._probes:not_a_backend", capabilities=CAPS,
        probe=_probe, priority={"cpu": 30},
    ))


def gpt_oss_on_amx(host, config):
    """gpt-oss on an AMX CPU prefers intel_amx"""
    return {"attention_backend": "intel_amx"} if host.platform == "cpu" and host.has_amx else {}


@hookimpl
def attnplug_arch_overrides(register):
    register("GptOssForCausalLM", gpt_oss_on_amx)
