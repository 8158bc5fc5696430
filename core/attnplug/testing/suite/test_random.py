"""Randomised cases (hypothesis): one case per mode family, each drawing
``--conformance-examples`` problems (default 12) from what the backend claims.

Each example draws ragged lengths (prefix 0-40, new tokens by mode), a page
size, a head layout (MHA/GQA/MQA as claimed), head dims (V differing where
claimed), dtype and KV-cache dtype, sliding window / soft-cap / sinks /
scaling where claimed, a target-verify mask of arbitrary bits, whether the
forward saves, whether ``req_to_token`` maps the new slots yet, garbage
(NaN/+inf) in every slot no request owns (written through ``set_kv`` or
straight into the layers' storage), garbage in the K/V of each request's last
new token (hidden from its earlier tokens, and from the drafts a verify mask
hides it from; the tokens that do see it must be non-finite, as the reference
says), and a ``req_to_token`` that is not page-aligned (a backend declaring
``reads_page_table`` refuses it naming the position; the others serve it
exactly). The forward must return the float64
reference within tolerance and leave the cache byte-identical except the new
K/V at ``out_cache_loc`` -- or raise a clear ``attnplug`` error (ShapeError /
NotSupportedError) and leave the cache byte-identical.

Hypothesis runs derandomized with no example database, so a run is
reproducible; a failure is shrunk to a minimal batch and printed as a
``Case(...)``. Without hypothesis installed the cases are skipped.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest
import torch

from ...capabilities import support_reasons
from ...errors import AttnplugError
from ...registry import default_registry
from ..tolerances import tolerance_for
from . import harness as H
from ._common import capabilities
from .cases import DTYPES, Case, Features, Scenario, Shape

if TYPE_CHECKING:
    from ..pytest_plugin import BoundCase, Recorder

DEFAULT_EXAMPLES = 12
_LAYOUTS = ((4, 4), (8, 2), (8, 1), (6, 3))
_HEAD_DIMS = (16, 64, 80, 128)


def _claimed(values: tuple[Any, ...], claimed: Any) -> list[Any]:
    return [x for x in values if claimed is None or x in claimed]


def _strategy(st: Any, mode: str, caps: Any) -> Any:
    page_sizes = _claimed((1, 2, 16, 64), caps.page_sizes) or list(caps.page_sizes)
    layouts = [(h, kv) for h, kv in _LAYOUTS
               if (caps.mqa or not (kv == 1 and h > 1)) and (caps.gqa or not (h > kv > 1))] or [(4, 4)]
    head_dims = _claimed(_HEAD_DIMS, caps.head_dims) or list(caps.head_dims)
    dtypes = [d for d in DTYPES if d in caps.dtypes]

    @st.composite
    def cases(draw: Any) -> Case:
        b = draw(st.integers(1, 4))
        prefix = [draw(st.integers(0, 40)) for _ in range(b)]
        draft = None
        if mode == "decode":
            ext = [1] * b
        elif mode == "target_verify":
            draft = draw(st.integers(1, 5))
            ext = [draft] * b
        elif mode == "draft_extend":
            prefix = [p + 1 for p in prefix]
            ext = [draw(st.integers(1, 6)) for _ in range(b)]
        else:  # extend, mixed: zero new tokens allowed in extend (while the request has some K/V)
            lo = 0 if mode == "extend" else 1
            ext = [draw(st.integers(lo if p else 1, 12)) for p in prefix]
        custom = mode == "target_verify" and draw(st.booleans())
        h, kv = draw(st.sampled_from(layouts))
        d = draw(st.sampled_from(head_dims))
        dv = draw(st.sampled_from(head_dims)) if caps.v_head_dim_differs and draw(st.booleans()) else d
        dtype = draw(st.sampled_from(dtypes))
        # the claimed caches for this model dtype (kv_cache_dtype_follows_model narrows the list)
        kv_dtypes = [x for x in caps.kv_cache_dtypes
                     if x in DTYPES and not support_reasons(caps, dtype=dtype, kv_cache_dtype=x)] or [dtype]
        feats = Features(
            sliding_window=draw(st.none() | st.integers(0, 20)) if caps.sliding_window else None,
            logit_cap=draw(st.none() | st.floats(1.0, 30.0)) if caps.logit_softcap else None,
            sinks=draw(st.booleans()) if caps.sinks else False,
            scaling=draw(st.none() | st.floats(0.05, 1.0)),
        )
        seed = draw(st.integers(0, 2 ** 16))
        return Case(
            "random", f"{mode}-{seed}",
            Scenario(f"random_{mode}", mode, tuple(prefix), tuple(ext), draft=draft, custom_mask=custom),
            dtype=dtype, page_size=draw(st.sampled_from(page_sizes)),
            shape=Shape(f"h{h}kv{kv}d{d}dv{dv}", h, kv, d, dv), features=feats,
            kv_cache_dtype=draw(st.sampled_from(kv_dtypes)), save_kv_cache=draw(st.booleans()),
            garbage=draw(st.sampled_from(["nan", "inf", None])), unmapped_new=draw(st.booleans()),
            garbage_raw=draw(st.booleans()), garbage_new=draw(st.booleans()), unaligned=draw(st.booleans()),
        )

    return cases()


def check_example(name: str, case: Case, device: str) -> str:
    """One example: the reference answer, or a clear attnplug error with the cache untouched."""
    problem = H.make_problem(case, device)
    if case.scenario.custom_mask and problem.batch.spec_custom_mask is not None:
        # arbitrary bits, not just causal ones (a row may hide every draft)
        g = torch.Generator().manual_seed(case.seed)
        bits = torch.rand(tuple(problem.batch.spec_custom_mask.shape), generator=g) < 0.5
        problem.batch.spec_custom_mask.copy_(bits.to(problem.batch.spec_custom_mask.device))
    before, r2t = problem.snapshot(), problem.cache.req_to_token.clone()
    q, k, v = problem.qkv[0]
    try:
        _, backend = default_registry().build(name, problem.context(name))
        backend.init_forward_metadata(problem.batch)
        out = backend.forward(q, k, v, problem.layers[0], problem.batch, save_kv_cache=case.save_kv_cache)
    except AttnplugError as exc:
        changes = H.cache_changes(before, problem, r2t)
        assert not changes, f"{name} refused ({type(exc).__name__}: {exc}) but changed the cache: {changes}"
        return "refused"
    exp = (problem.batch.num_tokens, case.shape.num_heads, case.shape.v_dim)
    assert isinstance(out, torch.Tensor) and tuple(out.shape) == exp, \
        f"{name}: output {getattr(out, 'shape', out)!r}, expected shape {exp}"
    cmp = H.compare(out, H.expected_output(problem, 0), tolerance_for(case.dtype, case.kv_cache_dtype))
    assert cmp.ok, f"{name}: {cmp.detail}"
    diffs = H.check_cache(problem, 0, H.expected_cache(problem, 0, save=case.save_kv_cache))
    assert not diffs, f"{name}: cache wrong after the forward (save_kv_cache={case.save_kv_cache}): {diffs}"
    return "ok"


def test_random(attnplug_case: BoundCase, attnplug_record: Recorder, request: pytest.FixtureRequest) -> None:
    hypothesis = pytest.importorskip("hypothesis", reason="random: hypothesis is not installed")
    from hypothesis import strategies as st

    name, mode = attnplug_case.backend, attnplug_case.case.scenario.mode
    caps = capabilities(name)
    device = H.device_for(caps)
    examples = int(request.config.getoption("attnplug_examples", default=None) or DEFAULT_EXAMPLES)
    seen = {"ok": 0, "refused": 0}

    @hypothesis.settings(max_examples=examples, derandomize=True, database=None, deadline=None,
                         suppress_health_check=list(hypothesis.HealthCheck), print_blob=True)
    @hypothesis.given(case=_strategy(st, mode, caps))
    def random_batches(case: Case) -> None:
        seen[check_example(name, case, device)] += 1

    random_batches()
    attnplug_record(examples=seen["ok"] + seen["refused"], refused=seen["refused"])
