"""Speculative decoding: draft backends, stamps through containers and wrappers, runner isolation.

Unit tests use an in-process registry; the runner-isolation and factory-contract tests run in
fresh interpreters against the real installed test distributions (tests/dists), like the
registry tests; the numeric check runs every CPU backend installed here (torch_native)
against the float64 reference.
"""

from __future__ import annotations

import importlib.util
import types

import pytest

import attnplug
from attnplug import (
    AttentionBackend,
    AttentionConfig,
    BackendWrapper,
    BuildContext,
    ForwardMode,
    HostInfo,
    HybridBackend,
    hookimpl,
)
from attnplug.errors import PluginError
from attnplug import selector as selector_module
from attnplug.backend import PROTOCOL_METHODS
from attnplug.descriptor import BackendDescriptor
from attnplug.errors import AttnplugError
from attnplug.forward_context import NoForwardContextError, current_backend, forward_context
from attnplug.registry import Registry, in_process_source
from attnplug.speculative import (
    DraftBackends,
    MultiStepDraftBackend,
    SidecarWrapper,
    build_draft_backends,
    draft_backend_name,
    kernel_for_forward,
    target_verify_backend_name,
)
from attnplug.stamps import stamps_of
from tests.conftest import run_json
from tests.protocol_spy import RecordingBackend, SpyBackend, call_protocol_method

HOST = HostInfo()


# -- an in-process registry -------------------------------------------------------------------------


def _plugin():
    mod = types.ModuleType("spec_test_plugin")

    @hookimpl
    def attnplug_register_backends(register):
        for name in ("kp", "kd", "kdraft"):
            register(BackendDescriptor(name=name, factory=lambda ctx, n=name: (n, RecordingBackend(n)), aliases=(name + "_a",)))
        # a host-dependent constructor: answers another registered name
        register(BackendDescriptor(name="kauto", factory=lambda ctx: ("kd", RecordingBackend("kd"))))
        register(BackendDescriptor(name="kalias", factory=lambda ctx: ("kp_a", RecordingBackend("kp"))))
        flips = iter(["kp", "kd"] * 100)  # a constructor that answers a different name on each call
        register(BackendDescriptor(name="kflip", factory=lambda ctx: (lambda n: (n, RecordingBackend(n)))(next(flips))))

    mod.attnplug_register_backends = attnplug_register_backends
    return mod


@pytest.fixture(scope="module")
def reg():
    r = Registry(HOST)
    r.load_sources([in_process_source(_plugin(), "spec-test-plugin")])
    return r


def ctx(**kw):
    cfg = AttentionConfig(**{"prefill_attention_backend": "kp", "decode_attention_backend": "kd", **kw})
    return BuildContext(config=cfg, host=HOST)


class Batch:
    def __init__(self, mode):
        self.forward_mode = mode


# -- names ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["prefill", "decode"])
def test_draft_names_come_from_the_selector_unless_overridden(spec):
    cfg = ctx(speculative_attention_mode=spec).config
    assert draft_backend_name(ForwardMode.DECODE, cfg) == "kd"
    assert draft_backend_name(ForwardMode.DRAFT_EXTEND, cfg) == "kp"
    assert draft_backend_name(ForwardMode.DRAFT_EXTEND_V2, cfg) == ("kd" if spec == "decode" else "kp")
    assert target_verify_backend_name(cfg) == ("kd" if spec == "decode" else "kp")
    over = cfg.replace(speculative_draft_attention_backend="kdraft")
    for mode in (ForwardMode.DECODE, ForwardMode.DRAFT_EXTEND, ForwardMode.DRAFT_EXTEND_V2):
        assert draft_backend_name(mode, over) == "kdraft"
    assert target_verify_backend_name(over) == target_verify_backend_name(cfg)  # the target keeps its pair


def test_split_config_without_base_field_is_read_through_the_pair():
    # bug 1: only the split fields are set; the base field is None
    cfg = AttentionConfig(prefill_attention_backend="kp", decode_attention_backend="kd")
    assert cfg.attention_backend is None
    assert draft_backend_name("decode", cfg) == "kd"


