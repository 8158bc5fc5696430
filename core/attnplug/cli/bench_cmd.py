"""``attnplug bench``: paged decode of one backend against two baselines, side by side.

Measured in one process, on one problem (pages scattered at random):

* the backend under test: ``forward`` of one layer on a decode batch whose
  metadata was built once (as in an engine, where every layer shares it);
  it writes the new K/V and attends over the paged cache;
* baseline (a), ``per-request SDPA``: what common engines' torch-native
  backends do: write the new K/V, then for each request gather its K/V through
  ``req_to_token`` and call ``torch.nn.functional.scaled_dot_product_attention``;
* baseline (b), ``floor``: attention on K/V already gathered into contiguous
  ``[batch, kv_heads, context, head_dim]`` tensors (no paging, no gather, no
  write): the faster of SDPA and plain matmul-softmax-matmul.

Numbers are medians of ``--repeats`` timed calls after ``--warmup`` calls,
timed round-robin; before each timed call the CPU caches are flushed (unless
``--warm``), as in a real forward where the other layers ran in between.
torch is imported inside ``run`` only (``attnplug`` stays light).
"""

from __future__ import annotations

import argparse
from typing import Any, Callable

# json, statistics, time and torch are imported where used: `attnplug` builds every
# subcommand's parser on each start (`attnplug list` included), so this module stays light.

DEFAULTS = dict(batch=32, context=1024, heads=32, kv_heads=8, head_dim=128, page_size=16, dtype="float32",
                repeats=10, warmup=2)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", default="torch_native", metavar="NAME",
                        help="installed backend (name or alias) to benchmark (default: torch_native)")
    parser.add_argument("--batch", type=int, default=DEFAULTS["batch"], help="requests per decode batch (default: 32)")
    parser.add_argument("--context", type=int, default=DEFAULTS["context"],
                        help="KV length of every request, the new token included (default: 1024)")
    parser.add_argument("--heads", type=int, default=DEFAULTS["heads"], help="query heads (default: 32)")
    parser.add_argument("--kv-heads", type=int, default=DEFAULTS["kv_heads"], help="KV heads (default: 8)")
    parser.add_argument("--head-dim", type=int, default=DEFAULTS["head_dim"], help="head dim (default: 128)")
    parser.add_argument("--page-size", type=int, default=DEFAULTS["page_size"], help="KV-cache page size (default: 16)")
    parser.add_argument("--dtype", default=DEFAULTS["dtype"], help="model and KV-cache dtype (default: float32)")
    parser.add_argument("--repeats", type=int, default=DEFAULTS["repeats"], help="timed calls per row (default: 10)")
    parser.add_argument("--warmup", type=int, default=DEFAULTS["warmup"], help="untimed calls first (default: 2)")
    parser.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    parser.add_argument("--seed", type=int, default=0, help="page scatter and data seed (default: 0)")
    parser.add_argument("--warm", action="store_true",
                        help="do not flush the CPU caches before each timed call (default: flush, as in a real "
                        "forward where the other layers ran in between)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")


def run(args: argparse.Namespace) -> int:
    import json

    result = decode_benchmark(
        backend=args.backend, batch=args.batch, context=args.context, heads=args.heads, kv_heads=args.kv_heads,
        head_dim=args.head_dim, page_size=args.page_size, dtype=args.dtype, repeats=args.repeats,
        warmup=args.warmup, device=args.device, seed=args.seed, warm=args.warm,
    )
    if args.json:
        print(json.dumps(result, indent=2, sort_keys=True))
    else:
        print(format_result(result))
    return 0


# ---------------------------------------------------------------------------
# reusable pieces (benchmarks/ scripts import these)
# ---------------------------------------------------------------------------


