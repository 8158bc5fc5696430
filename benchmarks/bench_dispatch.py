"""Per-call overhead of ``HybridBackend.forward`` over calling the serving half directly.

    python benchmarks/bench_dispatch.py [--calls 200000] [--repeats 7]

Both halves are no-op backends whose ``forward`` returns its input, so what is
measured is pure dispatch: the hybrid's mode lookup through the one selector
plus one extra Python call. Reports the best-of-repeats ns per call for each
forward mode (min is the usual estimator for micro-benchmarks: noise only adds
time). Goal: hybrid - direct <= 1 us per call. Timings only; nothing is asserted.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from attnplug import AttentionBackend, ForwardMode, HybridBackend


class NoOp(AttentionBackend):
    def init_forward_metadata(self, batch: Any) -> None:
        return None

    def forward(self, q: Any, k: Any, v: Any, layer: Any, batch: Any, save_kv_cache: bool = True) -> Any:
        return q


class Batch:
    """Only what dispatch reads."""

    __slots__ = ("forward_mode",)

    def __init__(self, mode: ForwardMode) -> None:
        self.forward_mode = mode


def per_call_ns(fn: Any, batch: Batch, calls: int, repeats: int) -> float:
    q = object()
    best = float("inf")
    rng = range(calls)
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        for _ in rng:
            fn(q, None, None, None, batch)
        best = min(best, (time.perf_counter_ns() - t0) / calls)
    return best


def loop_ns(calls: int, repeats: int) -> float:
    def nothing(q: Any, k: Any, v: Any, layer: Any, batch: Any) -> Any:
        return q

    return per_call_ns(nothing, Batch(ForwardMode.DECODE), calls, repeats)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200_000)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    prefill, decode = NoOp(), NoOp()
    hybrid = HybridBackend(prefill, decode, speculative_attention_mode="decode")
    base = loop_ns(args.calls, args.repeats)
    print(f"HybridBackend.forward dispatch ({args.calls} calls x {args.repeats} repeats, best; "
          f"a plain Python call costs {base:.0f} ns here)")
    print(f"  {'mode':<16} {'direct':>10} {'hybrid':>10} {'overhead':>10}")
    worst = 0.0
    for mode in (ForwardMode.DECODE, ForwardMode.EXTEND, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND_V2):
        batch = Batch(mode)
        half = hybrid._half(batch)  # the half the hybrid routes this mode to
        direct = per_call_ns(half.forward, batch, args.calls, args.repeats)
        via = per_call_ns(hybrid.forward, batch, args.calls, args.repeats)
        worst = max(worst, via - direct)
        print(f"  {mode.value:<16} {direct:8.0f} ns {via:8.0f} ns {via - direct:8.0f} ns")
    print(f"worst overhead {worst / 1000:.3f} us per call (goal <= 1 us): {'met' if worst <= 1000 else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
