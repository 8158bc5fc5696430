"""Numeric cases: one forward per case, compared with the float64 reference.

Families (each generated from the declared capabilities, see ``cases.py``):
every forward mode at page sizes 1/16/64 and three dtypes; GQA/MQA layouts at
head dims 64/128/256; V head dim != K head dim; sliding window, soft-cap and
sinks across modes; cross-attention; a KV cache in another dtype; problems
long enough to cross block/split/chunk thresholds; non-default ``scaling``;
``save_kv_cache=False`` with stale ``out_cache_loc`` slots; new tokens whose
slot ``req_to_token`` does not map yet; edges (a query row with no visible
key, zero new tokens, position 0, a draft-extend carrying a verify mask);
NaN/+inf in every slot no request owns; a small ``BuildContext.max_workspace_bytes``
(``workspace``: answer in pieces, or refuse with ``ResourceLimitError`` writing nothing).

Every case also checks the cache afterwards, byte for byte: the old contents
with the new K/V at exactly ``out_cache_loc`` (nothing at all when the case
does not save, or for cross-attention).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ...errors import ResourceLimitError
from ...registry import default_registry
from ..tolerances import EXACT, tolerance_for
from . import harness as H
from ._common import capabilities, fail

if TYPE_CHECKING:
    from ..pytest_plugin import BoundCase, Recorder


def _check_one_forward(bound: Any, record: Any) -> tuple[H.Problem, Any]:
    name, case = bound.backend, bound.case
    problem = H.make_problem(case, H.device_for(capabilities(name)))
    with H.threads(case.threads):
        backend = H.build_backend(name, problem)
        out = H.run(backend, problem)
    _check_result(name, problem, out, record)
    return problem, out


def _check_result(name: str, problem: H.Problem, out: Any, record: Any) -> None:
    """``out`` (layer 0's output) equals the reference; the cache holds exactly the expected writes."""
    case = problem.case
    H.check_output_shape(out, problem)
    ref = H.expected_output(problem, 0)
    cmp = H.compare(out, ref, tolerance_for(case.dtype, case.kv_cache_dtype))
    record(**cmp.record())
    if not cmp.ok:
        fail(f"{name}: {cmp.detail}")
    if problem.layers[0].is_cross_attention:
        diffs = H.check_cache(problem, 0, problem.before[0])
        if diffs:
            fail(f"{name}: a cross-attention forward must not write the KV cache: " + "; ".join(diffs))
        return
    diffs = H.check_cache(problem, 0, H.expected_cache(problem, 0, save=case.save_kv_cache))
    if diffs:
        what = "save_kv_cache=True" if case.save_kv_cache else "save_kv_cache=False (nothing may change)"
        fail(f"{name}: KV cache wrong after a {case.scenario.mode} forward with {what}: " + "; ".join(diffs))


def test_mode(attnplug_case: BoundCase, attnplug_record: Recorder) -> None:
    _check_one_forward(attnplug_case, attnplug_record)


def test_heads(attnplug_case: BoundCase, attnplug_record: Recorder) -> None:
    _check_one_forward(attnplug_case, attnplug_record)


def test_v_head_dim(attnplug_case: BoundCase, attnplug_record: Recorder) -> None:
    _check_one_forward(attnplug_case, attnplug_record)


def test_feature(attnplug_case: BoundCase, attnplug_record: Recorder) -> None:
    _check_one_forward(attnplug_case, attnplug_record)


def test_cross_attention(attnplug_case: BoundCase, attnplug_record: Recorder) -> None:
    _check_one_forward(attnplug_case, attnplug_record)


def test_kv_cache_dtype(attnplug_case: BoundCase, attnplug_record: Recorder) -> None:
    _check_one_forward(attnplug_case, attnplug_record)


def test_fp8_kv(attnplug_case: BoundCase, attnplug_record: Recorder) -> None:
    """An fp8 cache with scales: the output matches the reference on the stored values × scales, and
    the new K/V are stored quantized (round(x / scale), saturated) at exactly ``out_cache_loc``."""
    _check_one_forward(attnplug_case, attnplug_record)


def test_kv_layout(attnplug_case: BoundCase, attnplug_record: Recorder) -> None:
    """The forward is right, and writes only its slots, in every KV layout the backend declares."""
    _check_one_forward(attnplug_case, attnplug_record)


def test_long(attnplug_case: BoundCase, attnplug_record: Recorder) -> None:
    _check_one_forward(attnplug_case, attnplug_record)


def test_scaling(attnplug_case: BoundCase, attnplug_record: Recorder) -> None:
    _check_one_forward(attnplug_case, attnplug_record)


def test_no_save(attnplug_case: BoundCase, attnplug_record: Recorder) -> None:
    _check_one_forward(attnplug_case, attnplug_record)


def test_unmapped_slot(attnplug_case: BoundCase, attnplug_record: Recorder) -> None:
    _check_one_forward(attnplug_case, attnplug_record)


def test_edge(attnplug_case: BoundCase, attnplug_record: Recorder) -> None:
    _check_one_forward(attnplug_case, attnplug_record)


def test_garbage(attnplug_case: BoundCase, attnplug_record: Recorder) -> None:
    _check_one_forward(attnplug_case, attnplug_record)


def test_workspace(attnplug_case: BoundCase, attnplug_record: Recorder) -> None:
    """Built with a small ``max_workspace_bytes``: the output equals the reference (the backend
    worked in pieces that fit), or the build or forward raised ``attnplug.ResourceLimitError``
    naming ``max_workspace_bytes`` and nothing was written. A backend claiming deterministic
    output must also give the same bits as without the limit (the pieces are a batch split)."""
    _check_under_limit(attnplug_case, attnplug_record)


def test_chunked(attnplug_case: BoundCase, attnplug_record: Recorder) -> None:
    """``workspace``'s check where the limit cuts each request's queries into chunks: windows,
    sinks, soft-cap and the verify mask stay those of the request, at one and two threads."""
    _check_under_limit(attnplug_case, attnplug_record)


def _check_under_limit(bound: Any, record: Any) -> None:
    name, case = bound.backend, bound.case
    problem = H.make_problem(case, H.device_for(capabilities(name)))
    limit = f"max_workspace_bytes={case.max_workspace_bytes}"
    r2t = problem.cache.req_to_token.clone()
    with H.threads(case.threads):
        try:
            backend = H.build_backend(name, problem)
            out = H.run(backend, problem)
        except ResourceLimitError as exc:
            if "max_workspace_bytes" not in str(exc):
                fail(f"{name}: the ResourceLimitError under {limit} must name max_workspace_bytes; got: {exc}")
            changes = H.cache_changes(problem.before, problem, r2t)
            if changes:
                fail(f"{name}: a {case.scenario.mode} forward refused under {limit} changed the KV cache: "
                     + "; ".join(changes))
            record(refused=str(exc)[:200])
            return
        _check_result(name, problem, out, record)
        if not capabilities(name).deterministic:
            return
        for (kb, vb), (k0, v0) in zip(zip(problem.cache.k_buffers, problem.cache.v_buffers), problem.before):
            kb.copy_(k0)
            vb.copy_(v0)
        _, free = default_registry().build(name, problem.context(name).replace(max_workspace_bytes=4 << 30))
        whole = H.run(free, problem)
    if not torch.equal(out, whole):
        diff = float((out.double() - whole.double()).abs().max())
        record(max_abs_err=diff, tolerance=EXACT.to_dict())
        fail(f"{name} claims deterministic output, but a {case.scenario.mode} forward under {limit} differs "
             f"from the same forward without the limit (max abs difference {diff:.3g})")


def test_head_dim_class(attnplug_case: BoundCase, attnplug_record: Recorder) -> None:
    """Head dims 72/80/96/112 (multiples of 8, 16 and 32 but not of 64) in every dtype."""
    _check_one_forward(attnplug_case, attnplug_record)


def test_score_range(attnplug_case: BoundCase, attnplug_record: Recorder) -> None:
    """Every score hundreds below zero, or the row maximum in the first key block only."""
    _check_one_forward(attnplug_case, attnplug_record)


def test_odd_heads(attnplug_case: BoundCase, attnplug_record: Recorder) -> None:
    """Odd KV-head counts over decode batches of 1-6 requests, at one and two threads."""
    _check_one_forward(attnplug_case, attnplug_record)


#: ``rounding``: the largest mean signed error, in units of the output's last place, that a 16-bit
#: output rounded to nearest may show over the case's elements (rounded to nearest: about 0 +- 0.01
#: at thousands of elements; truncated toward zero: about -0.5; scaled by a common factor one
#: 16-bit ulp off: about +-0.25)
ROUNDING_BIAS_ULPS = 0.1
#: elements the bias is averaged over must number at least this many
ROUNDING_MIN_ELEMENTS = 1000
_MANTISSA_BITS = {"float16": 10, "bfloat16": 7}


def rounding_bias(out: Any, ref: Any, dtype: str) -> tuple[float, int]:
    """Mean of sign(ref) * (out - ref) / ulp(ref) over the normal-range elements, and their count."""
    got, ref = out.detach().double().cpu().flatten(), ref.double().cpu().flatten()
    sel = ref.abs() > 2.0 ** -12  # away from subnormals and from values the tolerance's atol covers anyway
    got, ref = got[sel], ref[sel]
    ulp = torch.exp2(torch.floor(torch.log2(ref.abs())) - _MANTISSA_BITS[dtype])
    err = torch.sign(ref) * (got - ref) / ulp
    return (float(err.mean()) if err.numel() else 0.0), int(err.numel())


def test_rounding(attnplug_case: BoundCase, attnplug_record: Recorder) -> None:
    """A 16-bit output within tolerance element by element AND unbiased on average: its mean
    signed error, in ulps of the output dtype, is within ``ROUNDING_BIAS_ULPS`` of zero."""
    name, case = attnplug_case.backend, attnplug_case.case
    problem, out = _check_one_forward(attnplug_case, attnplug_record)
    bias, n = rounding_bias(out, H.expected_output(problem, 0), case.dtype)
    attnplug_record(rounding_bias_ulps=bias, rounding_elements=n)
    if n < ROUNDING_MIN_ELEMENTS:
        fail(f"rounding case {case.id} has only {n} elements to average (needs {ROUNDING_MIN_ELEMENTS})")
    if abs(bias) > ROUNDING_BIAS_ULPS:
        fail(f"{name}: {case.dtype} outputs are biased: mean signed error {bias:+.3f} ulp over {n} elements "
             f"(round-to-nearest gives about 0; |bias| must be <= {ROUNDING_BIAS_ULPS}). Truncating the float32 "
             f"result, or scaling it by a rounded common factor, does this")
