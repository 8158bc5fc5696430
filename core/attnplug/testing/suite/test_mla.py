"""MLA cases (docs/mla.md), generated from ``Capabilities.mla_forms``: each case runs one forward of an
MLA layer in the case's form and compares it with the float64 ``reference_mla``, then checks the
latent cache byte for byte (the new rows at exactly ``out_cache_loc``, quantized for fp8).

Families: ``mla`` (both forms across modes, page sizes 1/16/64, ragged batches, float32/bfloat16),
``mla_garbage`` (NaN/+inf in every latent slot no request owns), ``mla_fp8`` (an fp8 latent cache with
its one scale), ``mla_forms_agree`` (the two forms on the same weights agree with each other). A
backend claiming no MLA form skips every case with the reason (the layer kind and the form).
"""

from __future__ import annotations

from typing import Any

import torch

from ...layer import ABSORBED, UNABSORBED
from ..tolerances import tolerance_for
from . import harness as H
from . import mla_problem as M
from ._common import capabilities, fail


def _one_forward(bound: Any, record: Any) -> None:
    name, case = bound.backend, bound.case
    problem = M.make_mla_problem(case, H.device_for(capabilities(name)))
    backend = M.build(name, problem)
    out = M.run(backend, problem)
    want_shape = (problem.batch.num_tokens, problem.layer.num_heads, problem.layer.output_dim(case.mla_form))
    if tuple(out.shape) != want_shape or out.dtype != problem.q.dtype:
        fail(f"{name}: MLA output is {tuple(out.shape)} {out.dtype}, expected {want_shape} {problem.q.dtype} "
             f"({case.mla_form} form)")
    cmp = H.compare(out, problem.expected(), tolerance_for(case.dtype, case.kv_cache_dtype))
    record(**cmp.record())
    if not cmp.ok:
        fail(f"{name}: {case.mla_form} MLA {case.scenario.mode}: {cmp.detail}")
    diffs = M.cache_diffs(problem, problem.expected_cache())
    if diffs:
        fail(f"{name}: latent cache wrong after a {case.scenario.mode} forward: " + "; ".join(diffs))


def test_mla(attnplug_case: Any, attnplug_record: Any) -> None:
    _one_forward(attnplug_case, attnplug_record)


def test_mla_garbage(attnplug_case: Any, attnplug_record: Any) -> None:
    _one_forward(attnplug_case, attnplug_record)


def test_mla_fp8(attnplug_case: Any, attnplug_record: Any) -> None:
    _one_forward(attnplug_case, attnplug_record)


def test_mla_forms_agree(attnplug_case: Any, attnplug_record: Any) -> None:
    """absorbed q_h = [q_nope_h @ w_kc[h], q_pe_h]; out_unabsorbed_h == out_absorbed_h @ w_vc[h]."""
    name, case = attnplug_case.backend, attnplug_case.case
    problem = M.make_mla_problem(case, H.device_for(capabilities(name)))
    backend = M.build(name, problem)
    batch_a, q_a = problem.with_form(ABSORBED)
    batch_u, q_u = problem.with_form(UNABSORBED)
    out_a = M.run(backend, problem, batch_a, q_a, save=False)
    out_u = M.run(backend, problem, batch_u, q_u, save=False)
    w_vc = problem.layer.mla.w_vc.to(torch.float64).cpu()  # type: ignore[union-attr]
    projected = torch.einsum("thl,hlv->thv", out_a.detach().to(torch.float64).cpu(), w_vc)
    cmp = H.compare(out_u, projected, tolerance_for(case.dtype), "unabsorbed output vs absorbed output @ w_vc")
    attnplug_record(**cmp.record())
    if not cmp.ok:
        fail(f"{name}: the two MLA forms disagree on the same weights ({case.scenario.mode}): {cmp.detail}")
    diffs = M.cache_diffs(problem, problem.before)
    if diffs:
        fail(f"{name}: save_kv_cache=False MLA forwards wrote the latent cache: " + "; ".join(diffs))
