"""Tokens/s of vLLM's ``LLM.generate`` served three ways, side by side in one process: vLLM's own
``CPU_ATTN``, attnplug ``vllm_cpu`` and attnplug ``torch_native`` (``docs/performance.md``, "vLLM host").

Three in-process engines on one seeded model are built first (vLLM's own before attnplug is registered),
then timed round-robin: each round runs one ``generate`` of ``--prompts`` concurrent prompts on every
engine, in a rotating order; prefix caching is off so every round does the same work. Reported: median
tokens/s over the rounds, and each engine's median ratio to vLLM's own (per round, so machine noise that
hits one round hits all three alike), both per wall second and per CPU second of this process (the engines
run in it: on a shared, oversubscribed machine the CPU time is the steadier measure of work).

Run in the vLLM tier's environment (``tox -e vllm``'s, or ``.venv-vllm``):

    python benchmarks/bench_vllm_host.py [--rounds 7] [--prompts 8] [--new-tokens 64] [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.pop("ATTNPLUG_VLLM", None)


def save_model(root: Path, layers: int, hidden: int, heads: int, kv_heads: int, head_dim: int) -> str:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, head_dim=head_dim, num_hidden_layers=layers, vocab_size=1024,
                      max_position_embeddings=2048, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.05)
    model.save_pretrained(root / "llama")
    return str(root / "llama")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=256, help="longest prompt (they range from a quarter of it)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    import attnplug.integrations.vllm as integ
    from attnplug.integrations.vllm import backend as B

    tmp = Path(tempfile.mkdtemp(prefix="bench_vllm_host_"))
    path = save_model(tmp, args.layers, args.hidden, args.heads, args.kv_heads, args.head_dim)
    engine_args = dict(skip_tokenizer_init=True, dtype=args.dtype, enforce_eager=True, seed=0,
                       max_model_len=args.prompt_len + args.new_tokens + 32, enable_prefix_caching=False,
                       max_num_seqs=args.prompts, block_size=32, gpu_memory_utilization=0.2,
                       kv_cache_memory_bytes=256 << 20)
    g = torch.Generator().manual_seed(3)
    lens = [args.prompt_len // 4 + (i * (args.prompt_len - args.prompt_len // 4)) // max(1, args.prompts - 1)
            for i in range(args.prompts)]
    prompts = [TokensPrompt(prompt_token_ids=torch.randint(1, 1024, (n,), generator=g).tolist()) for n in lens]
    sp = SamplingParams(temperature=0, max_tokens=args.new_tokens, detokenize=False, ignore_eos=True)

    engines: dict[str, object] = {}
    integ.unregister()
    engines["vLLM CPU_ATTN"] = LLM(model=path, **engine_args)
    os.environ["ATTNPLUG_VLLM"] = "1"
    integ.register()
    for name in ("vllm_cpu", "torch_native"):
        os.environ["ATTNPLUG_VLLM_ARGS"] = f"--attention-backend {name}"
        engines[f"attnplug {name}"] = LLM(model=path, **engine_args)
        assert B.engine_states()[-1].pair == (name, name)

    def run(llm: object) -> tuple[float, float, list[list[int]]]:
        t0, c0 = time.perf_counter(), time.process_time()
        outs = llm.generate(prompts, sp, use_tqdm=False)  # type: ignore[attr-defined]
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        n = sum(len(o.outputs[0].token_ids) for o in outs)
        return n / dt, n / dc, [list(o.outputs[0].token_ids) for o in outs]

    names = list(engines)
    for n in names:  # warm-up, and the tokens every engine generates
        run(engines[n])
    tps: dict[str, list[float]] = {n: [] for n in names}
    tpc: dict[str, list[float]] = {n: [] for n in names}
    tokens: dict[str, list[list[int]]] = {}
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for n in order:
            rate, cpu_rate, tokens[n] = run(engines[n])
            tps[n].append(rate)
            tpc[n].append(cpu_rate)
        gc.collect()
    ref = names[0]
    rows = []
    for n in names:
        ratios = [a / b for a, b in zip(tps[n], tps[ref])]
        cpu_ratios = [a / b for a, b in zip(tpc[n], tpc[ref])]
        rows.append(dict(engine=n, tokens_per_s=statistics.median(tps[n]), ratio_vs_vllm=statistics.median(ratios),
                         tokens_per_cpu_s=statistics.median(tpc[n]),
                         cpu_ratio_vs_vllm=statistics.median(cpu_ratios),
                         same_tokens_as_vllm=tokens[n] == tokens[ref]))
    print(f"model: Llama {args.layers} layers, hidden {args.hidden}, heads {args.heads}/{args.kv_heads}, head_dim "
          f"{args.head_dim}, {args.dtype}; {args.prompts} concurrent prompts of {lens[0]}-{lens[-1]} tokens, "
          f"{args.new_tokens} new tokens each; {args.rounds} rounds, torch threads {torch.get_num_threads()}")
    print(f"{'engine':<24}{'tokens/s':>10}{'vs vLLM':>10}{'tokens/cpu-s':>14}{'vs vLLM':>10}  same tokens")
    for row in rows:
        print(f"{row['engine']:<24}{row['tokens_per_s']:>10.1f}{row['ratio_vs_vllm']:>10.3f}"
              f"{row['tokens_per_cpu_s']:>14.1f}{row['cpu_ratio_vs_vllm']:>10.3f}  {row['same_tokens_as_vllm']}")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(args=vars(args), rows=rows, raw_wall=tps, raw_cpu=tpc), indent=2))
    sys.stdout.flush()
    os._exit(0)  # in-process engines: skip their slow teardown


if __name__ == "__main__":
    main()
