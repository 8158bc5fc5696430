"""A DeepSeek-V3-architecture model (MLA, docs/mla.md) served through attnplug's latent cache by the
transformers integration: greedy tokens and per-step logits equal transformers' own eager generate().

The model is built from a tiny config (2 layers, the second a MoE layer; q LoRA; YaRN rope with an
mscale, so the softmax scale is 1/sqrt(qk_nope + qk_rope) times mscale², not 1/sqrt(576)-like) with
seeded random weights. The integration keeps the latents the module hands to ``cache.update`` and
serves each MLA layer from a latent ``PagedKVCache`` (``v_head_dim=0``), in the unabsorbed form (the
module's own per-head q; the backend decompresses with ``kv_b_proj`` split per head) and in the
absorbed form (the integration multiplies q_nope by W_UK before attention and the output by W_UV
after it). Tokens follow the margin rule of ``greedy_rule``; logits stay within the float32 tolerance.
"""

from __future__ import annotations

import math

import pytest
import torch

import hf_models as models
from attnplug import AttentionConfig, ForwardMode, NotSupportedError
from attnplug.integrations.transformers import TransformersRunner
from attnplug.testing.tolerances import tolerance_for
from greedy_rule import follow_reference

FP32 = tolerance_for("float32")
LENS, NEW_TOKENS = (5, 64, 171), 16
ROPE = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "beta_fast": 32.0,
        "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0}


def deepseek_v3(seed: int = 0):
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    cfg = DeepseekV3Config(
        vocab_size=models.VOCAB, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
        kv_lora_rank=64, q_lora_rank=96, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
        max_position_embeddings=1024, initializer_range=0.1, rope_parameters=dict(ROPE),
        eos_token_id=None, bos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()


_REF: list = []


def _reference():
    if not _REF:
        _REF.extend(models.reference(deepseek_v3(), models.prompts(LENS), NEW_TOKENS))
    return _REF


@pytest.mark.parametrize("form", ["auto", "absorbed", "unabsorbed"])
def test_deepseek_v3_greedy_matches_transformers_eager(form):
    ref = _reference()
    model = deepseek_v3()
    runner = TransformersRunner(model, max_requests=4, max_context_len=512, mla_form=form)
    # served from the latent cache: one row of kv_lora_rank + qk_rope per token and layer
    assert runner.kv_cache.latent and runner.kv_cache.head_dim == 64 + 16
    assert runner.pair == ("torch_native", "torch_native")
    for spec in runner.layers:
        attn = model.model.layers[spec.layer_id].self_attn
        assert spec.mla is not None and spec.num_kv_heads == 1 and spec.v_head_dim == 64
        assert math.isclose(spec.scaling, attn.scaling) and not math.isclose(spec.scaling, 1 / math.sqrt(32 + 16))
    res, _ = follow_reference(runner, ref, models.prompts(LENS), LENS, NEW_TOKENS, FP32)
    modes = {s.mode for s in res.steps}
    assert ForwardMode.EXTEND in modes and ForwardMode.DECODE in modes
    assert runner.cache.requests == [] and runner.cache.pool.free_pages == runner.kv_cache.num_pages


def test_deepseek_v3_latent_cache_holds_the_latents():
    """After a prompt, the cache rows of layer 0 are the module's c_kv (after kv_a_layernorm) ++ rotated k_pe."""
    model = deepseek_v3()
    seen = {}
    attn = model.model.layers[0].self_attn
    def keep(mod, args, out):  # the last call's output (returns None: the output is unchanged)
        seen["c_kv"] = out.detach().clone()

    hook = attn.kv_a_layernorm.register_forward_hook(keep)
    runner = TransformersRunner(model, max_requests=2, max_context_len=64)
    rid = object()
    from attnplug.integrations.transformers import Chunk

    runner.forward([Chunk(rid, tuple(range(7)))])
    hook.remove()
    rows = runner.kv_cache.read_latent(0, runner.kv_cache.slots(runner.cache.row(rid), 0, 7))
    torch.testing.assert_close(rows[:, 0, :64], seen["c_kv"][0], rtol=0, atol=0)


def test_deepseek_v3_on_a_backend_without_mla_is_refused_naming_the_layer_kind():
    with pytest.raises(NotSupportedError) as info:
        TransformersRunner(deepseek_v3(), AttentionConfig(attention_backend="template_sdpa"), max_requests=2,
                           max_context_len=64)
    assert "MLA layer not supported by template_sdpa" in str(info.value)
    assert "layer 0 (MLA, heads 4" in str(info.value)
