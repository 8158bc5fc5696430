"""What the model really does, per layer (issue 22): the four failure classes, each a test family.

1. sliding windows given only as ``config.sliding_window`` (no ``layer_types``) are served;
2. bidirectional attention (``is_causal=False``) is served as bidirectional, never silently as causal;
3. a field the model stores but its forward does not pass (Gemma3's ``attn_logit_softcapping``) is not claimed;
4. refusals name the model family, the cause and the remedy, before the first forward.

Models are tiny, built from configs with seeded random weights (``initializer_range=0.1``); the
reference is transformers' own eager attention.
"""

from __future__ import annotations

import math

import pytest
import torch

import greedy_rule
import hf_models as models
from attnplug import AttentionConfig, NotSupportedError
from attnplug.integrations.transformers import ModelNotServedError, Request, TransformersRunner, generate
from attnplug.testing.tolerances import tolerance_for

HF_WINDOW = 8  # transformers' window (keys, self included) of the window tests: prompts exceed it


def _build(config, cls=None, seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    if cls is None:
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    else:
        model = cls._from_config(config, attn_implementation="eager")
    return model.float().eval()


def _common(**kw):
    base = dict(vocab_size=models.VOCAB, num_hidden_layers=2, max_position_embeddings=256, initializer_range=0.1,
                eos_token_id=None, bos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    base.update(kw)
    return base


def mistral():
    from transformers import MistralConfig
    return MistralConfig(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                         sliding_window=HF_WINDOW, **_common())


def phi3():
    from transformers import Phi3Config
    return Phi3Config(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                      sliding_window=HF_WINDOW, **_common())


def starcoder2():
    from transformers import Starcoder2Config
    return Starcoder2Config(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                            sliding_window=HF_WINDOW, **_common())


def gemma3(**kw):
    from transformers import Gemma3TextConfig
    base = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                query_pre_attn_scalar=32, sliding_window=HF_WINDOW, layer_types=["sliding_attention", "full_attention"])
    base.update(kw)
    return Gemma3TextConfig(**_common(**base))


def _eager_greedy(model, prompts, new_tokens):
    """transformers' eager attention, the whole sequence every step (no cache)."""
    model.set_attn_implementation("eager")
    toks, logits = [], []
    with torch.inference_mode():
        for p in prompts:
            seq, steps = list(p), []
            for _ in range(new_tokens):
                out = model(input_ids=torch.tensor([seq]), use_cache=False).logits[0, -1].float()
                steps.append(out)
                seq.append(int(out.argmax()))
            toks.append(seq[len(p):])
            logits.append(torch.stack(steps))
    return toks, logits


def _served_like_eager(model, backend: str, prompts, new_tokens: int = 6, **runner_kw):
    ref_tokens, ref_logits = _eager_greedy(model, prompts, new_tokens)
    runner = TransformersRunner(model, AttentionConfig(attention_backend=backend), max_requests=len(prompts),
                                max_context_len=64, **runner_kw)
    tol = tolerance_for("float32")
    follower = greedy_rule.Follower(ref_tokens, ref_logits, tol)
    res = generate(runner, [Request(p, new_tokens) for p in prompts], sampler=follower, record_logits=True)
    for i in range(len(prompts)):
        got = torch.stack(res.logits[i])
        assert torch.allclose(got, ref_logits[i], atol=tol.atol * 10, rtol=tol.rtol * 10), \
            f"request {i}: logits differ from eager by {float((got - ref_logits[i]).abs().max()):.3g}"
    assert follower.checked == len(prompts) * new_tokens
    return runner


BACKENDS = ["torch_native", "triton", "vllm_cpu"]


# -- 1. windows from config.sliding_window only -----------------------------------------
@pytest.mark.parametrize("family", [mistral, phi3, starcoder2], ids=lambda f: f.__name__)
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_window_given_only_as_config_sliding_window_is_served(family, backend):
    config = family()
    assert getattr(config, "layer_types", None) is None  # the window is config.sliding_window only
    model = _build(config)
    # one prompt shorter than the window, two longer (the window hides keys), ragged
    prompts = models.prompts((5, 13, 21))
    runner = _served_like_eager(model, backend, prompts, page_size=16)
    assert [s.sliding_window for s in runner.layers] == [HF_WINDOW - 1] * 2


def test_the_window_matters_in_those_tests():
    """A Mistral served as full attention would differ from eager: the window tests can fail."""
    model = _build(mistral())
    prompts = models.prompts((21,))
    _, with_window = _eager_greedy(model, prompts, 2)
    model.config.sliding_window = None
    _, without = _eager_greedy(model, prompts, 2)
    assert float((with_window[0] - without[0]).abs().max()) > 1e-2


# -- 2. bidirectional attention ---------------------------------------------------------------
def _eager_all_logits(model, seqs):
    model.set_attn_implementation("eager")
    with torch.inference_mode():
        return [model(input_ids=torch.tensor([s]), use_cache=False).logits[0].float() for s in seqs]


@pytest.mark.parametrize("backend", BACKENDS)
def test_bidirectional_gemma3_encodes_ragged_sequences_like_eager(backend):
    model = _build(gemma3(use_bidirectional_attention=True))
    seqs = models.prompts((3, 17, 9, 12))  # ragged, three longer than the window
    ref = _eager_all_logits(model, seqs)
    causal_twin = _build(gemma3(use_bidirectional_attention=False))
    twin = _eager_all_logits(causal_twin, seqs)
    runner = TransformersRunner(model, AttentionConfig(attention_backend=backend), task="encode", max_requests=4,
                                max_context_len=32)
    assert [s.causality for s in runner.layers] == ["bidirectional"] * 2
    # Gemma3's config halves a bidirectional window (HF_WINDOW // 2 + 1 = 5: |p - j| < 5 both ways)
    assert model.config.sliding_window == HF_WINDOW // 2 + 1
    assert [s.sliding_window for s in runner.layers] == [HF_WINDOW // 2, None]
    out = runner.encode(seqs)
    tol = tolerance_for("float32")
    for got, want, causal in zip(out, ref, twin):
        assert got.shape == want.shape
        assert torch.allclose(got, want, atol=tol.atol * 10, rtol=tol.rtol * 10), float((got - want).abs().max())
        assert float((causal - want).abs().max()) > 1e-2  # causal attention would be caught
    # nothing outlives the forward
    assert runner.cache.requests == [] and runner.cache.pool.free_pages == runner.kv_cache.num_pages


def test_bidirectional_bert_encoder_is_served_by_encode():
    from transformers import BertConfig, BertLMHeadModel

    cfg = BertConfig(vocab_size=models.VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=128, max_position_embeddings=64, initializer_range=0.1, is_decoder=False)
    model = _build(cfg, BertLMHeadModel)
    seqs = models.prompts((4, 11, 7))
    ref = _eager_all_logits(model, seqs)
    runner = TransformersRunner(model, AttentionConfig(attention_backend="torch_native"), task="encode",
                                max_requests=3, max_context_len=32)
    assert all(s.uses_bidirectional for s in runner.layers)
    tol = tolerance_for("float32")
    for got, want in zip(runner.encode(seqs), ref):
        assert torch.allclose(got, want, atol=tol.atol * 10, rtol=tol.rtol * 10), float((got - want).abs().max())


def test_a_bidirectional_model_is_refused_by_a_backend_that_does_not_claim_it():
    model = _build(gemma3(use_bidirectional_attention=True, head_dim=32))
    with pytest.raises(NotSupportedError, match=r"layer 1 \(heads 4/2, head_dim 32, bidirectional\): "
                                                r"bidirectional \(non-causal\) attention is not claimed"):
        TransformersRunner(model, AttentionConfig(attention_backend="template_sdpa"), task="encode")
    assert model.config._attn_implementation == "eager"


def test_a_model_switched_to_causal_after_build_is_caught_at_its_call():
    model = _build(gemma3(use_bidirectional_attention=True))
    runner = TransformersRunner(model, AttentionConfig(attention_backend="torch_native"), task="encode",
                                max_requests=2, max_context_len=32)
    model.model.layers[1].self_attn.is_causal = True
    with pytest.raises(Exception, match=r"layer 1: the model's attention is causal .* causality='bidirectional'"):
        runner.encode([[1, 2, 3]])
    assert runner.cache.requests == []


# -- 3. a stored field the forward does not pass --------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_gemma3_softcap_it_never_passes_is_not_claimed(backend):
    model = _build(gemma3(attn_logit_softcapping=50.0))
    runner = _served_like_eager(model, backend, models.prompts((5, 13)), new_tokens=4)
    assert [s.logit_cap for s in runner.layers] == [None, None]
    assert any("attn_logit_softcapping=50.0 is stored but the forward passes no softcap" in n for n in runner.notes)


def test_gemma2_softcap_it_passes_is_claimed():
    specs = TransformersRunner(models.build("gemma2"), AttentionConfig(attention_backend="torch_native"),
                               max_requests=1, max_context_len=32).layers
    assert [s.logit_cap for s in specs] == [50.0, 50.0]


# -- 4. refusals naming the real cause --------------------------------------------------------
def _tiny(model_type, **kw):
    from transformers import AutoConfig
    base = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=models.VOCAB,
                intermediate_size=64)
    base.update(kw)
    return AutoConfig.for_model(model_type, **base)


REFUSALS = {
    "falcon": (lambda: _build(_tiny("falcon")),
               r"model family 'falcon' \(FalconForCausalLM\): FalconForCausalLM does not route attention through "
               r"transformers' AttentionInterface .* What to do: use a model whose transformers implementation"),
    "qwen3_next": (lambda: _build(_tiny("qwen3_next", layer_types=["linear_attention", "full_attention"])),
                   r"model family 'qwen3_next' \(Qwen3NextForCausalLM\): layers \[0\] are of type 'linear_attention' "
                   r"\(config.layer_types\): a linear-attention layer .* What to do: serve a model whose layers"),
    "bart_seq2seq": (lambda: _build(_tiny("bart", encoder_layers=1, decoder_layers=1, d_model=64),
                                    cls=__import__("transformers").BartForConditionalGeneration),
                     r"model family 'bart' \(BartForConditionalGeneration\): an encoder-decoder model: its decoder's "
                     r"cross-attention .* What to do: serve a decoder-only model"),
    "bart_decoder": (lambda: _build(_tiny("bart", decoder_layers=2, d_model=64)),
                     r"model family 'bart' \(BartForCausalLM\): position_ids: the model's attention inputs do not "
                     r"change with position_ids"),
    "bert_generate": (lambda: _build(_tiny("bert")),
                      r"model family 'bert' \(BertLMHeadModel\): .*its attention is bidirectional .* What to do: serve "
                      r"it with TransformersRunner\(\.\.\., task='encode'\)"),
}


@pytest.mark.parametrize("name", sorted(REFUSALS))
def test_refusals_name_family_cause_and_remedy_before_any_forward(name):
    build, pattern = REFUSALS[name]
    model = build()
    with pytest.raises(ModelNotServedError, match=pattern) as err:
        TransformersRunner(model, AttentionConfig(attention_backend="torch_native"), max_requests=2,
                           max_context_len=32)
    assert isinstance(err.value, NotSupportedError)
    assert model.config._attn_implementation == "eager"  # left as it was


def test_gpt_neox_head_size_is_found_and_served():
    """GPT-NeoX names its head size ``head_size``: found, and served like eager."""
    model = _build(_tiny("gpt_neox", initializer_range=0.1, eos_token_id=None, bos_token_id=None))
    runner = _served_like_eager(model, "torch_native", models.prompts((5, 12)), new_tokens=4)
    assert [s.head_dim for s in runner.layers] == [16, 16]


@pytest.mark.parametrize("head_dim", [16, 24])
def test_a_head_dim_the_backend_cannot_hold_is_a_not_supported_error_naming_the_layer(head_dim):
    from transformers import LlamaConfig
    model = _build(LlamaConfig(hidden_size=4 * head_dim, intermediate_size=64, num_attention_heads=4,
                               num_key_value_heads=2, **_common()))
    with pytest.raises(NotSupportedError, match=rf"'vllm_cpu' does not support this layer: layer 0 \(heads 4/2, "
                                                rf"head_dim {head_dim}\): head_dim={head_dim} \(supported: 32, 48"):
        TransformersRunner(model, AttentionConfig(attention_backend="vllm_cpu"), max_requests=1, max_context_len=32)
    assert model.config._attn_implementation == "eager"


def test_scaling_from_the_call_not_the_default():
    """Gemma3's scaling is query_pre_attn_scalar ** -0.5 (not 1/sqrt(head_dim)): read from the call."""
    runner = TransformersRunner(_build(gemma3(query_pre_attn_scalar=20)),
                                AttentionConfig(attention_backend="torch_native"), max_requests=1, max_context_len=32)
    assert all(math.isclose(s.scaling, 20 ** -0.5) for s in runner.layers)
