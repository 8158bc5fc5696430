"""The compiled helper of the ``vllm_cpu`` backend (``csrc/stage.cpp``, built at install by ``setup.py``).

Two torch ops, registered with ``TORCH_LIBRARY`` when ``_stage*.so`` is loaded (``torch.ops.load_library``), with
fake implementations for ``torch.library.opcheck`` / tracing:

* ``torch.ops.attnplug_vllm_cpu.stage(raw, k, v, slots, snap) -> bool``: a decode layer's staged write in one pass:
  the K and V rows of ``slots`` the write replaces copied into ``snap`` ``[2, n, H, d]`` (the undo copy: ``read``'s
  rows), then ``k``/``v`` written at ``slots`` in vLLM's CPU layout (the bytes ``cpu_attn_reshape_and_cache``
  writes), and whether every ``k``/``v`` value is finite;
* ``torch.ops.attnplug_vllm_cpu.all_finite(t) -> bool``: no NaN/inf in ``t`` (the op's output after the call);
* ``torch.ops.attnplug_vllm_cpu.decode_layer_new(...) -> (Tensor, int)`` (``decode_layer``: into a given output):
  a plain decode layer in one call from Python: ``stage``, then vLLM's attention op (found through the dispatcher by
  name, called with the arguments ``backend._attend`` passes), then ``all_finite`` of the output. ``-1``: one of the
  path's conditions does not hold (q/k/v's dtype, device, ``[n, num_heads, d]`` / ``[n, H, d]`` shapes and dense
  rows, the thread count), nothing was done; else bit 0 = k/v finite, bit 1 = the output finite. An attention op
  that raises has the replaced rows put back before its error propagates. It checks every argument of a layer's
  call itself, so ``VllmCpuBackend`` hands it the layer before the skeleton's q/k/v checks
  (``PagedBackend.checked_layer_call``).

They replace, for a decode layer, the undo copy (``VllmCpuLayout.page_snapshot``'s short-write branch: one
``torch.take`` through a flat index), the writer call of ``VllmCpuBackend.write_new_kv`` and the three float32 sums
of ``_decode_check``. Each torch op after vLLM's attention op runs with the core's caches cold (the op's K/V
evict a 2 MiB L2 from 2 MiB of context on), so one compiled pass over the lines the write touches anyway, and one
loop over the output, cost a fraction of the torch ops (docs/performance.md, "Round 6 (issue 30 per layer,
vhelp)").

Where the helper is missing (a build without a C++ compiler, a torch whose ABI it was not built for) or
``$ATTNPLUG_VLLM_CPU_HELPER=0`` turns it off, ``load()`` says why and the backend keeps its pure-torch path,
which ``VllmCpuBackend.runtime_notes()`` names (``attnplug doctor`` and ``attnplug bench`` print it).
"""

from __future__ import annotations

import functools
import glob
import os
from typing import Any, NamedTuple

#: ``0`` turns the compiled helper off (the pure-torch path runs; tests and benchmarks compare both)
HELPER_ENV = "ATTNPLUG_VLLM_CPU_HELPER"
NAMESPACE = "attnplug_vllm_cpu"


class Helper(NamedTuple):
    """The loaded ops (``OpOverload``s: called without the packet's overload lookup)."""

    stage: Any
    all_finite: Any
    decode_layer: Any
    decode_layer_new: Any


def library_path() -> str | None:
    """The compiled helper installed with this package (``None``: built without it)."""
    here = os.path.dirname(os.path.abspath(__file__))
    found = sorted(glob.glob(os.path.join(here, "_stage*.so")))
    return found[0] if found else None


@functools.cache
def _load_library() -> tuple[Helper | None, str | None]:
    path = library_path()
    if path is None:
        return None, ("attnplug_vllm_cpu/_stage*.so is missing (the package was built without a C++ compiler; "
                      "reinstall attnplug-vllm-cpu with one)")
    import torch

    try:
        torch.ops.load_library(path)
        ns = getattr(torch.ops, NAMESPACE)
        helper = Helper(ns.stage.default, ns.all_finite.default, ns.decode_layer.default, ns.decode_layer_new.default)
    except (OSError, RuntimeError, AttributeError) as exc:
        return None, f"{os.path.basename(path)} does not load ({exc}; built for another torch?)"
    _register_fake()
    return helper, None


def load() -> tuple[Helper | None, str | None]:
    """``(helper, None)``, or ``(None, why the pure-torch path runs)``; the library is loaded once per process,
    ``$ATTNPLUG_VLLM_CPU_HELPER`` is read per call (per backend build)."""
    if os.environ.get(HELPER_ENV, "1") == "0":
        return None, f"${HELPER_ENV}=0 turns it off"
    return _load_library()


@functools.cache
def _same_device(*tensors: Any) -> bool:
    """All of ``tensors`` on one device (a fake tensor reports the device it stands for)."""
    device = tensors[0].device
    return all(t.device == device for t in tensors[1:])


def _register_fake() -> None:
    import torch

    @torch.library.register_fake(f"{NAMESPACE}::stage")
    def _stage_fake(raw, k, v, slots, snap):  # type: ignore[no-untyped-def]
        """Shapes and dtypes only: the op writes ``raw`` and ``snap`` in place; the verdict is data (``True``
        here: a trace cannot know it)."""
        torch._check(raw.dim() == 4 and k.dim() == 3 and v.dim() == 3 and snap.dim() == 4,
                     lambda: f"{NAMESPACE}::stage: raw [P, H, ps, 2d], k/v [n, H, d], snap [2, n, H, d]")
        torch._check(k.dtype == raw.dtype and v.dtype == raw.dtype and snap.dtype == raw.dtype,
                     lambda: f"{NAMESPACE}::stage: k/v/snap must be in the cache's dtype")
        torch._check(slots.dtype == torch.int64 and slots.dim() == 1, lambda: f"{NAMESPACE}::stage: slots int64 [n]")
        return True

    @torch.library.register_fake(f"{NAMESPACE}::decode_layer")
    def _decode_layer_fake(raw, k, v, slots, snap, q, key_cache, value_cache, out, query_start_loc, seq_lens,  # type: ignore[no-untyped-def]
                           scale, window, block_table, softcap, sched, sinks, threads, num_heads, op):
        """A trace's answer is the common one (3: written, all finite); real meta tensors beside the CPU cache
        (a caller's q/k/v/out on another device than the cache) get the real op's -1: nothing done."""
        return 3 if _same_device(raw, q, k, v, out) else -1

    @torch.library.register_fake(f"{NAMESPACE}::decode_layer_new")
    def _decode_layer_new_fake(raw, k, v, slots, snap, q, key_cache, value_cache, query_start_loc, seq_lens,  # type: ignore[no-untyped-def]
                               scale, window, block_table, softcap, sched, sinks, threads, num_heads, op):
        if not _same_device(raw, q, k, v):
            return q.new_empty((0,)), -1
        return q.new_empty((q.shape[0], q.shape[1], q.shape[2])), 3

    @torch.library.register_fake(f"{NAMESPACE}::all_finite")
    def _all_finite_fake(t):  # type: ignore[no-untyped-def]
        return True
