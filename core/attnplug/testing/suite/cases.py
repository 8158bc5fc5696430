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

from ... import support
from ...capabilities import Capabilities, support_reasons
from ...support import SupportQuery
from ...kvlayout import HND, NHD
from ...layer import ABSORBED, UNABSORBED, LayerSpec, MLASpec
from ...modes import ForwardMode

__all__ = [
    "ALL_MODE_SCENARIOS",
    "ANY_DTYPE_FAMILIES",
    "BIDIRECTIONAL_SCENARIOS",
    "CHUNK_FEATURES",
    "CHUNK_LIMITS",
    "DEFAULT_SHAPE",
    "DTYPES",
    "EXTRA_LAYOUTS_FOR_ANY",
    "FEATURES",
    "FP8_KV",
    "GARBAGE_FEATURES",
    "GARBAGE_MODES",
    "GARBAGE_NEW_MODES",
    "GENERATORS",
    "HEAD_DIMS",
    "HEAD_DIM_CLASSES",
    "HEAD_LAYOUTS",
    "LONG_SHAPE",
    "NOT_CLAIMED",
    "NUMERIC_FAMILIES",
    "ODD_HEADS",
    "PAGE_SIZES",
    "RANDOM_MODES",
    "REFUSALS",
    "REFUSAL_DTYPES",
    "REFUSAL_KV_DTYPES",
    "REFUSAL_VARIANTS_NEWER",
    "REJECTIONS",
    "SCALINGS",
    "V_HEAD_DIMS",
    "WIDE_SHAPE",
    "WORKSPACE_LIMITS",
    "Case",
    "Features",
    "Scenario",
    "Shape",
    "case_layer",
    "cases_for",
    "claimed_shape",
    "first_layout",
    "fit_case",
    "gen_bad_input",
    "gen_chunked",
    "gen_cross_attention",
    "gen_cuda_graph",
    "gen_determinism",
    "gen_edge",
    "gen_feature",
    "gen_fp8_kv",
    "gen_garbage",
    "gen_head_dim_class",
    "gen_heads",
    "gen_kv_cache_dtype",
    "gen_kv_cache_write",
    "gen_kv_layout",
    "gen_kv_none",
    "gen_long",
    "gen_metadata_required",
    "gen_mode",
    "gen_no_save",
    "gen_odd_heads",
    "gen_output_ownership",
    "gen_random",
    "gen_refusal",
    "gen_rejected",
    "gen_rounding",
    "gen_scaling",
    "gen_score_range",
    "gen_sequence",
    "gen_shared_metadata",
    "gen_unmapped_slot",
    "gen_v_head_dim",
    "gen_workspace",
    "refusal_model_dtype",
    "scenario",
    "skip_reason",
    "unclaimed_refusals",
]

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
    #: request 0's first draft row hides every draft (with no prefix: a query row with no visible key)
    mask_hides_row: bool = False

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
        # -- edges --
        # an empty encoder: the query rows of request 1 see no key (output zero)
        "cross_extend_empty": lambda: Scenario(name, "extend", (7, 12, 20), (4, 6, 2), encoder=(5, 0, 9)),
        "cross_decode_empty": lambda: Scenario(name, "decode", (7, 16, 29), (1, 1, 1), encoder=(0, 16, 0)),
        "cross_decode_all_empty": lambda: Scenario(name, "decode", (7, 16), (1, 1), encoder=(0, 0)),
        # request 1 extends by zero tokens (it only sits in the batch)
        "extend_zero_new": lambda: Scenario(name, "extend", (5, 12, 0), (3, 0, 4)),
        # every request decodes its first token (position 0, nothing cached)
        "decode_position0": lambda: Scenario(name, "decode", (0, 0, 0), (1, 1, 1)),
        # target-verify with no prefix whose mask hides every draft from request 0's first row
        "target_verify_no_visible": lambda: Scenario(name, "target_verify", (0, 9), (4, 4), draft=4,
                                                     custom_mask=True, mask_hides_row=True),
        # draft-extend carrying a verify mask (ignored outside target-verify)
        "draft_extend_with_mask": lambda: Scenario(name, "draft_extend", (6, 21, 3), (3, 3, 3), draft=3,
                                                   custom_mask=True),
        "draft_extend_v2_with_mask": lambda: Scenario(name, "draft_extend_v2", (6, 21), (3, 3), draft=3,
                                                      custom_mask=True),
        # -- long problems: cross any reasonable block / split / chunk threshold (see LONG_SHAPE) --
        # gathered K of one request alone is 8 MiB in float32 at LONG_SHAPE; 4.1k keys = 17 splits of 256
        "decode_long": lambda: Scenario(name, "decode", (4099, 0, 2900, 700, 3333, 63), (1,) * 6),
        # 700 queries x 4.2k keys x 8 heads = 94 MiB of float32 scores: chunked by a 64 MiB bound
        "extend_long": lambda: Scenario(name, "extend", (3500, 0), (700, 300)),
        "mixed_long": lambda: Scenario(name, "mixed", (2047, 1500, 0), (1, 600, 5)),
        # -- under a small workspace limit (the ``workspace`` family): ragged decodes, one at position 0 --
        "decode_workspace": lambda: Scenario(name, "decode", (200, 3, 130, 0, 64, 90), (1,) * 6),
        # -- the ``chunked`` family: enough new tokens over long enough prefixes that a backend
        # working in query chunks under a workspace limit cuts each request into several --
        # six long decodes: 6 x 8 heads x 128 values, thousands of rounded outputs
        "decode_rounding": lambda: Scenario(name, "decode", (300, 41, 700, 129, 64, 250), (1,) * 6),
        "extend_chunky": lambda: Scenario(name, "extend", (200, 37, 0), (12, 9, 16)),
        "verify_chunky": lambda: Scenario(name, "target_verify", (150, 40), (8, 8), draft=8, custom_mask=True),
        "mixed_chunky": lambda: Scenario(name, "mixed", (180, 0, 61), (1, 14, 10)),
        "draft_extend_chunky": lambda: Scenario(name, "draft_extend", (120, 33), (6, 6)),
        "cross_decode_workspace": lambda: Scenario(name, "decode", (130, 3, 70, 90), (1,) * 4,
                                                   encoder=(129, 0, 70, 65)),
    }
    if name.startswith("decode_batch") and name[len("decode_batch"):].isdigit():  # the odd_heads family
        n = int(name[len("decode_batch"):])
        return Scenario(name, "decode", (37, 90, 5, 64, 130, 17)[:n], (1,) * n)
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
#: the shape of the long cases: 4 KV heads x head dim 128, so one 4.1k-token request gathers 8 MiB of K
LONG_SHAPE = Shape("long", 8, 4, 128)
#: 32 query heads: a long extend's soft-capped / sink scores (float32, every head) overflow a 64 MiB
#: score chunk, so its queries are processed in several chunks
WIDE_SHAPE = Shape("wide", 32, 8, 64)
HEAD_LAYOUTS: tuple[tuple[str, int, int], ...] = (("mha", 4, 4), ("gqa4", 8, 2), ("gqa8", 16, 2), ("mqa", 8, 1))
HEAD_DIMS: tuple[int, ...] = (64, 128, 256)
V_HEAD_DIMS: tuple[tuple[int, int], ...] = ((128, 64), (64, 128), (192, 128))


