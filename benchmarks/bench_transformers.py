"""Generated tokens/s: a transformers model through attnplug vs transformers' own sdpa, side by side.

    python benchmarks/bench_transformers.py [--backend auto --batch 8 --new-tokens 64 \
        --hidden 256 --layers 4 --repeats 3]

One small Llama-style model (random weights from a config, no download), one
batch of prompts of different lengths, greedy decoding:

* baseline: ``model.generate()`` with ``attn_implementation="sdpa"`` on the
  left-padded batch (transformers' normal batched path, its own DynamicCache);
* attnplug: ``TransformersRunner`` + ``generate`` (ragged, no padding, the
  paged cache), every request arriving at step 0.

``--backend auto`` (the default) serves through the pair resolution gives this
host (what a user gets without naming a backend: cpu_fused where its kernel is
installed, else torch_native); the name it resolved to is printed.

Runs alternate (baseline, attnplug, baseline, ...) and the median of each is
reported, with the ratio and, for attnplug, where its time goes per generated
token (the backend's forwards, per-forward metadata, building the
``ForwardBatch``, the rest of the model, the loop's own bookkeeping; means over
the same runs). On a shared machine, compare
``--threads 1`` runs: with more threads than free cores the small GEMMs of
both runs are dominated by thread contention. Timings only; nothing is asserted.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="auto",
                        help="attention backend for attnplug (auto: the pair resolution gives this host)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--min-prompt", type=int, default=32)
    parser.add_argument("--max-prompt", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="wall: perf_counter; cpu: the process's CPU time (with --threads 1: time off the core "
                             "on a shared machine is left out)")
    args = parser.parse_args(argv)
    if args.clock == "cpu" and args.threads != 1:
        parser.error("--clock cpu needs --threads 1 (CPU time of several threads adds up)")
    if args.clock == "cpu":
        time.perf_counter = time.process_time  # every timer below (and only this script's) reads CPU time

    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from attnplug import AttentionConfig
    from attnplug.integrations.transformers import Request, TransformersRunner, generate

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1024, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, max_position_embeddings=4096,
                         eos_token_id=None, bos_token_id=None, pad_token_id=0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    g = torch.Generator().manual_seed(1)
    lens = torch.linspace(args.min_prompt, args.max_prompt, args.batch).round().long().tolist()
    prompts = [torch.randint(1, 1024, (n,), generator=g).tolist() for n in lens]
    longest = max(lens)
    ids = torch.zeros(args.batch, longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding, as transformers' batched generate expects
        ids[i, longest - len(p):] = torch.tensor(p)
        mask[i, longest - len(p):] = 1
    n_new = args.new_tokens
    total = args.batch * n_new

    config = AttentionConfig() if args.backend == "auto" else AttentionConfig(attention_backend=args.backend)
    runner = TransformersRunner(model, config, max_requests=args.batch, max_context_len=longest + n_new + 16)
    prefill, decode = runner.pair
    served = str(decode) if prefill == decode else f"{prefill}/{decode}"
    timers = {"attention": 0.0, "metadata": 0.0, "batch": 0.0}
    forward, init = runner.backend.forward, runner.backend.init_forward_metadata

    def timed_forward(*a, **kw):
        t = time.perf_counter()
        try:
            return forward(*a, **kw)
        finally:
            timers["attention"] += time.perf_counter() - t

    def timed_init(batch):
        t = time.perf_counter()
        try:
            return init(batch)
        finally:
            timers["metadata"] += time.perf_counter() - t

    runner.backend.forward, runner.backend.init_forward_metadata = timed_forward, timed_init
    make_batch = runner._batch

    def timed_batch(*a, **kw):
        t = time.perf_counter()
        try:
            return make_batch(*a, **kw)
        finally:
            timers["batch"] += time.perf_counter() - t

    runner._batch = timed_batch
    model_time = [0.0]
    run_model = runner._run

    def timed_run(*a, **kw):
        t = time.perf_counter()
        try:
            return run_model(*a, **kw)
        finally:
            model_time[0] += time.perf_counter() - t

    runner._run = timed_run

    def baseline() -> float:
        model.set_attn_implementation("sdpa")
        t = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=n_new, min_new_tokens=n_new,
                                 do_sample=False, pad_token_id=0)
        dt = time.perf_counter() - t
        assert out.shape[1] == longest + n_new
        return dt

    def ours() -> float:
        model.set_attn_implementation("attnplug")
        t = time.perf_counter()
        res = generate(runner, [Request(p, n_new) for p in prompts], max_running=args.batch)
        dt = time.perf_counter() - t
        assert sum(map(len, res.tokens)) == total
        return dt

    baseline(), ours()  # warm-up: first-call allocations and lazy imports
    for k in timers:
        timers[k] = 0.0
    model_time[0] = 0.0
    base_t, our_t = [], []
    for _ in range(args.repeats):
        base_t.append(baseline())
        our_t.append(ours())
    b, o = statistics.median(base_t), statistics.median(our_t)
    print(f"model: Llama-style, hidden {args.hidden}, {args.layers} layers, heads {args.heads}/{args.kv_heads}, "
          f"vocab 1024, float32, torch threads {torch.get_num_threads()}")
    print(f"clock: {args.clock}")
    print(f"batch: {args.batch} prompts of {lens[0]}..{lens[-1]} tokens, {n_new} new tokens each "
          f"(greedy), median of {args.repeats}")
    print(f"{'run':<34} {'s':>8} {'tokens/s':>10} {'ratio':>7}")
    print(f"{'transformers generate(), sdpa':<34} {b:8.3f} {total / b:10.1f} {1.0:7.2f}")
    print(f"{'attnplug ' + served + ', generate()':<34} {o:8.3f} {total / o:10.1f} {b / o:7.2f}")
    n, mean = args.repeats, statistics.mean(our_t)
    attn, meta, mod, fb = (timers["attention"] / n, timers["metadata"] / n, model_time[0] / n, timers["batch"] / n)
    print(f"attnplug, mean of {n} runs ({mean:.3f} s): attention kernels {attn:.3f} s, metadata {meta:.3f} s, "
          f"rest of the model {mod - attn - meta:.3f} s, loop and batching {mean - mod:.3f} s")
    us = 1e6 / total  # per generated token
    print(f"per generated token (us): whole {mean * us:.0f}, the backend's forwards {attn * us:.0f}, "
          f"init_forward_metadata {meta * us:.0f}, ForwardBatch {fb * us:.0f}, rest of the model "
          f"{(mod - attn - meta) * us:.0f}, loop and runner bookkeeping {(mean - mod - fb) * us:.0f}; "
          f"sdpa's whole token {statistics.mean(base_t) * us:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
