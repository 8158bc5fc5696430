"""Conformance levels, proven on an outside backend (``tests/conformance/outside_backend``, pip-installed).

``outside_v01`` was written against level 0.1: it implements ``AttentionBackend`` directly, keeps
its own bounds check, writes first and reads keys back through ``req_to_token`` padded to the
longest request (masked padding multiplied by zero). ``outside_paged`` is its upgrade: a
``PagedBackend`` subclass whose compute reads only owned slots. At its level ``outside_v01``
passes, with the newer requirements reported and guided; at the default level those fail the run,
each message saying how to comply; ``outside_paged`` passes everything.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from _suite_runner import SuiteRun, run_pytest

import attnplug
from attnplug.testing.suite import requirements as R

#: fewer hypothesis examples: the random family's verdict, not its depth, is what is tested here
FAST = ["--conformance-examples=3"]
#: the installed attnplug and its level (the default ``--conformance-level``)
VERSION, CUR = attnplug.__version__, R.installed_level()


@pytest.fixture(scope="module")
def v01_at_its_level(outside_site: Path, tmp_path_factory: pytest.TempPathFactory) -> SuiteRun:
    return run_pytest(["--backend=outside_v01", "--conformance-level=0.1", "-rx", *FAST],
                      tmp_path_factory.mktemp("v01-level"), outside_site, timeout=900, quiet=False)


def test_level_01_backend_passes_at_its_level_with_every_newer_requirement_reported(v01_at_its_level: SuiteRun) -> None:
    run = v01_at_its_level
    assert run.proc.returncode == 0, run.output[-5000:]
    newer = ", ".join(lv for lv in R.known_levels() if lv != "0.1")
    assert f"attnplug conformance level 0.1 (attnplug {VERSION} checks up to {CUR}): failures of requirements new " \
           f"since {newer} are reported, not failed" in run.output
    r = run.report
    assert r is not None and r["conformance_level"] == "0.1" and r["conformance_levels"] == R.known_levels()
    cases = r["cases"]
    assert not [c["id"] for c in cases if c["outcome"] == "failed"]
    passed = [c for c in cases if c["outcome"] == "passed"]
    would = [c for c in cases if c["outcome"] == "would_fail"]
    # every level-0.1 family it claims passes; what fails is a newer requirement only
    assert {c["family"] for c in passed} >= {"protocol", "mode", "heads", "bad_input", "metadata_required",
                                             "kv_cache_write", "shared_metadata", "sequence", "refusal"}
    assert would and all(c["since"] != "0.1" for c in would)
    would02 = [c for c in would if c["since"] == "0.2"]
    broken = {c["requirement"] for c in would}
    assert {"garbage", "rejected", "refusal.forward", "kv_none", "no_save", "unmapped_slot"} <= broken
    # the refusal family: its 0.1 variants pass in words; the forwards, and the newer variants, would fail
    refusal = {c["case"]: c for c in cases if c["family"] == "refusal"}
    assert refusal["sliding_window"]["requirement"] == "refusal.forward"  # the forward was not refused
    assert refusal["dtype_int32"]["outcome"] == "would_fail"
    # each would-fail case keeps its failure text with the guidance
    for c in would:
        req = R.requirement(c["requirement"])
        assert f"requirement {req.id!r} (conformance level {req.since}): {req.contract}" in c["reason"], c
        assert f"how to meet it: {req.how}" in c["reason"] and f"see docs/conformance.md#{req.anchor}" in c["reason"]
    garbage = next(c for c in would if c["family"] == "garbage")
    assert "non-finite values" in garbage["reason"]
    rejected = next(c for c in would if c["case"].startswith("out_cache_loc_negative"))
    assert "must name 'out_cache_loc'; got: loc[0]=-1 is out of range" in rejected["reason"]
    # the summary: counts, then per level what would fail and how to meet each requirement
    s = r["summary"]
    assert s["failed"] == 0 and s["would_fail"] == len(would)
    assert run.summary_line("outside_v01").endswith(
        f"0 failed, {len(would)} would fail at a newer level (numeric cases: {s['numeric']})")
    new = next(ln for ln in run.output.splitlines()
               if ln.startswith("attnplug conformance outside_v01 at level 0.1:") and "new since 0.2:" in ln)
    assert re.search(rf"new since 0\.2: {len(would02)} cases would fail — .*garbage \(\d+\).*rejected \(22\).*"
                     rf"refusal\.forward \(\d+\).*; see docs/conformance\.md#level-0-2$", new), new
    for rid in broken:
        req = R.requirement(rid)
        assert f"  {rid}: {req.contract}. How to meet it: {req.how} (docs/conformance.md#{req.anchor})" in run.output
    assert r["backends"][0]["would_fail_by_level"]["0.2"]["rejected"] == 22
    # pytest counts them as expected failures, with the reason
    assert re.search(rf"\b{len(would)} xfailed\b", run.output)
    assert "XFAIL" in run.output and "would fail at conformance level 0.2 (checked at 0.1): requirement 'garbage'" \
        in run.output


def test_level_01_backend_at_the_default_level_fails_newer_requirements_saying_how_to_comply(
        outside_site: Path, tmp_path: Path) -> None:
    run = run_pytest(["--backend=outside_v01", "-k", "test_garbage and ps16 or test_rejected or test_refusal or "
                      "test_kv_none or test_mode and ps16 or test_bad_input"], tmp_path, outside_site, quiet=False)
    assert run.proc.returncode == 1, run.output[-5000:]
    assert f"attnplug conformance level {CUR} (attnplug {VERSION} checks up to {CUR})\n" in run.output
    r = run.report
    assert r is not None and r["conformance_level"] == CUR
    failed = [c for c in r["cases"] if c["outcome"] == "failed"]
    assert failed and "0.1" not in {c["since"] for c in failed}
    assert {c["family"] for c in failed} == {"garbage", "rejected", "refusal", "kv_none"}
    assert all(c["outcome"] == "passed" for c in r["cases"] if c["family"] in ("mode", "bad_input")
               and c["outcome"] != "skipped")
    assert not any(c["outcome"] == "would_fail" for c in r["cases"])
    # every failure message, as pytest prints it, ends with the requirement and how to meet it
    blocks = re.split(r"\n_+ (?=test_\w+\[outside_v01-)", run.output.split("short test summary info")[0])[1:]
    assert len(blocks) == len(failed)
    for block in blocks:
        assert re.search(r"requirement '[a-z_.]+' \(conformance level \d+\.\d+\): ", block), block[-1500:]
        assert "how to meet it: " in block and "see docs/conformance.md#req-" in block, block[-1500:]
    assert "how to meet it: subclass PagedBackend (init_forward_metadata runs PagedKVCache.check_batch" in run.output
    assert "see docs/conformance.md#req-garbage" in run.output
    assert f"at level {CUR}: new since" not in run.output  # nothing is newer than the default level


@pytest.fixture(scope="module")
def paged_run(outside_site: Path, tmp_path_factory: pytest.TempPathFactory) -> SuiteRun:
    return run_pytest(["--backend=outside_paged", *FAST], tmp_path_factory.mktemp("paged"), outside_site,
                      timeout=900)


def test_the_pagedbackend_upgrade_passes_everything(paged_run: SuiteRun) -> None:
    run = paged_run
    assert run.proc.returncode == 0, run.output[-5000:]
    r = run.report
    assert r is not None
    outcomes = {c["outcome"] for c in r["cases"]}
    assert outcomes <= {"passed", "skipped"}, outcomes
    families = {c["family"] for c in r["cases"] if c["outcome"] == "passed"}
    assert {"garbage", "rejected", "refusal", "kv_none", "no_save", "unmapped_slot", "edge", "random"} <= families
    assert r["summary"]["failed"] == 0 and r["summary"]["would_fail"] == 0


def test_the_upgrade_at_the_old_level_says_it_meets_the_new_one(outside_site: Path, tmp_path: Path) -> None:
    run = run_pytest(["--backend=outside_paged", "--conformance-level=0.1", "-k", "test_garbage and ps16 and plain"],
                     tmp_path, outside_site)
    assert run.proc.returncode == 0, run.output[-4000:]
    assert re.search(r"attnplug conformance outside_paged at level 0\.1: new since 0\.2: every case that ran passes "
                     r"\(\d+ cases of its requirements\): outside_paged meets level 0\.2 as far as this run checked",
                     run.output), run.output[-3000:]


@pytest.mark.parametrize(("args", "error"), [
    (["--backend=outside_v01", "--conformance-level=0.9"],
     f"--conformance-level=0.9: unknown conformance level '0.9': attnplug {VERSION} knows "
     f"{', '.join(R.known_levels())}; 0.9 is newer than the installed attnplug {VERSION}: upgrade attnplug"),
    (["--backend=outside_v01", "--conformance-level=latest"], "unknown conformance level 'latest'"),
    (["--conformance-level=0.1"], "--conformance-level=0.1: needs --backend=NAME"),
])
def test_a_bad_level_is_a_usage_error(outside_site: Path, tmp_path: Path, args: list[str], error: str) -> None:
    run = run_pytest(args, tmp_path, outside_site, report=False)
    assert run.proc.returncode == 4, run.output[-3000:]
    assert error in run.output


def test_doctor_shows_the_level_each_backend_was_checked_at(outside_site: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATTNPLUG_")}
    env["PYTHONPATH"] = str(outside_site)
    proc = subprocess.run([sys.executable, "-m", "attnplug.cli.main", "doctor", "--backend", "outside_v01",
                           "--backend", "outside_paged"], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {ln.split()[0]: ln.split() for ln in proc.stdout.splitlines() if ln.startswith("outside_")}
    header = next(ln.split() for ln in proc.stdout.splitlines() if ln.startswith("backend "))
    col = header.index("level")
    assert rows["outside_v01"][col] == "0.1" and rows["outside_paged"][col] == CUR
    assert (f"  outside_v01: checked at conformance level 0.1; this attnplug requires {CUR}, adding refusal.forward, "
            "kv_none, rejected, garbage") in proc.stdout
    assert "run pytest --backend=outside_v01 to see which it meets (docs/conformance.md#level-0-2)" in proc.stdout
    assert "outside_paged: checked at" not in proc.stdout