@dataclasses.dataclass(frozen=True)
class Features:
    sliding_window: int | None = None
    logit_cap: float | None = None
    sinks: bool = False
    cross_attention: bool = False
    #: softmax scale; ``None`` is the default 1/sqrt(head_dim)
    scaling: float | None = None
    #: non-causal self-attention (``LayerSpec.causality="bidirectional"``)
    bidirectional: bool = False


FEATURES: dict[str, Features] = {
    "window5": Features(sliding_window=5),
    "window16": Features(sliding_window=16),
    # windows shorter than a verify/draft step's new tokens: the window hides earlier new tokens
    # from later queries, not only cached keys (a kernel applying it to the cache alone fails)
    "window2": Features(sliding_window=2),
    "window0": Features(sliding_window=0),
    "softcap": Features(logit_cap=2.0),
    "sinks": Features(sinks=True),
    "window_sinks": Features(sliding_window=5, sinks=True),
    "softcap_window": Features(sliding_window=8, logit_cap=2.0),
    # non-causal self-attention: queries see later new tokens too (window: |p - j| <= W both ways)
    "bidirectional": Features(bidirectional=True),
    "bidirectional_window": Features(sliding_window=3, bidirectional=True),
    "bidirectional_softcap_sinks": Features(logit_cap=2.0, sinks=True, bidirectional=True),
}

#: Scenarios the bidirectional features run in: ragged extends (with and without a cached prefix),
#: decode and a mixed batch (speculative modes have their own masks and are not combined with it).
BIDIRECTIONAL_SCENARIOS: tuple[str, ...] = ("extend_noprefix", "extend_prefix", "extend_ragged", "decode", "mixed")


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
    #: fill every slot no request owns with this value ("nan" or "inf"); see ``harness.fill_garbage``
    garbage: str | None = None
    #: ``out_cache_loc`` is a fresh slot that ``req_to_token`` does not map yet (it maps a stale one)
    unmapped_new: bool = False
    #: ``garbage`` is written straight into each layer's storage (raw tensor writes, as a KV transfer or a
    #: snapshot restore does), not through ``set_kv``; see ``harness.fill_garbage_raw``
    garbage_raw: bool = False
    #: the K and V of each request's last new token (when it has two or more) hold garbage (``garbage``'s
    #: value, NaN when ``None``): hidden from its earlier tokens by causality (or a target-verify mask)
    garbage_new: bool = False
    #: two cached positions of a request swap slots: ``req_to_token`` is not page-aligned (a backend that
    #: declares ``reads_page_table`` refuses it; the others serve it exactly)
    unaligned: bool = False
    #: families that check something other than one forward (sequence, layers) read this
    extra: tuple[tuple[str, Any], ...] = ()
    #: the KV-cache layout the problem's cache is allocated in (``cases_for`` sets the backend's first)
    kv_layout: str = "nhd"
    #: ``(k_scale, v_scale)`` of every layer of an fp8 cache (``None``: 1.0, 1.0)
    kv_scales: tuple[float, float] | None = None
    #: ``BuildContext.max_workspace_bytes`` the backend is built with (None: the default, 4 GiB)
    max_workspace_bytes: int | None = None
    #: the requirement a failure of this case names when it is not the family's own (``requirements.py``:
    #: a case of a requirement added to an older family)
    requirement: str | None = None
    #: torch threads the build and forward run with (None: as the session has them); a kernel that
    #: splits work by thread count must give the reference's answer at every count
    threads: int | None = None
    #: how q/k are drawn besides the noise: ``""`` plain; ``"far_below"`` every score a query has is
    #: hundreds below zero; ``"max_first"`` each request's first key scores far above the rest (the
    #: row maximum sits only in the first key block); see ``harness.shape_scores``
    scores: str = ""
    #: an MLA case (docs/mla.md) in this form (``"absorbed"`` / ``"unabsorbed"``); ``None``: not MLA
    mla_form: str | None = None
    #: values drawn exactly representable in a narrower dtype, as ``(what, dtype)`` pairs; ``what`` is
    #: ``"q"``, ``"k"``, ``"v"`` (the new tokens' q/k/v) or ``"sinks"`` (every layer's). Each is drawn as
    #: usual, then rounded to ``dtype`` and back (same random stream): ``("q", "float8_e4m3fn")`` lets a
    #: kernel that quantizes q to e4m3 with scale 1 compute what the reference computes from q;
    #: ``("sinks", "bfloat16")`` gives sinks a kernel taking them in bfloat16 sees unchanged.
    #: See ``harness.EXACT_IN``
    exact_in: tuple[tuple[str, str], ...] = ()

    @property
    def seed(self) -> int:
        return zlib.crc32(f"{self.family}:{self.id}".encode()) & 0x7FFFFFFF

    @property
    def kv_dtype(self) -> str:
        return self.kv_cache_dtype or self.dtype


