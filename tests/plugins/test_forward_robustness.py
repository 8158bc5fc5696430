"""Issue 26, the forward path on every CPU backend: what a forward must never do with bad data.

Each family runs on cpu_fused (the fused C++ kernel), torch_native (the eager paths),
template_sdpa, triton (kernels in Triton's interpreter) and vllm_cpu (the real
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

import dataclasses
import importlib.util
import subprocess
import sys
import textwrap
from typing import Any

import pytest
import torch

from attnplug import LayerSpec, ShapeError
from attnplug.registry import default_registry
from attnplug.testing import reference
from attnplug.testing.suite import harness as H
from attnplug.testing.suite.cases import Case, Features, Scenario, Shape
from attnplug.testing.tolerances import tolerance_for

#: every CPU backend (cpu_fused: the fused C++ kernel; torch_native: the eager paths)
BACKENDS = ["cpu_fused", "torch_native", "template_sdpa", "triton", "vllm_cpu"]
IDS = BACKENDS
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
    name = request.param
    why = _available(name)
    if why:
        pytest.skip(why)
    return name


def _layout(name: str) -> str:
    layouts = default_registry().get(name).capabilities.kv_layouts
    return layouts[0] if layouts else "nhd"


def _claims(name: str, what: str) -> bool:
    return bool(getattr(default_registry().get(name).capabilities, what))


def make_case(name: str, sc: Scenario, *, features: Features = Features(), dtype: str = "float32",  # noqa: B008 (frozen)
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
    for _q, k, v in problem.qkv:
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


# ---------------------------------------------------------------------------
# 7. LayerSpec validates at construction
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("field,value", [
    ("logit_cap", -30.0), ("logit_cap", -1), ("logit_cap", float("nan")), ("logit_cap", float("inf")),
    ("logit_cap", float("-inf")), ("logit_cap", "30"), ("logit_cap", True),
    ("sliding_window", 5.0), ("sliding_window", True), ("sliding_window", -1), ("sliding_window", "8"),
    ("sliding_window", float("inf")), ("scaling", float("nan")), ("scaling", float("inf")), ("scaling", "0.1"),
])
def test_layer_spec_refuses_an_out_of_range_field_naming_it(field, value):
    with pytest.raises(ValueError, match=rf"LayerSpec\.{field}="):
        LayerSpec(0, 4, 2, 64, **{field: value})


@pytest.mark.parametrize("window,stored", [(0, 0), (7, 7), (2 ** 31 - 2, 2 ** 31 - 2), (2 ** 31 - 1, None),
                                           (2 ** 32, None), (2 ** 32 + 5, None), (2 ** 40, None)])
def test_layer_spec_stores_a_window_wider_than_any_position_as_none(window, stored):
    layer = LayerSpec(0, 4, 2, 64, sliding_window=window)
    assert layer.sliding_window == stored and type(layer.sliding_window) in (int, type(None))
    assert layer.uses_sliding_window is (stored is not None)


@pytest.mark.parametrize("cap", [None, 0, 0.0, 1e-3, 30, 50.0])
def test_layer_spec_accepts_a_finite_positive_cap_or_none(cap):
    assert LayerSpec(0, 4, 2, 64, logit_cap=cap).logit_cap == cap


# ---------------------------------------------------------------------------
# 2. page alignment: declared by backends that read through a page table
# ---------------------------------------------------------------------------
UNALIGNED = {
    # (scenario, request, positions to swap): all cached (< the request's prefix)
    "swap_in_page": (Scenario("extend_prefix", "extend", (7, 0, 20), (4, 6, 3)), 2, (1, 2)),
    "swap_across_pages": (Scenario("extend_prefix", "extend", (7, 0, 20), (4, 6, 3)), 2, (3, 17)),
    "decode_swap": (Scenario("decode", "decode", (0, 6, 16, 40), (1, 1, 1, 1)), 3, (2, 33)),
    "moved_to_a_spare_slot": (Scenario("decode", "decode", (0, 6, 16, 40), (1, 1, 1, 1)), 2, (4, None)),
}


def _unalign(problem: H.Problem, request: int, positions: tuple[int, int | None]) -> int:
    """Make request ``request``'s mapping not page-aligned; returns the first position that is not."""
    r2t, row = problem.cache.req_to_token, problem.req_rows[request]
    a, b = positions
    if b is None:  # one position moved to a slot no request owns (it holds noise, not garbage)
        spare = next(s for s in range(problem.cache.num_slots) if s not in set(problem.owned))
        r2t[row, a] = spare
        return a
    r2t[row, a], r2t[row, b] = int(r2t[row, b]), int(r2t[row, a])
    return a


