#!/usr/bin/env python3
"""The issue-14 cases on a real GPU (run by scripts/gpu_check.sh; never CI).

Each case builds a backend through the registry on this machine, runs one
forward on CUDA against ``attnplug.testing.reference`` and prints one line:
``PASS``, ``FAIL`` (with the error or the excess error) or ``SKIP`` (with the
reason: the backend is unavailable here, or refuses the layer in words).

Cases: attention sinks on each backend that claims them (fa3, trtllm_mha,
aiter); MQA (one KV head) on trtllm_mha; fp8 KV on SM90 (fa3, flashinfer; scales 1
and (0.04, 2.5));
determinism on SM90 (flashinfer and fa3: one request's output is bitwise the
same alone and inside a larger batch).

Issue-27 cases (``issue27/...``): flashinfer decode on tensor cores (fp8 KV,
determinism, GQA 8) on SM90, where a decode wrapper left at ``backend="auto"``
ran FA3 (flashinfer 0.6.0-0.6.3: carry ``flashinfer-python==0.6.3`` in ``.whl/``
to see it; the header prints the installed version); a target-verify right
after an extend on one flashinfer backend (SM90, flashinfer <= 0.6.4: the
shared wrapper's ``"auto"`` choice stuck to FA3 and the custom mask failed);
a sink model on fa3 (off SM90 it must be refused, and resolution with the
layer must pick another backend; on SM90 it must match the reference); a
captured sink model (real ``torch.cuda.graph`` capture of one decode per
backend with CPU-resident sinks, against a plain-layer control).

Usage: python scripts/gpu_contract_cases.py [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import traceback
from typing import Any

import torch

from attnplug import AttentionConfig, BuildContext, ForwardBatch, ForwardMode, LayerSpec
from attnplug.errors import NotSupportedError
from attnplug.kvcache import PageAllocator, PagedKVCache, quantize
from attnplug.registry import Registry
from attnplug.testing.reference import reference_attention

DEV = "cuda"
#: Excess-error bound per query dtype (|out - ref| <= atol + rtol * |ref|), as in the conformance suite.
TOL = {torch.float16: (2e-2, 2e-2), torch.bfloat16: (4e-2, 4e-2)}
#: fp8 KV scales of the scaled cases: (k_scale, v_scale), neither 1 and different (a dropped or swapped scale fails)
FP8_SCALES = (0.04, 2.5)
FP8_TOL = (1.5e-1, 1.5e-1)  # the cache itself is rounded to e4m3; the reference reads the rounded cache


def problem(mode: ForwardMode, prefix: list[int], ext: list[int], *, heads: int = 8, kv_heads: int = 2,
            head_dim: int = 128, page_size: int = 16, dtype: torch.dtype = torch.bfloat16,
            kv_dtype: torch.dtype | None = None, kv_scales: tuple[float, float] = (1.0, 1.0), sinks: bool = False,
            window: int | None = None, seed: int = 0, tree: bool = False):
    g = torch.Generator().manual_seed(seed)
    seq = [p + e for p, e in zip(prefix, ext)]
    pages = sum(math.ceil(s / page_size) for s in seq) + 4
    cache = PagedKVCache(1, pages, kv_heads, head_dim, page_size=page_size, dtype=kv_dtype or dtype, device=DEV,
                         max_requests=len(seq) + 2, max_context_len=max(seq) + page_size)
    kb, vb = cache.get_kv(0)
    if cache.quantized:  # stored = round(x / scale): dequantized values ~ N(0, 1) whatever the scales
        cache.set_kv_scales(0, *kv_scales)
        kb.copy_(quantize(torch.randn(kb.shape, generator=g), kv_scales[0], kb.dtype).to(DEV))
        vb.copy_(quantize(torch.randn(vb.shape, generator=g), kv_scales[1], vb.dtype).to(DEV))
    else:
        kb.copy_(torch.randn(kb.shape, generator=g).to(kb.dtype).to(DEV))
        vb.copy_(torch.randn(vb.shape, generator=g).to(vb.dtype).to(DEV))
    alloc = PageAllocator(pages, shuffle=True, seed=seed)
    rows = list(range(len(seq)))
    for r, s in zip(rows, seq):
        cache.assign_pages(r, s, alloc.alloc(math.ceil(s / page_size)))
    loc = torch.cat([cache.req_to_token[r, p:s] for r, p, s in zip(rows, prefix, seq)])
    if mode is ForwardMode.DECODE:
        batch = ForwardBatch.decode(torch.tensor(rows, device=DEV), torch.tensor(seq, device=DEV), loc)
    else:
        spec: dict[str, Any] = {}
        if mode is ForwardMode.TARGET_VERIFY:  # ext[i] draft tokens each; ``tree``: a random tree mask
            d = ext[0]
            spec["spec_num_draft_tokens"] = d
            if tree:
                m = torch.rand(len(seq), d, d, generator=g) < 0.5
                spec["spec_custom_mask"] = ((m & torch.ones(d, d, dtype=torch.bool).tril())
                                            | torch.eye(d, dtype=torch.bool)).to(DEV)
        batch = ForwardBatch.extend(torch.tensor(rows, device=DEV), torch.tensor(prefix, device=DEV),
                                    torch.tensor(ext, device=DEV), loc, mode=mode, **spec)
    T = sum(ext)
    q = torch.randn(T, heads, head_dim, generator=g).to(dtype).to(DEV)
    k = torch.randn(T, kv_heads, head_dim, generator=g).to(dtype).to(DEV)
    v = torch.randn(T, kv_heads, head_dim, generator=g).to(dtype).to(DEV)
    snk = torch.randn(heads, generator=g).to(torch.bfloat16).float() if sinks else None
    layer = LayerSpec(0, heads, kv_heads, head_dim, sinks=snk, sliding_window=window)
    return dict(cache=cache, batch=batch, q=q, k=k, v=v, layer=layer, before=(kb.clone(), vb.clone()),
                page_size=page_size, dtype=dtype, kv_dtype=kv_dtype or dtype)


def build(reg: Registry, name: str, p: dict[str, Any], deterministic: bool = False):
    avail = reg.availability(name)
    if not avail:
        return None, "; ".join(avail.reasons)
    dt = {torch.float16: "float16", torch.bfloat16: "bfloat16"}[p["dtype"]]
    kv = {torch.float8_e4m3fn: "float8_e4m3fn"}.get(p["kv_dtype"], dt)
    layer = p["layer"]
    ctx = BuildContext(AttentionConfig(attention_backend=name, deterministic=deterministic), reg.host, dtype=dt,
                       kv_cache_dtype=kv, num_heads=layer.num_heads, num_kv_heads=layer.num_kv_heads,
                       head_dim=layer.head_dim, page_size=p["page_size"], kv_cache=p["cache"], device=DEV,
                       max_context_len=p["cache"].max_context_len, layers=(layer,))
    try:
        _, backend = reg.build(name, ctx)
    except NotSupportedError as exc:  # the declared capabilities refuse the layer on this host, in words
        return None, f"refused: {exc}"
    reasons = backend.not_supported_reasons(layer, ctx)
    return (None, "refused: " + "; ".join(reasons)) if reasons else (backend, "")


def run(backend: Any, p: dict[str, Any]) -> torch.Tensor:
    backend.init_forward_metadata(p["batch"])
    return backend.forward(p["q"], p["k"], p["v"], p["layer"], p["batch"])


def accuracy(reg: Registry, name: str, p: dict[str, Any]) -> tuple[str, str]:
    backend, why = build(reg, name, p)
    if backend is None:
        return "SKIP", why
    return compare(p, run(backend, p))


def compare(p: dict[str, Any], out: torch.Tensor) -> tuple[str, str]:
    """``out`` of ``p``'s forward against the float64 reference (the cache before the forward)."""
    kb, vb = p["before"]
    cache = p["cache"]
    # fp8: the stored values and the layer's scales (the reference dequantizes and quantizes new tokens)
    kc, vc = (kb.cpu(), vb.cpu()) if cache.quantized else (kb.cpu().double(), vb.cpu().double())
    ref = reference_attention(p["q"].cpu(), p["k"].cpu(), p["v"].cpu(), p["layer"], _cpu(p["batch"]),
                              kc, vc, cache.req_to_token.cpu(), *cache.kv_scales(0))
    atol, rtol = FP8_TOL if p["kv_dtype"] == torch.float8_e4m3fn else TOL[p["dtype"]]
    excess = float(((out.double().cpu() - ref).abs() - (atol + rtol * ref.abs())).max())
    return ("PASS" if excess <= 0 else "FAIL"), f"max excess error {excess:.3g}"