def _case(family: str, sc: Scenario, dtype: str, ps: int, *parts: str, **kw: Any) -> Case:
    words = [sc.name, *parts, dtype, f"ps{ps}"]
    return Case(family, "-".join(w for w in words if w), sc, dtype=dtype, page_size=ps, **kw)


# -- MLA (docs/mla.md): DeepSeek-V3's latent geometry, 8 query heads ------------------------------------
#: ``(kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim)`` of every MLA case
MLA_DIMS: tuple[int, int, int, int] = (512, 128, 64, 128)
#: the MLA layer shape: 8 query heads over one latent row of 512 + 64 (values: its first 512)
MLA_SHAPE = Shape("mla", 8, 1, MLA_DIMS[0] + MLA_DIMS[2], MLA_DIMS[0])
#: per form, the scenarios of the ``mla`` family: absorbed decode, short extends, verify, draft-extend,
#: mixed; unabsorbed prefill over a cached prefix (and decode)
MLA_SCENARIOS: dict[str, tuple[str, ...]] = {
    ABSORBED: ("decode", "extend_prefix", "extend_ragged", "target_verify", "target_verify_custom_mask",
               "draft_extend", "mixed"),
    UNABSORBED: ("extend_prefix", "extend_ragged", "extend_noprefix", "decode"),
}
MLA_DTYPES: tuple[str, ...] = ("float32", "bfloat16")
#: fp8 latent scales: ``unit`` and ``scaled`` (a backend ignoring the scale is off by 25x)
MLA_FP8_SCALES: dict[str, float] = {"unit": 1.0, "scaled": 0.04}


def _mla_case(family: str, name: str, form: str, dtype: str, ps: int, *parts: str, **kw: Any) -> Case:
    return _case(family, scenario(name, ps), dtype, ps, form, *parts, shape=MLA_SHAPE, mla_form=form, **kw)


def gen_mla() -> list[Case]:
    """MLA layers in both forms (absorbed decode / short extend / verify / draft-extend / mixed; unabsorbed
    prefill over a cached prefix, ragged batches, decode) at page sizes 1/16/64, float32 and bfloat16."""
    return [_mla_case("mla", name, form, dt, ps)
            for form, names in MLA_SCENARIOS.items() for name in names for ps in PAGE_SIZES for dt in MLA_DTYPES]


def gen_mla_garbage() -> list[Case]:
    """NaN / +inf in every latent slot no request owns, both forms."""
    out = []
    for form, names in ((ABSORBED, ("decode", "extend_prefix", "target_verify_custom_mask")),
                        (UNABSORBED, ("decode", "extend_prefix"))):
        for name in names:
            for value in ("nan", "inf"):
                out.append(_mla_case("mla_garbage", name, form, "float32", 16, value, garbage=value))
    return out


def gen_mla_fp8() -> list[Case]:
    """An fp8 latent cache with one scale per layer: e4m3 / e5m2 x scale unit / scaled x absorbed decode,
    absorbed extend over a prefix, unabsorbed prefill over a prefix."""
    out = []
    for kv in ("float8_e4m3fn", "float8_e5m2"):
        for sname, scale in MLA_FP8_SCALES.items():
            for form, name in ((ABSORBED, "decode"), (ABSORBED, "extend_prefix"), (UNABSORBED, "extend_prefix")):
                out.append(_mla_case("mla_fp8", name, form, "float32", 16, kv, sname, kv_cache_dtype=kv,
                                     kv_scales=(scale, scale)))
    return out


def gen_mla_forms_agree() -> list[Case]:
    """Both forms on the same weights: with absorbed q_h = [q_nope_h @ w_kc[h], q_pe_h], the unabsorbed
    output of head h equals the absorbed output @ w_vc[h] (needs both forms claimed in the mode kind)."""
    return [_case("mla_forms_agree", scenario(name, ps), "float32", ps, "both", shape=MLA_SHAPE, mla_form=ABSORBED)
            for name in ("decode", "extend_prefix", "target_verify") for ps in (1, 16)]


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
        names = BIDIRECTIONAL_SCENARIOS if feat.bidirectional else (
            "extend_prefix", "decode", "target_verify_custom_mask", "draft_extend", "mixed")
        for name in names:
            for dt in DTYPES:
                out.append(_case("feature", scenario(name), dt, 16, fname, features=feat,
                                 requirement="feature.bidirectional" if feat.bidirectional else None))
    return out


def gen_cross_attention() -> list[Case]:
    """Cross-attention, including requests whose encoder is empty (their rows see no key: zero)."""
    out = []
    for name in ("cross_extend", "cross_decode", "cross_extend_empty", "cross_decode_empty", "cross_decode_all_empty"):
        for ps in (1, 16):
            for dt in DTYPES:
                out.append(_case("cross_attention", scenario(name, ps), dt, ps,
                                 features=Features(cross_attention=True)))
    return out


def gen_kv_cache_dtype() -> list[Case]:
    """A KV cache in a dtype other than the model's (skipped by capability where ``kv_cache_dtypes``
    lacks it or ``kv_cache_dtype_follows_model`` refuses a non-fp8 cache in another dtype)."""
    out = []
    for dt in DTYPES:
        for kv in DTYPES:
            if kv == dt:
                continue
            for name in ("extend_prefix", "decode"):
                out.append(_case("kv_cache_dtype", scenario(name), dt, 16, f"kv_{kv}", kv_cache_dtype=kv))
    return out