def test_unresolved_pair_is_a_clear_error():
    with pytest.raises(AttnplugError, match="speculative_draft_attention_backend is unset"):
        draft_backend_name(ForwardMode.DECODE, AttentionConfig())
    with pytest.raises(AttnplugError, match="target-verify"):
        target_verify_backend_name(AttentionConfig())


# -- building -------------------------------------------------------------------------------------


def test_every_child_of_the_multi_step_container_is_stamped(reg):
    d = build_draft_backends(reg, ctx(), 4)
    assert isinstance(d, DraftBackends) and isinstance(d.decode, MultiStepDraftBackend)
    assert MultiStepDraftBackend.stamps_children is True
    assert d.num_steps == 4 and len(d.decode.children()) == 4
    assert len({id(c) for c in d.decode.children()}) == 4  # one backend object per step
    assert [d.step(i) for i in range(4)] == list(d.decode.children())
    assert [stamps_of(c) for c in d.decode.children()] == [("kd", "kd")] * 4
    assert stamps_of(d.decode) == ("kd", "kd")
    assert [c.tag for c in d.decode.children()] == ["kd"] * 4  # stamp == what the factory built
    with pytest.raises(IndexError, match="4 steps"):
        d.step(4)


def test_stamping_the_container_stamps_every_child():
    from attnplug.stamps import stamp

    c = MultiStepDraftBackend([RecordingBackend("a"), RecordingBackend("b"), RecordingBackend("c")])
    stamp(c, "x", "y")
    assert [stamps_of(ch) for ch in c.children()] == [("x", "y")] * 3


def test_draft_override_beats_the_configured_pair(reg):
    d = build_draft_backends(reg, ctx(speculative_draft_attention_backend="kdraft"), 2)
    assert {k: v for k, v in d.stamps().items()} == {
        "decode": ("kdraft", "kdraft"), "extend": ("kdraft", "kdraft"),
        "decode.step0": ("kdraft", "kdraft"), "decode.step1": ("kdraft", "kdraft"),
    }
    assert d.requested == {"decode": "kdraft", "extend": "kdraft"}


def test_without_override_draft_uses_the_pair_halves(reg):
    d = build_draft_backends(reg, ctx(), 1)
    assert stamps_of(d.step(0)) == ("kd", "kd")
    assert stamps_of(d.extend) == ("kp", "kp")


@pytest.mark.parametrize("spec", ["prefill", "decode"])
def test_speculative_attention_mode_picks_verify_and_extend_v2_halves(reg, spec):
    c = ctx(speculative_attention_mode=spec)
    d = build_draft_backends(reg, c, 1, target_ctx=c, extend_mode="draft_extend_v2")
    half = "kd" if spec == "decode" else "kp"
    assert stamps_of(d.target_verify) == (half, half)
    assert d.target_verify.tag == half
    assert stamps_of(d.extend) == (half, half) and d.extend_mode is ForwardMode.DRAFT_EXTEND_V2
    assert kernel_for_forward(ForwardMode.TARGET_VERIFY, c.config, d.target_verify) == half
    # the target's own pair agrees, whichever backend the host uses for verify
    pair = reg.build_pair(c)
    assert isinstance(pair, HybridBackend)
    assert kernel_for_forward(ForwardMode.TARGET_VERIFY, c.config, pair) == half
    assert pair.forward(None, None, None, None, Batch(ForwardMode.TARGET_VERIFY)) == half


def test_wrapper_carries_the_inner_stamps(reg):
    d = build_draft_backends(reg, ctx(speculative_draft_attention_backend="kdraft"), 1)
    assert isinstance(d.extend, SidecarWrapper) and isinstance(d.extend, BackendWrapper)
    assert stamps_of(d.extend) == stamps_of(d.extend.inner) == ("kdraft", "kdraft")
    d.extend.set_hidden_states("h")
    assert d.extend.take_hidden_states() == "h" and d.extend.hidden_states is None
    assert d.extend.forward(None, None, None, None, Batch(ForwardMode.DRAFT_EXTEND)) == "kdraft"


