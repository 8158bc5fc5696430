"""attnplug-speedups (``speedups/``): the per-layer check of a planned layer, compiled (issue 30).

``layer_ok`` may answer True only where the skeleton's Python per-call check passes (the forward's write
counters unchanged; q, k and v of ``[tokens, heads, dim]`` with the checked dtype and device type), and must
answer False for anything it cannot read itself (subclasses, inference counters, other types), so the Python
check decides those. The skeleton must give the same outputs, cache contents and refusals with and without it.

The compiled module is installed in CI (``tox -e tests`` sets ``ATTNPLUG_REQUIRE_SPEEDUPS=1``: missing, these
tests fail there); elsewhere they are skipped when it is not installed. The skeleton's Python path is run with
the module installed too: ``ATTNPLUG_SPEEDUPS=0`` (tox runs the hot-path and robustness files so) and the
``python_check`` fixture below.
"""

from __future__ import annotations

import os
import struct
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnplug.paged as paged
from attnplug import ShapeError
from attnplug.errors import ConfigError

from test_paged_base import LAYER, ToyBackend, decode_batch, make, qkv, same, snapshot

if os.environ.get("ATTNPLUG_REQUIRE_SPEEDUPS") == "1":
    import attnplug_speedups as sp  # (CI: its absence is a failure, not a skip)
else:
    sp = pytest.importorskip("attnplug_speedups", reason="attnplug-speedups is not installed (pip install ./speedups)")


class _Sub(torch.Tensor):
    """A tensor subclass: the compiled check never reads one (the Python check decides)."""


T, QH, KH, DIM = 3, 4, 2, 8
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _expect(dtype=torch.float32, device="cpu", v_dim=DIM):
    return sp.expectation(torch.empty(1, QH, DIM, dtype=dtype, device=device), QH, DIM, KH, DIM, KH, v_dim)


def _tensors(dtype=torch.float32):
    return (torch.zeros(T, QH, DIM, dtype=dtype), torch.zeros(T, KH, DIM, dtype=dtype),
            torch.zeros(T, KH, DIM, dtype=dtype))


def _forward_tuple(*counters, tokens=T):
    return (tokens,) + tuple(x for c in counters for x in (c, c._version))


def test_the_expectation_holds_the_dims_the_dtype_and_the_device_type():
    e = _expect(torch.bfloat16)
    fields = struct.unpack("8q", e)
    assert fields[:6] == (QH, DIM, KH, DIM, KH, DIM)
    assert fields[6] != struct.unpack("8q", _expect(torch.float32))[6]  # the scalar type
    assert fields[7] != struct.unpack("8q", _expect(device="meta"))[7]  # the device type
    assert sp.expectation(torch.empty(1, QH, DIM).as_subclass(_Sub), QH, DIM, KH, DIM, KH, DIM) is None


def test_layer_ok_passes_a_good_call_and_takes_no_argument_it_cannot_read():
    q, k, v = _tensors()
    c = torch.zeros(4, dtype=torch.int64)
    fwd = _forward_tuple(c)
    assert sp.layer_ok(q, k, v, _expect(), fwd) is True
    assert sp.layer_ok(q, k, v, _expect(), (T,)) is True  # (no counters: a forward that records none)
    # what it cannot read is "cannot tell", never an error: the Python check runs
    for e, f in ((None, fwd), (b"x" * 64, fwd), (_expect()[:-8], fwd), (_expect(), None), (_expect(), [T]),
                 (_expect(), (T, c)), (_expect(), (float(T),)), (_expect(), (0,)), (_expect(), (-1,)),
                 (_expect(), (1 << 70,)), (_expect(), (T, c, 1 << 70)), (_expect(), (T, c, -1)),
                 (_expect(), (T, "c", 0)), (_expect(), (T, c, float(c._version)))):
        assert sp.layer_ok(q, k, v, e, f) is False, (e, f)
    with pytest.raises(TypeError, match=r"layer_ok\(q, k, v, expect, forward\) takes 5 arguments \(4 given\)"):
        sp.layer_ok(q, k, v, _expect())
    with pytest.raises(TypeError, match=r"expectation\(q, .*\) takes 7 arguments \(1 given\)"):
        sp.expectation(q)


