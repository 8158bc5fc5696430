"""Cases run only where claimed: determinism and batch invariance
(``deterministic``), CUDA-graph capture and replay (``cuda_graph``, on a GPU)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .. import reference
from ..tolerances import EXACT, tolerance_for
from . import harness as H
from ._common import capabilities, fail
from .cases import Scenario

if TYPE_CHECKING:
    from ..pytest_plugin import BoundCase, Recorder


def _restore(problem: H.Problem) -> None:
    problem.restore(problem.before)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    return float((a.to(torch.float64) - b.to(torch.float64)).abs().max())


def test_determinism(attnplug_case: BoundCase, attnplug_record: Recorder) -> None:
    name, case = attnplug_case.backend, attnplug_case.case
    problem = H.make_problem(case, H.device_for(capabilities(name)))
    backend = H.build_backend(name, problem)
    first = H.run(backend, problem).clone()
    if case.variant == "repeat":
        for attempt in range(2):
            _restore(problem)
            again = H.run(backend, problem)
            diff = _max_diff(first, again)
            attnplug_record(max_abs_err=diff, tolerance=EXACT.to_dict())
            if not torch.equal(first, again):
                fail(f"{name} claims deterministic, but repeat {attempt + 1} of the same {case.scenario.mode} "
                     f"forward differs (max abs difference {diff:.3g})")
        return
    # batch invariance: request 1 alone gives bit-identical output to request 1 in the batch
    sc = case.scenario
    i = 1
    start = sum(sc.extend[:i])
    rows = slice(start, start + sc.extend[i])
    alone_sc = Scenario(sc.name + "_alone", sc.mode, (sc.prefix[i],), (sc.extend[i],), draft=sc.draft)
    _restore(problem)
    batch = H.make_batch(alone_sc, problem.cache, [problem.req_rows[i]], problem.gen, problem.device)
    q, k, v = H.self_attention_qkv(problem, 0)
    backend.init_forward_metadata(batch)
    alone = backend.forward(q[rows], k[rows], v[rows], problem.layers[0], batch, save_kv_cache=True)
    diff = _max_diff(first[rows], alone)
    attnplug_record(max_abs_err=diff, tolerance=EXACT.to_dict())
    if not torch.equal(first[rows], alone):
        fail(f"{name} claims deterministic (batch-invariant) output, but request {i} of a {case.scenario.mode} "
             f"batch of {len(sc.prefix)} differs from the same request alone (max abs difference {diff:.3g})")


def test_cuda_graph(attnplug_case: BoundCase, attnplug_record: Recorder) -> None:
    """Capture one decode forward in a CUDA graph, then replay it on new q/k/v."""
    name, case = attnplug_case.backend, attnplug_case.case
    problem = H.make_problem(case, "cuda")
    backend = H.build_backend(name, problem)
    layer, batch = problem.layers[0], problem.batch
    q, k, v = (t.clone() for t in H.self_attention_qkv(problem, 0))
    backend.init_cuda_graph_state(H.MAX_REQUESTS, H.MAX_REQUESTS)
    backend.init_forward_metadata_capture_cuda_graph(batch)
    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]  # torch types its __init__ loosely
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        backend.forward(q, k, v, layer, batch, save_kv_cache=True)
    torch.cuda.current_stream().wait_stream(stream)
    backend.on_after_cuda_graph_warmup()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(q, k, v, layer, batch, save_kv_cache=True)
    _restore(problem)
    new = H.make_qkv(problem, layer)
    for static, fresh in zip((q, k, v), new):
        if fresh is not None:  # self-attention: all three are given
            static.copy_(fresh)
    backend.init_forward_metadata_replay_cuda_graph(batch)
    graph.replay()
    torch.cuda.synchronize()
    ref = reference.reference_attention(q, k, v, layer, batch, *problem.before[0], problem.cache.req_to_token)
    cmp = H.compare(out, ref, tolerance_for(case.dtype), what="replayed output")
    attnplug_record(**cmp.record())
    if not cmp.ok:
        fail(f"{name}: CUDA-graph replay: {cmp.detail}")
    diffs = H.check_cache(problem, 0, reference.expected_cache_after(*problem.before[0], k, v, batch.out_cache_loc))
    if diffs:
        fail(f"{name}: CUDA-graph replay: " + "; ".join(diffs))
