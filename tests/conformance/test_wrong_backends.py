"""The suite fails deliberately wrong backends on exactly the cases that exercise their bug,
and passes the correct control (each run restricted with -k to the relevant cases)."""

from __future__ import annotations

from pathlib import Path

from _suite_runner import SuiteRun, run_pytest


def _split(run: SuiteRun, backend: str) -> tuple[set[str], set[str], set[str]]:
    """Failed, passed and skipped cases of ``backend``, as ``test_func[case-id]`` without the backend name."""
    mine = {}
    for k, v in run.outcomes().items():
        func, _, param = k.partition("[")
        if param.startswith(f"{backend}-"):
            mine[f"{func}[{param[len(backend) + 1:]}"] = v
        elif param == f"{backend}]":
            mine[func] = v
    assert mine, run.output[-3000:]
    return ({k for k, v in mine.items() if v == "failed"}, {k for k, v in mine.items() if v == "passed"},
            {k for k, v in mine.items() if v == "skipped"})


def test_correct_reference_backend_passes(wrong_site: Path, tmp_path: Path) -> None:
    run = run_pytest(["--backend=conf_reference", "-k",
                      "float32 and ps16 and not test_long or test_protocol or test_bad_input or test_metadata_required"],
                     tmp_path, wrong_site)
    assert run.proc.returncode == 0, run.output[-4000:]
    failed, passed, _ = _split(run, "conf_reference")
    assert not failed and len(passed) > 60
    line = run.summary_line("conf_reference")
    assert " 0 failed" in line and "numeric cases: " in line


def test_dropped_softmax_scale_fails_every_numeric_case(wrong_site: Path, tmp_path: Path) -> None:
    run = run_pytest(["--backend=conf_no_scale", "-k", "(test_mode or test_heads) and float32"],
                     tmp_path, wrong_site)
    assert run.proc.returncode == 1, run.output[-4000:]
    failed, passed, _ = _split(run, "conf_no_scale")
    # only the idle batch (no tokens) cannot show the bug
    assert passed == {k for k in passed | failed if "[idle-" in k}, sorted(passed)
    assert len(failed) > 40
    assert "max abs error" in run.output
    assert run.report is not None
    numeric = [c for c in run.report["cases"] if c["outcome"] == "failed"]
    assert all(c["max_abs_err"] > c["tolerance"]["atol"] for c in numeric)


def test_ignored_sliding_window_fails_window_cases_only(wrong_site: Path, tmp_path: Path) -> None:
    run = run_pytest(["--backend=conf_no_window", "-k", "(test_feature or test_shared_metadata) and float32"],
                     tmp_path, wrong_site)
    assert run.proc.returncode == 1, run.output[-4000:]
    failed, passed, _ = _split(run, "conf_no_window")
    feature_failed = {k for k in failed if k.startswith("test_feature")}
    feature_all = {k for k in failed | passed if k.startswith("test_feature")}
    assert feature_failed == {k for k in feature_all if "window" in k}
    from attnplug.testing.suite.cases import FEATURES

    # the causal windowed variants (bidirectional ones need a claim conf_no_window does not make)
    windowed = sum(1 for f in FEATURES.values() if f.sliding_window is not None and not f.bidirectional)
    assert windowed == 6  # window5, window16, window2, window0, window_sinks, softcap_window
    assert len(feature_failed) == windowed * 5  # every variant with a window x five modes
    # the shared-metadata layers include a windowed layer when the window is claimed
    assert all(k in failed for k in failed | passed if k.startswith("test_shared_metadata"))


def test_kv_cache_written_one_slot_off_fails_cache_cases(wrong_site: Path, tmp_path: Path) -> None:
    run = run_pytest(["--backend=conf_kv_off_by_one", "-k",
                      "(test_kv_cache_write or test_sequence or test_mode) and float32"], tmp_path, wrong_site)
    assert run.proc.returncode == 1, run.output[-4000:]
    failed, passed, _ = _split(run, "conf_kv_off_by_one")
    writes = {k for k in failed | passed if k.startswith("test_kv_cache_write")}
    # every write fails, except the idle batch and save_kv_cache=False (nothing to write)
    assert {k for k in writes if k in failed} == {k for k in writes if "[idle-" not in k and "no_save" not in k}
    assert all(k in failed for k in failed | passed if k.startswith("test_sequence"))
    # every single-forward case checks the cache too: they fail on the cache, not on the output
    modes = {k for k in failed | passed if k.startswith("test_mode")}
    assert {k for k in modes if k in failed} == {k for k in modes if "[idle-" not in k}
    assert "written outside out_cache_loc" in run.output


