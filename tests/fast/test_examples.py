"""The examples run end to end (each in a fresh interpreter) and exit 0."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def _torch_native_kernel_missing() -> bool:
    try:
        return importlib.util.find_spec("attnplug_torch_native.backend") is None
    except ModuleNotFoundError:
        return True


@pytest.mark.skipif(_torch_native_kernel_missing(), reason="the torch_native kernel module is not installed")
@pytest.mark.parametrize("args", [
    [],
    ["--speculative-attention-mode", "decode", "--page-size", "1",
     "--speculative-draft-attention-backend", "torch", "--num-draft-tokens", "5", "--rounds", "4"],
], ids=["default", "verify-on-decode-half-draft-alias-page1"])
def test_speculative_decode_example(args):
    proc = subprocess.run([sys.executable, str(EXAMPLES / "speculative_decode.py"), *args],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    lines = proc.stdout.splitlines()
    assert lines[0] == "attnplug speculative decoding example"
    assert lines[-1].strip().startswith("OK")
    assert "same greedy tokens: True" in proc.stdout
    assert "target_verify->torch_native" in proc.stdout and "draft_extend->torch_native" in proc.stdout
