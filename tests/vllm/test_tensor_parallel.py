"""tensor_parallel_size=2 (vLLM's multiprocessing executor, one CPU core per rank): every rank loads the
entry point, resolves the same pair over its own per-rank head counts, and generates the same float32 greedy
tokens as vLLM's own CPU_ATTN on one rank (saved weights: each rank loads its shard of the same model)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def test_two_ranks_resolve_over_their_own_heads_and_generate_the_one_rank_tokens(model_dir, reference) -> None:
    ref_tokens, _, _ = reference("llama")
    env = dict(os.environ, ATTNPLUG_VLLM="1", ATTNPLUG_VLLM_ARGS="", VLLM_CPU_OMP_THREADS_BIND="0|1",
               VLLM_ENABLE_V1_MULTIPROCESSING="0")
    proc = subprocess.run([sys.executable, str(Path(__file__).parent / "tp_run.py"), model_dir("llama"), "2"],
                          env=env, capture_output=True, text=True, timeout=400)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    for rank in (0, 1):  # llama: 4 heads / 2 KV heads, so 2/1 on each rank
        assert f"attnplug rank {rank}: layer 0 served as heads 2/1" in out, out[-4000:]
        assert f"attnplug serves vLLM attention (rank {rank}" in out
    tokens = json.loads(next(line for line in out.splitlines() if line.startswith("TOKENS "))[7:])
    assert tokens == ref_tokens
