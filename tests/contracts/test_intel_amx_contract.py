"""intel_amx's calls of sgl-kernel's CPU ops against the recorded op schemas of each build generation
(``sgl_kernel_cpu_schemas.json``: the first ops; window/sinks after ``logit_cap``; SGLang 0.5.23 / PR #32733
with ``k_scale, v_scale`` right after the buffers and ``tree_mask, is_causal`` ending extend).

The CPU build cannot be installed here (no wheel): MOCK op objects carry each recorded schema as a real
``torch._C.FunctionSchema`` and bind every call to it as the dispatcher does (``test_intel_amx.MockSglKernelOp``);
emulators do the math, checked against the float64 reference.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
import torch

import attnplug_intel_amx
import test_intel_amx as T
import _fa3_family_helpers as H
from attnplug import ForwardMode, LayerSpec
from attnplug.errors import BackendUnavailableError, NotSupportedError
from attnplug_intel_amx.backend import KNOWN_ARGS, Ops

GENERATIONS = sorted(T.SCHEMAS)
MODES = {"extend": dict(prefix=(0, 21, 5), ext=(7, 3, 30)),
         "decode": dict(mode=ForwardMode.DECODE, prefix=(15, 16, 40), ext=(1, 1, 1)),
         "mixed": dict(mode=ForwardMode.MIXED, prefix=(9, 0, 3), ext=(2, 5, 1))}
FEATURES = {"plain": {}, "softcap": dict(cap=2.0), "window_sinks": dict(window=5, sinks=True),
            "sinks_bf16": dict(sinks=True, dtype=torch.bfloat16), "v_head_dim": dict(v_head_dim=64)}


def _has(generation, arg):
    return all(f" {arg}" in T.SCHEMAS[generation][op] for op in KNOWN_ARGS)


@pytest.mark.parametrize("feature", sorted(FEATURES))
@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("generation", GENERATIONS)
def test_every_call_binds_to_each_recorded_schema(generation, mode, feature):
    """Bug 1: the plugin called the ops by position in the old order; the 0.5.23 schema (scales after the
    buffers) then received ``out`` where a float belongs. Every generation's schema must bind and compute
    the reference; a generation without window/sinks arguments refuses such layers in words."""
    kw = FEATURES[feature]
    p = T.problem(page_size=16, **MODES[mode], **kw)
    ops = T.mock_ops(generation)
    needs = [a for a in ("sliding_window_size", "sinks") if kw.get({"sliding_window_size": "window",
                                                                     "sinks": "sinks"}[a])]
    if any(not _has(generation, a) for a in needs):
        b = T.build(p, ops)
        assert any("newer build" in r for r in b.not_supported_reasons(p.layer)), b.not_supported_reasons(p.layer)
        b.init_forward_metadata(p.batch)
        with pytest.raises(NotSupportedError):
            b.forward_extend(p.q, p.k, p.v, p.layer, p.batch)
        return
    H.assert_close(T.run(p, ops=ops), p.expected, kw.get("dtype"))
    calls = ops.decode.op.calls + ops.extend.op.calls
    assert calls, "the plugin made no op call"
    for call in calls:
        if "k_scale" in call:  # a 16-bit cache: scale 1.0, as Python floats
            assert (call["k_scale"], call["v_scale"]) == (1.0, 1.0)
        if call.get("sinks") is not None:  # Bug 2: the ops read sinks as the query's dtype
            q = call.get("query", call.get("q_extend"))
            assert call["sinks"].dtype == q.dtype == p.q.dtype
        if "is_causal" in call:
            assert call["is_causal"] is True and call["tree_mask"] is None


@pytest.mark.parametrize("op", sorted(KNOWN_ARGS))
@pytest.mark.parametrize("generation", GENERATIONS)
def test_an_argument_the_plugin_does_not_know_is_refused_by_name(generation, op):
    """A newer build with a required argument nobody fills: refused at build, naming op and argument."""
    sch = dict(T.SCHEMAS[generation])
    sch[op] = sch[op].replace("float logit_cap", "float logit_cap, Tensor page_hint")
    with pytest.raises(BackendUnavailableError, match=rf"{op} has argument\(s\) page_hint \(Tensor\)"):
        Ops.from_ops(T.MockSglKernelOp(sch["decode_attention_cpu"], T.emulate_decode),
                     T.MockSglKernelOp(sch["extend_attention_cpu"], T.emulate_extend))


@pytest.mark.parametrize("mode", ["extend", "decode"])
def test_an_unknown_argument_with_a_default_gets_its_default(mode):
    sch = dict(T.SCHEMAS["kv_scales"])
    op = "decode_attention_cpu" if mode == "decode" else "extend_attention_cpu"
    sch[op] = sch[op].replace(") -> ()", ", int num_kv_splits=8) -> ()")  # defaults come last
    seen = []

    def emulator(fn):
        def run(num_kv_splits=None, **kw):
            seen.append(num_kv_splits)
            return fn(**kw)
        return run

    ops = Ops.from_ops(T.MockSglKernelOp(sch["decode_attention_cpu"], emulator(T.emulate_decode)),
                       T.MockSglKernelOp(sch["extend_attention_cpu"], emulator(T.emulate_extend)))
    p = T.problem(page_size=16, **MODES[mode])
    H.assert_close(T.run(p, ops=ops), p.expected)
    assert 8 in seen


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_sinks_reach_the_ops_in_the_query_dtype(dtype):
    """Bug 2: ``data_ptr<scalar_t>()`` reads the sinks as the query's type; float32 sinks under a bf16 or
    fp16 query are misread (the emulator refuses them as the op would misbehave)."""
    p = T.problem(page_size=16, sinks=True, dtype=dtype, **MODES["decode"])
    ops = T.mock_ops("kv_scales")
    H.assert_close(T.run(p, ops=ops), p.expected, dtype)
    assert ops.decode.op.calls[0]["sinks"].dtype == dtype


@pytest.mark.parametrize("head_dim, v_head_dim, ok", [
    (32, None, True), (64, None, True), (128, None, True), (96, None, True), (576, 512, True),
    (16, None, False), (48, None, False), (80, None, False), (64, 48, False), (64, 80, False),
])
def test_the_extend_kernels_head_dim_rule_is_declared(head_dim, v_head_dim, ok):
    """extend_attention_cpu: ``head_size % 32 == 0`` and ``head_size_v % 32 == 0`` (sgl-kernel extend.cpp).
    The head dim is in the declared capabilities (resolution sees it); the V head dim in backend_reasons."""
    caps = attnplug_intel_amx.CAPABILITIES
    assert (head_dim in caps.head_dims) is (head_dim % 32 == 0)
    p = T.problem(page_size=16, **MODES["extend"])
    b = T.build(p, T.mock_ops("kv_scales"))
    reasons = b.not_supported_reasons(LayerSpec(0, 4, 2, head_dim, v_head_dim=v_head_dim))
    assert (not reasons) is ok, reasons
    if not ok:
        assert any("32" in r for r in reasons), reasons


def test_the_kernels_extra_does_not_pull_the_cuda_sgl_kernel_wheel():
    """PyPI's ``sgl-kernel`` / ``sglang-kernel`` wheels are the CUDA builds (no CPU attention ops); the CPU
    build is compiled from source, so ``attnplug-intel-amx[kernels]`` must not name them."""
    meta = tomllib.loads((Path(__file__).resolve().parents[2] / "plugins" / "intel_amx" / "pyproject.toml").read_text())
    extra = meta["project"]["optional-dependencies"]["kernels"]
    names = {r.split(";")[0].split("[")[0].strip().split("<")[0].split(">")[0].split("=")[0].split("!")[0]
             .split("~")[0].strip().lower().replace("_", "-") for r in extra}
    assert not names & {"sgl-kernel", "sglang-kernel"}, extra


def test_the_recorded_schemas_differ_where_the_issue_says():
    """The data itself: the 0.5.23 schemas put the scales right after the buffers, and extend ends with
    ``tree_mask, is_causal``; the first generation has neither."""
    def names(gen, op):
        return [a.name for a in torch._C.parse_schema(T.SCHEMAS[gen][op]).arguments]

    assert names("kv_scales", "decode_attention_cpu")[3:5] == ["k_scale", "v_scale"]
    assert names("kv_scales", "extend_attention_cpu")[6:8] == ["k_scale", "v_scale"]
    assert names("kv_scales", "extend_attention_cpu")[-2:] == ["tree_mask", "is_causal"]
    assert "k_scale" not in names("legacy", "decode_attention_cpu") + names("window_sinks", "decode_attention_cpu")
    assert names("legacy", "decode_attention_cpu")[2] == "v_cahce"  # as registered (sic)