#: fp8 KV-cache formats and, per format, the scale variants every claimed one runs with:
#: ``unit`` (1, 1), ``scaled`` (a K scale below 1 and a V scale above 1, so ignoring either moves
#: the output), ``saturate`` (scales small enough that a few percent of the N(0, 1) values
#: exceed the format's finite range and are stored saturated)
FP8_KV: dict[str, dict[str, tuple[float, float]]] = {
    "float8_e4m3fn": {"unit": (1.0, 1.0), "scaled": (0.04, 2.5), "saturate": (1 / 256, 1 / 256)},
    "float8_e5m2": {"unit": (1.0, 1.0), "scaled": (0.04, 2.5), "saturate": (1 / 32768, 1 / 32768)},
}


def gen_fp8_kv() -> list[Case]:
    """An fp8 KV cache with per-layer scales: every format × model dtype fp32/bf16 × decode, extend
    over a prefix, target-verify and a mixed batch × the scale variants of ``FP8_KV``."""
    out = []
    for kv, variants in FP8_KV.items():
        for dt in ("float32", "bfloat16"):
            for name in ("decode", "extend_prefix", "target_verify", "mixed"):
                for label, scales in variants.items():
                    out.append(_case("fp8_kv", scenario(name), dt, 16, f"kv_{kv}", label, kv_cache_dtype=kv,
                                     kv_scales=scales, variant=label))
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


def gen_long() -> list[Case]:
    """Problems large enough to cross any reasonable block / split / chunk threshold.

    Decode: six requests up to 4.1k keys at ``LONG_SHAPE`` (8 MiB of float32 K per long
    request, 17 splits of 256 keys). Extend: 700 queries over 4.2k keys (94 MiB of float32
    scores at 8 heads) plus a 300-token prompt; a mixed batch with a 600-token chunk. Plain,
    with a window of 1000 (the window edge moves across blocks and chunks), with sinks and
    with a non-fused decode (``save_kv_cache=False``).
    """
    out = [_case("long", scenario("decode_long"), dt, 16, shape=LONG_SHAPE) for dt in ("float32", "bfloat16")]
    for name in ("decode_long", "extend_long"):
        out.append(_case("long", scenario(name), "float32", 16, "window1000", shape=LONG_SHAPE,
                         features=Features(sliding_window=1000)))
    out.append(_case("long", scenario("extend_long"), "float32", 16, shape=LONG_SHAPE))
    out.append(_case("long", scenario("mixed_long"), "float32", 16, shape=LONG_SHAPE))
    out.append(_case("long", scenario("decode_long"), "float32", 16, "sinks", shape=LONG_SHAPE,
                     features=Features(sinks=True)))
    # window + sinks over a long extend at 32 heads: 700 queries x 1700 visible keys of float32 scores
    # per head exceed a 64 MiB chunk, so a later chunk's first visible key sits past the window's edge
    out.append(_case("long", scenario("extend_long"), "float32", 16, "window1000_sinks", shape=WIDE_SHAPE,
                     features=Features(sliding_window=1000, sinks=True)))
    out.append(_case("long", scenario("decode_long"), "float32", 64, "no_save", shape=LONG_SHAPE,
                     save_kv_cache=False))
    return out


#: non-default softmax scales: 1.0 (no scaling), Gemma-2's 1/sqrt(256) at head dim 64, an
#: MLA-style 1/sqrt(192) (the scale of a 192-dim q.k with a 128-dim value).
SCALINGS: dict[str, float] = {"scale1": 1.0, "scale_gemma": 256 ** -0.5, "scale_mla": 192 ** -0.5}


def gen_scaling() -> list[Case]:
    """A ``scaling`` other than 1/sqrt(head_dim), on the fused and non-fused decode paths and extend."""
    out = []
    for sname, scale in SCALINGS.items():
        for name in ("extend_prefix", "decode", "target_verify_custom_mask", "mixed"):
            for dt in ("float32", "bfloat16"):
                out.append(_case("scaling", scenario(name), dt, 16, sname, features=Features(scaling=scale)))
        out.append(_case("scaling", scenario("decode"), "float32", 16, sname, "no_save",
                         features=Features(scaling=scale), save_kv_cache=False))
        out.append(_case("scaling", scenario("decode"), "float32", 16, sname, "softcap",
                         features=Features(scaling=scale, logit_cap=5.0)))
    return out


def gen_no_save() -> list[Case]:
    """``save_kv_cache=False`` checked numerically: the new K/V come from the arguments (the
    ``out_cache_loc`` slots hold stale noise), and nothing in the cache changes."""
    out = []
    for name in ("decode", "extend_prefix", "extend_prefix_midpage", "target_verify_custom_mask", "mixed",
                 "draft_extend"):
        for ps in (1, 16):
            if name == "extend_prefix_midpage" and ps == 1:
                continue
            for dt in DTYPES:
                out.append(_case("no_save", scenario(name, ps), dt, ps, save_kv_cache=False))
    for fname in ("window5", "softcap", "sinks"):
        out.append(_case("no_save", scenario("decode"), "float32", 16, fname, features=FEATURES[fname],
                         save_kv_cache=False))
    return out


def gen_unmapped_slot() -> list[Case]:
    """New tokens whose slots ``req_to_token`` does not map yet (engines that map after attention):
    ``out_cache_loc`` is a fresh slot, ``req_to_token`` still points at a stale one."""
    out = []
    for name in ("decode", "extend_prefix", "target_verify", "mixed"):
        for ps in (1, 16):
            for dt in ("float32", "bfloat16"):
                for save in (True, False):
                    out.append(_case("unmapped_slot", scenario(name, ps), dt, ps, "" if save else "no_save",
                                     unmapped_new=True, save_kv_cache=save))
    return out


