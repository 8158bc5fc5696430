"""``attnplug lint`` on big files: the guard's time as a ratio of ``ast.parse`` alone, side by side.

    python benchmarks/bench_lint.py [--mb 20] [--findings-per-line 1.0] [--repeats 3]

Writes one synthetic module of about ``--mb`` megabytes (ordinary statements,
string literals, and reads of the base field -- most of them findings, some
suppressed by an allow comment, some spelled ``getattr(x, FIELD)``), then
times, best of ``--repeats``: ``ast.parse`` of the source (as a caller sees it,
and with the garbage collector off, which is how the guard runs its own parse:
the stricter baseline), and the guard's whole check of the file (read, parse,
fold constants, visit, report). Also a scaling row: the same shape at 1/4 the
size, so a super-linear cost shows as a growing ratio. Goal: guard <= 2x
``ast.parse``. Timings only; nothing is asserted.
"""

from __future__ import annotations

import argparse
import ast
import gc
import sys
import tempfile
import time
from pathlib import Path

from attnplug.guard import check

BLOCK = '''\
def handler_{i}(cfg, x):
    total = x * {i} + len("text with # not a comment {i}")
    name = cfg.attention_backend
    other = getattr(cfg, FIELD) if x else None
    ok = cfg.attention_backend  # attnplug: allow-base-field
    return total, name, other, ok, cfg.attention_backends()[0]


'''


def source_of(megabytes: float) -> str:
    head = 'FIELD = "attention_backend"\n\n'
    one = len(BLOCK.format(i=100000))
    n = max(1, int(megabytes * 1e6 / one))
    return head + "".join(BLOCK.format(i=i) for i in range(n))


def best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def parse_gc_off(text: str, filename: str) -> None:
    gc.disable()
    try:
        ast.parse(text, filename=filename)
    finally:
        gc.enable()


def row(megabytes: float, repeats: int, folder: Path) -> tuple[float, int, float, float, float, int]:
    text = source_of(megabytes)
    path = folder / f"big_{megabytes:g}mb.py"
    path.write_text(text, encoding="utf-8")
    t_parse = best(lambda: ast.parse(text, filename=str(path)), repeats)
    t_parse_off = best(lambda: parse_gc_off(text, str(path)), repeats)
    report = None

    def run() -> None:
        nonlocal report
        report = check([path])

    t_guard = best(run, repeats)
    assert report is not None
    return len(text.encode()) / 1e6, len(report.findings), t_parse, t_parse_off, t_guard, len(report.allowed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=20.0, help="size of the big file in MB (default: 20)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per row; the best is kept (default: 3)")
    args = parser.parse_args(argv)
    if args.mb <= 0 or args.repeats < 1:
        parser.error("--mb must be > 0 and --repeats >= 1")
    print(f"python {sys.version.split()[0]}; best of {args.repeats}")
    print(f"{'size MB':>8} {'findings':>9} {'allowed':>8} {'parse s':>8} {'parse gc-off s':>15} {'guard s':>8} "
          f"{'guard/parse':>12} {'guard/parse gc-off':>19}")
    with tempfile.TemporaryDirectory() as tmp:
        for mb in (args.mb / 4, args.mb):
            size, findings, t_parse, t_off, t_guard, allowed = row(mb, args.repeats, Path(tmp))
            print(f"{size:8.1f} {findings:9d} {allowed:8d} {t_parse:8.2f} {t_off:15.2f} {t_guard:8.2f} "
                  f"{t_guard / t_parse:11.2f}x {t_guard / t_off:18.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
