"""How a host engine uses attnplug: flags -> resolved pair -> backend -> forwards."""

import argparse

import torch

from attnplug import (
    AttentionConfig, BuildContext, ForwardBatch, LayerSpec, PageAllocator, PagedKVCache, default_registry,
)
from attnplug.config import add_attention_args, config_from_args
from attnplug.resolution import resolve
from attnplug.selector import backend_name_for_mode

parser = argparse.ArgumentParser()
add_attention_args(parser)  # --attention-backend, --prefill-/--decode-attention-backend, ...
config: AttentionConfig = config_from_args(parser.parse_args())

registry = default_registry()  # entry points, discovered once per process
resolved = resolve(config, arch="LlamaForCausalLM", registry=registry)
print("resolved pair:", resolved.pair)  # `attnplug resolve` explains it pass by pass

layer = LayerSpec(layer_id=0, num_heads=8, num_kv_heads=2, head_dim=64)
# one cache serves both halves, in the KV layout resolution chose for the pair (`attnplug list` shows layouts)
cache = PagedKVCache(num_layers=1, num_pages=64, num_kv_heads=2, head_dim=64, page_size=16,
                     layout=registry.kv_layout(resolved.config.kv_layout))
ctx = BuildContext(config=resolved.config, host=registry.host, kv_cache=cache, page_size=16,
                   num_heads=8, num_kv_heads=2, head_dim=64)
backend = registry.build_pair(ctx)  # one backend, or a HybridBackend when the halves differ

# Prefill two requests of 20 and 7 tokens, then decode one token each.
pages = PageAllocator(64)
for req, length in enumerate([21, 8]):
    cache.assign_pages(req, length, pages.alloc((length + 15) // 16))
prefill = ForwardBatch.extend([0, 1], [0, 0], [20, 7],
                              torch.cat([cache.slots(0, 0, 20), cache.slots(1, 0, 7)]))
decode = ForwardBatch.decode([0, 1], [21, 8], torch.stack([cache.slots(0, 20, 21)[0], cache.slots(1, 7, 8)[0]]))
for batch in (prefill, decode):
    n = batch.num_tokens
    q, k, v = torch.randn(n, 8, 64), torch.randn(n, 2, 64), torch.randn(n, 2, 64)
    backend.init_forward_metadata(batch)  # once per forward, shared by every layer
    out = backend.forward(q, k, v, layer, batch)  # per layer
    # model code asks the backend serving this forward (its stamps), never a global
    kernel = backend_name_for_mode(batch.forward_mode, resolved.config, backend)
    print(f"{batch.forward_mode.value}: out {tuple(out.shape)} served by {kernel}")
