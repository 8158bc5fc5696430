"""Running the conformance suite in a subprocess, as a user would (imported by the tests here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any


class SuiteRun:
    def __init__(self, proc: subprocess.CompletedProcess[str], report: dict[str, Any] | None) -> None:
        self.proc = proc
        self.report = report
        self.output = proc.stdout + proc.stderr

    def outcomes(self) -> dict[str, str]:
        """case id (``test_x[backend-case]``) -> outcome, from the JSON report."""
        assert self.report is not None, self.output
        cases = [c for b in self.report["backends"] for c in b["cases"]]
        return {c["id"]: c["outcome"] for c in cases if c["outcome"] != "not_run"}

    def summary_line(self, backend: str) -> str:
        for line in self.output.splitlines():
            if line.startswith(f"attnplug conformance {backend}:"):
                return line
        raise AssertionError(f"no summary line for {backend} in:\n{self.output[-3000:]}")


def run_pytest(args: list[str], cwd: Path, site: Path | None = None, report: bool = True,
               timeout: int = 300, quiet: bool = True) -> SuiteRun:
    """``python -m pytest ARGS`` in ``cwd`` (outside this repo's config), wrong backends on sys.path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ATTNPLUG_", "PYTEST_"))}
    if site is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(site)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    path = cwd / "report.json"
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *(["-q"] if quiet else []), *args]
    if report:
        cmd.append(f"--conformance-report={path}")
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    data = json.loads(path.read_text()) if report and path.exists() else None
    return SuiteRun(proc, data)
