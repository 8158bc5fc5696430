"""Kernel module of the ``torch_native`` backend: exact paged attention in plain PyTorch.

Imported only when the backend is built (the descriptor module stays light).
Semantics are those of ``attnplug.testing.reference``; the computation runs in
float32 (fp16/bf16 inputs are upcast) and the output has the input dtype.

Layout of the work
------------------

``init_forward_metadata(batch)`` runs once per forward and builds what every
layer needs (padded slot indices through ``req_to_token``, padding masks,
per-request offsets, target-verify masks). Tensors that also depend on a
per-layer property (sliding window, KV-head count, decode block size) are
derived from it on first use and memoised, so each is built at most once per
forward whatever the number of layers.

**Decode** is vectorised across the batch: no per-request Python loop. The
K/V of every request are gathered through ``req_to_token`` with one
``index_select`` (token rows of ``kv_heads * head_dim``) into a reused,
padded workspace laid out ``[max_len, requests, kv_heads, head_dim]``; in it
each ``(request, kv_head)`` pair is an ``[max_len, head_dim]`` matrix at a
uniform stride, so one ``baddbmm`` scores the ``num_heads // num_kv_heads``
query heads of every group at once (q viewed ``[B * kv_heads, group, dim]``,
no GQA expand copy), a masked softmax follows, and one ``bmm`` against the
gathered values. Fused path (the usual case: the forward wrote the new token
to the cache in the model dtype, at the slot ``req_to_token`` maps its
position to): the new token is read back with the rest. Otherwise (no write,
a cache dtype other than the model's, attention sinks, a slot not mapped yet)
the new token's score is one extra column taken from the ``k``/``v``
arguments, with a hand-written softmax that adds the sink to the denominator.

On CPU the batch is processed in blocks of requests holding about
``decode_block_bytes`` of gathered K (default 16 MiB), so the workspace stays
in cache between the gather and the matmul that reads it (measured ~25%
faster than one whole-batch gather at batch 32 x 1024 tokens). The loop runs
over blocks, never over single requests unless one request alone fills a
block; a small batch is one block. ``decode_block_bytes=None`` (the default
off CPU) gathers the whole batch into one ``[max_len, B, ...]`` workspace.

**Extend** (EXTEND, MIXED, TARGET_VERIFY, DRAFT_EXTEND, DRAFT_EXTEND_V2)
assembles every request's keys (cached prefix + new tokens) in one reused
workspace with two index operations per layer, then runs a bounded loop over
requests: one ``bmm`` per request for the scores of all heads, the per-request
mask (causal by position, sliding window, target-verify custom mask) built in
``init_forward_metadata``, and one ``bmm`` for the values.

Workspaces are grown on demand (geometrically) and reused by every layer and
every forward.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from attnplug.backend import AttentionBackend, MetadataGuard
from attnplug.batch import check_qkv
from attnplug.errors import AttnplugError, ShapeError
from attnplug import ForwardMode

from . import CAPABILITIES, NAME

#: Gathered K bytes per decode block on CPU: small enough to stay in cache between the gather
#: and the matmul reading it, large enough to keep the number of ops per layer low.
DEFAULT_DECODE_BLOCK_BYTES = 16 << 20

_F32 = torch.float32


def create(ctx: Any) -> tuple[str, "TorchNativeBackend"]:
    """Factory named by the descriptor: ``(effective_name, backend)``."""
    return NAME, TorchNativeBackend(ctx)


class Workspace:
    """Flat buffers keyed by ``(name, dtype)``, grown on demand and reused.

    ``grows`` counts allocations, so tests can check that layers and repeated
    forwards reuse the buffers instead of allocating.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._buffers: dict[tuple[str, torch.dtype], torch.Tensor] = {}
        self.grows = 0

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        n = math.prod(shape)
        key = (name, dtype)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < n:
            old = 0 if buf is None else buf.numel()
            self._buffers.pop(key, None)
            buf = torch.empty(max(n, old + old // 2, 1), dtype=dtype, device=self.device)
            self._buffers[key] = buf
            self.grows += 1
        return buf[:n].view(shape)

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())


# ---------------------------------------------------------------------------
# per-forward metadata
# ---------------------------------------------------------------------------


class _Padded:
    """Padded slot indices of the first ``lens[i]`` positions of every request.

    ``slots`` is ``[B, L]`` (padding points at slot 0, masked), ``invalid`` is
    ``[B, L]`` (True where ``j >= lens[i]``). Derived tensors are memoised.
    """

    def __init__(self, req_to_token: torch.Tensor, req: torch.Tensor, lens: torch.Tensor, max_len: int) -> None:
        self.lens = lens
        self.max_len = max_len
        device = req.device
        pos = torch.arange(max_len, device=device)
        self.invalid = pos[None, :] >= lens[:, None]  # [B, L]
        rows = req_to_token[:, :max_len].index_select(0, req)  # only the columns in use
        self.slots = rows.masked_fill(self.invalid, 0)
        self.pos = pos
        self._memo: dict[Any, Any] = {}

    def block_index(self, per_block: int) -> torch.Tensor:
        """Slot indices, block after block of ``per_block`` requests, position-major inside a block.

        Block ``j`` (requests ``b0 … b1-1``) is ``index[b0 * L : b1 * L]`` and lists, for each
        position ``l``, the slots of its requests: gathered token rows then form an
        ``[L, requests, kv_heads, dim]`` workspace in which every ``(request, kv_head)`` row is
        one ``[L, dim]`` matrix at a uniform stride (one ``bmm`` for the block, no copy).
        """
        key = ("index", per_block)
        if key not in self._memo:
            B = self.slots.shape[0]
            parts = [self.slots[b0:b0 + per_block].t().reshape(-1) for b0 in range(0, B, per_block)]
            self._memo[key] = torch.cat(parts) if parts else self.slots.reshape(-1)
        return self._memo[key]

    def row_mask(self, num_kv_heads: int, window: int | None, query_pos: torch.Tensor | None) -> torch.Tensor | None:
        """``[B * Hkv, 1, L]``: True where the key is hidden from the row's queries; ``None`` if nothing is."""
        key = ("mask", num_kv_heads, window)
        if key not in self._memo:
            hidden = self.invalid
            if window is not None and query_pos is not None:
                hidden = hidden | (self.pos[None, :] < (query_pos - window)[:, None])
            mask = None
            if bool(hidden.any()):
                mask = hidden.repeat_interleave(num_kv_heads, dim=0).unsqueeze(1).contiguous()
            self._memo[key] = mask
        return self._memo[key]


class DecodeMetadata:
    """One decode forward.

    Two views of every request's keys, each built on first use and then shared
    by every layer: ``with_new`` covers positions ``0 … seq-1`` (the fused path:
    the token being decoded is read back from the cache, where this forward
    wrote it), ``prefix`` covers ``0 … seq-2`` (the general path: the new token
    comes from the ``k``/``v`` arguments). ``new_in_cache`` says whether
    ``req_to_token`` maps each request's last position to its ``out_cache_loc``
    slot, which the fused path needs.
    """

    kind = "decode"

    def __init__(self, batch: Any, req_to_token: torch.Tensor) -> None:
        device = req_to_token.device
        self.batch_size = batch.batch_size
        self.req = batch.req_pool_indices.to(device)
        self.seq = batch.seq_lens.to(device)
        self.prefix = self.seq - 1  # position of the token being decoded = cached length before it
        self.max_seq = max(batch.seq_lens_cpu, default=1)
        last = req_to_token[self.req, self.prefix] if self.batch_size else self.prefix
        self.new_in_cache = bool(torch.equal(last, batch.out_cache_loc.to(device)))
        self._req_to_token = req_to_token
        self._batch = batch
        self._views: dict[str, _Padded] = {}

    def keys(self, which: str) -> _Padded:
        view = self._views.get(which)
        if view is None:
            r2t = self._req_to_token
            if which == "with_new":
                view = _Padded(r2t, self.req, self.seq, self.max_seq)
            elif which == "prefix":
                view = _Padded(r2t, self.req, self.prefix, self.max_seq - 1)
            else:  # cross-attention: the encoder tokens at positions 0 … enc-1
                enc = self._batch.encoder_lens
                if enc is None:
                    raise ShapeError("cross-attention layer but ForwardBatch.encoder_lens is None")
                enc = enc.to(r2t.device)
                view = _Padded(r2t, self.req, enc, int(enc.max()) if len(enc) else 0)
            self._views[which] = view
        return view


class ExtendMetadata:
    """One extend-shaped forward: per-request offsets, slot indices and visibility masks."""

    kind = "extend"

    def __init__(self, batch: Any, req_to_token: torch.Tensor) -> None:
        device = req_to_token.device
        self._batch = batch
        self._req_to_token = req_to_token
        self.prefix = list(batch.extend_prefix_lens_cpu)
        self.ext = list(batch.extend_seq_lens_cpu)
        self.seq = list(batch.seq_lens_cpu)
        self.req = batch.req_pool_indices.tolist()
        self.num_tokens = sum(self.ext)
        self.total_kv = sum(self.seq)
        # Keys of request i occupy rows kv_off[i] … kv_off[i] + seq[i] - 1 of the key workspace:
        # its cached prefix first, then its new tokens.
        self.q_off, self.kv_off = [], []
        t = o = 0
        src, dst_prefix, dst_new = [], [], []
        for r, p, e in zip(self.req, self.prefix, self.ext):
            self.q_off.append(t)
            self.kv_off.append(o)
            if p:
                src.append(req_to_token[r, :p])
                dst_prefix.append(torch.arange(o, o + p, device=device))
            if e:
                dst_new.append(torch.arange(o + p, o + p + e, device=device))
            t += e
            o += p + e
        empty = torch.zeros(0, dtype=torch.int64, device=device)
        self.prefix_src = torch.cat(src) if src else empty
        self.prefix_dst = torch.cat(dst_prefix) if dst_prefix else empty
        self.new_dst = torch.cat(dst_new) if dst_new else empty
        self.custom_mask = None
        if batch.forward_mode is ForwardMode.TARGET_VERIFY and batch.spec_custom_mask is not None:
            self.custom_mask = batch.spec_custom_mask.to(device=device, dtype=torch.bool)
        self._device = device
        self._hidden: dict[int | None, list[torch.Tensor]] = {}
        self._cross: tuple[torch.Tensor, list[int], list[int]] | None = None

    def hidden(self, window: int | None) -> list[torch.Tensor]:
        """Per request, ``[ext, seq]`` bool: True where key ``j`` is hidden from query ``a``."""
        if window not in self._hidden:
            masks = []
            for i, (p, e, s) in enumerate(zip(self.prefix, self.ext, self.seq)):
                qpos = torch.arange(p, p + e, device=self._device)[:, None]
                kpos = torch.arange(s, device=self._device)[None, :]
                hidden = kpos > qpos
                if window is not None:
                    hidden |= kpos < qpos - window
                if self.custom_mask is not None and e:
                    hidden[:, p:] |= ~self.custom_mask[i, :e, :e]
                masks.append(hidden)
            self._hidden[window] = masks
        return self._hidden[window]

    def cross(self) -> tuple[torch.Tensor, list[int], list[int]]:
        """Slots of every request's encoder tokens (concatenated), their offsets and lengths."""
        if self._cross is None:
            enc_t = self._batch.encoder_lens
            if enc_t is None:
                raise ShapeError("cross-attention layer but ForwardBatch.encoder_lens is None")
            enc = [int(x) for x in enc_t.tolist()]
            parts, offs, o = [], [], 0
            for r, n in zip(self.req, enc):
                offs.append(o)
                if n:
                    parts.append(self._req_to_token[r, :n])
                o += n
            slots = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64, device=self._device)
            self._cross = (slots, offs, enc)
        return self._cross


