"""Kernels of the test-only backends: the float64 reference with one bug each."""

from __future__ import annotations

import dataclasses
from typing import Any

from attnplug import AttentionBackend, MetadataGuard
from attnplug.batch import check_qkv
from attnplug.testing.reference import reference_attention

from . import CAPABILITIES


class ReferenceBackend(AttentionBackend):
    capabilities = CAPABILITIES
    bug: str | None = None

    def __init__(self, name: str, ctx: Any) -> None:
        self.name = name
        self.cache = ctx.kv_cache
        self.meta = MetadataGuard(name)

    def init_forward_metadata(self, batch: Any) -> None:
        self.meta.set(batch, None)

    def forward_extend(self, q, k, v, layer, batch, save_kv_cache=True):  # type: ignore[no-untyped-def]
        return self._forward(q, k, v, layer, batch, save_kv_cache)

    def forward_decode(self, q, k, v, layer, batch, save_kv_cache=True):  # type: ignore[no-untyped-def]
        return self._forward(q, k, v, layer, batch, save_kv_cache)

    def _forward(self, q, k, v, layer, batch, save_kv_cache):  # type: ignore[no-untyped-def]
        self.meta.require(batch)
        check_qkv(q, k, v, layer, batch.num_tokens)
        kc, vc = self.cache.get_kv(layer.layer_id)
        seen = layer
        if self.bug == "scale":
            seen = dataclasses.replace(layer, scaling=1.0)
        elif self.bug == "window":
            seen = dataclasses.replace(layer, sliding_window=None)
        elif self.bug == "sinks":
            seen = dataclasses.replace(layer, sinks=None)
        out = reference_attention(q, k, v, seen, batch, kc, vc, self.cache.req_to_token)
        if save_kv_cache and k is not None:
            loc = batch.out_cache_loc
            if self.bug == "kv_slot":
                loc = (loc + 1) % self.cache.num_slots
            self.cache.set_kv(layer.layer_id, loc, k, v)
        return out.to(device=q.device, dtype=q.dtype)


def _factory(name: str, bug: str | None):  # type: ignore[no-untyped-def]
    def create(ctx: Any) -> tuple[str, ReferenceBackend]:
        backend = ReferenceBackend(name, ctx)
        backend.bug = bug
        return name, backend

    return create


create_conf_reference = _factory("conf_reference", None)
create_conf_no_scale = _factory("conf_no_scale", "scale")
create_conf_no_window = _factory("conf_no_window", "window")
create_conf_kv_off_by_one = _factory("conf_kv_off_by_one", "kv_slot")
create_conf_no_sinks = _factory("conf_no_sinks", "sinks")
