"""Hostile plugins (issue 9, classes 8-12 and 14): a real installed distribution,
``attnplug-test-hostile`` (tests/dists), misbehaves in the one way ``ATTNPLUG_TEST_HOSTILE``
names; each scenario runs in a fresh interpreter so discovery and the CLI run for real.

In every case only that plugin is set aside, with a message naming its distribution;
the other plugin (``attnplug-test-other``, backend ``fake_triton``) keeps working, and
machine output stays valid JSON.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import run_json

DIST = "attnplug-test-hostile"
BOTH = f"{DIST},attnplug-test-other"


def cli(site, *args, mode="", env=None, timeout=120):
    """Run ``attnplug ARGS`` in a fresh interpreter with the test distributions installed."""
    full = {k: v for k, v in os.environ.items() if not k.startswith("ATTNPLUG_")}
    full["PYTHONPATH"] = os.pathsep.join([str(site)] + ([full["PYTHONPATH"]] if full.get("PYTHONPATH") else []))
    full["ATTNPLUG_PLUGINS"] = BOTH
    full["ATTNPLUG_TEST_HOSTILE"] = mode
    full.update(env or {})
    return subprocess.run([sys.executable, "-m", "attnplug", *args], capture_output=True, text=True,
                          env=full, timeout=timeout)


def record_of(data):
    return next(p for p in data["plugins"] if p["distribution"] == DIST)


def names_of(data):
    return [b["name"] for b in data["backends"]]


def no_traceback(proc):
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "Exception ignored" not in proc.stderr, proc.stderr


def set_aside(site, mode):
    """``attnplug list --json`` with the hostile plugin in ``mode``: exit 0, no traceback, the hostile
    plugin's record failed (set aside). Returns the listing and that record."""
    proc = cli(site, "list", "--json", mode=mode)
    assert proc.returncode == 0, proc.stderr
    no_traceback(proc)
    data = json.loads(proc.stdout)
    rec = record_of(data)
    assert rec["status"] == "failed", rec
    return data, rec


# -- class 8: a plugin can raise anything ---------------------------------------------------
@pytest.mark.parametrize("mode,fragment", [
    ("import_systemexit", "raised SystemExit: 3"),
    ("import_keyboardinterrupt", "raised KeyboardInterrupt"),
    ("hook_systemexit", "hook attnplug_register_backends raised SystemExit: 5"),
])
def test_base_exception_while_loading_sets_the_plugin_aside(test_dists_site, mode, fragment):
    data, rec = set_aside(test_dists_site, mode)
    assert fragment in rec["error"]
    assert "fake_triton" in names_of(data) and "hostile_ok" not in names_of(data)
    text = cli(test_dists_site, "list", mode=mode)
    assert text.returncode == 0 and f"plugin {DIST} 0.3.0 (hostile): failed:" in text.stdout


def test_doctor_survives_a_plugin_exiting_at_import(test_dists_site):
    proc = cli(test_dists_site, "doctor", "--json", "--backend", "fake_triton", mode="import_systemexit")
    no_traceback(proc)
    data = json.loads(proc.stdout)  # not empty output: a full report
    assert any(p["distribution"] == DIST and "SystemExit" in p["error"] for p in data["failed_plugins"])


@pytest.mark.parametrize("mode,fragment", [("factory_systemexit", "SystemExit: 9"),
                                           ("factory_keyboardinterrupt", "KeyboardInterrupt")])
def test_factory_raising_base_exception_is_a_plugin_error(test_dists_site, mode, fragment):
    out = run_json("""
        import json
        from attnplug import AttentionConfig, BuildContext, HostInfo
        from attnplug.registry import Registry
        reg = Registry.discover()
        try:
            reg.build("hostile_ok", BuildContext(config=AttentionConfig(), host=HostInfo()))
            out = ["built"]
        except BaseException as exc:
            out = [type(exc).__name__, str(exc), getattr(exc, "distribution", None)]
        print(json.dumps(out))
    """, site=test_dists_site, env={"ATTNPLUG_PLUGINS": BOTH, "ATTNPLUG_TEST_HOSTILE": mode})
    assert out[0] == "PluginError" and out[2] == DIST
    assert "factory of backend 'hostile_ok' raised" in out[1] and fragment in out[1]
    proc = cli(test_dists_site, "doctor", "--json", "--backend", "hostile_ok", mode=mode)
    no_traceback(proc)
    assert proc.returncode == 1
    backend = json.loads(proc.stdout)["backends"][0]
    assert backend["status"] == "failed" and fragment in backend["error"]


def test_probe_raising_system_exit_makes_the_backend_unavailable(test_dists_site):
    data = json.loads(cli(test_dists_site, "list", "--json", mode="probe_raises_systemexit").stdout)
    entry = next(b for b in data["backends"] if b["name"] == "hostile_ok")
    assert entry["available"] is False and entry["reasons"] == ["availability probe raised SystemExit: 4"]


