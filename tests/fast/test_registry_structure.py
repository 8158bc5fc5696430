"""The registry's shape (issue 11) and the plugin-code boundary (issue 9, classes 8-11),
in-process with a fresh registry per test."""

from __future__ import annotations

import ast
import inspect
import io
import signal
import sys
import threading
import types
import typing
from pathlib import Path

import pytest

from attnplug import AttentionConfig, BackendDescriptor, BuildContext, Capabilities, HostInfo, hookimpl
from attnplug import hookspecs
from attnplug.descriptor import descriptor_problems
from attnplug.errors import NotSupportedError, PluginError
from attnplug.isolation import call_plugin
from attnplug.layer import LayerSpec
from attnplug.registry import Registry, in_process_source
from tests.protocol_spy import RecordingBackend

CORE = Path(__file__).resolve().parents[2] / "core" / "attnplug"
CPU = HostInfo()


def plugin(**hooks):
    mod = types.ModuleType("inproc_plugin")
    for name, fn in hooks.items():
        setattr(mod, name, hookimpl(fn))
    return mod


def registry(*mods_and_dists, host=CPU):
    reg = Registry(host)
    reg.load_sources([in_process_source(m, d) for m, d in mods_and_dists])
    return reg


# -- structure ----------------------------------------------------------------------------------
def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
            out.add(node.module)
    return out


def test_resolution_modules_import_each_other_in_one_direction():
    graph = {p.stem: {m for m in _imports(p) if (CORE / "resolution" / f"{m}.py").exists()}
             for p in (CORE / "resolution").glob("*.py") if p.stem != "__init__"}
    assert "chain" not in graph["explain"] and "explain" in graph["chain"]

    def reaches(a, b, seen=()):
        return any(n == b or (n not in seen and reaches(n, b, seen + (n,))) for n in graph.get(a, ()))

    assert not any(reaches(m, m) for m in graph), graph


def test_nothing_outside_the_registry_reaches_into_the_plugin_manager():
    offenders = []
    for path in CORE.rglob("*.py"):
        if path.name == "registry.py":
            continue
        text = path.read_text(encoding="utf-8")
        for needle in (".pm.", ".pm)", "._pm", "get_hookimpls", "pluggy.PluginManager"):
            if needle in text:
                offenders.append(f"{path.relative_to(CORE)}: {needle}")
    assert offenders == []
    assert not hasattr(Registry(CPU), "pm")


def test_register_callables_are_typed_protocols():
    for hook, proto in [("attnplug_register_backends", hookspecs.RegisterBackend),
                        ("attnplug_arch_overrides", hookspecs.RegisterArchOverride),
                        ("attnplug_resolution_rules", hookspecs.RegisterResolutionRule)]:
        annotation = getattr(hookspecs, hook).__annotations__["register"]  # a string (PEP 563)
        assert getattr(hookspecs, annotation) is proto
        assert typing.Protocol in proto.__mro__ and "Callable[..." not in annotation
    assert list(inspect.signature(hookspecs.RegisterBackend.__call__).parameters) == ["self", "descriptor"]


# -- one way to call a hook ----------------------------------------------------------------------
@pytest.mark.parametrize("exc", [SystemExit(7), KeyboardInterrupt(), GeneratorExit(), ValueError("v")])
def test_call_hook_turns_anything_raised_into_a_plugin_error(exc):
    def check(config, host):
        raise exc

    reg = registry((plugin(attnplug_check_config=check), "attnplug-raiser"))
    with pytest.raises(PluginError) as info:
        reg.call_hook("attnplug_check_config", config=AttentionConfig(), host=CPU)
    assert info.value.distribution == "attnplug-raiser"
    assert f"hook attnplug_check_config raised {type(exc).__name__}" in str(info.value)


