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
* Cross-attention: a query sees the ``encoder_lens[i]`` cached keys at
  positions ``0 …`` without a causal mask; nothing is written.
* Scores are ``scaling * q·k``, then ``cap * tanh(s / cap)`` with a soft-cap;
  a sink adds ``exp(sink[h])`` to the softmax denominator only.
* Query head ``h`` uses KV head ``h // (num_heads // num_kv_heads)``.
"""

from __future__ import annotations

from typing import Any

import torch

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
) -> torch.Tensor:
    """Expected output ``[tokens, num_heads, v_head_dim]`` in float64.

    ``k_cache``/``v_cache`` are this layer's buffers as they were *before* the
    forward (``[slots, kv_heads, dim]``).
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
    kc, vc = k_cache.detach().to(torch.float64).cpu(), v_cache.detach().to(torch.float64).cpu()
    r2t = req_to_token.cpu()
    sinks = None if layer.sinks is None else torch.as_tensor(layer.sinks).detach().to(torch.float64).cpu()
    out = torch.zeros(q.shape[0], H, Dv, dtype=torch.float64)
    t0 = 0
    for i, r in enumerate(reqs):
        n_new, p0 = ext[i], prefix[i]
        if layer.is_cross_attention:
            enc = int(batch.encoder_lens[i])
            slots = r2t[r, :enc].long()
            keys, vals = kc[slots], vc[slots]
            key_pos = list(range(enc))
        else:
            slots = r2t[r, :p0].long()
            keys, vals = kc[slots], vc[slots]
            if n_new:
                keys = torch.cat([keys, k[t0:t0 + n_new].detach().to(torch.float64).cpu()])
                vals = torch.cat([vals, v[t0:t0 + n_new].detach().to(torch.float64).cpu()])
            key_pos = list(range(p0 + n_new))
        mask_rows = None
        if mode is ForwardMode.TARGET_VERIFY and batch.spec_custom_mask is not None:
            mask_rows = batch.spec_custom_mask[i].cpu().bool()
        for a in range(n_new):
            p = p0 + a
            visible = []
            for j in key_pos:
                if layer.is_cross_attention:
                    visible.append(j)
                    continue
                if j > p:
                    continue
                if layer.sliding_window is not None and j < p - layer.sliding_window:
                    continue
                if mask_rows is not None and j >= p0 and not bool(mask_rows[a, j - p0]):
                    continue
                visible.append(j)
            if not visible:
                continue  # no visible key (empty encoder): the output stays zero
            vis = torch.tensor(visible, dtype=torch.long)
            kv_heads = torch.arange(H) // group
            kk, vv = keys[vis][:, kv_heads], vals[vis][:, kv_heads]  # [n, H, D]
            s = layer.scaling * torch.einsum("hd,nhd->hn", q64[t0 + a], kk)
            if layer.logit_cap:
                s = layer.logit_cap * torch.tanh(s / layer.logit_cap)
            m = s.max(dim=1).values
            if sinks is not None:
                m = torch.maximum(m, sinks)
            w = torch.exp(s - m[:, None])
            denom = w.sum(dim=1)
            if sinks is not None:
                denom = denom + torch.exp(sinks - m)
            out[t0 + a] = torch.einsum("hn,nhd->hd", w, vv) / denom[:, None]
        t0 += n_new
    return out


def expected_cache_after(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, out_cache_loc: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's buffers after a forward that saves ``k``/``v`` at ``out_cache_loc`` (in cache dtype)."""
    kc, vc = k_cache.clone(), v_cache.clone()
    if k is not None and k.shape[0]:
        for t, slot in enumerate(out_cache_loc.tolist()):
            kc[slot] = k[t].to(kc.dtype)
            vc[slot] = v[t].to(vc.dtype)
    return kc, vc