@pytest.mark.parametrize("variant", sorted(UNALIGNED))
def test_a_mapping_that_is_not_page_aligned(backend_name, variant):
    """Refused, naming the request and the position, by a backend that reads through a page table;
    served exactly (the reference reads req_to_token position by position) by the others."""
    name = backend_name
    sc, request, positions = UNALIGNED[variant]
    problem = H.make_problem(make_case(name, sc), "cpu")
    pos = _unalign(problem, request, positions)
    backend = build(name, problem)
    before = problem.snapshot()
    if getattr(type(backend), "reads_page_table", False):
        with pytest.raises(ShapeError, match=rf"request {request}, position {pos}\).*not page-aligned"):
            forward(backend, problem)
        assert not H.cache_changes(before, problem)
    else:
        check_against_reference(name, problem, forward(backend, problem))


@pytest.mark.parametrize("module,cls", [
    ("attnplug_vllm_cpu.backend", "VllmCpuBackend"), ("attnplug_fa3.backend", "FA3Backend"),
    ("attnplug_trtllm_mha.backend", "TrtllmMHABackend"), ("attnplug_flashinfer.backend", "FlashInferBackend"),
    ("attnplug_torch_native.backend", "TorchNativeBackend"), ("attnplug_triton.backend", "TritonBackend"),
    ("attnplug_template_backend.backend", "TemplateSDPABackend"),
])
def test_backends_declare_whether_they_read_through_a_page_table(module, cls):
    """Page-table readers declare it (and so get the per-forward check); token-wise readers do not."""
    mod = pytest.importorskip(module)
    want = module.split(".")[0] in ("attnplug_vllm_cpu", "attnplug_fa3", "attnplug_trtllm_mha", "attnplug_flashinfer")
    assert getattr(mod, cls).reads_page_table is want


def test_the_page_check_runs_once_per_forward_not_per_layer(monkeypatch):
    """The check is per forward (init_forward_metadata), whatever the layer count."""
    if _available("vllm_cpu"):
        pytest.skip(_available("vllm_cpu"))
    from attnplug.kvcache import PagedKVCache
    from attnplug_vllm_cpu.backend import VllmCpuBackend
    calls = []
    real = PagedKVCache.check_page_aligned
    monkeypatch.setattr(PagedKVCache, "check_page_aligned",
                        lambda self, *a, **kw: (calls.append(1), real(self, *a, **kw)))
    # a decode batch's alignment is checked inside vllm_cpu's one pass over the batch (which then skips the
    # separate pass); count an accepting one pass as the check
    real_one = VllmCpuBackend._one_pass
    monkeypatch.setattr(VllmCpuBackend, "_one_pass", lambda self, b: real_one(self, b) and not calls.append(1))
    sc = Scenario("decode", "decode", (0, 6, 16, 40), (1, 1, 1, 1))
    problem = H.make_problem(make_case("vllm_cpu", sc), "cpu", layer_features=[Features()] * 3)
    backend = build("vllm_cpu", problem)
    backend.init_forward_metadata(problem.batch)
    for i in range(3):
        q, k, v = problem.qkv[i]
        backend.forward(q, k, v, problem.layers[i], problem.batch)
    assert len(calls) == 1


