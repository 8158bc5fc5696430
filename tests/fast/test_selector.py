"""The per-mode selector, and proof that it is the only copy of the rule."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import pytest

import attnplug
from attnplug import AttentionConfig, ForwardMode, HybridBackend
from attnplug import hybrid as hybrid_module
from attnplug.selector import backend_name_for_mode, half_for_mode
from tests.protocol_spy import RecordingBackend

# Written from SPEC.md by hand: mode -> half, for speculative_attention_mode prefill / decode.
EXPECTED_HALF = {
    ForwardMode.EXTEND: ("prefill", "prefill"),
    ForwardMode.DECODE: ("decode", "decode"),
    ForwardMode.MIXED: ("prefill", "prefill"),
    ForwardMode.IDLE: ("decode", "decode"),
    ForwardMode.TARGET_VERIFY: ("prefill", "decode"),
    ForwardMode.DRAFT_EXTEND: ("prefill", "prefill"),
    ForwardMode.DRAFT_EXTEND_V2: ("prefill", "decode"),
}
CORE = Path(attnplug.__file__).parent


def test_expected_table_covers_every_mode():
    assert set(EXPECTED_HALF) == set(ForwardMode)


@pytest.mark.parametrize("mode,spec", list(itertools.product(list(ForwardMode), ["prefill", "decode"])))
def test_half_for_mode(mode, spec):
    assert half_for_mode(mode, spec) == EXPECTED_HALF[mode][spec == "decode"]


class _Stamped:
    def __init__(self, p, d):
        self.prefill_attention_backend_str = p
        self.decode_attention_backend_str = d


@pytest.mark.parametrize(
    "mode,spec,stamped", list(itertools.product(list(ForwardMode), ["prefill", "decode"], [True, False]))
)
def test_backend_name_prefers_stamps_then_pair(mode, spec, stamped):
    cfg = AttentionConfig(prefill_attention_backend="cfg_p", decode_attention_backend="cfg_d",
                          speculative_attention_mode=spec)
    backend = _Stamped("stamp_p", "stamp_d") if stamped else _Stamped(None, None)
    half = EXPECTED_HALF[mode][spec == "decode"]
    want = ("stamp_" if stamped else "cfg_") + half[0]
    assert backend_name_for_mode(mode, cfg, backend) == want


def test_unstamped_falls_back_to_pair_not_base_field():
    cfg = AttentionConfig(prefill_attention_backend="fa3", decode_attention_backend="flashinfer")
    assert backend_name_for_mode(ForwardMode.DECODE, cfg, None) == "flashinfer"
    assert backend_name_for_mode(ForwardMode.EXTEND, cfg, _Stamped(None, None)) == "fa3"


class _Batch:
    def __init__(self, mode):
        self.forward_mode = mode


@pytest.mark.parametrize("mode,spec", list(itertools.product(
    [m for m in ForwardMode if m is not ForwardMode.IDLE], ["prefill", "decode"])))
def test_hybrid_routes_like_the_selector(mode, spec):
    h = HybridBackend(RecordingBackend("P"), RecordingBackend("D"), spec)
    assert h.forward(None, None, None, None, _Batch(mode)) == EXPECTED_HALF[mode][spec == "decode"][0].upper()


def test_hybrid_calls_the_selector_function(monkeypatch):
    calls = []

    def spy(mode, spec="prefill"):
        calls.append((mode, spec))
        return "decode"

    monkeypatch.setattr(hybrid_module, "half_for_mode", spy)
    h = HybridBackend(RecordingBackend("P"), RecordingBackend("D"), "decode")
    assert h.forward(None, None, None, None, _Batch(ForwardMode.EXTEND)) == "D"
    assert calls == [(ForwardMode.EXTEND, "decode")]


def _modules():
    return [p for p in CORE.rglob("*.py") if "testing" not in p.parts]


def test_no_second_mode_table_in_the_core():
    """Only selector.py may compare ``speculative_attention_mode`` with a half's name, and
    the hybrid backend must not mention ForwardMode at all (it routes through the selector)."""
    offenders = []
    for path in _modules():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare):
                operands = [node.left, *node.comparators]
                names = {n.attr if isinstance(n, ast.Attribute) else getattr(n, "id", None) for n in operands}
                consts = {n.value for n in operands if isinstance(n, ast.Constant)}
                if "speculative_attention_mode" in names and consts & {"prefill", "decode"}:
                    offenders.append(f"{path.name}:{node.lineno}")
    assert all(o.startswith("selector.py") for o in offenders), offenders
    assert "ForwardMode" not in (CORE / "hybrid.py").read_text()
