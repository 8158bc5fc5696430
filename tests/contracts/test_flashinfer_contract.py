"""flashinfer's wrapper calls against flashinfer-python's real signatures: the installed package
(imports on CPU; the tier installs it) and the recorded 0.5.0 … 0.7.4 sources, plus the library's
preconditions: int32 CSR indices; fp8 KV under ``backend="auto"`` only from 0.6.4 (SM90 picks FA3);
split arguments only on the FA2 path; ``fixed_split_size`` not under CUDA graphs."""

from __future__ import annotations

import importlib
import inspect
import sys

import pytest
import torch

import _flashinfer_family_helpers as H
import _library_contracts as C
from _drive import check_versions, forward
from attnplug import AttentionConfig, BuildContext, ForwardMode
from packaging.version import Version as version_key
from attnplug_flashinfer import LIBRARY, MIN_LIBRARY_VERSION

import test_flashinfer as T

WRAPPERS = {"BatchDecodeWithPagedKVCacheWrapper": T.EmuDecodeWrapper,
            "BatchPrefillWithPagedKVCacheWrapper": T.EmuPagedPrefillWrapper}
SUPPORTED = [(LIBRARY, v) for v in C.versions(LIBRARY) if version_key(v) >= version_key(MIN_LIBRARY_VERSION)]


def _unchecked_class(cls):
    """The emulator class with its own precondition decorators lifted (this tier checks per version)."""
    attrs = {m: getattr(cls, m).__wrapped__ for m in ("plan", "run") if hasattr(getattr(cls, m), "__wrapped__")}
    return type(cls.__name__, (cls,), attrs)


@pytest.fixture
def recorder(monkeypatch):
    return _install_recorder(monkeypatch)


def _install_recorder(monkeypatch):
    rec = C.Recorder()
    mod = H.fake_module("flashinfer", "0", **{name: rec.wrap_class(f"flashinfer.{name}", _unchecked_class(cls))
                                               for name, cls in WRAPPERS.items()})
    monkeypatch.setitem(sys.modules, "flashinfer", mod)
    import importlib.metadata as im

    real = im.version
    monkeypatch.setattr(im, "version", lambda n: MIN_LIBRARY_VERSION if n == LIBRARY else real(n))
    return rec


def _record(rec, pb, *, fp8=False, deterministic=False, save=True, graph=False):
    from attnplug_flashinfer.backend import FlashInferBackend

    assert pb.cache.quantized is fp8, "make fp8 problems with _problem(case, fp8=True)"
    c = pb.cache
    ctx = BuildContext(AttentionConfig(deterministic=deterministic), H.host(
        "cuda", {LIBRARY: MIN_LIBRARY_VERSION}, compute_capability=(9, 0)), dtype="float16",
        kv_cache_dtype="float8_e4m3fn" if fp8 else "float16", num_heads=pb.layer.num_heads,
        num_kv_heads=pb.layer.num_kv_heads, head_dim=pb.layer.head_dim, page_size=c.page_size, kv_cache=c,
        max_context_len=c.max_context_len, layers=(pb.layer,))
    be = FlashInferBackend(ctx)
    if graph:
        be.init_cuda_graph_state(8, 64)
        be.init_forward_metadata_capture_cuda_graph(pb.batch)
        be.init_forward_metadata_replay_cuda_graph(pb.batch)
        be.forward(pb.q, pb.k, pb.v, pb.layer, pb.batch)
    else:
        forward(be, pb, save=save)
    return rec.calls


def _real(qualname):
    """The installed flashinfer's function for ``qualname`` (``None`` when flashinfer is not installed)."""
    try:
        mod = importlib.import_module("flashinfer")
    except ImportError:
        return None
    obj = mod
    for part in qualname.split(".")[1:]:
        obj = getattr(obj, part)
    return obj


CASES = {
    "decode": dict(mode=ForwardMode.DECODE, prefix_lens=[5, 9], extend_lens=[1, 1]),
    "extend": dict(mode=ForwardMode.EXTEND, prefix_lens=[0, 6], extend_lens=[3, 4]),
    "verify_tree": dict(mode=ForwardMode.TARGET_VERIFY, prefix_lens=[4, 7], extend_lens=[3, 3], tree_mask=True),
}
#: the fp8 variant's cache scales (k_scale, v_scale): they must reach run() as floats
FP8_SCALES = (0.04, 2.5)


