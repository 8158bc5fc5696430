"""Numeric cases: one forward per case, compared with the float64 reference.

Families (each generated from the declared capabilities, see ``cases.py``):
every forward mode at page sizes 1/16/64 and three dtypes; GQA/MQA layouts at
head dims 64/128/256; V head dim != K head dim; sliding window, soft-cap and
sinks across modes; cross-attention; a KV cache in another dtype.
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
