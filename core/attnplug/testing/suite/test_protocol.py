"""Protocol cases: effective names and stamps, capabilities that agree,
metadata required before forward, clear errors for bad input shapes. (Refusal
of what is not claimed and rejected forwards: ``test_robustness``.)"""

from __future__ import annotations

import dataclasses
import re
import warnings
from typing import TYPE_CHECKING, Any

import pytest
import torch

from ...capabilities import RESTRICTIONS
from ...errors import MetadataNotInitializedError, ShapeError
from ...registry import default_registry
from . import harness as H
from ._common import capabilities, fail
from .cases import Case, claimed_shape, first_layout, scenario

if TYPE_CHECKING:
    from ..pytest_plugin import BoundCase


def _small_problem(name: str, sc: str = "decode") -> H.Problem:
    caps = capabilities(name)
    dtype = "float32" if "float32" in caps.dtypes else caps.dtypes[0]
    ps = 16 if caps.page_sizes is None or 16 in caps.page_sizes else caps.page_sizes[0]
    case = Case("protocol", f"{name}-{sc}", scenario(sc, ps), dtype=dtype, page_size=ps, numeric=False,
                shape=claimed_shape(caps), kv_layout=first_layout(caps))
    return H.make_problem(case, H.device_for(caps))


def test_effective_name_and_stamps(attnplug_backend: str) -> None:
    reg = default_registry()
    problem = _small_problem(attnplug_backend)
    effective, backend = reg.build(attnplug_backend, problem.context(attnplug_backend))
    stamps = (backend.prefill_attention_backend_str, backend.decode_attention_backend_str)
    if stamps != (effective, effective):
        fail(f"after building {attnplug_backend!r} the stamps are {stamps}, expected both to be the effective "
             f"name {effective!r}")
    if effective in reg.aliases():
        fail(f"effective name {effective!r} is an alias of {reg.aliases()[effective][0]!r}; "
             f"factories must return canonical names")
    if effective not in reg.names():
        fail(f"effective name {effective!r} is not a registered backend (registered: {', '.join(reg.names())})")


def test_aliases_build_canonical(attnplug_backend: str) -> None:
    reg = default_registry()
    desc = reg.get(attnplug_backend)
    aliases = desc.all_aliases()
    if not aliases:
        pytest.skip(f"aliases: {attnplug_backend} declares none")
    problem = _small_problem(attnplug_backend)
    for alias in aliases:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            canonical = reg.canonical(alias)
            effective, backend = reg.build(alias, problem.context(attnplug_backend))
        if canonical != attnplug_backend:
            fail(f"alias {alias!r} resolves to {canonical!r}, expected {attnplug_backend!r}")
        stamps = (backend.prefill_attention_backend_str, backend.decode_attention_backend_str)
        if effective in reg.aliases() or stamps != (effective, effective):
            fail(f"building through alias {alias!r} gave effective name {effective!r} and stamps {stamps}; "
                 f"both stamps must be the canonical effective name")


def test_capabilities_agree(attnplug_backend: str) -> None:
    """Everything the descriptor claims (what resolution and this suite read) the backend class claims too."""
    desc_caps = capabilities(attnplug_backend)
    problem = _small_problem(attnplug_backend)
    backend = H.build_backend(attnplug_backend, problem, check_support=False)
    cls_caps = type(backend).capabilities
    missing = []
    for f in dataclasses.fields(desc_caps):
        d, c = getattr(desc_caps, f.name), getattr(cls_caps, f.name)
        if f.name in RESTRICTIONS:  # True claims less: the class may not restrict what the descriptor allows
            if c and not d:
                missing.append(f"{f.name}=False")
        elif isinstance(d, bool):
            if d and not c:
                missing.append(f"{f.name}=True")
        elif f.name in ("dtypes", "kv_cache_dtypes", "devices"):
            extra = [x for x in d if x not in c]
            if extra:
                missing.append(f"{f.name} {extra}")
        elif f.name in ("head_dims", "page_sizes"):
            if c is not None and (d is None or any(x not in c for x in d)):
                missing.append(f"{f.name}={d} (backend class: {c})")
    if missing:
        fail(f"the descriptor of {attnplug_backend} claims {', '.join(missing)}, but "
             f"{type(backend).__name__}.capabilities does not")


