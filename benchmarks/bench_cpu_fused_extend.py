"""cpu_fused's tiled extend bodies against vLLM's CPU op, side by side (issue 25's extend goals).

``bench_vllm_cpu_raw.py``'s problem and timing (one process, round-robin, medians, caches flushed), with
one row per tiled-extend body this CPU runs, so the bf16 bodies are timed in the same run:

* ``raw op``: vLLM's op (``cpu_attention_with_kv_cache``, its ``vec`` ISA), the goals' baseline;
* ``cpu_fused``: the default (``tiled_isa = 0``: the body ``attnplug_extend_tiled`` chooses; for bf16
  without AMX, vdpbf16ps or widened to float32 by the measured rate, ``CpuFusedBackend.tiled_bf16_body``);
* ``cpu_fused fma``: pinned to the avx512 FMA tiles (``tiled_isa = 3``; bf16 widened to float32);
* ``cpu_fused dp`` (bf16, where the CPU has AVX-512 BF16): pinned to the vdpbf16ps body (``tiled_isa = 4``);
* ``cpu_fused amx`` (where AMX is usable): pinned to the AMX body (``tiled_isa = 5``).

Run with ``ATTNPLUG_CPU_FUSED_AMX=0`` for a CPU without AMX (an AMD Zen 4 / Zen 5: the issue's machine).

Usage::

    python benchmarks/bench_cpu_fused_extend.py --threads 1 --clock cpu --prefix-list 1024,1000,0,31 --new-list 512,7,300,1
    python benchmarks/bench_cpu_fused_extend.py --threads 2 --repeats 3            # 4 x 512 new over 1024
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

import attnplug_cpu_fused.kernel as cf_kernel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_vllm_cpu_raw import Problem, time_rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="float32,bfloat16", help="float32, bfloat16 (comma-separated)")
    ap.add_argument("--batch", type=int, default=4, help="requests (without the lists)")
    ap.add_argument("--context", type=int, default=1024, help="cached tokens a request (without the lists)")
    ap.add_argument("--new-tokens", type=int, default=512, help="new tokens a request (without the lists)")
    ap.add_argument("--prefix-list", default=None, help="cached tokens per request, e.g. 1024,1000,0,31")
    ap.add_argument("--new-list", default=None, help="new tokens per request, e.g. 512,7,300,1")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: the calling thread's CPU time (with --threads 1), robust to a loaded machine")
    ap.add_argument("--library", default=None,
                    help="load this build of cpu_fused's _C*.so instead of the installed one (e.g. a timing-only build "
                         "with -DATTNPLUG_ET_DP_TIMING_AS_FMA: its 'cpu_fused dp' row is then the vdpbf16ps body as "
                         "on a CPU issuing vdpbf16ps at the FMA's rate, with wrong results)")
    ap.add_argument("--unchecked", default="", help="rows not checked against torch_native (comma-separated; "
                    "for a timing-only --library)")
    a = ap.parse_args(argv)
    if a.library:
        cf_kernel.library_path = lambda: os.path.abspath(a.library)  # before the first load()
    if a.clock == "cpu" and a.threads != 1:
        ap.error("--clock cpu measures the calling thread only: use it with --threads 1")
    clock = time.thread_time if a.clock == "cpu" else time.perf_counter
    if a.threads:
        torch.set_num_threads(a.threads)
    load = os.getloadavg()
    if cf_kernel.load()[0] is None:
        raise SystemExit(f"cpu_fused: no compiled kernel ({cf_kernel.load()[1]})")
    best = int(torch.ops.attnplug_cpu_fused.tiled_isa())
    print(f"threads {torch.get_num_threads()}, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} "
          f"(cores {os.cpu_count()}); {a.clock} clock, medians of {a.repeats}, round-robin, caches flushed; "
          f"$ATTNPLUG_CPU_FUSED_AMX={os.environ.get('ATTNPLUG_CPU_FUSED_AMX', '(unset)')}, best tiled isa {best}"
          f"{f', library {a.library}' if a.library else ''}{f', unchecked rows: {a.unchecked}' if a.unchecked else ''}")
    lists = {}
    batch = a.batch
    if a.prefix_list:
        lists = dict(prefixes=[int(x) for x in a.prefix_list.split(",")], news=[int(x) for x in a.new_list.split(",")])
        batch = len(lists["prefixes"])
    for dtype in a.dtype.split(","):
        p = Problem("extend", batch, a.context, a.new_tokens, a.heads, a.kv_heads, a.head_dim, a.page_size, dtype,
                    **lists)
        be = p.backends["cpu_fused"]
        ref = p.plugin("torch_native")()
        rows = {"raw op": p.raw, "cpu_fused": p.plugin("cpu_fused"), "cpu_fused fma": p.plugin("cpu_fused", tiled_isa=3)}
        if dtype == "bfloat16" and best >= 4:
            rows["cpu_fused dp"] = p.plugin("cpu_fused", tiled_isa=4)
        if best >= 5:
            rows["cpu_fused amx"] = p.plugin("cpu_fused", tiled_isa=5)
        tol = 1e-4 if dtype == "float32" else 3e-2
        for name, fn in rows.items():
            if name in a.unchecked.split(","):
                continue
            err = float((fn().double() - ref.double()).abs().max())
            if err > tol:
                raise SystemExit(f"{dtype}: {name} differs from torch_native by {err:.2e} (> {tol})")
        ms = time_rows(rows, a.repeats, a.warmup, False, clock)
        print(f"\nextend {dtype}: {batch} requests {lists or f'{a.context} cached + {a.new_tokens} new'} heads "
              f"{a.heads}/{a.kv_heads} d{a.head_dim} page {a.page_size}; default bf16 body {getattr(be, 'tiled_bf16_body', '?')} "
              f"({getattr(be, 'tiled_bf16_why', '?')})")
        print(f"  {'row':<16}{'ms':>10}{'x raw op':>10}")
        for name, t in ms.items():
            print(f"  {name:<16}{t:>10.2f}{t / ms['raw op']:>10.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
