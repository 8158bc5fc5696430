"""Plugin machinery against real installed distributions (tests/dists, pip-installed into a
temp folder), each scenario in a fresh interpreter so discovery runs for real."""

from __future__ import annotations

import shutil

import pytest

from tests.conftest import run_json, run_python

ALL_GOOD = "attnplug-test-fa3like,attnplug-test-other"


def discover(site, allow=None, deny=None, extra=""):
    env = {}
    if allow is not None:
        env["ATTNPLUG_PLUGINS"] = allow
    if deny is not None:
        env["ATTNPLUG_DISABLE_PLUGINS"] = deny
    code = f"""
        import json, sys
        from attnplug.registry import Registry
        reg = Registry.discover()
        out = {{
            "names": reg.names(),
            "plugins": {{p.distribution: [p.status, p.error, p.version] for p in reg.plugins
                         if p.distribution.startswith("attnplug-test")}},
            "conflicts": {{n: str(e) for n, e in reg.conflicts.items()}},
            "problems": reg.problems,
            "kernel_imported": "attnplug_test_fa3like.kernels" in sys.modules,
        }}
        {extra}
        print(json.dumps(out))
    """
    return run_json(code, site=site, env=env)


def test_good_plugins_register_and_kernel_modules_stay_unimported(test_dists_site):
    out = discover(test_dists_site, allow=ALL_GOOD)
    assert {"fake_fa3", "fake_flashinfer", "fake_gpu_only", "fake_triton"} <= set(out["names"])
    assert out["plugins"]["attnplug-test-fa3like"][:2] == ["loaded", None]
    assert out["plugins"]["attnplug-test-fa3like"][2] == "1.0.0"
    assert out["kernel_imported"] is False


def test_broken_import_is_set_aside_and_others_keep_working(test_dists_site):
    out = discover(test_dists_site, allow=ALL_GOOD + ",attnplug-test-broken-import")
    status, error, version = out["plugins"]["attnplug-test-broken-import"]
    assert status == "failed" and version == "0.1.0"
    assert "ModuleNotFoundError" in error and "attnplug_this_module_does_not_exist" in error
    assert "fake_fa3" in out["names"]


def test_raising_hook_is_set_aside_without_partial_registrations(test_dists_site):
    out = discover(test_dists_site, allow=ALL_GOOD + ",attnplug-test-raising-hook")
    status, error, _ = out["plugins"]["attnplug-test-raising-hook"]
    assert status == "failed"
    assert "attnplug_register_backends" in error and "boom from the register hook" in error
    assert "half_registered" not in out["names"]
    assert "fake_triton" in out["names"]


def test_conflicting_names_are_an_error_naming_both_distributions(test_dists_site):
    out = discover(test_dists_site, allow=ALL_GOOD + ",attnplug-test-conflict", extra="""
        try:
            reg.get("fake_fa3")
        except Exception as exc:
            out["error"] = [type(exc).__name__, str(exc)]
    """)
    assert out["error"][0] == "BackendConflictError"
    for text in (out["error"][1], out["conflicts"]["fake_fa3"]):
        assert "attnplug-test-fa3like" in text and "attnplug-test-conflict" in text
    assert "fake_fa3" not in out["names"]  # neither wins silently
    alias_msg = out["conflicts"]["fa3_alias"]
    assert "alias" in alias_msg and "attnplug-test-fa3like" in alias_msg and "attnplug-test-conflict" in alias_msg
    assert "conflict_ok" in out["names"]  # the rest of the plugin still loads


def test_allow_and_deny_lists_filter_and_report_unknown_names(test_dists_site):
    out = discover(test_dists_site, allow="attnplug-test-fa3like,no-such-plugin",
                   deny="fa3like,also-missing")
    # deny wins over allow for fa3like; other is not allowed
    assert out["plugins"]["attnplug-test-fa3like"][0] == "filtered"
    assert "ATTNPLUG_DISABLE_PLUGINS" in out["plugins"]["attnplug-test-fa3like"][1]
    assert out["plugins"]["attnplug-test-other"][0] == "filtered"
    assert "fake_fa3" not in out["names"] and "fake_triton" not in out["names"]
    problems = " ".join(out["problems"])
    assert "ATTNPLUG_PLUGINS names 'no-such-plugin'" in problems
    assert "ATTNPLUG_DISABLE_PLUGINS names 'also-missing'" in problems


