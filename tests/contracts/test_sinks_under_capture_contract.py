"""Sinks under CUDA-graph capture, for every plugin that hands sinks to a kernel (fa3, trtllm_mha, aiter).

PyTorch refuses a host-to-device copy (and the allocation a cast makes) while a stream is being captured,
so a backend that converts ``layer.sinks`` on every call breaks the first captured sink model. The plugins
convert each layer's sinks once, outside capture (the capture hooks run before the captured region), and
keep the converted tensor. No GPU here: ``simulated_capture`` is a MOCK of capture that makes converting
the layer's own (CPU-resident) sinks raise, as capture would; the emulators record the sinks each
capture-time and replay-time kernel call receives.
"""

from __future__ import annotations

import contextlib
import sys

import pytest
import torch

import _fa3_family_helpers as FH
import _flashinfer_family_helpers as IH
import _library_contracts as C
from _drive import unchecked
from attnplug import ForwardMode


@contextlib.contextmanager
def simulated_capture(monkeypatch, sinks):
    """MOCK of CUDA-graph capture: converting ``sinks`` (the layer's own tensor) raises, as PyTorch refuses
    a host-to-device copy during capture."""
    as_tensor, to = torch.as_tensor, torch.Tensor.to

    def refuse(what):
        raise AssertionError(f"{what} of the layer's CPU-resident sinks during CUDA-graph capture "
                             f"(PyTorch refuses the host-to-device copy while capturing)")

    def guarded_as_tensor(data, *a, **kw):
        if data is sinks and (a or kw):
            refuse("torch.as_tensor(..., dtype/device)")
        return as_tensor(data, *a, **kw)

    def guarded_to(self, *a, **kw):
        if self is sinks or self.data_ptr() == sinks.data_ptr():
            refuse("Tensor.to")
        return to(self, *a, **kw)

    with monkeypatch.context() as m:
        m.setattr(torch, "as_tensor", guarded_as_tensor)
        m.setattr(torch.Tensor, "to", guarded_to)
        yield


def _sinks_seen(calls, name):
    return [c.kwargs.get(name, c.args[-1] if name == "sink_ptr" and c.args else None) for c in calls]


# -- per plugin: build, the kernel name that takes sinks, the argument name, the dtype it reads --------
def _fa3(monkeypatch, mode):
    import test_fa3
    from attnplug_fa3 import SGL_KERNEL
    from attnplug_fa3.backend import FA3Backend

    p = FH.make_problem(dtype=torch.bfloat16, head_dim=64, page_size=16, sinks=True, mode=mode,
                        **({"ext": (1, 1, 1)} if mode is ForwardMode.DECODE else {}))
    rec = C.Recorder()
    ctx = FH.context(p, FH.cuda_host(90, sgl_kernel="0.3.21"), dtype="bfloat16", layers=(p.layer,))
    qual = "sgl_kernel.flash_attn.flash_attn_with_kvcache"
    be = FA3Backend(ctx, kernel=rec.wrap(qual, unchecked(test_fa3.emulate_flash_attn_with_kvcache)),
                    provider=SGL_KERNEL)
    return be, p, rec, "sinks", torch.bfloat16, lambda out: FH.assert_close(out, p.expected, torch.bfloat16)


def _trtllm(monkeypatch, mode):
    import test_trtllm_mha as T
    from attnplug_trtllm_mha.backend import TrtllmMHABackend

    p = FH.make_problem(dtype=torch.bfloat16, head_dim=64, page_size=16, sinks=True, mode=mode,
                        **({"ext": (1, 1, 1)} if mode is ForwardMode.DECODE else {}))
    rec = C.Recorder()
    ctx = FH.context(p, FH.cuda_host(100, flashinfer_python="0.6.3"), dtype="bfloat16", layers=(p.layer,))
    kernels = (rec.wrap("flashinfer.decode.trtllm_batch_decode_with_kv_cache", unchecked(T.emulate_decode)),
               rec.wrap("flashinfer.prefill.trtllm_batch_context_with_kv_cache", unchecked(T.emulate_context)))
    be = TrtllmMHABackend(ctx, kernels=kernels, workspace_bytes=1024)
    return be, p, rec, "sinks", torch.float32, lambda out: FH.assert_close(out, p.expected, torch.bfloat16)


