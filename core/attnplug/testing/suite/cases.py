"""The conformance cases, generated from a backend's declared capabilities.

Pure data (no torch): the pytest plugin imports this at collection time to
parametrize the suite's test functions. Every family below generates the
same matrix for every backend; a case needing something the backend does not
claim is kept and marked skipped with the reason
(``"sinks: not claimed by <backend>"``), so a report shows what was not
tested and why.

A *scenario* is one forward batch shape (mode, per-request prefix and new
token counts, speculative fields). A *case* is a scenario plus a layer shape,
layer features, dtypes and page size, with a fixed seed derived from its id.
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import Any, Callable, Iterable

from ...capabilities import Capabilities

DTYPES: tuple[str, ...] = ("float32", "float16", "bfloat16")
PAGE_SIZES: tuple[int, ...] = (1, 16, 64)

#: Phrase that marks a skip as "not claimed" (the summary counts these as skipped by capability).
NOT_CLAIMED = "not claimed by"


# -- scenarios ---------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Scenario:
    """One forward batch: ``mode`` is a ``ForwardMode`` value; ``prefix[i]``
    cached tokens and ``extend[i]`` new tokens for request ``i``."""

    name: str
    mode: str
    prefix: tuple[int, ...] = ()
    extend: tuple[int, ...] = ()
    draft: int | None = None
    custom_mask: bool = False
    encoder: tuple[int, ...] | None = None

    @property
    def seq_lens(self) -> tuple[int, ...]:
        return tuple(p + e for p, e in zip(self.prefix, self.extend))

    @property
    def num_tokens(self) -> int:
        return sum(self.extend)


def scenario(name: str, page_size: int = 16) -> Scenario:
    """The scenario called ``name`` (``extend_prefix_midpage`` depends on ``page_size``)."""
    ps = page_size
    table: dict[str, Callable[[], Scenario]] = {
        "extend_noprefix": lambda: Scenario(name, "extend", (0, 0, 0), (5, 9, 3)),
        "extend_prefix": lambda: Scenario(name, "extend", (7, 0, 20), (4, 6, 2)),
        "extend_ragged": lambda: Scenario(name, "extend", (3, 17, 0, 30), (1, 12, 5, 2)),
        "extend_single_token": lambda: Scenario(name, "extend", (10, 0, 5), (1, 1, 1)),
        # every prefix ends inside a page, so new tokens share a page with cached ones
        "extend_prefix_midpage": lambda: Scenario(name, "extend", (ps // 2 + 1, ps + 3, 2 * ps - 1), (3, 5, 2)),
        # seq_lens 17 and 65 start a new page at page sizes 16 and 64; 1 decodes with no prefix
        "decode": lambda: Scenario(name, "decode", (0, 6, 16, 64), (1, 1, 1, 1)),
        "target_verify": lambda: Scenario(name, "target_verify", (5, 27), (4, 4), draft=4),
        "target_verify_custom_mask": lambda: Scenario(name, "target_verify", (5, 27), (4, 4), draft=4,
                                                      custom_mask=True),
        "draft_extend": lambda: Scenario(name, "draft_extend", (6, 21, 3), (2, 3, 1)),
        "draft_extend_v2": lambda: Scenario(name, "draft_extend_v2", (6, 21), (3, 3)),
        "mixed": lambda: Scenario(name, "mixed", (10, 0, 23, 4), (1, 6, 1, 3)),
        "idle": lambda: Scenario(name, "idle"),
        # cross-attention: queries read the first encoder[i] cached tokens of the request
        "cross_extend": lambda: Scenario(name, "extend", (7, 12, 20), (4, 6, 2), encoder=(5, 12, 9)),
        "cross_decode": lambda: Scenario(name, "decode", (7, 16, 29), (1, 1, 1), encoder=(5, 16, 9)),
    }
    try:
        return table[name]()
    except KeyError:
        raise KeyError(f"unknown conformance scenario {name!r} (known: {', '.join(table)})") from None


ALL_MODE_SCENARIOS: tuple[str, ...] = (
    "extend_noprefix", "extend_prefix", "extend_ragged", "extend_single_token", "extend_prefix_midpage",
    "decode", "target_verify", "target_verify_custom_mask", "draft_extend", "draft_extend_v2", "mixed", "idle",
)


# -- layers ------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    num_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 64
    v_head_dim: int | None = None

    @property
    def v_dim(self) -> int:
        return self.v_head_dim or self.head_dim


DEFAULT_SHAPE = Shape("gqa4", 8, 2, 64)
HEAD_LAYOUTS: tuple[tuple[str, int, int], ...] = (("mha", 4, 4), ("gqa4", 8, 2), ("gqa8", 16, 2), ("mqa", 8, 1))
HEAD_DIMS: tuple[int, ...] = (64, 128, 256)
V_HEAD_DIMS: tuple[tuple[int, int], ...] = ((128, 64), (64, 128), (192, 128))


@dataclasses.dataclass(frozen=True)
class Features:
    sliding_window: int | None = None
    logit_cap: float | None = None
    sinks: bool = False
    cross_attention: bool = False


FEATURES: dict[str, Features] = {
    "window5": Features(sliding_window=5),
    "window16": Features(sliding_window=16),
    "softcap": Features(logit_cap=2.0),
    "sinks": Features(sinks=True),
    "window_sinks": Features(sliding_window=5, sinks=True),
    "softcap_window": Features(sliding_window=8, logit_cap=2.0),
}


# -- cases -------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Case:
    """One generated case. ``id`` is unique within its family; ``seed`` derives from it."""

    family: str
    id: str
    scenario: Scenario
    dtype: str = "float32"
    page_size: int = 16
    shape: Shape = DEFAULT_SHAPE
    features: Features = Features()
    kv_cache_dtype: str | None = None
    save_kv_cache: bool = True
    numeric: bool = True
    variant: str = ""
    #: families that check something other than one forward (sequence, layers) read this
    extra: tuple[tuple[str, Any], ...] = ()

    @property
    def seed(self) -> int:
        return zlib.crc32(f"{self.family}:{self.id}".encode()) & 0x7FFFFFFF

    @property
    def kv_dtype(self) -> str:
        return self.kv_cache_dtype or self.dtype


def _case(family: str, sc: Scenario, dtype: str, ps: int, *parts: str, **kw: Any) -> Case:
    words = [sc.name, *parts, dtype, f"ps{ps}"]
    return Case(family, "-".join(w for w in words if w), sc, dtype=dtype, page_size=ps, **kw)


def gen_mode() -> list[Case]:
    """Every forward mode at every dtype and page size (default layer shape)."""
    out = []
    for name in ALL_MODE_SCENARIOS:
        for ps in PAGE_SIZES:
            if name == "extend_prefix_midpage" and ps == 1:
                continue  # with one slot a page no prefix ends mid-page
            for dt in DTYPES:
                out.append(_case("mode", scenario(name, ps), dt, ps))
    return out


def gen_heads() -> list[Case]:
    """GQA ratios 1, 4, 8 and MQA at head dims 64/128/256."""
    out = []
    for lname, h, kv in HEAD_LAYOUTS:
        for d in HEAD_DIMS:
            for name in ("extend_prefix", "decode"):
                for dt in DTYPES:
                    out.append(_case("heads", scenario(name), dt, 16, f"{lname}-d{d}",
                                     shape=Shape(lname, h, kv, d)))
    return out


def gen_v_head_dim() -> list[Case]:
    """V head dim different from K head dim."""
    out = []
    for dk, dv in V_HEAD_DIMS:
        for name in ("extend_prefix", "decode", "target_verify"):
            for dt in DTYPES:
                out.append(_case("v_head_dim", scenario(name), dt, 16, f"dk{dk}-dv{dv}",
                                 shape=Shape(f"dk{dk}dv{dv}", 8, 2, dk, dv)))
    return out


def gen_feature() -> list[Case]:
    """Sliding window, logit soft-cap and sinks, alone and combined, across modes."""
    out = []
    for fname, feat in FEATURES.items():
        for name in ("extend_prefix", "decode", "target_verify_custom_mask", "draft_extend", "mixed"):
            for dt in DTYPES:
                out.append(_case("feature", scenario(name), dt, 16, fname, features=feat))
    return out


def gen_cross_attention() -> list[Case]:
    out = []
    for name in ("cross_extend", "cross_decode"):
        for ps in (1, 16):
            for dt in DTYPES:
                out.append(_case("cross_attention", scenario(name, ps), dt, ps,
                                 features=Features(cross_attention=True)))
    return out


def gen_kv_cache_dtype() -> list[Case]:
    """A KV cache in a dtype other than the model's."""
    out = []
    for dt in DTYPES:
        for kv in DTYPES:
            if kv == dt:
                continue
            for name in ("extend_prefix", "decode"):
                out.append(_case("kv_cache_dtype", scenario(name), dt, 16, f"kv_{kv}", kv_cache_dtype=kv))
    return out


