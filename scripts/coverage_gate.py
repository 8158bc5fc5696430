#!/usr/bin/env python3
"""Branch coverage of this repo's kernel modules under the conformance suite, as a CI gate.

Runs ``python -m pytest PYTEST_ARGS`` (default: ``--backend=all -q -p
no:cacheprovider``) under coverage.py with branch coverage of the modules in
``GATED`` only, prints each module's coverage with its uncovered lines and
branches, and fails when a module is below ``THRESHOLD`` -- the one place the
threshold is stated. The modules are matched by their path inside the
installed package, so the gate works on an editable checkout and on the
wheels tox installs.

    python scripts/coverage_gate.py                      # the CI step (tox -e tests, its conformance stream)
    python scripts/coverage_gate.py --report-only -- --backend=torch_native -q
    python scripts/coverage_gate.py --also "VAR=VALUE --backend=NAME -q" -- --backend=all -q

``--also "VAR=VALUE ... PYTEST_ARGS"`` (repeatable) adds a run of pytest with those
environment variables and arguments, measured into the same data: a backend with two code
paths chosen by the environment is gated on both.

Exit status: pytest's when it failed (the suite's verdict comes first), else 1
when a gated module is below the threshold, else 0. ``--report-only`` never
fails on coverage. Needs ``coverage`` (tox.ini deps).
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

#: Minimum branch coverage (percent) of every gated module under the suite.
THRESHOLD = 95.0
#: Modules gated below THRESHOLD for now, each with its measured figure and what is missing (none today:
#: cpu_fused's backend.py is back at THRESHOLD since its plan sharing, the tiled kernel's refusals, the
#: non-CPU refusal and the kernel's bad-slot error have tests in tests/plugins/test_cpu_fused.py).
MODULE_THRESHOLD: dict[str, float] = {}

#: backend -> the modules whose coverage is gated (path patterns inside the installed package).
#: kernels.py holds the Triton kernels; under TRITON_INTERPRET=1 they run as Python and are measured.
GATED: dict[str, tuple[str, ...]] = {
    "torch_native": ("*/attnplug_torch_native/backend.py",),
    # kernel.py (loading the compiled library) is not gated: the suite finds it built; its failure
    # paths are tested in tests/plugins/test_cpu_fused.py
    "cpu_fused": ("*/attnplug_cpu_fused/backend.py",),
    "triton": ("*/attnplug_triton/backend.py", "*/attnplug_triton/kernels.py"),
}


#: Lines the suite leaves uncovered, each justified (issue 15): in triton's backend.py only the
#: constructor's refusal of a bad tuning knob (``decode_split_len``/``block_n``/``extend_rows``;
#: the suite builds every backend through the registry with the defaults), tested by
#: ``tests/plugins/test_triton.py``. GPU-only tile sizing is marked ``pragma: no cover`` there.
#: The decode chunk planner is reached by the suite's ``workspace`` family. In cpu_fused's
#: backend.py the methods the suite cannot reach are marked ``pragma: no cover`` with where they
#: are tested: ``kernel_call`` (``attnplug bench --overhead``'s hook: tests/fast/test_hot_path.py),
#: ``_failed`` (the kernel's error codes, after req_to_token changed or an allocation failed:
#: tests/plugins/test_forward_robustness.py).


def _patterns() -> list[str]:
    return [p for pats in GATED.values() for p in pats]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--report-only", action="store_true", help="print coverage, never fail on it")
    p.add_argument("--threshold", type=float, default=THRESHOLD, help=f"percent (default {THRESHOLD:g})")
    p.add_argument("--also", action="append", default=[], metavar='"VAR=VALUE ... ARGS"',
                   help="a further pytest run, with these environment variables and arguments (repeatable)")
    p.add_argument("pytest_args", nargs="*", help="arguments for pytest (after --)")
    a = p.parse_args(argv)
    try:
        import coverage
    except ImportError:
        print("coverage_gate: coverage.py is not installed (pip install -c constraints.txt coverage)",
              file=sys.stderr)
        return 2
    args = a.pytest_args or ["--backend=all", "-q", "-p", "no:cacheprovider"]
    runs = [({}, args)]
    for spec in a.also:
        words = shlex.split(spec)
        env = dict(w.split("=", 1) for w in words if "=" in w and not w.startswith("-"))
        runs.append((env, [w for w in words if not ("=" in w and not w.startswith("-"))]))
    rc = 0
    with tempfile.TemporaryDirectory(prefix="attnplug-cov-") as tmp:
        data = Path(tmp) / ".coverage"
        for i, (env, run_args) in enumerate(runs):
            code = subprocess.call([sys.executable, "-m", "coverage", "run", "--branch", f"--data-file={data}",
                                    *(["--append"] if i else []), f"--include={','.join(_patterns())}",
                                    "-m", "pytest", *run_args], env={**os.environ, **env})
            rc = rc or code
        cov = coverage.Coverage(data_file=str(data), branch=True, include=_patterns())
        cov.load()
        measured = sorted(cov.get_data().measured_files())
        what = " and ".join(" ".join([*(f"{k}={v}" for k, v in env.items()), "pytest", *r]) for env, r in runs)
        print(f"\nbranch coverage of the kernel modules under {what} (threshold {a.threshold:g}%):")
        below = []
        for pattern in _patterns():
            files = [f for f in measured if Path(f).match(pattern.lstrip("*/"))]
            if not files:
                print(f"  {pattern}: not imported by this run (its backend was not run)")
                continue
            floor = min(a.threshold, MODULE_THRESHOLD.get(pattern, a.threshold))
            for f in files:
                pct = cov.report(morfs=[f], show_missing=True, file=sys.stdout, skip_empty=True)
                if pct < floor:
                    below.append(f"{f}: {pct:.1f}% (threshold {floor:g}%)")
    if rc != 0:
        print(f"coverage_gate: pytest failed (exit {rc})", file=sys.stderr)
        return rc
    if below and not a.report_only:
        print(f"coverage_gate: below {a.threshold:g}% branch coverage: " + "; ".join(below), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
