"""``Capabilities.kv_cache_dtype_follows_model``: a non-fp8 KV cache must be in the model dtype.

The rule is declared data, so the one implementation of the generic checks
(``support_reasons``) answers it for resolution, the registry's build check,
the suite's skips and doctor alike; fp8 caches stay governed by
``kv_cache_dtypes`` alone.
"""

from __future__ import annotations

import dataclasses
import json
import types

import pytest

from attnplug import AttentionConfig, BackendDescriptor, BuildContext, Capabilities, HostInfo, hookimpl
from attnplug.capabilities import RESTRICTIONS, support_reasons
from attnplug.errors import ConfigError, NotSupportedError
from attnplug.discovery import in_process_source
from attnplug.registry import Registry
from attnplug.resolution import resolve, trace

FOLLOWS = Capabilities(dtypes=("float16", "bfloat16"), kv_cache_dtypes=("float16", "bfloat16", "float8_e4m3fn"),
                       kv_cache_dtype_follows_model=True)
FREE = dataclasses.replace(FOLLOWS, kv_cache_dtype_follows_model=False)
MISMATCH = ("kv_cache_dtype=float16 with dtype=bfloat16: a non-fp8 KV cache must be in the model dtype "
            "(kv_cache_dtype_follows_model)")


def test_default_is_off_and_the_field_is_part_of_equality_and_json() -> None:
    assert Capabilities().kv_cache_dtype_follows_model is False
    assert FOLLOWS != FREE
    assert FOLLOWS.to_dict()["kv_cache_dtype_follows_model"] is True
    assert json.loads(json.dumps(FREE.to_dict()))["kv_cache_dtype_follows_model"] is False
    assert "kv_cache_dtype_follows_model" in RESTRICTIONS
    assert FOLLOWS.summary().endswith("kv_cache_dtype_follows_model")
    assert "kv_cache_dtype_follows_model" not in FREE.summary()


def test_a_mismatched_16_bit_cache_is_refused_naming_both_dtypes_and_the_field() -> None:
    assert support_reasons(FOLLOWS, dtype="bfloat16", kv_cache_dtype="float16") == [MISMATCH]
    assert support_reasons(FOLLOWS, dtype="float16", kv_cache_dtype="bf16") == [
        "kv_cache_dtype=bfloat16 with dtype=float16: a non-fp8 KV cache must be in the model dtype "
        "(kv_cache_dtype_follows_model)"]
    # without the field the same listed pair is served
    assert support_reasons(FREE, dtype="bfloat16", kv_cache_dtype="float16") == []


@pytest.mark.parametrize("model", ["float16", "bfloat16"])
def test_a_cache_in_the_model_dtype_is_fine(model: str) -> None:
    assert support_reasons(FOLLOWS, dtype=model, kv_cache_dtype=model) == []


@pytest.mark.parametrize("model", ["float16", "bfloat16"])
def test_fp8_caches_are_governed_by_kv_cache_dtypes_alone(model: str) -> None:
    assert support_reasons(FOLLOWS, dtype=model, kv_cache_dtype="float8_e4m3fn") == []
    # an fp8 format not listed: the list's reason, and no word about following the model
    assert support_reasons(FOLLOWS, dtype=model, kv_cache_dtype="float8_e5m2") == [
        "kv_cache_dtype=float8_e5m2 (supported: float16, bfloat16, float8_e4m3fn)"]


def test_float32_is_not_fp8_so_it_must_follow_the_model_too() -> None:
    caps = Capabilities(kv_cache_dtypes=("float32", "bfloat16"), kv_cache_dtype_follows_model=True)
    assert support_reasons(caps, dtype="float32", kv_cache_dtype="float32") == []
    reasons = support_reasons(caps, dtype="bfloat16", kv_cache_dtype="float32")
    assert reasons == ["kv_cache_dtype=float32 with dtype=bfloat16: a non-fp8 KV cache must be in the model dtype "
                       "(kv_cache_dtype_follows_model)"]


def test_an_unlisted_cache_gets_one_reason_and_an_unknown_model_dtype_is_not_judged() -> None:
    caps = Capabilities(dtypes=("float32", "bfloat16"), kv_cache_dtypes=("bfloat16",),
                        kv_cache_dtype_follows_model=True)
    assert support_reasons(caps, dtype="bfloat16", kv_cache_dtype="float32") == [
        "kv_cache_dtype=float32 (supported: bfloat16)"]
    assert support_reasons(FOLLOWS, kv_cache_dtype="float16") == []  # dtype left None: not checked


# -- resolution and build, through a registry holding a backend that declares the field ----------
def _plugin() -> types.ModuleType:
    """A one-backend plugin registered in-process: the field is all that tells resolution the rule.
    Its factory must never run here (every test is refused before it)."""
    mod = types.ModuleType("follows_plugin")

    @hookimpl
    def attnplug_register_backends(register):  # type: ignore[no-untyped-def]
        register(BackendDescriptor(
            name="follows", factory="tests.dists_resolution._probes:not_a_backend",
            capabilities=dataclasses.replace(FOLLOWS, dtypes=("float32", "float16", "bfloat16"), devices=("cpu",)),
            priority={"cpu": 90}))

    mod.attnplug_register_backends = attnplug_register_backends  # type: ignore[attr-defined]
    return mod


def _registry(host: HostInfo) -> Registry:
    import attnplug_torch_native

    reg = Registry(host=host)
    reg.load_sources([in_process_source(attnplug_torch_native, "attnplug-torch-native"),
                      in_process_source(_plugin(), "test-follows")])
    return reg


CPU = HostInfo(platform="cpu")


def test_resolution_moves_away_from_the_backend_for_a_mismatched_16_bit_cache() -> None:
    reg = _registry(CPU)
    same = resolve(AttentionConfig(dtype="bfloat16", kv_cache_dtype="bfloat16"), host=CPU, registry=reg)
    assert same.pair == ("follows", "follows")
    moved = resolve(AttentionConfig(dtype="bfloat16", kv_cache_dtype="float16"), host=CPU, registry=reg)
    assert "follows" not in moved.pair
    assert MISMATCH in moved.rejected()["follows"]
    fp8 = resolve(AttentionConfig(dtype="bfloat16", kv_cache_dtype="fp8_e4m3"), host=CPU, registry=reg)
    assert fp8.pair == ("follows", "follows")


def test_resolution_refuses_a_pinned_half_with_the_capabilitys_reason() -> None:
    reg = _registry(CPU)
    res = trace(AttentionConfig(decode_attention_backend="follows", dtype="bfloat16", kv_cache_dtype="float16"),
                host=CPU, registry=reg)
    assert isinstance(res.error, ConfigError)
    assert "'follows'" in str(res.error) and MISMATCH in str(res.error)


def test_build_refuses_before_the_factory_runs() -> None:
    reg = _registry(CPU)
    ctx = BuildContext(config=AttentionConfig(), host=CPU, dtype="bfloat16", kv_cache_dtype="float16")
    with pytest.raises(NotSupportedError, match=r"kv_cache_dtype_follows_model") as exc:
        reg.build("follows", ctx)
    assert MISMATCH in str(exc.value)
