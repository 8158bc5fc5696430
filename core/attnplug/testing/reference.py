"""A float64 reference for paged attention, independent of every backend.

It is written for clarity, not speed: one request and one query token at a
time, masks spelled out from positions. It never calls a backend, so a bug in
a backend cannot hide in the expected values.

Semantics (the contract every backend must match):

* K/V of a request: positions ``0 … prefix-1`` come from the cache *before*
  the forward (through ``req_to_token``), positions ``prefix …`` from the new
  ``k``/``v`` of this forward.
* Self-attention: a query at position ``p`` sees key ``j`` iff ``j <= p`` and,
  with a sliding window ``W``, ``j >= p - W``. In target-verify, draft token
  ``a`` sees the whole prefix and draft token ``b`` iff ``mask[a, b]``
  (causal when no mask is given); the window applies by position as well.
* Bidirectional self-attention (``layer.causality == "bidirectional"``): a
  query at position ``p`` sees every key ``j`` of its request (cached and
  new), and with a window ``W`` only ``|p - j| <= W``.
* Cross-attention: a query sees the ``encoder_lens[i]`` cached keys at
  positions ``0 …`` without a causal mask; nothing is written.
* Scores are ``scaling * q·k``, then ``cap * tanh(s / cap)`` with a soft-cap;
  a sink adds ``exp(sink[h])`` to the softmax denominator only.
* Query head ``h`` uses KV head ``h // (num_heads // num_kv_heads)``.
* A query row with no visible key (cross-attention over an empty encoder, a
  target-verify mask row hiding every draft of a request with no prefix) has
  output **zero** (with or without sinks: a sink adds no value).
* Only the K/V of slots a request owns (``req_to_token[r, :prefix]``, or
  ``:encoder_lens[i]`` for cross-attention) and the new ``k``/``v`` are read;
  the ``out_cache_loc`` slots are never read (with ``save_kv_cache=False``
  they hold stale values). Whatever any other slot holds (NaN, +inf) cannot
  reach the output. Garbage in a key or value a row *does* read (visible: owned, inside its
  window, not hidden by causality or the target-verify mask) makes that row's output non-finite
  (NaN or inf), never zero: the oracle exposes what it should, it does not hide it.
* Masking selects, never multiplies by zero: a hidden key's score is ``-inf`` whatever ``q·k``
  gave, and a hidden key's value contributes exactly nothing, NaN/inf included. This holds for
  this forward's new tokens (a later token is hidden from an earlier one; a draft the
  target-verify mask hides) as for cached slots.
* The custom mask is read in target-verify only; any other mode ignores a
  ``spec_custom_mask`` it carries.
* An fp8 KV cache (``k_cache``/``v_cache`` in ``float8_e4m3fn``/``float8_e5m2``)
  holds stored values: a key is ``stored * k_scale``, a value ``stored * v_scale``.
  The new ``k``/``v`` of the forward are read as the cache stores them too
  (quantized with the same scales: ``kvcache.quantize``), whether or not the
  forward saves them, as the kernels that read new tokens from the cache do.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..dtypes import FP8_DTYPES
from ..kvcache import quantize
from ..modes import ForwardMode


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    layer: Any,
    batch: Any,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Expected output ``[tokens, num_heads, v_head_dim]`` in float64.

    ``k_cache``/``v_cache`` are this layer's buffers as they were *before* the
    forward (``[slots, kv_heads, dim]``, token-major: ``PagedKVCache.read_kv``);
    ``k_scale``/``v_scale`` are the layer's scales when they hold fp8 values.
    """
    mode = batch.forward_mode
    H, Dv = layer.num_heads, layer.v_head_dim
    if mode is ForwardMode.IDLE:
        return torch.zeros(0, H, Dv, dtype=torch.float64)
    group = layer.num_heads // layer.num_kv_heads
    seq = batch.seq_lens.tolist()
    prefix = [s - 1 for s in seq] if mode is ForwardMode.DECODE else batch.extend_prefix_lens.tolist()
    ext = [1] * len(seq) if mode is ForwardMode.DECODE else batch.extend_seq_lens.tolist()
    reqs = batch.req_pool_indices.tolist()
    q64 = q.detach().to(torch.float64).cpu()
    kc, vc = k_cache.detach().cpu(), v_cache.detach().cpu()
    fp8 = str(kc.dtype).replace("torch.", "") in FP8_DTYPES
    if fp8:  # stored values times the scales; new tokens as the cache would store them
        kc, vc = _f64(kc) * k_scale, _f64(vc) * v_scale
        if k is not None:
            k = _f64(quantize(k, k_scale, k_cache.dtype)) * k_scale
            v = _f64(quantize(v, v_scale, v_cache.dtype)) * v_scale  # type: ignore[arg-type]
    r2t = req_to_token.cpu()
    sinks = None if layer.sinks is None else torch.as_tensor(layer.sinks).detach().to(torch.float64).cpu()
    out = torch.zeros(q.shape[0], H, Dv, dtype=torch.float64)
    t0 = 0
    for i, r in enumerate(reqs):
        n_new, p0 = ext[i], prefix[i]
        # only the slots this request owns are read: garbage anywhere else cannot reach the answer
        if layer.is_cross_attention:
            n_keys = int(batch.encoder_lens[i])
            slots = r2t[r, :n_keys].long()
            keys, vals = _f64(kc[slots]), _f64(vc[slots])
        else:
            n_keys = p0 + n_new
            slots = r2t[r, :p0].long()
            keys, vals = _f64(kc[slots]), _f64(vc[slots])
            if n_new:
                keys = torch.cat([keys, _f64(k[t0:t0 + n_new])])
                vals = torch.cat([vals, _f64(v[t0:t0 + n_new])])
        mask_rows = None
        if mode is ForwardMode.TARGET_VERIFY and batch.spec_custom_mask is not None:
            mask_rows = batch.spec_custom_mask[i].cpu().bool()
        kpos = torch.arange(n_keys)
        Hkv, G = layer.num_kv_heads, group
        kt = keys.permute(1, 2, 0)  # [Hkv, D, n_keys]: query head h = kv * G + g uses KV head kv
        vt = vals.permute(1, 0, 2)  # [Hkv, n_keys, Dv]
        for a0 in range(0, n_new, _ROWS):  # a few query rows at a time: bounded memory on long prompts
            a1 = min(n_new, a0 + _ROWS)
            na = a1 - a0
            qpos = torch.arange(p0 + a0, p0 + a1)
            # keys outside [lo, hi) are hidden from every row of this chunk (causality, window): skipped
            lo, hi = 0, n_keys
            bidir = getattr(layer, "causality", "causal") == "bidirectional" and not layer.is_cross_attention
            if not layer.is_cross_attention:
                hi = min(n_keys, p0 + a1)
                if layer.sliding_window is not None:
                    lo = max(0, p0 + a0 - layer.sliding_window)
                if bidir:  # keys after the query too: all of them, or up to the window past the last row
                    hi = n_keys if layer.sliding_window is None else min(n_keys, p0 + a1 + layer.sliding_window)
            kp = kpos[lo:hi]
            if layer.is_cross_attention:
                visible = torch.ones(na, hi - lo, dtype=torch.bool)
            else:
                visible = kp[None, :] <= qpos[:, None]
                if bidir:
                    visible = torch.ones_like(visible)
                    if layer.sliding_window is not None:
                        visible &= kp[None, :] <= qpos[:, None] + layer.sliding_window
                if layer.sliding_window is not None:
                    visible &= kp[None, :] >= qpos[:, None] - layer.sliding_window
                if mask_rows is not None:
                    visible &= torch.cat([torch.ones(na, max(0, p0 - lo), dtype=torch.bool),
                                          mask_rows[a0:a1, max(0, lo - p0):hi - p0]], dim=1)
            n = hi - lo
            qg = q64[t0 + a0:t0 + a1].reshape(na, Hkv, G, -1).permute(1, 0, 2, 3).reshape(Hkv, na * G, -1)
            s = (layer.scaling * torch.bmm(qg, kt[:, :, lo:hi])).view(Hkv, na, G, n)
            if layer.logit_cap:
                s = layer.logit_cap * torch.tanh(s / layer.logit_cap)
            s = s.masked_fill(~visible[None, :, None, :], -math.inf)
            m = s.amax(dim=3) if n else torch.full((Hkv, na, G), -math.inf, dtype=torch.float64)
            sk = None
            if sinks is not None:
                sk = sinks.view(Hkv, 1, G)
                m = torch.maximum(m, sk)
            # a row with no visible key (max -inf): any finite shift. A +inf or NaN maximum (garbage
            # the row really reads) stays, so the row's output is non-finite: the oracle exposes it
            m = torch.where(m == -math.inf, torch.zeros_like(m), m)
            w = torch.exp(s - m[..., None])  # hidden keys: exp(-inf) = 0
            denom = w.sum(dim=3)
            if sk is not None:
                denom = denom + torch.exp(sk - m)
            vv = vt[:, lo:hi]
            odd = ~torch.isfinite(vv).all(dim=2).all(dim=0)  # keys with a non-finite value: [n]
            if bool(odd.any()):
                # select, never multiply by zero: a hidden key's NaN/Inf value must not reach a row
                # (0 * NaN is NaN), a visible one's must (garbage the row really reads)
                clean = torch.where(torch.isfinite(vv), vv, torch.zeros((), dtype=vv.dtype))
                num = torch.bmm(w.reshape(Hkv, na * G, n), clean).view(Hkv, na, G, Dv)
                for j in odd.nonzero().flatten().tolist():
                    term = w[..., j, None] * vv[:, j][:, None, None, :]  # [Hkv, na, G, Dv]
                    num = num + torch.where(visible[None, :, j, None, None], term, torch.zeros((), dtype=term.dtype))
            else:
                num = torch.bmm(w.reshape(Hkv, na * G, n), vv).view(Hkv, na, G, Dv)
            # no visible key (empty encoder, a verify row hiding everything): the output is zero. A NaN
            # denominator (a NaN/inf score of a key the row reads) is not "no key": it stays NaN
            o = torch.where(denom[..., None] == 0, torch.zeros_like(num), num / denom[..., None])
            out[t0 + a0:t0 + a1] = o.permute(1, 0, 2, 3).reshape(na, H, Dv)
        t0 += n_new
    return out