def verify_after_extend(reg: Registry) -> tuple[str, str]:
    """Issue 27 #4: one flashinfer backend runs an extend, then a tree target-verify (custom mask) over the
    same cache. With one shared eager prefill wrapper, flashinfer <= 0.6.4 kept the extend's FA3 choice on
    SM90 and the verify failed (cudaErrorNotSupported)."""
    p = problem(ForwardMode.TARGET_VERIFY, [40, 77], [4, 4], tree=True, seed=11)
    backend, why = build(reg, "flashinfer", p)
    if backend is None:
        return "SKIP", why
    # the extend: another batch over the same cache and rows (its own prefix), run first, not saved
    full = p["batch"]
    ext = ForwardBatch.extend(full.req_pool_indices, torch.tensor([0, 0], device=DEV),
                              torch.tensor([40, 77], device=DEV),
                              torch.cat([p["cache"].req_to_token[r, :n] for r, n in zip(range(2), (40, 77))]))
    qe = torch.randn(117, p["layer"].num_heads, p["layer"].head_dim, device=DEV, dtype=p["dtype"])
    ke = torch.randn(117, p["layer"].num_kv_heads, p["layer"].head_dim, device=DEV, dtype=p["dtype"])
    backend.init_forward_metadata(ext)
    backend.forward(qe, ke, ke.clone(), p["layer"], ext, save_kv_cache=False)
    torch.cuda.synchronize()
    status, detail = compare(p, run(backend, p))
    return status, f"verify after extend: {detail}"