def test_a_wrapper_that_drops_the_stamps_is_rejected(reg):
    class Forgetful(AttentionBackend):  # not a BackendWrapper: carries no stamps
        def __init__(self, inner):
            self.inner = inner

    with pytest.raises(AttnplugError, match="Forgetful.*does not carry the inner stamps"):
        build_draft_backends(reg, ctx(), 1, wrap_extend=Forgetful)
    d = build_draft_backends(reg, ctx(), 1, wrap_extend=None)
    assert isinstance(d.extend, RecordingBackend)


def test_stamps_are_effective_names_not_requested_names(reg):
    d = build_draft_backends(reg, ctx(speculative_draft_attention_backend="kauto"), 2)
    assert d.requested["decode"] == "kauto"
    assert all(s == ("kd", "kd") for s in d.stamps().values())
    d = build_draft_backends(reg, ctx(speculative_draft_attention_backend="kdraft_a"), 1)  # alias in config
    assert stamps_of(d.step(0)) == ("kdraft", "kdraft")


def test_a_leaf_returning_an_alias_is_rejected_naming_the_distribution(reg):
    with pytest.raises(PluginError, match="'spec-test-plugin'.*alias 'kp_a'") as e:
        build_draft_backends(reg, ctx(speculative_draft_attention_backend="kalias"), 2)
    assert e.value.distribution == "spec-test-plugin"


def test_steps_answering_different_names_are_a_plugin_error(reg):
    with pytest.raises(PluginError, match="'spec-test-plugin'.*different effective names.*'kd', 'kp'"):
        build_draft_backends(reg, ctx(speculative_draft_attention_backend="kflip"), 2)


def test_draft_context_is_marked_draft(reg):
    seen = []

    class Spy(Registry):
        def build(self, name, c):
            seen.append(c.is_draft)
            return super().build(name, c)

    spy = Spy(HOST)
    spy.load_sources([in_process_source(_plugin(), "spec-test-plugin")])
    c = ctx()
    build_draft_backends(spy, c, 2, target_ctx=c)
    assert seen == [True, True, True, False]  # two steps, extend: draft; verify: the target's context


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, None])
def test_num_steps_must_be_a_positive_int(reg, bad):
    with pytest.raises(ValueError, match="num_steps"):
        build_draft_backends(reg, ctx(), bad)


def test_extend_mode_must_be_a_draft_extend_mode(reg):
    with pytest.raises(ValueError, match="extend_mode"):
        build_draft_backends(reg, ctx(), 1, extend_mode=ForwardMode.DECODE)


