"""flashinfer's MLA calls (``BatchMLAPagedAttentionWrapper``) against flashinfer-python's real signatures.

The plugin runs on CPU against the emulator of ``tests/plugins/test_flashinfer_mla.py`` (a mock: the kernels
need a GPU); every recorded ``__init__``/``plan``/``run`` must bind to each supported release's recorded
signature (0.5.0 … 0.7.4, ``signatures.json``; the wrapper moved from ``flashinfer/mla.py`` to the
``flashinfer/mla`` package in 0.7) and to the installed package's, and meet the preconditions in
``_library_contracts`` (int32 CSR arrays, the 512 + 64 latent, one dtype, contiguous last dimensions).
"""

from __future__ import annotations

import importlib
import inspect
import sys

import pytest

import _flashinfer_family_helpers as H
import _library_contracts as C
from _drive import check_versions
from attnplug import ForwardMode
from attnplug_flashinfer import LIBRARY, MIN_LIBRARY_VERSION
from packaging.version import Version as version_key

import test_flashinfer_mla as T

SUPPORTED = [(LIBRARY, v) for v in C.versions(LIBRARY) if version_key(v) >= version_key(MIN_LIBRARY_VERSION)]
QUAL = "flashinfer.mla.BatchMLAPagedAttentionWrapper"


def _unchecked(cls):
    attrs = {m: getattr(cls, m).__wrapped__ for m in ("plan", "run") if hasattr(getattr(cls, m), "__wrapped__")}
    return type(cls.__name__, (cls,), attrs)


def _install(monkeypatch):
    rec = C.Recorder()
    mla = H.fake_module("flashinfer.mla", "0", BatchMLAPagedAttentionWrapper=rec.wrap_class(QUAL, _unchecked(T.EmuMLAWrapper)))
    monkeypatch.setitem(sys.modules, "flashinfer", H.fake_module("flashinfer", "0", mla=mla))
    monkeypatch.setitem(sys.modules, "flashinfer.mla", mla)
    import importlib.metadata as im

    real = im.version
    monkeypatch.setattr(im, "version", lambda n: MIN_LIBRARY_VERSION if n == LIBRARY else real(n))
    return rec


CASES = {name: T.CASES[name] for name in ("decode", "extend_prefix", "verify_chain")}


def _record(rec, case, dtype):
    mode, prefix, ext = CASES[case]
    cache, batch, spec, q, lat = T.mla_problem(mode, prefix, ext, page_size=16, dtype=dtype)
    be = T.build(cache, spec, str(dtype).replace("torch.", ""))
    rec.calls.clear()
    be.init_forward_metadata(batch)
    be.forward(q, lat[0], None, spec[0], batch)
    return list(rec.calls)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_mla_calls_bind_to_every_supported_flashinfer_mocked_no_gpu(monkeypatch, case, dtype):
    import torch

    rec = _install(monkeypatch)
    calls = _record(rec, case, getattr(torch, dtype))
    assert [c.qualname.rsplit(".", 1)[1] for c in calls] == ["__init__", "plan", "run"]
    check_versions(SUPPORTED, lambda lib, v: ([], calls))
    plan = calls[1]
    causal = plan.args[8] if len(plan.args) > 8 else plan.kwargs["causal"]
    assert causal is (CASES[case][0] is not ForwardMode.DECODE)


def test_mla_calls_bind_to_the_installed_flashinfer(monkeypatch):
    """``inspect.signature`` of the real, installed ``flashinfer.mla.BatchMLAPagedAttentionWrapper``."""
    import torch

    try:
        cls = importlib.import_module("flashinfer.mla").BatchMLAPagedAttentionWrapper
    except ImportError:
        pytest.skip("flashinfer-python is not installed in this environment")
    import importlib.metadata as im

    version = im.distribution(LIBRARY).version
    real = {f"{QUAL}.{m}": inspect.signature(getattr(cls, m)) for m in ("__init__", "plan", "run")}
    rec = _install(monkeypatch)
    calls = []
    for case in CASES:
        calls += _record(rec, case, torch.float16)
    found = [p for call in calls for p in C.problems(call, LIBRARY, version, sig=real[call.qualname])]
    assert not found, "\n".join(dict.fromkeys(found))


def test_a_wrong_call_is_caught_by_the_binding():
    """The tier can fail: a ``plan`` with the latent dims swapped and int64 indices breaks two preconditions,
    and a misspelt keyword does not bind."""
    import torch

    i64 = torch.zeros(3, dtype=torch.int64)
    bad = C.Call(f"{QUAL}.plan", (i64, i64, i64[:2], i64[:2], 8, 64, 512, 16, True, 0.1, torch.float16, torch.float16),
                 {})
    found = C.problems(bad, LIBRARY, "0.5.0")
    assert any("must be int32" in p for p in found) and any("kernels exist for 512/64" in p for p in found)
    typo = C.Call(f"{QUAL}.run", (), {"q_nope": None, "qpe": None})
    assert any("does not bind" in p for p in C.problems(typo, LIBRARY, "0.7.4"))
