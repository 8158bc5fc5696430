"""What the slow install-flow tests share: running a build/install command in a clean environment
(a failure shows its output) and building one wheel from a copied source folder."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest


def run(cmd: list[str], cwd: Path, timeout: int, check: bool = True) -> subprocess.CompletedProcess[str]:
    """``cmd`` without this session's attnplug/pytest/venv variables; a non-zero exit fails the test with its output
    (``check=False``: returned, for a test of a command that must fail)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("ATTNPLUG_", "PYTEST_", "PYTHONPATH", "VIRTUAL_ENV"))}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode and check:
        pytest.fail(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


def wheel(src: Path, out: Path, timeout: int) -> Path:
    """Build ``src`` (a copy: no build folders appear in the repo) into one wheel in ``out``."""
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
         str(src)], cwd=src, timeout=timeout)
    name = re.sub(r"[-.]", "_", (src / "pyproject.toml").read_text().split('name = "', 1)[1].split('"', 1)[0])
    wheels = sorted(out.glob(f"{name}-*.whl"))
    assert wheels, f"no wheel for {name} in {out}"
    return wheels[-1]
