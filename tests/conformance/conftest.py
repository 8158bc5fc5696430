"""Helpers for testing the conformance suite itself: a test-only distribution of
deliberately wrong backends, made importable through a real dist-info on a
temp folder, and the suite run in a fresh ``python -m pytest`` subprocess."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
PKG = HERE / "wrong_backends_pkg" / "attnplug_conformance_wrong"

_ENTRY_POINTS = "[attnplug.backends]\nconf_wrong = attnplug_conformance_wrong\n"
_METADATA = "Metadata-Version: 2.1\nName: attnplug-conformance-wrong\nVersion: 0.1.0\n"


@pytest.fixture(scope="session")
def wrong_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding the wrong-backends package and its dist-info (entry point included)."""
    site = tmp_path_factory.mktemp("wrong-site")
    shutil.copytree(PKG, site / PKG.name, ignore=shutil.ignore_patterns("__pycache__"))
    info = site / "attnplug_conformance_wrong-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(_METADATA)
    (info / "entry_points.txt").write_text(_ENTRY_POINTS)
    (info / "top_level.txt").write_text("attnplug_conformance_wrong\n")
    return site


OUTSIDE = HERE / "outside_backend"


@pytest.fixture(scope="session")
def outside_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``tests/conformance/outside_backend`` pip-installed (for real) into a folder: the outside
    distribution ``attnplug-test-outside`` with backends ``outside_v01`` and ``outside_paged``."""
    import subprocess
    import sys

    site = tmp_path_factory.mktemp("outside-site")
    build = tmp_path_factory.mktemp("outside-src")
    src = build / OUTSIDE.name
    shutil.copytree(OUTSIDE, src, ignore=shutil.ignore_patterns("__pycache__", "build", "*.egg-info"))
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
           "--disable-pip-version-check", "--target", str(site), str(src)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"installing {OUTSIDE} failed:\n{proc.stdout}\n{proc.stderr}")
    return site
