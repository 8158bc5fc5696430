"""Kernels of the outside backends: one attention computation, written twice.

``OutsideV01`` is how the backend was written against conformance level 0.1
(everything level 0.1 checks, nothing more). ``OutsidePaged`` is the upgrade
the level-0.2 failure messages describe, and nothing else changed.
"""

from __future__ import annotations

from typing import Any

import torch

from attnplug import AttentionBackend, PagedBackend, ShapeError
from attnplug.backend import MetadataGuard
from attnplug.batch import check_qkv

from . import CAPABILITIES


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, layer: Any, qpos: torch.Tensor,
            visible_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of ``q`` [e, H, d] at positions ``qpos`` over ``keys``/``values`` [L, KVH, d]
    (position = index); keys at or past ``visible_len`` are masked. The probabilities [H, e, L] and the
    values [L, H, dv], in float32."""
    group = layer.gqa_group_size
    kk = keys.float().repeat_interleave(group, dim=1)
    vv = values.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), kk) * layer.scaling
    kpos = torch.arange(keys.shape[0])[None, :]
    visible = (kpos <= qpos[:, None]) & (kpos < visible_len)
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    return probs, vv


class OutsideV01(AttentionBackend):
    """Written against level 0.1: its own bounds check, write first, keys read back through req_to_token
    padded to the longest request, padding masked by a zero probability (multiplied)."""

    capabilities = CAPABILITIES

    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx
        self.cache = ctx.kv_cache
        self._meta = MetadataGuard("outside_v01")

    def init_forward_metadata(self, batch: Any) -> None:
        self._meta.set(batch, None)

    def forward_extend(self, q, k, v, layer, batch, save_kv_cache=True):  # type: ignore[no-untyped-def]
        return self._forward(q, k, v, layer, batch, save_kv_cache)

    def forward_decode(self, q, k, v, layer, batch, save_kv_cache=True):  # type: ignore[no-untyped-def]
        return self._forward(q, k, v, layer, batch, save_kv_cache)

    def _forward(self, q, k, v, layer, batch, save_kv_cache):  # type: ignore[no-untyped-def]
        self._meta.require(batch)
        check_qkv(q, k, v, layer, batch.num_tokens)
        cache = self.cache
        n = cache.num_slots
        for i, slot in enumerate(batch.out_cache_loc.tolist()):
            if not 0 <= slot < n:
                raise ShapeError(f"loc[{i}]={slot} is out of range [0, {n})")
        kbuf, vbuf = cache.k_buffers[layer.layer_id], cache.v_buffers[layer.layer_id]
        if save_kv_cache:
            kbuf[batch.out_cache_loc] = k
            vbuf[batch.out_cache_loc] = v
        out = q.new_zeros(batch.num_tokens, layer.num_heads, layer.v_head_dim)
        longest = max(batch.seq_lens_cpu)
        table = cache.req_to_token[batch.req_pool_indices][:, :longest].clamp(min=0)
        keys, values = kbuf[table], vbuf[table]  # [B, longest, KVH, d]: every request padded to the longest
        start = 0
        for i, (p, e, s) in enumerate(zip(batch.extend_prefix_lens_cpu, batch.extend_seq_lens_cpu,
                                          batch.seq_lens_cpu)):
            if e:
                probs, vv = _attend(q[start:start + e], keys[i], values[i], layer, torch.arange(p, p + e), s)
                out[start:start + e] = torch.einsum("hqk,khd->qhd", probs, vv).to(q.dtype)
            start += e
        return out


class OutsidePaged(PagedBackend):
    """The upgrade: PagedBackend does the checks, the refusal and the KV write; the compute reads only the
    slots a request owns (``read_kv``), takes the new K/V from its arguments, and masks by selecting."""

    capabilities = CAPABILITIES
    backend_name = "outside_paged"
    new_kv_source = "args"

    def compute_extend(self, q, k, v, layer, batch, meta):  # type: ignore[no-untyped-def]
        out = q.new_zeros(batch.num_tokens, layer.num_heads, layer.v_head_dim)
        start = 0
        for r, p, e in zip(batch.req_pool_indices_cpu, batch.extend_prefix_lens_cpu, batch.extend_seq_lens_cpu):
            if e:
                ck, cv = self.cache.read_kv(layer.layer_id, self.cache.req_to_token[r, :p])
                keys = torch.cat([ck, k[start:start + e]])
                values = torch.cat([cv, v[start:start + e]])
                for i in range(e):  # each query over exactly the keys it sees: a hidden key is never read
                    n = p + i + 1
                    probs, vv = _attend(q[start + i:start + i + 1], keys[:n], values[:n], layer,
                                        torch.tensor([p + i]), n)
                    out[start + i] = torch.einsum("hqk,khd->qhd", probs, vv)[0].to(q.dtype)
            start += e
        return out


def create_v01(ctx: Any) -> tuple[str, OutsideV01]:
    return "outside_v01", OutsideV01(ctx)


def create_paged(ctx: Any) -> tuple[str, OutsidePaged]:
    return "outside_paged", OutsidePaged(ctx)
