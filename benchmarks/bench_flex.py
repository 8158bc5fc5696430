"""FlexAttention (compiled) against torch_native and the contiguous floor, side by side.

What ``attnplug bench`` does not express: issue 12's fused-path exploration. Rows,
timed round-robin in one process (medians, CPU caches flushed before every call):

* ``torch_native``: ``forward`` of one layer, as ``attnplug bench`` times it;
* ``flex``: ``torch.compile(flex_attention)``.
  Decode reads the paged cache in place, with no gather: K/V are the whole cache
  viewed ``[1, kv_heads, slots, head_dim]`` (strided), each request's queries are
  its ``heads // kv_heads`` query heads per KV head (``[B, kv_heads, group, d]``),
  and a ``BlockMask`` with KV blocks of one page lists the request's pages (full
  blocks) and its last page (a partial block; ``mask_mod`` hides the slots past
  its length). The call also writes the new K/V, as the backend does. Needs
  page-aligned slots (every page of a request is one whole cache page).
  Extend runs on K/V already contiguous per request (``[B, kv_heads, prefix+new,
  d]``, no gather, no write) with the causal-by-position block mask: a lower
  bound for any flex extend over the paged cache;
* ``floor``: decode matmul-softmax-matmul, extend SDPA with the causal-by-position
  mask, on K/V already contiguous per request (as ``attnplug bench``).

The first call's time (compile) is printed. Usage::

    python benchmarks/bench_flex.py --mode decode --dtype bfloat16 --threads 1
    python benchmarks/bench_flex.py --mode extend --dtype float32 --threads 1
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_torch_native import Problem, add_problem_args, describe, problem_from_args, timed

from attnplug_torch_native.backend import TorchNativeBackend


def flex_decode_call(p: Problem) -> Callable[[], Any]:
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    cache, layer, B = p.cache, p.layer, p.batch
    ps, Hkv, D = cache.page_size, layer.num_kv_heads, layer.head_dim
    G = layer.num_heads // Hkv
    kc, vc = cache.get_kv(0)
    slots = kc.shape[0]
    n_pages = slots // ps
    r2t = cache.req_to_token[:B, :p.seq]
    pages = (p.seq + ps - 1) // ps
    first = torch.nn.functional.pad(r2t, (0, pages * ps - p.seq))[:, ::ps]  # slot of each page's first position
    if bool((first % ps != 0).any()) or not torch.equal(
            r2t, (first[:, :, None] + torch.arange(ps)).reshape(B, -1)[:, :p.seq]):
        raise SystemExit("flex decode needs page-aligned slots")
    table = (first // ps).to(torch.int32)  # [B, pages]
    full = torch.zeros(B, 1, 1, n_pages, dtype=torch.int32)
    full[:, 0, 0, :pages - 1] = table[:, :pages - 1]
    part = torch.zeros(B, 1, 1, n_pages, dtype=torch.int32)
    part[:, 0, 0, 0] = table[:, pages - 1]
    limit = table[:, pages - 1].long() * ps + (p.seq - (pages - 1) * ps)  # first hidden slot of the last page

    def visible(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return kv_idx < limit[b]

    # the kernel generated for CPU fails to compile without a partial block (torch 2.13), so the
    # last page is always one
    mask = BlockMask.from_kv_blocks(torch.ones(B, 1, 1, dtype=torch.int32), part,
                                    torch.full((B, 1, 1), pages - 1, dtype=torch.int32), full,
                                    BLOCK_SIZE=(G, ps), mask_mod=visible, seq_lengths=(G, slots))
    K = kc.view(1, slots, Hkv, D).permute(0, 2, 1, 3)
    V = vc.view(1, slots, Hkv, layer.v_head_dim).permute(0, 2, 1, 3)
    qg = p.q.view(B, Hkv, G, D)
    fn = torch.compile(flex_attention, dynamic=False)

    def call() -> Any:
        cache.set_kv(0, p.fb.out_cache_loc, p.k, p.v)
        return fn(qg, K, V, block_mask=mask, scale=layer.scaling)

    return call


def flex_extend_call(p: Problem) -> Callable[[], Any]:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    B, e, L, prefix = p.batch, p.ext, p.seq, p.prefix
    H, Hkv, D = p.layer.num_heads, p.layer.num_kv_heads, p.layer.head_dim
    kc, vc = p.cache.get_kv(0)
    slots = p.cache.req_to_token[:B, :L].reshape(-1)
    K = kc[slots].view(B, L, Hkv, D).transpose(1, 2).contiguous()
    V = vc[slots].view(B, L, Hkv, D).transpose(1, 2).contiguous()
    qh = p.q.view(B, e, H, D).transpose(1, 2).contiguous()

    def causal(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return kv_idx <= q_idx + prefix

    mask = create_block_mask(causal, None, None, e, L, device="cpu")
    fn = torch.compile(flex_attention, dynamic=False)
    return lambda: fn(qh, K, V, block_mask=mask, scale=p.layer.scaling, enable_gqa=H != Hkv)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_problem_args(ap)
    a = ap.parse_args(argv)
    p = problem_from_args(a)
    flex = flex_decode_call(p) if a.mode == "decode" else flex_extend_call(p)
    t0 = time.perf_counter()
    out = flex()
    compile_s = time.perf_counter() - t0
    floor_name, floor = next((k, fn) for k, fn in p.floor_calls().items()
                             if k in ("matmul-softmax-matmul", "sdpa, causal-by-position mask"))
    ref = floor()
    ref = torch.cat(ref) if isinstance(ref, list) else ref
    err = (out.float().reshape(ref.shape) - ref.float()).abs().max().item()
    calls = {"torch_native": p.backend_call(TorchNativeBackend(p.ctx)), "flex": flex, f"floor: {floor_name}": floor}
    ms = timed(calls, a.repeats, 1)
    fl = ms[f"floor: {floor_name}"]
    print(describe(a, p) + f", load {os.getloadavg()[0]:.1f}")
    print(f"  flex first call (compile): {compile_s:.1f} s; max |flex - floor| = {err:.2e}")
    for k, v in ms.items():
        print(f"  {k:40s} {v:9.2f} ms  {v / fl:5.2f}x floor  torch_native/row {ms['torch_native'] / v:5.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
