"""Case generation from capabilities (pure data; no torch, no subprocess)."""

from __future__ import annotations

import dataclasses

from attnplug import Capabilities
from attnplug.testing.suite import cases as C
from attnplug.testing.tolerances import TOLERANCES, tolerance_for

EVERYTHING = Capabilities(v_head_dim_differs=True, sliding_window=True, logit_softcap=True, sinks=True,
                          cross_attention=True, speculative_verify=True, draft_extend=True, deterministic=True,
                          kv_cache_dtypes=("float32", "float16", "bfloat16"))


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
    assert reasons == {None, "cuda_graph: " + C.NOT_CLAIMED + " x"}
    numeric = [c for c in _all_cases(EVERYTHING) if c.numeric and c.family != "cuda_graph"]
    assert len(numeric) >= 300


def test_unclaimed_features_are_skipped_with_the_reason() -> None:
    caps = Capabilities(dtypes=("float32",), page_sizes=(16,), head_dims=(64, 128))
    got = {C.skip_reason(c, caps, "mine") for c in _all_cases(caps)}
    for expected in (
        "sinks: not claimed by mine",
        "sliding_window: not claimed by mine",
        "logit_softcap: not claimed by mine",
        "cross_attention: not claimed by mine",
        "speculative_verify (target_verify): not claimed by mine",
        "draft_extend: not claimed by mine",
        "deterministic: not claimed by mine",
        "dtype float16: not claimed by mine (claims: float32)",
        "page_size 64: not claimed by mine (claims: 16)",
        "head_dim 256: not claimed by mine (claims: 64, 128)",
    ):
        assert expected in got
    assert all(r is None or C.NOT_CLAIMED in r for r in got)


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


def test_refusal_cases_follow_the_claims() -> None:
    assert [c.variant for c in C.cases_for("refusal", EVERYTHING)] == ["dtype_float64"]
    plain = Capabilities()
    assert "sinks" in [c.variant for c in C.cases_for("refusal", plain)]


def test_tolerances_are_stated_per_dtype() -> None:
    assert set(TOLERANCES) == {"float32", "float16", "bfloat16"}
    assert TOLERANCES["float32"].atol < TOLERANCES["float16"].atol < TOLERANCES["bfloat16"].atol
    assert tolerance_for("float32", "bfloat16") == dataclasses.replace(
        TOLERANCES["bfloat16"], atol=TOLERANCES["bfloat16"].atol)