def _aiter(monkeypatch, mode):
    import attnplug_aiter.backend as B
    import test_aiter as T
    from attnplug_aiter import LIBRARY, MIN_LIBRARY_VERSION

    rec = C.Recorder()
    mod = IH.fake_module("aiter", MIN_LIBRARY_VERSION,
                         mha_batch_prefill_func=rec.wrap("aiter.mha_batch_prefill_func",
                                                         unchecked(T.emu_mha_batch_prefill_func)),
                         paged_attention_ragged=rec.wrap("aiter.paged_attention_ragged",
                                                         unchecked(T.emu_paged_attention_ragged)))
    monkeypatch.setitem(sys.modules, "aiter", mod)
    # mocked: which installed distribution owns the module (no ROCm build here)
    monkeypatch.setattr(B, "library_provider", lambda dists: (LIBRARY, MIN_LIBRARY_VERSION), raising=False)
    pb = IH.make_problem(mode, [5, 9], [1, 1], page_size=4, dtype=torch.bfloat16, sinks=True, seed=3)
    ctx = IH.context(pb, IH.host("rocm", {LIBRARY: MIN_LIBRARY_VERSION}, gfx_arch="gfx942"), "bfloat16")
    return B.AiterBackend(ctx), pb, rec, "sink_ptr", torch.float32, lambda out: IH.check_output(pb, out, T.TOL)


PLUGINS = {"fa3": _fa3, "trtllm_mha": _trtllm, "aiter": _aiter}
#: the modes each plugin captures (aiter: decode only)
CAPTURED = {"fa3": ("decode", "extend"), "trtllm_mha": ("decode", "extend"), "aiter": ("decode",)}


@pytest.mark.parametrize("plugin, mode", [(p, m) for p in sorted(PLUGINS) for m in CAPTURED[p]])
def test_sinks_reach_captured_kernels_already_on_the_device(monkeypatch, plugin, mode):
    """Bug 6: fa3, trtllm_mha and aiter moved/cast the sinks on every call, which capture refuses. At
    capture the kernel must receive sinks already converted (the library's dtype, the backend's device),
    made outside the captured region; the replay reads the very same tensor."""
    fmode = {"decode": ForwardMode.DECODE, "extend": ForwardMode.EXTEND}[mode]
    be, p, rec, arg, dtype, check = PLUGINS[plugin](monkeypatch, fmode)
    be.init_cuda_graph_state(8, 64)
    be.init_forward_metadata_capture_cuda_graph(p.batch)  # host work, before the captured region
    rec.calls.clear()
    with simulated_capture(monkeypatch, p.layer.sinks):
        out = be.forward(p.q, p.k, p.v, p.layer, p.batch, save_kv_cache=False)
    check(out)
    at_capture = [c.kwargs[arg] for c in rec.calls if c.kwargs.get(arg) is not None]
    assert at_capture, f"{plugin}: no kernel call received {arg} at capture"
    for s in at_capture:
        assert s.dtype == dtype and s.device == be.device, (s.dtype, s.device)
        assert s is not p.layer.sinks or p.layer.sinks.dtype == dtype
    rec.calls.clear()
    be.init_forward_metadata_replay_cuda_graph(p.batch)
    with simulated_capture(monkeypatch, p.layer.sinks):  # a replay runs what was captured: nothing new
        out = be.forward(p.q, p.k, p.v, p.layer, p.batch, save_kv_cache=False)
    check(out)
    at_replay = [c.kwargs[arg] for c in rec.calls if c.kwargs.get(arg) is not None]
    assert {s.data_ptr() for s in at_replay} == {s.data_ptr() for s in at_capture}


@pytest.mark.parametrize("plugin", sorted(PLUGINS))
def test_sinks_are_converted_once_per_layer(monkeypatch, plugin):
    """Eager forwards too: one conversion per layer, kept across forwards (no per-call copy)."""
    be, p, rec, arg, dtype, check = PLUGINS[plugin](monkeypatch, ForwardMode.DECODE)
    for _ in range(3):
        be.init_forward_metadata(p.batch)
        check(be.forward(p.q, p.k, p.v, p.layer, p.batch, save_kv_cache=False))
    seen = [c.kwargs[arg] for c in rec.calls if c.kwargs.get(arg) is not None]
    assert len(seen) >= 3 and len({s.data_ptr() for s in seen}) == 1
