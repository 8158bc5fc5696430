"""Building problems for conformance cases and checking a backend's answers.

A *problem* is one paged KV cache (every slot filled with noise, pages
scattered at random by ``PageAllocator``), one ``ForwardBatch`` and the
q/k/v of every layer, all drawn from the case's fixed seed. The backend is
built through the real registry (``default_registry().build``) with a
``BuildContext`` that carries that cache. Expected values come from
``attnplug.testing.reference`` only.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Sequence

import torch

try:
    import pytest
except ImportError:  # `attnplug doctor` uses this harness on a plain install, where pytest may be absent

    class _WithoutPytest:
        """What the harness needs of pytest where it is not installed: ``fail`` and ``skip`` raise plain
        errors (doctor reports them as the case's failure), never an ImportError for the whole backend."""

        @staticmethod
        def fail(reason: str = "", pytrace: bool = True) -> Any:
            raise AssertionError(reason)

        @staticmethod
        def skip(reason: str = "") -> Any:
            raise RuntimeError(f"skipped: {reason}")

    pytest = _WithoutPytest()  # type: ignore[assignment]

from ...backend import AttentionBackend
from ...batch import ForwardBatch
from ...config import AttentionConfig
from ...build_context import BuildContext
from ...dtypes import torch_dtype
from ...errors import ShapeError
from ...kvcache import PageAllocator, PagedKVCache
from ...layer import LayerSpec
from ...modes import ForwardMode
from ...registry import default_registry
from .. import reference
from ..tolerances import Tolerance
from .cases import Case, Features, Scenario, Shape

__all__ = [
    "EXACT_IN",
    "FAR_BELOW",
    "FIRST_LEAD",
    "GARBAGE_VALUES",
    "MAX_CONTEXT",
    "MAX_REQUESTS",
    "Comparison",
    "Problem",
    "bits",
    "build_backend",
    "cache_changes",
    "check_cache",
    "check_output_shape",
    "compare",
    "device_for",
    "exact_in",
    "expected_cache",
    "expected_output",
    "fill_garbage",
    "fill_garbage_raw",
    "make_batch",
    "make_layer",
    "make_problem",
    "make_qkv",
    "poison_last_new_tokens",
    "run",
    "same_bytes",
    "self_attention_qkv",
    "shape_scores",
    "threads",
    "unalign",
]

MAX_REQUESTS = 16
#: req_to_token width: room for the long cases (4.2k tokens) with margin
MAX_CONTEXT = 8192
#: what ``Case.garbage`` writes into every slot no request owns
GARBAGE_VALUES: dict[str, float] = {"nan": float("nan"), "inf": float("inf")}


def device_for(caps: Any) -> str:
    """The device cases run on: CUDA when present and claimed, else the CPU."""
    if "cuda" in caps.devices and torch.cuda.is_available():
        return "cuda"
    if "cpu" in caps.devices:
        return "cpu"
    pytest.skip(f"devices: the backend claims {', '.join(caps.devices)}; none of them is on this host")
    raise AssertionError  # unreachable


@dataclasses.dataclass
class Problem:
    case: Case
    device: str
    layers: list[LayerSpec]
    cache: PagedKVCache
    batch: ForwardBatch
    qkv: list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]]
    req_rows: list[int]
    gen: torch.Generator
    #: per layer: (K, V) buffers as they were before any forward of this problem
    before: list[tuple[torch.Tensor, torch.Tensor]] = dataclasses.field(default_factory=list)
    #: slots some request owns (``req_to_token[r, :len]``); with ``Case.garbage`` every other slot is garbage
    owned: list[int] = dataclasses.field(default_factory=list)

    def snapshot(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's K/V, token-major ``[num_slots, …]``, read through the cache's layout."""
        return [self.cache.read_kv(i) for i in range(self.cache.num_layers)]

    def restore(self, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Write every slot of every layer back to ``kv`` (a ``snapshot()``), through the layout."""
        every = torch.arange(self.cache.num_slots, device=self.cache.device)
        for i, (k, v) in enumerate(kv):
            self.cache.set_kv(i, every, k, v, stored=True)

    def context(self, name: str) -> BuildContext:
        c = self.case
        sh = c.shape
        return BuildContext(
            config=AttentionConfig(attention_backend=name),
            host=default_registry().host,
            device=self.device,
            dtype=c.dtype,
            kv_cache_dtype=c.kv_dtype,
            num_heads=sh.num_heads,
            num_kv_heads=sh.num_kv_heads,
            head_dim=sh.head_dim,
            v_head_dim=sh.v_dim,
            page_size=c.page_size,
            kv_cache=self.cache,
            max_batch_size=MAX_REQUESTS,
            max_context_len=MAX_CONTEXT,
            layers=tuple(self.layers),
            **({} if c.max_workspace_bytes is None else {"max_workspace_bytes": c.max_workspace_bytes}),  # type: ignore[arg-type]
        )


def _randn(gen: torch.Generator, shape: Sequence[int], dtype: str, device: str, scale: float = 1.0) -> torch.Tensor:
    x = torch.randn(*shape, generator=gen, dtype=torch.float32) * scale
    return x.to(device=device, dtype=torch_dtype(dtype))


#: what ``Case.exact_in`` may name: the new tokens' q, k, v and the layers' sinks
EXACT_IN: tuple[str, ...] = ("q", "k", "v", "sinks")


def exact_in(case: Case, what: str) -> str | None:
    """The dtype ``case.exact_in`` draws ``what`` exactly representable in (``None``: drawn as usual).
    An unknown ``what`` or dtype in ``case.exact_in`` is a ``ValueError`` naming the case and the pair."""
    found = None
    for name, dtype in case.exact_in:
        if name not in EXACT_IN:
            raise ValueError(f"case {case.family}:{case.id}: exact_in names {name!r}; expected one of "
                             f"{', '.join(EXACT_IN)}")
        if not isinstance(getattr(torch, str(dtype), None), torch.dtype):
            raise ValueError(f"case {case.family}:{case.id}: exact_in ({name!r}, {dtype!r}): "
                             f"{dtype!r} is not a torch dtype name")
        if name == what:
            found = str(dtype)
    return found


def _exact(x: torch.Tensor, dtype: str | None) -> torch.Tensor:
    """``x`` rounded to ``dtype`` and back (``None``: ``x`` itself)."""
    return x if dtype is None else x.to(getattr(torch, dtype)).to(x.dtype)


def make_layer(layer_id: int, shape: Shape, features: Features, gen: torch.Generator, device: str,
               *, sinks_exact_in: str | None = None) -> LayerSpec:
    """One layer of ``shape`` with ``features``; ``sinks_exact_in``: sinks rounded to that dtype (and back)."""
    sinks = None
    if features.sinks:
        # sink logits large enough that ignoring them is visible at every dtype
        sinks = torch.linspace(0.0, 4.0, shape.num_heads)[torch.randperm(shape.num_heads, generator=gen)]
        sinks = _exact(sinks.to(device=device, dtype=torch.float32), sinks_exact_in)
    return LayerSpec(
        layer_id=layer_id,
        num_heads=shape.num_heads,
        num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        v_head_dim=shape.v_dim,
        scaling=features.scaling,  # type: ignore[arg-type]  # None: LayerSpec's default
        logit_cap=features.logit_cap,
        sliding_window=features.sliding_window,
        sinks=sinks,
        is_cross_attention=features.cross_attention,
        causality="bidirectional" if features.bidirectional else "causal",
    )


def make_problem(
    case: Case,
    device: str,
    *,
    layer_features: Sequence[Features] | None = None,
    final_lens: Sequence[int] | None = None,
) -> Problem:
    """Cache, batch and q/k/v for ``case``; one layer per entry of ``layer_features``.

    ``case.unmapped_new``: the new tokens get fresh slots in ``out_cache_loc`` while
    ``req_to_token`` still maps their positions to the stale slots assigned first.
    ``case.garbage``: every slot no request owns holds NaN/+inf, and so do the
    ``out_cache_loc`` slots when the case does not save (they are stale then);
    ``req_to_token`` entries past each request's length point at a garbage slot;
    with ``case.garbage_raw`` it is written straight into the layers' storage
    (``fill_garbage_raw``). ``case.garbage_new``: the last new token of each request
    with two or more holds garbage in its K and V. ``case.unaligned``: the first
    request with two cached positions has them swapped (``unalign``). ``case.exact_in``:
    q/k/v/sinks drawn exactly representable in the dtypes it names (``exact_in``).
    """
    gen = torch.Generator().manual_seed(case.seed)
    sc, ps, sh = case.scenario, case.page_size, case.shape
    feats = list(layer_features) if layer_features is not None else [case.features]
    layers = [make_layer(i, sh, f, gen, device, sinks_exact_in=exact_in(case, "sinks")) for i, f in enumerate(feats)]
    n = len(sc.prefix)
    lens = list(final_lens) if final_lens is not None else list(sc.seq_lens)
    pages_needed = [(max(length, 1) + ps - 1) // ps for length in lens]
    fresh_pages = (sc.num_tokens + ps - 1) // ps if case.unmapped_new else 0
    num_pages = sum(pages_needed) + fresh_pages + 5  # spare pages: stray writes land somewhere visible
    cache = PagedKVCache(len(layers), num_pages, sh.num_kv_heads, sh.head_dim, v_head_dim=sh.v_dim,
                         page_size=ps, dtype=case.kv_dtype, device=device,
                         max_requests=MAX_REQUESTS, max_context_len=max(MAX_CONTEXT, max(lens, default=0)),
                         layout=default_registry().kv_layout(case.kv_layout))
    if case.kv_scales is not None:
        for i in range(len(layers)):
            cache.set_kv_scales(i, *case.kv_scales)
    every = torch.arange(cache.num_slots, device=device)
    for i in range(len(layers)):  # noise in every slot, written through the layout (quantized for fp8)
        cache.set_kv(i, every, _randn(gen, (cache.num_slots, sh.num_kv_heads, sh.head_dim), case.kv_dtype, device),
                     _randn(gen, (cache.num_slots, sh.num_kv_heads, sh.v_dim), case.kv_dtype, device))
    alloc = PageAllocator(num_pages, shuffle=True, seed=case.seed)
    rows = torch.randperm(MAX_REQUESTS, generator=gen)[:n].tolist()
    for r, length, need in zip(rows, lens, pages_needed):
        cache.assign_pages(r, length, alloc.alloc(need))
    fresh = None
    if case.unmapped_new and sc.num_tokens:
        pages = torch.tensor(alloc.alloc(fresh_pages), dtype=torch.int64)
        fresh = (pages[:, None] * ps + torch.arange(ps)[None, :]).reshape(-1)[:sc.num_tokens].to(device)
    batch = make_batch(sc, cache, rows, gen, device, out_cache_loc=fresh)
    problem = Problem(case, device, layers, cache, batch, [], rows, gen)
    if case.unaligned:
        unalign(problem)
    owned: set[int] = set()
    for r, length in zip(rows, lens):
        owned.update(cache.req_to_token[r, :length].tolist())
    if sc.encoder is not None:
        for r, enc in zip(rows, sc.encoder):
            owned.update(cache.req_to_token[r, :enc].tolist())
    problem.owned = sorted(owned)
    if case.garbage and case.garbage_raw:
        fill_garbage_raw(problem, GARBAGE_VALUES[case.garbage], stale_new=not case.save_kv_cache)
    elif case.garbage:
        fill_garbage(problem, GARBAGE_VALUES[case.garbage], stale_new=not case.save_kv_cache)
    problem.qkv = [make_qkv(problem, layer) for layer in layers]
    if case.garbage_new:
        poison_last_new_tokens(problem, GARBAGE_VALUES[case.garbage or "nan"])
    if case.scores:
        shape_scores(problem, case.scores)
    problem.before = problem.snapshot()
    return problem


#: ``shape_scores``: the score along the shared direction: every score near -FAR_BELOW, and the
#: first key's score near +FIRST_LEAD (the rest spread a few units around zero)
FAR_BELOW = 300.0
FIRST_LEAD = 20.0


def shape_scores(problem: Problem, how: str) -> None:
    """Give every query and every key a request reads a shared direction ``u`` (unit, random):
    ``"far_below"``: q = a·u + noise, k = -a·u + noise for every owned key and new token, so
    every score is hundreds below zero while their spread stays that of the noise;
    ``"max_first"``: q = b·u + noise and each request's first key (position 0: in the cache, or
    its first new token) k = b·u, so that key's score leads the rest by about 20, and the row
    maximum sits in the first key block only."""
    gen, cache = problem.gen, problem.cache
    sc = problem.case.scenario
    for i, layer in enumerate(problem.layers):
        q, k, v = problem.qkv[i]
        d = layer.head_dim
        u = torch.randn(d, generator=gen, dtype=torch.float64)
        u /= u.norm()
        scale = layer.scaling
        a = b = ((FAR_BELOW if how == "far_below" else FIRST_LEAD) / scale) ** 0.5
        qd = q.dtype
        q64 = q.to(torch.float64) * 0.5 + b * u
        problem.qkv[i] = (q64.to(qd), k, v)
        if how == "far_below":
            own = torch.tensor(problem.owned, dtype=torch.int64, device=cache.device)
            if own.numel():
                k0, v0 = cache.read_kv(i, own)
                k_new = (k0.to(torch.float64) * 0.5 - a * u).to(k0.dtype if not cache.quantized else torch.float32)
                cache.set_kv(i, own, k_new, v0, stored=not cache.quantized)
            if k is not None:
                problem.qkv[i] = (q64.to(qd), (k.to(torch.float64) * 0.5 - a * u).to(k.dtype), v)
        else:
            firsts = []
            for r, p in zip(problem.req_rows, sc.prefix):
                if p > 0:  # the first key is cached
                    firsts.append(int(cache.req_to_token[r, 0]))
            if firsts:
                slots = torch.tensor(firsts, dtype=torch.int64, device=cache.device)
                k0, v0 = cache.read_kv(i, slots)
                lead = (b * u).to(k0.dtype).expand_as(k0).contiguous()
                cache.set_kv(i, slots, lead, v0, stored=True)
            if k is not None:
                k2 = k.clone()
                t = 0
                for p, e in zip(sc.prefix, sc.extend):
                    if p == 0 and e > 0:  # the first key is this request's first new token
                        k2[t] = (b * u).to(k.dtype)
                    t += e
                problem.qkv[i] = (q64.to(qd), k2, v)


@contextlib.contextmanager
def threads(n: int | None) -> Any:
    """Run with ``n`` torch threads (``None``: unchanged); restored on exit."""
    if n is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def unalign(problem: Problem) -> tuple[int, int] | None:
    """Swap the slots of cached positions 0 and 1 of the first request with two cached positions (page size
    >= 2: ``req_to_token`` is then not page-aligned); returns ``(request, position 0)`` or ``None``."""
    r2t = problem.cache.req_to_token
    for i, (row, p) in enumerate(zip(problem.req_rows, problem.batch.extend_prefix_lens_cpu)):
        if p >= 2:
            r2t[row, 0], r2t[row, 1] = int(r2t[row, 1]), int(r2t[row, 0])
            return i, 0
    return None


def poison_last_new_tokens(problem: Problem, value: float) -> list[int]:
    """Write ``value`` into the K and V (every layer) of each request's last new token when it has two or
    more (causality hides it from the request's earlier tokens); returns the tokens."""
    tokens, t0 = [], 0
    for e in problem.batch.extend_seq_lens_cpu:
        if e >= 2:
            tokens.append(t0 + e - 1)
        t0 += e
    for _, k, v in problem.qkv:
        if k is not None and tokens:
            k[tokens] = value
            v[tokens] = value  # type: ignore[index]
    return tokens


def fill_garbage_raw(problem: Problem, value: float, *, stale_new: bool = False) -> None:
    """Like ``fill_garbage``, but the garbage goes straight into each layer's storage
    (``PagedKVCache.layer_storage``: every floating-point element filled by a tensor write, never
    ``set_kv`` or the layout, so no layout bookkeeping sees it), then the slots requests own are written
    back as they were. Refreshes ``problem.before``."""
    cache = problem.cache
    keep = torch.tensor(problem.owned, dtype=torch.int64, device=cache.device)
    if stale_new and problem.batch.num_tokens:
        stale = problem.batch.out_cache_loc.to(cache.device)
        keep = keep[~torch.isin(keep, stale)]
    for i in range(cache.num_layers):
        kept = cache.read_kv(i, keep) if keep.numel() else None
        for t in cache.layer_storage(i):
            if t.dtype.is_floating_point:
                t.fill_(value)
        if kept is not None:
            cache.set_kv(i, keep, *kept, stored=True)
    bad = next((s for s in range(cache.num_slots) if s not in set(keep.tolist())), None)
    if bad is not None:
        for r, length in zip(problem.req_rows, problem.case.scenario.seq_lens):
            cache.req_to_token[r, length:] = bad
    if problem.qkv:
        problem.before = problem.snapshot()


def fill_garbage(problem: Problem, value: float, *, stale_new: bool) -> None:
    """Write ``value`` into every slot outside ``problem.owned`` (and into ``out_cache_loc``
    when ``stale_new``); point ``req_to_token`` past each request's length at a garbage slot."""
    cache = problem.cache
    keep = torch.zeros(cache.num_slots, dtype=torch.bool)
    keep[torch.tensor(problem.owned, dtype=torch.int64)] = True
    if stale_new and problem.batch.num_tokens:
        keep[problem.batch.out_cache_loc.cpu()] = False
    bad = (~keep).nonzero().flatten().to(cache.device)
    if not bad.numel():
        return
    for i in range(cache.num_layers):
        k, v = cache.read_kv(i, bad)  # stored values: garbage is written as it is, never quantized
        cache.set_kv(i, bad, k.fill_(value), v.fill_(value), stored=True)
    first_bad = int(bad[0])
    lens = problem.case.scenario.seq_lens
    for r, length in zip(problem.req_rows, lens):
        cache.req_to_token[r, length:] = first_bad


def make_batch(sc: Scenario, cache: PagedKVCache, rows: Sequence[int], gen: torch.Generator,
               device: str, out_cache_loc: torch.Tensor | None = None) -> ForwardBatch:
    """The batch of ``sc``; ``out_cache_loc`` defaults to the slots ``req_to_token`` maps the new positions to."""
    mode = ForwardMode.parse(sc.mode)
    if mode is ForwardMode.IDLE:
        return ForwardBatch.idle(device)
    if out_cache_loc is not None:
        out_loc = out_cache_loc
    else:
        locs = [cache.slots(r, p, p + e) for r, p, e in zip(rows, sc.prefix, sc.extend)]
        out_loc = torch.cat(locs) if locs else torch.zeros(0, dtype=torch.int64, device=device)
    kw: dict[str, Any] = {}
    if sc.encoder is not None:
        kw["encoder_lens"] = torch.tensor(sc.encoder, dtype=torch.int64, device=device)
    rows_t = torch.tensor(list(rows), dtype=torch.int64, device=device)
    if mode is ForwardMode.DECODE:
        seq = torch.tensor(sc.seq_lens, dtype=torch.int64, device=device)
        return ForwardBatch.decode(rows_t, seq, out_loc, **kw)
    if mode is ForwardMode.TARGET_VERIFY:
        kw["spec_num_draft_tokens"] = sc.draft
        if sc.custom_mask:
            d = sc.draft or 0
            mask = torch.rand(len(rows), d, d, generator=gen) < 0.5
            mask = torch.tril(mask) | torch.eye(d, dtype=torch.bool)  # a draft always sees itself ...
            if sc.mask_hides_row:
                mask[0, 0, :] = False  # ... except this one: with no prefix it sees no key at all
            kw["spec_custom_mask"] = mask.to(device)
    elif sc.custom_mask:
        # a verify mask on a batch that is not target-verify: only the diagonal (so applying it
        # would hide every earlier draft); the backend must ignore it
        d = sc.draft or 0
        kw["spec_num_draft_tokens"] = d
        kw["spec_custom_mask"] = torch.eye(d, dtype=torch.bool).expand(len(rows), d, d).contiguous().to(device)
    prefix = torch.tensor(sc.prefix, dtype=torch.int64, device=device)
    ext = torch.tensor(sc.extend, dtype=torch.int64, device=device)
    return ForwardBatch.extend(rows_t, prefix, ext, out_loc, mode=mode, **kw)


def self_attention_qkv(problem: Problem, layer_idx: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Layer ``layer_idx``'s q/k/v for a check that needs this forward's K/V (only a cross-attention
    layer has none: such a check is not generated for it; an error naming the layer if it is)."""
    q, k, v = problem.qkv[layer_idx]
    if k is None or v is None:
        raise ShapeError(f"layer {layer_idx} of case {problem.case} has no k/v (cross-attention): this check needs "
                         f"self-attention K/V")
    return q, k, v


def make_qkv(problem: Problem, layer: LayerSpec) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    c, gen, dev = problem.case, problem.gen, problem.device
    t = problem.batch.num_tokens
    q_scale = 3.0 if layer.logit_cap else 1.0  # scores large enough for the cap to bite
    q = _exact(_randn(gen, (t, layer.num_heads, layer.head_dim), c.dtype, dev, q_scale), exact_in(c, "q"))
    if layer.is_cross_attention:
        return q, None, None
    k = _exact(_randn(gen, (t, layer.num_kv_heads, layer.head_dim), c.dtype, dev), exact_in(c, "k"))
    v = _exact(_randn(gen, (t, layer.num_kv_heads, layer.v_head_dim), c.dtype, dev), exact_in(c, "v"))
    return q, k, v


# -- building ------------------------------------------------------------------
def build_backend(name: str, problem: Problem, *, check_support: bool = True) -> Any:
    """Build ``name`` through the registry for this problem; a claimed case the
    backend then refuses (``not_supported_reasons``) fails here."""
    ctx = problem.context(name)
    _, backend = default_registry().build(name, ctx)
    if check_support:
        for layer in problem.layers:
            reasons = backend.not_supported_reasons(layer, ctx)
            if reasons:
                pytest.fail(
                    f"{name} claims this case in its capabilities, but not_supported_reasons() "
                    f"for layer {layer.layer_id} says: {'; '.join(reasons)}",
                    pytrace=False,
                )
    return backend


def expected_output(problem: Problem, layer_idx: int, kv_before: tuple[torch.Tensor, torch.Tensor] | None = None,
                    qkv: Any = None) -> torch.Tensor:
    k_before, v_before = kv_before or problem.before[layer_idx]
    q, k, v = qkv or problem.qkv[layer_idx]
    return reference.reference_attention(q, k, v, problem.layers[layer_idx], problem.batch,
                                         k_before, v_before, problem.cache.req_to_token,
                                         *problem.cache.kv_scales(layer_idx))


def expected_cache(problem: Problem, layer_idx: int, kv_before: tuple[torch.Tensor, torch.Tensor] | None = None,
                   qkv: Any = None, save: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    k_before, v_before = kv_before or problem.before[layer_idx]
    if not save:
        return k_before, v_before
    _, k, v = qkv or problem.qkv[layer_idx]
    return reference.expected_cache_after(k_before, v_before, k, v, problem.batch.out_cache_loc,
                                          *problem.cache.kv_scales(layer_idx))


def run(backend: AttentionBackend, problem: Problem, layer_idx: int = 0, *, init: bool = True,
        save: bool | None = None,
        qkv: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None = None) -> torch.Tensor:
    if init:
        backend.init_forward_metadata(problem.batch)
    q, k, v = qkv or problem.qkv[layer_idx]
    save = problem.case.save_kv_cache if save is None else save
    return backend.forward(q, k, v, problem.layers[layer_idx], problem.batch, save_kv_cache=save)


# -- checking -------------------------------------------------------------------
@dataclasses.dataclass
class Comparison:
    max_abs_err: float
    tolerance: Tolerance
    ok: bool
    detail: str = ""

    def record(self) -> dict[str, Any]:
        return {"max_abs_err": self.max_abs_err, "tolerance": self.tolerance.to_dict()}


def check_output_shape(out: Any, problem: Problem, layer_idx: int = 0) -> None:
    layer = problem.layers[layer_idx]
    exp = (problem.batch.num_tokens, layer.num_heads, layer.v_head_dim)
    if not isinstance(out, torch.Tensor):
        pytest.fail(f"forward returned {type(out).__name__}, expected a tensor of shape {exp}", pytrace=False)
    if tuple(out.shape) != exp:
        pytest.fail(f"output has shape {tuple(out.shape)}, expected {exp} (tokens, num_heads, v_head_dim)",
                    pytrace=False)
    want = torch_dtype(problem.case.dtype)
    if out.dtype != want:
        pytest.fail(f"output dtype is {out.dtype}, expected the model dtype {want}", pytrace=False)


def compare(out: torch.Tensor, ref: torch.Tensor, tol: Tolerance, what: str = "output") -> Comparison:
    got = out.detach().to(torch.float64).cpu()
    if got.numel() == 0:
        return Comparison(0.0, tol, True)
    # where the reference is non-finite (garbage the row really reads), so must the output be; everywhere
    # else the output must be finite and within tolerance
    fin_ref, fin_got = torch.isfinite(ref), torch.isfinite(got)
    if not torch.equal(fin_ref, fin_got):
        odd = (fin_ref & ~fin_got).nonzero()
        if odd.numel():
            return Comparison(float("inf"), tol, False, f"{what} has non-finite values where the reference is "
                                                         f"finite (first at index {odd[0].tolist()})")
        odd = (~fin_ref & fin_got).nonzero()
        return Comparison(float("inf"), tol, False, f"{what} is finite where the reference is non-finite (garbage "
                                                     f"the row reads was hidden; first at index {odd[0].tolist()}: "
                                                     f"got {float(got[tuple(odd[0].tolist())]):.6g})")
    if not bool(fin_ref.all()):  # compare the finite elements (both non-finite elsewhere)
        zero = torch.zeros((), dtype=got.dtype)
        got, ref = torch.where(fin_ref, got, zero), torch.where(fin_ref, ref, zero)
    err = (got - ref).abs()
    bound = tol.atol + tol.rtol * ref.abs()
    max_err = float(err.max())
    excess = err - bound
    ok = bool((excess <= 0).all())
    detail = ""
    if not ok:
        idx = tuple(int(i) for i in (excess == excess.max()).nonzero()[0].tolist())
        n_bad = int((excess > 0).sum())
        detail = (f"{what}: max abs error {max_err:.3g} exceeds atol={tol.atol:g} + rtol={tol.rtol:g}*|ref|; "
                  f"{n_bad} of {err.numel()} elements out of tolerance; worst at [token, head, dim]={list(idx)}: "
                  f"got {float(got[idx]):.6g}, expected {float(ref[idx]):.6g}")
    return Comparison(max_err, tol, ok, detail)


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes (NaN compares equal to the same NaN: garbage slots are checked byte for byte)."""
    return t.detach().contiguous().view(torch.uint8)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def cache_changes(before: list[tuple[torch.Tensor, torch.Tensor]], problem: Problem,
                  r2t_before: torch.Tensor | None = None) -> list[str]:
    """Which layers' buffers (and ``req_to_token``) differ, byte for byte, from ``before``."""
    changed = []
    for i, ((k0, v0), (k1, v1)) in enumerate(zip(before, problem.snapshot())):
        for name, a, b in (("K", k0, k1), ("V", v0, v1)):
            if not same_bytes(a, b):
                rows = (bits(a) != bits(b)).reshape(a.shape[0], -1).any(dim=1).nonzero().flatten().tolist()
                changed.append(f"layer {i} {name} changed at slots {rows[:8]}")
    if r2t_before is not None and not torch.equal(r2t_before, problem.cache.req_to_token):
        changed.append("req_to_token changed")
    return changed


def check_cache(problem: Problem, layer_idx: int, want: tuple[torch.Tensor, torch.Tensor]) -> list[str]:
    """Differences between layer ``layer_idx``'s buffers and ``want`` (bit for bit)."""
    problems = []
    got = problem.cache.read_kv(layer_idx)
    for name, g, w in zip(("K", "V"), got, want):
        if g.dtype != w.dtype or g.shape != w.shape:
            problems.append(f"layer {layer_idx} {name} buffer changed dtype/shape: {g.dtype}{tuple(g.shape)}")
            continue
        diff = (bits(g) != bits(w)).reshape(g.shape[0], -1).any(dim=1)
        if bool(diff.any()):
            slots = diff.nonzero().flatten().tolist()
            expected_loc = set(problem.batch.out_cache_loc.tolist())
            unexpected = [s for s in slots if s not in expected_loc]
            wrong = [s for s in slots if s in expected_loc]
            msg = f"layer {layer_idx} {name} cache differs from the expected contents in {len(slots)} slot(s)"
            if unexpected:
                msg += f"; written outside out_cache_loc at slots {unexpected[:8]}"
            if wrong:
                msg += f"; wrong or missing values at out_cache_loc slots {wrong[:8]}"
            problems.append(msg)
    return problems
