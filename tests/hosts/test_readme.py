"""The README's "Serve a transformers model" example is the file CI runs, and it runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import hf_models as models

ROOT = Path(__file__).resolve().parents[2]


def test_readme_shows_the_transformers_example_verbatim():
    example = (ROOT / "examples" / "serve_transformers.py").read_text(encoding="utf-8")
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Serve a transformers model", 1)[1].split("\n## ", 1)[0]
    assert f"```python\n{example}```" in section


CPU = models.cpu_default()


@pytest.mark.parametrize("args,pair,extend_kernel,decode_kernel", [
    ([], f"({CPU!r}, {CPU!r})", CPU, CPU),
    (["--prefill-attention-backend", "template", "--decode-attention-backend", "torch"],
     "('template_sdpa', 'torch_native')", "template_sdpa", "torch_native"),
], ids=["resolved-default", "split-by-alias"])
def test_the_example_serves_with_mixed_forwards_and_matches_transformers(args, pair, extend_kernel, decode_kernel):
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "serve_transformers.py"), *args],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == f"serving pair: {pair}"
    forwards = lines[1].removeprefix("forwards: ").split()
    assert forwards[0] == f"extend:45->{extend_kernel}"  # 5 + 40 prompt tokens, no padding
    assert f"mixed:18->{extend_kernel}" in forwards  # 17 prompt tokens + 1 decode token
    assert f"decode:2->{decode_kernel}" in forwards
    assert lines[2] == "same tokens as transformers: True"
