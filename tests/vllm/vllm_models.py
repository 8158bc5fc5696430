"""Tiny models for the vLLM tier: seeded random weights saved with transformers' ``save_pretrained`` and
loaded by vLLM normally (``load_format="dummy"`` would draw each TP rank's shard on its own and use tiny
weights under which attention is nearly uniform; these are drawn with std 0.1 so masks, windows and sinks
change the tokens)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

#: one engine's settings: in-process, small KV memory, chunked prefill and prefix caching on
ENGINE_ARGS: dict[str, Any] = dict(
    skip_tokenizer_init=True, dtype="float32", enforce_eager=True, max_model_len=256, seed=0,
    enable_prefix_caching=True, enable_chunked_prefill=True, max_num_batched_tokens=64, max_num_seqs=8,
    block_size=32, gpu_memory_utilization=0.2, kv_cache_memory_bytes=32 << 20,
)
HF_WINDOW = 24  # keys a sliding-window query sees, itself included (transformers' and vLLM's convention)


def _common() -> dict[str, Any]:
    return dict(vocab_size=512, num_hidden_layers=2, max_position_embeddings=512, tie_word_embeddings=False,
                initializer_range=0.1)


def configs() -> dict[str, Any]:
    from transformers import Gemma2Config, GptOssConfig, LlamaConfig, Qwen3Config

    return {
        "llama": LlamaConfig(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                             head_dim=32, **_common()),
        "qwen3": Qwen3Config(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=1,
                             head_dim=64, **_common()),
        # sliding windows on some layers: layer 0 slides (W=24), layer 1 attends to everything (vLLM's
        # Qwen2 refuses a window on some layers only); soft-caps off (vllm_cpu does not claim soft-cap)
        "gemma2_sliding": Gemma2Config(hidden_size=128, intermediate_size=256, num_attention_heads=4,
                                       num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=32,
                                       sliding_window=HF_WINDOW, layer_types=["sliding_attention", "full_attention"],
                                       attn_logit_softcapping=None, final_logit_softcapping=None,
                                       **{**_common(), "tie_word_embeddings": True}),  # vLLM's Gemma2 ties them
        "gpt_oss": GptOssConfig(hidden_size=128, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                                head_dim=32, num_local_experts=2, num_experts_per_tok=2, sliding_window=HF_WINDOW,
                                rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                                                 "beta_slow": 1.0, "truncate": False,
                                                 "original_max_position_embeddings": 128, "rope_theta": 150000.0},
                                **_common()),
    }


def save(name: str, root: Path, seed: int = 0) -> str:
    """The folder of model ``name`` (saved once under ``root``)."""
    from transformers import AutoModelForCausalLM

    out = root / name
    if (out / "config.json").exists():
        return str(out)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(configs()[name], torch_dtype=torch.float32)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.dim() == 1 and "sinks" not in pname:  # norms stay at 1
                continue
            # Gemma2 ties the output to the input embedding and scales it by sqrt(hidden): at std 0.1 the
            # residual stream keeps the input token and greedy decoding repeats it whatever attention does
            std = 0.02 if name == "gemma2_sliding" and "embed_tokens" in pname else 0.1
            p.copy_(torch.randn(p.shape, generator=g) * std)
    model.save_pretrained(out)
    return str(out)


def prompts() -> list[list[int]]:
    """8 concurrent prompts of different lengths (1 .. ~150 tokens); all but two share a 70-token prefix (two
    full 32-token blocks: prefix-cache hits), long ones are prefilled in chunks of max_num_batched_tokens."""
    g = torch.Generator().manual_seed(7)
    shared = torch.randint(1, 512, (70,), generator=g).tolist()
    tails = [1, 5, 17, 40, 80]
    out = [shared + torch.randint(1, 512, (t,), generator=g).tolist() for t in tails]
    out += [torch.randint(1, 512, (n,), generator=g).tolist() for n in (1, 9, 120)]
    return out


def generate(llm: Any, max_tokens: int = 12) -> tuple[list[list[int]], list[int]]:
    """Greedy tokens of every prompt, and how many prompt tokens vLLM found in its prefix cache."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(temperature=0, max_tokens=max_tokens, detokenize=False, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts()], sp, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], [int(o.num_cached_tokens or 0) for o in outs]


def env_on(args: str = "") -> None:
    os.environ["ATTNPLUG_VLLM"] = "1"
    os.environ["ATTNPLUG_VLLM_ARGS"] = args
