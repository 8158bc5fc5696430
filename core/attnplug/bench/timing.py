"""Timing: round-robin medians, a CPU cache flush, and this machine's read bandwidth."""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch


CLOCKS: dict[str, Callable[[], float]] = {
    "wall": time.perf_counter,
    # CPU time of the calling thread: with one torch thread every op runs on it, so time spent
    # waiting for a core taken by other jobs is not counted (memory stalls still are)
    "cpu": time.thread_time,
}


def median_ms(fn: Callable[[], Any], repeats: int, warmup: int, sync: Callable[[], None] = lambda: None,
              clock: Callable[[], float] = time.perf_counter) -> float:
    """Median time (``clock``: wall by default) of ``fn()`` in milliseconds over ``repeats`` calls
    after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(max(1, repeats)):
        t0 = clock()
        fn()
        sync()
        times.append(clock() - t0)
    return statistics.median(times) * 1e3


def interleaved_median_ms(calls: dict[str, Callable[[], Any]], repeats: int, warmup: int,
                          sync: Callable[[], None] = lambda: None,
                          flush: Callable[[], None] = lambda: None,
                          best: dict[str, float] | None = None,
                          clock: Callable[[], float] = time.perf_counter) -> dict[str, float]:
    """Median ms per call of each entry, timed round-robin (one call of each per round), so a
    change in machine load during the run hits every entry alike. ``flush`` runs (untimed)
    before every timed call, so no entry finds the previous one's data in cache. ``best``, when
    given, receives each entry's fastest call (the estimator least hurt by other jobs on the machine)."""
    for fn in calls.values():
        for _ in range(warmup):
            fn()
    sync()
    times: dict[str, list[float]] = {k: [] for k in calls}
    for _ in range(max(1, repeats)):
        for label, fn in calls.items():
            flush()
            sync()
            t0 = clock()
            fn()
            sync()
            times[label].append(clock() - t0)
    if best is not None:
        best.update({k: min(v) * 1e3 for k, v in times.items()})
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def paired_difference_ms(a: Callable[[], Any], b: Callable[[], Any], repeats: int, warmup: int,
                         sync: Callable[[], None] = lambda: None, flush: Callable[[], None] = lambda: None,
                         clock: Callable[[], float] = time.perf_counter) -> dict[str, float]:
    """``a`` and ``b`` timed back to back ``repeats`` times (their order swapped every round, ``flush`` untimed
    before each call): each one's median ms, and the **median of the per-round differences** ``a - b`` with
    its noise band ``diff_band`` (ms), the half-width of the median's ~95% interval (``1.57 * IQR / sqrt(n)``,
    a box plot's notch). A load change hits both calls of a round alike, so the paired median resolves a
    difference far smaller than either call's own spread, and the band says when it does not."""
    for _ in range(warmup):
        a()
        b()
    sync()
    ta: list[float] = []
    tb: list[float] = []
    n = max(2, repeats)
    for i in range(n):
        for fn, out in ((a, ta), (b, tb)) if i % 2 == 0 else ((b, tb), (a, ta)):
            flush()
            sync()
            t0 = clock()
            fn()
            sync()
            out.append(clock() - t0)
    diffs = [x - y for x, y in zip(ta, tb)]
    q1, _, q3 = statistics.quantiles(diffs, n=4)
    return {"a": statistics.median(ta) * 1e3, "b": statistics.median(tb) * 1e3,
            "diff": statistics.median(diffs) * 1e3, "diff_band": 1.57 * (q3 - q1) / n ** 0.5 * 1e3}


def timed_compute(backend: Any, clock: Callable[[], float]) -> list[float]:
    """Time ``backend``'s compute from inside: its ``compute_decode`` and ``compute_extend`` replaced on the
    instance by wrappers that append each call's duration (``clock`` seconds) to the list returned. Install it
    before ``init_forward_metadata`` and ``kernel_call`` (both take the bound methods then). For
    ``paired_outside_ms``: the time of a call outside its compute is its total minus the list's last entry (an
    outer wrapper returns last when one compute calls the other: the kernel side's outside is then the smaller,
    so the forward's excess is not understated)."""
    inner: list[float] = []
    for attr in ("compute_decode", "compute_extend"):
        orig = getattr(backend, attr)

        def timed(*args: Any, _orig: Callable[..., Any] = orig) -> Any:
            t0 = clock()
            out = _orig(*args)
            inner.append(clock() - t0)
            return out
        setattr(backend, attr, timed)
    return inner


