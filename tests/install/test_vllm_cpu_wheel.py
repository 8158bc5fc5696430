"""Slow tier: attnplug-vllm-cpu's compiled helper is optional at build time, and its absence is said.

Built without a C++ compiler (``$CXX`` names none), the distribution is a pure-Python wheel that still carries
the helper's source, and the build says it is going without the helper (the backend's ``runtime_notes`` then
names the pure-torch path: tests/plugins/test_vllm_cpu_stage.py). The build with a compiler is what tox's
install of the plugin does (tests/plugins/test_vllm_cpu_stage.py checks the installed package carries it).
"""

from __future__ import annotations

import shutil
import sys
import zipfile
from pathlib import Path

import pytest

import _flow

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_without_a_compiler_the_wheel_is_pure_python_and_the_build_says_so(tmp_path: Path, monkeypatch) -> None:
    src = tmp_path / "vllm_cpu"
    shutil.copytree(ROOT / "plugins" / "vllm_cpu", src,
                    ignore=shutil.ignore_patterns("build", "dist", "*.egg-info", "__pycache__", "_stage*.so"))
    monkeypatch.setenv("CXX", "attnplug-no-such-compiler")
    out = tmp_path / "wheels"
    proc = _flow.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-v", "-w", str(out),
                      str(src)], cwd=src, timeout=600)
    assert "building without the compiled helper" in proc.stdout + proc.stderr
    assert "attnplug-no-such-compiler" in proc.stdout + proc.stderr  # the compiler it looked for, named
    wheels = sorted(out.glob("attnplug_vllm_cpu-*.whl"))
    assert len(wheels) == 1 and wheels[0].name.endswith("-py3-none-any.whl"), wheels
    names = zipfile.ZipFile(wheels[0]).namelist()
    assert "attnplug_vllm_cpu/csrc/stage.cpp" in names and "attnplug_vllm_cpu/stage.py" in names
    assert not [n for n in names if n.endswith(".so")], names
