"""``attnplug bench --overhead``: what the framework costs per layer above each backend's own kernel.

For every problem and backend, three calls are timed round-robin (one call of each per round, medians
of ``--repeats``), with the CPU caches warm and again flushed before every call (``--warm``: warm only):

* ``forward``: ``backend.forward`` of one layer, metadata built once (what every layer of a forward
  pays: the per-layer checks, the KV write with its guarantees, the kernel, the output);
* ``kernel``: the backend's own kernel called directly with prepared arguments
  (``PagedBackend.kernel_call``: the KV write and the attention, a fresh output per call);
* ``init_forward_metadata``: the per-forward cost (bounds checks and the kernel's metadata), paid once
  per forward by all layers together; timed on its own and followed by one layer's forward
  (``first_layer_extra_us``: what the first layer of a forward pays above the others, such as
  kernel metadata a backend builds at the first layer that needs it).

``forward`` and ``kernel`` are timed as pairs (``timing.paired_difference_ms``: back to back, order swapped every
round): ``overhead_us`` is the **median of the per-round differences** forward - kernel, the per-layer cost of the
framework, and ``overhead_band_us`` its noise band (the half-width of the median's ~95% interval). The per-layer
verdict uses the band: met when ``overhead_us + overhead_band_us`` is within the goal, not met when
``overhead_us - overhead_band_us`` is above it, and **unresolved** (``None``) otherwise: a kernel whose own
time varies by more than the goal (an eager kernel of dozens of ops at 4 × 256 varies by ~100 µs) cannot show a
15 µs difference at that repeat count, and the table says so instead of printing a verdict the noise chose.

Where the backend's kernel is its own compute (its ``kernel_call`` is the skeleton's: torch_native, the template)
on the CPU, the compute is also timed **from inside** (``timing.timed_compute``) and the same pairs give
``outside_us`` ± ``outside_band_us``: the paired median of (forward - its compute) - (kernel - its compute), the
time spent around the compute, which no longer carries the compute's own spread (bands of a fraction of a µs);
the verdict then uses it (``overhead_judged_by``). ``compute_diff_us`` ± its band is the paired difference of the
computes themselves (what the code around a compute does to it; ~0 within its band). The goals (issue 30;
docs/performance.md, "The framework's own cost per layer"):

* per layer: at most ``OVERHEAD_GOAL_US`` with warm caches, judged with the band above (flushed rows: no verdict);
* ``init_forward_metadata`` (``init_goal_us``): **at most ``INIT_GOAL_US`` (50 µs) with warm caches for a problem
  no larger than the issue's 1 × 128** (at most ``INIT_SMALL_TOKENS`` cached tokens in the batch, batch ×
  context): an absolute bound, whatever the forward costs; **proportionate above that**: at most
  ``INIT_GOAL_SHARE`` (2%) of ``MODEL_LAYERS`` (32) layers' forwards, never below ``INIT_GOAL_US`` (a larger
  problem never gets a stricter bound than the small one; at 32 × 1024 the share is the bound). Flushed
  rows are judged by the proportionate rule at every size: a call with every cache line cold measures the
  memory latency of the code and data it touches, which the absolute bound does not describe.
"""

from __future__ import annotations

from typing import Any

#: per-layer overhead goal (µs, warm caches)
OVERHEAD_GOAL_US = 15.0
#: init_forward_metadata goal: this many µs, or this share of a ``MODEL_LAYERS``-layer forward's layers
INIT_GOAL_US = 50.0
INIT_GOAL_SHARE = 0.02
MODEL_LAYERS = 32


#: the issue's small problem (1 × 128): at most this many cached tokens in the batch (batch × context)
INIT_SMALL_TOKENS = 128


def init_goal_us(forward_us: float, kv_tokens: int, caches: str = "warm") -> float:
    """The ``init_forward_metadata`` bound (µs) of a problem with ``kv_tokens`` cached tokens (batch × context) whose
    one-layer forward takes ``forward_us``, with ``caches`` ``"warm"`` or ``"flushed"`` (the module docstring's
    rule): ``INIT_GOAL_US`` for a warm problem no larger than ``INIT_SMALL_TOKENS``; else the larger of
    ``INIT_GOAL_US`` and ``INIT_GOAL_SHARE`` of ``MODEL_LAYERS`` forwards."""
    if caches == "warm" and kv_tokens <= INIT_SMALL_TOKENS:
        return INIT_GOAL_US
    return max(INIT_GOAL_US, INIT_GOAL_SHARE * MODEL_LAYERS * forward_us)


