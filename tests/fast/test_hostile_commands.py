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


# -- item 14: doctor on a plain install, without pytest ---------------------------------------------------------
BLOCK_PYTEST = r'''
import sys
class NoPytest:
    """A plain install: pytest (and _pytest) cannot be imported."""
    def find_spec(self, name, path=None, target=None):
        if name in ("pytest", "_pytest") or name.startswith(("pytest.", "_pytest.")):
            raise ImportError(f"No module named {name!r}")
        return None
sys.meta_path.insert(0, NoPytest())
from attnplug.cli.main import main
sys.exit(main(sys.argv[1:]))
'''


@pytest.mark.parametrize("args", [["--backend", "torch_native"], ["--json", "--backend", "torch_native",
                                                                  "--backend", "template_sdpa"]])
def test_doctor_needs_no_pytest(args):
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATTNPLUG_")}
    proc = subprocess.run([sys.executable, "-c", BLOCK_PYTEST, "doctor", *args], capture_output=True, text=True,
                          env=env, timeout=600)
    clean(proc, 0)
    assert "pytest" not in proc.stdout and "pytest" not in proc.stderr
    if "--json" in args:
        data = json.loads(proc.stdout)
        assert data["ok"] and [b["status"] for b in data["backends"]] == ["ok", "ok"]
    else:
        assert proc.stdout.rstrip().endswith("doctor: all checks passed")


# -- item 15: a name conflict removed the backends: doctor says so, and fails when none usable remains -----------
def test_doctor_under_a_name_conflict_that_leaves_nothing_says_so_and_fails(test_dists_site):
    plugins = f"{DIST},attnplug-torch-native"
    proc = run(test_dists_site, "doctor", mode="conflict_torch_native", plugins=plugins)
    clean(proc, 1)
    assert ("backend name 'torch_native' is registered by two distributions: 'attnplug-test-hostile' and "
            "'attnplug-torch-native'") in proc.stdout
    assert "default pair: none: name conflicts removed 'torch_native'" in proc.stdout
    assert "no installed backend declares a default priority" not in proc.stdout
    assert proc.stdout.rstrip().splitlines()[-1] == (
        "doctor: FAILED: no usable backend: name conflicts removed 'torch_native'; uninstall one distribution of "
        "each, or filter one with ATTNPLUG_DISABLE_PLUGINS")
    data = json.loads(run(test_dists_site, "doctor", "--json", mode="conflict_torch_native", plugins=plugins).stdout)
    assert data["ok"] is False and data["backends"] == [] and "torch_native" in data["no_usable_backend"]
    assert "name conflicts removed 'torch_native'" in data["default_pair"]["explanation"]


def test_doctor_under_a_name_conflict_with_a_usable_backend_left_says_so_and_passes(test_dists_site):
    plugins = f"{DIST},attnplug-torch-native,attnplug-template-backend"
    proc = run(test_dists_site, "doctor", "--json", mode="conflict_torch_native", plugins=plugins)
    data = json.loads(proc.stdout)
    assert [b["name"] for b in data["backends"]] == ["template_sdpa"] and data["backends"][0]["status"] == "ok"
    assert data["no_usable_backend"] is None
    if not data["default_pair"]["ok"]:
        assert "name conflicts removed 'torch_native'" in data["default_pair"]["explanation"]
    clean(proc, 0)


# -- item 13: a malformed resolution-hook result sets that plugin aside; resolution goes on --------------------
HOOK_FAULTS = {
    "check_config_str": "hook attnplug_check_config returned 'this is one problem, not one per character' (str); "
                        "expected a list of str or None",
    "check_config_dict": "hook attnplug_check_config returned {'problem': 'x'} (dict); expected a list of str or None",
    "check_config_systemexit": "hook attnplug_check_config raised SystemExit: 13",
    "rule_bad_stage": "resolution rule 'hostile_rule': stage='sideways' (expected one of ('force', 'fallback'))",
    "rule_returns_str": "resolution rule 'hostile_rule' returned 'attention_backend=hostile_ok'; it must return a "
                        "dict of fields",
    "rule_unknown_field": "force_rules rule 'hostile_rule' declared unknown field 'no_such_field'",
    "override_list": "resolution rule 'HostileForCausalLM: as_a_list' returned ['attention_backend', 'hostile_ok']; "
                     "it must return a dict of fields",
    "override_raises": "resolution rule 'HostileForCausalLM: exits' raised SystemExit: 12",
    "override_arch_int": "attnplug_arch_overrides: arch must be a name or names, got 7",
}


@pytest.mark.parametrize("mode", sorted(HOOK_FAULTS))
def test_a_malformed_resolution_hook_sets_its_plugin_aside_and_resolution_goes_on(test_dists_site, mode):
    arch = ["--arch", "HostileForCausalLM"] if mode.startswith("override") else []
    args = ["resolve", "--json", *arch]
    for extra in ([], ["--attention-backend", "fake_triton"]):
        proc = run(test_dists_site, *args, *extra, mode=mode)
        clean(proc, 0)
        data = json.loads(proc.stdout)
        assert data["ok"] is True and data["pair"] == {"prefill": "fake_triton", "decode": "fake_triton"}, data["error"]
        assert list(data["set_aside"]) == [DIST] and HOOK_FAULTS[mode] in data["set_aside"][DIST]
    text = run(test_dists_site, *[a for a in args if a != "--json"], mode=mode)
    clean(text, 0)
    assert f"plugin {DIST} set aside (its resolution hook broke the contract; resolved without it): " in text.stdout
    # asking for the set-aside plugin's backend by name: a plugin fault (1), naming it
    named = run(test_dists_site, "resolve", *arch, "--attention-backend", "hostile_ok", mode=mode)
    clean(named, 1)
    assert f"belongs to plugin '{DIST}', which was set aside" in named.stdout


@pytest.mark.parametrize("mode", sorted(HOOK_FAULTS))
def test_list_shows_a_plugin_with_a_malformed_resolution_hook_set_aside(test_dists_site, mode):
    proc = run(test_dists_site, "list", "--json", mode=mode)
    clean(proc, 0)
    data = json.loads(proc.stdout)
    record = next(p for p in data["plugins"] if p["distribution"] == DIST)
    assert record["status"] == "failed" and HOOK_FAULTS[mode] in record["error"], record
    assert [b["name"] for b in data["backends"]] == ["fake_triton"]
    human = run(test_dists_site, "list", mode=mode)
    assert f"plugin {DIST} 0.3.0 (hostile): failed: " in human.stdout


def test_a_well_behaved_plugin_is_not_set_aside_by_list(test_dists_site):
    data = json.loads(run(test_dists_site, "list", "--json").stdout)
    assert next(p for p in data["plugins"] if p["distribution"] == DIST)["status"] == "loaded"
    assert [b["name"] for b in data["backends"]] == ["fake_triton", "hostile_ok"]
