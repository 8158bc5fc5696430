"""``Case.exact_in``: the harness draws named values exactly representable in a narrower dtype.

The same random stream as without it (so a case's other tensors are unchanged), each named value
rounded to the dtype and back; an unknown name or dtype is refused naming the case and the pair."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from attnplug.testing.suite import harness as H
from attnplug.testing.suite.cases import Case, Features, Scenario, Shape


def _case(dtype: str = "float16", kv: str | None = None, **kw: object) -> Case:
    sc = Scenario("exact", "extend", (0, 5, 17), (7, 3, 1))
    return Case("exact_in_test", f"{dtype}-{kv}", sc, dtype=dtype, page_size=16, shape=Shape("s", 4, 2, 16),
                features=Features(sinks=True), kv_cache_dtype=kv, **kw)  # type: ignore[arg-type]


def _round(x: torch.Tensor, dtype: str) -> torch.Tensor:
    return x.to(getattr(torch, dtype)).to(x.dtype)


@pytest.mark.parametrize("what,dtype", [("q", "float8_e4m3fn"), ("k", "float8_e5m2"), ("v", "float8_e4m3fn"),
                                        ("sinks", "bfloat16"), ("sinks", "float8_e4m3fn")])
@pytest.mark.parametrize("model", ["float16", "bfloat16", "float32"])
def test_the_named_value_is_the_plain_draw_rounded_and_nothing_else_moves(what: str, dtype: str, model: str) -> None:
    plain = H.make_problem(_case(model), "cpu")
    exact = H.make_problem(dataclasses.replace(_case(model), exact_in=((what, dtype),)), "cpu")
    names = ("q", "k", "v")
    got = dict(zip(names, exact.qkv[0]), sinks=exact.layers[0].sinks)
    want = dict(zip(names, plain.qkv[0]), sinks=plain.layers[0].sinks)
    for name in (*names, "sinks"):
        g, w = got[name], want[name]
        assert g is not None and w is not None
        if name == what:
            assert torch.equal(g, _round(w, dtype)) and torch.equal(g, _round(g, dtype))
            assert not torch.equal(g, w), f"{name}: rounding to {dtype} changed nothing; the test cannot fail"
        else:
            assert torch.equal(g, w), name
    for (kp, vp), (ke, ve) in zip(plain.before, exact.before):
        assert torch.equal(kp, ke) and torch.equal(vp, ve)
    assert torch.equal(plain.cache.req_to_token, exact.cache.req_to_token)
    assert torch.equal(plain.batch.out_cache_loc, exact.batch.out_cache_loc)


def test_fp8_queries_over_an_fp8_cache_equal_their_e4m3_quantization() -> None:
    """What the fa3 family asks for: a kernel that quantizes q to e4m3 with scale 1 loses nothing."""
    case = dataclasses.replace(_case("bfloat16", "float8_e4m3fn"), kv_scales=(0.5, 2.0),
                               exact_in=(("q", "float8_e4m3fn"), ("sinks", "bfloat16")))
    p = H.make_problem(case, "cpu")
    q = p.qkv[0][0]
    sinks = p.layers[0].sinks
    assert sinks is not None
    assert torch.equal(q.to(torch.float8_e4m3fn).to(q.dtype), q)
    assert torch.equal(sinks.to(torch.bfloat16).float(), sinks)
    assert p.cache.kv_scales(0) == (0.5, 2.0)


@pytest.mark.parametrize("pairs,fragment", [
    ((("keys", "bfloat16"),), "exact_in names 'keys'; expected one of q, k, v, sinks"),
    ((("q", "bfloat17"),), "exact_in ('q', 'bfloat17'): 'bfloat17' is not a torch dtype name"),
    ((("sinks", "bfloat16"), ("v", "Tensor")), "exact_in ('v', 'Tensor'): 'Tensor' is not a torch dtype name"),
])
def test_an_unknown_name_or_dtype_is_refused_naming_the_case(pairs: tuple[tuple[str, str], ...],
                                                              fragment: str) -> None:
    with pytest.raises(ValueError) as exc:
        H.make_problem(dataclasses.replace(_case(), exact_in=pairs), "cpu")
    assert "case exact_in_test:float16-None" in str(exc.value) and fragment in str(exc.value)