def overhead_verdict(overhead_us: float, band_us: float) -> bool | None:
    """The per-layer goal's verdict for a paired median ``overhead_us`` ± ``band_us``: ``True`` (met) when the whole
    interval is within ``OVERHEAD_GOAL_US``, ``False`` when all of it is above, ``None`` (unresolved) when the
    interval straddles the goal."""
    if overhead_us + band_us <= OVERHEAD_GOAL_US:
        return True
    if overhead_us - band_us > OVERHEAD_GOAL_US:
        return False
    return None


def measure_overhead(p: Any, prep: Any, flush_cold: Any) -> dict[str, Any]:
    """One problem's overhead rows (one per backend), warm and (unless ``--warm``) flushed."""
    import torch

    from ..errors import AttnplugError
    from ..registry import default_registry
    from .problem import PagedProblem
    from .spec import prepared_or_noted
    from ..paged import PagedBackend
    from .timing import CLOCKS, interleaved_median_ms, paired_difference_ms, paired_outside_ms, timed_compute

    spec = prep.spec
    prob = PagedProblem(p, str(prep.device), spec.seed)
    reg = default_registry()
    clock = CLOCKS[spec.clock]
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    for name in prep.backends:
        def prepare(name: str = name) -> tuple[Any, Any, Any, Any]:
            ctx = prob.context(name, reg.host, reg)
            _, backend = reg.build(name, ctx)
            reasons = backend.not_supported_reasons(prob.layer, ctx)
            if reasons:
                raise AttnplugError("; ".join(reasons))
            # a backend whose kernel_call is the skeleton's (its own compute, called directly) on the CPU: the
            # compute is timed from inside too, so the overhead is the time outside it (the module docstring)
            inner = timed_compute(backend, clock) if prep.device.type == "cpu" and \
                getattr(type(backend), "kernel_call", None) is PagedBackend.kernel_call else None
            forward = prob.backend_call(backend)
            forward()  # the layer's first forward: checks passed, its plan built
            if not hasattr(backend, "kernel_call"):
                raise AttnplugError(f"{type(backend).__name__} is not a PagedBackend: no kernel_call to compare with")
            kernel = backend.kernel_call(prob.q, prob.k, prob.v, prob.layer, prob.batch)
            kernel()
            return backend, forward, kernel, inner

        ready = prepared_or_noted(notes, name, prepare)
        if ready is None:
            continue
        backend, forward, kernel, inner = ready
        batch = prob.batch

        def init(backend: Any = backend, batch: Any = batch) -> None:
            backend.init_forward_metadata(batch)

        def init_and_layer(backend: Any = backend, forward: Any = forward, batch: Any = batch) -> None:
            backend.init_forward_metadata(batch)
            forward()

        row: dict[str, Any] = {"backend": name}
        for caches in ("warm",) if spec.warm or prep.device.type != "cpu" else ("warm", "flushed"):
            flush = flush_cold if caches == "flushed" else (lambda: None)
            ms = interleaved_median_ms({"init": init, "init_and_layer": init_and_layer}, spec.repeats,
                                       spec.warmup, prob.sync, flush, None, clock)
            init()
            forward()  # this forward's metadata, the layer's first call of it done: what later layers see
            outside: dict[str, Any] = {}
            if inner is None:
                pair = paired_difference_ms(forward, kernel, spec.repeats, spec.warmup, prob.sync, flush, clock)
            else:
                o = paired_outside_ms(forward, kernel, inner, spec.repeats, spec.warmup, prob.sync, flush, clock)
                pair = {"a": o["a_total"], "b": o["b_total"], "diff": o["total_diff"], "diff_band": o["total_diff_band"]}
                outside = {"outside_us": o["diff"] * 1e3, "outside_band_us": o["diff_band"] * 1e3,
                           "compute_diff_us": o["inner_diff"] * 1e3, "compute_diff_band_us": o["inner_diff_band"] * 1e3}
            ms.update(forward=pair["a"], kernel=pair["b"])
            us = {k: v * 1e3 for k, v in ms.items()}
            over, band = pair["diff"] * 1e3, pair["diff_band"] * 1e3
            # the verdict from the finer measure where there is one
            judged = (outside["outside_us"], outside["outside_band_us"]) if outside else (over, band)
            goal = init_goal_us(us["forward"], p.batch * p.context, caches)
            row[caches] = {"forward_us": us["forward"], "kernel_us": us["kernel"], "overhead_us": over,
                           "overhead_band_us": band, **outside,
                           "overhead_judged_by": "outside the compute" if outside else "forward - kernel",
                           "init_forward_metadata_us": us["init"],
                           "first_layer_extra_us": us["init_and_layer"] - us["init"] - us["forward"],
                           "init_share_of_model_forward": us["init"] / (MODEL_LAYERS * us["forward"]),
                           "overhead_goal_met": overhead_verdict(*judged) if caches == "warm" else None,
                           "init_goal_us": goal, "init_goal_met": us["init"] <= goal}
        rows.append(row)
        del backend, forward, kernel, init
    from attnplug.paged import SPEEDUPS_NOTE

    return {"problem": p.to_dict(), "label": p.label(), "rows": rows, "notes": notes,
            "torch_threads": torch.get_num_threads(), "per_layer_check": SPEEDUPS_NOTE}