@pytest.mark.parametrize("hook,value,expected", [
    ("attnplug_check_config", "one string", "expected a list of str or None"),
    ("attnplug_check_config", {"a": 1}, "expected a list of str or None"),
    ("attnplug_check_config", [1, 2], "expected a list of str or None"),
    ("attnplug_resolve_name", 42, "expected a str or None"),
])
def test_call_hook_checks_the_result_type(hook, value, expected):
    fn = (lambda config, host: value) if hook == "attnplug_check_config" else (lambda name, host: value)
    reg = registry((plugin(**{hook: fn}), "attnplug-wrong-type"))
    kwargs = {"config": AttentionConfig(), "host": CPU} if hook == "attnplug_check_config" else {"name": "x", "host": CPU}
    with pytest.raises(PluginError, match=expected) as info:
        reg.call_hook(hook, **kwargs)
    assert info.value.distribution == "attnplug-wrong-type"


# -- descriptor values -----------------------------------------------------------------------------
def test_aliases_given_as_a_string_are_never_split_into_characters():
    d = BackendDescriptor(name="b", factory="m:f", aliases="xyz")
    assert d.aliases == "xyz"
    assert descriptor_problems(d) == ["field 'aliases': expected a tuple of non-empty str names, got 'xyz' (str)"]
    assert BackendDescriptor(name="b", factory="m:f", aliases=["p", "q"]).aliases == ("p", "q")


@pytest.mark.parametrize("field,value,fragment", [
    ("priority", {"cpu": "high"}, "field \"priority['cpu']\": expected an int or None"),
    ("priority", {"tpu": 3}, "key 'tpu' is not a platform"),
    ("priority", 5, "field 'priority': expected a dict {platform: int} or a callable"),
    ("capabilities", {"dtypes": ()}, "field 'capabilities': expected an attnplug.Capabilities"),
    ("probe", "find_spec", "field 'probe': expected a callable"),
    ("factory", "no_colon", "field 'factory': expected a 'module:function' str or a callable"),
    ("deprecated_aliases", ("",), "field 'deprecated_aliases'"),
    ("library", 3, "field 'library': expected a str or None"),
])
def test_register_refuses_each_malformed_field_naming_it(field, value, fragment):
    def reg_hook(register):
        register(BackendDescriptor(**{"name": "bad", "factory": "m:f", field: value}))

    def good_hook(register):
        register(BackendDescriptor(name="good", factory=lambda ctx: ("good", RecordingBackend("tiny"))))

    reg = registry((plugin(attnplug_register_backends=reg_hook), "attnplug-malformed"),
                   (plugin(attnplug_register_backends=good_hook), "attnplug-good"))
    rec = next(p for p in reg.plugins if p.distribution == "attnplug-malformed")
    assert rec.status == "failed" and fragment in rec.error
    assert reg.names() == ["good"]


# -- building ---------------------------------------------------------------------------------------
FP32_BF16 = Capabilities(dtypes=("float32", "bfloat16"), head_dims=(64, 128), page_sizes=(16,), devices=("cpu",))


def _narrow_registry(caps=FP32_BF16, host=CPU):
    def hook(register):
        register(BackendDescriptor(name="narrow", factory=lambda ctx: ("narrow", RecordingBackend("tiny")), capabilities=caps))

    return registry((plugin(attnplug_register_backends=hook), "attnplug-narrow"), host=host)


def test_build_refuses_a_context_the_capabilities_do_not_claim():
    reg = _narrow_registry()
    ctx = BuildContext(config=AttentionConfig(), host=CPU, dtype="float16", head_dim=32, page_size=4,
                       layers=(LayerSpec(layer_id=3, num_heads=4, num_kv_heads=4, head_dim=32, sliding_window=8),))
    with pytest.raises(NotSupportedError) as info:
        reg.build("narrow", ctx)
    text = str(info.value)
    assert text.startswith("attention backend 'narrow' does not support the build context")
    for reason in ("dtype=float16 (supported: float32, bfloat16)",
                   "page_size=4 (supported: 16)", "head_dim=32 (supported: 64, 128)",
                   "layer 3: sliding_window=8 is not claimed"):
        assert reason in text, (reason, text)
    assert text.count("head_dim=32") == 1  # the layer's head_dim reason is not repeated


