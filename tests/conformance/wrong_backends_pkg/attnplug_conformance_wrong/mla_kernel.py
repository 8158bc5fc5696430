"""Test-only MLA backends (docs/mla.md): the float64 reference behind the core's ``PagedBackend`` skeleton,
``conf_mla_reference`` correct, each other with one MLA bug while claiming both forms everywhere:

* ``conf_mla_wrong_slice``: the absorbed form takes its values from the wrong slice of the latent row
  (its LAST ``kv_lora_rank`` entries, overlapping ``k_pe``, instead of the first);
* ``conf_mla_scale576``: the softmax scale from the latent row width, ``1/sqrt(head_dim)`` (576 in
  DeepSeek-V3), instead of ``LayerSpec.scaling`` (``1/sqrt(qk_nope + qk_rope)``), in both forms.

Ordinary (non-MLA) layers are computed correctly by all three, so only MLA cases can fail.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from attnplug import PagedBackend
from attnplug.kvcache import quantize
from attnplug.testing.reference import reference_attention, reference_mla

from . import MLA_CAPABILITIES


class MLAReferenceBackend(PagedBackend):
    capabilities = MLA_CAPABILITIES
    new_kv_source = "args"
    bug: str | None = None

    def compute_extend(self, q: Any, k: Any, v: Any, layer: Any, batch: Any, meta: Any) -> Any:
        cache = self.cache
        kc, vc = cache.read_kv(layer.layer_id)
        ks, vs = cache.kv_scales(layer.layer_id)
        out = reference_attention(q, k, v, layer, batch, kc, vc, cache.req_to_token, ks, vs)
        return out.to(device=q.device, dtype=q.dtype)

    def compute_mla(self, q: Any, latent: Any, layer: Any, batch: Any, meta: Any) -> Any:
        cache = self.cache
        lid = layer.layer_id
        scale = cache.k_scales[lid]
        rows = cache.read_latent(lid)
        if self.bug == "scale576":
            layer = dataclasses.replace(layer, scaling=1.0 / math.sqrt(layer.head_dim))
        if self.bug == "wrong_slice" and batch.mla_form == "absorbed":
            lora = layer.mla.kv_lora_rank
            kc = rows.to(torch.float64) * (scale if cache.quantized else 1.0)
            new = quantize(latent, scale, cache.dtype) if cache.quantized else latent
            new = new.to(torch.float64) * (scale if cache.quantized else 1.0)
            shadow = dataclasses.replace(layer, mla=None, v_head_dim=lora)
            out = reference_attention(q, new, new[..., -lora:], shadow, batch, kc, kc[..., -lora:],
                                      cache.req_to_token)
        else:
            out = reference_mla(q, latent, layer, batch, rows, cache.req_to_token, scale=scale)
        return out.to(device=q.device, dtype=q.dtype)


def _factory(name: str, bug: str | None):  # type: ignore[no-untyped-def]
    def create(ctx: Any) -> tuple[str, MLAReferenceBackend]:
        backend = MLAReferenceBackend(ctx)
        backend.bug = bug
        return name, backend

    return create


create_conf_mla_reference = _factory("conf_mla_reference", None)
create_conf_mla_wrong_slice = _factory("conf_mla_wrong_slice", "wrong_slice")
create_conf_mla_scale576 = _factory("conf_mla_scale576", "scale576")