def fa3_sinks_off_sm90(reg: Registry) -> tuple[str, str]:
    """Issue 27 #5: sgl-kernel's FA3 applies sinks on SM90 only. Off SM90 a sink layer must be refused and
    resolution (given the layer) must pick another backend; on SM90 the layer must match the reference."""
    from attnplug.resolution import trace

    p = problem(ForwardMode.DECODE, [40, 100], [1, 1], sinks=True, seed=13)
    if not reg.availability("fa3"):
        return "SKIP", "fa3 unavailable: " + "; ".join(reg.availability("fa3").reasons)
    backend, why = build(reg, "fa3", p)
    res = trace(AttentionConfig(dtype="bfloat16"), host=reg.host, registry=reg, layers=(p["layer"],))
    picked = f"resolution with the sink layer picks {res.pair if res.ok else 'nothing'}"
    if reg.host.sm() != 90:
        ok = backend is None and "sinks" in why and (not res.ok or "fa3" not in res.pair)
        return ("PASS" if ok else "FAIL"), f"SM{reg.host.sm()}: fa3 {why or 'accepted the sink layer'}; {picked}"
    if backend is None:
        return "FAIL", f"SM90 refused a sink layer: {why}"
    status, detail = compare(p, run(backend, p))
    return status, f"{detail}; {picked}"


def captured(reg: Registry, name: str, sinks: bool) -> tuple[str, str]:
    """Issue 27 #6: a real CUDA-graph capture of one decode with CPU-resident sinks (the layer's own tensor
    on the host). The capture hook runs before the captured region; the forward inside it must not copy
    the sinks to the device. ``sinks=False`` is the control: capture works at all for this backend."""
    p = problem(ForwardMode.DECODE, [40, 100], [1, 1], sinks=sinks, page_size=64 if name == "trtllm_mha" else 16,
                seed=17)
    if sinks:
        assert p["layer"].sinks.device.type == "cpu"
    backend, why = build(reg, name, p)
    if backend is None:
        return "SKIP", why
    batch = p["batch"]
    backend.init_cuda_graph_state(batch.batch_size, batch.batch_size)
    backend.init_forward_metadata_capture_cuda_graph(batch)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(p["q"], p["k"], p["v"], p["layer"], batch, save_kv_cache=False)
    backend.init_forward_metadata_replay_cuda_graph(batch)
    graph.replay()
    torch.cuda.synchronize()
    status, detail = compare(p, out)
    return status, f"captured and replayed: {detail}"


def determinism(reg: Registry, name: str) -> tuple[str, str]:
    """Request 0 alone and inside a batch of 8 (same cache): its output must be bitwise equal."""
    p = problem(ForwardMode.DECODE, [3000] + [200 * i + 7 for i in range(1, 8)], [1] * 8, seed=5)
    backend, why = build(reg, name, p, deterministic=True)
    if backend is None:
        return "SKIP", why
    batched = run(backend, p)[:1].clone()
    full = p["batch"]
    solo = dict(p, batch=ForwardBatch.decode(full.req_pool_indices[:1], full.seq_lens[:1], full.out_cache_loc[:1]),
                q=p["q"][:1], k=p["k"][:1], v=p["v"][:1])
    alone = run(backend, solo)
    same = torch.equal(alone, batched)
    return ("PASS" if same else "FAIL"), f"bitwise equal alone vs batched: {same}"


