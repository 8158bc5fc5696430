"""Case generation from capabilities (pure data; no torch, no subprocess)."""

from __future__ import annotations

import dataclasses

from attnplug import Capabilities
from attnplug.capabilities import support_reasons
from attnplug.testing.suite import cases as C
from attnplug.testing.tolerances import TOLERANCES, tolerance_for

EVERYTHING = Capabilities(v_head_dim_differs=True, sliding_window=True, logit_softcap=True, sinks=True,
                          cross_attention=True, bidirectional=True, speculative_verify=True, draft_extend=True, deterministic=True,
                          kv_cache_dtypes=("float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"),
                          kv_layouts=None,
                          mla_forms={"decode": ("absorbed", "unabsorbed"), "extend": ("absorbed", "unabsorbed")})


def _all_cases(caps: Capabilities) -> list[C.Case]:
    return [c for fam in list(C.GENERATORS) + ["refusal"] for c in C.cases_for(fam, caps)]


def test_ids_are_unique_within_each_family() -> None:
    for fam in C.GENERATORS:
        ids = [c.id for c in C.GENERATORS[fam]()]
        assert len(ids) == len(set(ids)), fam


def test_seeds_are_fixed_by_id() -> None:
    a, b = C.gen_mode()[5], C.gen_mode()[5]
    assert a.seed == b.seed and a.seed != C.gen_mode()[6].seed


def test_a_backend_claiming_everything_runs_everything_but_cuda_graph_off_gpu() -> None:
    reasons = {C.skip_reason(c, EVERYTHING, "x") for c in _all_cases(EVERYTHING)}
    assert reasons == {None, C.NOT_CLAIMED + " x: CUDA-graph capture is not claimed"}
    numeric = [c for c in _all_cases(EVERYTHING) if c.numeric and c.family != "cuda_graph"]
    assert len(numeric) >= 600


def test_mla_cases_are_skipped_per_form_and_mode_kind() -> None:
    caps = Capabilities(mla_forms={"decode": ("absorbed",)}, speculative_verify=True, draft_extend=True)
    mla = [c for c in _all_cases(caps) if c.family.startswith("mla")]
    run = {c.id for c in mla if C.skip_reason(c, caps, "d") is None}
    assert run and all(c.scenario.mode == "decode" and c.mla_form == "absorbed" and c.family != "mla_forms_agree"
                       for c in mla if c.id in run)
    reasons = {C.skip_reason(c, caps, "d") for c in mla} - {None}
    assert "not claimed by d: MLA layer (absorbed extend) not supported by d (mla_forms: extend: none)" in reasons
    assert "not claimed by d: MLA layer (unabsorbed decode) not supported by d (mla_forms: decode: absorbed)" in reasons


def test_unclaimed_features_are_skipped_with_the_cores_reason() -> None:
    caps = Capabilities(dtypes=("float32",), page_sizes=(16,), head_dims=(64, 128))
    got = {C.skip_reason(c, caps, "mine") for c in _all_cases(caps)}
    for expected in (
        "attention sinks are not claimed",
        "sliding_window=5 is not claimed",
        "logit_cap=2.0 is not claimed",
        "cross-attention is not claimed",
        "bidirectional (non-causal) attention is not claimed",
        "forward mode target_verify is not claimed",
        "forward mode draft_extend is not claimed",
        "deterministic (batch-invariant) output is not claimed",
        "dtype=float16 (supported: float32)",
        "head_dim=256 (supported: 64, 128)",
        "kv_cache_dtype=float8_e4m3fn (supported: float32)",
        "MLA layer not supported by mine (Capabilities.mla_forms claims no MLA form)",
    ):
        assert any(r and r.startswith("not claimed by mine: ") and expected in r for r in got), expected
    assert all(r is None or r.startswith(C.NOT_CLAIMED + " mine: ") for r in got)
    # a page size is never a reason to skip: a case written for another one runs at a claimed one
    assert not any(r and "page_size" in r for r in got)


