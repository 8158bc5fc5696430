"""Serve a transformers model through attnplug: continuous batching, greedy decoding."""

import argparse

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from attnplug.config import add_attention_args, config_from_args
from attnplug.integrations.transformers import Request, TransformersRunner, generate

parser = argparse.ArgumentParser()
add_attention_args(parser)  # the standard flags; unset halves are resolved for the model and host
args = parser.parse_args()

torch.manual_seed(0)  # a small Llama from a config, random weights: no download
model = AutoModelForCausalLM.from_config(LlamaConfig(
    vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
    num_attention_heads=8, num_key_value_heads=2, eos_token_id=None))

runner = TransformersRunner(model, config_from_args(args), max_requests=4, max_context_len=256)
print("serving pair:", runner.pair)

prompts = [[1, 5, 9, 2, 7], list(range(10, 50)), list(range(3, 20))]
requests = [Request(prompts[0], 6), Request(prompts[1], 3), Request(prompts[2], 4, arrival=2)]
result = generate(runner, requests, max_running=2)  # the third request joins while others decode
print("forwards:", " ".join(f"{s.mode.value}:{s.num_tokens}->{s.served_by}" for s in result.steps))

with torch.inference_mode():  # transformers' own greedy generate, eager attention, one prompt alone
    model.set_attn_implementation("eager")
    solo = model.generate(torch.tensor([prompts[2]]), max_new_tokens=4, do_sample=False)
print("same tokens as transformers:", result.tokens[2] == solo[0, len(prompts[2]):].tolist())