def test_metadata_required(attnplug_case: BoundCase) -> None:
    name, case = attnplug_case.backend, attnplug_case.case
    problem = _small_problem(name, case.scenario.name)
    backend = H.build_backend(name, problem, check_support=False)
    q, k, v = problem.qkv[0]
    batch = problem.batch
    if case.variant == "other_batch":
        backend.init_forward_metadata(problem.batch)
        batch = dataclasses.replace(problem.batch)  # equal contents, a different forward
    try:
        backend.forward(q, k, v, problem.layers[0], batch, save_kv_cache=False)
    except MetadataNotInitializedError as exc:
        if "init_forward_metadata" not in str(exc):
            fail(f"MetadataNotInitializedError should name init_forward_metadata; got: {exc}")
        return
    except Exception as exc:
        fail(f"{name}: forward on a batch init_forward_metadata did not see raised {type(exc).__name__}: {exc} "
             f"(expected attnplug.MetadataNotInitializedError)")
    what = "before init_forward_metadata" if case.variant == "never_initialised" else \
        "on a batch other than the one init_forward_metadata saw"
    fail(f"{name}: forward {what} returned without error (expected attnplug.MetadataNotInitializedError)")


_BAD_FIELD = {"q_heads": "q", "q_head_dim": "q", "q_tokens": "q", "k_kv_heads": "k", "v_head_dim": "v",
              "kv_dtype": "k"}


def _bad_inputs(variant: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[Any, Any, Any]:
    t, h, d = q.shape
    kvh, dv = k.shape[1], v.shape[2]
    if variant == "q_heads":
        return q.new_zeros(t, h + 1, d), k, v
    if variant == "q_head_dim":
        return q.new_zeros(t, h, d + 8), k, v
    if variant == "q_tokens":
        return q.new_zeros(t + 1, h, d), k, v
    if variant == "k_kv_heads":
        return q, k.new_zeros(t, kvh + 1, d), v
    if variant == "v_head_dim":
        return q, k, v.new_zeros(t, kvh, dv + 8)
    if variant == "kv_dtype":
        return q, k.to(torch.float64), v
    raise KeyError(variant)


def test_bad_input(attnplug_case: BoundCase) -> None:
    name, case = attnplug_case.backend, attnplug_case.case
    problem = _small_problem(name, case.scenario.name)
    backend = H.build_backend(name, problem, check_support=False)
    q, k, v = _bad_inputs(case.variant, *H.self_attention_qkv(problem, 0))
    before = problem.snapshot()
    backend.init_forward_metadata(problem.batch)
    field = _BAD_FIELD[case.variant]
    try:
        backend.forward(q, k, v, problem.layers[0], problem.batch, save_kv_cache=True)
    except ShapeError as exc:
        msg = str(exc)
        if not re.search(rf"\b{field}\b", msg):
            fail(f"ShapeError for a bad {field!r} ({case.variant}) should name the field {field!r}; got: {msg}")
    except Exception as exc:
        fail(f"{name}: bad input ({case.variant}) raised {type(exc).__name__}: {exc} "
             f"(expected attnplug.ShapeError naming {field!r})")
    else:
        fail(f"{name}: bad input ({case.variant}: q {tuple(q.shape)} {q.dtype}, k {tuple(k.shape)} {k.dtype}, "
             f"v {tuple(v.shape)}) was accepted (expected attnplug.ShapeError naming {field!r})")
    for i, ((k0, v0), (k1, v1)) in enumerate(zip(before, problem.snapshot())):
        if not (torch.equal(k0, k1) and torch.equal(v0, v1)):
            fail(f"{name}: a rejected forward ({case.variant}) still wrote layer {i} of the KV cache")
