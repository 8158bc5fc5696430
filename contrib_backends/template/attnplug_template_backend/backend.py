"""Kernel module of ``template_sdpa``: imported only when the backend is built.

A deliberately simple, correct implementation: one request at a time, K/V
gathered from the paged cache through ``req_to_token``, masks built from
positions, ``torch.nn.functional.scaled_dot_product_attention`` for the math.
Replace the loop with your kernel library; keep the protocol.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from attnplug import AttentionBackend, BuildContext, MetadataGuard, NotSupportedError
from attnplug.batch import check_qkv

from . import CAPABILITIES, NAME


class _Request(NamedTuple):
    row: int  # row in req_to_token
    prefix: int  # cached tokens before this forward
    new: int  # tokens in this forward
    start: int  # offset of its first token in q/k/v


class TemplateSDPABackend(AttentionBackend):
    capabilities = CAPABILITIES

    def __init__(self, ctx: BuildContext) -> None:
        if ctx.kv_cache is None:
            raise ValueError(f"{NAME} needs BuildContext.kv_cache (got None)")
        self.kv_cache = ctx.kv_cache
        self._meta = MetadataGuard(NAME)

    # once per forward, shared by every layer
    def init_forward_metadata(self, batch: Any) -> None:
        requests, start = [], 0
        rows = batch.req_pool_indices.tolist()
        for row, prefix, new in zip(rows, batch.extend_prefix_lens_cpu, batch.extend_seq_lens_cpu):
            requests.append(_Request(row, prefix, new, start))
            start += new
        self._meta.set(batch, requests)

    def forward_extend(self, q: Any, k: Any, v: Any, layer: Any, batch: Any, save_kv_cache: bool = True) -> Any:
        return self._attend(q, k, v, layer, batch, save_kv_cache)

    def forward_decode(self, q: Any, k: Any, v: Any, layer: Any, batch: Any, save_kv_cache: bool = True) -> Any:
        return self._attend(q, k, v, layer, batch, save_kv_cache)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: Any, batch: Any,
                save_kv_cache: bool) -> torch.Tensor:
        requests = self._meta.require(batch)
        check_qkv(q, k, v, layer, batch.num_tokens)
        reasons = self.not_supported_reasons(layer)
        if reasons:
            raise NotSupportedError(NAME, reasons)
        if k is None:
            raise NotSupportedError(NAME, ["k/v are required (cross-attention is not claimed)"])
        if save_kv_cache:
            self.kv_cache.set_kv(layer.layer_id, batch.out_cache_loc, k, v)
        k_cache, v_cache = self.kv_cache.get_kv(layer.layer_id)
        group = layer.num_heads // layer.num_kv_heads
        out = q.new_empty(q.shape[0], layer.num_heads, layer.v_head_dim)
        for i, r in enumerate(requests):
            if r.new == 0:
                continue
            new = slice(r.start, r.start + r.new)
            slots = self.kv_cache.req_to_token[r.row, : r.prefix]
            keys = torch.cat([k_cache[slots].to(q.dtype), k[new]])  # [n, kv_heads, d]
            vals = torch.cat([v_cache[slots].to(q.dtype), v[new]])
            mask = self._mask(r, layer, batch, i, q.device)
            o = F.scaled_dot_product_attention(
                q[new].transpose(0, 1),  # [heads, new, d]
                keys.repeat_interleave(group, dim=1).transpose(0, 1),
                vals.repeat_interleave(group, dim=1).transpose(0, 1),
                attn_mask=mask,
                scale=layer.scaling,
            )
            out[new] = o.transpose(0, 1)
        return out

    @staticmethod
    def _mask(r: _Request, layer: Any, batch: Any, i: int, device: Any) -> torch.Tensor:
        """``[new, prefix+new]`` bool: query ``a`` (position ``prefix+a``) may see key ``j``."""
        qpos = torch.arange(r.prefix, r.prefix + r.new, device=device)[:, None]
        kpos = torch.arange(r.prefix + r.new, device=device)[None, :]
        mask = kpos <= qpos
        if layer.sliding_window is not None:
            mask &= kpos >= qpos - layer.sliding_window
        if batch.forward_mode.is_target_verify() and batch.spec_custom_mask is not None:
            drafts = torch.ones(r.new, r.prefix + r.new, dtype=torch.bool, device=device)
            drafts[:, r.prefix:] = batch.spec_custom_mask[i].to(device=device, dtype=torch.bool)
            mask &= drafts
        return mask


def create(ctx: BuildContext) -> tuple[str, TemplateSDPABackend]:
    """The factory named by the descriptor: returns ``(effective_name, backend)``."""
    return NAME, TemplateSDPABackend(ctx)
