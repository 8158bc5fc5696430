"""Serve a Hugging Face transformers model through attnplug.

An unchanged transformers causal LM runs every attention call through a
resolved attnplug backend (or a ``HybridBackend`` for a split pair):

* ``layers.layer_specs(model)``: one ``LayerSpec`` per decoder layer, read from
  the attention modules and the config (heads, KV heads, head dim, scaling,
  sliding window translated to attnplug's convention, soft-cap, sinks);
* ``cache.AttnplugCache``: a transformers ``Cache`` backed by ``PagedKVCache``;
  pages are taken as a request grows and freed when it finishes, and the
  backend (not transformers) writes the K/V;
* ``attention.attnplug_attention_forward``: the function registered with
  transformers' ``AttentionInterface`` under the name ``"attnplug"``;
* ``runner.TransformersRunner``: flags/config -> resolve -> build through the
  registry -> per-forward metadata -> ragged (padding-free) forwards;
* ``loop.generate``: a continuous-batching greedy loop over a runner.

Names are loaded lazily (PEP 562): importing this package imports neither
transformers nor torch; the first use of a name does.
"""

from __future__ import annotations


from ..._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "ATTENTION_NAME": "attention",
    "register_attention": "attention",
    "attnplug_attention_forward": "attention",
    "AttnplugCache": "cache",
    "PagePool": "cache",
    "layer_specs": "layers",
    "derive": "layers",
    "ModelNotServedError": "layers",
    "attnplug_sliding_window": "layers",
    "TransformersRunner": "runner",
    "Chunk": "runner",
    "StepRecord": "runner",
    "Request": "loop",
    "GenerationResult": "loop",
    "generate": "loop",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals(), __all__)
