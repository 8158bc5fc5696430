"""cpu_fused and torch_native decode and extend against their baselines, side by side in one run.

What ``attnplug bench`` does not express: extra torch_native variants (another
kernel module given by path, e.g. the previous version, for a before/after table
in one run). For backends as installed, use ``attnplug bench --mode decode,extend``. Rows, timed round-robin (medians, CPU caches
flushed before every call):

* ``cpu_fused`` (when installed with its compiled kernel): ``forward`` of one layer, metadata
  built once (as in an engine), through the fused C++ kernel;
* ``torch_native``: the same through plain PyTorch (eager gather-then-matmul decode, SDPA
  extend: the before of issue 12's fused kernel);
* ``(a) per-request loop``: write the new K/V, then per request gather its K/V
  through ``req_to_token`` and call SDPA (what engines' torch-native backends do);
* ``(b) floor``: the same attention on K/V already contiguous (no paging, no gather,
  no write) — decode: the faster of SDPA and matmul-softmax-matmul; extend: SDPA
  with the causal-by-position mask, per request.

Usage::

    python benchmarks/bench_torch_native.py --mode decode --dtype bfloat16
    python benchmarks/bench_torch_native.py --mode extend --dtype float32 --threads 1
    python benchmarks/bench_torch_native.py --variant old=/tmp/old_backend.py
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F

from attnplug import AttentionConfig, BuildContext, ForwardBatch, HostInfo, LayerSpec, PageAllocator, PagedKVCache
from attnplug_torch_native.backend import TorchNativeBackend


class Problem:
    def __init__(self, mode: str, batch: int, context: int, new: int, heads: int, kv_heads: int, head_dim: int,
                 page_size: int, dtype: str, seed: int = 0) -> None:
        self.mode, self.dtype = mode, getattr(torch, dtype)
        gen = torch.Generator().manual_seed(seed)
        ext = 1 if mode == "decode" else new
        prefix = context - 1 if mode == "decode" else context
        seq = prefix + ext
        pages = (seq + page_size - 1) // page_size
        num_pages = batch * pages + 8
        self.cache = PagedKVCache(1, num_pages, kv_heads, head_dim, page_size=page_size, dtype=dtype,
                                  max_requests=batch, max_context_len=seq)
        for buf in (self.cache.k_buffers[0], self.cache.v_buffers[0]):
            buf.copy_(torch.randn(buf.shape, generator=gen).to(self.dtype))
        alloc = PageAllocator(num_pages, shuffle=True, seed=seed + 1)
        for r in range(batch):
            self.cache.assign_pages(r, seq, alloc.alloc(pages))
        req = list(range(batch))
        loc = torch.cat([self.cache.req_to_token[r, prefix:seq] for r in req])
        if mode == "decode":
            self.fb = ForwardBatch.decode(req, [seq] * batch, loc)
        else:
            self.fb = ForwardBatch.extend(req, [prefix] * batch, [ext] * batch, loc)
        T = batch * ext
        self.layer = LayerSpec(0, heads, kv_heads, head_dim)
        self.q = torch.randn(T, heads, head_dim, generator=gen).to(self.dtype)
        self.k = torch.randn(T, kv_heads, head_dim, generator=gen).to(self.dtype)
        self.v = torch.randn(T, kv_heads, head_dim, generator=gen).to(self.dtype)
        self.batch, self.prefix, self.ext, self.seq = batch, prefix, ext, seq
        self.ctx = BuildContext(
            config=AttentionConfig(attention_backend="torch_native"), host=HostInfo(platform="cpu"), dtype=dtype,
            num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, page_size=page_size, kv_cache=self.cache,
            max_batch_size=batch, max_context_len=seq,
        )

    def backend_call(self, backend: Any) -> Callable[[], Any]:
        backend.init_forward_metadata(self.fb)
        return lambda: backend.forward(self.q, self.k, self.v, self.layer, self.fb, save_kv_cache=True)

    def loop_call(self) -> Callable[[], Any]:
        cache, fb, layer, q, k, v = self.cache, self.fb, self.layer, self.q, self.k, self.v
        kc, vc = cache.get_kv(0)
        gqa = layer.num_heads != layer.num_kv_heads
        p, e = self.prefix, self.ext

        def call() -> Any:
            cache.set_kv(0, fb.out_cache_loc, k, v)
            out = torch.empty_like(q)
            for i in range(self.batch):
                tok = cache.req_to_token[i, :self.seq]
                kk, vv = kc[tok].movedim(0, 1).unsqueeze(0), vc[tok].movedim(0, 1).unsqueeze(0)
                qq = q[i * e:(i + 1) * e].movedim(0, 1).unsqueeze(0)
                mask = None
                if e > 1:
                    mask = torch.arange(self.seq)[None, :] <= torch.arange(p, p + e)[:, None]
                o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, scale=layer.scaling, enable_gqa=gqa)
                out[i * e:(i + 1) * e] = o.squeeze(0).movedim(1, 0)
            return out

        return call

    def floor_calls(self) -> dict[str, Callable[[], Any]]:
        B, L, e = self.batch, self.seq, self.ext
        H, Hkv, D = self.layer.num_heads, self.layer.num_kv_heads, self.layer.head_dim
        G, scale = H // Hkv, self.layer.scaling
        kc, vc = self.cache.get_kv(0)
        slots = self.cache.req_to_token[:B, :L].reshape(-1)
        K = kc[slots].view(B, L, Hkv, D).transpose(1, 2).contiguous()  # [B, Hkv, L, D]
        V = vc[slots].view(B, L, Hkv, D).transpose(1, 2).contiguous()
        if self.mode == "decode":
            q4, qg = self.q.view(B, H, 1, D), self.q.view(B, Hkv, G, D)

            def sdpa() -> Any:
                return F.scaled_dot_product_attention(q4, K, V, scale=scale, enable_gqa=G > 1)

            def matmul() -> Any:
                s = torch.matmul(qg, K.transpose(-1, -2)) * scale
                return torch.matmul(torch.softmax(s, dim=-1), V)

            return {"sdpa": sdpa, "matmul-softmax-matmul": matmul}
        qh = self.q.view(B, e, H, D).transpose(1, 2).contiguous()  # [B, H, e, D]
        mask = torch.arange(L)[None, :] <= torch.arange(self.prefix, self.prefix + e)[:, None]

        def sdpa_masked() -> Any:
            return [F.scaled_dot_product_attention(qh[i:i + 1], K[i:i + 1], V[i:i + 1], attn_mask=mask, scale=scale,
                                                   enable_gqa=G > 1) for i in range(B)]

        return {"sdpa, causal-by-position mask": sdpa_masked}


def timed(calls: dict[str, Callable[[], Any]], repeats: int, warmup: int) -> dict[str, float]:
    flush = torch.empty(64 << 20, dtype=torch.uint8)
    for fn in calls.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {k: [] for k in calls}
    for _ in range(repeats):
        for label, fn in calls.items():
            flush.add_(1)
            t = time.perf_counter()
            fn()
            times[label].append(time.perf_counter() - t)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def load_variant(path: str) -> Any:
    spec = importlib.util.spec_from_file_location(f"variant_{abs(hash(path))}", path)
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    mod.__package__ = "attnplug_torch_native"  # relative imports resolve against the installed plugin
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


def add_problem_args(ap: argparse.ArgumentParser) -> None:
    """The flags of one ``Problem`` and its timing (``bench_flex.py`` takes them too)."""
    ap.add_argument("--mode", choices=("decode", "extend"), default="decode")
    ap.add_argument("--batch", type=int, help="requests (default: decode 32, extend 4)")
    ap.add_argument("--context", type=int, default=1024,
                    help="decode: KV length incl. the new token; extend: prefix (default 1024)")
    ap.add_argument("--new", type=int, default=512, help="extend: new tokens per request (default 512)")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's)")


def problem_from_args(a: argparse.Namespace) -> Problem:
    """The ``Problem`` the flags of ``add_problem_args`` describe (``--threads`` set for the run)."""
    if a.threads:
        torch.set_num_threads(a.threads)
    batch = a.batch or (32 if a.mode == "decode" else 4)
    return Problem(a.mode, batch, a.context, a.new, a.heads, a.kv_heads, a.head_dim, a.page_size, a.dtype)


def describe(a: argparse.Namespace, p: Problem) -> str:
    """One line naming the problem: mode, dtype, batch, context, new tokens, heads, head dim, page, threads."""
    return (f"{a.mode} {a.dtype}: batch {p.batch}, context {a.context}" + (f", {a.new} new" if a.mode == "extend" else "")
            + f", heads {a.heads}/{a.kv_heads}, d {a.head_dim}, page {a.page_size}, threads {torch.get_num_threads()}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_problem_args(ap)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--variant", action="append", default=[], metavar="LABEL=PATH",
                    help="also time TorchNativeBackend from another kernel module file (repeatable)")
    ap.add_argument("--block-bytes", type=int, action="append", default=[], metavar="N",
                    help="also time torch_native with decode_block_bytes=N (repeatable)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    p = problem_from_args(a)
    calls = {}
    try:
        from attnplug_cpu_fused.backend import CpuFusedBackend

        calls["cpu_fused"] = p.backend_call(CpuFusedBackend(p.ctx))
    except Exception as exc:  # not installed, or installed without its kernel: the row says so
        print(f"cpu_fused: not timed ({exc})", file=sys.stderr)
    calls["torch_native"] = p.backend_call(TorchNativeBackend(p.ctx))
    for n in a.block_bytes:  # the eager decode's block size
        calls[f"torch_native eager, {n >> 10} KiB blocks"] = p.backend_call(
            TorchNativeBackend(p.ctx, decode_block_bytes=n))
    for spec in a.variant:
        label, path = spec.split("=", 1)
        calls[label] = p.backend_call(load_variant(path).TorchNativeBackend(p.ctx))
    calls["(a) per-request loop"] = p.loop_call()
    floors = {f"(b) floor: {k}": fn for k, fn in p.floor_calls().items()}
    calls.update(floors)
    ms = timed(calls, a.repeats, a.warmup)
    floor = min(ms[k] for k in floors)
    result = {
        "mode": a.mode, "dtype": a.dtype, "batch": p.batch, "context": a.context,
        "new": a.new if a.mode == "extend" else 1, "heads": a.heads, "kv_heads": a.kv_heads,
        "head_dim": a.head_dim, "page_size": a.page_size, "threads": torch.get_num_threads(),
        "ms": ms, "x_floor": {k: v / floor for k, v in ms.items()},
        "x_loop": {k: ms["(a) per-request loop"] / v for k, v in ms.items()},
    }
    if a.json:
        print(json.dumps(result, indent=2))
    else:
        print(describe(a, p))
        w = max(map(len, ms))
        for k, v in ms.items():
            print(f"  {k.ljust(w)}  {v:9.2f} ms  {result['x_floor'][k]:5.2f}x floor  "
                  f"{result['x_loop'][k]:5.2f}x faster than (a)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
