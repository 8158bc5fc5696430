"""aiter against amd-aiter's real ``mha_batch_prefill_func`` / ``paged_attention_ragged`` (read from the
ROCm/aiter tags; PyPI's amd-aiter stops at 0.1.7.post2.dev18) and their preconditions."""

from __future__ import annotations

import sys

import pytest
import torch

import _flashinfer_family_helpers as H
import _library_contracts as C
from _drive import check_versions, forward, unchecked
from attnplug import AttentionConfig, BuildContext, ForwardMode
from packaging.version import Version as version_key
from attnplug_aiter import LIBRARY, MIN_LIBRARY_VERSION

import test_aiter as T

PREFILL, RAGGED = "aiter.mha_batch_prefill_func", "aiter.paged_attention_ragged"
SUPPORTED = [(LIBRARY, v) for v in C.versions(LIBRARY) if version_key(v) >= version_key(MIN_LIBRARY_VERSION)]


def _calls(monkeypatch, pb, save=True):
    import attnplug_aiter.backend as B

    rec = C.Recorder()
    mod = H.fake_module("aiter", MIN_LIBRARY_VERSION,
                        mha_batch_prefill_func=rec.wrap(PREFILL, unchecked(T.emu_mha_batch_prefill_func)),
                        paged_attention_ragged=rec.wrap(RAGGED, unchecked(T.emu_paged_attention_ragged)))
    monkeypatch.setitem(sys.modules, "aiter", mod)
    # mocked: which installed distribution owns the module (no ROCm build here)
    monkeypatch.setattr(B, "library_provider", lambda dists: (LIBRARY, MIN_LIBRARY_VERSION), raising=False)
    c = pb.cache
    ctx = BuildContext(AttentionConfig(), H.host("rocm", {LIBRARY: MIN_LIBRARY_VERSION}, gfx_arch="gfx942"),
                       dtype="bfloat16", num_heads=pb.layer.num_heads, num_kv_heads=pb.layer.num_kv_heads,
                       head_dim=pb.layer.head_dim, page_size=c.page_size, kv_cache=c,
                       max_context_len=c.max_context_len, layers=(pb.layer,))
    forward(B.AiterBackend(ctx), pb, save=save)
    return rec.calls


CASES = {
    "decode": dict(mode=ForwardMode.DECODE, prefix_lens=[5, 9], extend_lens=[1, 1]),
    "extend": dict(mode=ForwardMode.EXTEND, prefix_lens=[0, 6], extend_lens=[3, 4]),
    "decode_sinks": dict(mode=ForwardMode.DECODE, prefix_lens=[5, 9], extend_lens=[1, 1], sinks=True),
    "extend_sinks_window": dict(mode=ForwardMode.EXTEND, prefix_lens=[0, 6], extend_lens=[3, 4], sinks=True,
                                sliding_window=3),
    "verify_tree": dict(mode=ForwardMode.TARGET_VERIFY, prefix_lens=[4, 7], extend_lens=[3, 3], tree_mask=True),
}


@pytest.mark.parametrize("save", [True, False])
@pytest.mark.parametrize("case", sorted(CASES))
def test_calls_bind_to_every_supported_aiter(monkeypatch, case, save):
    pb = H.make_problem(page_size=1, dtype=torch.bfloat16, **CASES[case])
    calls = _calls(monkeypatch, pb, save)
    check_versions(SUPPORTED, lambda lib, v: ([], calls))


def test_sinks_need_the_floor_release(monkeypatch):
    """v0.1.9's ``mha_batch_prefill_func`` has no ``sink_ptr``: the 0.1.10 floor is needed, not decorative."""
    pb = H.make_problem(page_size=1, dtype=torch.bfloat16, **CASES["extend_sinks_window"])
    calls = [c for c in _calls(monkeypatch, pb) if c.qualname == PREFILL]
    assert any("does not bind" in p for p in C.problems(calls[0], LIBRARY, "0.1.9"))
