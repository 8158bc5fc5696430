"""The final table and the JSON document of a sweep (plain data in, text out; no torch)."""

from __future__ import annotations

import json
from typing import IO, Any


def write_json(result: dict[str, Any], fh: IO[str]) -> None:
    json.dump(result, fh, indent=2, sort_keys=True)
    fh.write("\n")


def _gbs(x: float) -> str:
    return f"{x / 1e9:.1f}"


def format_table(result: dict[str, Any]) -> str:
    m, bw, st = result["machine"], result["bandwidth"], result["settings"]
    goals = result["goals"]
    lines = [
        f"attnplug bench on {m['device']} ({m['cpu']}, {m['cpu_cores']} cores, {m['torch_threads']} torch threads"
        + (f", {m['gpu']}" if "gpu" in m else "") + f"; torch {m['torch']})",
        f"read bandwidth {_gbs(bw['bytes_per_s'])} GB/s ({bw['method']})",
        f"medians of {st['repeats']} timed calls after {st['warmup']} warm-up, timed round-robin; "
        f"caches {st['caches']}",
        "goals: decode <= {d:g}x the floor; extend, verify, mixed <= {e:g}x the floor and faster than the loop"
        .format(d=goals["decode"]["max_ratio_to_floor"], e=goals["extend"]["max_ratio_to_floor"]),
    ]
    for note in result["notes"]:
        lines.append(f"note: {note}")
    for name, notes in result.get("runtime_notes", {}).items():
        lines += [f"{name}: {note}" for note in notes]
    header = f"  {'row':<44} {'ms':>10} {'x floor':>8} {'x vllm':>7} {'loop/row':>8} {'KV GB/s':>8} {'of bw':>6}  goal"
    for res in result["problems"]:
        lines += ["", f"{res['label']} (K/V {res['kv_bytes'] / 2**20:.1f} MiB; floor: {res['floor_method']})",
                  header]
        for r in res["rows"]:
            name = r["name"]
            gb = _gbs(r["kv_bytes_per_s"]) if "kv_bytes_per_s" in r else "-"
            frac = f"{r['bandwidth_fraction']:.2f}" if "bandwidth_fraction" in r else "-"
            goal = ""
            if "goal" in r:
                goal = ("met" if r["goal"]["met"] else "not met") + f" ({r['goal']['text']})"
                if r["max_abs_diff_vs_loop"] > 0.1:
                    goal += f"; max |diff| vs loop {r['max_abs_diff_vs_loop']:.2g}"
            xv = f"{r['ratio_to_vllm_raw']:.2f}" if "ratio_to_vllm_raw" in r else "-"
            lines.append(f"  {name:<44} {r['ms']:10.3f} {r['ratio_to_floor']:8.2f} {xv:>7} {r['speedup_vs_loop']:8.2f} "
                         f"{gb:>8} {frac:>6}  {goal}".rstrip())
        for v in res["validation"]:
            where = "included" if v["checks_in_init_forward_metadata"] else "not run by this backend"
            lines.append(
                f"  validation ({v['backend']}): init_forward_metadata {v['init_forward_metadata_ms']:.3f} ms; "
                f"bounds checks (PagedKVCache.check_batch, {where}) {v['bounds_checks_ms']:.3f} ms = "
                f"{100 * v['checks_over_forward']:.1f}% of one layer's forward; once per forward, not per layer")
        for note in res["notes"]:
            lines.append(f"  note: {note}")
    if result.get("overhead"):
        from .overhead import format_overhead

        lines += [""] + format_overhead(result)
    if result.get("mla"):
        from .mla import format_mla

        lines += [""] + format_mla(result)
    for s in result["skipped"]:
        lines += ["", f"skipped: {s['label']}: {s['reason']}"]
    best = result["best_decode_bandwidth_fraction"]
    if best is not None:
        lines += ["", f"best decode row: {best['backend']} reads K/V at {best['fraction']:.2f} of the measured "
                      f"read bandwidth ({best['problem']})"]
    met = [r for res in result["problems"] for r in res["rows"] if "goal" in r]
    if met:
        lines.append(f"goals met in {sum(r['goal']['met'] for r in met)} of {len(met)} backend rows "
                     f"(information only: the command exits 0 either way)")
    return "\n".join(lines)
