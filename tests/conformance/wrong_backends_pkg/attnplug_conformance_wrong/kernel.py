"""Kernels of the test-only backends: the float64 reference with one bug each.

``conf_reference`` is correct, robustness included: it validates everything
(claimed dtypes and mode, layer support, shapes, every index and length
against its bound) before it writes, then writes, then computes with the
reference, which reads only the slots a request owns. It is the control that
shows each suite case is right; each other backend changes one thing.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from attnplug import AttentionBackend, NotSupportedError, ShapeError
from attnplug.backend import MetadataGuard
from attnplug.batch import check_qkv
from attnplug.modes import ForwardMode
from attnplug.testing.reference import reference_attention

from . import CAPABILITIES, NARROW


def _dtype(t: Any) -> str:
    return str(t).replace("torch.", "")


class ReferenceBackend(AttentionBackend):
    capabilities = CAPABILITIES
    bug: str | None = None

    def __init__(self, name: str, ctx: Any) -> None:
        self.name = name
        self.cache = ctx.kv_cache
        self.meta = MetadataGuard(name)
        self._out: torch.Tensor | None = None
        #: below this the workspace bugs show (the suite's workspace family builds with a few KiB)
        self.small_workspace = getattr(ctx, "max_workspace_bytes", 4 << 30) < (1 << 20)

    def init_forward_metadata(self, batch: Any) -> None:
        self.meta.set(batch, None)

    def forward_extend(self, q, k, v, layer, batch, save_kv_cache=True):  # type: ignore[no-untyped-def]
        return self._forward(q, k, v, layer, batch, save_kv_cache)

    def forward_decode(self, q, k, v, layer, batch, save_kv_cache=True):  # type: ignore[no-untyped-def]
        return self._forward(q, k, v, layer, batch, save_kv_cache)

    # -- checks, all before any write ----------------------------------------
    def _validate(self, q: Any, k: Any, v: Any, layer: Any, batch: Any) -> None:
        caps, cache = self.capabilities, self.cache
        for what, dt in (("q/k/v", q.dtype), ("kv_cache", cache.dtype)):
            if _dtype(dt) not in (caps.dtypes if what == "q/k/v" else caps.kv_cache_dtypes):
                raise NotSupportedError(self.name, [f"{what} dtype={_dtype(dt)} (supported: {', '.join(caps.dtypes)})"])
        if not caps.supports_mode(batch.forward_mode):
            raise NotSupportedError(self.name, [f"forward mode {batch.forward_mode.value} is not claimed"])
        reasons = self.not_supported_reasons(layer)
        if reasons:
            raise NotSupportedError(self.name, reasons)
        check_qkv(q, k, v, layer, batch.num_tokens)
        if k is None and not layer.is_cross_attention:
            raise ShapeError(f"k and v are None for self-attention layer {layer.layer_id}")
        if self.bug == "no_bounds":
            return
        _in_range("layer_id", [layer.layer_id], cache.num_layers)
        rows, width = cache.req_to_token.shape
        _in_range("req_pool_indices", batch.req_pool_indices.tolist(), rows)
        _in_range("out_cache_loc", batch.out_cache_loc.tolist(), cache.num_slots)
        lens = batch.encoder_lens.tolist() if layer.is_cross_attention else batch.seq_lens_cpu
        for i, (r, n) in enumerate(zip(batch.req_pool_indices.tolist(), lens)):
            if n > width:
                raise ShapeError(f"request {i}: seq_len {n} exceeds the req_to_token width {width}")
            # the new tokens' positions may not be mapped yet: check the cached positions only
            cached = n if layer.is_cross_attention else batch.extend_prefix_lens_cpu[i]
            _in_range(f"req_to_token[{r}] (request {i})", cache.req_to_token[r, :cached].tolist(), cache.num_slots)

    def _forward(self, q, k, v, layer, batch, save_kv_cache):  # type: ignore[no-untyped-def]
        self.meta.require(batch)
        if self.bug == "write_first" and save_kv_cache and k is not None and not layer.is_cross_attention:
            self.cache.set_kv(layer.layer_id, batch.out_cache_loc, k, v)
        self._validate(q, k, v, layer, batch)
        kc, vc = self.cache.get_kv(layer.layer_id)
        seen, seen_batch = layer, batch
        if self.bug == "scale":
            seen = dataclasses.replace(layer, scaling=1.0)
        elif self.bug == "default_scale":
            seen = dataclasses.replace(layer, scaling=None)  # ignores the layer's scaling
        elif self.bug == "window":
            seen = dataclasses.replace(layer, sliding_window=None)
        elif self.bug == "sinks":
            seen = dataclasses.replace(layer, sinks=None)
        elif self.bug == "mask_everywhere" and batch.spec_custom_mask is not None:
            seen_batch = dataclasses.replace(batch, forward_mode=ForwardMode.TARGET_VERIFY)
        new_k, new_v = k, v
        if self.bug == "new_from_cache" and k is not None:
            # reads the new tokens back through req_to_token instead of from k/v
            slots = _new_positions_slots(batch, self.cache.req_to_token)
            new_k, new_v = kc[slots].to(k.dtype), vc[slots].to(v.dtype)
        if save_kv_cache and k is not None and not layer.is_cross_attention and self.bug != "write_first":
            loc = batch.out_cache_loc
            if self.bug == "kv_slot":
                loc = (loc + 1) % self.cache.num_slots
            self.cache.set_kv(layer.layer_id, loc, k, v)
        if self.bug == "new_from_cache" and k is not None and save_kv_cache:
            slots = _new_positions_slots(batch, self.cache.req_to_token)
            new_k, new_v = kc[slots].to(k.dtype), vc[slots].to(v.dtype)
        if self.bug == "workspace_oom" and self.small_workspace:
            raise MemoryError("workspace too large")  # not attnplug.ResourceLimitError, names no setting
        k_scale, v_scale = self.cache.kv_scales(layer.layer_id)
        if self.bug == "v_scale":
            v_scale = 1.0
        out = reference_attention(q, new_k, new_v, seen, seen_batch, kc, vc, self.cache.req_to_token, k_scale, v_scale)
        if self.bug == "chunk_drops_last" and self.small_workspace and batch.forward_mode is ForwardMode.DECODE:
            out[-1:] = 0  # a decode cut into pieces that forgets the batch's last request
        if self.bug == "pad_multiply" and not layer.is_cross_attention:
            out = out + _padding_times_zero(batch, vc, self.cache.req_to_token)
        if self.bug == "nan_when_empty":
            out = torch.where(out.abs().sum(dim=2, keepdim=True) == 0, torch.full_like(out, float("nan")), out)
        out = out.to(device=q.device, dtype=q.dtype)
        if self.bug == "reused_output":
            if self._out is None or self._out.shape != out.shape or self._out.dtype != out.dtype:
                self._out = torch.empty_like(out)
            self._out.copy_(out)
            return self._out
        return out


def _in_range(field: str, values: list[int], bound: int) -> None:
    for j, x in enumerate(values):
        if not 0 <= x < bound:
            raise ShapeError(f"{field}[{j}]={x} is outside [0, {bound})")


def _new_positions_slots(batch: Any, r2t: torch.Tensor) -> torch.Tensor:
    parts = [r2t[r, p:p + e] for r, p, e in zip(batch.req_pool_indices.tolist(), batch.extend_prefix_lens_cpu,
                                                  batch.extend_seq_lens_cpu)]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


def _padding_times_zero(batch: Any, vc: torch.Tensor, r2t: torch.Tensor) -> torch.Tensor:
    """What a kernel that pads every request to the longest and multiplies masked values by
    zero adds to a shorter request's output: ``0 * v[padding slot]`` (NaN when it holds NaN/inf)."""
    longest = max(batch.seq_lens_cpu, default=0)
    rows = []
    for r, s, e in zip(batch.req_pool_indices.tolist(), batch.seq_lens_cpu, batch.extend_seq_lens_cpu):
        pad = r2t[r, s:longest].long()
        leak = (vc[pad].to(torch.float64) * 0).sum(dim=0) if len(pad) else torch.zeros(vc.shape[1:], dtype=torch.float64)
        rows.append(leak.sum(dim=0).expand(e, -1) if e else None)
    parts = [x for x in rows if x is not None]
    if not parts:
        return torch.zeros(0, dtype=torch.float64)
    leak = torch.cat(parts)  # [tokens, Dv]
    return leak[:, None, :]


