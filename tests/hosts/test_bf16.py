"""bfloat16 runs: logits within the bf16 tolerance, by a stated rule.

The bf16 tolerance of attnplug.testing.tolerances bounds one attention call.
Whole-model logits also carry the bf16 rounding of every other op (norms,
MLPs, residual adds), which no attention backend controls: transformers' own
eager bf16 run does not stay within the bf16 tolerance of the float32
computation either (measured: up to ~0.08 past the bound on these models).
So the rule, per prompt, over 8 steps that follow the float32 reference's
tokens: with ``excess(x) = max(|x - fp32| - (atol + rtol * |fp32|))``, where
``fp32`` is the model run in float32 on the same (bf16-rounded) weights,

    excess(attnplug bf16) <= max(0, excess(transformers eager bf16)) + atol(bf16)

i.e. attnplug's logits are within the bf16 tolerance of the float32 result,
or no further outside it than transformers' own bf16 attention plus one
per-call bf16 ``atol``. The slack is there because two valid bf16 attentions
round differently (torch_native rounds the probabilities to bf16 for the
value matmul, as eager does, but in another order and blocking): measured on
gpt-oss (sinks), transformers' eager bf16 lands 0.029 past the bound and
torch_native 0.034; on llama, eager and sdpa bf16 both land 0.029 past it. Each
attention call itself is held to the bf16 tolerance of the float64 reference
by the conformance suite; a real bug (an ignored soft-cap, a wrong window or
scale) moves the logits by far more than this slack.
"""

from __future__ import annotations

import pytest
import torch

import hf_models as models
from attnplug import AttentionConfig
from attnplug.integrations.transformers import Request, TransformersRunner, generate
from attnplug.testing.tolerances import tolerance_for

BF16 = tolerance_for("bfloat16")
STEPS = 8


def _excess(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float(((x - ref).abs() - (BF16.atol + BF16.rtol * ref.abs())).max())


def _teacher_forced_eager(model, prompts, tokens):
    model.set_attn_implementation("eager")
    out = []
    with torch.inference_mode():
        for p, toks in zip(prompts, tokens):
            out.append(model(torch.tensor([p + toks[:-1]])).logits[0, len(p) - 1:].float())
    return out


@pytest.mark.parametrize("arch", ["llama", "gemma2", "gpt_oss"])
def test_bf16_logits_within_the_bf16_rule(arch):
    prompts = models.prompts()
    fp32 = models.reference(models.build(arch, dtype=torch.bfloat16).float(), prompts, STEPS)
    tokens = [t for t, _ in fp32]
    model = models.build(arch, dtype=torch.bfloat16)
    eager = _teacher_forced_eager(model, prompts, tokens)
    runner = TransformersRunner(model, AttentionConfig(attention_backend="torch_native"), max_requests=4,
                                max_context_len=512)
    assert runner.kv_cache.dtype == torch.bfloat16
    res = generate(runner, [Request(p, STEPS) for p in prompts], record_logits=True,
                   sampler=lambda rid, i, logits: tokens[rid][i])
    for i, (_, ref) in enumerate(fp32):
        ours = _excess(torch.stack(res.logits[i]), ref)
        theirs = _excess(eager[i], ref)
        allowed = max(0.0, theirs) + BF16.atol
        assert ours <= allowed, (f"prompt {i}: attnplug {ours:.4f} past the bf16 bound, eager {theirs:.4f} "
                                 f"(allowed: {allowed:.4f})")