def test_cases_run_at_a_claimed_page_size_and_in_the_first_declared_layout() -> None:
    caps = Capabilities(page_sizes=(32, 64), kv_layouts=("toy", "nhd"))
    mode = C.cases_for("mode", caps)
    assert {c.page_size for c in mode} == {32, 64}
    moved = [c for c in mode if c.id.endswith("~ps32")]
    assert moved and all(c.page_size == 32 for c in moved)  # 1 and 16 -> the smallest larger claimed one
    assert all(c.kv_layout == "toy" for c in mode)
    mid = [c for c in moved if c.scenario.name == "extend_prefix_midpage"]
    assert mid and all(p % 32 for p in mid[0].scenario.prefix if p)  # the prefix still ends mid-page
    layouts = C.cases_for("kv_layout", caps)
    assert layouts and {c.kv_layout for c in layouts} == {"nhd"}  # the further declared layout
    assert {c.kv_layout for c in C.cases_for("kv_layout", EVERYTHING)} == {"hnd"}  # reads any: the core's other
    assert C.cases_for("kv_layout", Capabilities()) == []


def test_every_skip_reason_is_the_cores_verdict() -> None:
    """skip_reason adds nothing of its own (but the GPU a CUDA-graph case needs): each reason is
    exactly what attnplug.capabilities.support_reasons says for the case's layer and context."""
    caps = Capabilities(dtypes=("float32", "bfloat16"), page_sizes=(1, 16), head_dims=(64,), mqa=False,
                        sliding_window=True, kv_cache_dtypes=("float32", "bfloat16"))
    for c in _all_cases(caps):
        if c.family in ("refusal", "cuda_graph"):
            continue
        got = C.skip_reason(c, caps, "mine")
        any_dtype = c.family in C.ANY_DTYPE_FAMILIES
        want = support_reasons(caps, None if any_dtype else C.case_layer(c),
                               dtype=None if any_dtype else c.dtype,
                               kv_cache_dtype=None if any_dtype else c.kv_dtype,
                               page_size=None if any_dtype else c.page_size,
                               mode=C.ForwardMode.parse(c.scenario.mode),
                               deterministic=c.family == "determinism", mla_form=c.mla_form, backend="mine")
        assert got == (f"not claimed by mine: {'; '.join(want)}" if want else None), c.id


def test_v_head_dim_is_not_checked_against_head_dims_by_the_suite_alone() -> None:
    # the old copy in cases.py refused v_head_dim 128 for head_dims=(192,); the core does not
    caps = Capabilities(head_dims=(192,), v_head_dim_differs=True)
    case = next(c for c in C.gen_v_head_dim() if c.shape.head_dim == 192 and c.dtype == "float32")
    assert C.skip_reason(case, caps, "x") is None


