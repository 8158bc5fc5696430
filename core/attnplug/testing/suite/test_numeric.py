"""Numeric cases: one forward per case, compared with the float64 reference.

Families (each generated from the declared capabilities, see ``cases.py``):
every forward mode at page sizes 1/16/64 and three dtypes; GQA/MQA layouts at
head dims 64/128/256; V head dim != K head dim; sliding window, soft-cap and
sinks across modes; cross-attention; a KV cache in another dtype; problems
long enough to cross block/split/chunk thresholds; non-default ``scaling``;
``save_kv_cache=False`` with stale ``out_cache_loc`` slots; new tokens whose
slot ``req_to_token`` does not map yet; edges (a query row with no visible
key, zero new tokens, position 0, a draft-extend carrying a verify mask);
NaN/+inf in every slot no request owns.

Every case also checks the cache afterwards, byte for byte: the old contents
with the new K/V at exactly ``out_cache_loc`` (nothing at all when the case
does not save, or for cross-attention).
"""

from __future__ import annotations

from typing import Any

from ..tolerances import tolerance_for
from . import harness as H
from ._common import capabilities, fail


def _check_one_forward(bound: Any, record: Any) -> None:
    name, case = bound.backend, bound.case
    problem = H.make_problem(case, H.device_for(capabilities(name)))
    backend = H.build_backend(name, problem)
    out = H.run(backend, problem)
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


def test_mode(attnplug_case: Any, attnplug_record: Any) -> None:
    _check_one_forward(attnplug_case, attnplug_record)


def test_heads(attnplug_case: Any, attnplug_record: Any) -> None:
    _check_one_forward(attnplug_case, attnplug_record)


def test_v_head_dim(attnplug_case: Any, attnplug_record: Any) -> None:
    _check_one_forward(attnplug_case, attnplug_record)


def test_feature(attnplug_case: Any, attnplug_record: Any) -> None:
    _check_one_forward(attnplug_case, attnplug_record)


def test_cross_attention(attnplug_case: Any, attnplug_record: Any) -> None:
    _check_one_forward(attnplug_case, attnplug_record)


def test_kv_cache_dtype(attnplug_case: Any, attnplug_record: Any) -> None:
    _check_one_forward(attnplug_case, attnplug_record)


def test_fp8_kv(attnplug_case: Any, attnplug_record: Any) -> None:
    """An fp8 cache with scales: the output matches the reference on the stored values × scales, and
    the new K/V are stored quantized (round(x / scale), saturated) at exactly ``out_cache_loc``."""
    _check_one_forward(attnplug_case, attnplug_record)


def test_kv_layout(attnplug_case: Any, attnplug_record: Any) -> None:
    """The forward is right, and writes only its slots, in every KV layout the backend declares."""
    _check_one_forward(attnplug_case, attnplug_record)


def test_long(attnplug_case: Any, attnplug_record: Any) -> None:
    _check_one_forward(attnplug_case, attnplug_record)


def test_scaling(attnplug_case: Any, attnplug_record: Any) -> None:
    _check_one_forward(attnplug_case, attnplug_record)


def test_no_save(attnplug_case: Any, attnplug_record: Any) -> None:
    _check_one_forward(attnplug_case, attnplug_record)


def test_unmapped_slot(attnplug_case: Any, attnplug_record: Any) -> None:
    _check_one_forward(attnplug_case, attnplug_record)


def test_edge(attnplug_case: Any, attnplug_record: Any) -> None:
    _check_one_forward(attnplug_case, attnplug_record)


def test_garbage(attnplug_case: Any, attnplug_record: Any) -> None:
    _check_one_forward(attnplug_case, attnplug_record)
