"""The continuous-batching loop: requests join and finish at different steps, MIXED
forwards occur, no padding reaches attention, and each request gets exactly the
tokens it gets when generated alone (under the margin rule of ``greedy_rule``)."""

from __future__ import annotations

import pytest
import torch

import hf_models as models
from attnplug import AttentionConfig, ForwardMode
from attnplug.integrations.transformers import Request, TransformersRunner, generate
from attnplug.testing.tolerances import tolerance_for
from greedy_rule import Follower

LENS = (5, 40, 90, 12, 150, 33, 70)
MAX_NEW = (12, 5, 9, 16, 4, 10, 7)
ARRIVALS = (0, 0, 2, 3, 3, 6, 9)


@pytest.mark.parametrize("arch", ["gemma2", "gpt_oss"])
def test_each_request_gets_its_solo_tokens(arch):
    prompts = models.prompts(LENS, seed=11)
    requests = [Request(p, n, arrival=a) for p, n, a in zip(prompts, MAX_NEW, ARRIVALS)]
    model = models.build(arch)
    # three request rows and few pages: rows and pages must be freed and reused as requests finish
    runner = TransformersRunner(model, AttentionConfig(attention_backend="torch_native"), max_requests=3,
                                max_context_len=256, page_size=16, num_pages=30)
    seen_tokens = []
    forward = runner.backend.forward

    def counting_forward(q, k, v, layer, batch, save_kv_cache=True):
        seen_tokens.append((layer.layer_id, q.shape[0], batch.num_tokens))
        return forward(q, k, v, layer, batch, save_kv_cache)

    runner.backend.forward = counting_forward  # instance attribute: only this runner's backend
    solo = [generate(runner, [Request(p, n)], record_logits=True) for p, n in zip(prompts, MAX_NEW)]
    seen_tokens.clear()
    follower = Follower([s.tokens[0] for s in solo], [torch.stack(s.logits[0]) for s in solo],
                        tolerance_for("float32"))
    res = generate(runner, requests, max_running=3, sampler=follower)

    assert res.tokens == [s.tokens[0] for s in solo]
    assert follower.checked == sum(MAX_NEW)
    modes = [s.mode for s in res.steps]
    assert ForwardMode.MIXED in modes and ForwardMode.DECODE in modes and modes[0] is ForwardMode.EXTEND
    assert len(set(res.joined)) > 2 and len(set(res.finished)) > 2
    # a request joined while another was decoding, and one finished while others went on
    assert any(0 < res.joined[i] <= res.finished[j] and res.joined[j] < res.joined[i]
               for i in range(len(LENS)) for j in range(len(LENS)))
    # no padding: every forward sent exactly its requests' real new tokens to attention, in every layer
    for step, rec in zip(res.forward_steps, res.steps):
        expected = sum(LENS[i] if res.joined[i] == step else 1
                       for i in range(len(LENS)) if res.joined[i] <= step <= res.finished[i])
        assert rec.num_tokens == expected
    assert len(seen_tokens) == len(res.steps) * len(runner.layers)
    assert [n for _, n, _ in seen_tokens] == [rec.num_tokens for rec in res.steps for _ in runner.layers]
    assert runner.cache.requests == [] and runner.cache.pool.free_pages == 30
    assert bool((runner.kv_cache.req_to_token[:3] == -1).any())  # released rows are unmapped


def test_max_step_tokens_delays_a_long_prompt_but_not_decodes():
    prompts = models.prompts((30, 8, 25), seed=3)
    runner = TransformersRunner(models.build("llama"), AttentionConfig(attention_backend="torch_native"),
                                max_requests=4, max_context_len=128)
    res = generate(runner, [Request(p, 4) for p in prompts], max_step_tokens=40)
    # 30 + 8 fit in the first step; 25 waits for the next one, beside two decode tokens
    assert res.joined == [0, 0, 1]
    assert [s.num_tokens for s in res.steps][:2] == [38, 27]
    assert res.steps[1].mode is ForwardMode.MIXED
