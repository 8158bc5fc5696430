"""The fp8 KV-cache contract: stored = round(x / scale) saturated, read = stored * scale, on every
write path of the cache; configuration spellings; resolution of a pair for an fp8 cache."""

from __future__ import annotations

import argparse
import math

import pytest
import torch

from attnplug import AttentionConfig, BuildContext, HostInfo, PagedKVCache
from attnplug.config import add_attention_args, config_from_args
from attnplug.errors import ConfigError
from attnplug.kvcache import quantize
from attnplug.resolution import resolve, trace
from tests import dists_resolution as D

FORMATS = [torch.float8_e4m3fn, torch.float8_e5m2]


def _finite_values(dtype: torch.dtype) -> torch.Tensor:
    """Every finite value of an 8-bit float format, from its 256 bit patterns (sorted, unique)."""
    vals = torch.arange(256, dtype=torch.int16).to(torch.uint8).view(dtype).to(torch.float64)
    return torch.unique(vals[torch.isfinite(vals)])


def _nearest_even(x: float, grid: torch.Tensor, dtype: torch.dtype) -> float:
    """Round-to-nearest (ties to the even bit pattern) over the format's finite values, saturating."""
    top = float(grid.max())
    if x >= top:
        return top
    if x <= -top:
        return -top
    d = (grid - x).abs()
    best = d.min()
    ties = grid[d == best]
    if ties.numel() == 1:
        return float(ties[0])
    bits = [int(torch.tensor([float(t)], dtype=torch.float64).to(dtype).view(torch.uint8)) for t in ties]
    return float(ties[[b % 2 == 0 for b in bits].index(True)])


