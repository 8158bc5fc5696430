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


# -- issue 27 ------------------------------------------------------------------------------------------
def _ctx(pb, *, layers=None, deterministic=False, kv_cache_dtype=None, **kw):
    c = pb.cache
    return BuildContext(AttentionConfig(deterministic=deterministic), H.host(
        "cuda", {LIBRARY: MIN_LIBRARY_VERSION}, compute_capability=(9, 0)), dtype="float16",
        kv_cache_dtype=kv_cache_dtype, num_heads=pb.layer.num_heads, num_kv_heads=pb.layer.num_kv_heads,
        head_dim=pb.layer.head_dim, page_size=c.page_size, kv_cache=c, max_context_len=c.max_context_len,
        layers=layers if layers is not None else (pb.layer,), **kw)


def _inits(calls, cls):
    return [c for c in calls if c.qualname == f"flashinfer.{cls}.__init__"]


@pytest.mark.parametrize("variant", ["plain", "fp8_kv", "deterministic", "gqa_8"])
def test_every_decode_wrapper_is_pinned_to_fa2(recorder, variant):
    """Bug 3: decode wrappers were built without ``backend=``; fp8 KV or determinism switch decode to tensor
    cores, where ``"auto"`` resolves to FA3 on SM90 (flashinfer 0.6.0-0.6.3 for every dtype, fp8 in every
    release): the invalid fp8 kernel again and ``disable_split_kv`` silently dropped."""
    kw = {"fp8_kv": dict(fp8=True), "deterministic": dict(deterministic=True)}.get(variant, {})
    pb = _problem("decode", **kw) if variant != "gqa_8" else H.make_problem(
        page_size=4, num_heads=8, num_kv_heads=1, **CASES["decode"])
    calls = _record(recorder, pb, **kw)
    inits = _inits(calls, "BatchDecodeWithPagedKVCacheWrapper")
    assert inits and all(c.kwargs.get("backend") == "fa2" for c in inits), [c.kwargs for c in inits]
    check_versions(SUPPORTED, lambda lib, v: ([], calls))


@pytest.mark.parametrize("version, fp8, deterministic, flagged", [
    ("0.6.0", False, True, True), ("0.6.0", True, False, True), ("0.5.0", True, False, True),
    ("0.6.4", False, True, False), ("0.7.4", False, True, False), ("0.7.4", True, True, True),
    ("0.5.0", False, True, False),
])
def test_the_decode_auto_data_flags_what_it_says(version, fp8, deterministic, flagged):
    """The recorded per-version choice of tensor-core decode under ``backend="auto"`` can fail a call."""
    sig = C.signature(LIBRARY, version, "flashinfer.BatchDecodeWithPagedKVCacheWrapper.plan")
    i32 = torch.zeros(2, dtype=torch.int32)
    kw = dict(q_data_type=torch.float16, kv_data_type=torch.float8_e4m3fn if fp8 else torch.float16)
    if deterministic:
        kw["disable_split_kv"] = True
    call = C.Call("flashinfer.BatchDecodeWithPagedKVCacheWrapper.plan", (i32, i32, i32, 4, 2, 64, 4), kw,
                  owner={"backend": "auto", "use_tensor_cores": True})
    found = C.problems(call, LIBRARY, version, sig=sig)
    assert bool(found) is flagged, found
    pinned = C.Call(call.qualname, call.args, kw, owner={"backend": "fa2", "use_tensor_cores": True})
    assert not C.problems(pinned, LIBRARY, version, sig=sig)


SEQUENCES = {"extend_then_verify": ("extend", "verify_tree"), "verify_then_extend_then_verify":
             ("verify_tree", "extend", "verify_tree"), "extend_decode_verify": ("extend", "decode", "verify_tree")}


@pytest.mark.parametrize("variant", ["plain", "deterministic", "window"])
@pytest.mark.parametrize("sequence", sorted(SEQUENCES))
def test_verify_after_extend_never_reuses_the_extend_wrapper(recorder, sequence, variant):
    """Bug 4: extend and target-verify shared one cached eager prefill wrapper; before 0.6.5 its ``"auto"``
    choice sticks, so after an extend fixed FA3 (SM90) a verify with a custom mask fails. The verify gets a
    wrapper of its own, pinned to fa2; the sequence must bind on every version (``sequence_problems``)."""
    from attnplug_flashinfer.backend import FlashInferBackend

    win = dict(sliding_window=5) if variant == "window" else {}
    problems = {case: H.make_problem(page_size=4, seed=i, **{"tree_mask": True, **CASES[case]}, **win)
                for i, case in enumerate(("extend", "decode", "verify_tree"))}
    first = problems[SEQUENCES[sequence][0]]
    # one cache for the whole sequence: every problem's pages and rows fit the largest one's
    be = FlashInferBackend(_ctx(first, deterministic=variant == "deterministic"))
    for case in SEQUENCES[sequence]:
        pb = problems[case]
        be.kv_cache = pb.cache
        out = forward(be, pb)
        H.check_output(pb, out, T.TOL)
    verify_plans = [c for c in recorder.calls if c.qualname.endswith("PrefillWithPagedKVCacheWrapper.plan")
                    and c.kwargs.get("custom_mask") is not None]
    assert verify_plans and all(c.owner["backend"] == "fa2" for c in verify_plans)
    check_versions(SUPPORTED, lambda lib, v: ([], recorder.calls))


