"""Dtype names as plain strings, so capabilities and contexts need no torch."""

from __future__ import annotations

from typing import Any

__all__ = [
    "AUTO", "BFLOAT16", "FLOAT16", "FLOAT32", "FLOAT64", "FP8_DTYPES", "FP8_E4M3", "FP8_E5M2", "dtype_name",
    "kv_dtype_name", "torch_dtype",
]

FLOAT32 = "float32"
FLOAT16 = "float16"
BFLOAT16 = "bfloat16"
FLOAT64 = "float64"
FP8_E4M3 = "float8_e4m3fn"
FP8_E5M2 = "float8_e5m2"
#: The fp8 (quantized) KV-cache formats: stored = round(x / scale), read = stored * scale.
FP8_DTYPES: tuple[str, ...] = (FP8_E4M3, FP8_E5M2)

_ALIASES = {
    "fp32": FLOAT32, "float": FLOAT32, "float32": FLOAT32,
    "fp16": FLOAT16, "half": FLOAT16, "float16": FLOAT16,
    "bf16": BFLOAT16, "bfloat16": BFLOAT16,
    "fp64": FLOAT64, "double": FLOAT64, "float64": FLOAT64,
    "fp8": FP8_E4M3, "fp8_e4m3": FP8_E4M3, "float8_e4m3fn": FP8_E4M3,
    "fp8_e5m2": FP8_E5M2, "float8_e5m2": FP8_E5M2,
}


def dtype_name(dtype: Any) -> str:
    """Canonical name of a dtype given as a string or a torch dtype (torch is not imported)."""
    text = str(dtype)
    if text.startswith("torch."):
        text = text[len("torch."):]
    try:
        return _ALIASES[text.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r} (known: {sorted(set(_ALIASES.values()))})") from None


#: ``kv_cache_dtype`` value meaning "the model dtype" (what engines' ``--kv-cache-dtype auto`` means)
AUTO = "auto"


def kv_dtype_name(kv_cache_dtype: Any, model_dtype: Any = None) -> str | None:
    """The KV-cache dtype's canonical name: ``None``/``"auto"`` mean the model dtype (``None`` when
    that is unknown too); ``fp8_e4m3`` / ``fp8_e5m2`` (engines' spellings) name the fp8 formats."""
    if kv_cache_dtype is None or (isinstance(kv_cache_dtype, str) and kv_cache_dtype.lower() == AUTO):
        return None if model_dtype is None else dtype_name(model_dtype)
    return dtype_name(kv_cache_dtype)


def torch_dtype(name: Any) -> Any:
    """The torch dtype for a name (imports torch; call only where torch is needed)."""
    import torch

    return getattr(torch, dtype_name(name))
