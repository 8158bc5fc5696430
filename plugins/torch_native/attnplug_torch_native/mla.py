"""torch_native's MLA layers (docs/mla.md), both forms, in eager PyTorch.

Kept apart from the ordinary attention kernels of ``backend.py`` (which calls ``compute_mla`` here):
one request and one bounded chunk of query rows at a time, float32 arithmetic whatever the model
dtype, the cached latent rows gathered (and dequantized for an fp8 latent cache) only where the
request owns them.

* absorbed: ``q [T, H, kv_lora_rank + qk_rope]`` against the request's latent rows (MQA: one row per
  key, shared by every head), values = the rows' first ``kv_lora_rank`` entries; output
  ``[T, H, kv_lora_rank]``;
* unabsorbed: the rows are decompressed per head (key ``[c_kv @ w_kc[h]^T, k_pe]``, value
  ``c_kv @ w_vc[h]``) and attended with ``q [T, H, qk_nope + qk_rope]``; output ``[T, H, v_head_dim]``.

Masking selects: a hidden key's score is ``-inf``; a non-finite value row is zeroed for the matmul and
the output rows of every query that sees it are set to NaN (garbage a row reads is exposed, garbage it
does not read never reaches it). This forward's new rows are read as an fp8 cache stores them.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from attnplug import ForwardMode

_F32 = torch.float32
#: query rows attended at once (bounds the ``[H, rows, keys]`` score block)
ROWS = 256


def _weights(store: dict[Any, Any], layer: Any, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``w_kc`` / ``w_vc`` of ``layer`` as float32 on ``device``, converted once per weight object."""
    m = layer.mla
    key = (id(m.w_kc), id(m.w_vc), device)
    hit = store.get(key)
    if hit is None or hit[0] is not m.w_kc or hit[1] is not m.w_vc:
        hit = store[key] = (m.w_kc, m.w_vc, torch.as_tensor(m.w_kc).detach().to(device=device, dtype=_F32),
                            torch.as_tensor(m.w_vc).detach().to(device=device, dtype=_F32))
    return hit[2], hit[3]


def compute_mla(backend: Any, q: torch.Tensor, latent: torch.Tensor, layer: Any, batch: Any,
                weights: dict[Any, Any]) -> torch.Tensor:
    """``PagedBackend.compute_mla`` of torch_native (see the module docstring)."""
    cache = backend.cache
    m = layer.mla
    absorbed = batch.mla_form == "absorbed"
    H, L = layer.num_heads, m.kv_lora_rank
    out = q.new_empty((q.shape[0], H, layer.output_dim(batch.mla_form)))
    lid = layer.layer_id
    # the new rows as the cache stores them (fp8: quantized with the layer's scale, then dequantized)
    if cache.quantized:
        new = cache.dequantize(lid, *cache.quantize(lid, latent, latent[..., :0]))[0]
    else:
        new = latent
    new = new.reshape(new.shape[0], -1).to(_F32)
    scale = cache.k_scales[lid] if cache.quantized else None
    storage = cache.layer_storage(lid)[0] if cache.layout.name == "nhd" else None
    w_kc = w_vc = None
    if not absorbed:
        w_kc, w_vc = _weights(weights, layer, q.device)
    decode = batch.forward_mode is ForwardMode.DECODE
    verify_mask = batch.spec_custom_mask if batch.forward_mode is ForwardMode.TARGET_VERIFY else None
    r2t = cache.req_to_token
    t0 = 0
    for i, r in enumerate(batch.req_pool_indices_cpu):
        p0 = batch.seq_lens_cpu[i] - 1 if decode else batch.extend_prefix_lens_cpu[i]
        n = 1 if decode else batch.extend_seq_lens_cpu[i]
        if n == 0:
            continue
        slots = r2t[r, :p0]
        if storage is not None:
            rows = storage.index_select(0, slots).reshape(p0, layer.head_dim)
        else:
            rows = cache.read_latent(lid, slots).reshape(p0, layer.head_dim)
        rows = rows.to(_F32)
        if scale is not None:
            rows = rows * scale
        rows = torch.cat([rows, new[t0:t0 + n]])  # [p0 + n, L + R]
        if absorbed:
            keys = rows[None]  # [1, nk, L + R]: every head reads the same rows
            vals = rows[None, :, :L]
        else:
            c_kv, k_pe = rows[:, :L], rows[:, L:]
            k_nope = torch.einsum("nl,hdl->hnd", c_kv, w_kc)
            keys = torch.cat([k_nope, k_pe[None].expand(H, -1, -1)], dim=2)  # [H, nk, nope + rope]
            vals = torch.einsum("nl,hlv->hnv", c_kv, w_vc)  # [H, nk, v]
        bad = ~torch.isfinite(vals).all(dim=2).all(dim=0)  # [nk]: keys with a non-finite value
        any_bad = bool(bad.any())
        if any_bad:
            vals = torch.where(torch.isfinite(vals), vals, torch.zeros((), dtype=_F32))
        qi = q[t0:t0 + n].to(_F32).transpose(0, 1)  # [H, n, D]
        mask_i = None if verify_mask is None else verify_mask[i].to(torch.bool)
        for a0 in range(0, n, ROWS):
            a1 = min(n, a0 + ROWS)
            hi = p0 + a1  # keys past the last row's position are hidden from every row of the chunk
            s = torch.matmul(qi[:, a0:a1], keys[:, :hi].transpose(1, 2)) * layer.scaling  # [H, na, hi]
            qpos = torch.arange(p0 + a0, p0 + a1, device=q.device)
            kpos = torch.arange(hi, device=q.device)
            visible = kpos[None, :] <= qpos[:, None]
            if mask_i is not None:
                draft = torch.ones_like(visible)
                draft[:, p0:] = mask_i[a0:a1, :hi - p0]
                visible &= draft
            s = s.masked_fill(~visible[None], -math.inf)
            mx = s.amax(dim=2, keepdim=True)
            mx = torch.where(mx == -math.inf, torch.zeros_like(mx), mx)
            w = torch.exp(s - mx)
            denom = w.sum(dim=2, keepdim=True)
            o = torch.matmul(w, vals[:, :hi].expand(H, -1, -1) if absorbed else vals[:, :hi])
            o = torch.where(denom == 0, torch.zeros_like(o), o / denom)
            if any_bad:  # a row that sees a non-finite value: exposed as NaN
                sees = (visible & bad[None, :hi]).any(dim=1)
                o[:, sees] = math.nan
            out[t0 + a0:t0 + a1] = o.transpose(0, 1).to(out.dtype)
        t0 += n
    return out