def test_tensors_of_other_implementations_are_cannot_tell_never_an_error():
    """Sparse and nested tensors have other ``TensorImpl`` classes: ``layer_ok``
    answers False and ``expectation`` None for them (the Python check decides), and nothing raises."""
    q, k, v = _tensors()
    others = [q.to_sparse(), torch.nested.nested_tensor([torch.zeros(QH, DIM)] * T)]
    for other in others:
        assert sp.expectation(other, QH, DIM, KH, DIM, KH, DIM) is None
        assert sp.layer_ok(other, k, v, _expect(), (T,)) is False
        assert sp.layer_ok(q, k, v, _expect(), (T, other, 0)) is False  # (as a counter)


def test_a_counter_written_since_or_without_a_counter_is_never_passed():
    q, k, v = _tensors()
    a, b = torch.zeros(4, dtype=torch.int64), torch.zeros(2, 3, dtype=torch.int32)
    fwd = _forward_tuple(a, b)
    assert sp.layer_ok(q, k, v, _expect(), fwd)
    b[0].add_(0)  # a write through a view moves the base's counter
    assert not sp.layer_ok(q, k, v, _expect(), fwd)
    assert sp.layer_ok(q, k, v, _expect(), _forward_tuple(a, b))
    with torch.inference_mode():
        inf = torch.zeros(2)
    assert not sp.layer_ok(q, k, v, _expect(), (T, inf, 0))  # keeps no counter: cannot tell
    assert not sp.layer_ok(q, k, v, _expect(), (T, a.as_subclass(_Sub), a._version))


@settings(max_examples=300, deadline=None)
@given(which=st.sampled_from(["q", "k", "v"]), what=st.sampled_from(["tokens", "heads", "dim", "rank", "dtype",
                                                                       "device", "subclass", "none", "same"]),
       dtype=st.sampled_from(DTYPES), delta=st.integers(-2, 2).filter(bool))
def test_layer_ok_is_true_exactly_when_every_per_call_check_passes(which, what, dtype, delta):
    """Each way one argument can differ from the layer's expectation (a property over the argument, the field
    and the dtype): the answer is the Python check's (q/k/v's ``shape``, ``dtype`` and device compared), True
    only for the unchanged call."""
    base = dict(zip("qkv", _tensors(dtype)))
    t = base[which]
    if what == "tokens":
        t = torch.zeros(max(0, T + delta), *t.shape[1:], dtype=dtype)
    elif what == "heads":
        t = torch.zeros(t.shape[0], max(0, t.shape[1] + delta), t.shape[2], dtype=dtype)
    elif what == "dim":
        t = torch.zeros(*t.shape[:2], max(0, t.shape[2] + delta), dtype=dtype)
    elif what == "rank":
        t = t.reshape(t.shape[0], -1) if delta < 0 else t.unsqueeze(0)
    elif what == "dtype":
        t = t.to(torch.float64)
    elif what == "device":
        t = t.to("meta")
    elif what == "subclass":
        t = t.as_subclass(_Sub)
    elif what == "none":
        t = None
    base[which] = t
    c = torch.zeros(2, dtype=torch.int64)
    answer = sp.layer_ok(base["q"], base["k"], base["v"], _expect(dtype), _forward_tuple(c))
    rest = {"q": (QH, DIM), "k": (KH, DIM), "v": (KH, DIM)}
    python = all(type(x) is torch.Tensor and tuple(x.shape) == (T, *rest[n]) and x.dtype is dtype and x.is_cpu
                 for n, x in base.items())
    assert answer is python
    assert answer is (what == "same")


@pytest.fixture(params=["compiled", "python"])
def check_path(request, monkeypatch):
    """The skeleton with attnplug-speedups ("compiled", its answers counted) and with the Python check only
    (the state ``ATTNPLUG_SPEEDUPS=0`` or an install without the package gives)."""
    answers: list[bool] = []
    if request.param == "python":
        monkeypatch.setattr(paged, "_layer_ok", None)
        monkeypatch.setattr(paged, "_expectation", None)
    else:
        monkeypatch.setattr(paged, "_expectation", sp.expectation)

        def counted(*args):
            answers.append(sp.layer_ok(*args))
            return answers[-1]

        monkeypatch.setattr(paged, "_layer_ok", counted)
    return request.param, answers


