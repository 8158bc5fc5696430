"""Robustness cases: what a backend must refuse, and that a refused forward writes nothing.

* ``kv_none``: ``k=v=None`` on a self-attention layer raises ``attnplug.ShapeError``
  naming k/v.
* ``rejected``: out-of-range or negative ``out_cache_loc`` / ``req_pool_indices`` /
  ``layer_id``, ``req_to_token`` entries out of range or unassigned (-1), a
  ``seq_len`` beyond the assigned positions or the ``req_to_token`` width raise
  ``attnplug.ShapeError`` whose message names the field, the bad value and the
  bound; q/k/v in an unclaimed dtype raise ``attnplug.NotSupportedError`` naming
  it. The error may come from ``init_forward_metadata`` or from ``forward``.
* ``refusal``: per unclaimed dtype, KV-cache dtype, mode and feature:
  ``not_supported_reasons`` says so in words (where the context can express it)
  and a forward using it raises ``attnplug.NotSupportedError`` naming it.

In every case the KV cache (every layer) and ``req_to_token`` are byte-identical
before and after the refused call.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import re
import sys
from typing import TYPE_CHECKING, Any, Callable

import torch

from ...batch import ForwardBatch
from ...dtypes import dtype_name
from ...errors import AttnplugError, NotSupportedError, ShapeError
from ...registry import default_registry
from . import harness as H
from ._common import capabilities, fail
from .cases import (DEFAULT_SHAPE, REJECTIONS, Case, Features, Shape, claimed_shape, first_layout,
                    refusal_model_dtype, scenario)

if TYPE_CHECKING:
    from ..pytest_plugin import BoundCase


def _claimed_case(name: str, case: Case, **kw: Any) -> Case:
    """``case`` at a dtype and page size ``name`` claims (its checks are not about them)."""
    caps = capabilities(name)
    ps = 16 if caps.page_sizes is None or 16 in caps.page_sizes else caps.page_sizes[0]
    sc = scenario(case.scenario.name, ps)
    kw.setdefault("shape", claimed_shape(caps))
    kw.setdefault("kv_layout", first_layout(caps))
    return dataclasses.replace(case, dtype=refusal_model_dtype(caps), page_size=ps, scenario=sc, **kw)


def _attempt(call: Callable[[], Any], problem: H.Problem, error: type[BaseException]) -> dict[str, Any]:
    """Run ``call``; what it raised (or that it returned) and what it changed in the cache."""
    before, r2t = problem.snapshot(), problem.cache.req_to_token.clone()
    result: dict[str, Any] = {"raised": None, "msg": ""}
    try:
        call()
    except error as exc:
        result.update(raised="expected", msg=str(exc))
    except Exception as exc:
        result.update(raised=type(exc).__name__, msg=str(exc))
    result["changes"] = H.cache_changes(before, problem, r2t)
    return result


def _coverage_running() -> bool:
    """coverage.py cannot see a forked child that ends in ``os._exit``: measure in-process then."""
    cov = sys.modules.get("coverage")
    return cov is not None and cov.Coverage.current() is not None


def _attempt_isolated(call: Callable[[], Any], problem: H.Problem, error: type[BaseException]) -> dict[str, Any]:
    """``_attempt`` in a forked child on the CPU: a kernel that dereferences an out-of-range index
    can kill the process (the Triton interpreter segfaults), and that must fail this case only.
    In-process on other devices and while coverage.py measures (the gate needs the error paths)."""
    if problem.device != "cpu" or not hasattr(os, "fork") or _coverage_running():
        return _attempt(call, problem, error)
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: report through the pipe, never return into pytest
        code = 0
        try:
            os.close(read_end)
            torch.set_num_threads(1)
            data = pickle.dumps(_attempt(call, problem, error))
            with os.fdopen(write_end, "wb") as fh:
                fh.write(data)
        except BaseException:
            code = 1
        os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as fh:
        data = fh.read()
    _, status = os.waitpid(pid, 0)
    if data:
        result: dict[str, Any] = pickle.loads(data)
        return result
    how = f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else f"exit {os.WEXITSTATUS(status)}"
    return {"raised": f"a crash of the process ({how})", "msg": "an invalid index or length reached the kernel",
            "changes": []}


def _expect_refused(name: str, what: str, call: Callable[[], Any], problem: H.Problem, error: type,
                    must_name: list[str], requirement: str | None = None) -> str:
    """Run ``call`` (isolated); it must raise ``error`` whose message matches every regex of
    ``must_name``, and leave the cache and ``req_to_token`` byte-identical. Returns the message.
    ``requirement``: the requirement id a failure names (default: the family's)."""
    r = _attempt_isolated(call, problem, error)
    msg: str = r["msg"]
    if r["raised"] is None:
        fail(f"{name}: {what} was accepted (expected attnplug.{error.__name__})", requirement)
    if r["raised"] != "expected":
        fail(f"{name}: {what} raised {r['raised']}: {msg} (expected attnplug.{error.__name__})", requirement)
    missing = [p for p in must_name if not re.search(p, msg, re.IGNORECASE)]
    if missing:
        fail(f"{name}: {what}: the {error.__name__} must name {' and '.join(repr(p) for p in missing)}; got: {msg}",
             requirement)
    if r["changes"]:
        fail(f"{name}: {what} was refused, but the refused call changed the KV cache: {'; '.join(r['changes'])}",
             requirement)
    return msg


def _forward(backend: Any, problem: H.Problem, q: Any, k: Any, v: Any, layer: Any = None,
             batch: Any = None) -> Callable[[], Any]:
    def call() -> Any:
        b = batch if batch is not None else problem.batch
        backend.init_forward_metadata(b)
        return backend.forward(q, k, v, layer if layer is not None else problem.layers[0], b, save_kv_cache=True)

    return call


def test_kv_none(attnplug_case: BoundCase) -> None:
    name = attnplug_case.backend
    case = _claimed_case(name, attnplug_case.case)
    problem = H.make_problem(case, H.device_for(capabilities(name)))
    backend = H.build_backend(name, problem, check_support=False)
    q = problem.qkv[0][0]
    _expect_refused(name, "k=v=None on a self-attention layer", _forward(backend, problem, q, None, None),
                    problem, ShapeError, [r"\bk\b|\bv\b"])


def _num(x: int) -> str:
    return rf"(?<![\d.]){re.escape(str(x))}(?![\d.])"


def test_rejected(attnplug_case: BoundCase) -> None:
    name, variant = attnplug_case.backend, attnplug_case.case.variant
    case = _claimed_case(name, attnplug_case.case)
    problem = H.make_problem(case, H.device_for(capabilities(name)))
    backend = H.build_backend(name, problem, check_support=False)
    cache, batch = problem.cache, problem.batch
    q, k, v = problem.qkv[0]
    layer = problem.layers[0]
    slots, rows, width = cache.num_slots, cache.req_to_token.shape[0], cache.req_to_token.shape[1]
    field, err_name = REJECTIONS[variant]
    error = NotSupportedError if err_name == "NotSupportedError" else ShapeError
    # request i: one with at least two cached positions
    i = next(j for j, p in enumerate(batch.extend_prefix_lens_cpu) if p >= 2)
    row = problem.req_rows[i]
    must = [field]
    if variant.startswith("out_cache_loc"):
        bad = slots if variant.endswith("beyond") else -1
        loc = batch.out_cache_loc.clone()
        loc[0] = bad
        batch = dataclasses.replace(batch, out_cache_loc=loc)
        must += [_num(bad), f"{_num(slots)}|{_num(0)}" if bad < 0 else _num(slots)]
    elif variant.startswith("req_pool_indices"):
        bad = rows if variant.endswith("beyond") else -1
        idx = batch.req_pool_indices.clone()
        idx[i] = bad
        batch = dataclasses.replace(batch, req_pool_indices=idx)
        must += [_num(bad), f"{_num(rows)}|{_num(0)}" if bad < 0 else _num(rows)]
    elif variant.startswith("layer_id"):
        bad = cache.num_layers if variant.endswith("beyond") else -1
        layer = dataclasses.replace(layer, layer_id=bad)
        must += [_num(bad), f"{_num(cache.num_layers)}|{_num(0)}" if bad < 0 else _num(cache.num_layers)]
    elif variant == "req_to_token_beyond":
        cache.req_to_token[row, 1] = slots
        must += [_num(slots)]
    elif variant == "req_to_token_unassigned":
        cache.req_to_token[row, 1] = -1
        must += [_num(-1)]
    elif variant == "seq_len_beyond_assigned":
        # the request's last cached positions have no slot (engines mark them -1)
        p = batch.extend_prefix_lens_cpu[i]
        cache.req_to_token[row, p - 2:p] = -1
    elif variant == "seq_len_beyond_context":
        seq = list(batch.seq_lens_cpu)
        ext = list(batch.extend_seq_lens_cpu)
        seq[i] = width + 5
        rows_t = batch.req_pool_indices
        if batch.forward_mode.is_decode():
            batch = ForwardBatch.decode(rows_t, seq, batch.out_cache_loc)
        else:
            prefix = [s - e for s, e in zip(seq, ext)]
            batch = ForwardBatch.extend(rows_t, prefix, ext, batch.out_cache_loc, mode=batch.forward_mode)
        must += [f"{_num(width + 5)}|{_num(width)}"]
    elif variant == "dtype_int32":
        q = (q.float() * 8).to(torch.int32)
        k, v = (None if t is None else (t.float() * 8).to(torch.int32) for t in (k, v))
    else:
        raise KeyError(variant)
    _expect_refused(name, f"a forward with {variant}", _forward(backend, problem, q, k, v, layer,
                                                                                    batch), problem, error, must)


# -- refusal of what is not claimed -------------------------------------------------
_FEATURE = {  # feature -> (layer shape, layer features, scenario, regex the error must match)
    "sliding_window": (DEFAULT_SHAPE, Features(sliding_window=4), "decode", r"sliding.?window"),
    "logit_softcap": (DEFAULT_SHAPE, Features(logit_cap=30.0), "decode", r"logit.?cap|soft.?cap"),
    "sinks": (DEFAULT_SHAPE, Features(sinks=True), "decode", r"sink"),
    "cross_attention": (DEFAULT_SHAPE, Features(cross_attention=True), "cross_decode", r"cross"),
    "bidirectional": (DEFAULT_SHAPE, Features(bidirectional=True), "extend_prefix", r"bidirectional"),
    "v_head_dim_differs": (Shape("dv32", 8, 2, 64, 32), Features(), "decode", r"v_head_dim"),
    "mqa": (Shape("mqa", 8, 1, 64), Features(), "decode", r"MQA|num_kv_heads"),
    "gqa": (Shape("gqa4", 8, 2, 64), Features(), "decode", r"GQA|group"),
    "mode_target_verify": (DEFAULT_SHAPE, Features(), "target_verify", r"target.?verify"),
    "mode_draft_extend": (DEFAULT_SHAPE, Features(), "draft_extend", r"draft.?extend"),
}


def _as_dtype(t: torch.Tensor, dtype: str) -> torch.Tensor:
    target = getattr(torch, dtype)
    if not (target.is_floating_point or target.is_complex):
        return (t.float() * 8).to(target)
    return t.to(target)


def test_refusal(attnplug_case: BoundCase) -> None:
    """What the backend does not claim is refused in words, and a forward using it is refused."""
    name, case = attnplug_case.backend, attnplug_case.case
    caps = capabilities(name)
    model = refusal_model_dtype(caps)
    device = H.device_for(caps)
    what = case.variant
    # level 0.1 checked some variants in words only (``case.requirement`` is None for them, the family's
    # own); every other variant, and the refused forward, is the newer ``refusal.forward``
    words = case.requirement
    # a variant a later level added names its own requirement for the words and the forward alike
    forward = case.requirement if case.requirement not in (None, "refusal.forward") else "refusal.forward"
    if what.startswith("dtype_"):
        dt = what[len("dtype_"):]
        problem = H.make_problem(_claimed_case(name, Case("refusal", what, scenario("decode"))), device)
        backend = H.build_backend(name, problem, check_support=False)
        ctx = problem.context(name)
        try:
            known = dtype_name(dt)
        except ValueError:
            known = None  # the core's dtype names do not cover it: the forward check below still applies
        if known is not None and not backend.not_supported_reasons(problem.layers[0], ctx.replace(dtype=known)):
            fail(f"{name} does not claim dtype {dt}, but not_supported_reasons() for a {dt} context is empty", words)
        q, k, v = (None if t is None else _as_dtype(t, dt) for t in problem.qkv[0])
        _expect_refused(name, f"a forward with q/k/v in unclaimed dtype {dt}", _forward(backend, problem, q, k, v),
                        problem, NotSupportedError, [re.escape(dt)], forward)
        return
    if what.startswith("kv_dtype_"):
        kv = what[len("kv_dtype_"):]
        base = _claimed_case(name, Case("refusal", what, scenario("decode")))
        problem = H.make_problem(dataclasses.replace(base, kv_cache_dtype=kv), device)
        ctx = problem.context(name)
        try:
            _, backend = default_registry().build(name, ctx)
        except NotSupportedError as exc:
            if not re.search(re.escape(kv), str(exc)):
                fail(f"{name}: building with unclaimed kv_cache_dtype {kv} was refused without naming it: {exc}", words)
            return  # refused at build: the best place
        except AttnplugError as exc:
            fail(f"{name}: building with unclaimed kv_cache_dtype {kv} raised {type(exc).__name__}: {exc} "
                 f"(expected attnplug.NotSupportedError)", words)
        if not backend.not_supported_reasons(problem.layers[0], ctx):
            fail(f"{name} does not claim kv_cache_dtype {kv} with a {model} model, but not_supported_reasons() "
                 f"for that context is empty", words)
        q, k, v = problem.qkv[0]
        _expect_refused(name, f"a forward over a KV cache in unclaimed dtype {kv}", _forward(backend, problem, q, k, v),
                        problem, NotSupportedError, [re.escape(kv)], forward)
        return
    shape, feats, sc, pattern = _FEATURE[what]
    if what not in ("v_head_dim_differs", "mqa", "gqa"):
        shape = claimed_shape(caps)
    base = _claimed_case(name, Case("refusal", what, scenario(sc)), shape=shape)
    try:
        problem = H.make_problem(dataclasses.replace(base, features=feats), device)
    except ValueError as exc:  # the backend's own KV layout cannot hold such a layer's cache at all
        if "cannot hold this cache" not in str(exc):
            raise
        if not re.search(pattern, str(exc)):
            fail(f"{name}: its KV layout {base.kv_layout!r} refused a cache for unclaimed {what} without naming "
                 f"it: {exc}", words)
        # in a layout that can hold it, the registry must refuse to build the backend, naming it too
        problem = H.make_problem(dataclasses.replace(base, features=feats, kv_layout="nhd"), device)
        try:
            default_registry().build(name, problem.context(name))
        except NotSupportedError as exc2:
            if not re.search(pattern, str(exc2)):
                fail(f"{name}: building for a layer using unclaimed {what} was refused without naming it: {exc2}", words)
            return
        fail(f"{name}: built over a cache for a layer using unclaimed {what}", words)
    try:
        backend = H.build_backend(name, problem, check_support=False)
    except NotSupportedError as exc:  # refused at build (the context lists the layer): the best place
        if not re.search(pattern, str(exc)):
            fail(f"{name}: building for a layer using unclaimed {what} was refused without naming it: {exc}", words)
        # a backend built without knowing the layers must still refuse the forward
        _, backend = default_registry().build(name, problem.context(name).replace(layers=()))
    layer = problem.layers[0]
    if not what.startswith("mode_") and not backend.not_supported_reasons(layer, problem.context(name)):
        fail(f"{name} does not claim {what}, but not_supported_reasons() for a layer using it is empty; "
             f"a backend must refuse, in words, what it does not claim", words)
    q, k, v = problem.qkv[0]
    _expect_refused(name, f"a forward using unclaimed {what}", _forward(backend, problem, q, k, v), problem,
                    NotSupportedError, [pattern], forward)