@pytest.mark.parametrize("dtype", FORMATS, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("scale", [1.0, 0.04, 2.5])
def test_quantize_rounds_to_nearest_even_and_saturates(dtype: torch.dtype, scale: float) -> None:
    grid = _finite_values(dtype)
    top = float(grid.max())
    assert top == {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}[dtype]
    gen = torch.Generator().manual_seed(0)
    # random values over the whole range, exact midpoints between neighbours, and out-of-range values
    mids = ((grid[1:] + grid[:-1]) / 2)[::7]
    x = torch.cat([torch.randn(200, generator=gen, dtype=torch.float64) * top / 8, mids,
                   torch.tensor([top * 1.5, -top * 3, top, -top, 0.0])]) * scale
    x = x.to(torch.float32).to(torch.float64)  # the cache quantizes float32 values
    got = quantize(x.to(torch.float32), scale, dtype).to(torch.float64)
    # the cache divides in float32: round those quotients
    quotients = (x.to(torch.float32) / scale).tolist()
    want = torch.tensor([_nearest_even(qv, grid, dtype) for qv in quotients], dtype=torch.float64)
    assert torch.equal(got, want)
    nan = quantize(torch.tensor([math.nan]), scale, dtype)
    assert torch.isnan(nan.to(torch.float32)).all()
    inf = quantize(torch.tensor([math.inf, -math.inf]), scale, dtype).to(torch.float64)
    assert inf.tolist() == [top, -top]  # saturated, never inf or NaN


def _cache(dtype: str = "float8_e4m3fn", **kw: object) -> PagedKVCache:
    return PagedKVCache(2, 4, 2, 8, page_size=4, dtype=dtype, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("layout", ["nhd", "hnd"])
def test_every_write_path_quantizes_with_the_layers_scales(layout: str) -> None:
    cache = _cache(layout=layout)
    cache.set_kv_scales(1, 0.04, 2.5)
    assert cache.quantized and cache.kv_scales(1) == (0.04, 2.5) and cache.kv_scales(0) == (1.0, 1.0)
    gen = torch.Generator().manual_seed(1)
    k = (torch.randn(3, 2, 8, generator=gen) * 3).clamp(-14, 14)  # |k / 0.04| <= 350: nothing saturates
    v = torch.randn(3, 2, 8, generator=gen)
    loc = torch.tensor([9, 2, 14])
    cache.set_kv(1, loc, k, v)
    sk, sv = cache.read_kv(1, loc)
    assert sk.dtype == torch.float8_e4m3fn
    assert torch.equal(sk, quantize(k, 0.04, torch.float8_e4m3fn)) and torch.equal(sv, quantize(v, 2.5, torch.float8_e4m3fn))
    dk, dv = cache.read_kv(1, loc, dequantize=True)
    assert torch.equal(dk, sk.float() * 0.04) and torch.equal(dv, sv.float() * 2.5)
    assert (dk - k).abs().max() <= 0.04 * 256 * 2 ** -4  # half an e4m3 step (3 mantissa bits) below 512
    # a raising block leaves the stored bytes exactly as they were (restored as stored, not re-quantized)
    before = cache.read_kv(1)
    with pytest.raises(RuntimeError):
        with cache.staged(1, loc, k * 2, v * 2):
            raise RuntimeError("kernel failed")
    after = cache.read_kv(1)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(before, after))
    # stored=True writes stored values as they are
    cache.set_kv(0, loc, sk, sv, stored=True)
    assert torch.equal(cache.read_kv(0, loc)[0].view(torch.uint8), sk.view(torch.uint8))


@pytest.mark.parametrize("bad", [0, -1.0, math.inf, math.nan, True, "1"])
def test_scales_must_be_positive_finite_numbers(bad: object) -> None:
    with pytest.raises(ValueError, match=r"layer 0 k_scale=.*expected a positive finite number"):
        _cache().set_kv_scales(0, bad, 1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"layer 1 v_scale"):
        _cache().set_kv_scales(1, 1.0, bad)  # type: ignore[arg-type]


def test_a_cache_that_would_ignore_scales_refuses_them() -> None:
    cache = _cache("bfloat16")
    assert not cache.quantized
    with pytest.raises(ValueError, match="scales apply to fp8 caches.*stores bfloat16.*k_scale=0.5"):
        cache.set_kv_scales(0, 0.5, 1.0)
    cache.set_kv_scales(0, 1.0, 1.0)  # the identity is accepted everywhere


def test_kv_cache_dtype_spellings() -> None:
    host = HostInfo(platform="cpu")
    for given, want in [("auto", "bfloat16"), (None, "bfloat16"), ("fp8_e4m3", "float8_e4m3fn"),
                        ("fp8_e5m2", "float8_e5m2"), ("float8_e4m3fn", "float8_e4m3fn")]:
        cfg = AttentionConfig(kv_cache_dtype=given)
        assert BuildContext(config=cfg, host=host, dtype="bfloat16", kv_cache_dtype=given).kv_cache_dtype == want
    with pytest.raises(ConfigError, match="kv_cache_dtype='fp9'"):
        AttentionConfig(kv_cache_dtype="fp9")
    p = argparse.ArgumentParser()
    add_attention_args(p)
    assert config_from_args(p.parse_args(["--kv-cache-dtype", "fp8_e5m2"])).kv_cache_dtype == "fp8_e5m2"
    assert "fp8_e4m3" in p.format_help()


H100 = HostInfo(platform="cuda", compute_capability=(9, 0), device_name="H100",
                libraries={"sgl-kernel": "0.3.5", "flashinfer-python": "0.7.4", "triton": "3.4.0", "torch": "2.8.0"})


def test_resolution_picks_halves_that_both_claim_the_fp8_format_and_explains() -> None:
    reg = D.registry(H100)
    plain = resolve(AttentionConfig(), host=H100, registry=reg)
    e5m2 = resolve(AttentionConfig(kv_cache_dtype="fp8_e5m2"), host=H100, registry=reg)
    for name in e5m2.pair:
        assert "float8_e5m2" in reg.get(name).capabilities.kv_cache_dtypes
    assert e5m2.pair != plain.pair  # the default pair does not store e5m2: resolution moved
    rejected = e5m2.rejected()
    assert any("kv_cache_dtype=float8_e5m2" in r for r in rejected[plain.pair[1]])


def test_a_pinned_half_lacking_the_fp8_format_is_refused_with_alternatives() -> None:
    reg = D.registry(H100)
    res = trace(AttentionConfig(prefill_attention_backend="fa3", kv_cache_dtype="fp8_e5m2"), host=H100, registry=reg)
    assert isinstance(res.error, ConfigError)
    msg = str(res.error)
    assert "'fa3'" in msg and "kv_cache_dtype=float8_e5m2" in msg and "Backends that would:" in msg


def _sm(sm: int | None, platform: str = "cuda") -> HostInfo:
    return HostInfo(platform=platform, compute_capability=None if sm is None else (sm // 10, sm % 10))


@pytest.mark.parametrize("config, host", [
    (AttentionConfig(attention_backend="triton", kv_cache_dtype="fp8_e4m3"), _sm(80)),  # another backend
    (AttentionConfig(attention_backend="kern", kv_cache_dtype="fp8_e4m3"), _sm(90)),  # an SM it is built for
    (AttentionConfig(attention_backend="kern", kv_cache_dtype="fp8_e4m3"), _sm(None)),  # SM unknown
    (AttentionConfig(attention_backend="kern", kv_cache_dtype="fp8_e4m3"), _sm(None, "rocm")),  # not CUDA
    (AttentionConfig(attention_backend="kern", kv_cache_dtype="auto"), _sm(80)),  # no fp8 cache
    (AttentionConfig(attention_backend="kern", kv_cache_dtype="bfloat16"), _sm(80)),
], ids=["other_backend", "built_sm", "unknown_sm", "rocm", "auto", "bfloat16"])
def test_fp8_kv_sm_problems_refuses_only_fp8_on_other_gpus(config: AttentionConfig, host: HostInfo) -> None:
    from attnplug.probes import fp8_kv_sm_problems

    assert fp8_kv_sm_problems("kern", config, host, (90,), "kern's fp8 path runs on SM90") == []


@pytest.mark.parametrize("config", [
    AttentionConfig(attention_backend="kern", kv_cache_dtype="fp8_e5m2"),
    AttentionConfig(prefill_attention_backend="triton", decode_attention_backend="kern", kv_cache_dtype="fp8_e5m2"),
], ids=["both_halves", "decode_half"])
@pytest.mark.parametrize("advice, tail", [("", ""), ("Use auto", ". Use auto")])
def test_fp8_kv_sm_problems_names_the_dtype_backend_and_gpu(config: AttentionConfig, advice: str, tail: str) -> None:
    from attnplug.probes import fp8_kv_sm_problems

    assert fp8_kv_sm_problems("kern", config, _sm(86), (90, 100), "kern's fp8 path runs on SM90/100", advice) == [
        "kv_cache_dtype=float8_e5m2 with attention backend 'kern': kern's fp8 path runs on SM90/100 only; this GPU is "
        "SM86" + tail]
