"""MLA problems for the suite (docs/mla.md): a latent cache full of noise, pages scattered, the layer's
decompression weights, q in the case's form and the new latent rows; the expected output from
``reference_mla`` and the expected cache bytes. Usable without pytest (like ``harness``).

``make_mla_problem``'s keyword options serve tests outside the suite (a plugin's own MLA tests): other
latent dims than DeepSeek-V3's, several layers over one cache, chosen request rows. Left at their
defaults they build exactly what a suite case always got (the same random draws, in the same order)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import torch

from ...batch import ForwardBatch
from ...config import AttentionConfig
from ...build_context import BuildContext
from ...kvcache import PageAllocator, PagedKVCache
from ...layer import ABSORBED, LayerSpec, MLASpec
from ...registry import default_registry
from ..reference import expected_latent_after, reference_mla
from . import harness as H
from .cases import MLA_DIMS, Case


__all__ = ["MLAProblem", "absorbed_q", "build", "cache_diffs", "make_mla_problem", "run"]


@dataclasses.dataclass
class MLAProblem:
    case: Case
    device: str
    layer: LayerSpec
    cache: PagedKVCache
    batch: ForwardBatch
    q: torch.Tensor
    latent: torch.Tensor
    #: the per-head parts of the queries (``q`` is built from them in the case's form)
    q_nope: torch.Tensor
    q_pe: torch.Tensor
    before: torch.Tensor
    scale: float
    #: every layer (``layer`` is the first) and each one's new latent rows (``latent`` is the first's)
    layers: tuple[LayerSpec, ...] = ()
    latents: tuple[torch.Tensor, ...] = ()

    def context(self, name: str) -> BuildContext:
        c, lay = self.case, self.layer
        return BuildContext(
            config=AttentionConfig(attention_backend=name), host=default_registry().host, device=self.device,
            dtype=c.dtype, kv_cache_dtype=c.kv_dtype, num_heads=lay.num_heads, num_kv_heads=1,
            head_dim=lay.head_dim, v_head_dim=lay.v_head_dim, page_size=c.page_size, kv_cache=self.cache,
            max_batch_size=H.MAX_REQUESTS, max_context_len=H.MAX_CONTEXT, layers=self.layers or (lay,),
        )

    def with_form(self, form: str) -> tuple[ForwardBatch, torch.Tensor]:
        """This problem's batch in ``form`` (a new batch object) and its queries in that form."""
        batch = dataclasses.replace(self.batch, mla_form=form).validate()
        return batch, absorbed_q(self) if form == ABSORBED else torch.cat([self.q_nope, self.q_pe], dim=2)

    def expected(self, batch: ForwardBatch | None = None, q: torch.Tensor | None = None) -> torch.Tensor:
        return reference_mla(self.q if q is None else q, self.latent, self.layer, batch or self.batch, self.before,
                             self.cache.req_to_token, scale=self.scale)

    def expected_cache(self, save: bool = True) -> torch.Tensor:
        if not save:
            return self.before
        return expected_latent_after(self.before, self.latent, self.batch.out_cache_loc, self.scale)


def absorbed_q(problem: MLAProblem) -> torch.Tensor:
    """``[q_nope_h @ w_kc[h], q_pe_h]`` per head, in the case's dtype (the host's absorption)."""
    w_kc = problem.layer.mla.w_kc.to(torch.float32)  # type: ignore[union-attr]
    qa = torch.einsum("thn,hnl->thl", problem.q_nope.to(torch.float32), w_kc)
    return torch.cat([qa.to(problem.q_pe.dtype), problem.q_pe], dim=2)


