"""Slow tier: the template backend as a third party ships it.

Builds the core wheel and the template's wheel, installs them with torch and
pytest into a fresh virtual environment (no system site packages), and runs
``python -m pytest --backend=template_sdpa`` from a folder outside this repo:
the conformance suite ships inside the core and finds the backend through its
entry point alone.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import _flow

ROOT = Path(__file__).resolve().parents[2]
CONSTRAINTS = ROOT / "constraints.txt"
TEMPLATE = ROOT / "contrib_backends" / "template"
_IGNORE = shutil.ignore_patterns("build", "dist", "*.egg-info", "__pycache__", ".pytest_cache")


#: a command or a wheel build may take this long (seconds)
TIMEOUT = 900
_run = functools.partial(_flow.run, timeout=TIMEOUT)
_wheel = functools.partial(_flow.wheel, timeout=TIMEOUT)


@pytest.mark.slow
def test_template_backend_passes_the_suite_from_a_fresh_venv(tmp_path: Path) -> None:
    core_src = tmp_path / "core_src"
    core_src.mkdir()
    shutil.copy(ROOT / "pyproject.toml", core_src)
    shutil.copytree(ROOT / "core", core_src / "core", ignore=_IGNORE)
    readme = ROOT / "README.md"
    if readme.exists():
        shutil.copy(readme, core_src)
    else:
        (core_src / "README.md").write_text("attnplug\n")
    template_src = tmp_path / "template_src"
    shutil.copytree(TEMPLATE, template_src, ignore=_IGNORE)
    wheels = tmp_path / "wheels"
    core_whl, template_whl = _wheel(core_src, wheels), _wheel(template_src, wheels)

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], cwd=tmp_path)  # no system site packages
    py = venv / "bin" / "python"
    _run([str(py), "-m", "pip", "install", "-q", "-c", str(CONSTRAINTS), "torch==2.13.0", "pytest", "hypothesis",
          str(core_whl), str(template_whl)], cwd=tmp_path)

    # a folder that is no part of any project: only the installed distributions are visible
    work = tmp_path / "third_party_checkout"
    work.mkdir()
    proc = subprocess.run([str(py), "-m", "pytest", "--backend=template_sdpa", "-p", "no:cacheprovider", "-q",
                           "-rs", "--conformance-report=report.json"], cwd=work, capture_output=True, text=True,
                          timeout=900, env={k: v for k, v in os.environ.items()
                                            if not k.startswith(("ATTNPLUG_", "PYTEST_", "PYTHONPATH"))})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    line = next((ln for ln in out.splitlines() if ln.startswith("attnplug conformance template_sdpa:")), None)
    assert line is not None, out[-4000:]
    m = re.match(r"attnplug conformance template_sdpa: (\d+) passed, (\d+) skipped by capability, "
                 r"(?:\d+ skipped \(other\), )?0 failed "
                 r"\(numeric cases: (\d+)\)", line)
    assert m and int(m.group(1)) > 300 and int(m.group(3)) > 250, line
    # the suite came from the venv's installed core, not from this checkout
    assert "site-packages/attnplug/testing/suite/" in out and str(ROOT) not in out
    assert (work / "report.json").exists()