class NarrowBackend(ReferenceBackend):
    capabilities = NARROW


def _factory(name: str, bug: str | None):  # type: ignore[no-untyped-def]
    def create(ctx: Any) -> tuple[str, ReferenceBackend]:
        backend = (NarrowBackend if name == "conf_narrow" else ReferenceBackend)(name, ctx)
        backend.bug = bug
        return name, backend

    return create


create_conf_reference = _factory("conf_reference", None)
create_conf_narrow = _factory("conf_narrow", None)
create_conf_no_scale = _factory("conf_no_scale", "scale")
create_conf_no_window = _factory("conf_no_window", "window")
create_conf_kv_off_by_one = _factory("conf_kv_off_by_one", "kv_slot")
create_conf_no_sinks = _factory("conf_no_sinks", "sinks")
create_conf_default_scale = _factory("conf_default_scale", "default_scale")
create_conf_pad_multiply = _factory("conf_pad_multiply", "pad_multiply")
create_conf_write_first = _factory("conf_write_first", "write_first")
create_conf_no_bounds = _factory("conf_no_bounds", "no_bounds")
create_conf_reused_output = _factory("conf_reused_output", "reused_output")
create_conf_mask_everywhere = _factory("conf_mask_everywhere", "mask_everywhere")
create_conf_new_from_cache = _factory("conf_new_from_cache", "new_from_cache")
create_conf_nan_when_empty = _factory("conf_nan_when_empty", "nan_when_empty")
create_conf_chunk_drops_last = _factory("conf_chunk_drops_last", "chunk_drops_last")
create_conf_workspace_oom = _factory("conf_workspace_oom", "workspace_oom")
create_conf_no_v_scale = _factory("conf_no_v_scale", "v_scale")