def gen_edge() -> list[Case]:
    """Edges: a query row with no visible key (output zero), an extend request with zero new
    tokens, every request at position 0, a draft-extend carrying a verify mask (ignored)."""
    out = []
    for name in ("target_verify_no_visible", "extend_zero_new", "decode_position0", "draft_extend_with_mask",
                 "draft_extend_v2_with_mask"):
        for ps in (1, 16):
            for dt in DTYPES:
                out.append(_case("edge", scenario(name, ps), dt, ps))
    for name in ("target_verify_no_visible", "decode_position0"):
        out.append(_case("edge", scenario(name), "float32", 16, "sinks", features=Features(sinks=True)))
    out.append(_case("edge", scenario("target_verify_no_visible"), "float32", 16, "softcap_window",
                     features=FEATURES["softcap_window"]))
    out.append(_case("edge", scenario("decode_position0"), "float32", 16, "no_save", save_kv_cache=False))
    return out


def gen_output_ownership() -> list[Case]:
    """An output kept from layer 0 still holds layer 0's answer after layer 1 (and another forward) ran."""
    return [_case("output_ownership", scenario(name), dt, 16)
            for name in ("decode", "extend_prefix", "target_verify", "mixed") for dt in ("float32", "bfloat16")]


def gen_kv_none() -> list[Case]:
    """``k=v=None`` on a self-attention layer: ``attnplug.ShapeError`` naming k/v; nothing written."""
    return [Case("kv_none", sc, scenario(sc), numeric=False) for sc in ("decode", "extend_prefix")]


#: settings of the garbage family: (feature name, features)
GARBAGE_FEATURES: tuple[tuple[str, Features], ...] = (
    ("plain", Features()), ("window5", Features(sliding_window=5)), ("sinks", Features(sinks=True)),
    ("window_sinks", Features(sliding_window=5, sinks=True)),
)
GARBAGE_MODES: tuple[str, ...] = tuple(n for n in ALL_MODE_SCENARIOS if n != "idle") + (
    "cross_extend", "cross_decode")


def gen_garbage() -> list[Case]:
    """NaN or +inf in every slot no request owns (and in the ``out_cache_loc`` slots when nothing is
    saved): outputs equal the reference. Pairwise over mode x page size x {plain, window, sinks,
    window+sinks} x garbage: at page size 16 every mode with every setting, NaN in float32 and +inf
    in bfloat16; at page sizes 1 and 64 every mode plain and three modes with window+sinks (the
    garbage kind alternating); cross-attention; ``save_kv_cache=False`` per mode."""
    out = []
    kinds: tuple[tuple[str, str], ...] = (("float32", "nan"), ("bfloat16", "inf"))
    for name in GARBAGE_MODES:
        cross = name.startswith("cross")
        for ps in PAGE_SIZES:
            if name == "extend_prefix_midpage" and ps == 1:
                continue
            for fname, feat in GARBAGE_FEATURES:
                if cross:
                    if fname != "plain" or ps == 64:
                        continue
                    feat = Features(cross_attention=True)
                if ps == 16:
                    chosen = kinds
                elif fname == "plain" or (fname == "window_sinks" and name in ("decode", "extend_prefix",
                                                                               "target_verify")):
                    flip = (ps == 64) != (fname == "window_sinks")
                    chosen = (kinds[1 if flip else 0],)
                else:
                    continue
                for dt, g in chosen:
                    if cross and ps == 1 and g == "inf":
                        continue
                    out.append(_case("garbage", scenario(name, ps), dt, ps, fname, g, features=feat, garbage=g))
        if not cross:
            out.append(_case("garbage", scenario(name), "float32", 16, "no_save", "inf", garbage="inf",
                             save_kv_cache=False))
    # NaN/+inf in the K/V of each request's last new token (hidden by causal order from its earlier
    # tokens; in target-verify, by the tree mask from the drafts it is hidden from): it must reach
    # exactly the rows that see it (``garbage.new_tokens``, level 0.3)
    for name in GARBAGE_NEW_MODES:
        for fname, feat in (("plain", Features()), ("window5", Features(sliding_window=5))):
            for dt, g in kinds:
                out.append(_case("garbage", scenario(name), dt, 16, "new_tokens", fname, g, features=feat,
                                 garbage=g, garbage_new=True, requirement="garbage.new_tokens"))
    return out


#: modes of the ``garbage`` family's new-token cases (requests of two or more new tokens)
GARBAGE_NEW_MODES: tuple[str, ...] = ("extend_noprefix", "extend_prefix", "extend_ragged",
                                      "target_verify_custom_mask", "draft_extend", "mixed")


#: workspace limits of the ``workspace`` family (bytes): from below one request's decode state to
#: a few requests' worth at the default layer shape, so a backend that works in pieces under
#: ``max_workspace_bytes`` cuts the batch at different places (or refuses) at each limit
WORKSPACE_LIMITS: tuple[int, ...] = (4 << 10, 16 << 10, 32 << 10)


def gen_workspace() -> list[Case]:
    """A backend built with a small ``BuildContext.max_workspace_bytes``: every forward equals the
    reference (work cut into pieces that fit) or raises ``attnplug.ResourceLimitError`` naming the
    limit, writing nothing. A ragged decode of six requests (one at position 0) at every limit,
    plain, with sinks and in bfloat16; cross-attention with an empty encoder; an extend."""
    out = []
    for limit in WORKSPACE_LIMITS:
        kib = f"ws{limit >> 10}k"
        sc = scenario("decode_workspace")
        out.append(_case("workspace", sc, "float32", 16, kib, max_workspace_bytes=limit))
        out.append(_case("workspace", sc, "bfloat16", 16, kib, max_workspace_bytes=limit))
        out.append(_case("workspace", sc, "float32", 16, "sinks", kib, features=Features(sinks=True),
                         max_workspace_bytes=limit))
        out.append(_case("workspace", scenario("cross_decode_workspace"), "float32", 16, kib,
                         features=Features(cross_attention=True), max_workspace_bytes=limit))
    out.append(_case("workspace", scenario("extend_prefix"), "float32", 16, "ws16k", max_workspace_bytes=16 << 10))
    return out