def _problem(case, fp8=False, **_):
    """``CASES[case]`` on 4-token pages; ``fp8``: an e4m3 cache with ``FP8_SCALES``."""
    extra = dict(kv_dtype=torch.float8_e4m3fn, kv_scales=FP8_SCALES) if fp8 else {}
    return H.make_problem(page_size=4, **CASES[case], **extra)


VARIANTS = {"plain": {}, "fp8_kv": dict(fp8=True), "deterministic": dict(deterministic=True),
            "no_cache_write": dict(save=False), "deterministic_no_cache_write": dict(deterministic=True, save=False)}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("case", sorted(CASES))
def test_calls_bind_to_every_supported_flashinfer(recorder, case, variant):
    """Bug 4 (fp8 KV: backend="auto" before 0.6.4) and bug 5 (split arguments dropped off the FA2 path)."""
    kw = VARIANTS[variant]
    calls = _record(recorder, _problem(case, **kw), **kw)
    check_versions(SUPPORTED, lambda lib, v: ([], calls))
    runs = [c for c in calls if c.qualname.endswith(".run")]
    want = {"k_scale": FP8_SCALES[0], "v_scale": FP8_SCALES[1]} if kw.get("fp8") else {}
    assert runs and all({n: c.kwargs[n] for n in ("k_scale", "v_scale") if n in c.kwargs} == want for c in runs)


@pytest.mark.parametrize("case", ["decode", "verify_tree"])
def test_cuda_graph_calls_bind_deterministic(recorder, case):
    calls = _record(recorder, _problem(case), deterministic=True, graph=True)
    assert any(c.owner.get("use_cuda_graph") for c in calls if c.qualname.endswith(".plan"))
    check_versions(SUPPORTED, lambda lib, v: ([], calls))


@pytest.mark.parametrize("variant", ["plain", "fp8_kv", "deterministic"])
def test_calls_bind_to_the_installed_flashinfer(monkeypatch, variant):
    """``inspect.signature`` of the real, installed package (the tier installs flashinfer-python)."""
    LIBRARY_CALLS = [f"flashinfer.{w}.{m}" for w in WRAPPERS for m in ("__init__", "plan", "run")]
    if _real(LIBRARY_CALLS[0]) is None:
        pytest.skip("flashinfer-python is not installed in this environment")
    import importlib.metadata as im

    version = im.distribution(LIBRARY).version
    real = {q: inspect.signature(_real(q)) for q in LIBRARY_CALLS}  # before the emulator replaces the module
    recorder = _install_recorder(monkeypatch)
    calls = []
    for case in ("decode", "extend", "verify_tree"):
        recorder.calls.clear()
        calls += _record(recorder, _problem(case, **VARIANTS[variant]), **VARIANTS[variant])
    found = [p for call in calls
             for p in C.problems(call, LIBRARY, version, sig=real[call.qualname])]
    assert not found, "\n".join(dict.fromkeys(found))


def test_the_recorded_signatures_match_the_installed_package():
    """The extractor's reading of the source equals what Python reports for the installed release."""
    import importlib.metadata as im

    try:
        version = im.distribution(LIBRARY).version
    except im.PackageNotFoundError:
        pytest.skip("flashinfer-python is not installed in this environment")
    if version not in C.versions(LIBRARY):
        pytest.skip(f"flashinfer-python {version} is not among the recorded versions")
    for qualname in C.recorded()[LIBRARY][version]["functions"]:
        real = inspect.signature(_real(qualname))
        got = C.signature(LIBRARY, version, qualname)
        names = [(p.name, p.kind) for p in real.parameters.values()]  # methods: self included
        assert [(p.name, p.kind) for p in got.parameters.values()] == names, qualname


def test_fixed_split_size_is_flagged_off_the_fa2_path_and_under_graphs():
    """The precondition itself can fail: what the old plugin passed is refused."""
    sig = C.signature(LIBRARY, "0.5.0", "flashinfer.BatchPrefillWithPagedKVCacheWrapper.plan")
    i32 = torch.zeros(2, dtype=torch.int32)
    call = C.Call("flashinfer.BatchPrefillWithPagedKVCacheWrapper.plan", (i32, i32, i32, i32, 4, 2, 64, 4),
                  dict(causal=True, fixed_split_size=4096), owner={"backend": "auto", "use_cuda_graph": True})
    found = C.problems(call, LIBRARY, "0.5.0", sig=sig)
    assert any("only the FA2 path honours them" in p for p in found)
    assert any("not guaranteed under CUDA graphs" in p for p in found)
