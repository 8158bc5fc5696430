"""Shared fixtures: real installed test distributions (tests/dists), run in subprocesses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DISTS = ROOT / "tests" / "dists"
CONSTRAINTS = ROOT / "constraints.txt"


@pytest.fixture(scope="session")
def test_dists_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every distribution under tests/dists, pip-installed (for real) into one target folder."""
    site = tmp_path_factory.mktemp("dists-site")
    dists = sorted(str(p) for p in DISTS.iterdir() if (p / "pyproject.toml").exists())
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
           "--disable-pip-version-check", "-c", str(CONSTRAINTS), "--target", str(site), *dists]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"installing tests/dists failed:\n{proc.stdout}\n{proc.stderr}")
    return site


def run_python(code: str, *, site: Path | None = None, env: dict[str, str] | None = None,
               extra_paths: tuple[Path, ...] = ()) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter with the test distributions on sys.path."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("ATTNPLUG_")}
    paths = [str(p) for p in extra_paths] + ([str(site)] if site else [])
    if full_env.get("PYTHONPATH"):
        paths.append(full_env["PYTHONPATH"])
    full_env["PYTHONPATH"] = os.pathsep.join(paths)
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=full_env, timeout=120)


def run_json(code: str, **kw) -> object:
    """Run ``code`` (which prints one JSON document last) and return it; fail with stderr."""
    proc = run_python(code, **kw)
    if proc.returncode:
        pytest.fail(f"subprocess failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])