def gen_kv_cache_write() -> list[Case]:
    """New K/V land in exactly ``out_cache_loc``; nothing else in the cache changes."""
    out = []
    for name in ("extend_noprefix", "extend_prefix", "extend_prefix_midpage", "decode", "target_verify",
                 "draft_extend", "mixed", "idle"):
        for ps in (1, 16):
            if name == "extend_prefix_midpage" and ps == 1:
                continue
            for dt in DTYPES:
                out.append(_case("kv_cache_write", scenario(name, ps), dt, ps))
    for name in ("extend_prefix", "decode"):
        for dt in DTYPES:
            out.append(_case("kv_cache_write", scenario(name), dt, 16, "no_save", save_kv_cache=False))
    return out


def gen_shared_metadata() -> list[Case]:
    """Several layers (plain, sliding window, soft-cap/sinks where claimed) after one init."""
    out = []
    for name in ("extend_prefix", "decode", "target_verify_custom_mask", "mixed"):
        for dt in DTYPES:
            out.append(_case("shared_metadata", scenario(name), dt, 16, "3layers"))
    return out


def gen_sequence() -> list[Case]:
    """Several forwards in a row, each reading the K/V the backend itself wrote before."""
    out = []
    for seq in ("prefill_decode", "chunked_prefill_decode"):
        for ps in (1, 16):
            for dt in DTYPES:
                out.append(Case("sequence", f"{seq}-{dt}-ps{ps}", scenario("extend_noprefix"), dtype=dt,
                                page_size=ps, variant=seq))
    return out


