"""The backend protocol: defaults, dispatch, and containers/wrappers forwarding every method."""

from __future__ import annotations

import pytest
import torch

from attnplug import (
    AttentionBackend,
    BackendWrapper,
    ForwardBatch,
    ForwardMode,
    HybridBackend,
    LayerSpec,
    NotSupportedError,
)
from attnplug.backend import OPTIONAL_METHODS, MetadataGuard
from attnplug.errors import MetadataNotInitializedError
from attnplug.backend import PROTOCOL_METHODS, REQUIRED_METHODS
from tests.protocol_spy import RecordingBackend, SpyBackend, call_protocol_method

LAYER = LayerSpec(layer_id=0, num_heads=4, num_kv_heads=2, head_dim=8, v_head_dim=6)


def test_required_methods_raise_naming_the_class():
    class Empty(AttentionBackend):
        pass

    for name in REQUIRED_METHODS:
        with pytest.raises(NotImplementedError, match="Empty"):
            getattr(Empty(), name)(*([None] * (1 if name == "init_forward_metadata" else 5)))


def test_optional_methods_have_explicit_defaults_on_the_base():
    for name in OPTIONAL_METHODS:
        assert name in vars(AttentionBackend), name
    r = RecordingBackend()
    assert r.get_cuda_graph_seq_len_fill_value() == 1
    assert r.init_cuda_graph_state(8, 8) is None
    assert r.on_after_cuda_graph_warmup() is None
    b = ForwardBatch.decode([0], [3], [5])
    r.init_forward_metadata_capture_cuda_graph(b)
    r.init_forward_metadata_replay_cuda_graph(b)
    assert r.calls == [("init_forward_metadata", ForwardMode.DECODE)] * 2


def test_stamps_default_to_none():
    r = RecordingBackend()
    assert (r.prefill_attention_backend_str, r.decode_attention_backend_str) == (None, None)


@pytest.mark.parametrize("mode", list(ForwardMode))
def test_forward_dispatches_by_mode(mode):
    r = RecordingBackend()
    q = torch.zeros(0, 4, 8)
    batch = type("B", (), {"forward_mode": mode})()
    out = r.forward(q, None, None, LAYER, batch)
    if mode is ForwardMode.IDLE:
        assert out.shape == (0, 4, 6) and out.dtype == q.dtype
        assert r.calls == []
    else:
        want = "forward_decode" if mode is ForwardMode.DECODE else "forward_extend"
        assert out == "r" and r.calls == [(want, mode)]


@pytest.mark.parametrize("container", [HybridBackend, BackendWrapper])
def test_containers_define_every_protocol_method(container):
    """No method may fall through to the base default: that is how wrappers forget children."""
    missing = [m for m in PROTOCOL_METHODS if m not in vars(container)]
    assert missing == []


def _call(backend, name, batch):
    return call_protocol_method(backend, name, batch, LAYER)


@pytest.mark.parametrize("name", PROTOCOL_METHODS)
def test_wrapper_forwards_each_method(name):
    inner = SpyBackend("inner")
    w = BackendWrapper(inner)
    _call(w, name, type("B", (), {"forward_mode": ForwardMode.EXTEND})())
    assert inner.names[0] == name


@pytest.mark.parametrize("name", PROTOCOL_METHODS)
@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE])
def test_hybrid_forwards_each_method_to_the_right_halves(name, mode):
    p, d = SpyBackend("p"), SpyBackend("d")
    _call(HybridBackend(p, d), name, type("B", (), {"forward_mode": mode})())
    both = name in {"init_cuda_graph_state", "on_after_cuda_graph_warmup", "not_supported_reasons"}
    decode_only = name == "get_cuda_graph_seq_len_fill_value"
    if both:
        assert p.names[:1] == [name] and d.names[:1] == [name]
    elif decode_only:
        assert d.names[:1] == [name] and p.names == []
    else:
        served, other = (d, p) if mode is ForwardMode.DECODE else (p, d)
        assert served.names[:1] == [name] and other.names == []


def test_metadata_guard_rejects_forward_before_init():
    g = MetadataGuard("demo")
    b1, b2 = object(), object()
    with pytest.raises(MetadataNotInitializedError, match="init_forward_metadata"):
        g.require(b1)
    g.set(b1, {"m": 1})
    assert g.require(b1) == {"m": 1}
    with pytest.raises(MetadataNotInitializedError):
        g.require(b2)


def test_require_supported_memoises_the_verdict_per_layer_object():
    class Picky(RecordingBackend):
        def __init__(self):
            super().__init__()
            self.checks = 0

        def layer_reasons(self, layer):
            self.checks += 1
            return ["sinks are not claimed"] if layer.sinks is not None else []

    b = Picky()
    for _ in range(3):
        b.require_supported(LAYER)  # every forward of this layer
    assert b.checks == 1
    sinky = LayerSpec(layer_id=1, num_heads=4, num_kv_heads=2, head_dim=8, sinks=torch.zeros(4))
    for _ in range(2):
        with pytest.raises(NotSupportedError, match="Picky.*sinks are not claimed"):
            b.require_supported(sinky)
    assert b.checks == 2


def test_require_supported_defaults_to_the_declared_capabilities():
    window = LayerSpec(layer_id=0, num_heads=4, num_kv_heads=2, head_dim=8, sliding_window=4)
    with pytest.raises(NotSupportedError, match="sliding_window=4 is not claimed"):
        RecordingBackend().require_supported(window)


class Noted(RecordingBackend):
    def __init__(self, *notes):
        super().__init__()
        self.notes = list(notes)

    def runtime_notes(self):
        return self.notes


class RaisingNotes(RecordingBackend):
    def runtime_notes(self):
        raise KeyError("no such path")


def test_runtime_notes_default_to_the_childrens_once_each():
    from attnplug.backend import runtime_notes_of

    assert runtime_notes_of(RecordingBackend()) == []
    assert runtime_notes_of(BackendWrapper(Noted("fused", "eager for layer 3"))) == ["fused", "eager for layer 3"]
    hybrid = HybridBackend(Noted("a", "shared"), Noted("shared", "b"))
    assert runtime_notes_of(hybrid) == ["a", "shared", "b"]


def test_a_raising_runtime_notes_hook_becomes_a_note():
    from attnplug.backend import runtime_notes_of

    assert runtime_notes_of(RaisingNotes()) == ["runtime_notes() raised KeyError: 'no such path'"]
    # inside a container too: the other child's notes survive
    assert runtime_notes_of(HybridBackend(RaisingNotes(), Noted("b"))) == [
        "runtime_notes() raised KeyError: 'no such path'", "b"]