def test_duplicate_metadata_on_sys_path_is_registered_once(test_dists_site, tmp_path):
    # An editable install next to stale metadata: the same distribution twice on sys.path.
    stale = tmp_path / "stale"
    stale.mkdir()
    for info in test_dists_site.glob("attnplug_test_other-*.dist-info"):
        shutil.copytree(info, stale / info.name.replace("2.0.0", "1.9.0"))
    proc = run_python("""
        from attnplug.registry import Registry
        reg = Registry.discover()
        recs = [p for p in reg.plugins if p.distribution == "attnplug-test-other"]
        print(len(recs), recs[0].status, reg.names().count("fake_triton"))
        print(reg.problems)
    """, site=test_dists_site, extra_paths=(stale,), env={"ATTNPLUG_PLUGINS": ALL_GOOD})
    assert proc.returncode == 0, proc.stderr
    first, problems = proc.stdout.splitlines()[:2]
    assert first == "1 loaded 1"
    assert "duplicate metadata" in problems and "attnplug-test-other" in problems


BUILD = """
    import json, sys, warnings
    from attnplug import AttentionConfig, BuildContext, HostInfo
    from attnplug.registry import Registry
    reg = Registry.discover()
    host = HostInfo()
    def ctx(**kw):
        return BuildContext(config=AttentionConfig(**kw), host=host)
    out = {}
    def attempt(key, name):
        try:
            eff, b = reg.build(name, ctx())
            out[key] = ["ok", eff, b.prefill_attention_backend_str, b.decode_attention_backend_str]
        except Exception as exc:
            out[key] = [type(exc).__name__, str(exc), getattr(exc, "distribution", None)]
"""


def build_once(site, name, plugins):
    """``reg.build(name, ...)`` in a fresh interpreter that discovered ``plugins`` only: ``attempt``'s record,
    ``["ok", effective name, prefill stamp, decode stamp]`` or ``[error class, message, distribution]``."""
    return run_json(BUILD + f"""
    attempt("r", {name!r})
    print(json.dumps(out))
    """, site=site, env={"ATTNPLUG_PLUGINS": plugins})["r"]


@pytest.mark.parametrize(
    "backend,fragment",
    [
        ("bad_alias", "alias 'bad_alias_name' as its effective name"),
        ("bad_bare", "a bare Tiny"),
        ("bad_none", "returned None"),
        ("bad_unregistered", "'no_such_backend', which is not a registered backend"),
        ("bad_not_backend", "must subclass attnplug.AttentionBackend"),
        ("bad_raises", "raised ZeroDivisionError"),
    ],
)
def test_factory_contract_violations_name_the_distribution(test_dists_site, backend, fragment):
    kind, message, dist = build_once(test_dists_site, backend, "attnplug-test-bad-factories")
    assert kind == "PluginError"
    assert dist == "attnplug-test-bad-factories"
    assert "attnplug-test-bad-factories" in message and fragment in message


def test_factory_may_answer_another_registered_name_and_is_stamped_with_it(test_dists_site):
    assert build_once(test_dists_site, "good_other_name", "attnplug-test-bad-factories") == [
        "ok", "bad_none", "bad_none", "bad_none"]


def test_unknown_backend_lists_available_and_why_others_are_not(test_dists_site):
    kind, message, _ = build_once(test_dists_site, "no_such", ALL_GOOD + ",attnplug-test-broken-import")
    assert kind == "UnknownBackendError"
    assert "unknown attention backend 'no_such'" in message
    assert "fake_fa3" in message and "fake_triton" in message
    assert "fake_gpu_only (needs a cuda device; this host is cpu; needs SM90+)" in message
    assert "attnplug-test-broken-import" in message  # plugins set aside are named too