# ---------------------------------------------------------------------------
# 9. garbage written straight into layer storage (not through set_kv)
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("scn", ["decode", "extend_prefix", "mixed"])
def test_garbage_written_straight_into_layer_storage_reaches_no_output(backend_name, scn, value):
    """Every element of every layer's storage is garbage (raw tensor writes, as a KV transfer or a
    snapshot restore would do), then the slots requests own are written back: no output sees it."""
    name = backend_name
    sc = {"decode": Scenario("decode", "decode", (0, 6, 17, 40), (1, 1, 1, 1)),
          "extend_prefix": Scenario("extend_prefix", "extend", (7, 0, 20), (4, 6, 3)),
          "mixed": Scenario("mixed", "mixed", (10, 0, 23), (1, 6, 3))}[scn]
    problem = H.make_problem(make_case(name, sc), "cpu")
    H.fill_garbage_raw(problem, value)
    out = forward(build(name, problem), problem)
    check_against_reference(name, problem, out)
    assert bool(torch.isfinite(out).all())


# ---------------------------------------------------------------------------
# 3. req_to_token changed after init_forward_metadata: an error, never a signal
# ---------------------------------------------------------------------------
_CHILD = textwrap.dedent("""
    import os, sys
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from attnplug.registry import default_registry
    from attnplug.testing.suite import harness as H
    from attnplug.testing.suite.cases import Case, Scenario, Shape
    name, layout, scn, value = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    sc, i, pos = {
        "decode": (Scenario("decode", "decode", (0, 6, 16, 40), (1, 1, 1, 1)), 3, 20),
        "extend": (Scenario("extend", "extend", (3, 0, 9), (2, 5, 4)), 2, 7),
        "target_verify": (Scenario("tv", "target_verify", (5, 27), (4, 4), draft=4), 1, 10),
    }[scn]
    p = H.make_problem(Case("r2t", name + scn, sc, shape=Shape("g", 4, 2, 64), kv_layout=layout), "cpu")
    backend = default_registry().build(name, p.context(name))[1]
    backend.init_forward_metadata(p.batch)
    p.cache.req_to_token[p.req_rows[i], pos] = value  # after the per-forward checks
    q, k, v = p.qkv[0]
    try:
        backend.forward(q, k, v, p.layers[0], p.batch)
        print("RESULT returned")
    except Exception as exc:
        print("RESULT", type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
""")