def test_ignored_sinks_fail_sink_cases_only(wrong_site: Path, tmp_path: Path) -> None:
    run = run_pytest(["--backend=conf_no_sinks", "-k", "test_feature and float32"], tmp_path, wrong_site)
    assert run.proc.returncode == 1, run.output[-4000:]
    failed, passed, _ = _split(run, "conf_no_sinks")
    assert failed == {k for k in failed | passed if "sinks" in k}
    assert failed and passed


# -- the depth and robustness families (issue 15, issue 9) ------------------------------
CONTROL = ("test_garbage and ps16 and nan or test_edge and float32 and ps16 or test_scaling and float32 and decode "
           "or test_no_save and float32 and ps16 or test_unmapped_slot and float32 and ps16 "
           "or test_cross_attention and float32 and ps16 or test_rejected or test_kv_none "
           "or test_output_ownership and float32 or test_random or test_refusal or test_workspace")


def test_correct_backends_pass_the_depth_and_robustness_families(wrong_site: Path, tmp_path: Path) -> None:
    run = run_pytest(["--backend=conf_reference", "--backend=conf_narrow", "--conformance-examples=3", "-k",
                      CONTROL], tmp_path, wrong_site, timeout=1200)
    assert run.proc.returncode == 0, run.output[-4000:]
    failed, passed, _ = _split(run, "conf_reference")
    assert not failed and len(passed) > 80
    fams = {k.split("[")[0] for k in passed}
    assert {"test_garbage", "test_edge", "test_rejected", "test_kv_none", "test_output_ownership", "test_random",
            "test_no_save", "test_unmapped_slot", "test_scaling", "test_refusal", "test_workspace"} <= fams
    failed, passed, _ = _split(run, "conf_narrow")
    refusals = {k for k in passed if k.startswith("test_refusal")}
    assert not failed and {"test_refusal[dtype_int32]", "test_refusal[dtype_complex64]",
                           "test_refusal[kv_dtype_float16]", "test_refusal[mode_target_verify]",
                           "test_refusal[sinks]", "test_refusal[gqa]"} <= refusals


#: wrong backend -> the cases aimed at its bug (-k); each also runs a few plain mode cases, which pass
AIMED = {
    "conf_default_scale": "test_scaling and float32",
    "conf_pad_multiply": "test_garbage and ps16 and nan and plain",
    "conf_write_first": "test_rejected",
    "conf_no_bounds": "test_rejected",
    "conf_reused_output": "test_output_ownership and float32",
    "conf_mask_everywhere": "test_edge and float32",
    "conf_new_from_cache": "(test_no_save or test_unmapped_slot) and float32 and ps16",
    "conf_nan_when_empty": "(test_edge or test_cross_attention) and float32 and ps16",
    "conf_chunk_drops_last": "test_workspace",
    "conf_workspace_oom": "test_workspace",
}


def test_each_wrong_backend_fails_the_family_aimed_at_its_bug(wrong_site: Path, tmp_path: Path) -> None:
    plain = "test_mode and float32 and ps16 and (decode or extend_prefix)"
    expr = " or ".join(f"({w} and ({aim} or {plain}))" for w, aim in AIMED.items())
    run = run_pytest([*(f"--backend={w}" for w in AIMED), "-k", expr], tmp_path, wrong_site, timeout=1200)
    assert run.proc.returncode == 1, run.output[-4000:]
    res = {w: _split(run, w) for w in AIMED}

    def fam(keys: set[str], prefix: str) -> set[str]:
        return {k for k in keys if k.startswith(prefix)}

    for w, (failed, passed, _) in res.items():  # the plain mode cases never show these bugs
        assert not fam(failed, "test_mode[") and fam(passed, "test_mode["), w
    failed, passed, _ = res["conf_default_scale"]
    assert fam(failed, "test_scaling") == fam(failed | passed, "test_scaling") != set()
    failed, passed, _ = res["conf_pad_multiply"]
    garbage = fam(failed | passed, "test_garbage")
    assert fam(failed, "test_garbage") == {k for k in garbage if "[cross" not in k} != set()
    failed, passed, _ = res["conf_write_first"]
    # a bad layer_id cannot be written even by a backend that writes first: PagedKVCache.set_kv
    # refuses it before touching a buffer, so those cases pass for it too
    rejected = fam(failed | passed, "test_rejected")
    assert fam(failed, "test_rejected") == {k for k in rejected if "layer_id" not in k} != set()
    failed, passed, _ = res["conf_no_bounds"]
    # (layer_id: the core's PagedKVCache refuses an out-of-range layer before any backend code can)
    assert fam(failed, "test_rejected") == {k for k in fam(failed | passed, "test_rejected")
                                            if "dtype" not in k and "layer_id" not in k}
    failed, passed, _ = res["conf_reused_output"]
    assert fam(failed, "test_output_ownership") == fam(failed | passed, "test_output_ownership") != set()
    failed, passed, _ = res["conf_mask_everywhere"]
    assert fam(failed, "test_edge") == {k for k in fam(failed | passed, "test_edge") if "with_mask" in k} != set()
    failed, passed, _ = res["conf_new_from_cache"]
    for f in ("test_no_save", "test_unmapped_slot"):
        assert fam(failed, f) == fam(failed | passed, f) != set(), f
    failed, passed, _ = res["conf_nan_when_empty"]
    empty = {k for k in failed | passed if "no_visible" in k or "_empty-" in k}
    assert empty and failed - fam(failed, "test_mode[") == empty
    failed, passed, _ = res["conf_chunk_drops_last"]
    workspace = fam(failed | passed, "test_workspace")
    assert fam(failed, "test_workspace") == {k for k in workspace if "decode_workspace" in k} != set()
    failed, passed, _ = res["conf_workspace_oom"]
    assert fam(failed, "test_workspace") == fam(failed | passed, "test_workspace") != set()


