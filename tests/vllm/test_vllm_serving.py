"""vLLM serves models through attnplug: greedy tokens equal vLLM's own CPU_ATTN (float32) for several
architectures (GQA Llama, Qwen3, Gemma2 with a sliding window on one layer, gpt-oss with sinks and a sliding
window), 8 concurrent prompts of different lengths, chunked prefill and prefix-cache hits, through
vllm_cpu, torch_native and a split pair; a model the pair cannot serve is refused at start-up naming
the layer and the half."""

from __future__ import annotations

import os

import pytest

import vllm_models as models
from attnplug import AttentionConfig

PAIRS = {
    "vllm_cpu": AttentionConfig(attention_backend="vllm_cpu"),
    "torch_native": AttentionConfig(attention_backend="torch_native"),
    # a split pair whose decode half is the third-party template, installed as a package: it serves vLLM
    # with no code change in vLLM or attnplug
    "torch_native/template_sdpa": AttentionConfig(prefill_attention_backend="torch_native",
                                                  decode_attention_backend="template_sdpa"),
}
MODELS = ["llama", "qwen3", "gemma2_sliding", "gpt_oss"]


def _pairs(name: str) -> dict[str, AttentionConfig]:
    if name == "gpt_oss":  # the template claims no sinks: refused (below); the split pair runs on the others
        return {k: v for k, v in PAIRS.items() if "template" not in k}
    return PAIRS


@pytest.mark.parametrize("name", MODELS)
def test_greedy_tokens_equal_vllms_own_through_every_pair(name, reference, attnplug_engine) -> None:
    ref_tokens, ref_cached, ref_impl = reference(name)
    assert ref_impl == "CPUAttentionBackendImpl"  # opt-in off: vLLM's own backend served the reference
    assert sum(ref_cached) > 0, "no prefix-cache hit: the prompts would not cover cache hits"
    llm, state = attnplug_engine(name)
    from conftest import first_attention_impl

    assert type(first_attention_impl(llm)).__name__ == "AttnplugVllmImpl"
    assert len(state.layers) == 2
    for label, config in _pairs(name).items():
        state.rebuild(config)
        llm.reset_prefix_cache()
        tokens, cached = models.generate(llm)
        assert tokens == ref_tokens, f"{name} through {label}"
        assert sum(cached) > 0, f"{name} through {label}: no prefix-cache hit"
        p, d = config.attention_backends()
        served = {(mode, by) for (mode, by) in state.served}
        modes = {m for m, _ in served}
        # chunked prefill next to decodes makes mixed batches; each mode is served by its half
        assert {"decode", "mixed"} <= modes, served
        assert all(by == (d if mode == "decode" else p) for mode, by in served), served
        # one ForwardBatch (one init_forward_metadata) per scheduled batch and KV-cache group, shared by
        # every layer of the group
        for g in state.groups:
            assert g.builds >= 1 and g.layer_calls == g.builds * len(g.layer_names), (g.builds, g.layer_calls)
            if hasattr(g.backend, "metadata_builds"):  # a single backend (a split pair's halves count their own)
                assert g.backend.metadata_builds == g.builds


def test_the_kv_cache_attnplug_reads_is_the_one_vllm_allocated(attnplug_engine) -> None:
    llm, state = attnplug_engine("llama")
    state.rebuild(PAIRS["vllm_cpu"])
    llm.reset_prefix_cache()
    models.generate(llm, max_tokens=2)
    runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
    fc = runner.vllm_config.compilation_config.static_forward_context
    for g in state.groups:
        for i, n in enumerate(g.layer_names):
            raw = g.kv_cache.layer_storage(i)[0]
            assert raw.data_ptr() == fc[n].kv_cache.data_ptr() and raw.shape == fc[n].kv_cache.shape


@pytest.mark.parametrize("args,half", [
    ("--attention-backend template_sdpa", None),
    ("--prefill-attention-backend torch_native --decode-attention-backend template_sdpa", "decode half"),
])
def test_a_layer_the_pair_cannot_serve_is_refused_at_start_up_naming_layer_and_half(args, half, model_dir) -> None:
    import attnplug.integrations.vllm as integ
    from vllm import LLM

    models.env_on(args)
    integ.register()
    try:
        with pytest.raises(Exception) as info:
            LLM(model=model_dir("gpt_oss"), **models.ENGINE_ARGS)
    finally:
        os.environ["ATTNPLUG_VLLM_ARGS"] = ""
    msg = str(info.value)
    assert "template_sdpa" in msg and "layer 0" in msg and "sinks" in msg, msg
    if half:
        assert half in msg, msg