def test_aliases_deprecated_aliases_and_host_dependent_names(test_dists_site):
    out = run_json(BUILD + """
    warnings.simplefilter("error")
    attempt("alias", "fa3_alias")
    try:
        reg.canonical("old_flashinfer")
    except DeprecationWarning as w:
        out["deprecated"] = str(w)
    warnings.simplefilter("ignore")
    out["deprecated_resolves"] = reg.canonical("old_flashinfer")
    out["hybrid_cpu"] = reg.canonical("fake_hybrid", HostInfo())
    out["hybrid_cuda"] = reg.canonical("fake_hybrid", HostInfo(platform="cuda", compute_capability=(9, 0)))
    out["built_hybrid"] = reg.build("fake_hybrid", ctx())[0]
    print(json.dumps(out))
    """, site=test_dists_site, env={"ATTNPLUG_PLUGINS": ALL_GOOD})
    assert out["alias"] == ["ok", "fake_fa3", "fake_fa3", "fake_fa3"]  # stamped canonical, not the alias
    assert "'old_flashinfer' is deprecated; use 'fake_flashinfer'" in out["deprecated"]
    assert out["deprecated_resolves"] == "fake_flashinfer"
    assert (out["hybrid_cpu"], out["hybrid_cuda"]) == ("fake_flashinfer", "fake_fa3")
    assert out["built_hybrid"] == "fake_flashinfer"


def test_unavailable_backend_raises_with_its_reasons(test_dists_site):
    kind, message, _ = build_once(test_dists_site, "fake_gpu_only", ALL_GOOD)
    assert kind == "BackendUnavailableError"
    assert "needs SM90+" in message and "Available here: fake_fa3, fake_flashinfer, fake_triton" in message


TWO_RUNNERS = BUILD + """
    import attnplug, os
    import attnplug.hybrid  # warm the lazy imports so the snapshot compares values, not first imports
    from attnplug import ForwardMode
    for n in attnplug.__all__:
        getattr(attnplug, n)
    def snapshot():
        mods = {n: {k: repr(v) for k, v in vars(m).items() if not k.startswith("__")}
                for n, m in sys.modules.items() if n == "attnplug" or n.startswith("attnplug.")}
        return mods, dict(os.environ)
    target_cfg = dict(prefill_attention_backend="fake_fa3", decode_attention_backend="fake_flashinfer")
    draft_cfg = dict(attention_backend="fake_triton")
    order = sys.argv[1] if len(sys.argv) > 1 else ORDER
    built = {}
    before = None
    for who in order.split(","):
        c = ctx(**(target_cfg if who == "target" else draft_cfg))
        built[who] = reg.build_pair(c)
        if before is None:
            before = snapshot()
    after = snapshot()
    class B:
        def __init__(self, m): self.forward_mode = m
    out["stamps"] = {w: [b.prefill_attention_backend_str, b.decode_attention_backend_str] for w, b in built.items()}
    out["dispatch"] = {w: {m.value: b.forward(None, None, None, None, B(m)) for m in
                          (ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.TARGET_VERIFY)}
                       for w, b in built.items()}
    out["globals_unchanged"] = before == after
    print(json.dumps(out))
"""


@pytest.mark.parametrize("order", ["target,draft", "draft,target"])
def test_two_runners_keep_their_own_stamps_in_either_build_order(test_dists_site, order):
    out = run_json(TWO_RUNNERS.replace("ORDER", repr(order)), site=test_dists_site,
                   env={"ATTNPLUG_PLUGINS": ALL_GOOD})
    assert out["stamps"] == {"target": ["fake_fa3", "fake_flashinfer"], "draft": ["fake_triton", "fake_triton"]}
    assert out["dispatch"]["target"] == {"extend": "fake_fa3", "decode": "fake_flashinfer",
                                         "target_verify": "fake_fa3"}
    assert out["dispatch"]["draft"] == {"extend": "fake_triton", "decode": "fake_triton",
                                        "target_verify": "fake_triton"}
    assert out["globals_unchanged"] is True