def make_mla_problem(case: Case, device: str, *, dims: tuple[int, int, int, int] = MLA_DIMS, num_layers: int = 1,
                     rows: Sequence[int] | None = None) -> MLAProblem:
    """The MLA problem of ``case`` on ``device``.

    ``dims``: the layer's ``(kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim)`` (default
    DeepSeek-V3's, ``MLA_DIMS``). ``num_layers``: layers over one cache (default 1); each layer after the
    first gets its own weights, latent noise in every slot (``case.garbage`` where no request owns one, the
    fp8 scale of ``case.kv_scales``) and new latent rows, all drawn after the first layer's. ``rows``: the
    requests' ``req_to_token`` rows (default drawn at random, distinct, below ``harness.MAX_REQUESTS``)."""
    gen = torch.Generator().manual_seed(case.seed)
    sc, ps, heads = case.scenario, case.page_size, case.shape.num_heads
    lora, nope, rope, vd = dims
    if num_layers < 1:
        raise ValueError(f"make_mla_problem: num_layers={num_layers}, expected at least 1")
    # w ~ N(0, 1/lora): decompressed keys and values are O(1), like the latent rows
    w_kc = (torch.randn(heads, nope, lora, generator=gen) / math.sqrt(lora)).to(device)
    w_vc = (torch.randn(heads, lora, vd, generator=gen) / math.sqrt(lora)).to(device)
    layer = LayerSpec(0, heads, 1, lora + rope, mla=MLASpec(lora, nope, rope, vd, w_kc=w_kc, w_vc=w_vc))
    lens = list(sc.seq_lens)
    pages_needed = [(max(n, 1) + ps - 1) // ps for n in lens]
    num_pages = sum(pages_needed) + 5
    cache = PagedKVCache(num_layers, num_pages, 1, lora + rope, v_head_dim=0, page_size=ps, dtype=case.kv_dtype,
                         device=device, max_requests=H.MAX_REQUESTS,
                         max_context_len=max(H.MAX_CONTEXT, max(lens, default=0)),
                         layout=default_registry().kv_layout(case.kv_layout))
    scale = 1.0
    if case.kv_scales is not None:
        scale = case.kv_scales[0]
        for lid in range(num_layers):
            cache.set_latent_scale(lid, scale)
    every = torch.arange(cache.num_slots, device=device)

    def noise(lid: int) -> None:
        cache.set_latent(lid, every, H._randn(gen, (cache.num_slots, 1, lora + rope), "float32", device).to(
            cache.dtype if not cache.quantized else torch.float32))

    noise(0)
    alloc = PageAllocator(num_pages, shuffle=True, seed=case.seed)
    drawn = torch.randperm(H.MAX_REQUESTS, generator=gen)[:len(lens)].tolist()
    rows = drawn if rows is None else list(rows)
    if len(rows) != len(lens):
        raise ValueError(f"make_mla_problem: {len(rows)} rows for {len(lens)} requests of case {case.id}")
    for r, length, need in zip(rows, lens, pages_needed):
        cache.assign_pages(r, length, alloc.alloc(need))
    batch = H.make_batch(sc, cache, rows, gen, device)
    batch.mla_form = case.mla_form or ABSORBED
    batch.validate()
    bad = torch.zeros(0, dtype=torch.int64)
    if case.garbage:
        owned: set[int] = set()
        for r, length in zip(rows, lens):
            owned.update(cache.req_to_token[r, :length].tolist())
        bad = torch.tensor([s for s in range(cache.num_slots) if s not in owned], dtype=torch.int64, device=device)

    def garbage(lid: int) -> None:
        if case.garbage and bad.numel():
            value = H.GARBAGE_VALUES[case.garbage]
            cache.set_latent(lid, bad, torch.full((bad.numel(), 1, lora + rope), value).to(cache.dtype), stored=True)

    garbage(0)
    t = batch.num_tokens
    q_nope = H._randn(gen, (t, heads, nope), case.dtype, device)
    q_pe = H._randn(gen, (t, heads, rope), case.dtype, device)
    latent = H._randn(gen, (t, 1, lora + rope), case.dtype, device)
    problem = MLAProblem(case, device, layer, cache, batch, q_nope, latent, q_nope, q_pe,
                         cache.read_latent(0).clone(), scale)
    if batch.mla_form == ABSORBED:
        # absorbed queries drawn directly (scores O(sqrt(576/192))); the forms-agree family derives them
        problem.q = H._randn(gen, (t, heads, lora + rope), case.dtype, device)
    else:
        problem.q = torch.cat([q_nope, q_pe], dim=2)
    layers, latents = [layer], [latent]
    for lid in range(1, num_layers):  # drawn after everything the first layer has: its draws stay the same
        w_kc = (torch.randn(heads, nope, lora, generator=gen) / math.sqrt(lora)).to(device)
        w_vc = (torch.randn(heads, lora, vd, generator=gen) / math.sqrt(lora)).to(device)
        layers.append(LayerSpec(lid, heads, 1, lora + rope, mla=MLASpec(lora, nope, rope, vd, w_kc=w_kc, w_vc=w_vc)))
        noise(lid)
        garbage(lid)
        latents.append(H._randn(gen, (t, 1, lora + rope), case.dtype, device))
    problem.layers, problem.latents = tuple(layers), tuple(latents)
    return problem


def build(name: str, problem: MLAProblem) -> Any:
    _, backend = default_registry().build(name, problem.context(name))
    return backend


def run(backend: Any, problem: MLAProblem, batch: ForwardBatch | None = None, q: torch.Tensor | None = None,
        save: bool = True) -> torch.Tensor:
    b = problem.batch if batch is None else batch
    backend.init_forward_metadata(b)
    out: torch.Tensor = backend.forward(problem.q if q is None else q, problem.latent, None, problem.layer, b,
                                        save_kv_cache=save)
    return out


def cache_diffs(problem: MLAProblem, want: torch.Tensor) -> list[str]:
    """Where the latent rows differ, bit for bit, from ``want`` (token-major ``[num_slots, 1, width]``)."""
    got = problem.cache.read_latent(0)
    if H.same_bytes(got, want):
        return []
    diff = (H.bits(got) != H.bits(want)).reshape(got.shape[0], -1).any(dim=1).nonzero().flatten().tolist()
    loc = set(problem.batch.out_cache_loc.tolist())
    outside = [s for s in diff if s not in loc]
    return [f"latent rows differ at {len(diff)} slots ({len(outside)} outside out_cache_loc; first {diff[:5]})"]