def _serve(cls, dtype, steps=4):
    torch.manual_seed(0)  # (the cache's contents: the same for both paths)
    backend, cache = make(cls, num_layers=2, dtype=dtype)
    tdtype = getattr(torch, dtype)
    outs = []
    for step in range(steps):
        batch = decode_batch(cache)
        backend.init_forward_metadata(batch)
        for layer in (LAYER, paged.LayerSpec(layer_id=0, num_heads=4, num_kv_heads=2, head_dim=8)) if step == 0 \
                else (LAYER,):
            q, k, v = (x + step for x in qkv(2, tdtype))
            outs.append(backend.forward(q, k, v, layer, batch))
    return backend, cache, outs


def _backend_class(kind):
    if kind == "toy":
        return ToyBackend
    if kind == "torch_native":
        from attnplug_torch_native.backend import TorchNativeBackend

        return TorchNativeBackend
    assert kind == "toy, own write"
    return _WritingToy


class _WritingToy(ToyBackend):
    """A backend with its own ``compute_and_write`` (as cpu_fused): the skeleton's inline write does not apply."""

    def compute_and_write(self, compute, cache, plan, loc, q, k, v, layer, batch, meta):
        out = compute(q, k, v, layer, batch, meta)
        cache.set_kv(plan.layer_id, loc, k, v)
        self.own_writes = getattr(self, "own_writes", 0) + 1
        return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", ["toy", "torch_native", "toy, own write"])
def test_the_skeleton_serves_the_same_with_the_compiled_check_and_takes_it_on_planned_layers(check_path, kind,
                                                                                             dtype):
    path, answers = check_path
    cls = _backend_class(kind)
    backend, cache, outs = _serve(cls, dtype)
    # the reference: a backend of the same class with the Python check only, the same calls
    saved = paged._layer_ok, paged._expectation
    paged._layer_ok, paged._expectation = None, None
    try:
        ref_backend, ref_cache, ref_outs = _serve(cls, dtype)
    finally:
        paged._layer_ok, paged._expectation = saved
    assert all(torch.equal(a, b) for a, b in zip(outs, ref_outs))
    assert same(cache, snapshot(ref_cache))
    if path == "compiled":
        # the first call of each layer object is its full check (no plan yet); every later forward of the planned
        # layer is one compiled call that passes
        assert answers == [True] * 3, answers
        plan = backend.layer_plan(LAYER)
        assert plan.fast is not None and plan.inline is (kind != "toy, own write")
    else:
        assert not answers and backend.layer_plan(LAYER).fast is None
    if kind == "toy, own write":  # every call wrote through the backend's hook, with either check
        assert backend.own_writes == ref_backend.own_writes == 5


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cpu_fused_through_its_own_compute_and_write_serves_the_same_with_the_compiled_check(check_path, dtype):
    """cpu_fused (registry-built, the bench's decode problem) overrides ``compute_and_write`` (one op for the
    attention and the write): a call the compiled check passes goes there, and outputs and cache are bit-equal
    to the Python check's."""
    pytest.importorskip("attnplug_cpu_fused", reason="attnplug-cpu-fused is not installed")
    from attnplug.bench.problem import PagedProblem
    from attnplug.bench.spec import Problem
    from attnplug.registry import default_registry

    def serve():
        prob = PagedProblem(Problem(mode="decode", batch=3, context=40, heads=4, kv_heads=2, head_dim=32,
                                    page_size=16, dtype=dtype), "cpu", 0)
        reg = default_registry()
        _, backend = reg.build("cpu_fused", prob.context("cpu_fused", reg.host, reg))
        outs = []
        for step in range(3):
            backend.init_forward_metadata(prob.batch)
            outs.append(backend.forward(prob.q + step, prob.k + step, prob.v + step, prob.layer, prob.batch))
        return backend, prob, outs

    path, answers = check_path
    backend, prob, outs = serve()
    saved = paged._layer_ok, paged._expectation
    paged._layer_ok, paged._expectation = None, None
    try:
        _, ref_prob, ref_outs = serve()
    finally:
        paged._layer_ok, paged._expectation = saved
    assert all(torch.equal(a, b) for a, b in zip(outs, ref_outs))
    lid = prob.layer.layer_id
    assert all(torch.equal(a, b) for a, b in zip(prob.cache.get_kv(lid), ref_prob.cache.get_kv(lid)))
    plan = backend.layer_plan(prob.layer)
    if path == "compiled":
        assert answers == [True, True] and plan.fast is not None and not plan.inline
    else:
        assert not answers and plan.fast is None