def test_no_static_rename_or_mode_table_in_speculative():
    """Halves come from the selector and names from the factories: speculative.py holds no
    mode table (no comparison of a mode or of speculative_attention_mode, no dict keyed by
    modes) and no rename table (no string-to-string dict)."""
    import ast

    tree = ast.parse(open(importlib.util.find_spec("attnplug.speculative").origin).read())
    offenders = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            text = ast.unparse(node)
            if "ForwardMode." in text or "speculative_attention_mode" in text:
                offenders.append(text)
        if isinstance(node, ast.Dict):
            keys = [k for k in node.keys if k is not None]
            if any("ForwardMode." in ast.unparse(k) for k in keys):
                offenders.append(ast.unparse(node))
            consts = [v for v in node.values if isinstance(v, ast.Constant) and isinstance(v.value, str)]
            if keys and consts and all(isinstance(k, ast.Constant) for k in keys):
                offenders.append(ast.unparse(node))
    assert offenders == []
    calls = {ast.unparse(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
    assert "selector.backend_name_for_mode" in calls


# -- the container forwards every protocol method ---------------------------------------------------


def _call(backend, name, batch):
    return call_protocol_method(backend, name, batch, attnplug.LayerSpec(0, 2, 1, 8))


def test_container_defines_every_protocol_method():
    assert [m for m in PROTOCOL_METHODS if m not in vars(MultiStepDraftBackend)] == []


BATCHLESS = {"init_cuda_graph_state", "on_after_cuda_graph_warmup", "get_cuda_graph_seq_len_fill_value",
             "not_supported_reasons"}


@pytest.mark.parametrize("name", PROTOCOL_METHODS)
def test_container_forwards_each_method_to_the_active_step(name):
    steps = [SpyBackend("s0"), SpyBackend("s1"), SpyBackend("s2")]
    c = MultiStepDraftBackend(steps)
    batch = Batch(ForwardMode.DECODE)
    if name in BATCHLESS:
        _call(c, name, batch)
        assert all(s.names[:1] == [name] for s in steps)
        return
    with pytest.raises(AttnplugError, match="no draft step of this container is active"):
        _call(c, name, batch)
    with forward_context(c.step(1), batch, runner="draft"):
        _call(c, name, batch)
    assert steps[1].names[:1] == [name] and steps[0].names == [] and steps[2].names == []


def test_container_rejects_empty_and_shared_steps():
    with pytest.raises(ValueError):
        MultiStepDraftBackend([])
    t = RecordingBackend("x")
    with pytest.raises(ValueError, match="distinct"):
        MultiStepDraftBackend([t, t])


# -- model-facing dispatch --------------------------------------------------------------------------


def test_kernel_for_forward_calls_the_selector(monkeypatch, reg):
    calls = []
    real = selector_module.backend_name_for_mode

    def spy(mode, config, backend=None):
        calls.append((mode, backend))
        return real(mode, config, backend)

    monkeypatch.setattr(selector_module, "backend_name_for_mode", spy)
    d = build_draft_backends(reg, ctx(speculative_draft_attention_backend="kdraft"), 2)
    cfg = ctx().config
    with forward_context(d.step(1), Batch(ForwardMode.DECODE), runner="draft"):
        assert kernel_for_forward(ForwardMode.DECODE, cfg) == "kdraft"
    assert calls[-1] == (ForwardMode.DECODE, d.step(1))


def test_kernel_for_forward_reads_the_forward_context_not_a_global(reg):
    c = ctx(speculative_draft_attention_backend="kdraft")
    target = reg.build_pair(c)
    d = build_draft_backends(reg, c, 2)
    cfg = c.config
    with forward_context(target, Batch(ForwardMode.DECODE)):
        assert kernel_for_forward("decode", cfg) == "kd"
        assert kernel_for_forward("extend", cfg) == "kp"
        for i in range(2):
            with forward_context(d.step(i), Batch(ForwardMode.DECODE), runner="draft"):
                assert kernel_for_forward("decode", cfg) == "kdraft"
                assert kernel_for_forward("decode", cfg, runner="target") == "kd"
        with forward_context(d.extend, Batch(ForwardMode.DRAFT_EXTEND), runner="draft"):
            assert kernel_for_forward(ForwardMode.DRAFT_EXTEND, cfg) == "kdraft"
        assert kernel_for_forward(ForwardMode.DECODE, cfg) == "kd"
    with pytest.raises(NoForwardContextError):
        kernel_for_forward(ForwardMode.DECODE, cfg)


def test_kernel_for_forward_falls_back_to_the_pair_only_when_unstamped():
    cfg = AttentionConfig(prefill_attention_backend="kp", decode_attention_backend="kd")
    assert kernel_for_forward(ForwardMode.DECODE, cfg, RecordingBackend("unstamped")) == "kd"
    with pytest.raises(AttnplugError, match="unstamped"):
        kernel_for_forward(ForwardMode.DECODE, AttentionConfig(), RecordingBackend("unstamped"))


# -- two runners in one process, against the real installed test distributions ----------------------

RUNNERS = """
    import asyncio, json, os, sys, threading, time
    import attnplug
    import attnplug.hybrid, attnplug.speculative, attnplug.forward_context
    from attnplug import AttentionConfig, BuildContext, ForwardMode, HostInfo
    from attnplug.registry import Registry
    from attnplug.forward_context import forward_context, current_backend, active_frames
    from attnplug.speculative import build_draft_backends, kernel_for_forward
    for n in attnplug.__all__:
        getattr(attnplug, n)  # warm the lazy imports so the snapshot compares values, not first imports

    def snapshot():
        mods = {n: {k: repr(v) for k, v in vars(m).items() if not k.startswith("__")}
                for n, m in sys.modules.items() if n == "attnplug" or n.startswith("attnplug.")}
        return mods, dict(os.environ)

    ORDER, DRAFT, SPEC = sys.argv[1:4] if len(sys.argv) > 3 else PARAMS
    reg = Registry.discover()
    host = HostInfo()
    cfg = AttentionConfig(prefill_attention_backend="fake_fa3", decode_attention_backend="fake_flashinfer",
                          speculative_attention_mode=SPEC,
                          speculative_draft_attention_backend=DRAFT or None)
    target_ctx = BuildContext(config=cfg, host=host)
    draft_ctx = BuildContext(config=cfg, host=host, is_draft=True)
    built, before = {}, None
    for who in ORDER.split(","):
        if who == "target":
            built["target"] = reg.build_pair(target_ctx)
        else:
            built["draft"] = build_draft_backends(reg, draft_ctx, 3, target_ctx=target_ctx)
        if before is None:
            before = snapshot()
    after_build = snapshot()
    pair, draft = built["target"], built["draft"]

    class Batch:
        def __init__(self, mode):
            self.forward_mode = mode

    # (runner, label, backend, mode): what the host hands to the forward context for each forward
    JOBS = [("target", "pair", pair, ForwardMode.EXTEND), ("target", "pair", pair, ForwardMode.DECODE),
            ("target", "pair", pair, ForwardMode.TARGET_VERIFY),
            ("target", "verify", draft.target_verify, ForwardMode.TARGET_VERIFY)]
    JOBS += [("draft", f"step{i}", draft.step(i), ForwardMode.DECODE) for i in range(draft.num_steps)]
    JOBS += [("draft", "extend", draft.extend, ForwardMode.DRAFT_EXTEND)]

    def model_forward(runner, backend, mode, yield_point=None):
        # what model code does: ask the context for this forward's backend, never a global
        batch = Batch(mode)
        with forward_context(backend, batch, runner=runner):
            if yield_point:
                yield_point()
            b = current_backend()
            kernel = kernel_for_forward(mode, cfg)
            b.init_forward_metadata(batch)
            out = b.forward(None, None, None, None, batch)
            return [kernel, out, b is backend]

    out = {"stamps": {k: list(v) for k, v in draft.stamps().items()},
           "target_stamps": [pair.prefill_attention_backend_str, pair.decode_attention_backend_str],
           "sequential": {f"{r}:{l}:{m.value}": model_forward(r, b, m) for r, l, b, m in JOBS}}
    want = out["sequential"]

    def check(r, l, b, m, got, errors):
        if got != want[f"{r}:{l}:{m.value}"] or got[0] != got[1] or not got[2]:
            errors.append(f"{r}:{l}:{m.value} -> {got}")

    # nested: the draft's steps inside a target step, the target restored after each
    nested = []
    with forward_context(pair, Batch(ForwardMode.TARGET_VERIFY), runner="target"):
        for r, l, b, m in JOBS:
            if r == "draft":
                check(r, l, b, m, model_forward(r, b, m), nested)
            if current_backend() is not pair:
                nested.append("target not restored")
    out["nested_errors"] = nested

    # two threads (one per runner), lock-stepped so their forwards overlap
    barrier = threading.Barrier(2)
    thread_errors = []
    def thread_main(runner):
        jobs = [j for j in JOBS if j[0] == runner]
        for it in range(60):
            r, l, b, m = jobs[it % len(jobs)]
            check(r, l, b, m, model_forward(r, b, m, yield_point=barrier.wait), thread_errors)
    threads = [threading.Thread(target=thread_main, args=(r,)) for r in ("target", "draft")]
    for t in threads: t.start()
    for t in threads: t.join(60)
    out["thread_errors"] = thread_errors

    # two asyncio tasks, switching inside their forwards
    task_errors, order_log = [], []
    async def task_main(runner):
        jobs = [j for j in JOBS if j[0] == runner]
        for it in range(60):
            r, l, b, m = jobs[it % len(jobs)]
            batch = Batch(m)
            with forward_context(b, batch, runner=r):
                await asyncio.sleep(0)  # the other runner's task enters its forward here
                order_log.append(r)
                cb = current_backend()
                got = [kernel_for_forward(m, cfg), cb.forward(None, None, None, None, batch), cb is b]
            check(r, l, b, m, got, task_errors)
    async def main():
        await asyncio.gather(task_main("target"), task_main("draft"))
    asyncio.run(main())
    out["task_errors"] = task_errors
    out["task_switches"] = sum(1 for a, c in zip(order_log, order_log[1:]) if a != c)

    # each backend object saw only the modes of its own runner's jobs
    seen = {}
    for r, l, b, m in JOBS:
        leaves = b.children() if hasattr(b, "children") and b.children() else (b,)
        for leaf in leaves:
            leaf = getattr(leaf, "inner", leaf)
            for kind, mode in getattr(leaf, "calls", []):
                seen.setdefault(f"{r}:{l}:{leaf.tag}", set()).add(mode)
    out["modes_seen"] = {k: sorted(v) for k, v in seen.items()}
    out["frames_left"] = len(active_frames())
    out["globals_unchanged_by_second_build"] = before == after_build
    out["globals_unchanged_by_forwards"] = before == snapshot()
    print(json.dumps(out))
"""

DIST_ENV = {"ATTNPLUG_PLUGINS": "attnplug-test-fa3like,attnplug-test-other,attnplug-test-bad-factories"}


@pytest.mark.parametrize("order", ["target,draft", "draft,target"])
@pytest.mark.parametrize("draft,spec", [("fake_triton", "prefill"), ("", "decode")])
def test_target_and_draft_runners_dispatch_to_their_own_backends(test_dists_site, order, draft, spec):
    out = run_json(RUNNERS.replace("PARAMS", repr((order, draft, spec))), site=test_dists_site, env=DIST_ENV)
    verify = "fake_flashinfer" if spec == "decode" else "fake_fa3"
    d_dec, d_ext = ("fake_triton", "fake_triton") if draft else ("fake_flashinfer", "fake_fa3")
    assert out["target_stamps"] == ["fake_fa3", "fake_flashinfer"]
    assert out["stamps"] == {
        "decode": [d_dec, d_dec], "extend": [d_ext, d_ext], "target_verify": [verify, verify],
        **{f"decode.step{i}": [d_dec, d_dec] for i in range(3)},
    }
    seq = out["sequential"]
    assert seq["target:pair:extend"] == ["fake_fa3", "fake_fa3", True]
    assert seq["target:pair:decode"] == ["fake_flashinfer", "fake_flashinfer", True]
    assert seq["target:pair:target_verify"] == [verify, verify, True]
    assert seq["target:verify:target_verify"] == [verify, verify, True]
    for i in range(3):
        assert seq[f"draft:step{i}:decode"] == [d_dec, d_dec, True]
    assert seq["draft:extend:draft_extend"] == [d_ext, d_ext, True]
    assert out["nested_errors"] == [] and out["thread_errors"] == [] and out["task_errors"] == []
    assert out["task_switches"] > 30  # the tasks really interleaved inside their forwards
    # each backend object (leaf) saw only its own runner's modes: the hybrid routed verify by the selector
    fa3_modes = ["extend"] + (["target_verify"] if spec == "prefill" else [])
    flashinfer_modes = ["decode"] + (["target_verify"] if spec == "decode" else [])
    assert out["modes_seen"] == {
        "target:pair:fake_fa3": fa3_modes, "target:pair:fake_flashinfer": flashinfer_modes,
        f"target:verify:{verify}": ["target_verify"],
        **{f"draft:step{i}:{d_dec}": ["decode"] for i in range(3)},
        f"draft:extend:{d_ext}": ["draft_extend"],
    }
    assert out["frames_left"] == 0
    assert out["globals_unchanged_by_second_build"] is True
    assert out["globals_unchanged_by_forwards"] is True


CONTRACT = """
    import json, warnings
    from attnplug import AttentionConfig, BuildContext, HostInfo
    from attnplug.registry import Registry
    from attnplug.speculative import build_draft_backends
    reg = Registry.discover()
    out = {}
    def attempt(key, target_kw=None, **kw):
        cfg = AttentionConfig(**{"attention_backend": "fake_fa3", **kw})
        c = BuildContext(config=cfg, host=HostInfo())
        tc = None if target_kw is None else BuildContext(config=AttentionConfig(**target_kw), host=HostInfo())
        try:
            d = build_draft_backends(reg, c, 2, target_ctx=tc)
            out[key] = ["ok", {k: list(v) for k, v in d.stamps().items()}]
        except Exception as exc:
            out[key] = [type(exc).__name__, str(exc), getattr(exc, "distribution", None)]
    warnings.simplefilter("ignore")
    attempt("override", speculative_draft_attention_backend="bad_alias")
    attempt("pair_decode_half", decode_attention_backend="bad_alias")
    attempt("verify_half", target_kw=dict(prefill_attention_backend="fake_fa3", decode_attention_backend="bad_alias",
                                          speculative_attention_mode="decode"))
    attempt("alias_in_config", speculative_draft_attention_backend="fa3_alias")
    attempt("host_dependent", speculative_draft_attention_backend="fake_hybrid")
    print(json.dumps(out))
"""


def test_leaf_returning_an_alias_is_rejected_through_the_draft_api(test_dists_site):
    out = run_json(CONTRACT, site=test_dists_site, env=DIST_ENV)
    for key in ("override", "pair_decode_half", "verify_half"):
        kind, message, dist = out[key]
        assert kind == "PluginError", out[key]
        assert dist == "attnplug-test-bad-factories"
        assert "attnplug-test-bad-factories" in message and "alias 'bad_alias_name'" in message
    # a configured alias or host-dependent name is fine: the stamps hold the effective name
    assert out["alias_in_config"][0] == "ok"
    assert set(map(tuple, out["alias_in_config"][1].values())) == {("fake_fa3", "fake_fa3")}
    assert set(map(tuple, out["host_dependent"][1].values())) == {("fake_flashinfer", "fake_flashinfer")}


# -- numeric check: target-verify and draft-extend on every CPU backend installed here -------------


def _cpu_backends():
    """Every backend the installed plugins make available on a CPU host (torch_native here)."""
    r = Registry.discover(env={})
    return r, [n for n in r.available_names(HOST)
               if r.get(n).capabilities.speculative_verify or r.get(n).capabilities.draft_extend]


_NUMERIC_REG, _NUMERIC_NAMES = _cpu_backends()


def _require_kernel_module(name):
    """Skip (with the reason) while a plugin's kernel module is not written yet; anything else fails."""
    factory = _NUMERIC_REG.get(name).factory
    if isinstance(factory, str):
        module = factory.split(":", 1)[0]
        try:
            found = importlib.util.find_spec(module)
        except ModuleNotFoundError:
            found = None
        if found is None:
            pytest.skip(f"{name}: kernel module {module!r} does not exist yet")


def _tolerance(dtype):
    try:
        from attnplug.testing.tolerances import tolerance_for
    except ImportError:  # the suite may move it next to the cases
        from attnplug.testing.suite.tolerances import tolerance_for
    return tolerance_for(dtype)


NUMERIC_CASES = [
    # (mode, spec attention mode, custom mask, page size)
    (ForwardMode.TARGET_VERIFY, "prefill", False, 1),
    (ForwardMode.TARGET_VERIFY, "decode", False, 4),
    (ForwardMode.TARGET_VERIFY, "prefill", True, 4),
    (ForwardMode.TARGET_VERIFY, "decode", True, 1),
    (ForwardMode.DRAFT_EXTEND, "prefill", False, 4),
    (ForwardMode.DRAFT_EXTEND_V2, "decode", False, 1),
    (ForwardMode.DECODE, "prefill", False, 4),  # the draft's multi-step decode children
]


@pytest.mark.parametrize("case", NUMERIC_CASES, ids=lambda c: f"{c[0].value}-{c[1]}-mask{int(c[2])}-page{c[3]}")
@pytest.mark.parametrize("name", _NUMERIC_NAMES or ["<none>"])
def test_speculative_modes_match_the_reference(name, case):
    if name == "<none>":
        pytest.skip("no CPU backend claiming speculative modes is installed")
    import torch

    from attnplug import ForwardBatch, LayerSpec, PageAllocator, PagedKVCache
    from attnplug.testing.reference import expected_cache_after, reference_attention

    mode, spec, use_mask, page_size = case
    caps = _NUMERIC_REG.get(name).capabilities
    if not caps.supports_mode(mode):
        pytest.skip(f"{name} does not claim {mode.value}")
    if caps.page_sizes is not None and page_size not in caps.page_sizes:
        pytest.skip(f"{name} does not claim page_size={page_size}")
    _require_kernel_module(name)

    torch.manual_seed(0)
    layer = LayerSpec(layer_id=1, num_heads=4, num_kv_heads=2, head_dim=16)
    num_pages = 160 // page_size
    cache = PagedKVCache(2, num_pages, 2, 16, page_size=page_size, max_requests=4, max_context_len=64)
    alloc = PageAllocator(num_pages, seed=1)
    prefix = [5, 11, 8]
    reqs = [2, 0, 3]
    steps = 3
    for r, p in zip(reqs, prefix):
        cache.assign_pages(r, 40, alloc.alloc(-(-40 // page_size)))
        slots = cache.slots(r, 0, p)
        cache.k_buffers[1][slots] = torch.randn(p, 2, 16)
        cache.v_buffers[1][slots] = torch.randn(p, 2, 16)
    cfg = AttentionConfig(attention_backend=name, speculative_attention_mode=spec)
    bctx = BuildContext(config=cfg, host=HOST, num_heads=4, num_kv_heads=2, head_dim=16,
                        page_size=page_size, kv_cache=cache, layers=(layer,))
    spec_backends = build_draft_backends(_NUMERIC_REG, bctx, steps, target_ctx=bctx,
                                         extend_mode=mode if mode.is_draft_extend() else ForwardMode.DRAFT_EXTEND)

    def slots_for(lens, offset=0):
        return torch.cat([cache.slots(r, p + offset, p + offset + n) for r, p, n in zip(reqs, prefix, lens)])

    batches = []  # (runner, backend, batch)
    if mode is ForwardMode.TARGET_VERIFY:
        d = 4
        mask = None
        if use_mask:  # a draft tree: token 2 branches off token 0, token 3 follows token 2
            tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
            mask = tree.expand(len(reqs), d, d).clone()
        b = ForwardBatch.extend(reqs, prefix, [d] * len(reqs), slots_for([d] * len(reqs)), mode=mode,
                                spec_num_draft_tokens=d, spec_custom_mask=mask)
        batches.append(("target", spec_backends.target_verify, b))
        assert kernel_for_forward(mode, cfg, spec_backends.target_verify) == name
    elif mode.is_draft_extend():
        lens = [1, 3, 2]  # ragged: accepted tokens differ per request
        b = ForwardBatch.extend(reqs, prefix, lens, slots_for(lens), mode=mode)
        batches.append(("draft", spec_backends.extend, b))
    else:
        for i in range(steps):  # step i decodes position prefix+i (the previous steps' tokens are cached)
            seq = [p + i + 1 for p in prefix]
            b = ForwardBatch.decode(reqs, seq, slots_for([1] * len(reqs), offset=i))
            batches.append(("draft", spec_backends.step(i), b))

    tol = _tolerance("float32")
    for runner, backend, batch in batches:
        n = batch.num_tokens
        q, k, v = torch.randn(n, 4, 16), torch.randn(n, 2, 16), torch.randn(n, 2, 16)
        kc, vc = cache.get_kv(1)
        kc0, vc0 = kc.clone(), vc.clone()
        want = reference_attention(q, k, v, layer, batch, kc0, vc0, cache.req_to_token)
        with forward_context(backend, batch, runner=runner):
            served = current_backend()
            assert kernel_for_forward(batch.forward_mode, cfg) == name
            served.init_forward_metadata(batch)
            got = served.forward(q, k, v, layer, batch, save_kv_cache=True)
        assert got.shape == want.shape and got.dtype == q.dtype
        err = (got.double() - want).abs()
        bound = tol.atol + tol.rtol * want.abs()
        assert bool((err <= bound).all()), (
            f"{name} {batch.forward_mode.value} (runner {runner}): max error {err.max().item():.3g}; "
            f"per token {[round(x, 6) for x in err.amax(dim=(1, 2)).tolist()]}; seq_lens {batch.seq_lens.tolist()}"
        )
        want_k, want_v = expected_cache_after(kc0, vc0, k, v, batch.out_cache_loc)
        assert torch.equal(cache.k_buffers[1], want_k) and torch.equal(cache.v_buffers[1], want_v)