def test_an_ignored_v_scale_fails_exactly_the_fp8_cases_with_a_v_scale(wrong_site: Path, tmp_path: Path) -> None:
    """The correct control passes every fp8 case; a backend reading values without their V scale
    fails every case whose V scale is not 1 (and only those)."""
    run = run_pytest(["--backend=conf_reference", "--backend=conf_no_v_scale", "-k", "test_fp8_kv"],
                     tmp_path, wrong_site)
    assert run.proc.returncode == 1, run.output[-4000:]
    failed, passed, _ = _split(run, "conf_reference")
    assert not failed and len(passed) == 48  # 2 formats x 2 model dtypes x 4 modes x 3 scale variants
    failed, passed, _ = _split(run, "conf_no_v_scale")
    cases = failed | passed
    assert len(cases) == 48
    assert failed == {k for k in cases if "-unit-" not in k}, sorted(failed)
    assert "max abs error" in run.output


# -- MLA (docs/mla.md, level 0.4) ---------------------------------------------------------------
MLA_PLAIN = "test_mode and float32 and ps16 and (decode or extend_prefix)"


def test_wrong_mla_backends_fail_exactly_their_mla_families(wrong_site: Path, tmp_path: Path) -> None:
    """conf_mla_reference passes every MLA case; conf_mla_wrong_slice (absorbed values from the last
    kv_lora_rank entries) fails exactly the absorbed cases and the forms-agree family; conf_mla_scale576
    (scale 1/sqrt(576)) fails every numeric MLA case but not forms-agree (both forms share the wrong
    scale, so they still agree). All three pass the ordinary mode cases."""
    names = ("conf_mla_reference", "conf_mla_wrong_slice", "conf_mla_scale576")
    expr = f"(test_mla and ps16) or ({MLA_PLAIN})"
    run = run_pytest([*(f"--backend={n}" for n in names), "-k", expr], tmp_path, wrong_site, timeout=1200)
    assert run.proc.returncode == 1, run.output[-4000:]
    ref_failed, ref_passed, _ = _split(run, "conf_mla_reference")
    assert not ref_failed, sorted(ref_failed)
    mla_cases = {k for k in ref_passed if k.startswith("test_mla")}
    fams = {k.split("[")[0] for k in mla_cases}
    assert fams == {"test_mla", "test_mla_garbage", "test_mla_fp8", "test_mla_forms_agree"}, fams
    assert any(k.startswith("test_mode[") for k in ref_passed)

    failed, passed, _ = _split(run, "conf_mla_wrong_slice")
    assert not {k for k in failed if k.startswith("test_mode[")}
    want = {k for k in mla_cases if "-absorbed-" in k or k.startswith("test_mla_forms_agree")}
    assert failed == want, (sorted(failed ^ want))
    assert {k for k in passed if k.startswith("test_mla")} == mla_cases - want

    failed, passed, _ = _split(run, "conf_mla_scale576")
    assert not {k for k in failed if k.startswith("test_mode[")}
    want = {k for k in mla_cases if not k.startswith("test_mla_forms_agree")}
    assert failed == want, sorted(failed ^ want)
    assert {k for k in passed if k.startswith("test_mla")} == {k for k in mla_cases if k not in want}
    assert "max abs error" in run.output


def test_backends_without_mla_claims_skip_mla_cases_with_the_reason(wrong_site: Path, tmp_path: Path) -> None:
    run = run_pytest(["--backend=conf_reference", "-rs", "-k", "test_mla and ps16"], tmp_path, wrong_site,
                     quiet=False)
    assert run.proc.returncode == 0, run.output[-4000:]
    failed, passed, skipped = _split(run, "conf_reference")
    assert not failed and not passed and len(skipped) > 20
    assert "MLA layer not supported by conf_reference (Capabilities.mla_forms claims no MLA form)" in run.output
