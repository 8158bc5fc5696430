"""The pytest plugin itself: light and inert without --backend, name resolution,
usage errors, report header, summary line and JSON report (subprocess runs)."""

from __future__ import annotations

import json
from pathlib import Path

from _suite_runner import run_pytest

PROBE = '''
import json, sys

def pytest_collection_finish(session):
    data = {
        "torch": "torch" in sys.modules,
        "registry": "attnplug.registry" in sys.modules,
        "suite": any(m.startswith("attnplug.testing.suite") for m in sys.modules),
        "attnplug_plugin": session.config.pluginmanager.has_plugin("attnplug"),
        "items": [i.nodeid for i in session.items],
    }
    with open("probe.json", "w") as fh:
        json.dump(data, fh)
'''


def test_without_backend_nothing_is_collected_and_nothing_heavy_imported(tmp_path: Path) -> None:
    (tmp_path / "probe_plugin.py").write_text(PROBE)
    (tmp_path / "test_other_project.py").write_text("def test_ok():\n    assert 1 + 1 == 2\n")
    run = run_pytest(["-p", "probe_plugin", "--co"], tmp_path, site=tmp_path, report=False)
    assert run.proc.returncode == 0, run.output
    probe = json.loads((tmp_path / "probe.json").read_text())
    assert probe["attnplug_plugin"] is True  # autoloaded through pytest11 ...
    assert probe["torch"] is False  # ... and cheap: no torch,
    assert probe["registry"] is False  # no plugin discovery,
    assert probe["suite"] is False  # no suite module
    assert probe["items"] == ["test_other_project.py::test_ok"]
    assert "attnplug conformance" not in run.output
    # another project's plain run is unaffected
    plain = run_pytest([], tmp_path, report=False)
    assert plain.proc.returncode == 0 and "1 passed" in plain.output, plain.output


def test_empty_directory_collects_nothing(tmp_path: Path) -> None:
    run = run_pytest(["--co"], tmp_path, report=False)
    assert run.proc.returncode == 5, run.output  # "no tests collected"
    assert "suite" not in run.output


def test_help_lists_the_options_in_their_own_group(tmp_path: Path) -> None:
    run = run_pytest(["--help"], tmp_path, report=False)
    assert run.proc.returncode == 0
    assert "attnplug conformance suite" in run.output
    assert "--backend=NAME" in run.output and "--conformance-report=PATH" in run.output


def test_disabled_with_p_no_attnplug(tmp_path: Path) -> None:
    run = run_pytest(["-p", "no:attnplug", "--backend=torch_native"], tmp_path, report=False)
    assert run.proc.returncode == 4  # argparse: unrecognized argument
    assert "unrecognized arguments: --backend" in run.output


def test_unknown_backend_is_a_usage_error_listing_what_is_installed(wrong_site: Path, tmp_path: Path) -> None:
    run = run_pytest(["--backend=no_such_backend"], tmp_path, wrong_site, report=False)
    assert run.proc.returncode == 4, run.output
    assert "unknown attention backend 'no_such_backend'" in run.output
    assert "torch_native" in run.output and "conf_reference" in run.output  # installed, available
    # registered but unavailable, with the reason
    assert "conf_unavailable (ModuleNotFoundError: No module named 'imaginary_kernels')" in run.output


def test_unavailable_backend_is_a_usage_error_with_the_reason(wrong_site: Path, tmp_path: Path) -> None:
    run = run_pytest(["--backend=conf_unavailable"], tmp_path, wrong_site, report=False)
    assert run.proc.returncode == 4, run.output
    assert "unavailable on this host" in run.output and "imaginary_kernels" in run.output


def test_alias_resolves_to_canonical_name(wrong_site: Path, tmp_path: Path) -> None:
    run = run_pytest(["--backend=confalias_reference", "-k", "test_effective_name or test_aliases"],
                     tmp_path, wrong_site, quiet=False)
    assert run.proc.returncode == 0, run.output[-3000:]
    assert "attnplug conformance: backend conf_reference (requested as 'confalias_reference'), " \
           "distribution attnplug-conformance-wrong 0.1.0, host " in run.output
    assert run.summary_line("conf_reference").startswith("attnplug conformance conf_reference: 2 passed")
    assert run.report is not None and run.report["backend"] == "conf_reference"


def test_repeated_and_all_backends_are_parametrized_separately(wrong_site: Path, tmp_path: Path) -> None:
    run = run_pytest(["--backend=conf_reference", "--backend=conf_no_scale", "--backend=conf_reference",
                      "--co", "-k", "test_mode"], tmp_path, wrong_site, report=False)
    assert run.proc.returncode == 0, run.output[-3000:]
    assert "test_mode[conf_reference-decode-float32-ps16]" in run.output
    assert "test_mode[conf_no_scale-decode-float32-ps16]" in run.output
    every = run_pytest(["--backend=all", "--co", "-k", "test_effective_name"], tmp_path, wrong_site, report=False,
                       quiet=False)
    assert every.proc.returncode == 0, every.output[-3000:]
    for name in ("torch_native", "conf_reference", "conf_no_window"):
        assert f"test_effective_name_and_stamps[{name}]" in every.output
    assert "conf_unavailable: unavailable on this host" in every.output


def test_report_and_summary(wrong_site: Path, tmp_path: Path) -> None:
    run = run_pytest(["--backend=conf_no_scale", "-k", "test_mode and float32 and ps16 or test_refusal"],
                     tmp_path, wrong_site)
    assert run.proc.returncode == 1
    r = run.report
    assert r is not None
    assert r["backend"] == "conf_no_scale" and r["distribution"] == "attnplug-conformance-wrong"
    assert r["version"] == "0.1.0" and r["host"]["platform"] in ("cpu", "cuda", "rocm", "xpu", "npu")
    by_id = {c["id"]: c for c in r["cases"]}
    bad = by_id["test_mode[conf_no_scale-decode-float32-ps16]"]
    assert bad["outcome"] == "failed" and bad["numeric"] is True
    assert bad["max_abs_err"] > bad["tolerance"]["atol"] == 1e-4
    idle = by_id["test_mode[conf_no_scale-idle-float32-ps16]"]
    assert idle["outcome"] == "passed" and idle["max_abs_err"] == 0.0
    cuda = [c for c in r["cases"] if c["family"] == "refusal"]
    assert cuda and all(c["outcome"] == "passed" for c in cuda)  # float64 is not claimed and is refused
    s = r["summary"]
    line = run.summary_line("conf_no_scale")
    assert line == (f"attnplug conformance conf_no_scale: {s['passed']} passed, {s['skipped_by_capability']} "
                    f"skipped by capability, {s['failed']} failed (numeric cases: {s['numeric']})")
    assert s["failed"] == 11 and s["numeric"] == 12  # every mode at ps16; idle cannot show the bug


def test_suite_is_collected_whatever_the_projects_collection_settings(tmp_path: Path) -> None:
    (tmp_path / "pytest.ini").write_text("[pytest]\npython_files = check_*.py\npython_functions = check_*\n")
    run = run_pytest(["--backend=torch_native", "--import-mode=importlib", "-k", "test_effective or test_aliases"],
                     tmp_path, report=False)
    assert run.proc.returncode == 0, run.output[-3000:]
    assert run.summary_line("torch_native").startswith("attnplug conformance torch_native: 2 passed")
