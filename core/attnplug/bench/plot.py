"""``--plot``: a PNG of a sweep (matplotlib, the optional extra ``attnplug[plot]``).

Left: time per row (each backend, the loop, the floor) against context length.
Right: decode rows' K/V read rate as a fraction of the measured read bandwidth.
One line per row and per combination of the other swept values.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from .spec import BenchUsageError

_SWEPT = ("mode", "dtype", "batch", "head_dim", "kv_heads", "page_size")


def require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise BenchUsageError("--plot needs matplotlib, which is not installed: pip install 'attnplug[plot]'") \
            from None


def _series(result: dict[str, Any], decode_only: bool, key: str) -> dict[tuple[str, str], list[tuple[int, float]]]:
    """``(row name, other swept values) -> [(context, value)]``."""
    probs = [res["problem"] for res in result["problems"]]
    varying = [f for f in _SWEPT if len({p[f] for p in probs}) > 1]
    out: dict[tuple[str, str], list[tuple[int, float]]] = defaultdict(list)
    for res in result["problems"]:
        p = res["problem"]
        if decode_only and p["mode"] != "decode":
            continue
        tag = " ".join(f"{f}={p[f]}" for f in varying)
        for r in res["rows"]:
            if key in r:
                out[(r["name"].split(":")[0], tag)].append((p["context"], r[key]))
    return {k: sorted(v) for k, v in out.items()}


def _draw(ax: Any, series: dict[tuple[str, str], list[tuple[int, float]]]) -> None:
    """One colour per row (backend, loop, floor), one line style per combination of the other values."""
    names = list(dict.fromkeys(n for n, _ in series))
    tags = list(dict.fromkeys(t for _, t in series))
    styles = ["-", "--", ":", "-."]
    for (name, tag), pts in series.items():
        ax.plot([c for c, _ in pts], [v for _, v in pts], styles[tags.index(tag) % len(styles)], marker="o",
                color=f"C{names.index(name) % 10}", label=f"{name} {tag}".strip())


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    _draw(left, _series(result, False, "ms"))
    left.set(xscale="log", yscale="log", xlabel="context (cached tokens per request)", ylabel="ms per call",
             title="time per row vs context")
    left.legend(fontsize=7)
    _draw(right, _series(result, True, "bandwidth_fraction"))
    gbs = result["bandwidth"]["bytes_per_s"] / 1e9
    right.set(xscale="log", xlabel="context (cached tokens per request)", ylim=(0, None),
              ylabel=f"K/V read rate / read bandwidth ({gbs:.1f} GB/s)", title="decode: fraction of read bandwidth")
    if right.lines:
        right.legend(fontsize=7)
    m = result["machine"]
    fig.suptitle(f"attnplug bench on {m['device']}: {m.get('gpu', m['cpu'])}, torch threads: {m['torch_threads']}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