def median_ms(fn: Callable[[], Any], repeats: int, warmup: int, sync: Callable[[], None] = lambda: None) -> float:
    """Median wall time of ``fn()`` in milliseconds over ``repeats`` calls after ``warmup`` calls."""
    import statistics
    import time

    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def interleaved_median_ms(calls: dict[str, Callable[[], Any]], repeats: int, warmup: int,
                          sync: Callable[[], None] = lambda: None,
                          flush: Callable[[], None] = lambda: None) -> dict[str, float]:
    """Median ms per call of each entry, timed round-robin (one call of each per round), so
    that a change in machine load during the run hits every entry alike. ``flush`` runs
    (untimed) before every timed call, so no entry finds the previous one's data in cache."""
    import statistics
    import time

    for fn in calls.values():
        for _ in range(warmup):
            fn()
    sync()
    times: dict[str, list[float]] = {k: [] for k in calls}
    for _ in range(max(1, repeats)):
        for label, fn in calls.items():
            flush()
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times[label].append(time.perf_counter() - t0)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def cache_flusher(device: str = "cpu", warm: bool = False) -> Callable[[], None]:
    """A callable that evicts the CPU caches (reads a buffer twice the last-level cache),
    so every timed call starts cold, as a layer's attention does in a real forward (the
    other layers ran in between). ``warm=True`` or a non-CPU device: a no-op."""
    if warm or not str(device).startswith("cpu"):
        return lambda: None
    import torch

    size = 64 << 20
    try:
        with open("/sys/devices/system/cpu/cpu0/cache/index3/size", encoding="utf-8") as fh:
            text = fh.read().strip().upper()
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1], 1)
        size = int(text.rstrip("KMG")) * mult
    except (OSError, ValueError):
        pass
    buf = torch.ones(min(2 * size, 2 << 30) // 4, dtype=torch.float32)  # pages touched once, here

    def flush() -> None:
        buf.sum()  # reads only: no dirty lines left to write back during the timed call

    return flush


class DecodeProblem:
    """One paged decode problem: a one-layer cache with scattered pages, a batch and q/k/v."""

    def __init__(self, *, batch: int, context: int, heads: int, kv_heads: int, head_dim: int, page_size: int,
                 dtype: str, device: str = "cpu", seed: int = 0) -> None:
        import torch

        from attnplug import AttentionConfig, BuildContext, ForwardBatch, LayerSpec, PageAllocator, PagedKVCache
        from attnplug.dtypes import torch_dtype
        from attnplug.host import detect_host

        if context < 1 or batch < 1:
            raise ValueError(f"--batch and --context must be >= 1 (got {batch}, {context})")
        self.torch = torch
        self.dtype = torch_dtype(dtype)
        self.device = torch.device(device)
        self.batch, self.context, self.page_size = batch, context, page_size
        pages_per_req = (context + page_size - 1) // page_size
        num_pages = batch * pages_per_req + 8
        gen = torch.Generator().manual_seed(seed)
        self.cache = PagedKVCache(1, num_pages, kv_heads, head_dim, page_size=page_size, dtype=dtype, device=device,
                                  max_requests=batch, max_context_len=context)
        for buf in (self.cache.k_buffers[0], self.cache.v_buffers[0]):
            buf.copy_(torch.randn(buf.shape, generator=gen).to(self.dtype))
        alloc = PageAllocator(num_pages, shuffle=True, seed=seed + 1)
        for r in range(batch):
            self.cache.assign_pages(r, context, alloc.alloc(pages_per_req))
        req = torch.arange(batch)
        loc = self.cache.req_to_token[req, context - 1].clone()
        self.fb = ForwardBatch.decode(req.to(device), torch.full((batch,), context, device=device), loc)
        self.layer = LayerSpec(0, heads, kv_heads, head_dim)
        self.q = torch.randn(batch, heads, head_dim, generator=gen).to(self.dtype).to(device)
        self.k = torch.randn(batch, kv_heads, head_dim, generator=gen).to(self.dtype).to(device)
        self.v = torch.randn(batch, kv_heads, head_dim, generator=gen).to(self.dtype).to(device)
        self.ctx = BuildContext(
            config=AttentionConfig(attention_backend="torch_native"), host=detect_host(), device=device,
            dtype=dtype, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, page_size=page_size,
            kv_cache=self.cache, max_batch_size=batch, max_context_len=context,
        )

    def sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize()

    # -- the backend under test ------------------------------------------
    def backend_call(self, backend: Any) -> Callable[[], Any]:
        fb, layer, q, k, v = self.fb, self.layer, self.q, self.k, self.v
        backend.init_forward_metadata(fb)  # once per forward, shared by every layer

        def call() -> Any:
            return backend.forward(q, k, v, layer, fb, save_kv_cache=True)

        return call

    # -- baseline (a): per-request gather + SDPA ---------------------------
    def per_request_sdpa_call(self) -> Callable[[], Any]:
        torch = self.torch
        sdpa = torch.nn.functional.scaled_dot_product_attention
        cache, fb, layer = self.cache, self.fb, self.layer
        k_cache, v_cache = cache.get_kv(0)
        req_to_token = cache.req_to_token
        gqa = layer.num_heads != layer.num_kv_heads
        q, k, v = self.q, self.k, self.v

        def call() -> Any:
            cache.set_kv(0, fb.out_cache_loc, k, v)
            query = q.movedim(0, 1)  # [H, T, D]
            out = torch.empty(q.shape[0], layer.num_heads, layer.v_head_dim, dtype=q.dtype, device=q.device)
            seq_lens = fb.seq_lens.tolist()
            reqs = fb.req_pool_indices.tolist()
            for i, (r, n) in enumerate(zip(reqs, seq_lens)):
                tokens = req_to_token[r, :n]
                per_k = k_cache[tokens].movedim(0, 1)  # [Hkv, n, D]
                per_v = v_cache[tokens].movedim(0, 1)
                o = sdpa(query[:, i:i + 1].unsqueeze(0), per_k.unsqueeze(0), per_v.unsqueeze(0),
                         scale=layer.scaling, enable_gqa=gqa)
                out[i] = o.squeeze(0).movedim(1, 0)[0]
            return out

        return call

    # -- baseline (b): contiguous K/V, no paging ---------------------------
    def floor_calls(self) -> dict[str, Callable[[], Any]]:
        torch = self.torch
        B, L = self.batch, self.context
        H, Hkv, D = self.layer.num_heads, self.layer.num_kv_heads, self.layer.head_dim
        G = H // Hkv
        kc, vc = self.cache.get_kv(0)
        slots = self.cache.req_to_token[:B, :L].reshape(-1)
        K = kc[slots].view(B, L, Hkv, D).transpose(1, 2).contiguous()  # [B, Hkv, L, D]
        V = vc[slots].view(B, L, Hkv, D).transpose(1, 2).contiguous()
        q4 = self.q.view(B, H, 1, D)
        qg = self.q.view(B, Hkv, G, D)
        scale = self.layer.scaling

        def sdpa() -> Any:
            return torch.nn.functional.scaled_dot_product_attention(q4, K, V, scale=scale, enable_gqa=G > 1)

        def matmul() -> Any:
            s = torch.matmul(qg, K.transpose(-1, -2)) * scale
            return torch.matmul(torch.softmax(s, dim=-1), V)

        return {"sdpa": sdpa, "matmul-softmax-matmul": matmul}


def decode_benchmark(*, backend: str = "torch_native", variants: dict[str, Callable[[Any], Any]] | None = None,
                     repeats: int = 10, warmup: int = 2, warm: bool = False, **problem: Any) -> dict[str, Any]:
    """Run the side-by-side decode benchmark; returns a dict (see ``format_result``).

    ``variants`` maps a label to a callable that builds another backend from
    the problem's ``BuildContext``; each is timed in the same run.
    """
    import torch

    from attnplug.registry import default_registry

    p = DecodeProblem(**problem)
    name, built = default_registry().build(backend, p.ctx)
    call = p.backend_call(built)
    out = call()
    expected = p.per_request_sdpa_call()()
    max_err = float((out.float() - expected.float()).abs().max())
    calls: dict[str, Callable[[], Any]] = {name: call}
    for label, make in (variants or {}).items():
        calls[label] = p.backend_call(make(p.ctx))
    calls["(a) per-request SDPA loop"] = p.per_request_sdpa_call()
    floor_labels = {}
    for kind, fn in p.floor_calls().items():
        floor_labels[kind] = f"(b) floor: contiguous K/V, {kind}"
        calls[floor_labels[kind]] = fn
    rows = interleaved_median_ms(calls, repeats, warmup, p.sync, cache_flusher(p.device.type, warm))
    floors = {kind: rows[label] for kind, label in floor_labels.items()}
    best = min(floors, key=floors.get)  # type: ignore[arg-type]
    meta_ms = median_ms(lambda: built.init_forward_metadata(p.fb), repeats, warmup, p.sync)
    return {
        "backend": name,
        "problem": {k: v for k, v in problem.items()},
        "caches": "warm" if warm else "flushed before every call",
        "threads": torch.get_num_threads(),
        "ms": rows,
        "backend_ms": rows[name],
        "per_request_ms": rows["(a) per-request SDPA loop"],
        "floor_ms": floors[best],
        "floor_kind": best,
        "speedup_vs_per_request": rows["(a) per-request SDPA loop"] / rows[name],
        "ratio_to_floor": rows[name] / floors[best],
        "metadata_ms": meta_ms,
        "max_abs_diff_vs_per_request": max_err,
    }


def format_result(r: dict[str, Any]) -> str:
    p = r["problem"]
    lines = [
        f"paged decode: batch {p['batch']}, context {p['context']}, heads {p['heads']}/{p['kv_heads']} kv, "
        f"head_dim {p['head_dim']}, {p['dtype']}, page_size {p['page_size']}, pages scattered; "
        f"torch threads {r['threads']}; CPU caches {r['caches']}",
    ]
    width = max(len(k) for k in r["ms"])
    for label, ms in r["ms"].items():
        lines.append(f"  {label.ljust(width)}  {ms:9.3f} ms/call")
    lines.append(f"  init_forward_metadata: {r['metadata_ms']:.3f} ms once per forward, shared by every layer "
                 f"(a backend may memoise per-layer-shape tensors on the first layer)")
    lines.append(
        f"  {r['backend']} speedup over (a): {r['speedup_vs_per_request']:.2f}x (goal >= 10x); "
        f"vs floor ({r['floor_kind']}): {r['ratio_to_floor']:.2f}x (goal <= 2x); "
        f"max |diff| vs (a) {r['max_abs_diff_vs_per_request']:.2e}"
    )
    return "\n".join(lines)