@pytest.mark.parametrize("value", [10 ** 12, -1, 2 ** 40 + 3, -(2 ** 40)])
@pytest.mark.parametrize("scn", ["decode", "extend", "target_verify"])
@pytest.mark.parametrize("name", ["cpu_fused", "torch_native"])
def test_req_to_token_changed_after_the_checks_is_an_error_not_a_signal(name, scn, value, tmp_path):
    """cpu_fused (the fused kernel) and torch_native (eager paths), in a child process: a wild or negative
    slot written into req_to_token after init_forward_metadata raises (the fused kernel: a ShapeError
    naming the request, the position and the slot), and the process exits normally."""
    why = _available(name)
    if why:
        pytest.skip(why)
    env = dict(os.environ)
    proc = subprocess.run([sys.executable, "-c", _CHILD, name, "nhd", scn, str(value)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, f"the process ended with {proc.returncode}: {proc.stderr[-2000:]}"
    result = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")]
    assert result and result[0] != "RESULT returned", f"the forward returned: {proc.stdout}"
    if name == "cpu_fused":
        req, pos = {"decode": (3, 20), "extend": (2, 7), "target_verify": (1, 10)}[scn]
        assert result[0].startswith("RESULT ShapeError"), result[0]
        assert f"request {req} " in result[0] and f"position {pos} " in result[0] and str(value) in result[0]


@pytest.mark.parametrize("when", ["before_layer0", "between_layers"])
@pytest.mark.parametrize("value", ["in_range", -1, 10 ** 12])
@pytest.mark.parametrize("scn", ["decode", "extend"])
def test_req_to_token_written_after_the_checks_is_refused_on_every_backend(backend_name, scn, value, when):
    """The skeleton's general rule (``PagedBackend``: req_to_token's write counter recorded per forward and
    compared per layer): a write into ``req_to_token`` after ``init_forward_metadata`` — an out-of-range
    slot, or an in-range one the metadata did not see — refuses the layer with a ``ShapeError`` on every
    CPU backend, before any write; never a read of another request's K/V (template_sdpa read slot -1 as
    the last slot before), never a signal."""
    sc = {"decode": Scenario("decode", "decode", (9, 6, 16, 40), (1, 1, 1, 1)),
          "extend": Scenario("extend", "extend", (3, 17, 9), (2, 5, 4))}[scn]
    problem = H.make_problem(make_case(backend_name, sc), "cpu", layer_features=[Features(), Features()])
    backend = build(backend_name, problem)
    backend.init_forward_metadata(problem.batch)
    r2t, row = problem.cache.req_to_token, problem.req_rows[2]
    new = int(r2t[problem.req_rows[0], 0]) if value == "in_range" else value
    if when == "between_layers":
        q, k, v = problem.qkv[0]
        backend.forward(q, k, v, problem.layers[0], problem.batch)
    before, old = problem.snapshot(), int(r2t[row, 1])
    r2t[row, 1] = new
    q, k, v = problem.qkv[1 if when == "between_layers" else 0]
    layer = problem.layers[1 if when == "between_layers" else 0]
    with pytest.raises(ShapeError, match=r"req_to_token|position 1 "):
        backend.forward(q, k, v, layer, problem.batch)
    assert H.cache_changes(before, problem) == [], "a refused forward wrote into the cache"
    # once re-initialised (the table restored) the forward runs again
    r2t[row, 1] = old
    backend.init_forward_metadata(problem.batch)
    backend.forward(q, k, v, layer, problem.batch)


# ---------------------------------------------------------------------------
# 10. fp8 scales: read per call; the public lists cannot be changed behind set_kv_scales
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("kv_dtype", ["float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("scn", ["decode", "target_verify"])
@pytest.mark.parametrize("name", ["cpu_fused", "torch_native", "triton"])
def test_scales_changed_within_one_forward_are_used(name, scn, kv_dtype, monkeypatch):
    """set_kv_scales between two calls of one forward (metadata built once; the second call of a layer
    reuses what the first prepared): every call reads the cache with the scales set at that moment,
    as the reference does."""
    why = _available(name)
    if why:
        pytest.skip(why)
    sc = {"decode": Scenario("decode", "decode", (0, 6, 16, 40), (1, 1, 1, 1)),
          "target_verify": Scenario("tv", "target_verify", (5, 27), (4, 4), draft=4)}[scn]
    case = make_case(name, sc, dtype="bfloat16", kv_cache_dtype=kv_dtype, kv_scales=(0.5, 2.0))
    problem = H.make_problem(case, "cpu")
    backend = build(name, problem)
    backend.init_forward_metadata(problem.batch)
    q, k, v = problem.qkv[0]
    backend.forward(q, k, v, problem.layers[0], problem.batch, save_kv_cache=False)
    for scales in ((4.0, 0.25), (1.0, 1.0)):
        problem.cache.set_kv_scales(0, *scales)
        out = backend.forward(q, k, v, problem.layers[0], problem.batch, save_kv_cache=False)
        check_against_reference(name, problem, out)


def test_public_scales_are_read_only():
    from attnplug.kvcache import PagedKVCache
    cache = PagedKVCache(2, 4, 2, 16, page_size=4, dtype="float8_e4m3fn")
    cache.set_kv_scales(1, 0.5, 2.0)
    assert cache.k_scales == (1.0, 0.5) and cache.v_scales == (1.0, 2.0)
    for attr in ("k_scales", "v_scales"):
        with pytest.raises(TypeError):
            getattr(cache, attr)[0] = 0.0
        with pytest.raises(AttributeError):
            setattr(cache, attr, [0.0, 0.0])
    assert cache.kv_scales(0) == (1.0, 1.0) and cache.kv_scales(1) == (0.5, 2.0)
    for bad in (0, 0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="k_scale"):
            cache.set_kv_scales(0, bad, 1.0)
    assert cache.kv_scales(0) == (1.0, 1.0)
