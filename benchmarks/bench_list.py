"""Start-up cost of ``attnplug list`` in a fresh process vs ``python -c "import importlib.metadata"``.

    python benchmarks/bench_list.py [--runs 9]

Both commands run ``--runs`` times, alternating, each in a fresh interpreter;
medians and their ratio are printed, and whether torch got imported by
``attnplug list`` (it must not be). Goal: ratio <= 2x. Nothing is asserted.

When ``PYTHONDONTWRITEBYTECODE`` is set (as in some sandboxes), attnplug's
own modules are compiled from source on every start while the standard
library's are not; the benchmark then also runs both commands with a bytecode
cache in a temporary ``PYTHONPYCACHEPREFIX`` (nothing is written to the tree),
which is what an installed package sees.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time


def attnplug_command() -> list[str]:
    script = os.path.join(os.path.dirname(sys.executable), "attnplug")
    if os.path.exists(script):
        return [script, "list"]
    found = shutil.which("attnplug")
    return [found, "list"] if found else [sys.executable, "-m", "attnplug", "list"]


def wall_s(cmd: list[str], env: dict[str, str] | None = None) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    return time.perf_counter() - t0


def compare(listing: list[str], baseline: list[str], runs: int, env: dict[str, str] | None, label: str) -> None:
    wall_s(listing, env), wall_s(baseline, env)  # warm the page cache (and the bytecode cache, if any)
    a, b = [], []
    for _ in range(runs):
        a.append(wall_s(listing, env))
        b.append(wall_s(baseline, env))
    ma, mb = statistics.median(a), statistics.median(b)
    print(f"[{label}]")
    print(f"  attnplug list: median {ma * 1e3:.1f} ms over {runs} runs "
          f"(min {min(a) * 1e3:.1f}, max {max(a) * 1e3:.1f})")
    print(f"  python -c 'import importlib.metadata': median {mb * 1e3:.1f} ms "
          f"(min {min(b) * 1e3:.1f}, max {max(b) * 1e3:.1f})")
    print(f"  ratio {ma / mb:.2f}x (goal <= 2x): {'met' if ma / mb <= 2 else 'NOT met'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=9)
    args = parser.parse_args(argv)
    listing = attnplug_command()
    baseline = [sys.executable, "-c", "import importlib.metadata"]
    no_bytecode = bool(os.environ.get("PYTHONDONTWRITEBYTECODE"))
    compare(listing, baseline, args.runs, None,
            "this environment"
            + (" (PYTHONDONTWRITEBYTECODE set: attnplug compiled on every start)" if no_bytecode else ""))
    if no_bytecode:
        with tempfile.TemporaryDirectory(prefix="attnplug-pyc-") as tmp:
            env = dict(os.environ, PYTHONPYCACHEPREFIX=tmp)
            env.pop("PYTHONDONTWRITEBYTECODE")
            compare(listing, baseline, args.runs, env, "with a bytecode cache (PYTHONPYCACHEPREFIX in a temp dir)")
    probe = subprocess.run(
        [sys.executable, "-c",
         "import sys; from attnplug.cli.main import main; main(['list']); "
         "print('TORCH_IMPORTED' if 'torch' in sys.modules else 'TORCH_NOT_IMPORTED', file=sys.stderr)"],
        capture_output=True, text=True,
    )
    print("torch " + ("IMPORTED (bad)" if "TORCH_IMPORTED" in probe.stderr else "not imported") + " by `attnplug list`")
    return 0


if __name__ == "__main__":
    sys.exit(main())
