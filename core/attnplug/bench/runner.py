"""Running a sweep: check the backends and the device, then measure every problem side by side.

``prepare`` turns every user error (unknown or unavailable backend, a device
this torch lacks) into ``BenchUsageError`` before anything is timed.
``run_sweep`` returns a plain dict (the ``--json`` document; ``report``
formats it): per problem, one row per backend, the per-request loop and the
contiguous floor, each backend's goal verdict, and for decode the KV bytes read
per second as a fraction of the read bandwidth measured at the start.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import platform
from typing import IO, Any

from ..backend import runtime_notes_of
from .spec import GOALS, BenchUsageError, Problem, Spec, goal_met

LOOP = "loop: per-request gather + SDPA"
FLOOR = "floor: contiguous K/V"
VLLM_RAW = "vllm-raw: vLLM's CPU op called directly"


@dataclasses.dataclass
class Prepared:
    spec: Spec
    device: Any  # torch.device
    backends: list[str]  # canonical names
    notes: list[str]


def prepare(spec: Spec) -> Prepared:
    try:
        import torch
    except ImportError:
        raise BenchUsageError("attnplug bench needs torch (pip install torch)") from None
    from ..errors import AttnplugError
    from ..registry import default_registry

    device = _device(torch, spec.device)
    if spec.threads is not None:
        torch.set_num_threads(spec.threads)
    reg = default_registry()
    notes: list[str] = []
    names: list[str] = []
    if spec.backends == ("all",):
        for name in reg.names():
            avail = reg.availability(name)
            if not avail:
                notes.append(f"{name}: not available here ({'; '.join(avail.reasons)})")
            elif device.type not in reg.get(name).capabilities.devices:
                notes.append(f"{name}: does not claim device {device.type}")
            else:
                names.append(name)
        if not names:
            raise BenchUsageError(f"--backend all: no available backend claims device {device.type}")
    else:
        for given in spec.backends:
            try:
                name = reg.canonical(given)
                avail = reg.availability(name)
            except AttnplugError as exc:
                raise BenchUsageError(f"--backend {given!r}: {exc}") from None
            if not avail:
                raise BenchUsageError(f"--backend {given!r}: {name} is not available here: "
                                      f"{'; '.join(avail.reasons)}")
            claimed = reg.get(name).capabilities.devices
            if device.type not in claimed:
                raise BenchUsageError(f"--backend {given!r}: {name} does not run on {device.type} "
                                      f"(claims: {', '.join(claimed)})")
            if name not in names:
                names.append(name)
    try:
        free = available_memory(device)
    except (RuntimeError, AssertionError):  # pragma: no cover - the device cannot say: the run will
        free = 1 << 62
    if (spec.bandwidth_mib << 20) > free // 2:
        raise BenchUsageError(f"--bandwidth-mib {spec.bandwidth_mib}: the tensor summed would take more than half "
                              f"the free memory of {device} ({free >> 20} MiB free)")
    return Prepared(spec, device, names, notes)


def _device(torch: Any, text: str) -> Any:
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError) as exc:
        raise BenchUsageError(f"--device {text!r} is not a torch device ({str(exc).splitlines()[0]})") from None
    if device.type == "cpu":
        return device
    module: Any = getattr(torch, device.type, None)
    ok = module is not None and hasattr(module, "is_available") and module.is_available()
    if not ok:
        raise BenchUsageError(f"--device {text!r}: this torch ({torch.__version__}) has no usable "
                              f"{device.type} device")
    count = module.device_count() if hasattr(module, "device_count") else 1
    if device.index is not None and device.index >= count:
        raise BenchUsageError(f"--device {text!r}: index {device.index} out of range ({count} {device.type} "
                              f"device(s))")
    return device


def machine(device: Any) -> dict[str, Any]:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    info: dict[str, Any] = {"cpu": cpu, "cpu_cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                            "torch": torch.__version__, "device": str(device)}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def available_memory(device: Any) -> int:
    import torch

    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62  # unknown: do not skip on memory


def run_sweep(prep: Prepared, progress: IO[str] | None = None) -> dict[str, Any]:
    from .timing import cache_flusher, read_bandwidth

    spec, device = prep.spec, prep.device
    bw: dict[str, Any] = {"bytes_per_s": 0.0, "method": "not measured (--overhead)"} if spec.overhead else \
        read_bandwidth(device, spec.bandwidth_mib, clock=spec.clock)
    mla: list[dict[str, Any]] = []
    flush = cache_flusher(device, spec.warm)
    problems = list(spec.problems())
    results, skipped, overhead = [], [], []
    for i, p in enumerate(problems, 1):
        if progress is not None:
            progress.write(f"\r[{i}/{len(problems)}] {p.label()}".ljust(110)[:110])
            progress.flush()
        reason = "" if spec.mla else _skip_reason(p, spec, device)
        if reason:
            skipped.append({"problem": p.to_dict(), "label": p.label(), "reason": reason})
            continue
        if spec.mla:
            from .mla import measure_mla

            mla.append(measure_mla(p, prep, bw["bytes_per_s"], flush))
        elif spec.overhead:
            from .overhead import measure_overhead

            overhead.append(measure_overhead(p, prep, cache_flusher(device, False)))
        else:
            results.append(_measure(p, prep, bw["bytes_per_s"], flush))
        gc.collect()
    if progress is not None:
        progress.write("\n")
    best = max((r for res in results for r in res["rows"] if r.get("bandwidth_fraction") is not None
                and r["kind"] == "backend"), key=lambda r: r["bandwidth_fraction"], default=None)
    return {
        "machine": machine(device),
        "bandwidth": bw,
        "settings": {"repeats": spec.repeats, "warmup": spec.warmup, "seed": spec.seed,
                     "caches": "warm" if spec.warm or device.type != "cpu" else
                     ("warm, then flushed before every timed call" if spec.overhead else
                      "flushed before every timed call"),
                     "max_kv_gib": spec.max_kv_gib, "clock": spec.clock, "overhead": spec.overhead,
                     "mla": spec.mla},
        "goals": {m: {"max_ratio_to_floor": g, "faster_than_loop": f} for m, (g, f) in GOALS.items()},
        "backends": prep.backends,
        "notes": prep.notes,
        # what each built backend chose at run time (``runtime_notes()``, e.g. torch_native's fused
        # CPU kernel taken or not): every distinct note, in the order first seen
        "runtime_notes": _runtime_notes(results),
        "problems": results,
        "overhead": overhead,
        "mla": mla,
        "skipped": skipped,
        "best_decode_bandwidth_fraction": None if best is None else
        {"backend": best["name"], "fraction": best["bandwidth_fraction"], "problem": best["problem_label"]},
    }


def _runtime_notes(results: list[dict[str, Any]]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for res in results:
        for name, notes in res.get("runtime_notes", {}).items():
            seen = out.setdefault(name, [])
            seen.extend(n for n in notes if n not in seen)
    return out


def _skip_reason(p: Problem, spec: Spec, device: Any) -> str:
    from .problem import memory_needed

    gib = p.kv_bytes() / 2**30
    if gib > spec.max_kv_gib:
        return f"K/V of {gib:.1f} GiB is over the {spec.max_kv_gib:g} GiB limit (--max-kv-gib)"
    need, have = memory_needed(p), available_memory(device)
    if need > 0.9 * have:
        return f"needs about {need / 2**30:.1f} GiB, {have / 2**30:.1f} GiB available on {device}"
    return ""


def _measure(p: Problem, prep: Prepared, bandwidth: float, flush: Any) -> dict[str, Any]:
    import torch

    from ..errors import AttnplugError, PluginError
    from ..isolation import call_plugin_code, captured_stdout, guarded, output_note, watch_sigint
    from ..registry import default_registry
    from .problem import PagedProblem
    from .timing import CLOCKS, interleaved_median_ms, median_ms

    spec = prep.spec
    prob = PagedProblem(p, str(prep.device), spec.seed)
    reg = default_registry()
    loop = prob.loop_call()
    expected = loop()
    calls, built, diffs, row_notes, dists = {}, {}, {}, [], {}
    for name in prep.backends:
        dist = dists[name] = reg.get(name).distribution
        try:
            ctx = prob.context(name, reg.host, reg)
            _, backend = reg.build(name, ctx)
            # the backend's own code runs isolated: a SystemExit or a KeyboardInterrupt it raises itself
            # is its failure (naming its distribution), and what it prints stays out of the results
            reasons, printed = call_plugin_code(dist, "not_supported_reasons()", backend.not_supported_reasons,
                                                prob.layer, ctx)
            if reasons:
                raise AttnplugError("; ".join(reasons))
            call, printed2 = call_plugin_code(dist, "init_forward_metadata()", prob.backend_call, backend)
            out, printed3 = call_plugin_code(dist, "forward()", call)
            for text in (printed, printed2, printed3):
                if text.strip():
                    row_notes.append(output_note(dist, f"{name}'s first call", text))
            if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(expected.shape):
                got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
                raise ValueError(f"forward returned {got}, expected a tensor of shape {tuple(expected.shape)}")
            diffs[name] = float((out.float() - expected.float()).abs().max())
        except PluginError as exc:  # the plugin broke the contract (raised SystemExit …): its row fails
            row_notes.append(f"{name}: failed ({exc})")
            continue
        except AttnplugError as exc:  # not claimed for this problem (dtype, head dim, …): a note, not a failure
            row_notes.append(f"{name}: skipped ({exc})")
            continue
        except Exception as exc:  # a backend that breaks is reported on its row; the other rows still run
            row_notes.append(f"{name}: failed ({type(exc).__name__}: {exc})")
            continue
        calls[name], built[name] = call, backend
    floor_kind, floor = prob.floor_call()
    floor_diff = float((prob.floor_tokens(floor()).float() - expected.float()).abs().max())
    calls[LOOP] = loop
    calls[FLOOR] = floor
    raw, why_raw = prob.vllm_raw_call(reg)
    raw_diff = None
    if raw is not None:
        try:
            raw_diff = float((raw().float() - expected.float()).abs().max())
            calls[VLLM_RAW] = raw
        except Exception as exc:  # the op refused this problem: a note, the other rows still run
            row_notes.append(f"vllm-raw: skipped ({type(exc).__name__}: {exc})")
    elif prob.device.type == "cpu":
        row_notes.append(f"vllm-raw: skipped ({why_raw})")
    best: dict[str, float] = {}
    clock = CLOCKS[spec.clock]
    while True:  # a backend that breaks the contract during the timed calls loses its row; the rest are timed
        with watch_sigint() as interrupted, captured_stdout() as printed_buf:
            timed = {n: guarded(dists[n], "forward()", c, interrupted) if n in built else c for n, c in calls.items()}
            try:
                best.clear()
                ms = interleaved_median_ms(timed, spec.repeats, spec.warmup, prob.sync, flush, best, clock)
                failed = None
            except PluginError as exc:
                failed = next((n for n in built if dists[n] == exc.distribution), None)
                if failed is None:
                    raise
                row_notes.append(f"{failed}: failed ({exc})")
                del calls[failed], built[failed]
        if "".join(printed_buf).strip():
            row_notes.append(output_note(", ".join(sorted({dists[n] for n in built})) or "?", "the timed calls",
                                         "".join(printed_buf)))
        if failed is None:
            break
    kv = p.kv_bytes()
    target, need_loop = GOALS[p.mode]
    rows = []
    for name, t in ms.items():
        kind = "backend" if name in built else {LOOP: "loop", FLOOR: "floor", VLLM_RAW: "vllm-raw"}[name]
        row: dict[str, Any] = {"name": name, "kind": kind, "ms": t, "ratio_to_floor": t / ms[FLOOR],
                               "speedup_vs_loop": ms[LOOP] / t, "problem_label": p.label(),
                               "best_ms": best[name], "best_ratio_to_floor": best[name] / best[FLOOR]}
        if VLLM_RAW in ms:
            row["ratio_to_vllm_raw"] = t / ms[VLLM_RAW]
        if p.mode == "decode":
            row["kv_bytes_per_s"] = kv / (t / 1e3)
            row["bandwidth_fraction"] = row["kv_bytes_per_s"] / bandwidth
        if kind == "backend":
            met = goal_met(p.mode, t, ms[FLOOR], ms[LOOP])
            row["goal"] = {"text": f"<= {target:g}x floor" + (" and faster than loop" if need_loop else ""),
                           "met": bool(met)}
            row["max_abs_diff_vs_loop"] = diffs[name]
        elif kind == "floor":
            row["max_abs_diff_vs_loop"] = floor_diff
        elif kind == "vllm-raw":
            row["max_abs_diff_vs_loop"] = raw_diff
        rows.append(row)
    validation = []
    if p.mode == "decode":
        from ..paged import PagedBackend

        for name, backend in built.items():
            # each lambda runs at once, in this iteration (prob is deleted only after the loop)
            meta = median_ms(lambda: backend.init_forward_metadata(prob.batch), spec.repeats, spec.warmup, prob.sync,  # noqa: B023, F821
                             clock)
            mapped = getattr(type(backend), "new_kv_source", "args") == "cache"
            checks = median_ms(lambda: prob.cache.check_batch(prob.batch, new_tokens_mapped=mapped), spec.repeats,  # noqa: B023, F821
                               spec.warmup, prob.sync, clock)
            validation.append({"backend": name, "init_forward_metadata_ms": meta, "bounds_checks_ms": checks,
                               "checks_in_init_forward_metadata": isinstance(backend, PagedBackend),
                               "forward_ms": ms[name], "checks_over_forward": checks / ms[name]})
    runtime = {name: runtime_notes_of(backend, dists[name]) for name, backend in built.items()}
    del prob, calls, built
    return {"problem": p.to_dict(), "label": p.label(), "kv_bytes": kv, "floor_method": floor_kind,
            "rows": rows, "validation": validation, "notes": row_notes, "torch_threads": torch.get_num_threads(),
            "runtime_notes": runtime}
