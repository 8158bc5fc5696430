"""KV-cache cases: writes land in exactly ``out_cache_loc``; one metadata init
serves several layers; forwards in a row read what the backend itself wrote;
an output stays the caller's after later layers and forwards."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .. import reference
from ..tolerances import EXACT, tolerance_for
from . import harness as H
from ._common import capabilities, fail
from .cases import Features, Scenario

if TYPE_CHECKING:
    from ..pytest_plugin import BoundCase, Recorder


def _cache_err(problem: H.Problem, layer_idx: int, want: tuple[torch.Tensor, torch.Tensor]) -> float:
    got = problem.cache.read_kv(layer_idx)
    errs = [float((g.to(torch.float64) - w.to(torch.float64)).abs().max()) if g.numel() else 0.0
            for g, w in zip(got, want)]
    return max(errs)


def test_kv_cache_write(attnplug_case: BoundCase, attnplug_record: Recorder) -> None:
    name, case = attnplug_case.backend, attnplug_case.case
    problem = H.make_problem(case, H.device_for(capabilities(name)))
    r2t = problem.cache.req_to_token.clone()
    backend = H.build_backend(name, problem)
    H.run(backend, problem)
    want = H.expected_cache(problem, 0, save=case.save_kv_cache)
    attnplug_record(max_abs_err=_cache_err(problem, 0, want), tolerance=EXACT.to_dict())
    diffs = H.check_cache(problem, 0, want)
    if not torch.equal(problem.cache.req_to_token, r2t):
        diffs.append("req_to_token was modified by the forward")
    if diffs:
        what = "with save_kv_cache=True" if case.save_kv_cache else "with save_kv_cache=False (nothing may change)"
        fail(f"{name}: KV-cache contents wrong after a {case.scenario.mode} forward {what}: " + "; ".join(diffs))


def _layer_features(caps: Any) -> list[Features]:
    return [
        Features(),
        Features(sliding_window=6) if caps.sliding_window else Features(),
        Features(logit_cap=2.0 if caps.logit_softcap else None, sinks=bool(caps.sinks)),
    ]


def test_shared_metadata(attnplug_case: BoundCase, attnplug_record: Recorder) -> None:
    """One ``init_forward_metadata``, then every layer's forward (as a model runs)."""
    name, case = attnplug_case.backend, attnplug_case.case
    caps = capabilities(name)
    problem = H.make_problem(case, H.device_for(caps), layer_features=_layer_features(caps))
    backend = H.build_backend(name, problem)
    backend.init_forward_metadata(problem.batch)
    tol = tolerance_for(case.dtype)
    worst = 0.0
    for i in range(len(problem.layers)):
        out = H.run(backend, problem, i, init=False)
        H.check_output_shape(out, problem, i)
        cmp = H.compare(out, H.expected_output(problem, i), tol, what=f"layer {i} output")
        worst = max(worst, cmp.max_abs_err)
        if not cmp.ok:
            attnplug_record(max_abs_err=worst, tolerance=tol.to_dict())
            fail(f"{name}: with metadata initialised once for {len(problem.layers)} layers, {cmp.detail}")
        diffs = H.check_cache(problem, i, H.expected_cache(problem, i))
        if diffs:
            fail(f"{name}: after layer {i}: " + "; ".join(diffs))
    attnplug_record(max_abs_err=worst, tolerance=tol.to_dict())


_SEQUENCES: dict[str, list[tuple[str, tuple[int, ...]]]] = {
    "prefill_decode": [("extend", (5, 9, 3)), ("decode", (1, 1, 1)), ("decode", (1, 1, 1)), ("decode", (1, 1, 1))],
    "chunked_prefill_decode": [("extend", (3, 4, 2)), ("extend", (2, 5, 1)), ("decode", (1, 1, 1)),
                               ("decode", (1, 1, 1))],
}