def test_build_accepts_a_claimed_context_and_keeps_it_on_the_backend():
    reg = _narrow_registry()
    ctx = BuildContext(config=AttentionConfig(), host=CPU, dtype="bfloat16", head_dim=64, page_size=16)
    name, backend = reg.build("narrow", ctx)
    assert name == "narrow" and backend.ctx is ctx


def test_build_maps_torch_cuda_device_to_rocm_on_a_rocm_host():
    rocm = HostInfo(platform="rocm", gfx_arch="gfx942")
    reg = _narrow_registry(Capabilities(devices=("rocm",)), host=rocm)
    reg.build("narrow", BuildContext(config=AttentionConfig(), host=rocm, device="cuda:0"))
    with pytest.raises(NotSupportedError, match=r"device=cpu \(supported: rocm\)"):
        reg.build("narrow", BuildContext(config=AttentionConfig(), host=rocm, device="cpu"))


# -- the Ctrl-C rule and output capture, in-process ---------------------------------------------------
def test_plugin_raised_keyboard_interrupt_is_its_failure():
    def fn():
        raise KeyboardInterrupt

    with pytest.raises(PluginError, match="raised KeyboardInterrupt"):
        call_plugin("attnplug-x", "hook h", fn)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler or callable(signal.getsignal(signal.SIGINT))


def test_a_sigint_while_plugin_code_runs_is_the_users_and_stops():
    before = signal.getsignal(signal.SIGINT)

    def fn():
        signal.raise_signal(signal.SIGINT)  # what the terminal sends on Ctrl-C
        return "not reached"

    with pytest.raises(KeyboardInterrupt):
        call_plugin("attnplug-x", "hook h", fn)
    assert signal.getsignal(signal.SIGINT) is before  # the handler is put back


def test_keyboard_interrupt_off_the_main_thread_is_the_plugins():
    caught = []

    def worker():
        try:
            call_plugin("attnplug-x", "probe", lambda: (_ for _ in ()).throw(KeyboardInterrupt()))
        except BaseException as exc:
            caught.append(exc)

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert isinstance(caught[0], PluginError)


def test_output_is_captured_per_thread(monkeypatch):
    real = io.StringIO()
    monkeypatch.setattr(sys, "stdout", real)
    inside, release = threading.Event(), threading.Event()
    results = []

    def plugin_code():
        print("from the plugin")
        inside.set()
        release.wait(10)
        return 1

    t = threading.Thread(target=lambda: results.append(call_plugin("attnplug-x", "hook h", plugin_code)))
    t.start()
    inside.wait(10)
    print("from the host")  # another thread, while the plugin's call is open
    release.set()
    t.join()
    assert results == [(1, "from the plugin\n")]
    assert real.getvalue() == "from the host\n"
    assert sys.stdout is real  # the router is gone once no plugin code runs


def test_reliability_doc_names_only_tests_that_exist():
    """docs/reliability.md cites `file.py::test_name` (and `::test_name` in the same file):
    every cited test exists, so the table cannot point at a test that was renamed away."""
    import re

    doc = (CORE.parents[1] / "docs" / "reliability.md").read_text(encoding="utf-8")
    cited = 0
    for cell in doc.split("|"):
        current = None
        for file_name, test_name in re.findall(r"(?:(test_\w+\.py))?::(test_\w+)", cell):
            current = file_name or current
            assert current is not None, cell
            found = sorted(Path(__file__).parents[1].glob(f"*/{current}"))  # a test file of any tier
            assert found, f"docs/reliability.md cites {current}, which no tests/<tier>/ folder holds"
            source = found[0].read_text(encoding="utf-8")
            assert f"def {test_name}(" in source, f"{current}::{test_name} is cited but does not exist"
            cited += 1
    assert cited >= 30