_ROWS = 256


def _f64(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(torch.float64).cpu()


def expected_cache_after(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
    out_cache_loc: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's buffers after a forward that saves ``k``/``v`` at ``out_cache_loc`` (in cache dtype;
    quantized with ``k_scale``/``v_scale`` for an fp8 cache)."""
    kc, vc = k_cache.clone(), v_cache.clone()
    if k is not None and v is not None and k.shape[0]:
        if str(kc.dtype).replace("torch.", "") in FP8_DTYPES:
            k, v = quantize(k, k_scale, kc.dtype), quantize(v, v_scale, vc.dtype)
        for t, slot in enumerate(out_cache_loc.tolist()):
            kc[slot] = k[t].to(kc.dtype)
            vc[slot] = v[t].to(vc.dtype)
    return kc, vc




# -- MLA (docs/mla.md) -------------------------------------------------------------------------------
def _mla_rows(latent: torch.Tensor, scale: float, cache_dtype: torch.dtype | None) -> torch.Tensor:
    """Latent rows as float64 values: fp8 rows dequantized (stored x scale); ``cache_dtype`` set: the new
    rows as an fp8 cache stores them (quantized with the same scale, then dequantized)."""
    if cache_dtype is not None and str(cache_dtype).replace("torch.", "") in FP8_DTYPES:
        latent = quantize(latent, scale, cache_dtype)
    if str(latent.dtype).replace("torch.", "") in FP8_DTYPES:
        return _f64(latent) * scale
    return _f64(latent)


def mla_decompress(rows: torch.Tensor, layer: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head keys ``[n, H, qk_nope + qk_rope]`` and values ``[n, H, v_head_dim]`` (float64) of latent
    rows ``[n, 1, kv_lora_rank + qk_rope]``: head ``h``'s key is ``[c_kv @ w_kc[h]^T, k_pe]``, its value
    ``c_kv @ w_vc[h]``. Rows holding NaN/inf give non-finite keys/values (never hidden)."""
    m = layer.mla
    r = rows.reshape(rows.shape[0], -1).to(torch.float64)
    c_kv, k_pe = r[:, :m.kv_lora_rank], r[:, m.kv_lora_rank:]
    w_kc = _f64(torch.as_tensor(m.w_kc))  # [H, nope, lora]
    w_vc = _f64(torch.as_tensor(m.w_vc))  # [H, lora, v]
    k_nope = torch.einsum("nl,hdl->nhd", c_kv, w_kc)
    keys = torch.cat([k_nope, k_pe[:, None, :].expand(-1, layer.num_heads, -1)], dim=2)
    vals = torch.einsum("nl,hlv->nhv", c_kv, w_vc)
    return keys, vals


def reference_mla(
    q: torch.Tensor,
    latent: torch.Tensor | None,
    layer: Any,
    batch: Any,
    latent_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    scale: float = 1.0,
) -> torch.Tensor:
    """Expected output of MLA ``layer`` (``LayerSpec.mla``) in float64, in the form ``batch.mla_form``.

    ``latent`` is the new tokens' latent rows ``[T, 1, kv_lora_rank + qk_rope]``; ``latent_cache`` the
    layer's rows before the forward (``PagedKVCache.read_latent``), fp8 with ``scale`` (the one latent
    scale; the new rows are read as the cache stores them, as for fp8 KV).

    * absorbed: ``q [T, H, kv_lora_rank + qk_rope]``; MQA over the latent rows, the values are their
      first ``kv_lora_rank`` entries: output ``[T, H, kv_lora_rank]``;
    * unabsorbed: ``q [T, H, qk_nope + qk_rope]``; every row read is decompressed per head
      (``mla_decompress``) and attended like multi-head attention with ``v_head_dim != head_dim``:
      output ``[T, H, mla.v_head_dim]``.

    Scores use ``layer.scaling`` in both forms; masks, garbage and empty rows as ``reference_attention``.
    """
    import dataclasses

    m = layer.mla
    cache_dtype = latent_cache.dtype
    kc = _mla_rows(latent_cache.detach().cpu(), scale, None)
    new = None if latent is None else _mla_rows(latent.detach().cpu(), scale, cache_dtype)
    if batch.mla_form == "absorbed":
        shadow = dataclasses.replace(layer, mla=None, v_head_dim=m.kv_lora_rank) if dataclasses.is_dataclass(
            layer) else layer
        return reference_attention(
            q, new, None if new is None else new[..., :m.kv_lora_rank], shadow, batch,
            kc, kc[..., :m.kv_lora_rank], req_to_token)
    # unabsorbed: decompress only the rows a request owns (garbage elsewhere never reaches the output)
    H, Dqk, Dv = layer.num_heads, m.qk_head_dim, m.v_head_dim
    keys = torch.zeros(kc.shape[0], H, Dqk, dtype=torch.float64)
    vals = torch.zeros(kc.shape[0], H, Dv, dtype=torch.float64)
    mode = batch.forward_mode
    seq = batch.seq_lens.tolist()
    prefix = [s - 1 for s in seq] if mode is ForwardMode.DECODE else batch.extend_prefix_lens.tolist()
    r2t = req_to_token.cpu()
    owned = [r2t[r, :p].long() for r, p in zip(batch.req_pool_indices.tolist(), prefix) if p]
    if owned:
        slots = torch.unique(torch.cat(owned))
        keys[slots], vals[slots] = mla_decompress(kc[slots], layer)
    nk = nv = None
    if new is not None:
        nk, nv = mla_decompress(new, layer)
    shadow = _MLAShadow(layer.layer_id, H, H, Dqk, Dv, layer.scaling)
    return reference_attention(q, nk, nv, shadow, batch, keys, vals, req_to_token)


class _MLAShadow:
    """The unabsorbed form as the plain multi-head layer ``reference_attention`` computes."""

    def __init__(self, layer_id: int, num_heads: int, num_kv_heads: int, head_dim: int, v_head_dim: int,
                 scaling: float) -> None:
        self.layer_id, self.num_heads, self.num_kv_heads = layer_id, num_heads, num_kv_heads
        self.head_dim, self.v_head_dim, self.scaling = head_dim, v_head_dim, scaling
        self.logit_cap = None
        self.sliding_window = None
        self.sinks = None
        self.is_cross_attention = False
        self.causality = "causal"
        self.mla = None


def expected_latent_after(latent_cache: torch.Tensor, latent: torch.Tensor | None, out_cache_loc: torch.Tensor,
                          scale: float = 1.0) -> torch.Tensor:
    """A latent layer's rows after a forward that saves ``latent`` at ``out_cache_loc`` (cache dtype)."""
    return expected_cache_after(latent_cache, latent_cache[..., :0], latent,
                                None if latent is None else latent[..., :0], out_cache_loc, scale, scale)[0]
