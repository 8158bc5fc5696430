"""Paged decode: torch_native vs a per-request SDPA loop vs the contiguous floor, side by side.

    python benchmarks/bench_decode.py [--batch 32 --context 1024 --heads 32 --kv-heads 8 \
        --head-dim 128 --page-size 16 --dtype float32 --repeats 10 --backend torch_native]

Same table as ``attnplug bench`` (it reuses ``attnplug.cli.bench_cmd``); for
torch_native it adds rows for other decode block sizes (the default gathers
blocks of requests holding ~16 MiB of K, so each stays in cache until the
matmul reads it; ``whole-batch gather`` gathers every request at once).
Goals: >= 10x faster than the per-request loop, <= 2x the floor. Timings
only; nothing is asserted.
"""

from __future__ import annotations

import argparse
import sys

from attnplug.cli import bench_cmd


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bench_cmd.add_arguments(parser)
    parser.add_argument("--no-variants", action="store_true", help="skip the torch_native block-size rows")
    args = parser.parse_args(argv)
    variants = {}
    if args.backend in ("torch_native", "torch") and not args.no_variants:
        from attnplug_torch_native.backend import TorchNativeBackend

        variants = {
            "torch_native, whole-batch gather": lambda ctx: TorchNativeBackend(ctx, decode_block_bytes=None),
            "torch_native, 4 MiB blocks": lambda ctx: TorchNativeBackend(ctx, decode_block_bytes=4 << 20),
        }
    result = bench_cmd.decode_benchmark(
        backend=args.backend, variants=variants, batch=args.batch, context=args.context, heads=args.heads,
        kv_heads=args.kv_heads, head_dim=args.head_dim, page_size=args.page_size, dtype=args.dtype,
        repeats=args.repeats, warmup=args.warmup, device=args.device, seed=args.seed, warm=args.warm,
    )
    print(bench_cmd.format_result(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