def paired_outside_ms(a: Callable[[], Any], b: Callable[[], Any], inner: list[float], repeats: int, warmup: int,
                      sync: Callable[[], None] = lambda: None, flush: Callable[[], None] = lambda: None,
                      clock: Callable[[], float] = time.perf_counter) -> dict[str, float]:
    """``paired_difference_ms`` of the time each call spends **outside** its compute: ``a`` and ``b`` each run one
    compute timed from inside (``timed_compute``, whose list is ``inner``), and each timed call counts its total
    minus that compute's time (``a``, ``b``, ``diff``, ``diff_band``). The compute's own run-to-run spread
    (milliseconds for an eager kernel) then leaves the difference, which resolves to a fraction of a µs. From the
    same calls: the paired median of the computes' own times (``inner_diff`` a - b with ``inner_diff_band``:
    what the code around a compute does to the compute itself) and of the totals (``a_total``, ``b_total``,
    ``total_diff``, ``total_diff_band``: ``paired_difference_ms``'s numbers)."""
    for _ in range(warmup):
        a()
        b()
    sync()
    # per call: its total time and its compute's
    tot: dict[str, list[float]] = {"a": [], "b": []}
    ins: dict[str, list[float]] = {"a": [], "b": []}
    n = max(2, repeats)
    for i in range(n):
        for fn, key in ((a, "a"), (b, "b")) if i % 2 == 0 else ((b, "b"), (a, "a")):
            flush()
            sync()
            count = len(inner)
            t0 = clock()
            fn()
            sync()
            t = clock() - t0
            if len(inner) == count:
                raise RuntimeError("a call timed outside its compute ran no timed compute")
            tot[key].append(t)
            ins[key].append(inner[-1])
        if len(inner) > 4096:
            del inner[:]

    def paired(x: list[float], y: list[float]) -> tuple[float, float]:
        d = [u - w for u, w in zip(x, y)]
        q1, _, q3 = statistics.quantiles(d, n=4)
        return statistics.median(d) * 1e3, 1.57 * (q3 - q1) / n ** 0.5 * 1e3

    out_a = [t - c for t, c in zip(tot["a"], ins["a"])]
    out_b = [t - c for t, c in zip(tot["b"], ins["b"])]
    diff, band = paired(out_a, out_b)
    inner_diff, inner_band = paired(ins["a"], ins["b"])
    total_diff, total_band = paired(tot["a"], tot["b"])
    return {"a": statistics.median(out_a) * 1e3, "b": statistics.median(out_b) * 1e3, "diff": diff, "diff_band": band,
            "inner_diff": inner_diff, "inner_diff_band": inner_band,
            "a_total": statistics.median(tot["a"]) * 1e3, "b_total": statistics.median(tot["b"]) * 1e3,
            "total_diff": total_diff, "total_diff_band": total_band}


def last_level_cache_bytes(default: int = 32 << 20) -> int:
    try:
        with open("/sys/devices/system/cpu/cpu0/cache/index3/size", encoding="utf-8") as fh:
            text = fh.read().strip().upper()
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1], 1)
        return int(text.rstrip("KMG")) * mult
    except (OSError, ValueError, IndexError):
        return default


def cache_flusher(device: torch.device, warm: bool = False) -> Callable[[], None]:
    """Evicts the CPU caches (sums a buffer twice the last-level cache) so every timed call starts
    cold, as one layer's attention does in a real forward. ``warm`` or a non-CPU device: a no-op."""
    if warm or device.type != "cpu":
        return lambda: None
    buf = torch.ones(min(2 * last_level_cache_bytes(), 2 << 30) // 4, dtype=torch.float32)

    def flush() -> None:
        buf.sum()  # reads only: no dirty lines left to write back during the timed call

    return flush


def read_bandwidth(device: torch.device, mib: int, repeats: int = 5, clock: str = "wall") -> dict[str, Any]:
    """This machine's read bandwidth: ``torch.sum`` over a float32 tensor of ``mib`` MiB (at least
    4x the last-level cache on a CPU), best of ``repeats`` calls after one warm-up (the best call is
    the one least disturbed; a sum reads every byte once and writes nothing)."""
    nbytes = mib << 20
    if device.type == "cpu":
        nbytes = max(nbytes, 4 * last_level_cache_bytes())
    buf = torch.ones(nbytes // 4, dtype=torch.float32, device=device)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    buf.sum()
    sync()
    best = float("inf")
    tick = CLOCKS[clock]
    for _ in range(repeats):
        t0 = tick()
        buf.sum()
        sync()
        best = min(best, tick() - t0)
    del buf
    return {
        "bytes_per_s": nbytes / best,
        "method": f"torch.sum over a {nbytes >> 20} MiB float32 tensor on {device}, best of {repeats} calls, "
                  f"{torch.get_num_threads()} torch threads" + (", thread CPU time" if clock == "cpu" else ""),
    }