def gen_determinism() -> list[Case]:
    """Repeated forwards bit-identical; a request's output identical alone and in a batch."""
    out = []
    for variant in ("repeat", "batch_invariance"):
        for name in ("extend_prefix", "decode", "target_verify", "mixed"):
            for dt in DTYPES:
                out.append(_case("determinism", scenario(name), dt, 16, variant, variant=variant))
    return out


def gen_cuda_graph() -> list[Case]:
    return [_case("cuda_graph", scenario("decode"), dt, 16) for dt in DTYPES]


def gen_bad_input() -> list[Case]:
    variants = ("q_heads", "q_head_dim", "q_tokens", "k_kv_heads", "v_head_dim", "kv_dtype")
    return [
        Case("bad_input", f"{v}-{sc}", scenario(sc), variant=v, numeric=False)
        for sc in ("extend_prefix", "decode") for v in variants
    ]


def gen_metadata_required() -> list[Case]:
    return [
        Case("metadata_required", f"{v}-{sc}", scenario(sc), variant=v, numeric=False)
        for sc in ("extend_prefix", "decode") for v in ("never_initialised", "other_batch")
    ]


def gen_refusal(caps: Capabilities) -> list[Case]:
    """One case per optional feature the backend does not claim: it must refuse it in words."""
    return [Case("refusal", feature, scenario("decode"), variant=feature, numeric=False)
            for feature in unclaimed_refusals(caps)]


GENERATORS: dict[str, Callable[[], list[Case]]] = {
    "mode": gen_mode,
    "heads": gen_heads,
    "v_head_dim": gen_v_head_dim,
    "feature": gen_feature,
    "cross_attention": gen_cross_attention,
    "kv_cache_dtype": gen_kv_cache_dtype,
    "kv_cache_write": gen_kv_cache_write,
    "shared_metadata": gen_shared_metadata,
    "sequence": gen_sequence,
    "determinism": gen_determinism,
    "cuda_graph": gen_cuda_graph,
    "bad_input": gen_bad_input,
    "metadata_required": gen_metadata_required,
}

def cases_for(family: str, caps: Capabilities) -> list[Case]:
    """The cases of ``family`` for a backend declaring ``caps`` (unclaimed ones included, to be skipped)."""
    if family == "refusal":
        return gen_refusal(caps)
    return GENERATORS[family]()


