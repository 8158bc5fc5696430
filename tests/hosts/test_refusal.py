"""A model needing a feature the chosen backend lacks is refused before the first forward,
naming the layer and the reason; a spec that no longer matches the model is caught per call."""

from __future__ import annotations

import pytest

import hf_models as models
from attnplug import AttentionConfig, AttnplugError, NotSupportedError
from attnplug.integrations.transformers import Request, TransformersRunner, generate


def test_sinks_on_the_template_are_refused_naming_every_layer():
    model = models.build("gpt_oss")
    with pytest.raises(NotSupportedError) as err:
        TransformersRunner(model, AttentionConfig(attention_backend="template_sdpa"))
    msg = str(err.value)
    assert "'template_sdpa'" in msg
    assert "layer 0 (heads 4/2, head_dim 32, sliding window 23, sinks): attention sinks are not claimed" in msg
    assert "layer 1 (heads 4/2, head_dim 32, sinks): attention sinks are not claimed" in msg
    # refused before anything ran: the model was not switched to attnplug
    assert model.config._attn_implementation == "eager"


def test_a_split_pair_names_the_half_that_cannot_serve():
    model = models.build("gemma2")
    cfg = AttentionConfig(prefill_attention_backend="torch_native", decode_attention_backend="template_sdpa")
    with pytest.raises(NotSupportedError) as err:
        TransformersRunner(model, cfg)
    msg = str(err.value)
    assert "torch_native (prefill) / template_sdpa (decode)" in msg
    assert "layer 0 (heads 4/2, head_dim 32, sliding window 23, soft-cap 50): decode half: logit_cap=50.0 is not claimed" in msg
    assert "prefill half" not in msg


def test_a_layer_whose_module_changed_after_build_is_caught_at_its_call():
    model = models.build("gemma2")
    runner = TransformersRunner(model, AttentionConfig(attention_backend="torch_native"), max_requests=2,
                                max_context_len=64)
    model.model.layers[0].self_attn.sliding_window = 16
    with pytest.raises(AttnplugError, match=r"layer 0: the model passes sliding_window=16 .* the LayerSpec has "
                                            r"sliding_window=23 \(expected 15\)"):
        generate(runner, [Request([1, 2, 3], 2)])
    # the failed forward gave its pages and row back
    assert runner.cache.requests == [] and runner.cache.pool.free_pages == runner.kv_cache.num_pages


def test_calling_the_attnplug_model_without_the_runner_says_how():
    model = models.build("llama")
    TransformersRunner(model, AttentionConfig(attention_backend="torch_native"), max_requests=1, max_context_len=32)
    import torch
    with pytest.raises(AttnplugError, match="without attnplug_forward=.*TransformersRunner"):
        model(torch.tensor([[1, 2, 3]]))