def test_every_refusal_is_the_python_checks_with_the_compiled_check(check_path):
    """A planned layer called wrongly (each of the hot-path tests' bad calls, plus a batch written in place
    after ``init_forward_metadata``): the same error and message, nothing written, with either path."""
    from test_hot_path import _bad_calls

    for case, ((q, k, v), exc, match) in _bad_calls().items():
        backend, cache = make()
        batch = decode_batch(cache)
        backend.init_forward_metadata(batch)
        backend.forward(*qkv(2), LAYER, batch)
        backend.forward(*qkv(2), LAYER, batch)  # (planned, and the compiled check passed once)
        before = snapshot(cache)
        with pytest.raises(exc, match=match):
            backend.forward(q, k, v, LAYER, batch)
        assert same(cache, before), case
    backend, cache = make()
    batch = decode_batch(cache)
    backend.init_forward_metadata(batch)
    backend.forward(*qkv(2), LAYER, batch)
    backend.forward(*qkv(2), LAYER, batch)
    batch.seq_lens.add_(0)  # written in place: its counter moved
    before = snapshot(cache)
    with pytest.raises(ShapeError, match=r"seq_lens.*changed after init_forward_metadata"):
        backend.forward(*qkv(2), LAYER, batch)
    assert same(cache, before)
    path, answers = check_path
    assert (answers[-1] is False) if path == "compiled" else not answers


def test_the_setting_and_the_notes_doctor_prints(monkeypatch, tmp_path):
    layer_ok, expectation, note = paged._load_speedups({})
    assert layer_ok is sp.layer_ok and expectation is sp.expectation and note.startswith("in use")
    assert paged._load_speedups({"ATTNPLUG_SPEEDUPS": "1"})[0] is sp.layer_ok
    assert paged._load_speedups({"ATTNPLUG_SPEEDUPS": "0"}) == (
        None, None, "off (ATTNPLUG_SPEEDUPS=0): the per-layer check runs in Python")
    with pytest.raises(ConfigError, match=r"ATTNPLUG_SPEEDUPS='yes': expected 0 .* or 1"):
        paged._load_speedups({"ATTNPLUG_SPEEDUPS": "yes"})
    monkeypatch.setitem(sys.modules, "attnplug_speedups", None)  # not installed
    assert paged._load_speedups({})[:2] == (None, None)
    assert paged._load_speedups({})[2].startswith("not installed (pip install ./speedups)")
    # installed but not loadable (built for another torch): why, and the Python check
    broken = tmp_path / "attnplug_speedups"
    broken.mkdir()
    (broken / "__init__.py").write_text("raise ImportError('undefined symbol: _ZN3c10 (built for another torch)')\n")
    monkeypatch.delitem(sys.modules, "attnplug_speedups")
    monkeypatch.syspath_prepend(str(tmp_path))
    layer_ok, expectation, note = paged._load_speedups({})
    assert (layer_ok, expectation) == (None, None)
    assert note == ("installed but not loadable (undefined symbol: _ZN3c10 (built for another torch)): the per-layer "
                    "check runs in Python; rebuild it")
    monkeypatch.delitem(sys.modules, "attnplug_speedups", raising=False)


def test_doctor_reports_which_check_runs():
    from attnplug.cli.doctor_cmd import _speedups_note

    assert _speedups_note() == paged.SPEEDUPS_NOTE


def test_a_bad_setting_is_one_line_and_exit_2_naming_the_variable():
    """``ATTNPLUG_SPEEDUPS=yes``: the command that builds a backend stops with one line naming the variable and
    what it takes (a subprocess: the setting is read once, when ``attnplug.paged`` loads)."""
    import subprocess

    env = dict(os.environ, ATTNPLUG_SPEEDUPS="yes", ATTNPLUG_PLUGINS="attnplug-torch-native")
    proc = subprocess.run([sys.executable, "-m", "attnplug", "doctor"], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc
    assert proc.stderr.strip().splitlines() == [
        "attnplug doctor: ATTNPLUG_SPEEDUPS='yes': expected 0 (the Python per-layer check) or 1 (the compiled check "
        "of attnplug-speedups where it is installed)"]