def _cpu(batch: ForwardBatch) -> ForwardBatch:
    if batch.forward_mode is ForwardMode.DECODE:
        return ForwardBatch.decode(batch.req_pool_indices.cpu(), batch.seq_lens.cpu(), batch.out_cache_loc.cpu())
    spec: dict[str, Any] = {}
    if batch.forward_mode is ForwardMode.TARGET_VERIFY:
        spec["spec_num_draft_tokens"] = batch.spec_num_draft_tokens
        if batch.spec_custom_mask is not None:
            spec["spec_custom_mask"] = batch.spec_custom_mask.cpu()
    return ForwardBatch.extend(batch.req_pool_indices.cpu(), batch.extend_prefix_lens.cpu(),
                               batch.extend_seq_lens.cpu(), batch.out_cache_loc.cpu(), mode=batch.forward_mode, **spec)


def cases() -> list[tuple[str, Any]]:
    D, E = ForwardMode.DECODE, ForwardMode.EXTEND
    out: list[tuple[str, Any]] = []
    for name in ("fa3", "trtllm_mha", "aiter", "flashinfer"):
        for mode, pre, ext in ((E, [0, 37], [21, 9]), (D, [40, 100], [1, 1])):
            out.append((f"sinks/{name}/{mode.value}",
                        lambda r, n=name, m=mode, a=pre, b=ext: accuracy(r, n, problem(m, a, b, sinks=True))))
    for ps in (16, 32, 64):
        for mode, pre, ext in ((E, [0, 37], [21, 9]), (D, [40, 100], [1, 1])):
            out.append((f"mqa/trtllm_mha/page{ps}/{mode.value}", lambda r, m=mode, a=pre, b=ext, s=ps: accuracy(
                r, "trtllm_mha", problem(m, a, b, kv_heads=1, page_size=s))))
    for name in ("flashinfer", "fa3"):
        for mode, pre, ext in ((E, [0, 37], [21, 9]), (D, [40, 100], [1, 1])):
            for tag, scales in (("", (1.0, 1.0)), ("/scaled", FP8_SCALES)):
                out.append((f"fp8kv/{name}/{mode.value}{tag}", lambda r, n=name, m=mode, a=pre, b=ext, s=scales:
                            accuracy(r, n, problem(m, a, b, kv_dtype=torch.float8_e4m3fn, kv_scales=s))))
    for name in ("flashinfer", "fa3"):
        out.append((f"deterministic/{name}", lambda r, n=name: determinism(r, n)))
    # issue 27: tensor-core decode on SM90 (fp8, determinism, a GQA group of 8 with one KV head)
    out.append(("issue27/flashinfer/decode_tc/fp8", lambda r: accuracy(r, "flashinfer", problem(
        D, [40, 100], [1, 1], kv_dtype=torch.float8_e4m3fn, kv_scales=FP8_SCALES))))
    out.append(("issue27/flashinfer/decode_tc/gqa8", lambda r: accuracy(r, "flashinfer", problem(
        D, [40, 100], [1, 1], heads=8, kv_heads=1))))
    out.append(("issue27/flashinfer/decode_tc/deterministic", lambda r: determinism(r, "flashinfer")))
    out.append(("issue27/flashinfer/verify_after_extend", verify_after_extend))
    out.append(("issue27/fa3/sinks_off_sm90", fa3_sinks_off_sm90))
    for name in ("fa3", "trtllm_mha", "aiter"):
        for snk in (False, True):
            out.append((f"issue27/captured/{name}/{'sinks' if snk else 'plain'}",
                        lambda r, n=name, s=snk: captured(r, n, s)))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("SKIP all: no CUDA device")
        return 0
    reg = Registry.discover()
    sm = reg.host.sm()
    print(f"host: {reg.host.describe()}")
    fi = reg.host.library_version("flashinfer-python")
    print(f"flashinfer-python {fi}: issue-27 #3 (decode auto -> FA3) bites 0.6.0-0.6.3, #4 (sticky auto) <= 0.6.4"
          if fi else "flashinfer-python not installed")
    results = []
    for label, fn in cases():
        needs_sm90 = label.startswith(("fp8kv/", "deterministic/", "issue27/flashinfer/"))
        if needs_sm90 and sm != 90:
            status, detail = "SKIP", f"the case is about SM90; this GPU is SM{sm}"
        else:
            try:
                status, detail = fn(reg)
            except Exception as exc:  # a case that raises is a failure, reported in words
                status, detail = "FAIL", f"{type(exc).__name__}: {exc}"
                traceback.print_exc(file=sys.stderr)
        print(f"{status:4} {label}: {detail}", flush=True)
        results.append({"case": label, "status": status, "detail": detail})
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"host": reg.host.describe(), "results": results}, fh, indent=1)
    return 1 if any(r["status"] == "FAIL" for r in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