#: rejected forwards: variant -> (field the error must name, expected error class name)
REJECTIONS: dict[str, tuple[str, str]] = {
    "out_cache_loc_beyond": ("out_cache_loc", "ShapeError"),
    "out_cache_loc_negative": ("out_cache_loc", "ShapeError"),
    "req_pool_indices_beyond": ("req_pool_indices", "ShapeError"),
    "req_pool_indices_negative": ("req_pool_indices", "ShapeError"),
    "layer_id_beyond": ("layer_id", "ShapeError"),
    "layer_id_negative": ("layer_id", "ShapeError"),
    "req_to_token_beyond": ("req_to_token", "ShapeError"),
    "req_to_token_unassigned": ("req_to_token", "ShapeError"),
    "seq_len_beyond_assigned": ("seq_len|req_to_token|prefix", "ShapeError"),
    "seq_len_beyond_context": ("seq_len|req_to_token|prefix", "ShapeError"),
    "dtype_int32": ("int32", "NotSupportedError"),
}


def gen_rejected() -> list[Case]:
    """Forwards that must be rejected with a clear error, the cache byte-identical afterwards."""
    return [Case("rejected", f"{v}-{sc}", scenario(sc), variant=v, numeric=False)
            for v in REJECTIONS for sc in ("decode", "extend_prefix")]


#: hypothesis-driven cases: one per mode family, examples drawn from the claimed envelope
RANDOM_MODES: tuple[str, ...] = ("extend", "decode", "target_verify", "draft_extend", "mixed")


def gen_random() -> list[Case]:
    return [Case("random", m, Scenario(m, m), numeric=True) for m in RANDOM_MODES]


def gen_refusal(caps: Capabilities) -> list[Case]:
    """One case per dtype, KV-cache dtype, mode and optional feature the backend does not claim:
    it must refuse it in words (``not_supported_reasons``) and refuse a forward using it with
    ``attnplug.NotSupportedError`` naming it, writing nothing."""
    from .requirements import REFUSAL_VARIANTS_0_1

    def req(what: str) -> str | None:
        if what in REFUSAL_VARIANTS_NEWER:
            return REFUSAL_VARIANTS_NEWER[what]
        return None if what in REFUSAL_VARIANTS_0_1 else "refusal.forward"

    return [Case("refusal", what, scenario("decode"), variant=what, numeric=False, requirement=req(what))
            for what in unclaimed_refusals(caps)]


#: refusal variants a later level added, with their requirement (words and forward alike)
REFUSAL_VARIANTS_NEWER: dict[str, str] = {"bidirectional": "refusal.bidirectional"}


#: (query-chunk) workspace limits of the ``chunked`` family, per thread the case runs with: small
#: enough that a backend cutting a request's queries to fit answers in chunks of one, a few and
#: about half of its queries
CHUNK_LIMITS: tuple[int, ...] = (16 << 10, 24 << 10, 40 << 10)
CHUNK_FEATURES: tuple[str, ...] = ("window2", "window5", "sinks", "softcap", "softcap_window")


def gen_chunked() -> list[Case]:
    """Window, sinks, soft-cap and the verify mask where a backend works in query chunks: the
    ``*_chunky`` scenarios under workspace limits that force several chunks per request, at one and
    two threads. A chunk applying the window, causal order or mask with its own offset instead of
    the request's fails here (``workspace`` semantics: answer, or refuse naming the limit)."""
    out = []
    for name in ("verify_chunky", "extend_chunky", "mixed_chunky", "draft_extend_chunky"):
        every = name == "verify_chunky"  # the mask: every feature at every limit; the others sampled
        for fname in (CHUNK_FEATURES + ("plain",)) if every else ("window5", "sinks", "softcap_window"):
            feat = FEATURES.get(fname, Features())
            for threads in (1, 2):
                for limit in CHUNK_LIMITS if every else CHUNK_LIMITS[:1]:
                    dt = "bfloat16" if limit == CHUNK_LIMITS[1] else "float32"
                    out.append(_case("chunked", scenario(name), dt, 16, fname, f"t{threads}", f"ws{limit >> 10}k",
                                     features=feat, threads=threads, max_workspace_bytes=limit * threads))
    return out


#: head dims beyond 64/128/256: multiples of 16 but not of 32 (80, 112), of 32 but not 64 (96),
#: and one of 8 only (72): a fast path admitted for the wrong class of dims fails here
HEAD_DIM_CLASSES: tuple[int, ...] = (72, 80, 96, 112)


def gen_head_dim_class() -> list[Case]:
    """Every dtype at head dims 72/80/96/112 in decode, extend over a prefix and target-verify."""
    out = []
    for d in HEAD_DIM_CLASSES:
        for name in ("decode", "extend_prefix", "target_verify_custom_mask"):
            for dt in DTYPES:
                out.append(_case("head_dim_class", scenario(name), dt, 16, f"d{d}", shape=Shape(f"gqa4d{d}", 8, 2, d)))
    return out


def gen_score_range() -> list[Case]:
    """Rows whose every score is hundreds below zero (a running maximum started at 0 instead of
    -inf underflows every exponential), and rows whose maximum sits only in the first key block
    (a maximum not carried across blocks rescales wrongly), in decode, extend, verify and mixed,
    float32 (16-bit scores of that size are not representable to the tolerance) and, for the
    first-block maximum, bfloat16; with sinks and a soft-cap too."""
    out = []
    for variant in ("far_below", "max_first"):
        for name in ("decode", "extend_prefix", "target_verify_custom_mask", "mixed"):
            dts = ("float32", "bfloat16") if variant == "max_first" else ("float32",)
            for dt in dts:
                out.append(_case("score_range", scenario(name), dt, 16, variant, scores=variant))
            out.append(_case("score_range", scenario(name), "float32", 16, variant, "sinks", scores=variant,
                             features=Features(sinks=True)))
        out.append(_case("score_range", scenario("decode"), "float32", 16, variant, "t1", scores=variant, threads=1))
    out.append(_case("score_range", scenario("decode"), "float32", 16, "max_first", "softcap", scores="max_first",
                     features=Features(logit_cap=30.0)))
    return out


