"""``attnplug doctor``: build every available backend and check every claimed mode against the
float64 reference. Test plugins: a simple correct torch backend, one that forgets the causal
mask (doctor must exit non-zero), one unavailable here, one whose factory raises."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import types

import pytest

from attnplug import BackendDescriptor, Capabilities, hookimpl
from attnplug.cli import doctor_cmd
from attnplug.registry import PluginSource, Registry, in_process_source
from tests.dists_resolution import doctor_plugins as P

ALL_MODES = ["extend_noprefix", "extend_prefix", "extend_ragged", "extend_single_token", "extend_prefix_midpage",
             "decode", "target_verify", "target_verify_custom_mask", "draft_extend", "draft_extend_v2", "mixed",
             "idle"]


def _modes(backend_report):
    return [m["mode"].split(" ")[0].split(":", 1)[1] for m in backend_report["modes"]
            if m["mode"].startswith("mode:")]


def make_registry(*modules_and_dists, failing: bool = False) -> Registry:
    reg = Registry()
    sources = [in_process_source(m, d) for m, d in modules_and_dists]
    if failing:
        def boom():
            raise ImportError("No module named 'flash_attn_interface'")

        sources.append(PluginSource("broken", "attnplug-broken", "0.0.1", "attnplug_broken", boom))
    reg.load_sources(sources)
    return reg


@pytest.fixture
def use_registry(monkeypatch):
    import attnplug.registry as registry_mod

    def use(reg):
        monkeypatch.setattr(registry_mod, "default_registry", lambda: reg)
        return reg

    return use


def test_correct_backend_passes_every_mode():
    reg = make_registry((P.good_plugin(), "attnplug-simple"))
    report = doctor_cmd.diagnose(reg)
    assert report["ok"] and report["failed"] == []
    (b,) = report["backends"]
    assert b["status"] == "ok" and b["effective_name"] == "simple_torch"
    assert _modes(b) == ALL_MODES
    claims = {m["mode"].split(" ")[0] for m in b["modes"]}
    assert {"heads:gqa4", "heads:mqa", "feature:window5", "feature:softcap", "feature:softcap_window"} <= claims
    assert not any("sinks" in c or "cross" in c for c in claims)  # not claimed: not checked
    assert all(m["ok"] for m in b["modes"])
    assert b["max_error"] < 1e-4
    assert report["default_pair"] == {"prefill": "simple_torch", "decode": "simple_torch", "ok": True,
                                      "error": None, "explanation": None}
    text = doctor_cmd.render(report)
    assert "backend" in text and "claims checked" in text and "max error" in text
    assert "default pair: prefill=simple_torch decode=simple_torch" in text
    assert text.endswith("doctor: all checks passed")


def test_wrong_backend_fails_with_nonzero_exit(use_registry, capsys):
    from attnplug.cli.main import main

    use_registry(make_registry((P.good_plugin(), "attnplug-simple"), (P.wrong_plugin(), "attnplug-wrong")))
    assert main(["doctor"]) == 1
    out = capsys.readouterr().out
    assert "no_causal_mask FAILED [cpu, float32, page_size=16] in mode:extend_noprefix (extend_noprefix): " \
           "output: max abs error" in out
    assert "doctor: FAILED: no_causal_mask" in out
    row = next(line for line in out.splitlines() if line.startswith("no_causal_mask"))
    assert "modes!" in row and "FAILED" in row and "attnplug-wrong" in row


@pytest.mark.parametrize("name", sorted(P.WRONG_CLAIMS))
def test_a_backend_breaking_a_claimed_feature_fails_naming_it(name):
    reg = make_registry((P.wrong_claim_plugin(name), "attnplug-wrong-claim"))
    report = doctor_cmd.diagnose(reg)
    assert report["failed"] == [name] and not report["ok"]
    failing = {m["mode"].split(" ")[0] for m in report["backends"][0]["modes"] if not m["ok"]}
    claim = P.WRONG_CLAIMS[name][1]
    assert failing and all(claim in label for label in failing), failing
    text = doctor_cmd.render(report)
    assert f"{name} FAILED" in text and f"feature:{claim}" in text


def test_decode_only_bug_is_caught_in_decode():
    # the mask only matters when a query sees several keys: decode is right, extend-like modes are wrong
    reg = make_registry((P.wrong_plugin(), "attnplug-wrong"))
    report = doctor_cmd.diagnose(reg)
    modes = {m["mode"].split(" ")[0]: m["ok"] for m in report["backends"][0]["modes"]}
    assert modes["mode:decode"] and modes["mode:idle"]
    assert not modes["mode:extend_noprefix"] and not modes["mode:target_verify"]


def test_unavailable_backend_is_shown_not_failed():
    reg = make_registry((P.good_plugin(), "attnplug-simple"), (P.unavailable_plugin(), "attnplug-gpu"))
    report = doctor_cmd.diagnose(reg)
    assert report["ok"]
    b = next(b for b in report["backends"] if b["name"] == "needs_gpu")
    assert b["available"] is False and b["status"] == "skipped" and "needs a CUDA GPU" in b["reasons"]
    text = doctor_cmd.render(report)
    row = next(line for line in text.splitlines() if line.startswith("needs_gpu"))
    assert "no: needs a cuda device" in row and row.rstrip().endswith("-")
    assert "  needs_gpu unavailable: needs a cuda device; this host is cpu; needs a CUDA GPU" in text


def test_factory_error_fails_naming_the_distribution():
    reg = make_registry((P.good_plugin(), "attnplug-simple"), (P.broken_factory_plugin(), "attnplug-broken-factory"))
    report = doctor_cmd.diagnose(reg)
    assert report["failed"] == ["broken_factory"]
    b = next(b for b in report["backends"] if b["name"] == "broken_factory")
    assert b["error"].startswith("build: PluginError")
    assert "attnplug-broken-factory" in b["error"] and "kernel library failed to initialise" in b["error"]


def test_failed_plugin_load_is_shown_and_strict_makes_it_fatal(use_registry, capsys):
    from attnplug.cli.main import main

    use_registry(make_registry((P.good_plugin(), "attnplug-simple"), failing=True))
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "plugin attnplug-broken 0.0.1 failed to load: import of 'attnplug_broken' raised ImportError" in out
    assert main(["doctor", "--strict"]) == 1


def test_no_volunteer_for_default_is_explained_not_failed(use_registry, capsys):
    """Only a third-party backend chosen by name (no default priority) and a GPU one: doctor
    checks the usable backend and explains the missing default."""
    from attnplug.cli.main import main

    mod = types.ModuleType("by_name_only")

    @hookimpl
    def attnplug_register_backends(register):
        register(BackendDescriptor(name="by_name", factory=lambda ctx: ("by_name", P.SimpleTorchBackend(ctx)),
                                   capabilities=P.CAPS))

    mod.attnplug_register_backends = attnplug_register_backends
    use_registry(make_registry((P.unavailable_plugin(), "attnplug-gpu"), (mod, "attnplug-third-party")))
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "default pair: none: no installed backend declares a default priority for a cpu host; " \
           "choose one by name, e.g. --attention-backend by_name" in out
    assert "doctor: all checks passed" in out


def test_a_default_that_fails_to_resolve_is_a_failure(use_registry, capsys):
    """A backend volunteers as the default here, but resolution fails: that is a failure."""
    from attnplug.cli.main import main

    use_registry(make_registry((P.good_plugin(), "attnplug-simple")))
    import attnplug.resolution as res_mod

    failed = types.SimpleNamespace(pair=(None, None), ok=False, error=RuntimeError("an override raised"))
    real_trace = res_mod.trace
    res_mod.trace = lambda *a, **k: failed
    try:
        assert main(["doctor"]) == 1
    finally:
        res_mod.trace = real_trace
    assert "default pair: NOT RESOLVED" in capsys.readouterr().out


def test_modes_not_claimed_are_not_checked():
    caps = Capabilities(dtypes=("float32",), speculative_verify=False, draft_extend=False, devices=("cpu",))

    class NoSpec(P.SimpleTorchBackend):
        capabilities = caps

    mod = types.ModuleType("nospec")

    @hookimpl
    def attnplug_register_backends(register):
        register(BackendDescriptor(name="no_spec", factory=lambda ctx: ("no_spec", NoSpec(ctx)), capabilities=caps,
                                   priority={"cpu": 1}))

    mod.attnplug_register_backends = attnplug_register_backends
    report = doctor_cmd.diagnose(make_registry((mod, "attnplug-nospec")))
    assert _modes(report["backends"][0]) == ["extend_noprefix", "extend_prefix", "extend_ragged",
                                             "extend_single_token", "extend_prefix_midpage", "decode", "mixed",
                                             "idle"]


def test_json_and_backend_filter(use_registry, capsys):
    from attnplug.cli.main import main

    use_registry(make_registry((P.good_plugin(), "attnplug-simple"), (P.wrong_plugin(), "attnplug-wrong")))
    assert main(["doctor", "--json", "--backend", "simple_torch"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [b["name"] for b in data["backends"]] == ["simple_torch"]
    assert data["ok"] is True and data["host"]["platform"] == "cpu"


@pytest.mark.skipif(importlib.util.find_spec("attnplug_torch_native.backend") is None,
                    reason="the torch_native kernel module is not installed yet")
def test_attnplug_doctor_exits_0_with_the_installed_plugins():
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATTNPLUG_")}
    proc = subprocess.run([sys.executable, "-m", "attnplug", "doctor"], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "torch_native" in proc.stdout and "doctor: all checks passed" in proc.stdout


def test_runtime_notes_of_a_built_backend_are_reported():
    """cpu_fused says which kernel variant it runs (``runtime_notes``); doctor prints it."""
    from attnplug.registry import default_registry

    reg = default_registry()
    if "cpu_fused" not in reg.names() or not reg.availability("cpu_fused").available:
        pytest.skip("cpu_fused is not installed with its compiled kernel")
    from attnplug_cpu_fused import kernel

    report = doctor_cmd.diagnose(reg, only=["cpu_fused"])
    (b,) = report["backends"]
    assert b["status"] == "ok"
    assert len(b["notes"]) == 1 and b["notes"][0].startswith(f"kernel variant {kernel.isa()} ")
    assert f"  cpu_fused: {b['notes'][0]}" in doctor_cmd.render(report)


def test_a_backend_without_runtime_notes_reports_none():
    reg = make_registry((P.good_plugin(), "attnplug-simple"))
    (b,) = doctor_cmd.diagnose(reg)["backends"]
    assert b["notes"] == []
