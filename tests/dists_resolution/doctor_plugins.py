"""In-process plugins for the doctor tests: a simple, correct torch backend and a wrong one.

The correct one writes the new K/V into the paged cache, then attends over
the request's slots read back through ``req_to_token`` (causal, with the
target-verify mask). The wrong one forgets the causal mask, which a real
kernel bug would look like; doctor must catch it and exit non-zero.
"""

from __future__ import annotations

import types

from attnplug import AttentionBackend, BackendDescriptor, Capabilities, hookimpl
from attnplug.modes import ForwardMode

CAPS = Capabilities(dtypes=("float32",), speculative_verify=True, draft_extend=True, devices=("cpu",))


class SimpleTorchBackend(AttentionBackend):
    capabilities = CAPS
    causal = True

    def __init__(self, ctx):
        self.cache = ctx.kv_cache
        self.batch = None

    def init_forward_metadata(self, batch):
        self.batch = batch

    def forward_extend(self, q, k, v, layer, batch, save_kv_cache=True):
        return self._attend(q, k, v, layer, batch, save_kv_cache)

    def forward_decode(self, q, k, v, layer, batch, save_kv_cache=True):
        return self._attend(q, k, v, layer, batch, save_kv_cache)

    def _attend(self, q, k, v, layer, batch, save):
        import torch

        assert batch is self.batch, "init_forward_metadata was not called"
        if save:
            self.cache.set_kv(layer.layer_id, batch.out_cache_loc, k, v)
        kb, vb = self.cache.get_kv(layer.layer_id)
        out = q.new_zeros(q.shape[0], layer.num_heads, layer.v_head_dim)
        group = layer.num_heads // layer.num_kv_heads
        t0 = 0
        for i, r in enumerate(batch.req_pool_indices.tolist()):
            p, e = batch.extend_prefix_lens_cpu[i], batch.extend_seq_lens_cpu[i]
            slots = self.cache.req_to_token[r, : p + e]
            keys = kb[slots].repeat_interleave(group, dim=1)  # [n, H, D]
            vals = vb[slots].repeat_interleave(group, dim=1)
            s = torch.einsum("thd,nhd->htn", q[t0:t0 + e], keys) * layer.scaling
            if self.causal:
                qpos = torch.arange(p, p + e)[:, None]
                hidden = torch.arange(p + e)[None, :] > qpos
                if batch.forward_mode is ForwardMode.TARGET_VERIFY and batch.spec_custom_mask is not None:
                    hidden[:, p:] |= ~batch.spec_custom_mask[i].bool()
                s = s.masked_fill(hidden[None], float("-inf"))
            out[t0:t0 + e] = torch.einsum("htn,nhd->thd", s.softmax(-1), vals)
            t0 += e
        return out


class NoCausalMaskBackend(SimpleTorchBackend):
    causal = False


def _plugin(name: str, cls: type) -> types.ModuleType:
    mod = types.ModuleType(f"doctor_plugin_{name}")

    @hookimpl
    def attnplug_register_backends(register):
        register(BackendDescriptor(name=name, factory=lambda ctx: (name, cls(ctx)), capabilities=CAPS,
                                   priority={"cpu": 100 if cls is SimpleTorchBackend else 0}))

    mod.attnplug_register_backends = attnplug_register_backends
    return mod


def good_plugin() -> types.ModuleType:
    return _plugin("simple_torch", SimpleTorchBackend)


def wrong_plugin() -> types.ModuleType:
    return _plugin("no_causal_mask", NoCausalMaskBackend)


def unavailable_plugin() -> types.ModuleType:
    mod = types.ModuleType("doctor_plugin_unavailable")

    @hookimpl
    def attnplug_register_backends(register):
        register(BackendDescriptor(name="needs_gpu", factory=lambda ctx: ("needs_gpu", None),
                                   capabilities=Capabilities(devices=("cuda",)),
                                   probe=lambda host: ["needs a CUDA GPU"], priority={"cuda": 5}))

    mod.attnplug_register_backends = attnplug_register_backends
    return mod


def broken_factory_plugin() -> types.ModuleType:
    mod = types.ModuleType("doctor_plugin_broken_factory")

    def factory(ctx):
        raise RuntimeError("kernel library failed to initialise")

    @hookimpl
    def attnplug_register_backends(register):
        register(BackendDescriptor(name="broken_factory", factory=factory, capabilities=CAPS))

    mod.attnplug_register_backends = attnplug_register_backends
    return mod
