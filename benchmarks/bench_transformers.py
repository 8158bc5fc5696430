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

After two warm-up pairs, runs alternate in pairs (sdpa then attnplug, then
attnplug then sdpa, ...) with nothing instrumented, and the median of each side
is reported with the ratio (and the median of the per-pair ratios). The same
number of attnplug runs then follows with timers around its pieces, for where
its time goes per generated token (the backend's forwards, per-forward
metadata, building the ``ForwardBatch``, the rest of the model, the loop's own
bookkeeping; means over those runs): the timers cost a little, so they stay out
of the ratio. Both sides generate every one of the new tokens (no end-of-sequence
token), greedily, from the same model. The load average before and after the
timed pairs is printed. On a shared machine, compare ``--threads 1`` runs (with
``--clock cpu``): with more threads than free cores the small GEMMs of both runs
are dominated by thread contention. Timings only; nothing is asserted.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any, Callable


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
    clock = time.process_time if args.clock == "cpu" else time.perf_counter

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

    def baseline() -> float:
        model.set_attn_implementation("sdpa")
        t = clock()
        with torch.inference_mode():
            # eos_token_id is None (config and generation config): generate() runs every one of the n_new steps
            out = model.generate(ids, attention_mask=mask, max_new_tokens=n_new, do_sample=False, pad_token_id=0)
        dt = clock() - t
        assert out.shape[1] == longest + n_new
        return dt

    def ours() -> float:
        model.set_attn_implementation("attnplug")
        t = clock()
        res = generate(runner, [Request(p, n_new) for p in prompts], max_running=args.batch)
        dt = clock() - t
        assert sum(map(len, res.tokens)) == total
        return dt

    load_before = os.getloadavg()
    for _ in range(2):  # warm-up: first-call allocations, lazy imports, the allocator's pools
        baseline(), ours()
    # the timed pairs, uninstrumented; the order alternates (sdpa first, then attnplug first) so drift in the
    # machine's load weighs on both sides alike
    base_t, our_t = [], []
    for i in range(args.repeats):
        if i % 2:
            our_t.append(ours())
            base_t.append(baseline())
        else:
            base_t.append(baseline())
            our_t.append(ours())
    load_after = os.getloadavg()
    # then as many instrumented attnplug runs, for the split of its time only (the timers cost a little)
    timers = {"attention": 0.0, "metadata": 0.0, "batch": 0.0, "model": 0.0}
    backend = runner.backend
    backend.forward = _timed(backend.forward, timers, "attention", clock)
    backend.init_forward_metadata = _timed(backend.init_forward_metadata, timers, "metadata", clock)
    runner._batch = _timed(runner._batch, timers, "batch", clock)
    runner._run = _timed(runner._run, timers, "model", clock)
    split_t = [ours() for _ in range(args.repeats)]
    for obj, name in ((backend, "forward"), (backend, "init_forward_metadata"), (runner, "_batch"), (runner, "_run")):
        delattr(obj, name)  # the class's own method again
    b, o = statistics.median(base_t), statistics.median(our_t)
    pair = statistics.median(bt / ot for bt, ot in zip(base_t, our_t))
    print(f"model: Llama-style, hidden {args.hidden}, {args.layers} layers, heads {args.heads}/{args.kv_heads}, "
          f"vocab 1024, float32, torch threads {torch.get_num_threads()}")
    print(f"clock: {args.clock}; load average {load_before[0]:.1f} before, {load_after[0]:.1f} after")
    print(f"batch: {args.batch} prompts of {lens[0]}..{lens[-1]} tokens, {n_new} new tokens each "
          f"(greedy), median of {args.repeats} alternating pairs after 2 warm-up pairs")
    print(f"{'run':<34} {'s':>8} {'tokens/s':>10} {'ratio':>7}")
    print(f"{'transformers generate(), sdpa':<34} {b:8.3f} {total / b:10.1f} {1.0:7.2f}")
    print(f"{'attnplug ' + served + ', generate()':<34} {o:8.3f} {total / o:10.1f} {b / o:7.2f}")
    print(f"median of the per-pair ratios: {pair:.3f}")
    n, mean = args.repeats, statistics.mean(split_t)
    attn, meta, mod, fb = (timers["attention"] / n, timers["metadata"] / n, timers["model"] / n, timers["batch"] / n)
    print(f"attnplug, {n} more runs with timers (mean {mean:.3f} s): attention kernels {attn:.3f} s, metadata "
          f"{meta:.3f} s, rest of the model {mod - attn - meta:.3f} s, loop and batching {mean - mod:.3f} s")
    us = 1e6 / total  # per generated token
    print(f"per generated token (us): whole {mean * us:.0f}, the backend's forwards {attn * us:.0f}, "
          f"init_forward_metadata {meta * us:.0f}, ForwardBatch {fb * us:.0f}, rest of the model "
          f"{(mod - attn - meta) * us:.0f}, loop and runner bookkeeping {(mean - mod - fb) * us:.0f}; "
          f"sdpa's whole token {statistics.mean(base_t) * us:.0f}")
    return 0


def _timed(fn: Callable[..., Any], timers: dict[str, float], key: str, clock: Callable[[], float]) -> Callable[..., Any]:
    """``fn`` with the time of each call added to ``timers[key]`` (the split runs' instrumentation)."""

    def timed(*a: Any, **kw: Any) -> Any:
        t = clock()
        try:
            return fn(*a, **kw)
        finally:
            timers[key] += clock() - t
    return timed


if __name__ == "__main__":
    sys.exit(main())
