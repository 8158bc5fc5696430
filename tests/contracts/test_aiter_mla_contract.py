"""aiter's MLA call (``aiter.mla.mla_decode_fwd``) against amd-aiter's real signatures (read from the ROCm/aiter
tags v0.1.9 and v0.1.10 by ``scripts/extract_signatures.py``; PyPI's amd-aiter stops at 0.1.7.post2.dev18) and
the preconditions in ``_library_contracts`` (4-D ``kv_buffer`` with one KV head, 576-wide contiguous ``q``,
``o`` of 512 in q's dtype, int32 indptrs, bf16, 16/32/64/128 heads, ``logit_cap <= 0``). The plugin runs on CPU
with the emulator of ``tests/plugins/test_aiter_mla.py`` (a mock: the kernel needs an MI300/MI350 GPU).
"""

from __future__ import annotations

import pytest
import torch

import _library_contracts as C
from _drive import check_versions
from attnplug_aiter import LIBRARY, MIN_LIBRARY_VERSION
from attnplug_aiter.backend import LIBRARY_CALLS
from packaging.version import Version as version_key

import test_aiter_mla as T

QUAL = "aiter.mla.mla_decode_fwd"
SUPPORTED = [(LIBRARY, v) for v in C.versions(LIBRARY) if version_key(v) >= version_key(MIN_LIBRARY_VERSION)]


def _record(fake_aiter, seq, page_size, heads):
    return C.record_mla_forward(QUAL, T.emulate_mla_decode_fwd.__wrapped__,
                                T.mla_problem(seq, page_size=page_size, heads=heads),
                                lambda cache, layer, kernel: T.build(cache, layer, mla_kernel=kernel))


def test_the_mla_call_is_listed_and_recorded_for_every_supported_aiter():
    assert QUAL in LIBRARY_CALLS
    assert SUPPORTED and all(C.signature(LIBRARY, v, QUAL) is not None for _, v in SUPPORTED)


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("heads", [16, 128])
def test_mla_decode_binds_to_every_supported_aiter_mocked_no_gpu(T_fake_aiter, page_size, heads):
    calls = _record(T_fake_aiter, [1, 40, 97], page_size, heads)
    assert [c.qualname for c in calls] == [QUAL]
    check_versions(SUPPORTED, lambda lib, v: ([], calls))


def test_a_wrong_call_is_caught_by_the_binding():
    """The tier can fail: fp16 with 8 heads over a 3-D buffer breaks three preconditions, a positive logit_cap
    a fourth; a misspelt keyword does not bind."""
    q = torch.zeros(2, 8, 576, dtype=torch.float16)
    o = torch.zeros(2, 8, 512, dtype=torch.float16)
    i32 = torch.zeros(3, dtype=torch.int32)
    bad = C.Call(QUAL, (q, torch.zeros(40, 1, 576, dtype=torch.float16), o, i32, i32, i32[:0], i32[:2], 1),
                 dict(sm_scale=0.1, logit_cap=30.0))
    found = C.problems(bad, LIBRARY, MIN_LIBRARY_VERSION)
    for words in ("kv_buffer must be 4-D", "8 query heads", "take bf16", "logit_cap=30.0 is not support yet"):
        assert any(words in p for p in found), (words, found)
    typo = C.Call(QUAL, bad.args, dict(softmax_scale=0.1))
    assert any("does not bind" in p for p in C.problems(typo, LIBRARY, MIN_LIBRARY_VERSION))


@pytest.fixture
def T_fake_aiter(monkeypatch):
    return T.install_fake_aiter(monkeypatch)