def test_a_real_ctrl_c_still_stops_the_program(test_dists_site):
    """The rule: a KeyboardInterrupt is the user's when a SIGINT arrived while plugin code
    ran (re-raised: exit 130); one the plugin raises itself is its failure (tests above)."""
    full = {k: v for k, v in os.environ.items() if not k.startswith("ATTNPLUG_")}
    full.update(PYTHONPATH=str(test_dists_site), ATTNPLUG_PLUGINS=BOTH, ATTNPLUG_TEST_HOSTILE="import_sleep")
    proc = subprocess.Popen([sys.executable, "-m", "attnplug", "list"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=full)
    try:
        assert proc.stderr.readline().strip() == "hostile: ready"  # the plugin is sleeping at import
        proc.send_signal(signal.SIGINT)
        start = time.monotonic()
        rc = proc.wait(timeout=30)
        err = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rc == 130, err
    assert "interrupted" in err and "Traceback" not in err
    assert time.monotonic() - start < 30  # it stopped instead of sleeping on


# -- class 9: plugin output never corrupts --json ---------------------------------------------
@pytest.mark.parametrize("mode,text", [("import_print", "hello from a plugin at import"),
                                       ("hook_print", "hello from a register hook")])
def test_plugin_stdout_while_loading_is_kept_out_of_json_and_reported(test_dists_site, mode, text):
    for args in (["list", "--json"], ["resolve", "--json"]):
        proc = cli(test_dists_site, *args, mode=mode)
        no_traceback(proc)
        data = json.loads(proc.stdout)  # the whole stdout is one JSON document, nothing printed before it
        assert proc.stdout.startswith("{")
        if args[0] == "list":
            assert record_of(data)["output"].strip() == text
            assert any(DIST in p and text in p for p in data["problems"])
    human = cli(test_dists_site, "list", mode=mode).stdout
    assert f"note: plugin distribution '{DIST}' wrote to stdout" in human


def test_plugin_stdout_during_resolution_goes_to_stderr(test_dists_site):
    proc = cli(test_dists_site, "resolve", "--json", "--attention-backend", "fake_triton", mode="check_config_print")
    data = json.loads(proc.stdout)
    assert data["ok"] is True
    assert "chatter from check_config" in proc.stderr and DIST in proc.stderr


# -- class 10: descriptor and hook values are validated where they enter, with types ---------
@pytest.mark.parametrize("mode,fragments", [
    ("priority_str", ["field \"priority['cpu']\"", "expected an int or None", "'high'"]),
    ("priority_raises", ["priority function of backend 'hostile_ok' raised ZeroDivisionError"]),
    ("priority_fn_str", ["field 'priority'", "expected an int or None", "'high'"]),
    ("caps_dict", ["field 'capabilities'", "expected an attnplug.Capabilities", "dict"]),
    ("caps_bool_str", ["field 'capabilities.sliding_window'", "expected a bool", "'yes'"]),
    ("probe_str", ["field 'probe'", "expected a list of reason strings", "'needs'"]),
    ("aliases_str", ["field 'aliases'", "expected a tuple of non-empty str names", "'xyz'"]),
])
def test_malformed_values_set_that_plugin_aside_naming_field_and_type(test_dists_site, mode, fragments):
    data, rec = set_aside(test_dists_site, mode)
    for fragment in fragments:
        assert fragment in rec["error"], (fragment, rec["error"])
    assert "hostile_ok" not in names_of(data) and "fake_triton" in names_of(data)
    assert not {"x", "y", "z"} & set(names_of(data))
    # every other command keeps working; asking for the set-aside backend says why, naming it
    res = cli(test_dists_site, "resolve", "--attention-backend", "hostile_ok", mode=mode)
    no_traceback(res)
    assert res.returncode == 1 and DIST in res.stdout and fragments[0] in res.stdout
    assert cli(test_dists_site, "resolve", "--attention-backend", "fake_triton", mode=mode).returncode == 0


def test_check_config_returning_a_string_is_one_error_naming_the_plugin(test_dists_site):
    """Never one problem per character; and (issue 26, item 13) the plugin is set aside, resolution
    goes on for everyone else."""
    proc = cli(test_dists_site, "resolve", "--json", "--attention-backend", "fake_triton", mode="check_config_str")
    no_traceback(proc)
    data = json.loads(proc.stdout)
    assert data["ok"] is True and data["pair"] == {"prefill": "fake_triton", "decode": "fake_triton"}
    why = data["set_aside"][DIST]
    assert "hook attnplug_check_config returned 'this is one problem" in why
    assert "expected a list of str or None" in why
    assert "t;" not in why


# -- class 11: a factory cannot claim a name it does not own ------------------------------------
BUILD = """
    import json
    from attnplug import AttentionConfig, BuildContext, HostInfo
    from attnplug.registry import Registry
    reg = Registry.discover()
    try:
        eff, b = reg.build("hostile_ok", BuildContext(config=AttentionConfig(), host=HostInfo()))
        out = ["ok", eff, b.prefill_attention_backend_str]
    except Exception as exc:
        out = [type(exc).__name__, str(exc), getattr(exc, "distribution", None)]
    print(json.dumps(out))
"""


def test_factory_answering_another_distributions_name_is_refused(test_dists_site):
    out = run_json(BUILD, site=test_dists_site, env={"ATTNPLUG_PLUGINS": BOTH, "ATTNPLUG_TEST_HOSTILE": "claims_other"})
    assert out[0] == "PluginError" and out[2] == DIST
    assert "'fake_triton', which belongs to distribution 'attnplug-test-other'" in out[1]
    assert "delegates_to" in out[1]


def test_a_declared_delegation_may_answer_another_distributions_name(test_dists_site):
    out = run_json(BUILD, site=test_dists_site, env={"ATTNPLUG_PLUGINS": BOTH, "ATTNPLUG_TEST_HOSTILE": "delegates"})
    assert out == ["ok", "fake_triton", "fake_triton"]


# -- class 12: filtered is not missing ------------------------------------------------------------
def test_a_filtered_plugin_is_named_with_the_filter_not_as_missing(test_dists_site):
    out = run_json(BUILD, site=test_dists_site, env={"ATTNPLUG_PLUGINS": "attnplug-test-other"})
    assert out[0] == "UnknownBackendError"
    assert "Plugins filtered out: " in out[1]
    assert f", {DIST}" in out[1] or f": {DIST}" in out[1]
    assert "(filtered out by ATTNPLUG_PLUGINS='attnplug-test-other' (it is not listed there))" in out[1]
    out = run_json(BUILD, site=test_dists_site, env={"ATTNPLUG_PLUGINS": BOTH, "ATTNPLUG_DISABLE_PLUGINS": "hostile"})
    assert f"{DIST} (filtered out by ATTNPLUG_DISABLE_PLUGINS='hostile' (it is listed there))" in out[1]
    assert out[1].count("(filtered out by ATTNPLUG_PLUGINS=") == 1  # grouped: one mention per variable


def test_a_backend_whose_plugin_is_filtered_says_which_filter(test_dists_site):
    # the shipped plugins' entry points are named after their backend: torch_native is installed
    # in this environment, filtered out here
    proc = cli(test_dists_site, "resolve", "--attention-backend", "torch_native")
    assert proc.returncode == 2  # the user's own filter removed it: a user error (issue 26: it was 1)
    assert ("unknown attention backend 'torch_native': backend 'torch_native' comes from plugin "
            "'attnplug-torch-native' (torch_native), which was filtered out by ATTNPLUG_PLUGINS=") in proc.stdout


@pytest.mark.parametrize("command", ["list", "doctor"])
def test_everything_filtered_or_failed_does_not_say_install(test_dists_site, command):
    proc = cli(test_dists_site, command, mode="import_systemexit", env={"ATTNPLUG_PLUGINS": DIST})
    no_traceback(proc)
    assert "pip install" not in proc.stdout
    assert f"no backends loaded: {DIST} (import of 'attnplug_test_hostile' raised SystemExit: 3); " in proc.stdout
    assert "attnplug-torch-native" in proc.stdout and "(filtered out by ATTNPLUG_PLUGINS=" in proc.stdout


@pytest.mark.parametrize("value", [",", " , ", ",,"])
@pytest.mark.parametrize("var", ["ATTNPLUG_PLUGINS", "ATTNPLUG_DISABLE_PLUGINS"])
def test_a_plugin_list_naming_nothing_is_an_error(test_dists_site, var, value):
    proc = cli(test_dists_site, "list", "--json", env={var: value})
    assert proc.returncode == 2 and proc.stdout == ""
    no_traceback(proc)
    assert proc.stderr.strip() == (f"attnplug list: error: {var}={value!r} names no plugin; give comma-separated "
                                   f"distribution or entry-point names (e.g. {var}=attnplug-torch-native), or unset "
                                   f"it to load every installed plugin")


def test_an_empty_plugin_list_means_no_filter(test_dists_site):
    data = json.loads(cli(test_dists_site, "list", "--json", env={"ATTNPLUG_PLUGINS": ""}).stdout)
    assert record_of(data)["status"] == "loaded"


# -- class 14: discovery happens once per process, also under threads --------------------------
def test_default_registry_discovers_once_under_eight_threads(test_dists_site):
    out = run_json("""
        import json, threading
        from attnplug.registry import default_registry
        import attnplug_test_hostile as hostile
        barrier = threading.Barrier(8)
        got = []
        def worker():
            barrier.wait()
            got.append(default_registry())
        threads = [threading.Thread(target=worker) for _ in range(8)]
        for t in threads: t.start()
        for t in threads: t.join()
        print(json.dumps({"registries": len({id(r) for r in got}), "threads": len(got),
                          "hook_calls": hostile.CALLS["attnplug_register_backends"],
                          "has_backend": "hostile_ok" in got[0].names()}))
    """, site=test_dists_site, env={"ATTNPLUG_PLUGINS": DIST, "ATTNPLUG_TEST_HOSTILE": "count"})
    assert out == {"registries": 1, "threads": 8, "hook_calls": 1, "has_backend": True}
