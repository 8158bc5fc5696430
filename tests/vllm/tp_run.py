"""Run by test_tensor_parallel.py in a process of its own: the llama model at the given tensor-parallel
size, through attnplug (ATTNPLUG_VLLM from the environment); prints the greedy tokens as JSON."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import vllm_models as models

if __name__ == "__main__":  # vLLM starts worker processes
    path, tp = sys.argv[1], int(sys.argv[2])
    from vllm import LLM

    llm = LLM(model=path, tensor_parallel_size=tp, distributed_executor_backend="mp", **models.ENGINE_ARGS)
    tokens, _ = models.generate(llm)
    print("TOKENS " + json.dumps(tokens), flush=True)
    os._exit(0)
