"""Kernel module of the ``torch_native`` backend: exact paged attention in plain PyTorch.

Imported only when the backend is built (the descriptor module stays light).
Semantics are those of ``attnplug.testing.reference``. The backend subclasses the
core's ``PagedBackend``, which already did, before a kernel here runs: metadata
lookup, IDLE, the per-forward bounds checks (every cached position a request reads
maps to a real slot), the per-layer structural checks, and which writes this
forward's new K/V *after* the kernel returned (``new_kv_source = "args"``), so a
forward that raises writes nothing. Every kernel takes the new K/V from its
``k``/``v`` arguments, never from the cache.

Compute dtype
-------------

When the query and the cache share float32 or bfloat16, the kernels run in that
dtype: matmuls take bf16 operands and accumulate in float32 (oneDNN on CPU, with
AVX-512 BF16 where the CPU has it); the softmax computes in float32. Gathered
bf16 K/V are never upcast. A bf16 matmul rounds its output, so a decode score
``s`` would be off by up to ``|s| * 2^-8``: decode instead takes each query row's
maximum ``m`` from a first bf16 matmul, then a second one (``baddbmm`` onto
``-m``) rounds ``s - m`` once, after the float32 accumulation (see
``_shifted_scores``). Any other pairing (float16, or a cache dtype other than the
model's) computes in float32, converting one bounded block at a time.

Garbage never reaches an output
-------------------------------

Slots no request owns may hold anything (NaN, ±inf): engines park padded writes
there. The kernels gather only rows a request owns and can see (its cached
positions inside its window), and the padding of a padded decode block is
*zeroed* (``index_fill_``) after the gather, never multiplied by zero; its scores
are ``-inf`` before the softmax as well. A row with no visible key (an empty
encoder, a target-verify mask row hiding everything) outputs zeros, sinks or not,
as the reference does.

This forward's new tokens are hidden too: from each earlier token of their request (causal)
and, in target-verify, from the drafts the tree mask hides them from. SDPA and a matmul
cannot select per (query, key), so each extend request's assembled K/V is checked for a
non-finite value (one float32 sum each); where one is found, the non-finite values are
replaced by zeros for the matmuls, and the output rows of every query that *sees* such a key
(by the same mask) are set to NaN afterwards: garbage reaches exactly the rows that read it,
as in the reference. Decode has one new token, seen by its query, and no hidden cached key.

Decode
------

Requests are processed in blocks holding about ``decode_block_bytes`` of gathered
K (default 4 MiB on CPU, so the block stays in cache between the gather and the
matmuls that read it); a request whose keys alone exceed that (long contexts) is
split into blocks of its KV heads, which attend independently. Per block: one ``index_select`` gathers every
``(request, kv_head, position)`` row of K into a head-major ``[requests * kv_heads,
len, head_dim]`` workspace (each matrix contiguous, which the bf16 matmul and
multi-request blocks need; a float32 one-request block gathers whole token rows
instead, faster, and its matmul reads them strided), the new token's K is copied into its row from the arguments, padding rows are
zeroed, one ``bmm`` scores the ``num_heads // num_kv_heads`` query heads of every
group at once (bf16: two, shifted by the row maximum), soft-cap and mask follow,
the softmax (with a sink term in the denominator when the layer has sinks), then
the same for V and one ``bmm``. The
gather indices of every block are built once per forward and window and shared by
every layer.

Extend
------

EXTEND, MIXED, TARGET_VERIFY, DRAFT_EXTEND and DRAFT_EXTEND_V2 run per request:
its visible cached prefix (inside the window of its first query) and its new
tokens are assembled head-major in a reused workspace (bounded by
``check_workspace``), then queries go in chunks through PyTorch's fused
``scaled_dot_product_attention`` with a boolean mask built per chunk (causal by
position, sliding window, target-verify mask), so no mask or score tensor is
larger than ``extend_score_bytes`` whatever the prefill length. Layers with a
soft-cap or sinks, which SDPA cannot express, take a matmul-softmax-matmul path
chunked by the same bound.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from attnplug import ForwardMode, PagedBackend

from . import CAPABILITIES, NAME

#: Gathered K bytes per decode block on CPU: small enough to stay in cache between the gather
#: and the matmuls reading it, large enough to keep the number of ops per layer low.
DEFAULT_DECODE_BLOCK_BYTES = 4 << 20
#: Bound on one extend query chunk's mask / float32 scores.
DEFAULT_EXTEND_SCORE_BYTES = 64 << 20
_F32 = torch.float32
_NATIVE = (torch.float32, torch.bfloat16)


class _Rows:
    """One layer's K (or V) as this backend reads it.

    A cache in the ``nhd`` layout is indexed in place (``buf``, token-major); any other layout is
    read through ``PagedKVCache.read_kv``, only for the slots a block needs (the fallback that
    lets torch_native serve a half of a pair whose other half owns the layout). An fp8 cache's
    rows are dequantized as they are gathered: stored * ``scale``.
    """

    __slots__ = ("cache", "layer_id", "which", "buf", "dtype", "scale", "heads", "dim")

    def __init__(self, cache: Any, layer_id: int, which: int) -> None:
        self.cache, self.layer_id, self.which = cache, layer_id, which
        self.buf = cache.get_kv(layer_id)[which] if cache.layout.name == "nhd" else None
        self.dtype = cache.dtype
        self.scale = cache.kv_scales(layer_id)[which] if cache.quantized else None
        self.heads = cache.num_kv_heads
        self.dim = cache.head_dim if which == 0 else cache.v_head_dim

    def element_size(self) -> int:
        return self.dtype.itemsize

    def read(self, index: torch.Tensor, width: int) -> torch.Tensor:
        """Rows ``index`` of the ``[-1, width]`` view a token-major buffer would have (``width`` =
        heads * dim: token rows; = dim: (token, head) rows), read through the cache's layout."""
        slots = index if width == self.heads * self.dim else torch.div(index, self.heads, rounding_mode="floor")
        rows = self.cache.read_kv(self.layer_id, slots)[self.which]  # [n, heads, dim]
        if width == self.heads * self.dim:
            return rows.reshape(index.numel(), width)
        return rows[torch.arange(index.numel(), device=index.device), index % self.heads]