# ---------------------------------------------------------------------------
# the backend
# ---------------------------------------------------------------------------


class TorchNativeBackend(AttentionBackend):
    """Exact paged attention in plain PyTorch (the reference CPU backend)."""

    capabilities = CAPABILITIES

    def __init__(
        self, ctx: Any, decode_block_bytes: int | None | str = "auto", extend_score_bytes: int = 64 << 20
    ) -> None:
        self.ctx = ctx
        #: bound on one extend chunk's float32 scores (queries are chunked to fit)
        self.extend_score_bytes = extend_score_bytes
        self.kv_cache = ctx.kv_cache
        self.device = torch.device(ctx.device if ctx.kv_cache is None else ctx.kv_cache.device)
        if decode_block_bytes == "auto":
            decode_block_bytes = DEFAULT_DECODE_BLOCK_BYTES if self.device.type == "cpu" else None
        self.decode_block_bytes: int | None = decode_block_bytes  # type: ignore[assignment]
        self.workspace = Workspace(self.device)
        self._guard = MetadataGuard(NAME)
        #: how many times ``init_forward_metadata`` built metadata (tests: once per forward)
        self.metadata_builds = 0

    # -- metadata --------------------------------------------------------
    def init_forward_metadata(self, batch: Any) -> None:
        mode = batch.forward_mode
        if mode is ForwardMode.IDLE:
            meta: Any = None
        else:
            r2t = self._cache().req_to_token
            meta = DecodeMetadata(batch, r2t) if mode is ForwardMode.DECODE else ExtendMetadata(batch, r2t)
        self.metadata_builds += 1
        self._guard.set(batch, meta)

    # -- forward -----------------------------------------------------------
    def forward_extend(self, q: Any, k: Any, v: Any, layer: Any, batch: Any, save_kv_cache: bool = True) -> Any:
        meta = self._guard.require(batch)
        if meta is None:  # idle
            return q.new_empty((0, layer.num_heads, layer.v_head_dim))
        self._check(q, k, v, layer, batch)
        saved = self._save(k, v, layer, batch, save_kv_cache)
        if meta.kind == "decode":
            return self._decode(q, k, v, layer, meta, saved)
        return self._extend(q, k, v, layer, meta)

    def forward_decode(self, q: Any, k: Any, v: Any, layer: Any, batch: Any, save_kv_cache: bool = True) -> Any:
        meta = self._guard.require(batch)
        if meta is None:
            return q.new_empty((0, layer.num_heads, layer.v_head_dim))
        self._check(q, k, v, layer, batch)
        saved = self._save(k, v, layer, batch, save_kv_cache)
        if meta.kind == "extend":
            return self._extend(q, k, v, layer, meta)
        return self._decode(q, k, v, layer, meta, saved)

    # -- helpers -----------------------------------------------------------
    def _cache(self) -> Any:
        if self.kv_cache is None:
            raise AttnplugError(
                "torch_native was built without a KV cache (BuildContext.kv_cache is None); "
                "build it with the engine's PagedKVCache to run forwards"
            )
        return self.kv_cache

    def _check(self, q: Any, k: Any, v: Any, layer: Any, batch: Any) -> None:
        check_qkv(q, k, v, layer, batch.num_tokens)
        if k is None and not layer.is_cross_attention:
            raise ShapeError(
                f"k and v are None for self-attention layer {layer.layer_id}; "
                f"only cross-attention layers may omit them"
            )
        kb, vb = self._cache().get_kv(layer.layer_id)
        if tuple(kb.shape[1:]) != (layer.num_kv_heads, layer.head_dim) or tuple(vb.shape[1:]) != (
            layer.num_kv_heads, layer.v_head_dim
        ):
            raise ShapeError(
                f"kv_cache rows for layer {layer.layer_id} are k {tuple(kb.shape[1:])} / v {tuple(vb.shape[1:])}, "
                f"expected ({layer.num_kv_heads}, {layer.head_dim}) / ({layer.num_kv_heads}, {layer.v_head_dim})"
            )

    def _save(self, k: Any, v: Any, layer: Any, batch: Any, save_kv_cache: bool) -> bool:
        """Write the new K/V at ``out_cache_loc`` (self-attention only); True when written."""
        if save_kv_cache and k is not None and not layer.is_cross_attention and batch.num_tokens:
            self._cache().set_kv(layer.layer_id, batch.out_cache_loc, k, v)
            return True
        return False

    @staticmethod
    def _sinks(layer: Any, device: torch.device) -> torch.Tensor | None:
        if layer.sinks is None:
            return None
        return torch.as_tensor(layer.sinks).detach().to(device=device, dtype=_F32).reshape(
            layer.num_kv_heads, layer.gqa_group_size
        )

    @staticmethod
    def _rows(buf: torch.Tensor, width: int) -> torch.Tensor:
        """``buf`` as a 2-D ``[-1, width]`` tensor (a view of the cache; a copy only if it is not contiguous)."""
        return buf.view(-1, width) if buf.is_contiguous() else buf.reshape(-1, width)

    def _gather(self, name: str, src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """Rows ``index`` of the 2-D ``src``, as float32, in a reused workspace.

        A non-fp32 cache is gathered into a second reused buffer of its own
        dtype and converted into the float32 one.
        """
        n, width = index.numel(), src.shape[1]
        out = self.workspace.get(name, (n, width), _F32)
        if src.dtype == _F32:
            torch.index_select(src, 0, index, out=out)
        else:
            raw = self.workspace.get(name + ".raw", (n, width), src.dtype)
            torch.index_select(src, 0, index, out=raw)
            out.copy_(raw)
        return out

    # -- decode: vectorised over the batch ---------------------------------
    def _decode(self, q: torch.Tensor, k: Any, v: Any, layer: Any, meta: DecodeMetadata, saved: bool) -> torch.Tensor:
        B = meta.batch_size
        H, Hkv, G = layer.num_heads, layer.num_kv_heads, layer.gqa_group_size
        D, Dv = layer.head_dim, layer.v_head_dim
        cross = layer.is_cross_attention
        rows = B * Hkv
        kb, vb = self._cache().get_kv(layer.layer_id)
        cap = layer.logit_cap or None
        sinks = self._sinks(layer, q.device)
        # Fused path: the new token was just written to the cache in the model dtype, so the
        # gather reads it back bit-exactly and one softmax covers everything.
        fused = (not cross and saved and sinks is None and meta.new_in_cache
                 and kb.dtype == q.dtype and vb.dtype == q.dtype)
        keys = meta.keys("cross" if cross else "with_new" if fused else "prefix")
        L = keys.max_len
        window = None if cross else layer.sliding_window
        hidden = keys.row_mask(Hkv, window, meta.prefix if window is not None else None) if L else None

        # queries as [rows, G, D]: query head h = kv * G + g uses KV head kv (no GQA expand copy)
        qs = q.to(_F32).reshape(rows, G, D)
        scale = layer.scaling
        sink_rows = None if sinks is None else sinks.unsqueeze(0).expand(B, Hkv, G).reshape(rows, G)

        # general path: score of the token being decoded, from the arguments (always visible)
        s_new = v_new = None
        if not cross and not fused:
            k_new = k.to(_F32).reshape(rows, 1, D)
            v_new = v.to(_F32).reshape(rows, 1, Dv)
            s_new = torch.bmm(qs, k_new.transpose(1, 2)).squeeze(2).mul_(scale)  # [rows, G]
            if cap:
                s_new = torch.tanh(s_new / cap) * cap

        out32 = torch.empty(rows, G, Dv, dtype=_F32, device=q.device)
        if L == 0:
            m = _maximum(s_new, sink_rows, like=out32[:, :, 0])
            out32.zero_()
            self._finish(out32, torch.zeros_like(m), m, s_new, v_new, sink_rows)
            return out32.view(B, H, Dv).to(q.dtype)

        ktok, vtok = self._rows(kb, Hkv * D), self._rows(vb, Hkv * Dv)  # [slots, Hkv * dim]: token rows
        per_block = B
        if self.decode_block_bytes:
            per_block = max(1, min(B, self.decode_block_bytes // (L * Hkv * max(D, Dv) * 4)))
        index = keys.block_index(per_block)
        for b0 in range(0, B, per_block):
            b1 = min(B, b0 + per_block)
            r0, r1 = b0 * Hkv, b1 * Hkv
            n = r1 - r0
            idx = index[b0 * L:b1 * L]
            # [L, requests in block, Hkv, D] workspace; row (request, kv_head) is an [L, D] matrix at stride D
            K = self._gather("dec.k", ktok, idx).as_strided((n, L, D), (D, n * D, 1))
            S = self.workspace.get("dec.s", (n, G, L), _F32)
            torch.baddbmm(S, qs[r0:r1], K.transpose(1, 2), beta=0.0, alpha=scale, out=S)  # scaled scores
            if cap:
                S.div_(cap).tanh_().mul_(cap)
            if hidden is not None:
                S.masked_fill_(hidden[r0:r1], -math.inf)
            if fused:
                P = torch.softmax(S, dim=2, out=self.workspace.get("dec.p", (n, G, L), _F32))
                V = self._gather("dec.v", vtok, idx).as_strided((n, L, Dv), (Dv, n * Dv, 1))
                torch.bmm(P, V, out=out32[r0:r1])
                continue
            m = _maximum(S.amax(dim=2), None if s_new is None else s_new[r0:r1],
                         None if sink_rows is None else sink_rows[r0:r1])
            m = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # rows with nothing visible
            S.sub_(m.unsqueeze(2)).exp_()
            den = S.sum(dim=2)
            V = self._gather("dec.v", vtok, idx).as_strided((n, L, Dv), (Dv, n * Dv, 1))
            torch.bmm(S, V, out=out32[r0:r1])
            self._finish(
                out32[r0:r1], den, m,
                None if s_new is None else s_new[r0:r1],
                None if v_new is None else v_new[r0:r1],
                None if sink_rows is None else sink_rows[r0:r1],
            )
        return out32.view(B, H, Dv).to(q.dtype)

    @staticmethod
    def _finish(
        out: torch.Tensor, den: torch.Tensor, m: torch.Tensor, s_new: Any, v_new: Any, sink: Any
    ) -> None:
        """Add the new token's term and the sink to the denominator, then normalise ``out`` in place."""
        if s_new is not None:
            w = torch.exp(s_new - m)
            out.add_(w.unsqueeze(2) * v_new)
            den = den + w
        if sink is not None:
            den = den + torch.exp(sink - m)
        out.div_(den.clamp_min(torch.finfo(_F32).tiny).unsqueeze(2))

    # -- extend: keys assembled once per layer, bounded loop over requests --
    def _extend(self, q: torch.Tensor, k: Any, v: Any, layer: Any, meta: ExtendMetadata) -> torch.Tensor:
        H, Hkv = layer.num_heads, layer.num_kv_heads
        D, Dv = layer.head_dim, layer.v_head_dim
        T = meta.num_tokens
        out = q.new_empty((T, H, Dv))
        if T == 0:
            return out
        kb, vb = self._cache().get_kv(layer.layer_id)
        qs = q.to(_F32) * layer.scaling
        cap = layer.logit_cap or None
        sinks = self._sinks(layer, q.device)

        if layer.is_cross_attention:
            slots, offs, lens = meta.cross()
            n = slots.numel()
            Kall = self._gather("ext.k", self._rows(kb, Hkv * D), slots).view(n, Hkv, D)
            Vall = self._gather("ext.v", self._rows(vb, Hkv * Dv), slots).view(n, Hkv, Dv)
            hidden_list = None
        else:
            Kall = self._assemble("ext.k", kb, k, meta, Hkv, D)
            Vall = self._assemble("ext.v", vb, v, meta, Hkv, Dv)
            offs, lens = meta.kv_off, meta.seq
            hidden_list = meta.hidden(layer.sliding_window)

        window = None if layer.is_cross_attention else layer.sliding_window
        for i, (t0, e) in enumerate(zip(meta.q_off, meta.ext)):
            if e == 0:
                continue
            o, s = offs[i], lens[i]
            if s == 0:  # empty encoder: nothing visible, the output is zero
                out[t0:t0 + e].zero_()
                continue
            p = 0 if hidden_list is None else meta.prefix[i]
            # queries in chunks, so the scores of a long prefill stay within extend_score_bytes
            chunk = max(1, min(e, self.extend_score_bytes // (4 * H * s)))
            for a0 in range(0, e, chunk):
                a1 = min(e, a0 + chunk)
                # keys the chunk can see: causal up to position p + a1 - 1, window from p + a0 - W
                lo, hi = 0, s
                if hidden_list is not None:
                    hi = p + a1
                    if window is not None:
                        lo = max(0, p + a0 - window)
                hidden = None if hidden_list is None else hidden_list[i][a0:a1, lo:hi]
                out[t0 + a0:t0 + a1] = self._extend_chunk(
                    qs[t0 + a0:t0 + a1], Kall[o + lo:o + hi], Vall[o + lo:o + hi], hidden, layer, cap, sinks
                )
        return out

    @staticmethod
    def _extend_chunk(
        q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, hidden: torch.Tensor | None, layer: Any,
        cap: float | None, sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        """Attention of ``q`` (``[e, H, D]``, scaled, float32) over ``K``/``V`` (``[s, Hkv, dim]``)."""
        H, Hkv, G = layer.num_heads, layer.num_kv_heads, layer.gqa_group_size
        e, s, D, Dv = q.shape[0], K.shape[0], layer.head_dim, layer.v_head_dim
        qh = q.reshape(e, Hkv, G, D).transpose(0, 1).reshape(Hkv, e * G, D)
        S = torch.bmm(qh, K.transpose(0, 1).transpose(1, 2)).view(Hkv, e, G, s)
        if cap:
            S.div_(cap).tanh_().mul_(cap)
        if hidden is not None:
            S.masked_fill_(hidden.view(1, e, 1, s), -math.inf)
        m = S.amax(dim=3, keepdim=True)
        sk = None
        if sinks is not None:
            sk = sinks.view(Hkv, 1, G, 1)
            m = torch.maximum(m, sk)
        m = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # rows with nothing visible
        S.sub_(m).exp_()
        den = S.sum(dim=3, keepdim=True)
        if sk is not None:
            den = den + torch.exp(sk - m)
        O = torch.bmm(S.view(Hkv, e * G, s), V.transpose(0, 1)).view(Hkv, e, G, Dv)
        O.div_(den.clamp_min(torch.finfo(_F32).tiny))
        return O.transpose(0, 1).reshape(e, H, Dv)

    def _assemble(
        self, name: str, buf: torch.Tensor, new: torch.Tensor, meta: ExtendMetadata, Hkv: int, dim: int
    ) -> torch.Tensor:
        """Every request's keys (or values), prefix then new tokens, in one reused float32 workspace."""
        row = Hkv * dim
        allk = self.workspace.get(name, (meta.total_kv, row), _F32)
        if meta.prefix_src.numel():
            got = self._gather(name + ".prefix", self._rows(buf, row), meta.prefix_src)
            allk.index_copy_(0, meta.prefix_dst, got)
        allk.index_copy_(0, meta.new_dst, new.reshape(-1, row).to(_F32))
        return allk.view(meta.total_kv, Hkv, dim)


def _maximum(*xs: Any, like: torch.Tensor | None = None) -> torch.Tensor:
    """Elementwise max of the tensors given (``None`` skipped); ``-inf`` like ``like`` when none."""
    vals = [x for x in xs if x is not None]
    if not vals:
        assert like is not None
        return torch.full_like(like, -math.inf)
    m = vals[0]
    for x in vals[1:]:
        m = torch.maximum(m, x)
    return m
