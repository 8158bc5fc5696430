"""scripts/side_by_side.py: the CI's way to run the conformance suite beside the other tiers in one environment."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "side_by_side.py"


def _run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60, cwd=cwd)


def test_every_stream_runs_to_its_end_and_the_first_failure_is_the_status():
    """Both streams run (the failing one does not stop the other, which prints after it failed); each line is
    prefixed with its stream's name; the status is the first failing stream's, in the order given."""
    proc = _run("a=echo one && sleep 0.5 && echo two", "b=echo bad && exit 3", "c=exit 5")
    lines = proc.stdout.splitlines()
    assert proc.returncode == 3
    assert "[a] one" in lines and "[a] two" in lines and "[b] bad" in lines
    assert lines.index("[a] two") > lines.index("[b] bad")  # a kept running after b failed
    assert "side_by_side: a exited 0" in proc.stdout and "side_by_side: b exited 3" in proc.stdout
    assert "side_by_side: c exited 5" in proc.stdout
    assert _run("a=true", "b=true").returncode == 0


def test_the_streams_run_at_the_same_time(tmp_path):
    """Two streams that each wait for the other's file: they finish only when run side by side."""
    proc = _run("a=touch a.flag && for i in $(seq 50); do [ -e b.flag ] && exit 0; sleep 0.1; done; exit 9",
                "b=touch b.flag && for i in $(seq 50); do [ -e a.flag ] && exit 0; sleep 0.1; done; exit 9",
                cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout


@pytest.mark.parametrize("args", [(), ("noequals",), ("=cmd",), ("a=",), ("a b=cmd",), ("a=x", "a=y")])
def test_bad_arguments_are_a_usage_error_naming_what_to_give(args):
    proc = _run(*args)
    assert proc.returncode != 0 and "side_by_side.py:" in proc.stderr
