"""One forward of a backend, checked: the forward-and-compare helper every kernel test shares.

``forward_and_check`` runs ``init_forward_metadata`` (unless told not to) and one ``forward`` of a
built backend over its paged cache, then checks what the conformance suite checks, with the same
reference and tolerances: the output's shape and dtype, the output against
``attnplug.testing.reference.reference_attention`` of the cache as it was before the forward within
``attnplug.testing.tolerances.tolerance_for`` (model dtype, KV dtype), the cache after the forward
against a write at ``out_cache_loc`` and nowhere else (``expected_cache_after``, byte for byte; no
write where ``save`` is off or the layer has no K/V), and ``req_to_token`` unchanged. The cache is
read through its layout (``read_kv``) with the layer's KV scales, so nhd, hnd and fp8 caches are
checked alike. Problem builders stay with their tests (each kernel test chooses its batches); this
is the one place a test's forward is compared.
"""

from __future__ import annotations

from typing import Any

import torch

from attnplug.dtypes import dtype_name
from attnplug.testing.reference import expected_cache_after, reference_attention
from attnplug.testing.suite.harness import same_bytes
from attnplug.testing.tolerances import Tolerance, tolerance_for


def forward_and_check(backend: Any, cache: Any, layer: Any, batch: Any, q: torch.Tensor, k: torch.Tensor | None,
                      v: torch.Tensor | None, *, dtype: torch.dtype, save: bool = True,
                      init: bool = True, tol: Tolerance | None = None) -> torch.Tensor:
    """``backend.forward(q, k, v, layer, batch)`` over ``cache``, checked against the float64 reference
    (module docstring); returns the output. ``dtype``: the model dtype the output must have; ``tol``: a
    tighter bound than the suite's where a test holds a kernel to one."""
    lid = layer.layer_id
    kc0, vc0 = cache.read_kv(lid)  # stored values, token-major, whatever the layout
    r2t = cache.req_to_token.clone()
    if init:
        backend.init_forward_metadata(batch)
    out = backend.forward(q, k, v, layer, batch, save_kv_cache=save)
    assert out.shape == (batch.num_tokens, layer.num_heads, layer.v_head_dim)
    assert out.dtype == dtype
    ks, vs = cache.kv_scales(lid)
    ref = reference_attention(q, k, v, layer, batch, kc0, vc0, cache.req_to_token, ks, vs)
    tol = tol or tolerance_for(dtype_name(dtype), dtype_name(cache.dtype))  # the suite's, stated in one place
    torch.testing.assert_close(out.double(), ref, atol=tol.atol, rtol=tol.rtol)
    kc1, vc1 = cache.read_kv(lid)
    writes = save and k is not None and not layer.is_cross_attention
    exp_k, exp_v = expected_cache_after(kc0, vc0, k, v, batch.out_cache_loc, ks, vs) if writes else (kc0, vc0)
    assert same_bytes(kc1, exp_k) and same_bytes(vc1, exp_v), "KV cache differs from a write at out_cache_loc only"
    assert torch.equal(cache.req_to_token, r2t), "the forward changed req_to_token"
    return out
