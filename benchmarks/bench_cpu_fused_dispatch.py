"""The cost of calling cpu_fused's kernel as a torch op, against the kernel's own time.

Issue 25's goal: the op's dispatch overhead <= 5% of the kernel's time on the smallest bench decode
row (batch 1, context 128; 32/8 heads, head dim 128, page 16). Rows, round-robin medians of the
thread's CPU time (one torch thread):

* ``op, full``: ``torch.ops.attnplug_cpu_fused.attend.default`` on that decode problem (what one
  layer's forward calls; the arguments prepared once, as the backend does per forward);
* ``op, no work``: the same call with an empty plan (no work row): Python -> dispatcher -> the
  argument checks and the ``DecodeArgs`` fill in ops.cpp, then the kernel returns at once. This is
  the dispatch overhead; ``full - no work`` is the kernel's time.

    python benchmarks/bench_cpu_fused_dispatch.py [--dtype bfloat16] [--context 128] [--calls 2000]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from attnplug import AttentionConfig, BuildContext, ForwardBatch, HostInfo, LayerSpec, PagedKVCache


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=7)
    a = ap.parse_args()
    torch.set_num_threads(1)
    from attnplug_cpu_fused import backend as cf_backend
    from attnplug_cpu_fused.backend import CpuFusedBackend, FusedForward

    dt = getattr(torch, a.dtype)
    H, Hkv, D, ps = 32, 8, 128, 16
    pages = a.batch * (-(-(a.context + 1) // ps)) + 1
    cache = PagedKVCache(1, pages, Hkv, D, page_size=ps, dtype=a.dtype, max_requests=a.batch,
                         max_context_len=a.context + 1)
    g = torch.Generator().manual_seed(0)
    cache.set_kv(0, torch.arange(cache.num_slots), torch.randn(cache.num_slots, Hkv, D, generator=g).to(dt),
                 torch.randn(cache.num_slots, Hkv, D, generator=g).to(dt), stored=True)
    per = -(-(a.context + 1) // ps)
    for r in range(a.batch):
        cache.assign_pages(r, a.context + 1, list(range(r * per, (r + 1) * per)))
    ctx = BuildContext(config=AttentionConfig(attention_backend="cpu_fused"), host=HostInfo(platform="cpu"),
                       dtype=a.dtype, kv_cache_dtype=a.dtype, num_heads=H, num_kv_heads=Hkv, head_dim=D,
                       page_size=ps, kv_cache=cache, max_batch_size=a.batch, max_context_len=a.context + 1)
    be = CpuFusedBackend(ctx)
    layer = LayerSpec(0, H, Hkv, D)
    batch = ForwardBatch.decode(list(range(a.batch)), [a.context + 1] * a.batch,
                                cache.req_to_token[torch.arange(a.batch), a.context])
    be.init_forward_metadata(batch)
    q = torch.randn(a.batch, H, D, generator=g).to(dt)
    k, v = torch.randn(a.batch, Hkv, D, generator=g).to(dt), torch.randn(a.batch, Hkv, D, generator=g).to(dt)
    meta = be.forward_metadata(batch)
    fl = be.layer_plan(layer).kernel
    fw = be._work(q, layer, meta, fl)
    assert isinstance(fw, FusedForward)
    out = torch.empty(a.batch, H, D, dtype=dt)
    full = be._args(q, k, v, layer, fl, fw, out)
    empty = list(full)
    empty[7] = cf_backend.work_tensor(torch.empty(0, 8, dtype=torch.int64), None, fw.per_item)  # no work row
    op = torch.ops.attnplug_cpu_fused.attend.default

    def timed(args: tuple) -> float:
        t0 = time.thread_time_ns()
        for _ in range(a.calls):
            op(*args)
        return (time.thread_time_ns() - t0) / a.calls / 1e3

    res: dict[str, list[float]] = {"op, full": [], "op, no work": []}
    timed(full), timed(tuple(empty))
    for _ in range(a.rounds):
        res["op, full"].append(timed(full))
        res["op, no work"].append(timed(tuple(empty)))
    med = {k: statistics.median(v) for k, v in res.items()}
    kern = med["op, full"] - med["op, no work"]
    print(f"cpu_fused op, decode {a.dtype} batch {a.batch} context {a.context}, heads {H}/{Hkv}, head dim {D}, "
          f"1 thread, kernel variant {be.isa} (medians of {a.rounds} rounds x {a.calls} calls, thread CPU time)")
    for name, us in med.items():
        print(f"  {name:14s} {us:8.2f} us")
    print(f"  dispatch overhead {med['op, no work']:.2f} us = {100 * med['op, no work'] / kern:.1f}% of the "
          f"kernel's {kern:.2f} us (goal <= 5%)")


if __name__ == "__main__":
    main()
