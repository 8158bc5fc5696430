"""Per-dtype tolerances of the conformance suite, stated in one place.

A backend output ``out`` passes against the float64 reference ``ref`` when,
element-wise, ``|out - ref| <= atol + rtol * |ref|``. The inputs (q, k, v and
the cached K/V) are drawn in the case's dtype and the reference computes on
exactly those rounded values in float64, so the tolerance only has to absorb
the backend's own arithmetic: accumulation order, and for 16-bit dtypes the
rounding of scores, probabilities and the output.

KV-cache writes, repeated forwards of a backend that claims ``deterministic``
and batch invariance are compared bit for bit (tolerance 0).

An fp8 KV cache uses the model dtype's tolerance: the reference reads exactly
the stored values × scales (new tokens quantized as stored), so quantization
error never enters the comparison (docs/conformance.md, "Tolerances").

Imports nothing heavy: the pytest plugin and the docs read this module.
"""

from __future__ import annotations

import dataclasses

__all__ = ["EXACT", "TOLERANCES", "Tolerance", "tolerance_for"]


@dataclasses.dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float

    def bound(self, ref_abs: float) -> float:
        return self.atol + self.rtol * ref_abs

    def to_dict(self) -> dict[str, float]:
        return {"atol": self.atol, "rtol": self.rtol}


#: dtype name -> tolerance of attention outputs against the float64 reference.
TOLERANCES: dict[str, Tolerance] = {
    "float32": Tolerance(atol=1e-4, rtol=1e-4),
    "float16": Tolerance(atol=5e-3, rtol=5e-3),
    "bfloat16": Tolerance(atol=4e-2, rtol=2e-2),
}

#: Comparisons that must be exact (KV-cache contents, determinism, batch invariance).
EXACT = Tolerance(atol=0.0, rtol=0.0)


def tolerance_for(dtype: str, kv_cache_dtype: str | None = None) -> Tolerance:
    """The tolerance for a model ``dtype`` (and a KV cache in ``kv_cache_dtype``):
    the looser of the two when they differ."""
    try:
        tol = TOLERANCES[dtype]
    except KeyError:
        raise KeyError(f"no conformance tolerance for dtype {dtype!r} (known: {', '.join(TOLERANCES)})") from None
    if kv_cache_dtype and kv_cache_dtype != dtype and kv_cache_dtype in TOLERANCES:
        other = TOLERANCES[kv_cache_dtype]
        tol = Tolerance(max(tol.atol, other.atol), max(tol.rtol, other.rtol))
    return tol