@pytest.mark.parametrize("case", sorted(CASES))
def test_fp8_decisions_read_the_cache_handed_in(recorder, case):
    """Bug 8a: tensor cores and the pinned prefill backend were decided from ``BuildContext.kv_cache_dtype``;
    an engine that leaves it unset (model dtype) and hands in an fp8 cache got ``backend="auto"`` prefill
    and CUDA-core decode over fp8. The decisions follow ``self.cache``."""
    from attnplug_flashinfer.backend import FlashInferBackend

    pb = _problem(case, fp8=True)
    be = FlashInferBackend(_ctx(pb, kv_cache_dtype=None))
    out = forward(be, pb)
    H.check_output(pb, out, T.TOL)
    for c in _inits(recorder.calls, "BatchDecodeWithPagedKVCacheWrapper"):
        assert c.kwargs["use_tensor_cores"] is True
    for c in _inits(recorder.calls, "BatchPrefillWithPagedKVCacheWrapper"):
        assert c.kwargs["backend"] == "fa2"
    check_versions(SUPPORTED, lambda lib, v: ([], recorder.calls))


def _capture(be, pb):
    be.init_cuda_graph_state(8, 64)
    be.init_forward_metadata_capture_cuda_graph(pb.batch)


@pytest.mark.parametrize("change", ["k", "v", "both", "none"])
@pytest.mark.parametrize("case", ["decode", "verify_tree"])
def test_kv_scales_changed_after_capture_are_refused(recorder, case, change):
    """Bug 8b: ``run(k_scale=, v_scale=)`` takes floats, baked into a captured graph; a replay after
    ``set_kv_scales`` silently dequantized with the old scales. The replay refuses, naming the layer."""
    from attnplug.errors import AttnplugError
    from attnplug_flashinfer.backend import FlashInferBackend

    pb = _problem(case, fp8=True)
    be = FlashInferBackend(_ctx(pb))
    _capture(be, pb)
    H.check_output(pb, be.forward(pb.q, pb.k, pb.v, pb.layer, pb.batch), T.TOL)
    k, v = FP8_SCALES
    new = {"k": (k * 2, v), "v": (k, v * 2), "both": (k * 2, v * 2), "none": (k, v)}[change]
    pb.cache.set_kv_scales(0, *new)
    if change == "none":
        be.init_forward_metadata_replay_cuda_graph(pb.batch)
        return
    with pytest.raises(AttnplugError, match=r"KV scales changed after the CUDA graph.*layer 0"):
        be.init_forward_metadata_replay_cuda_graph(pb.batch)


LAYER_CONFIGS = {
    "window_vs_full": (dict(sliding_window=5), {}),
    "softcap_vs_plain": (dict(logit_cap=2.0), {}),
    "gemma_like": (dict(sliding_window=3, logit_cap=5.0), dict(logit_cap=5.0)),
}


@pytest.mark.parametrize("configs", sorted(LAYER_CONFIGS))
@pytest.mark.parametrize("case", ["decode", "verify_tree"])
def test_capture_serves_layers_that_differ_in_window_or_softcap(recorder, case, configs):
    """Bug 7: a captured graph held one plan per batch size, so Gemma-style models (layers differing in
    window or soft-cap) could not use CUDA graphs at all. One wrapper set per distinct layer configuration:
    every layer matches the reference under capture and replay, and every call binds."""
    from attnplug import LayerSpec
    from attnplug.testing.reference import reference_attention

    from attnplug_flashinfer.backend import FlashInferBackend

    pb = _problem(case)
    base = pb.layer
    layers = tuple(LayerSpec(0, base.num_heads, base.num_kv_heads, base.head_dim, **kw)
                   for kw in LAYER_CONFIGS[configs])
    be = FlashInferBackend(_ctx(pb, layers=layers))
    _capture(be, pb)
    assert len(be._graph_wrappers[(pb.batch.batch_size, pb.batch.forward_mode.value)]) == 2
    for replay in (False, True):
        if replay:
            be.init_forward_metadata_replay_cuda_graph(pb.batch)
        for layer in layers:
            out = be.forward(pb.q, pb.k, pb.v, layer, pb.batch, save_kv_cache=False)
            ref = reference_attention(pb.q, pb.k, pb.v, layer, pb.batch, pb.k_before, pb.v_before,
                                      pb.cache.req_to_token, *pb.cache.kv_scales(0))
            torch.testing.assert_close(out.double(), ref, atol=3e-3, rtol=3e-3)
    check_versions(SUPPORTED, lambda lib, v: ([], recorder.calls))
    other = LayerSpec(0, base.num_heads, base.num_kv_heads, base.head_dim, sliding_window=7)
    with pytest.raises(Exception, match="was not captured"):
        be.forward(pb.q, pb.k, pb.v, other, pb.batch, save_kv_cache=False)
