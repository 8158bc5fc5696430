"""A built backend's code misbehaving inside ``doctor``, ``bench`` and the conformance suite (issue 26,
items 11 and 12): ``runtime_notes()``, ``init_forward_metadata`` or ``forward`` raise ``SystemExit`` /
``KeyboardInterrupt`` / ``GeneratorExit`` (raised by code, not a real Ctrl-C), print, or notes come back
as a string or another wrong type. The hostile test distribution (tests/dists/attnplug-test-hostile,
``kernel.py``) does each as ``ATTNPLUG_TEST_HOSTILE`` says; every scenario runs the real command in a
fresh interpreter and asserts a clean exit status (no signal, not 130, not the plugin's code), one
valid JSON document on stdout, the plugin named by distribution, and the other backends still checked.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

DIST = "attnplug-test-hostile"
WHO = f"plugin distribution '{DIST}'"
WITH_TORCH_NATIVE = f"{DIST},attnplug-test-other,attnplug-torch-native"


def run(site, *args, mode="", plugins=f"{DIST},attnplug-test-other", module="attnplug", timeout=600):
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATTNPLUG_")}
    env["PYTHONPATH"] = os.pathsep.join([str(site)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.update(ATTNPLUG_PLUGINS=plugins, ATTNPLUG_TEST_HOSTILE=mode)
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, env=env,
                          timeout=timeout)


def clean(proc, *allowed):
    assert proc.returncode in allowed, (proc.returncode, proc.stdout[-1500:], proc.stderr[-1500:])
    assert "Traceback" not in proc.stderr and "internal error" not in proc.stderr, proc.stderr[-2000:]
    assert "interrupted" not in proc.stderr


def doctor(site, mode):
    proc = run(site, "doctor", "--json", mode=mode)
    clean(proc, 0, 1)
    assert proc.stdout.startswith("{")
    data = json.loads(proc.stdout)  # the whole stdout is one JSON document
    backends = {b["name"]: b for b in data["backends"]}
    assert set(backends) == {"hostile_ok", "fake_triton"}, "doctor stopped before checking every backend"
    assert backends["fake_triton"]["modes"], "the other backend was not checked"
    return backends["hostile_ok"], proc


# -- item 11: SystemExit / KeyboardInterrupt from runtime_notes() -------------------------------------
NOTE_FAULTS = {
    "notes_systemexit": f"{WHO}: runtime_notes() raised SystemExit: 7",
    "notes_keyboardinterrupt": f"{WHO}: runtime_notes() raised KeyboardInterrupt",
    # item 12: a wrong type is one reported fault, never one note per character
    "notes_str": f"{WHO}: runtime_notes() returned 'fused kernel taken' (str); expected a list of str",
    "notes_int": f"{WHO}: runtime_notes() returned 42 (int); expected a list of str",
    "notes_items": f"{WHO}: runtime_notes() returned ['a note', 3] (list); expected a list of str",
}


@pytest.mark.parametrize("mode", sorted(NOTE_FAULTS))
def test_doctor_reports_a_faulty_runtime_notes_and_goes_on(test_dists_site, mode):
    hostile, _ = doctor(test_dists_site, mode)
    assert hostile["notes"] == [NOTE_FAULTS[mode]]
    assert hostile["modes"], "the backend's cases were not checked"


@pytest.mark.parametrize("mode", sorted(NOTE_FAULTS))
def test_bench_reports_a_faulty_runtime_notes_and_goes_on(test_dists_site, mode):
    proc = run(test_dists_site, "bench", "--quick", "--backend", "hostile_ok,torch_native", "--mode", "decode",
               "--context", "32", "--json", "-", mode=mode, plugins=WITH_TORCH_NATIVE)
    clean(proc, 0)
    data = json.loads(proc.stdout)
    assert data["runtime_notes"]["hostile_ok"] == [NOTE_FAULTS[mode]]
    assert {r["name"] for r in data["problems"][0]["rows"]} >= {"hostile_ok", "torch_native"}


# -- item 11: SystemExit / KeyboardInterrupt / GeneratorExit from forward or metadata ------------------------
FORWARD_FAULTS = {
    "forward_systemexit": "raised SystemExit: 8",
    "forward_keyboardinterrupt": "raised KeyboardInterrupt",
    "forward_generatorexit": "raised GeneratorExit: closed",
    "metadata_systemexit": "raised SystemExit: 6",
}


@pytest.mark.parametrize("mode", sorted(FORWARD_FAULTS))
def test_doctor_fails_the_backend_whose_forward_exits_and_goes_on(test_dists_site, mode):
    hostile, proc = doctor(test_dists_site, mode)
    assert proc.returncode == 1 and hostile["status"] == "failed"
    errors = [m["error"] for m in hostile["modes"] if not m["ok"]]  # an idle case never calls forward
    assert errors and all(WHO in e and FORWARD_FAULTS[mode] in e for e in errors), errors[:2]
    assert len(errors) > 1, "doctor stopped at the first case"


@pytest.mark.parametrize("mode", sorted(FORWARD_FAULTS) + ["forward_systemexit_later"])
def test_bench_fails_the_row_whose_forward_exits_and_goes_on(test_dists_site, mode):
    proc = run(test_dists_site, "bench", "--quick", "--backend", "hostile_ok,torch_native", "--mode", "decode",
               "--context", "32,64", "--json", "-", mode=mode, plugins=WITH_TORCH_NATIVE)
    clean(proc, 0)
    data = json.loads(proc.stdout)
    fragment = FORWARD_FAULTS.get(mode, "raised SystemExit: 10")
    assert len(data["problems"]) == 2, "bench stopped before the second problem"
    for problem in data["problems"]:
        names = {r["name"] for r in problem["rows"]}
        assert "torch_native" in names and "hostile_ok" not in names
        assert [n for n in problem["notes"] if n.startswith("hostile_ok: failed (")] == [
            n for n in problem["notes"] if WHO in n and fragment in n], problem["notes"]
        assert any(WHO in n and fragment in n for n in problem["notes"]), problem["notes"]


# -- item 12: plugin stdout never reaches doctor's or bench's JSON --------------------------------------------
@pytest.mark.parametrize("mode,text", [("forward_print", "chatter from forward"),
                                       ("notes_print", "chatter from runtime_notes")])
def test_plugin_stdout_during_checks_stays_out_of_doctor_json(test_dists_site, mode, text):
    hostile, proc = doctor(test_dists_site, mode)
    assert any(DIST in n and "stdout" in n and text in n for n in hostile["notes"]), hostile["notes"]
    human = run(test_dists_site, "doctor", mode=mode)
    clean(human, 0, 1)
    assert not any(line.strip() == text for line in human.stdout.splitlines())


@pytest.mark.parametrize("mode,text", [("forward_print", "chatter from forward"),
                                       ("notes_print", "chatter from runtime_notes")])
def test_plugin_stdout_during_bench_stays_out_of_its_json(test_dists_site, mode, text):
    proc = run(test_dists_site, "bench", "--quick", "--backend", "hostile_ok,torch_native", "--mode", "decode",
               "--context", "32", "--json", "-", mode=mode, plugins=WITH_TORCH_NATIVE)
    clean(proc, 0)
    data = json.loads(proc.stdout)
    everything = json.dumps(data)
    assert text in everything and DIST in everything  # reported, inside the document


# -- item 11: the conformance suite ----------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["forward_systemexit", "forward_keyboardinterrupt", "notes_keyboardinterrupt"])
def test_the_suite_fails_cases_whose_backend_exits_and_goes_on(test_dists_site, tmp_path, mode):
    report = tmp_path / "report.json"
    proc = run(test_dists_site, "-p", "no:cacheprovider", "-q", "--backend=hostile_ok", "-k", "test_mode",
               f"--conformance-report={report}", "--rootdir", str(tmp_path), "-o", "addopts=", module="pytest",
               mode=mode)
    out = proc.stdout + proc.stderr
    assert proc.returncode in (0, 1), out[-3000:]  # 2 would be "interrupted"
    assert "KeyboardInterrupt" not in out.split("short test summary")[0] or "PluginError" in out
    assert "!!!!!!!!!!!!!!!!!!!! KeyboardInterrupt !!!!!!!!!!!!!!!!!!!!" not in out
    if mode.startswith("forward"):
        assert proc.returncode == 1
        assert f"PluginError: {WHO}: backend 'hostile_ok' raised" in out
        data = json.loads(report.read_text())
        failed = [c for c in data["cases"] if c["outcome"] == "failed"]
        assert len(failed) > 1, "the suite stopped at the first case"