#: Families whose cases compute attention and compare values (the "numeric cases" of the summary).
NUMERIC_FAMILIES: frozenset[str] = frozenset(
    f for f in GENERATORS if f not in ("bad_input", "metadata_required", "refusal")
)


# -- what a case needs ---------------------------------------------------------
def _join(values: Iterable[Any]) -> str:
    return ", ".join(str(v) for v in values)


def skip_reason(case: Case, caps: Capabilities, backend: str, *, has_cuda: bool = False) -> str | None:
    """Why ``case`` does not apply to ``backend`` (a capability it does not claim), or None."""
    nc = f"{NOT_CLAIMED} {backend}"
    if case.family == "refusal":
        return None
    if case.family == "cuda_graph":
        if not caps.cuda_graph:
            return f"cuda_graph: {nc}"
        if not has_cuda or "cuda" not in caps.devices:
            return "cuda_graph: capture/replay needs a CUDA device (none on this host)"
    if case.family == "determinism" and not caps.deterministic:
        return f"deterministic: {nc}"
    if case.dtype not in caps.dtypes:
        return f"dtype {case.dtype}: {nc} (claims: {_join(caps.dtypes)})"
    if case.kv_cache_dtype and case.kv_cache_dtype != case.dtype:
        if case.kv_cache_dtype not in caps.kv_cache_dtypes:
            claimed = _join(caps.kv_cache_dtypes) if caps.kv_cache_dtypes else "the model dtype only"
            return f"kv_cache_dtype {case.kv_cache_dtype} with a {case.dtype} model: {nc} (claims: {claimed})"
    if caps.page_sizes is not None and case.page_size not in caps.page_sizes:
        return f"page_size {case.page_size}: {nc} (claims: {_join(caps.page_sizes)})"
    mode = case.scenario.mode
    if mode == "target_verify" and not caps.speculative_verify:
        return f"speculative_verify (target_verify): {nc}"
    if mode in ("draft_extend", "draft_extend_v2") and not caps.draft_extend:
        return f"draft_extend: {nc}"
    sh = case.shape
    if caps.head_dims is not None and sh.head_dim not in caps.head_dims:
        return f"head_dim {sh.head_dim}: {nc} (claims: {_join(caps.head_dims)})"
    if sh.v_dim != sh.head_dim:
        if not caps.v_head_dim_differs:
            return f"v_head_dim_differs (v_head_dim {sh.v_dim} != head_dim {sh.head_dim}): {nc}"
        if caps.head_dims is not None and sh.v_dim not in caps.head_dims:
            return f"v_head_dim {sh.v_dim}: {nc} (claims: {_join(caps.head_dims)})"
    if sh.num_kv_heads == 1 and sh.num_heads > 1 and not caps.mqa:
        return f"mqa: {nc}"
    if sh.num_kv_heads > 1 and sh.num_heads > sh.num_kv_heads and not caps.gqa:
        return f"gqa: {nc}"
    f = case.features
    if f.sliding_window is not None and not caps.sliding_window:
        return f"sliding_window: {nc}"
    if f.logit_cap and not caps.logit_softcap:
        return f"logit_softcap: {nc}"
    if f.sinks and not caps.sinks:
        return f"sinks: {nc}"
    if f.cross_attention and not caps.cross_attention:
        return f"cross_attention: {nc}"
    return None


#: Optional features whose *refusal* is checked when not claimed: a layer using
#: them must get a non-empty ``not_supported_reasons``.
REFUSALS: dict[str, Callable[[Capabilities], bool]] = {
    "sliding_window": lambda c: c.sliding_window,
    "logit_softcap": lambda c: c.logit_softcap,
    "sinks": lambda c: c.sinks,
    "cross_attention": lambda c: c.cross_attention,
    "v_head_dim_differs": lambda c: c.v_head_dim_differs,
    "mqa": lambda c: c.mqa,
    "gqa": lambda c: c.gqa,
    "dtype_float64": lambda c: "float64" in c.dtypes,
}


def unclaimed_refusals(caps: Capabilities) -> list[str]:
    return [name for name, claimed in REFUSALS.items() if not claimed(caps)]
