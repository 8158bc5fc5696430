"""LayerSpecs read from the models, and the sliding-window translation at its boundary."""

from __future__ import annotations

import math

import pytest
import torch

import hf_models as models
from attnplug import ForwardBatch, LayerSpec, NotSupportedError, PagedKVCache
from attnplug.integrations.transformers import attnplug_sliding_window, layer_specs
from attnplug.registry import default_registry


def test_specs_carry_heads_scaling_windows_softcap_and_sinks():
    llama = layer_specs(models.build("llama"))
    assert [(s.num_heads, s.num_kv_heads, s.head_dim, s.sliding_window, s.logit_cap, s.sinks) for s in llama] == \
        [(8, 2, 16, None, None, None)] * 2
    assert [s.head_dim for s in layer_specs(models.build("qwen2_hd48"))] == [48, 48]
    g = layer_specs(models.build("gemma2"))
    assert [s.sliding_window for s in g] == [models.HF_WINDOW - 1, None]
    assert [s.logit_cap for s in g] == [50.0, 50.0]
    assert all(math.isclose(s.scaling, 24 ** -0.5) for s in g)
    model = models.build("gpt_oss")
    o = layer_specs(model)
    assert [s.sliding_window for s in o] == [models.HF_WINDOW - 1, None]
    for s, layer in zip(o, model.model.layers):
        assert torch.equal(s.sinks, layer.self_attn.sinks)


def test_window_translation_rejects_nonsense():
    assert attnplug_sliding_window(None) is None and attnplug_sliding_window(1) == 0
    with pytest.raises(ValueError, match="sliding_window=0"):
        attnplug_sliding_window(0)


def test_an_unserved_layer_type_is_refused_by_name():
    model = models.build("llama")
    model.config.layer_types = ["full_attention", "chunked_attention"]
    with pytest.raises(NotSupportedError, match=r"model family 'llama' \(LlamaForCausalLM\): layers \[1\] are of "
                                                r"type 'chunked_attention' \(config.layer_types\): chunked local"):
        layer_specs(model)


def _attnplug_out(sw, q, k, v):
    L, H, D = q.shape
    cache = PagedKVCache(num_layers=1, num_pages=L, num_kv_heads=k.shape[1], head_dim=D, page_size=1,
                         max_requests=1, max_context_len=L)
    cache.assign_pages(0, L, list(range(L)))
    from attnplug import AttentionConfig, BuildContext
    reg = default_registry()
    ctx = BuildContext(config=AttentionConfig(attention_backend="torch_native"), host=reg.host, kv_cache=cache,
                       num_heads=H, num_kv_heads=k.shape[1], head_dim=D, page_size=1, max_context_len=L)
    _, backend = reg.build("torch_native", ctx)
    batch = ForwardBatch.extend([0], [0], [L], cache.slots(0, 0, L))
    backend.init_forward_metadata(batch)
    return backend.forward(q, k, v, LayerSpec(0, H, k.shape[1], D, sliding_window=sw), batch).double()


@pytest.mark.parametrize("hf_window", [1, 2, 7, 24])
def test_window_boundary_matches_transformers_mask_and_off_by_one_does_not(hf_window):
    """transformers' own mask function is the ground truth: W keys per query, itself included."""
    from transformers.masking_utils import sliding_window_causal_mask_function

    L, H, D = 40, 2, 16
    g = torch.Generator().manual_seed(hf_window)
    q, k, v = (torch.randn(L, H, D, generator=g) * 2 for _ in range(3))
    allowed_fn = sliding_window_causal_mask_function(hf_window)
    idx = torch.arange(L)
    allowed = allowed_fn(torch.tensor(0), torch.tensor(0), idx[:, None], idx[None, :]).expand(L, L)
    assert int(allowed[-1].sum()) == hf_window  # the last query sees exactly W keys
    s = torch.einsum("qhd,khd->hqk", q.double(), k.double()) / math.sqrt(D)
    ref = torch.einsum("hqk,khd->qhd", s.masked_fill(~allowed, -math.inf).softmax(-1), v.double())

    def err(sw):
        return float((_attnplug_out(sw, q, k, v) - ref).abs().max())

    sw = attnplug_sliding_window(hf_window)
    assert err(sw) < 1e-4
    assert err(sw + 1) > 1e-2
    if sw > 0:
        assert err(sw - 1) > 1e-2
