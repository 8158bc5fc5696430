"""In-process plugins for the doctor tests: a simple, correct torch backend and wrong ones.

The correct one (on ``PagedBackend``) attends over each request's cached
prefix read through ``req_to_token`` plus the new k/v (causal, sliding
window, soft-cap, the target-verify mask). Each wrong one breaks exactly one
claimed thing, as a real kernel bug would: no causal mask, a window one key
too wide or too narrow, a soft-cap claimed but ignored. Doctor must fail each
naming the claim, and exit non-zero.
"""

from __future__ import annotations

import types

from attnplug import BackendDescriptor, Capabilities, ForwardMode, PagedBackend, hookimpl

CAPS = Capabilities(dtypes=("float32",), speculative_verify=True, draft_extend=True, sliding_window=True,
                    logit_softcap=True, devices=("cpu",))


class SimpleTorchBackend(PagedBackend):
    capabilities = CAPS
    backend_name = "simple_torch"
    causal = True
    window_shift = 0  # a wrong backend sees keys from p - W - shift
    use_softcap = True

    def build_metadata(self, batch):
        return batch

    def compute_extend(self, q, k, v, layer, batch, meta):
        import torch

        kb, vb = self.cache.get_kv(layer.layer_id)
        out = q.new_zeros(q.shape[0], layer.num_heads, layer.v_head_dim)
        group = layer.num_heads // layer.num_kv_heads
        t0 = 0
        for i, r in enumerate(batch.req_pool_indices_cpu):
            p, e = batch.extend_prefix_lens_cpu[i], batch.extend_seq_lens_cpu[i]
            slots = self.cache.req_to_token[r, :p]
            keys = torch.cat([kb[slots], k[t0:t0 + e]]).repeat_interleave(group, dim=1)  # [n, H, D]
            vals = torch.cat([vb[slots], v[t0:t0 + e]]).repeat_interleave(group, dim=1)
            s = torch.einsum("thd,nhd->htn", q[t0:t0 + e], keys) * layer.scaling
            if layer.logit_cap and self.use_softcap:
                s = layer.logit_cap * torch.tanh(s / layer.logit_cap)
            qpos = torch.arange(p, p + e)[:, None]
            kpos = torch.arange(p + e)[None, :]
            hidden = kpos > qpos if self.causal else torch.zeros(e, p + e, dtype=torch.bool)
            if layer.sliding_window is not None:
                hidden |= kpos < qpos - layer.sliding_window - self.window_shift
            if batch.forward_mode is ForwardMode.TARGET_VERIFY and batch.spec_custom_mask is not None:
                hidden[:, p:] |= ~batch.spec_custom_mask[i].bool()
            s = s.masked_fill(hidden[None], float("-inf"))
            out[t0:t0 + e] = torch.einsum("htn,nhd->thd", s.softmax(-1), vals)
            t0 += e
        return out


class NoCausalMaskBackend(SimpleTorchBackend):
    causal = False


class WindowOneWideBackend(SimpleTorchBackend):
    window_shift = 1  # W + 2 keys


class WindowOneNarrowBackend(SimpleTorchBackend):
    window_shift = -1  # W keys


class IgnoresSoftcapBackend(SimpleTorchBackend):
    use_softcap = False


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


#: name -> (backend class, the claim doctor must name when it fails)
WRONG_CLAIMS = {
    "window_plus_one": (WindowOneWideBackend, "window"),
    "window_minus_one": (WindowOneNarrowBackend, "window"),
    "ignores_softcap": (IgnoresSoftcapBackend, "softcap"),
}


def wrong_claim_plugin(name: str) -> types.ModuleType:
    return _plugin(name, WRONG_CLAIMS[name][0])


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