def test_sequence(attnplug_case: BoundCase, attnplug_record: Recorder) -> None:
    """Forwards in a row; later ones read the K/V the backend wrote in earlier ones."""
    name, case = attnplug_case.backend, attnplug_case.case
    steps = _SEQUENCES[case.variant]
    n = len(steps[0][1])
    final = [sum(ext[i] for _, ext in steps) for i in range(n)]
    problem = H.make_problem(case, H.device_for(capabilities(name)), final_lens=final)
    backend = H.build_backend(name, problem)
    tol = tolerance_for(case.dtype)
    track_k, track_v = problem.before[0]
    lens = [0] * n
    worst = 0.0
    for step, (mode, ext) in enumerate(steps):
        sc = Scenario(f"step{step}", mode, tuple(lens), ext)
        problem.batch = H.make_batch(sc, problem.cache, problem.req_rows, problem.gen, problem.device)
        q, k, v = H.make_qkv(problem, problem.layers[0])
        backend.init_forward_metadata(problem.batch)
        out = backend.forward(q, k, v, problem.layers[0], problem.batch, save_kv_cache=True)
        H.check_output_shape(out, problem)
        ref = reference.reference_attention(q, k, v, problem.layers[0], problem.batch, track_k, track_v,
                                            problem.cache.req_to_token)
        cmp = H.compare(out, ref, tol, what=f"step {step} ({mode}) output")
        worst = max(worst, cmp.max_abs_err)
        if not cmp.ok:
            attnplug_record(max_abs_err=worst, tolerance=tol.to_dict())
            fail(f"{name}: forward {step} of {len(steps)} ({mode}, reading K/V written by earlier forwards): "
                 f"{cmp.detail}")
        track_k, track_v = reference.expected_cache_after(track_k, track_v, k, v, problem.batch.out_cache_loc)
        lens = [a + b for a, b in zip(lens, ext)]
    attnplug_record(max_abs_err=worst, tolerance=tol.to_dict())
    diffs = H.check_cache(problem, 0, (track_k, track_v))
    if diffs:
        fail(f"{name}: after {len(steps)} forwards: " + "; ".join(diffs))



def test_output_ownership(attnplug_case: BoundCase, attnplug_record: Recorder) -> None:
    """Contract: a forward returns a fresh tensor owned by the caller; no later forward or layer
    overwrites it (no aliasing of a reused workspace, of q/k/v or of the cache)."""
    name, case = attnplug_case.backend, attnplug_case.case
    caps = capabilities(name)
    problem = H.make_problem(case, H.device_for(caps), layer_features=[Features(), Features()])
    backend = H.build_backend(name, problem)
    backend.init_forward_metadata(problem.batch)
    kept = H.run(backend, problem, 0, init=False)
    ref0 = H.expected_output(problem, 0)
    first = kept.clone()
    storages = {t.untyped_storage().data_ptr() for t in problem.qkv[0] + problem.qkv[1] if t is not None}
    storages |= {b.untyped_storage().data_ptr() for i in range(problem.cache.num_layers)
                 for b in problem.cache.layer_storage(i)}
    if kept.numel() and kept.untyped_storage().data_ptr() in storages:
        fail(f"{name}: the output of layer 0 shares storage with q/k/v or the KV cache; a forward must return "
             f"a fresh tensor owned by the caller")
    H.run(backend, problem, 1, init=False)  # layer 1 of the same forward
    # ... and a whole other forward on the same backend and cache, with other values
    gen = torch.Generator(device="cpu").manual_seed(case.seed + 1)
    q0, k0, v0 = problem.qkv[0]
    q1 = torch.randn(q0.shape, generator=gen).to(q0)  # drawn in q, k, v order
    k1, v1 = (None if t is None else torch.randn(t.shape, generator=gen).to(t) for t in (k0, v0))
    other = (q1, k1, v1)
    backend.init_forward_metadata(problem.batch)
    H.run(backend, problem, 0, init=False, save=False, qkv=other)
    tol = tolerance_for(case.dtype)
    cmp = H.compare(kept, ref0, tol, what="layer 0 output kept across later forwards")
    attnplug_record(**cmp.record())
    if not torch.equal(H.bits(kept), H.bits(first)) or not cmp.ok:
        fail(f"{name}: the output returned by layer 0 changed after layer 1 and another forward ran (it aliases "
             f"a reused buffer): {cmp.detail or 'bits differ from the value first returned'}")
