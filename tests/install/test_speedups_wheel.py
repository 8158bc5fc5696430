"""Slow tier: attnplug-speedups needs a C++ compiler at build time, and says so by name when there is none.

The build with a compiler is what tox's install of ``speedups/`` does; tests/fast/test_speedups.py then imports
the installed package (``ATTNPLUG_REQUIRE_SPEEDUPS=1``: its absence fails there) and checks what it answers.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

import _flow

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_without_a_compiler_the_build_stops_naming_the_compiler_and_that_attnplug_runs_without_it(
        tmp_path: Path, monkeypatch) -> None:
    src = tmp_path / "speedups"
    shutil.copytree(ROOT / "speedups", src,
                    ignore=shutil.ignore_patterns("build", "dist", "*.egg-info", "__pycache__", "_C*.so"))
    monkeypatch.setenv("CXX", "attnplug-no-such-compiler")
    out = tmp_path / "wheels"
    proc = _flow.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-v", "-w", str(out),
                      str(src)], cwd=src, timeout=600, check=False)
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "attnplug-speedups: no C++ compiler found: 'attnplug-no-such-compiler' is not on PATH" in text
    assert "leave this optional package out (attnplug runs without it)" in text
    assert not list(out.glob("*.whl"))