def gen_rounding() -> list[Case]:
    """16-bit outputs rounded to nearest: over thousands of elements the mean signed error, in units
    of the output's last place, is near zero (truncation toward zero sits near -1/2)."""
    out = []
    for dt in ("float16", "bfloat16"):
        for name in ("decode_rounding", "extend_prefix", "target_verify_custom_mask"):
            out.append(_case("rounding", scenario(name), dt, 16, shape=Shape("gqa4d128", 8, 2, 128)))
    return out


#: odd KV-head counts: (name, heads, kv heads)
ODD_HEADS: tuple[tuple[str, int, int], ...] = (("kv3g2", 6, 3), ("kv5g1", 5, 5), ("kv7g2", 14, 7), ("kv3g3", 9, 3))


def gen_odd_heads() -> list[Case]:
    """Odd KV-head counts at decode batches of 1 to 6 requests, at one and two threads: a kernel that
    splits KV heads across work items unevenly (or by thread count) fails here."""
    out = []
    for lname, h, kv in ODD_HEADS:
        for n in range(1, 7):
            for threads in (1, 2):
                dt = "bfloat16" if n == 3 else "float32"
                out.append(_case("odd_heads", scenario(f"decode_batch{n}"), dt, 16, lname, f"t{threads}",
                                 shape=Shape(lname, h, kv, 64), threads=threads))
    return out


GENERATORS: dict[str, Callable[[], list[Case]]] = {
    "mode": gen_mode,
    "heads": gen_heads,
    "v_head_dim": gen_v_head_dim,
    "feature": gen_feature,
    "cross_attention": gen_cross_attention,
    "kv_cache_dtype": gen_kv_cache_dtype,
    "fp8_kv": gen_fp8_kv,
    "kv_cache_write": gen_kv_cache_write,
    "shared_metadata": gen_shared_metadata,
    "sequence": gen_sequence,
    "determinism": gen_determinism,
    "cuda_graph": gen_cuda_graph,
    "bad_input": gen_bad_input,
    "metadata_required": gen_metadata_required,
    "long": gen_long,
    "scaling": gen_scaling,
    "no_save": gen_no_save,
    "unmapped_slot": gen_unmapped_slot,
    "edge": gen_edge,
    "output_ownership": gen_output_ownership,
    "kv_none": gen_kv_none,
    "garbage": gen_garbage,
    "rejected": gen_rejected,
    "random": gen_random,
    "kv_layout": lambda: [],  # generated per backend: cases_for -> gen_kv_layout
    "workspace": gen_workspace,
    "chunked": gen_chunked,
    "head_dim_class": gen_head_dim_class,
    "score_range": gen_score_range,
    "rounding": gen_rounding,
    "odd_heads": gen_odd_heads,
    "mla": gen_mla,
    "mla_garbage": gen_mla_garbage,
    "mla_fp8": gen_mla_fp8,
    "mla_forms_agree": gen_mla_forms_agree,
}

def cases_for(family: str, caps: Capabilities) -> list[Case]:
    """The cases of ``family`` for a backend declaring ``caps`` (unclaimed ones included, to be skipped).

    Every case runs in the backend's first declared KV layout, and at a page size it claims: a case
    written for an unclaimed page size runs at the nearest claimed one (the smallest larger one, else
    the largest), its id saying so (``~ps32``), so a backend with a page-size rule still meets every
    family rather than skipping most of them.
    """
    if family == "refusal":
        return gen_refusal(caps)
    if family == "kv_layout":
        return gen_kv_layout(caps)
    return [fit_case(c, caps, first_layout(caps)) for c in GENERATORS[family]()]


def first_layout(caps: Capabilities) -> str:
    """The KV layout a backend's cases run in: the first it declares (``nhd`` for one reading any)."""
    return caps.kv_layouts[0] if caps.kv_layouts else NHD


def fit_case(case: Case, caps: Capabilities, layout: str) -> Case:
    """``case`` in ``layout`` at a page size ``caps`` claims (see ``cases_for``)."""
    ps = case.page_size
    claimed = caps.page_sizes
    changes: dict[str, Any] = {"kv_layout": layout}
    if claimed is not None and ps not in claimed:
        bigger = [p for p in claimed if p > ps]
        new = min(bigger) if bigger else max(claimed)
        sc = case.scenario
        if sc.name == "extend_prefix_midpage":
            sc = scenario(sc.name, new)  # keep the prefix ending mid-page at the new size
        changes.update(page_size=new, scenario=sc, id=f"{case.id}~ps{new}")
    return dataclasses.replace(case, **changes)


#: core layouts a backend reading any layout (``kv_layouts=None``) is tested in, besides ``nhd``
#: (a plugin's layout may need a geometry the suite's shapes do not have; its owner's suite covers it)
EXTRA_LAYOUTS_FOR_ANY: tuple[str, ...] = (HND,)


def gen_kv_layout(caps: Capabilities) -> list[Case]:
    """Every mode family in each KV layout the backend reads besides its first (each core layout for
    a backend reading any), at fp32 and bf16 where claimed: the layout is a claim like any other."""
    layouts = list(EXTRA_LAYOUTS_FOR_ANY) if caps.kv_layouts is None else list(caps.kv_layouts[1:])
    dtypes: list[str] = [d for d in ("float32", "bfloat16") if d in caps.dtypes] or [caps.dtypes[0]]
    out = []
    for layout in layouts:
        for dt in dtypes:
            for name in ("decode", "extend_prefix", "mixed", "extend_prefix_midpage"):
                base = _case("kv_layout", scenario(name), dt, 16, layout)
                out.append(fit_case(base, caps, layout))
    return out