def format_overhead(result: dict[str, Any]) -> list[str]:
    """The ``--overhead`` table lines (plain data in, text out)."""
    lines = [f"per-layer overhead above each backend's own kernel (goal: <= {OVERHEAD_GOAL_US:g} us warm) and "
             f"init_forward_metadata per forward (goal: <= {INIT_GOAL_US:g} us warm up to batch x context = "
             f"{INIT_SMALL_TOKENS}; above that, and flushed, <= {100 * INIT_GOAL_SHARE:g}% of {MODEL_LAYERS} layers' "
             f"forwards, at least {INIT_GOAL_US:g} us); microseconds"]
    checks = {res["per_layer_check"] for res in result["overhead"] if res.get("per_layer_check")}
    lines += [f"the skeleton's per-layer check (attnplug-speedups): {c}" for c in sorted(checks)]
    header = (f"  {'backend':<16} {'caches':<8} {'forward':>10} {'kernel':>10} {'overhead':>9} {'+-':>6} {'outside':>8} "
              f"{'+-':>5} {'init_fm':>9} {'1st layer+':>10} {'init/32 layers':>14}  goals")
    for res in result["overhead"]:
        lines += ["", res["label"], header]
        for row in res["rows"]:
            for caches in ("warm", "flushed"):
                r = row.get(caches)
                if r is None:
                    continue
                goals = []
                if caches == "warm":
                    met = r["overhead_goal_met"]
                    goals.append("overhead " + ("unresolved (noise)" if met is None else "met" if met else "not met"))
                goals.append("init " + ("met" if r["init_goal_met"] else "not met"))
                outside = f"{r['outside_us']:8.1f} {r['outside_band_us']:5.1f}" if "outside_us" in r else \
                    f"{'-':>8} {'-':>5}"
                lines.append(f"  {row['backend']:<16} {caches:<8} {r['forward_us']:10.1f} {r['kernel_us']:10.1f} "
                             f"{r['overhead_us']:9.1f} {r['overhead_band_us']:6.1f} {outside} "
                             f"{r['init_forward_metadata_us']:9.1f} "
                             f"{r['first_layer_extra_us']:10.1f} "
                             f"{100 * r['init_share_of_model_forward']:13.2f}%  {', '.join(goals)}")
        for note in res["notes"]:
            lines.append(f"  note: {note}")
    lines += ["", "forward: one layer's backend.forward; kernel: the backend's own kernel with prepared arguments "
              "(PagedBackend.kernel_call); overhead = median of forward - kernel timed in pairs, paid by every layer, "
              "+- its ~95% noise band (a verdict only when the band clears the goal); outside: the same difference "
              "of the time each call spends outside the backend's compute, timed from inside (backends whose kernel "
              "is their own compute, on the CPU; the verdict then uses it); init_fm: "
              "init_forward_metadata, once per forward; 1st layer+: what the first layer of a forward pays above "
              "the others; init/32 layers: init_fm over 32 layers' forwards"]
    return lines
