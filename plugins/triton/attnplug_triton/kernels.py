"""Triton kernels of the ``triton`` backend: paged attention over ``req_to_token``.

Imported only when the backend is built (``attnplug_triton.backend``). Set
``TRITON_INTERPRET=1`` *before* the first ``import triton`` to run them in
Triton's interpreter on CPU tensors.

One kernel serves every forward mode. A program owns one request, one KV head
and a block of that request's new tokens (``BLOCK_M``; 1 in decode), and
processes the query heads of the KV head's group together: its tile rows are
``(token, group head)`` pairs, so a K/V block is loaded once for the whole
group (GQA/MQA without expanding K/V). Keys come in two runs, in position
order:

* the cached prefix, positions ``0 … P-1``, read from the paged cache through
  ``req_to_token[request, position]`` (``P`` = ``extend_prefix_lens``, or
  ``encoder_lens`` for cross-attention);
* the new tokens, positions ``P …``, read from this forward's ``k``/``v``
  arguments (so the result does not depend on whether, or in which dtype,
  they were written to the cache), under the causal mask (or none for a
  bidirectional layer), the target-verify custom mask and the sliding window.

Scores are ``scale * q·k`` accumulated in float32 (``tl.dot`` in the input
dtype for fp16/bf16, IEEE fp32 for fp32), optionally soft-capped, and reduced
with an online softmax.

Garbage never enters: slots no request owns (padding slots, freed pages, this
forward's ``out_cache_loc`` before the core writes it) may hold anything, NaN
and inf included. The kernels read the cache only at positions ``< P`` of the
program's own request, and every load is masked with a neutral ``other``: the
``req_to_token`` index load itself (its entries past a request's length may be
``-1``), then the K/V rows it addresses. Masked scores are selected to
``-inf`` and a non-finite value is selected to zero before the product, the
rows that see such a value row set to NaN after it (``0 * NaN`` is NaN, so
masking never multiplies by zero: a later new token or a hidden draft that
holds garbage reaches no row it is hidden from).

Split-KV (decode): the key positions of a request are cut into splits of a
fixed ``split_len``; the program of split ``s`` covers positions
``[s * split_len, (s + 1) * split_len)`` and stores an unnormalised partial
(accumulator, running max, running sum), empty for a split past the request's
keys, and ``_combine_kernel`` merges them, adding the sink to the denominator
(an empty split, running max ``-inf``, is skipped by selection).
Decode always takes this path, even with one split, so a request's arithmetic
does not depend on how many splits the longest request of its batch needs.
Extend programs (``STORE_PARTIALS=False``) normalise and store directly.
Because the split length and block sizes are fixed per backend and layer
shape (never derived from the batch), a request's output is bit-identical
alone or in any batch.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _tanh(x):
    # tanh from exp, accurate in float32 for every x (no libdevice, works in the interpreter)
    t = tl.exp(-2.0 * tl.abs(x))
    y = (1.0 - t) / (1.0 + t)
    return tl.where(x < 0, -y, y)


@triton.jit
def _round(x, dtype: tl.constexpr):
    """float32 ``x`` in ``dtype``, rounded to nearest even. A GPU's conversion does that already;
    Triton's interpreter truncates a float32 -> bfloat16 cast (every output half an ulp low on
    average: the suite's ``rounding`` family), so for bfloat16 the rounding is done on the bits
    first (add 0x7FFF plus the kept lowest bit, clear the low half: exactly bf16-representable,
    so any conversion after it is exact; NaN kept as it is)."""
    if dtype == tl.bfloat16:
        u = x.to(tl.uint32, bitcast=True)
        u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
        x = tl.where(x != x, x, u.to(tl.float32, bitcast=True))
    return x.to(dtype)


@triton.jit
def _attend_block(
    q, k, v, acc, m_i, l_i, visible, scale, cap,
    HAS_CAP: tl.constexpr, FP32_DOT: tl.constexpr,
):
    """One key block: online-softmax update of ``acc``/``m_i``/``l_i``.

    Masking selects, never multiplies: a score no row may see becomes ``-inf`` by ``tl.where``
    (whatever ``q·k`` gave, NaN included), so its probability is exactly 0; and a non-finite
    value is replaced by zero before the product (``0 * NaN`` is NaN, and a key one row of the
    tile sees may be hidden from another: a later new token, a draft the tree mask hides), then
    the rows that *see* a key whose value row held one are set to NaN: garbage reaches exactly
    the rows that read it, as in the reference.
    """
    v_ok = tl.abs(v.to(tl.float32)) < float("inf")  # False for NaN and +-inf
    v = tl.where(v_ok, v, tl.zeros_like(v))
    v_bad = tl.max((v_ok == 0).to(tl.int32), 1) > 0  # [keys]: a value row holding NaN/inf
    reads_bad = tl.max((visible & v_bad[None, :]).to(tl.int32), 1) > 0  # [rows]
    if FP32_DOT:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = s * scale
    if HAS_CAP:
        s = cap * _tanh(s / cap)
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if FP32_DOT:
        pv = tl.dot(p, v, input_precision="ieee")
    else:
        pv = tl.dot(_round(p, v.dtype), v)
    acc = acc * alpha[:, None] + pv
    acc = tl.where(reads_bad[:, None], float("nan"), acc)
    return acc, m_new, l_i


@triton.jit
def _attn_kernel(
    Q, K_new, V_new, K_cache, V_cache, Req_to_token, Out, Part_acc, Part_m, Part_l, Sinks, Mask,
    Req, Q_start, Prefix_len, Ext_len,
    stride_qt, stride_qh, stride_knt, stride_knh, stride_vnt, stride_vnh,
    stride_kcs, stride_kch, stride_vcs, stride_vch, stride_r2t,
    stride_ot, stride_oh, stride_ps, stride_pt, stride_ph, stride_ms, stride_mt,
    stride_mask_b, stride_mask_a,
    scale, cap, window, split_len, num_splits, k_scale, v_scale,
    D: tl.constexpr, DV: tl.constexpr, G: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    STORE_PARTIALS: tl.constexpr, IS_CROSS: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_CAP: tl.constexpr,
    HAS_SINKS: tl.constexpr, HAS_MASK: tl.constexpr, FP32_DOT: tl.constexpr, KV_SCALED: tl.constexpr,
    IS_CAUSAL: tl.constexpr = True,
):
    i = tl.program_id(0)
    kvh = tl.program_id(1)
    pid2 = tl.program_id(2)
    mblock = pid2 // num_splits  # a runtime value: no recompilation as sequences grow
    split = pid2 % num_splits

    req = tl.load(Req + i)
    q_start = tl.load(Q_start + i)
    P = tl.load(Prefix_len + i)  # keys read from the cache (cached prefix, or the encoder tokens)
    E = tl.load(Ext_len + i)  # new tokens (queries) of this request
    a0 = mblock * BLOCK_M

    rows = tl.arange(0, BLOCK_R)
    tok = a0 + rows // G  # the row's token, counted from the request's first new token
    head = kvh * G + rows % G
    row_ok = (rows < BLOCK_M * G) & (tok < E)
    qpos = P + tok  # the row's position
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_n = tl.arange(0, BLOCK_N)

    q = tl.load(
        Q + (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=row_ok[:, None] & (offs_d[None, :] < D), other=0.0,
    )
    if FP32_DOT:  # fp32 models; and bf16 in the interpreter, whose tl.dot cannot multiply bf16
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_DV], tl.float32)

    # keys this program may see: [lo, hi) by position, cut to its split
    a_last = tl.minimum(a0 + BLOCK_M, E)  # one past the block's last token
    if IS_CROSS:
        lo = 0
        hi = P
    else:
        hi = P + a_last
        lo = 0
        if HAS_WINDOW:
            lo = tl.maximum(P + a0 - window, 0)
        if not IS_CAUSAL:  # bidirectional: later new tokens too, up to the window past the block's last row
            hi = P + E
            if HAS_WINDOW:
                hi = tl.minimum(hi, P + a_last + window)
    s_lo = split * split_len
    s_hi = s_lo + split_len
    lo = tl.maximum(lo, s_lo)
    hi = tl.minimum(hi, s_hi)
    hi = tl.where(a0 < E, hi, lo)  # a block past the request's tokens sees nothing (still stores its partial)

    # 1) the cached run: positions [lo, min(hi, P)) through req_to_token
    c_hi = tl.minimum(hi, P)
    for n0 in range(lo, c_hi, BLOCK_N):
        kpos = n0 + offs_n
        k_ok = kpos < c_hi
        slot = tl.load(Req_to_token + req * stride_r2t + kpos, mask=k_ok, other=0)
        k = tl.load(
            K_cache + slot[:, None] * stride_kcs + kvh * stride_kch + offs_d[None, :],
            mask=k_ok[:, None] & (offs_d[None, :] < D), other=0.0,
        )
        v = tl.load(
            V_cache + slot[:, None] * stride_vcs + kvh * stride_vch + offs_dv[None, :],
            mask=k_ok[:, None] & (offs_dv[None, :] < DV), other=0.0,
        )
        if KV_SCALED:  # an fp8 cache: dequantize this block only (stored * scale, in float32)
            k = _round(k.to(tl.float32) * k_scale, q.dtype)
            v = _round(v.to(tl.float32) * v_scale, q.dtype)
        k = k.to(q.dtype)
        v = v.to(q.dtype)
        visible = row_ok[:, None] & k_ok[None, :]
        if not IS_CROSS:
            if HAS_WINDOW:
                visible = visible & (kpos[None, :] >= qpos[:, None] - window)
        acc, m_i, l_i = _attend_block(q, k, v, acc, m_i, l_i, visible, scale, cap, HAS_CAP, FP32_DOT)

    # 2) the new run: positions [max(lo, P), hi) from this forward's k/v, causal
    if not IS_CROSS:
        n_lo = tl.maximum(lo, P)
        for n0 in range(n_lo, hi, BLOCK_N):
            kpos = n0 + offs_n
            k_ok = kpos < hi
            t = q_start + (kpos - P)
            k = tl.load(
                K_new + t[:, None] * stride_knt + kvh * stride_knh + offs_d[None, :],
                mask=k_ok[:, None] & (offs_d[None, :] < D), other=0.0,
            ).to(q.dtype)
            v = tl.load(
                V_new + t[:, None] * stride_vnt + kvh * stride_vnh + offs_dv[None, :],
                mask=k_ok[:, None] & (offs_dv[None, :] < DV), other=0.0,
            ).to(q.dtype)
            visible = row_ok[:, None] & k_ok[None, :]
            if IS_CAUSAL:
                visible = visible & (kpos[None, :] <= qpos[:, None])
            elif HAS_WINDOW:
                visible = visible & (kpos[None, :] <= qpos[:, None] + window)
            if HAS_WINDOW:
                visible = visible & (kpos[None, :] >= qpos[:, None] - window)
            if HAS_MASK:
                bits = tl.load(
                    Mask + i * stride_mask_b + tok[:, None] * stride_mask_a + (kpos - P)[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0,
                )
                visible = visible & (bits != 0)
            acc, m_i, l_i = _attend_block(q, k, v, acc, m_i, l_i, visible, scale, cap, HAS_CAP, FP32_DOT)

    if not STORE_PARTIALS:
        if HAS_SINKS:
            sink = tl.load(Sinks + head, mask=row_ok, other=0.0).to(tl.float32)
            m_f = tl.maximum(m_i, sink)
            w = tl.exp(m_i - m_f)
            l_i = l_i * w + tl.exp(sink - m_f)
            acc = acc * w[:, None]
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            Out + (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh + offs_dv[None, :],
            _round(out, Out.dtype.element_ty), mask=row_ok[:, None] & (offs_dv[None, :] < DV),
        )
    else:
        t_row = q_start + tok
        tl.store(
            Part_acc + split * stride_ps + t_row[:, None] * stride_pt + head[:, None] * stride_ph
            + offs_dv[None, :],
            acc, mask=row_ok[:, None] & (offs_dv[None, :] < DV),
        )
        tl.store(Part_m + split * stride_ms + t_row * stride_mt + head, m_i, mask=row_ok)
        tl.store(Part_l + split * stride_ms + t_row * stride_mt + head, l_i, mask=row_ok)


@triton.jit
def _combine_kernel(
    Part_acc, Part_m, Part_l, Sinks, Out,
    stride_ps, stride_pt, stride_ph, stride_ms, stride_mt, stride_ot, stride_oh, num_splits,
    H: tl.constexpr, DV: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    """Merge the split partials of one token (all heads): out = sum(w acc) / (sum(w l) + sink term)."""
    t = tl.program_id(0)
    offs_h = tl.arange(0, BLOCK_H)
    offs_dv = tl.arange(0, BLOCK_DV)
    h_ok = offs_h < H
    tile_ok = h_ok[:, None] & (offs_dv[None, :] < DV)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    for s in range(num_splits):
        m = tl.maximum(m, tl.load(Part_m + s * stride_ms + t * stride_mt + offs_h, mask=h_ok,
                                  other=float("-inf")))
    if HAS_SINKS:
        sink = tl.load(Sinks + offs_h, mask=h_ok, other=0.0).to(tl.float32)
        m = tl.maximum(m, sink)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    num = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
    den = tl.zeros([BLOCK_H], tl.float32)
    for s in range(num_splits):
        ms = tl.load(Part_m + s * stride_ms + t * stride_mt + offs_h, mask=h_ok, other=float("-inf"))
        ls = tl.load(Part_l + s * stride_ms + t * stride_mt + offs_h, mask=h_ok, other=0.0)
        # a split that saw no key (past the request's end, or before its window) has max -inf:
        # its partial is skipped by selection, never weighted by exp(-inf) = 0
        live = ms > float("-inf")
        a = tl.load(Part_acc + s * stride_ps + t * stride_pt + offs_h[:, None] * stride_ph + offs_dv[None, :],
                    mask=tile_ok & live[:, None], other=0.0)
        w = tl.exp(tl.where(live, ms, m_safe) - m_safe)
        num = num + tl.where(live[:, None], w[:, None] * a, 0.0)
        den = den + tl.where(live, w * ls, 0.0)
    if HAS_SINKS:
        den = den + tl.exp(sink - m_safe)
    out = num / tl.where(den > 0, den, 1.0)[:, None]
    tl.store(Out + t * stride_ot + offs_h[:, None] * stride_oh + offs_dv[None, :], _round(out, Out.dtype.element_ty),
             mask=tile_ok)


#: Whether these kernels run in Triton's interpreter. Triton decides when ``@triton.jit`` runs,
#: i.e. when this module is first imported, from ``TRITON_INTERPRET`` at that moment.
INTERPRETED: bool = type(_attn_kernel).__name__ == "InterpretedFunction"


@triton.jit
def _mla_decompress_kernel(
    Lat, Wkc, Wvc, K_out, V_out, Slots, n_rows,
    stride_ls, stride_wkh, stride_wkn, stride_wvh, stride_wvr,
    stride_kt, stride_kh, stride_vt, stride_vh, lat_scale,
    R: tl.constexpr, NOPE: tl.constexpr, ROPE: tl.constexpr, DV: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_NOPE: tl.constexpr, BLOCK_ROPE: tl.constexpr,
    BLOCK_DV: tl.constexpr, GATHER: tl.constexpr, SCALED: tl.constexpr, FP32_DOT: tl.constexpr,
):
    """MLA unabsorbed form: the per-head keys and values of ``n_rows`` latent rows ``c_kv ++ k_pe``.

    Program ``(block of rows, head h)``: ``K_out[row, h] = [c_kv @ w_kc[h]^T, k_pe]`` (``NOPE + ROPE``
    wide) and ``V_out[row, h] = c_kv @ w_vc[h]`` (``DV`` wide), products accumulated in float32 and
    rounded once to the output dtype (what an engine's ``kv_b_proj`` GEMM does). Rows are read at
    ``Slots[row]`` (``GATHER``: a cache's slots) or at ``row`` (this forward's new latent rows); an fp8
    latent is dequantized first (stored * ``lat_scale``). A NaN/inf in a latent row reaches exactly
    that row's keys and values (no masking multiplies it into another row)."""
    nb = tl.program_id(0)
    h = tl.program_id(1)
    rows = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = rows < n_rows
    if GATHER:
        src = tl.load(Slots + rows, mask=ok, other=0)
    else:
        src = rows
    offs_r = tl.arange(0, BLOCK_R)
    offs_n = tl.arange(0, BLOCK_NOPE)
    offs_p = tl.arange(0, BLOCK_ROPE)
    offs_v = tl.arange(0, BLOCK_DV)
    c = tl.load(Lat + src[:, None] * stride_ls + offs_r[None, :], mask=ok[:, None] & (offs_r[None, :] < R),
                other=0.0)
    pe = tl.load(Lat + src[:, None] * stride_ls + R + offs_p[None, :],
                 mask=ok[:, None] & (offs_p[None, :] < ROPE), other=0.0)
    if SCALED:
        c = _round(c.to(tl.float32) * lat_scale, K_out.dtype.element_ty)
        pe = _round(pe.to(tl.float32) * lat_scale, K_out.dtype.element_ty)
    wk = tl.load(Wkc + h * stride_wkh + offs_n[:, None] * stride_wkn + offs_r[None, :],
                 mask=(offs_n[:, None] < NOPE) & (offs_r[None, :] < R), other=0.0)  # [NOPE, R]
    wv = tl.load(Wvc + h * stride_wvh + offs_r[:, None] * stride_wvr + offs_v[None, :],
                 mask=(offs_r[:, None] < R) & (offs_v[None, :] < DV), other=0.0)  # [R, DV]
    c = c.to(K_out.dtype.element_ty)
    if FP32_DOT:
        c = c.to(tl.float32)
        k_nope = tl.dot(c, tl.trans(wk.to(tl.float32)), input_precision="ieee")
        val = tl.dot(c, wv.to(tl.float32), input_precision="ieee")
    else:
        k_nope = tl.dot(c, tl.trans(wk.to(c.dtype)))
        val = tl.dot(c, wv.to(c.dtype))
    out_ty = K_out.dtype.element_ty
    tl.store(K_out + rows[:, None] * stride_kt + h * stride_kh + offs_n[None, :], _round(k_nope, out_ty),
             mask=ok[:, None] & (offs_n[None, :] < NOPE))
    tl.store(K_out + rows[:, None] * stride_kt + h * stride_kh + NOPE + offs_p[None, :], pe.to(out_ty),
             mask=ok[:, None] & (offs_p[None, :] < ROPE))
    tl.store(V_out + rows[:, None] * stride_vt + h * stride_vh + offs_v[None, :], _round(val, out_ty),
             mask=ok[:, None] & (offs_v[None, :] < DV))