#: Families whose cases compute attention and compare values (the "numeric cases" of the summary).
NUMERIC_FAMILIES: frozenset[str] = frozenset(
    f for f in GENERATORS if f not in ("bad_input", "metadata_required", "refusal", "kv_none", "rejected")
)

#: Families whose cases pick a claimed dtype and page size when they run (their checks are not
#: about dtype or page size), so only their mode needs a claim.
ANY_DTYPE_FAMILIES: frozenset[str] = frozenset({"bad_input", "metadata_required", "kv_none", "rejected", "random"})


# -- what a case needs ---------------------------------------------------------
def _join(values: Iterable[Any]) -> str:
    return ", ".join(str(v) for v in values)


def case_layer(case: Case, layer_id: int = 0) -> LayerSpec:
    """The layer a case runs (sinks as placeholder zeros: the support verdict only asks whether it has any)."""
    sh, f = case.shape, case.features
    if case.mla_form is not None:
        lora, nope, rope, v = MLA_DIMS
        return LayerSpec(layer_id=layer_id, num_heads=sh.num_heads, num_kv_heads=1, head_dim=lora + rope,
                         mla=MLASpec(lora, nope, rope, v))
    return LayerSpec(
        layer_id=layer_id, num_heads=sh.num_heads, num_kv_heads=sh.num_kv_heads, head_dim=sh.head_dim,
        v_head_dim=sh.v_dim, logit_cap=f.logit_cap, sliding_window=f.sliding_window,
        scaling=f.scaling,  # type: ignore[arg-type]  # None: LayerSpec's default
        sinks=(0.0,) * sh.num_heads if f.sinks else None, is_cross_attention=f.cross_attention,
        causality="bidirectional" if f.bidirectional else "causal",
    )


def case_query(case: Case) -> SupportQuery:
    """What ``case`` asks of a backend, as the core's one support query."""
    any_dtype = case.family in ANY_DTYPE_FAMILIES
    return SupportQuery(
        dtype=None if any_dtype else case.dtype,
        kv_cache_dtype=None if any_dtype else case.kv_dtype,
        page_size=None if any_dtype else case.page_size,
        modes=(ForwardMode.parse(case.scenario.mode),),
        layers=() if any_dtype else (case_layer(case),),
        name_layers=False,
        cuda_graph=case.family == "cuda_graph",
        deterministic=case.family == "determinism",
        mla_form=case.mla_form,
    )


def skip_reason(case: Case, caps: Capabilities, backend: str, *, has_cuda: bool = False) -> str | None:
    """Why ``case`` does not apply to ``backend`` (a capability it does not claim), or None.

    Every capability verdict comes from the core's support query (``attnplug.support``, over
    ``capabilities.support_reasons``: the only implementation of the generic checks); the suite adds only what is not a claim:
    a CUDA-graph case needs a GPU on this host.
    """
    if case.family == "refusal":
        return None
    reasons = support.reasons(case_query(case).replace(backend=backend), caps)
    if case.family == "mla_forms_agree":  # both forms, in this mode kind
        reasons += [r for r in support.reasons(case_query(case).replace(backend=backend, mla_form=UNABSORBED), caps)
                    if r not in reasons]
    if reasons:
        return f"{NOT_CLAIMED} {backend}: {'; '.join(reasons)}"
    if case.family == "cuda_graph" and (not has_cuda or "cuda" not in caps.devices):
        return "cuda_graph: capture/replay needs a CUDA device (none on this host)"
    return None


#: dtypes whose refusal is checked when not claimed (integer and complex included: a kernel
#: that casts them would return truncated or real-only results)
REFUSAL_DTYPES: tuple[str, ...] = ("float32", "float16", "bfloat16", "float64", "int32", "int64", "complex64")
#: KV-cache dtypes whose refusal is checked when not claimed (for the first claimed model dtype)
REFUSAL_KV_DTYPES: tuple[str, ...] = ("float32", "float16", "bfloat16", "float64", "float8_e4m3fn", "float8_e5m2")

#: Optional features whose *refusal* is checked when not claimed: a layer using
#: them must get a non-empty ``not_supported_reasons``, and a forward with it is refused.
REFUSALS: dict[str, Callable[[Capabilities], bool]] = {
    "sliding_window": lambda c: c.sliding_window,
    "logit_softcap": lambda c: c.logit_softcap,
    "sinks": lambda c: c.sinks,
    "cross_attention": lambda c: c.cross_attention,
    "bidirectional": lambda c: c.bidirectional,
    "v_head_dim_differs": lambda c: c.v_head_dim_differs,
    "mqa": lambda c: c.mqa,
    "gqa": lambda c: c.gqa,
    "mode_target_verify": lambda c: c.speculative_verify,
    "mode_draft_extend": lambda c: c.draft_extend,
}


def claimed_shape(caps: Capabilities) -> Shape:
    """The default layer shape, or an MHA one of the same size when GQA is not claimed."""
    return DEFAULT_SHAPE if caps.gqa else Shape("mha8", 8, 8, DEFAULT_SHAPE.head_dim)


def refusal_model_dtype(caps: Capabilities) -> str:
    """The model dtype refusal cases run at (the first claimed)."""
    return "float32" if "float32" in caps.dtypes else caps.dtypes[0]


def unclaimed_refusals(caps: Capabilities) -> list[str]:
    out = [f"dtype_{d}" for d in REFUSAL_DTYPES if d not in caps.dtypes]
    model = refusal_model_dtype(caps)
    # the core's verdict: kv_cache_dtypes, narrowed by kv_cache_dtype_follows_model
    out += [f"kv_dtype_{d}" for d in REFUSAL_KV_DTYPES if support_reasons(caps, dtype=model, kv_cache_dtype=d)]
    out += [name for name, claimed in REFUSALS.items() if not claimed(caps)]
    return out
