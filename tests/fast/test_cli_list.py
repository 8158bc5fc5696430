"""`attnplug list`: complete, JSON-able, and free of torch and kernel libraries."""

from __future__ import annotations

import json

from tests.conftest import run_json, run_python

LIST_AND_MODULES = """
    import io, json, sys, contextlib
    from attnplug.cli.main import main
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(ARGS)
    heavy = sorted(m for m in sys.modules if m.split(".")[0] in
                   {"torch", "triton", "flash_attn", "flashinfer", "aiter", "numpy"}
                   or m.endswith(".kernels") or m.endswith(".backend") and m.startswith("attnplug_"))
    print(json.dumps({"rc": rc, "out": buf.getvalue(), "heavy": heavy}))
"""


def test_list_json_imports_no_torch_and_no_kernel_module(test_dists_site):
    out = run_json(LIST_AND_MODULES.replace("ARGS", '["list", "--json"]'), site=test_dists_site,
                   env={"ATTNPLUG_PLUGINS": "attnplug-test-fa3like,attnplug-torch-native,attnplug-test-broken-import"})
    assert out["rc"] == 0
    assert out["heavy"] == []
    data = json.loads(out["out"])
    by_name = {b["name"]: b for b in data["backends"]}
    tn = by_name["torch_native"]
    assert tn["distribution"] == "attnplug-torch-native" and tn["available"] is True
    assert tn["aliases"] == ["torch"] and tn["capabilities"]["sliding_window"] is True
    gpu = by_name["fake_gpu_only"]
    assert gpu["available"] is False and "needs SM90+" in gpu["reasons"]
    assert by_name["fake_flashinfer"]["deprecated_aliases"] == ["old_flashinfer"]
    failed = {p["distribution"]: p for p in data["plugins"] if p["status"] == "failed"}
    assert "attnplug-test-broken-import" in failed
    assert data["host"]["platform"] in {"cpu", "cuda", "rocm", "xpu", "npu"}


def test_list_text_shows_unavailable_reasons_and_failed_plugins(test_dists_site):
    out = run_json(LIST_AND_MODULES.replace("ARGS", '["list"]'), site=test_dists_site,
                   env={"ATTNPLUG_PLUGINS": "attnplug-test-fa3like,attnplug-test-broken-import"})
    text = out["out"]
    assert "fake_gpu_only" in text and "no: needs a cuda device" in text
    assert "attnplug-test-broken-import" in text and "ModuleNotFoundError" in text
    assert out["heavy"] == []


def test_console_script_help_lists_subcommands():
    proc = run_python("""
        import sys
        from attnplug.cli.main import main
        sys.argv = ["attnplug", "--help"]
        main()
    """)
    assert "list" in proc.stdout and "doctor" in proc.stdout and "ATTNPLUG_PLUGINS" in proc.stdout


def test_list_shows_a_restriction_beside_the_kv_dtypes_not_among_the_features():
    """``kv_cache_dtype_follows_model`` claims less: JSON carries it, the text puts it beside the cache dtypes."""
    env = {"ATTNPLUG_PLUGINS": "attnplug-fa3,attnplug-torch-native"}
    data = json.loads(run_json(LIST_AND_MODULES.replace("ARGS", '["list", "--json"]'), env=env)["out"])
    by_name = {b["name"]: b["capabilities"] for b in data["backends"]}
    assert by_name["fa3"]["kv_cache_dtype_follows_model"] is True
    assert by_name["torch_native"]["kv_cache_dtype_follows_model"] is False
    out = run_json(LIST_AND_MODULES.replace("ARGS", '["list"]'), env=env)
    assert out["heavy"] == []
    fa3 = next(line for line in out["out"].splitlines() if line.startswith("  fa3: "))
    assert "kv_cache_dtypes=float16,bfloat16,float8_e4m3fn (non-fp8: the model dtype only)" in fa3
    assert "follows" not in fa3.split("features=", 1)[1]
