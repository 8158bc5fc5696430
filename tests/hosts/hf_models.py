"""Small transformers models built from configs with seeded random weights (no downloads).

Each architecture is a few layers with hidden size <= 256. Weights are drawn
with ``initializer_range=0.1`` (not the usual 0.02) so attention scores are of
order one and attention is far from uniform: masks, windows, soft-cap and sinks
then change the logits measurably. gpt-oss sinks are redrawn from N(0, 1) for
the same reason.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

VOCAB = 256
#: prompt lengths of the parity tests (the issue: 4 prompts of lengths 5 … 300)
PROMPT_LENS = (5, 64, 171, 300)
NEW_TOKENS = 32
#: transformers' sliding window (keys per query, self included) of the sliding layers
HF_WINDOW = 24


def _common() -> dict[str, Any]:
    return dict(vocab_size=VOCAB, num_hidden_layers=2, max_position_embeddings=1024, initializer_range=0.1,
                eos_token_id=None, bos_token_id=None, pad_token_id=None, tie_word_embeddings=False)


def llama() -> Any:
    from transformers import LlamaConfig
    return LlamaConfig(hidden_size=128, intermediate_size=256, num_attention_heads=8, num_key_value_heads=2,
                       **_common())


def qwen3() -> Any:
    from transformers import Qwen3Config
    return Qwen3Config(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=32, **_common())


def qwen2_head48() -> Any:
    from transformers import Qwen2Config
    # head_dim 192 / 4 = 48: not a power of two
    return Qwen2Config(hidden_size=192, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                       **_common())


def gemma2() -> Any:
    from transformers import Gemma2Config
    # layer 0 sliding, layer 1 full (transformers' default alternation); scaling 1/sqrt(24), not 1/sqrt(head_dim)
    return Gemma2Config(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=32, query_pre_attn_scalar=24, attn_logit_softcapping=50.0,
                        final_logit_softcapping=30.0, sliding_window=HF_WINDOW, **_common())


def gpt_oss() -> Any:
    from transformers import GptOssConfig
    return GptOssConfig(hidden_size=128, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=32, num_local_experts=2, num_experts_per_tok=2, sliding_window=HF_WINDOW,
                        # gpt-oss's YaRN rope, scaled to this model's 1024 positions
                        rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                         "truncate": False, "original_max_position_embeddings": 256,
                                         "rope_theta": 150000.0},
                        **_common())


@dataclasses.dataclass(frozen=True)
class Arch:
    name: str
    config: Callable[[], Any]
    #: the features the model needs from a backend (for skipping/refusal checks)
    features: tuple[str, ...] = ()


ARCHS = {
    "llama": Arch("llama", llama, ("gqa",)),
    "qwen3": Arch("qwen3", qwen3, ("gqa",)),
    "qwen2_hd48": Arch("qwen2_hd48", qwen2_head48, ("gqa", "head_dim 48")),
    "gemma2": Arch("gemma2", gemma2, ("sliding_window", "logit_softcap")),
    "gpt_oss": Arch("gpt_oss", gpt_oss, ("sliding_window", "sinks")),
}


def build(arch: str, *, dtype: torch.dtype = torch.float32, attn: str = "eager", seed: int = 0) -> Any:
    """A fresh model of ``arch`` with seeded random weights (the same weights for the same seed)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(ARCHS[arch].config(), attn_implementation=attn)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".sinks"):
                p.copy_(torch.randn(p.shape, generator=g))
    return model.to(dtype).eval()


def prompts(lens: tuple[int, ...] = PROMPT_LENS, seed: int = 7) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lens]


def reference(model: Any, prompt_list: list[list[int]], new_tokens: int = NEW_TOKENS
              ) -> list[tuple[list[int], torch.Tensor]]:
    """transformers' own greedy ``generate()`` (eager attention), one prompt at a time:
    per prompt, the generated ids and the ``[new_tokens, vocab]`` float32 logits of each step."""
    model.set_attn_implementation("eager")
    out = []
    with torch.inference_mode():
        for p in prompt_list:
            ids = torch.tensor([p])
            o = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                               min_new_tokens=new_tokens, do_sample=False, output_logits=True,
                               return_dict_in_generate=True)
            out.append((o.sequences[0, len(p):].tolist(), torch.stack([s[0] for s in o.logits]).float()))
    return out


def cpu_default() -> str:
    """The backend resolution fills an unset half with on this CPU host: the highest priority available,
    cpu_fused where its compiled kernel is installed (docs/performance.md), else torch_native."""
    from attnplug.registry import default_registry

    reg = default_registry()
    return "cpu_fused" if "cpu_fused" in reg.names() and reg.availability("cpu_fused").available \
        else "torch_native"