def create(ctx: Any) -> tuple[str, "TorchNativeBackend"]:
    """Factory named by the descriptor: ``(effective_name, backend)``."""
    return NAME, TorchNativeBackend(ctx)


def _nonfinite_keys(K: torch.Tensor, V: torch.Tensor) -> torch.Tensor | None:
    """``None`` when one request's assembled ``K``/``V`` (``[Hkv, n, dim]``) are all finite (one float32
    sum each: a NaN/inf makes it non-finite); else ``[Hkv, n]`` bool, True for a key whose K or V row holds
    a NaN/inf, after replacing those values by zeros in place (the matmuls then never see them, and
    ``_poison_readers`` gives the rows that read such a key NaN)."""
    if bool(torch.isfinite(K.sum(dtype=_F32) + V.sum(dtype=_F32))):
        return None
    bad = ~(torch.isfinite(K).all(dim=2) & torch.isfinite(V).all(dim=2))
    torch.nan_to_num_(K, nan=0.0, posinf=0.0, neginf=0.0)
    torch.nan_to_num_(V, nan=0.0, posinf=0.0, neginf=0.0)
    return bad


def _poison_readers(o: torch.Tensor, mask: torch.Tensor | None, bad: torch.Tensor, G: int) -> None:
    """Set to NaN, in ``o`` (``[H, c, Dv]``, head ``h`` reading KV head ``h // G``), the rows of every query
    that sees (``mask`` ``[c, n]``; ``None``: every key) a key marked in ``bad`` (``[Hkv, n]``)."""
    Hkv, c = bad.shape[0], o.shape[1]
    if mask is None:
        reads = bad.any(dim=1, keepdim=True).expand(Hkv, c)
    else:
        reads = (mask[None, :, :] & bad[:, None, :]).any(dim=2)  # [Hkv, c]
    if bool(reads.any()):
        o.view(Hkv, G, c, -1).masked_fill_(reads[:, None, :, None], math.nan)


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


class _Block(NamedTuple):
    """One decode block: KV heads ``h0 … h1-1`` of requests ``b0 … b1-1``, padded to ``length`` keys.

    Rows index the cache viewed ``[slots, Hkv * dim]`` (``head_major=False``, all heads: the
    block's workspace is ``[length, requests, Hkv, dim]``) or ``[slots * Hkv, dim]``
    (``head_major=True``: ``[requests, h1 - h0, length, dim]``, each matrix contiguous). A block
    holds fewer than all KV heads only when one request's keys alone exceed the block size.
    """

    b0: int
    b1: int
    length: int
    head_major: bool
    index: torch.Tensor  # the rows to gather, in workspace order
    new_rows: torch.Tensor | None  # workspace rows of the new token: (request) or (request, kv_head) order
    pad_rows: torch.Tensor | None  # workspace rows past a request's keys (zeroed after the gather)
    hidden: torch.Tensor | None  # [(b1-b0), 1, 1, length] bool: True where the key is padding
    empty: list[int]  # block-local requests with no key at all (output zeros)
    h0: int  # first KV head
    h1: int  # one past the last KV head


