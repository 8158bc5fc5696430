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

ALL_MODES = ["extend", "extend+prefix", "decode", "mixed", "target_verify", "draft_extend", "idle"]


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
    assert [m["mode"] for m in b["modes"]] == ALL_MODES
    assert all(m["ok"] for m in b["modes"])
    assert b["max_error"] < 1e-4
    assert report["default_pair"] == {"prefill": "simple_torch", "decode": "simple_torch", "ok": True, "error": None}
    text = doctor_cmd.render(report)
    assert "backend" in text and "modes checked" in text and "max error" in text
    assert "default pair: prefill=simple_torch decode=simple_torch" in text
    assert text.endswith("doctor: all checks passed")


def test_wrong_backend_fails_with_nonzero_exit(use_registry, capsys):
    from attnplug.cli.main import main

    use_registry(make_registry((P.good_plugin(), "attnplug-simple"), (P.wrong_plugin(), "attnplug-wrong")))
    assert main(["doctor"]) == 1
    out = capsys.readouterr().out
    assert "no_causal_mask FAILED [cpu, float32, page_size=4] in extend: max |error|" in out
    assert "above tolerance" in out
    assert "doctor: FAILED: no_causal_mask" in out
    row = next(line for line in out.splitlines() if line.startswith("no_causal_mask"))
    assert "extend!" in row and "FAILED" in row and "attnplug-wrong" in row


def test_decode_only_bug_is_caught_in_decode():
    # the mask only matters when a query sees several keys: decode is right, extend-like modes are wrong
    reg = make_registry((P.wrong_plugin(), "attnplug-wrong"))
    report = doctor_cmd.diagnose(reg)
    modes = {m["mode"]: m["ok"] for m in report["backends"][0]["modes"]}
    assert modes["decode"] and modes["idle"]
    assert not modes["extend"] and not modes["target_verify"]


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


def test_no_default_pair_is_a_failure(use_registry, capsys):
    from attnplug.cli.main import main

    use_registry(make_registry((P.unavailable_plugin(), "attnplug-gpu")))
    assert main(["doctor"]) == 1
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
    assert [m["mode"] for m in report["backends"][0]["modes"]] == ["extend", "extend+prefix", "decode", "mixed",
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