def test_every_mode_and_required_dimension_is_generated() -> None:
    modes = {c.scenario.mode for c in C.gen_mode()}
    assert modes == {"extend", "decode", "mixed", "idle", "target_verify", "draft_extend", "draft_extend_v2"}
    assert {c.page_size for c in C.gen_mode() if c.scenario.mode == "decode"} == {1, 16, 64}
    heads = C.gen_heads()
    assert {(c.shape.num_heads // c.shape.num_kv_heads, c.shape.num_kv_heads == 1) for c in heads} == {
        (1, False), (4, False), (8, False), (8, True)}
    assert {c.shape.head_dim for c in heads} == {64, 128, 256}
    midpage = [c for c in C.gen_mode() if c.scenario.name == "extend_prefix_midpage"]
    assert all(p % c.page_size for c in midpage for p in c.scenario.prefix)


def test_long_cases_cross_the_thresholds_they_are_sized_for() -> None:
    long = {c.scenario.name: c for c in C.gen_long()}
    d, sh = long["decode_long"], C.LONG_SHAPE
    # one long request gathers >= 8 MiB of float32 K and spans > 16 splits of 256 keys
    assert max(d.scenario.seq_lens) * sh.num_kv_heads * sh.head_dim * 4 >= 8 << 20
    assert max(d.scenario.seq_lens) > 16 * 256 and 0 in d.scenario.prefix
    e = long["extend_long"].scenario
    assert max(e.extend) * max(e.seq_lens) * sh.num_heads * 4 > 64 << 20  # float32 scores of one request
    assert all(c.page_size == 16 or c.id.endswith("no_save-float32-ps64") for c in C.gen_long())


def test_edge_scenarios_are_what_they_claim() -> None:
    assert 0 in C.scenario("extend_zero_new").extend
    assert set(C.scenario("decode_position0").prefix) == {0}
    assert 0 in C.scenario("cross_extend_empty").encoder and 0 in C.scenario("cross_decode_empty").encoder
    nv = C.scenario("target_verify_no_visible")
    assert nv.prefix[0] == 0 and nv.mask_hides_row
    assert C.scenario("draft_extend_with_mask").custom_mask and C.scenario("draft_extend_with_mask").mode == \
        "draft_extend"
    assert {c.features.scaling for c in C.gen_scaling()} == set(C.SCALINGS.values())


def test_garbage_covers_every_mode_page_size_window_and_sink_setting() -> None:
    g = C.gen_garbage()
    modes = {c.scenario.name for c in g}
    assert modes == set(C.ALL_MODE_SCENARIOS) - {"idle"} | {"cross_extend", "cross_decode"}
    assert {c.page_size for c in g} == set(C.PAGE_SIZES)
    assert {(c.features.sliding_window is not None, c.features.sinks) for c in g} == {
        (False, False), (True, False), (False, True), (True, True)}
    assert {(c.dtype, c.garbage) for c in g} >= {("float32", "nan"), ("bfloat16", "inf")}
    assert any(not c.save_kv_cache for c in g)


def test_refusal_cases_follow_the_claims() -> None:
    assert [c.variant for c in C.cases_for("refusal", EVERYTHING)] == [
        "dtype_float64", "dtype_int32", "dtype_int64", "dtype_complex64", "kv_dtype_float64"]
    plain = [c.variant for c in C.cases_for("refusal", Capabilities())]
    for v in ("sinks", "mode_target_verify", "mode_draft_extend", "kv_dtype_float16", "cross_attention"):
        assert v in plain
    narrow = Capabilities(dtypes=("bfloat16",), kv_cache_dtypes=("bfloat16", "float32"))
    got = [c.variant for c in C.cases_for("refusal", narrow)]
    assert "dtype_float32" in got and "kv_dtype_float32" not in got and "kv_dtype_float16" in got


def test_kv_cache_dtype_follows_model_skips_mismatched_caches_by_capability_and_refuses_them() -> None:
    """Every ``kv_cache_dtype`` case is non-fp8 in another dtype than the model's: all are skipped with the
    core's reason; fp8 cases still run; the listed 16-bit dtype other than the refusal model dtype
    becomes a refusal case."""
    free = Capabilities(dtypes=("float16", "bfloat16"), kv_cache_dtypes=("float16", "bfloat16", "float8_e4m3fn"),
                        speculative_verify=True)
    follows = dataclasses.replace(free, kv_cache_dtype_follows_model=True)
    kv_cases = C.cases_for("kv_cache_dtype", follows)
    ran_free = [c for c in kv_cases if C.skip_reason(c, free, "x") is None]
    assert {(c.dtype, c.kv_dtype) for c in ran_free} == {("float16", "bfloat16"), ("bfloat16", "float16")}
    for c in ran_free:
        reason = C.skip_reason(c, follows, "x")
        assert reason is not None and reason.startswith(C.NOT_CLAIMED + " x: ")
        assert f"kv_cache_dtype={c.kv_dtype} with dtype={c.dtype}" in reason
        assert "kv_cache_dtype_follows_model" in reason
    fp8 = [c for c in C.cases_for("fp8_kv", follows) if c.kv_dtype == "float8_e4m3fn" and c.dtype == "bfloat16"]
    assert fp8 and all(C.skip_reason(c, follows, "x") is None for c in fp8)
    assert "kv_dtype_bfloat16" not in [c.variant for c in C.cases_for("refusal", free)]
    assert "kv_dtype_bfloat16" in [c.variant for c in C.cases_for("refusal", follows)]  # model float16


def test_rejections_cover_every_index_and_length() -> None:
    names = {c.variant for c in C.gen_rejected()}
    for field in ("out_cache_loc", "req_pool_indices", "layer_id", "req_to_token"):
        assert {f"{field}_beyond", f"{field}_negative" if field != "req_to_token" else f"{field}_unassigned"} <= names
    assert {"seq_len_beyond_assigned", "seq_len_beyond_context", "dtype_int32"} <= names


def test_tolerances_are_stated_per_dtype() -> None:
    assert set(TOLERANCES) == {"float32", "float16", "bfloat16"}
    assert TOLERANCES["float32"].atol < TOLERANCES["float16"].atol < TOLERANCES["bfloat16"].atol
    assert tolerance_for("float32", "bfloat16") == dataclasses.replace(
        TOLERANCES["bfloat16"], atol=TOLERANCES["bfloat16"].atol)