class ForwardMeta:
    """What one forward's layers share: per-request lengths, and lazily built decode plans."""

    def __init__(self, batch: Any, cache: Any) -> None:
        self.mode = batch.forward_mode
        self.rows = list(batch.req_pool_indices_cpu)
        self.seq = list(batch.seq_lens_cpu)
        self.prefix = list(batch.extend_prefix_lens_cpu)
        self.ext = list(batch.extend_seq_lens_cpu)
        if self.mode is ForwardMode.DECODE:
            self.prefix = [s - 1 for s in self.seq]
            self.ext = [1] * len(self.seq)
        self.enc = None if batch.encoder_lens is None else [int(x) for x in batch.encoder_lens.tolist()]
        self.q_off = [0]
        for e in self.ext:
            self.q_off.append(self.q_off[-1] + e)
        self.custom_mask = None
        if self.mode is ForwardMode.TARGET_VERIFY and batch.spec_custom_mask is not None:
            self.custom_mask = batch.spec_custom_mask.to(device=cache.device, dtype=torch.bool)
        self._cache = cache
        self._plans: dict[Any, Any] = {}

    def decode_plan(self, window: int | None, cross: bool, block_bytes: int | None, row_bytes: int,
                    head_major: bool) -> list[_Block]:
        """Decode blocks for this window / cross-attention / layout (built on the first layer, then shared)."""
        key = (window, cross, block_bytes, row_bytes, head_major)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self._build_decode_plan(window, cross, block_bytes, row_bytes, head_major)
        return plan

    def _build_decode_plan(self, window: int | None, cross: bool, block_bytes: int | None, row_bytes: int,
                           head_major: bool) -> list[_Block]:
        B = len(self.rows)
        # per request: first position read from the cache, cached keys, total keys (new one included)
        if cross:
            start = [0] * B
            cached = list(self.enc or [0] * B)
            total = cached
        else:
            start = [0 if window is None else max(0, p - window) for p in self.prefix]
            cached = [p - s0 for p, s0 in zip(self.prefix, start)]
            total = [c + 1 for c in cached]
        blocks: list[_Block] = []
        Hkv = self._cache.num_kv_heads
        b0 = 0
        while b0 < B:
            b1, length = b0 + 1, max(total[b0], 1)
            if block_bytes is not None and length * row_bytes > block_bytes and Hkv > 1:
                # one request's keys alone overflow the block (long context): split its KV heads,
                # which attend independently, so each block's K stays in cache (the request's slots
                # read once for all of them)
                hs = max(1, block_bytes * Hkv // (length * row_bytes))
                slots = self._slots(b0, b1, length, start, cached)
                for h0 in range(0, Hkv, hs):
                    blocks.append(self._block(b0, b1, length, start, cached, total, cross, True, h0, min(Hkv, h0 + hs),
                                              slots))
                b0 = b1
                continue
            if block_bytes is not None:
                while b1 < B and (b1 - b0 + 1) * max(length, total[b1]) * row_bytes <= block_bytes:
                    length = max(length, total[b1])
                    b1 += 1
            else:
                b1 = B
                length = max(max(total[b0:b1]), 1)
            # token-major rows only for a one-request block: a strided batched matmul over several
            # requests' rows falls off the BLAS fast path (measured 4x slower at 8 x 128 keys)
            blocks.append(self._block(b0, b1, length, start, cached, total, cross, head_major or b1 - b0 > 1,
                                      0, Hkv))
            b0 = b1
        return blocks

    def _slots(self, b0: int, b1: int, length: int, start: list[int], cached: list[int]) -> torch.Tensor:
        """``[n, length]`` int64: the slot of each key position requests ``b0 … b1-1`` read from the cache, 0 past
        a request's cached keys (the new token's place and padding read slot 0 and are overwritten / zeroed after
        the gather). A few requests: each one's ``req_to_token`` entries copied as a slice (~4 ops a request);
        more: one vectorised gather (~12 ops whatever the count)."""
        cache = self._cache
        dev, r2t = cache.device, cache.req_to_token
        n = b1 - b0
        if n <= 4:
            slots = torch.zeros((n, length), dtype=torch.int64, device=dev)
            for i in range(n):
                s0, c = start[b0 + i], cached[b0 + i]
                if c:
                    slots[i, :c] = r2t[self.rows[b0 + i], s0:s0 + c]
            return slots
        pos = torch.arange(length, device=dev)
        st = torch.as_tensor(start[b0:b1], dtype=torch.int64, device=dev)
        nc = torch.as_tensor(cached[b0:b1], dtype=torch.int64, device=dev)
        owned = pos[None, :] < nc[:, None]  # [n, length]: a cached position the request reads
        cols = (st[:, None] + pos[None, :]).clamp_(max=r2t.shape[1] - 1)
        rows = torch.as_tensor(self.rows[b0:b1], dtype=torch.int64, device=dev)
        # only owned entries are read through req_to_token
        return torch.where(owned, r2t.index_select(0, rows).gather(1, cols).to(torch.int64), torch.zeros_like(cols))

    def _block(self, b0: int, b1: int, length: int, start: list[int], cached: list[int], total: list[int],
               cross: bool, head_major: bool, h0: int, h1: int, slots: torch.Tensor | None = None) -> _Block:
        """One block's gather plan (``_Block``); ``slots``: the block's ``_slots`` when already read. The rows of
        the new token are computed as host ints (one tensor made from them); padding, where a request has
        fewer keys than the block's length, by the vectorised mask (its size is the padding's)."""
        cache = self._cache
        dev, Hkv = cache.device, cache.num_kv_heads
        n = b1 - b0
        if slots is None:
            slots = self._slots(b0, b1, length, start, cached)
        tot = total[b0:b1]
        any_pad = any(t < length for t in tot)
        new_rows = pad_rows = hidden = None
        pad = None
        if any_pad:
            nt = torch.as_tensor(tot, dtype=torch.int64, device=dev)
            pad = torch.arange(length, device=dev)[None, :] >= nt[:, None]  # [n, length]
        if head_major:  # workspace [n, h1 - h0, length] rows of dim
            hh = h1 - h0
            heads = torch.arange(h0, h1, device=dev)
            index = (slots[:, None, :] * Hkv + heads[None, :, None]).reshape(-1)
            if not cross:  # request i's new token at key position tot[i] - 1, in each of its heads' matrices
                new_rows = torch.tensor([(i * hh + h) * length + tot[i] - 1 for i in range(n) for h in range(hh)],
                                        dtype=torch.int64, device=dev)
            if pad is not None:
                flat = torch.arange(n * hh * length, device=dev).view(n, hh, length)
                pad_rows = flat[pad[:, None, :].expand(n, hh, length)].reshape(-1)
        else:  # workspace [length, n] rows of Hkv * dim
            index = slots.t().reshape(-1)
            if not cross:
                new_rows = torch.tensor([(tot[i] - 1) * n + i for i in range(n)], dtype=torch.int64, device=dev)
            if pad is not None:
                flat = torch.arange(length * n, device=dev).view(length, n)
                pad_rows = flat[pad.t()].reshape(-1)
        if pad is not None:
            hidden = pad.view(n, 1, 1, length)
        empty = [i for i, t in enumerate(tot) if t == 0]
        return _Block(b0, b1, length, head_major, index, new_rows, pad_rows, hidden, empty, h0, h1)


# ---------------------------------------------------------------------------
# the backend
# ---------------------------------------------------------------------------


class TorchNativeBackend(PagedBackend):
    """Exact paged attention in plain PyTorch (the reference CPU backend)."""

    capabilities = CAPABILITIES
    backend_name = NAME
    new_kv_source = "args"

    def __init__(self, ctx: Any, decode_block_bytes: int | None | str = "auto",
                 extend_score_bytes: int = DEFAULT_EXTEND_SCORE_BYTES) -> None:
        super().__init__(ctx)
        if decode_block_bytes == "auto":
            decode_block_bytes = DEFAULT_DECODE_BLOCK_BYTES if self.device.type == "cpu" else None
        #: gathered K bytes per decode block (``None``: the whole batch in one block)
        self.decode_block_bytes: int | None = decode_block_bytes  # type: ignore[assignment]
        #: bound on one extend query chunk's mask and float32 scores (queries are chunked to fit)
        self.extend_score_bytes = int(extend_score_bytes)
        self.workspace = Workspace(self.device)
        #: the largest mask/score chunk built so far, in bytes (tests check it stays bounded)
        self.largest_chunk_bytes = 0

    def build_metadata(self, batch: Any) -> ForwardMeta:
        return ForwardMeta(batch, self.cache)

    # -- MLA layers (docs/mla.md): both forms, eager, in mla.py ------------------
    def compute_mla(self, q: torch.Tensor, latent: torch.Tensor, layer: Any, batch: Any, meta: Any) -> torch.Tensor:
        from . import mla

        return mla.compute_mla(self, q, latent, layer, batch, self.__dict__.setdefault("_mla_weights", {}))

    # -- helpers -----------------------------------------------------------
    def _compute_dtype(self, q: torch.Tensor) -> torch.dtype:
        cd = self.cache.dtype
        if self.cache.quantized:  # fp8 blocks are dequantized into the model dtype's arithmetic
            return q.dtype if q.dtype in _NATIVE else _F32
        return cd if q.dtype == cd and cd in _NATIVE else _F32

    def _stored(self, layer: Any, k: Any, v: Any) -> tuple[Any, Any]:
        """The new K/V as the cache stores them: an fp8 cache quantizes (the reference reads new
        tokens as stored, whether or not they are saved); any other cache gives them unchanged."""
        if k is None or not self.cache.quantized:
            return k, v
        return self.cache.dequantize(layer.layer_id, *self.cache.quantize(layer.layer_id, k, v))

    @staticmethod
    def _sinks(layer: Any, device: torch.device) -> torch.Tensor | None:
        if layer.sinks is None:
            return None
        return torch.as_tensor(layer.sinks).detach().to(device=device, dtype=_F32).reshape(
            layer.num_kv_heads, layer.gqa_group_size
        )

    def _gather(self, name: str, src: _Rows, index: torch.Tensor, width: int, cd: torch.dtype) -> torch.Tensor:
        """Rows ``index`` of ``src`` viewed ``[-1, width]``, in ``cd`` (dequantized for fp8), in a reused
        workspace."""
        n = index.numel()
        if src.buf is not None:
            buf = src.buf
            src2 = buf.view(-1, width) if buf.is_contiguous() else buf.reshape(-1, width)
            raw = self.workspace.get(name, (n, width), src.dtype)
            torch.index_select(src2, 0, index, out=raw)
        else:
            raw = src.read(index, width)
        if src.dtype == cd and src.scale is None:
            return raw
        out = self.workspace.get(name + "." + str(cd), (n, width), cd)
        out.copy_(raw)  # fp8 values convert exactly into bf16 and float32
        if src.scale is not None:
            out.mul_(src.scale)  # one rounding of stored * scale, in the compute dtype
        return out

    def _note_chunk(self, nbytes: int) -> None:
        if nbytes > self.largest_chunk_bytes:
            self.largest_chunk_bytes = nbytes

    # -- decode: blocks of requests ------------------------------------------
    def compute_decode(self, q: torch.Tensor, k: Any, v: Any, layer: Any, batch: Any, meta: ForwardMeta) -> torch.Tensor:
        out = self.empty_output(q, layer)
        H, Hkv, G = layer.num_heads, layer.num_kv_heads, layer.gqa_group_size
        D, Dv = layer.head_dim, layer.v_head_dim
        cross = layer.is_cross_attention
        kb, vb = _Rows(self.cache, layer.layer_id, 0), _Rows(self.cache, layer.layer_id, 1)
        k, v = self._stored(layer, k, v)
        cd = self._compute_dtype(q)
        # bf16 matmuls want each (request, kv_head) matrix contiguous: gather rows of one head;
        # float32 ones take a strided matrix, and whole-token rows gather faster (one-request blocks)
        head_major = cd != _F32
        row_bytes = Hkv * max(D, Dv) * kb.element_size()
        blocks = meta.decode_plan(None if cross else layer.sliding_window, cross, self.decode_block_bytes,
                                  row_bytes, head_major)
        cap = layer.logit_cap or None
        sinks = self._sinks(layer, q.device)
        scale = layer.scaling
        # [B * Hkv, G, D]: query head h = kv * G + g uses KV head kv; float32 queries are scaled once
        # here (bf16 ones are not: the scores are scaled in float32 instead, to avoid rounding q * scale)
        qs = q.reshape(-1, G, D).to(cd)
        if cd == _F32:
            qs = qs * scale
        for blk in blocks:
            n, hh = blk.b1 - blk.b0, blk.h1 - blk.h0
            rows, L = n * hh, blk.length
            self.check_workspace(rows * L * (D + Dv) * (kb.element_size() + (0 if kb.dtype == cd else 4)),
                                 f"decode block of {n} request(s) x {L} keys")
            r0 = blk.b0 * Hkv + blk.h0
            K = self._block_rows("dec.k", kb, blk, k, D, Hkv, cd)
            # scores, probabilities and outputs go to reused workspaces too (no allocation per block)
            Km = self._matrices(K, blk, rows, L, D).transpose(1, 2)
            den = None
            if cd == _F32:
                S = torch.bmm(qs[r0:r0 + rows], Km, out=self.workspace.get("dec.s", (rows, G, L), _F32))
            else:
                Sb, m = self._shifted_scores(qs[r0:r0 + rows], Km, blk, n, hh, G)
                if not cap and sinks is None:
                    # softmax needs no absolute score: scale and normalise s - m in bf16 (softmax
                    # computes in float32 inside); rounding (s - m) * scale adds one more error of
                    # the same order as the probabilities' own rounding to bf16
                    Sb.mul_(scale)
                    if blk.hidden is not None:
                        Sb.view(n, hh, G, L).masked_fill_(blk.hidden, -math.inf)
                    P = torch.softmax(Sb, dim=2, out=self.workspace.get("dec.p16", (rows, G, L), cd))
                    S = None
                else:  # soft-cap and sinks need the absolute score: s = (s - m) + m in float32
                    S = self.workspace.get("dec.s", (rows, G, L), _F32).copy_(Sb).add_(m).mul_(scale)
            if S is not None:
                if cap:
                    S.div_(cap).tanh_().mul_(cap)
                if blk.hidden is not None:
                    S.view(n, hh, G, L).masked_fill_(blk.hidden, -math.inf)
                if sinks is None:
                    P = torch.softmax(S, dim=2, out=self.workspace.get("dec.p", (rows, G, L), _F32))
                else:
                    sk = sinks[blk.h0:blk.h1].unsqueeze(0).expand(n, hh, G).reshape(rows, G, 1)
                    mx = torch.maximum(S.amax(dim=2, keepdim=True), sk)
                    P = S.sub_(mx).exp_()
                    den = P.sum(dim=2, keepdim=True) + torch.exp(sk - mx)
                if cd != _F32:
                    P = self.workspace.get("dec.p16", (rows, G, L), cd).copy_(P)
            V = self._block_rows("dec.v", vb, blk, v, Dv, Hkv, cd)
            ob = out[blk.b0:blk.b1, blk.h0 * G:blk.h1 * G]  # contiguous: all heads, or one request
            direct = den is None and cd == out.dtype  # the matmul writes the output rows itself
            O = torch.bmm(P, self._matrices(V, blk, rows, L, Dv),
                          out=ob.view(rows, G, Dv) if direct else self.workspace.get("dec.o", (rows, G, Dv), cd))
            if den is not None:
                O = O.to(_F32).div_(den)
            if not direct:
                ob.copy_(O.view(n, hh * G, Dv))
            if blk.empty:
                ob.index_fill_(0, torch.as_tensor(blk.empty, device=ob.device), 0)
        return out

    def _shifted_scores(self, q: torch.Tensor, Km: torch.Tensor, blk: _Block, n: int, Hkv: int,
                        G: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(s - m, m)``: unscaled scores ``s = q @ Km`` of bf16 operands, shifted by each query
        row's maximum ``m``, from bf16 matmuls only (K is never widened to float32).

        A bf16 matmul accumulates in float32 but rounds its output to bf16, which puts an error of
        up to ``|s| * 2^-8`` on a score ``s``: at ``scaling=1.0`` that is visible after ``exp()``.
        So a first bf16 matmul finds each query row's largest score ``m``; a second one,
        ``baddbmm`` onto ``-m``, subtracts ``m`` inside the float32 accumulation and rounds
        ``s - m`` once. Softmax ignores the shift, and the scores that carry the weight (near the
        row's maximum) now have an error of ``|s - m| * 2^-8``, the same order as rounding the
        probabilities to bf16 for the value matmul. Both matmuls read the block's K from cache.
        Returns the bf16 ``[rows, G, L]`` workspace holding ``s - m``, and ``m`` (``[rows, G, 1]``).
        """
        rows, L = q.shape[0], Km.shape[2]
        Sb = self.workspace.get("dec.sb", (rows, G, L), q.dtype)
        torch.bmm(q, Km, out=Sb)
        if blk.hidden is not None:  # padding keys (zeroed, score 0) must not pick the shift
            Sb.view(n, Hkv, G, L).masked_fill_(blk.hidden, -math.inf)
        m = Sb.amax(dim=2, keepdim=True)
        if blk.hidden is not None:  # a request without keys: any finite shift will do
            m.masked_fill_(torch.isinf(m), 0)
        Sb.copy_(torch.neg(m).expand(rows, G, L))
        Sb.baddbmm_(q, Km)  # s - m: float32 accumulation onto -m, one rounding
        return Sb, m

    def _block_rows(self, name: str, buf: _Rows, blk: _Block, new: Any, dim: int, Hkv: int,
                    cd: torch.dtype) -> torch.Tensor:
        """The block's K (or V) rows in ``cd``: gathered, the new token from the arguments, padding zeroed."""
        width = dim if blk.head_major else Hkv * dim
        X = self._gather(name, buf, blk.index, width, cd)
        if blk.new_rows is not None:
            X.index_copy_(0, blk.new_rows, new[blk.b0:blk.b1, blk.h0:blk.h1].reshape(-1, width).to(cd))
        if blk.pad_rows is not None:
            X.index_fill_(0, blk.pad_rows, 0)  # select, never multiply garbage by 0
        return X

    @staticmethod
    def _matrices(X: torch.Tensor, blk: _Block, rows: int, L: int, dim: int) -> torch.Tensor:
        """``[rows, L, dim]``: the ``(request, kv_head)`` matrices of the block's workspace."""
        if blk.head_major:
            return X.view(rows, L, dim)
        return X.as_strided((rows, L, dim), (dim, rows * dim, 1), X.storage_offset())

    # -- extend: per request, queries in bounded chunks ---------------------
    def compute_extend(self, q: torch.Tensor, k: Any, v: Any, layer: Any, batch: Any, meta: ForwardMeta) -> torch.Tensor:
        return self.extend_requests(q, k, v, layer, meta, self.empty_output(q, layer))

    def extend_requests(self, q: torch.Tensor, k: Any, v: Any, layer: Any, meta: ForwardMeta, out: torch.Tensor,
                        skip: frozenset[int] = frozenset()) -> torch.Tensor:
        """Attend every request of an extend-mode forward but those in ``skip`` (already attended by a
        subclass's kernel) into their rows of ``out``."""
        H, Hkv = layer.num_heads, layer.num_kv_heads
        D, Dv = layer.head_dim, layer.v_head_dim
        kb, vb = _Rows(self.cache, layer.layer_id, 0), _Rows(self.cache, layer.layer_id, 1)
        k, v = self._stored(layer, k, v)
        cd = self._compute_dtype(q)
        cross = layer.is_cross_attention
        window = None if cross else layer.sliding_window
        bidir = layer.uses_bidirectional and not cross
        manual = bool(layer.logit_cap) or layer.sinks is not None
        sinks = self._sinks(layer, q.device)
        r2t = self.cache.req_to_token
        for i, row in enumerate(meta.rows):
            e = meta.ext[i]
            if e == 0 or i in skip:
                continue
            t0, p = meta.q_off[i], meta.prefix[i]
            if cross:
                lo, cached, n_new = 0, meta.enc[i] if meta.enc else 0, 0
            else:
                lo = 0 if window is None else max(0, p - window)  # first key the first query sees
                cached, n_new = p - lo, e
            n = cached + n_new
            if n == 0:  # empty encoder: nothing visible, the output is zero
                out[t0:t0 + e].zero_()
                continue
            esz = cd.itemsize
            self.check_workspace(n * Hkv * (D + Dv) * (esz + kb.element_size()),
                                 f"keys and values of request {i} ({n} tokens)")
            K = self._assemble("ext.k", kb, r2t[row, lo:p] if not cross else r2t[row, :cached],
                               None if cross else k[t0:t0 + e], Hkv, D, cd)
            V = self._assemble("ext.v", vb, r2t[row, lo:p] if not cross else r2t[row, :cached],
                               None if cross else v[t0:t0 + e], Hkv, Dv, cd)
            bad = _nonfinite_keys(K, V)  # None, the usual case: nothing to select out
            per_query = 4 * n * (H if manual else 1)
            chunk = max(1, min(e, self.extend_score_bytes // per_query))
            custom = None if meta.custom_mask is None else meta.custom_mask[i, :e, :e]
            for a0 in range(0, e, chunk):
                a1 = min(e, a0 + chunk)
                # keys the chunk can see: causal up to position p + a1 - 1, window from p + a0 - W
                k0, k1 = 0, n
                if not cross:
                    k1 = p + a1 - lo
                    if window is not None:
                        k0 = max(0, p + a0 - window - lo)
                    if bidir:  # later new tokens too: all of them, or up to the window past the last query
                        k1 = n if window is None else min(n, p + a1 + window - lo)
                mask = None if cross else self._mask(p, lo, a0, a1, k0, k1, window, custom, q.device, bidir)
                qc = q[t0 + a0:t0 + a1].transpose(0, 1).to(cd).contiguous()  # [H, c, D]
                if manual:
                    o = self._attend_manual(qc, K[:, k0:k1], V[:, k0:k1], mask, layer, sinks, cd)
                else:
                    o = self._attend_sdpa(qc, K[:, k0:k1], V[:, k0:k1], mask, layer)
                if bad is not None:  # the rows that read a non-finite key or value get NaN, no other
                    _poison_readers(o, mask, bad[:, k0:k1], layer.gqa_group_size)
                out[t0 + a0:t0 + a1] = o.transpose(0, 1)
        return out

    def _assemble(self, name: str, buf: _Rows, slots: torch.Tensor, new: torch.Tensor | None, Hkv: int,
                  dim: int, cd: torch.dtype) -> torch.Tensor:
        """One request's keys (or values): owned cached rows, then the new ones; ``[Hkv, n, dim]`` in ``cd``."""
        c = slots.numel()
        n = c + (0 if new is None else new.shape[0])
        tok = self.workspace.get(name + ".tok", (n, Hkv, dim), cd)
        if c and buf.buf is not None and buf.dtype == cd and buf.scale is None:  # straight into the workspace
            torch.index_select(buf.buf.view(-1, Hkv * dim), 0, slots, out=tok[:c].view(c, Hkv * dim))
        elif c:
            tok[:c] = self._gather(name + ".raw", buf, slots, Hkv * dim, cd).view(c, Hkv, dim)
        if new is not None:
            tok[c:] = new
        head = self.workspace.get(name, (Hkv, n, dim), cd)
        head.copy_(tok.transpose(0, 1))
        return head

    def _mask(self, p: int, lo: int, a0: int, a1: int, k0: int, k1: int, window: int | None,
              custom: torch.Tensor | None, device: torch.device, bidir: bool = False) -> torch.Tensor:
        """``[a1-a0, k1-k0]`` bool: True where query ``a`` (position ``p+a``) sees key ``lo+j``
        (causal, or with ``bidir`` every key within the window on both sides)."""
        self._note_chunk((a1 - a0) * (k1 - k0))
        qpos = torch.arange(p + a0, p + a1, device=device)[:, None]
        kpos = torch.arange(lo + k0, lo + k1, device=device)[None, :]
        if bidir:
            mask = kpos <= qpos + (window if window is not None else k1 + lo)
        else:
            mask = kpos <= qpos
        if window is not None:
            mask &= kpos >= qpos - window
        if custom is not None:
            # draft keys (positions p …) follow the target-verify mask; the prefix stays visible
            d0 = max(p, lo + k0)
            if d0 < lo + k1:
                mask[:, d0 - lo - k0:] &= custom[a0:a1, d0 - p:lo + k1 - p]
        return mask

    def _attend_sdpa(self, q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, mask: torch.Tensor | None,
                     layer: Any) -> torch.Tensor:
        """PyTorch's fused SDPA; rows with no visible key give zeros. bfloat16 runs in float32 and is
        rounded once: PyTorch's CPU SDPA in bfloat16 rounds its outputs high on average (+0.06 to +0.2
        ulp over thousands of elements, the suite's ``rounding`` family), not to nearest."""
        dt = q.dtype
        if dt == torch.bfloat16:
            q, K, V = q.to(_F32), K.to(_F32), V.to(_F32)
        o = F.scaled_dot_product_attention(
            q.unsqueeze(0), K.unsqueeze(0), V.unsqueeze(0), attn_mask=mask, scale=layer.scaling,
            enable_gqa=layer.num_heads != layer.num_kv_heads,
        ).squeeze(0).to(dt)  # [H, c, Dv]
        if mask is not None:
            seen = mask.any(dim=1)
            if not bool(seen.all()):
                o = o.masked_fill(~seen.view(1, -1, 1), 0)  # select, never multiply a NaN by 0
        return o

    def _attend_manual(self, q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, mask: torch.Tensor | None,
                       layer: Any, sinks: torch.Tensor | None, cd: torch.dtype) -> torch.Tensor:
        """Matmul-softmax-matmul with soft-cap and sinks (what SDPA cannot express)."""
        Hkv, G = layer.num_kv_heads, layer.gqa_group_size
        c, n = q.shape[1], K.shape[1]
        self._note_chunk(4 * Hkv * G * c * n)
        qh = q.reshape(Hkv, G * c, -1)
        # scores in float32 even for bf16 operands: a bf16-rounded score is off by |s| * 2^-9, which
        # is visible after exp() once scores are large (scaling 1.0, soft-capped layers); the chunk's
        # K is bounded by extend_score_bytes, so the upcast stays small
        S = torch.bmm(qh.to(_F32), K.transpose(1, 2).to(_F32)).view(Hkv, G, c, n)
        S.mul_(layer.scaling)
        cap = layer.logit_cap
        if cap:
            S.div_(cap).tanh_().mul_(cap)
        if mask is not None:
            S.masked_fill_(~mask.view(1, 1, c, n), -math.inf)
        m = S.amax(dim=3, keepdim=True)
        sk = None
        if sinks is not None:
            sk = sinks.view(Hkv, G, 1, 1)
            m = torch.maximum(m, sk)
        m = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # rows with nothing visible
        S.sub_(m).exp_()
        den = S.sum(dim=3, keepdim=True)
        if sk is not None:
            den = den + torch.exp(sk - m)
        O = torch.bmm(S.view(Hkv, G * c, n).to(cd), V).view(Hkv, G, c, -1).to(_F32)
        O.div_(den.clamp_min(torch.finfo(_F32).tiny))
        return O.view(Hkv * G, c, -1)
