"""Docs that cannot drift: README commands, the example it shows, the module map."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from attnplug.cli.main import SUBCOMMANDS

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def test_ci_runs_exactly_the_readme_test_command():
    commands = re.findall(r"```sh\n(.*?)\n```", README)
    assert len(commands) == 2 and commands[1].endswith("tox run-parallel -e tests,vllm -p 2 --parallel-live")
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert commands[1] in ci


def test_readme_lists_every_subcommand_and_no_other():
    rows = set(re.findall(r"^\| `attnplug (\w+)", README, flags=re.M))
    assert rows == set(SUBCOMMANDS)


def test_readme_shows_the_host_engine_example_verbatim_and_it_runs():
    example = (ROOT / "examples" / "host_engine.py").read_text(encoding="utf-8")
    assert example in README
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "host_engine.py"),
                           "--attention-backend", "torch"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "resolved pair: ('torch_native', 'torch_native')" in proc.stdout  # the alias resolved
    assert "decode: out (2, 8, 64) served by torch_native" in proc.stdout


def test_readme_doctor_table_header_matches_the_command():
    proc = subprocess.run([sys.executable, "-m", "attnplug", "doctor"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    header = next(line for line in proc.stdout.splitlines() if line.startswith("backend "))
    shown = next(line for line in README.splitlines() if line.startswith("backend ") and "distribution" in line)
    assert header.split() == shown.split()


def test_design_map_names_every_core_module():
    design = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    core = ROOT / "core" / "attnplug"
    missing = []
    for path in sorted(core.rglob("*.py")):
        rel = path.relative_to(core).as_posix()
        if path.name == "__init__.py" and rel != "__init__.py":
            continue
        if rel.startswith("testing/suite/") or rel == "__main__.py":
            continue  # the suite's case modules are covered by its row
        if f"`{rel}`" not in design and f"`{path.name}`" not in design:
            missing.append(rel)
    assert missing == []
