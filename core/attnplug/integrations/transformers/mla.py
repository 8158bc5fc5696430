"""MLA attention modules (docs/mla.md) served through attnplug's latent cache.

transformers' MLA modules (DeepSeek-V2/V3) compute the latent ``c_kv`` (after ``kv_a_layernorm``) and
the rotated ``k_pe``, hand both to ``cache.update(c_kv, k_pe, layer_idx)`` "while latent KV is still
compressed", then decompress the returned latents with ``kv_b_proj`` and call the attention function
with per-head ``q = [q_nope, q_pe]`` and the decompressed K/V. The integration's cache
(``cache.PagedCacheLayer.update``) keeps the latents of the call it receives, so the attention function
can serve the layer from the latent rows without touching the module's forward:

* **unabsorbed** (the form the module itself computes): ``q [T, H, qk_nope + qk_rope]`` as passed, the
  latent rows ``c_kv ++ k_pe`` as ``k``; the backend decompresses them with ``w_kc``/``w_vc`` (the
  module's ``kv_b_proj`` split per head) and returns ``[T, H, v_head_dim]``;
* **absorbed**: the integration multiplies ``q_nope`` by ``w_kc`` (W_UK) before attention and the
  ``[T, H, kv_lora_rank]`` output by ``w_vc`` (W_UV) after it, as an engine does.

Which modules are MLA modules is a registry (``register_mla_module``), not a branch on a model family:
DeepSeek-V2 and V3 are registered below. The decompressed K/V the module passes are not read (the
backend reads the latent cache).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from attnplug import AttnplugError, LayerSpec
from attnplug.layer import ABSORBED, MLASpec


@dataclasses.dataclass(frozen=True)
class MLAModule:
    """How one attention module class is an MLA layer: ``spec(module, layer_id, scaling)`` builds its
    ``LayerSpec`` (with ``MLASpec`` and the per-head weights), ``latent(args)`` the ``[T, 1,
    kv_lora_rank + qk_rope]`` rows from what the module passed to ``cache.update``."""

    spec: Callable[[Any, int, float], LayerSpec]
    latent: Callable[[tuple[Any, Any]], torch.Tensor]


#: attention module class name -> how it is an MLA layer (``register_mla_module``)
MLA_MODULES: dict[str, MLAModule] = {}


def register_mla_module(class_name: str, module: MLAModule) -> None:
    """Serve attention modules of class ``class_name`` as MLA layers (docs/mla.md)."""
    MLA_MODULES[class_name] = module


def mla_module(module: Any) -> MLAModule | None:
    return MLA_MODULES.get(type(module).__name__)


# -- DeepSeek-V2 / V3 ------------------------------------------------------------------------------
def _deepseek_spec(module: Any, layer_id: int, scaling: float) -> LayerSpec:
    heads = int(module.num_heads)
    lora, nope, rope, vd = (int(module.kv_lora_rank), int(module.qk_nope_head_dim), int(module.qk_rope_head_dim),
                            int(module.v_head_dim))
    w = module.kv_b_proj.weight.detach().view(heads, nope + vd, lora)  # per head: [nope + v, lora]
    w_kc = w[:, :nope, :].contiguous()  # [H, nope, lora]: k_nope_h = c_kv @ w_kc[h]^T
    w_vc = w[:, nope:, :].transpose(1, 2).contiguous()  # [H, lora, v]: v_h = c_kv @ w_vc[h]
    return LayerSpec(layer_id, heads, 1, lora + rope, scaling=scaling,
                     mla=MLASpec(lora, nope, rope, vd, w_kc=w_kc, w_vc=w_vc))


def _deepseek_latent(args: tuple[Any, Any]) -> torch.Tensor:
    c_kv, k_pe = args  # [1, 1, T, kv_lora_rank], [1, 1, T, qk_rope] (after the layernorm; rotary applied)
    return torch.cat([c_kv, k_pe], dim=-1)[0].transpose(0, 1)  # [T, 1, lora + rope]


DEEPSEEK = MLAModule(_deepseek_spec, _deepseek_latent)
for _name in ("DeepseekV2Attention", "DeepseekV3Attention"):
    register_mla_module(_name, DEEPSEEK)


# -- the runner's side ----------------------------------------------------------------------------
def mla_specs(specs: tuple[LayerSpec, ...], calls: Any) -> tuple[LayerSpec, ...]:
    """``specs`` with every layer whose attention module is a registered MLA module replaced by its MLA
    ``LayerSpec`` (the scale the probe recorded: transformers' YaRN mscale included)."""
    by_layer = {c.layer_idx: c for c in calls}
    out = []
    for s in specs:
        call = by_layer.get(s.layer_id)
        m = None if call is None else mla_module(call.module)
        out.append(s if m is None else m.spec(call.module, s.layer_id, s.scaling))
    return tuple(out)


def attend_mla(backend: Any, batch: Any, layer: LayerSpec, module: Any, query: torch.Tensor,
               latent_args: Any) -> torch.Tensor:
    """One MLA layer's attention call: ``query`` is ``[1, H, T, qk_nope + qk_rope]``; returns
    ``[1, T, H, v_head_dim]``."""
    m = mla_module(module)
    if m is None or latent_args is None:
        raise AttnplugError(f"layer {layer.layer_id}: an MLA layer, but the latents did not reach the cache "
                            f"(module {type(module).__name__} must pass them to cache.update)")
    mla = layer.mla
    assert mla is not None
    latent = m.latent(latent_args).to(query.dtype)
    q = query[0].transpose(0, 1)  # [T, H, nope + rope]
    if batch.mla_form == ABSORBED:
        w_kc = mla.w_kc.to(q.dtype)
        q_lat = torch.einsum("thn,hnl->thl", q[..., :mla.qk_nope_head_dim], w_kc)
        qa = torch.cat([q_lat, q[..., mla.qk_nope_head_dim:]], dim=2).contiguous()
        out = backend.forward(qa, latent.contiguous(), None, layer, batch)  # [T, H, kv_lora_rank]
        out = torch.einsum("thl,hlv->thv", out, mla.w_vc.to(out.dtype))
    else:
        out = backend.forward(q.contiguous(), latent.contiguous(), None, layer, batch)  # [T, H, v_head_dim]
    return out.unsqueeze(0)
