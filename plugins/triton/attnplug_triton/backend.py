"""Kernel module of the ``triton`` backend: ``TritonBackend`` and its factory.

Imported only when the backend is built; imports ``torch`` and ``triton``
(through ``attnplug_triton.kernels``). The kernels are described in
``kernels.py``; this module translates a ``ForwardBatch`` into their inputs
once per forward and launches them per layer.

``TritonBackend`` is a ``PagedBackend``: the core looks up this forward's
metadata, returns early for idle, checks the batch's indices against the
cache (once per forward) and each layer's shapes, dtype, device and support
verdict, and writes the new K/V at ``out_cache_loc`` *after* the kernels
returned (``new_kv_source = "args"``: the kernels take this forward's K/V from
their arguments and read from the cache only positions ``< extend_prefix_lens``,
or ``< encoder_lens`` for cross-attention), so a forward that raises writes
nothing.

Per forward (``build_metadata``), shared by every layer: ``req`` (the request
rows of ``req_to_token``), ``q_start`` (each request's first token in q/k/v),
``prefix`` (cached keys before this forward), ``ext`` (new tokens), the
target-verify mask as bytes, and the host-side grid sizes.

Per layer, one launch of ``_attn_kernel``:

* decode (``compute_decode``), grid ``(requests, kv_heads, splits)``: split-KV
  over fixed ``decode_split_len`` position ranges, then ``_combine_kernel``
  (grid ``(tokens,)``) merges the partials and adds the sinks. The partials
  (``splits x tokens x heads x (v_head_dim + 2)`` float32) are bounded by
  ``BuildContext.max_workspace_bytes``: a batch whose partials exceed it runs
  in chunks of requests (the same arithmetic per request, so the same bits),
  and a request whose own partials do not fit is refused before anything is
  allocated (``ResourceLimitError``);
* every other mode (``compute_extend``: extend, mixed, target-verify,
  draft-extend), grid ``(requests, kv_heads, blocks of BLOCK_M new tokens)``,
  normalised in place (no workspace beyond the output).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import triton

from attnplug import AttnplugError, ForwardMode, PagedBackend

from . import CAPABILITIES, NAME
from .kernels import INTERPRETED, _attn_kernel, _combine_kernel, _mla_decompress_kernel

_I32, _I64, _F32 = torch.int32, torch.int64, torch.float32
#: float32s of decode partials per token, split and head besides the ``v_head_dim`` accumulator:
#: the running max and the running sum
_PARTIAL_EXTRA = 2


def create(ctx: Any) -> tuple[str, "TritonBackend"]:
    """Factory named by the descriptor: ``(effective_name, backend)``."""
    return NAME, TritonBackend(ctx)


@dataclasses.dataclass(frozen=True)
class Tiles:
    """Block sizes of one kernel launch (fixed per backend and layer shape, never per batch)."""

    block_m: int  # new tokens per program
    block_r: int  # tile rows: block_m * group, padded to a power of two
    block_n: int  # keys per inner-loop step
    num_warps: int = 4
    num_stages: int = 2


@dataclasses.dataclass
class Metadata:
    """One forward's kernel inputs, built once by ``build_metadata`` (or a run of its requests)."""

    mode: ForwardMode
    batch_size: int
    num_tokens: int
    req: torch.Tensor  # int64 [B]: row of req_to_token
    q_start: torch.Tensor  # int64 [B]: first token of the request in q/k/v
    prefix: torch.Tensor  # int32 [B]: cached keys before this forward
    ext: torch.Tensor  # int32 [B]: new tokens
    max_ext: int
    max_seq: int
    starts: list[int]  # host copy of q_start, plus num_tokens at the end
    encoder: torch.Tensor | None = None  # int32 [B] (cross-attention)
    max_encoder: int = 0
    mask: torch.Tensor | None = None  # uint8 [B, d, d] (target-verify custom mask)

    def requests(self, a: int, b: int) -> "Metadata":
        """The metadata of requests ``a … b-1`` alone, token offsets counted from request ``a``'s."""
        if (a, b) == (0, self.batch_size):
            return self
        t0 = self.starts[a]
        return dataclasses.replace(
            self, batch_size=b - a, num_tokens=self.starts[b] - t0, req=self.req[a:b],
            q_start=self.q_start[a:b] - t0, prefix=self.prefix[a:b], ext=self.ext[a:b],
            starts=[t - t0 for t in self.starts[a:b + 1]],
            encoder=None if self.encoder is None else self.encoder[a:b],
            mask=None if self.mask is None else self.mask[a:b],
        )


@dataclasses.dataclass(frozen=True)
class _Keys:
    """Where one launch reads its cached keys and values, instead of the layer's own K/V buffers (MLA)."""

    kb: torch.Tensor  # [rows, kv_heads, >= head_dim]
    vb: torch.Tensor  # [rows, kv_heads, >= v_head_dim]
    r2t: torch.Tensor  # [requests, positions] -> row of kb/vb
    k_scale: float
    v_scale: float
    scaled: bool  # kb/vb hold fp8 values: dequantize with the scales
    kv_heads: int
    head_dim: int
    v_head_dim: int


def _pow2(n: int, floor: int = 16) -> int:
    return max(floor, triton.next_power_of_2(max(1, n)))


#: Shared-memory budget of one program on a GPU, estimated as ``elem * (2 * rows * d + stages *
#: block_n * (d + dv))`` (the Q tile and one layout conversion of it, plus ``num_stages`` K and V
#: tiles). The estimate matched or exceeded what Triton 3.9 allocated when the kernel was
#: compiled ahead of time for SM75, SM80 and SM90; 48 KiB fits SM75's 64 KiB, the smallest limit.
SMEM_BUDGET = 48 << 10


def smem_estimate(rows: int, block_n: int, stages: int, d: int, dv: int,
                  elem_bytes: int) -> int:  # pragma: no cover  (GPU tile sizing; tests/plugins AOT-compiles it)
    return elem_bytes * (2 * rows * d + stages * block_n * (d + dv))


def choose_tiles(
    decode: bool, group: int, head_dim: int, v_head_dim: int, elem_bytes: int, *,
    interpret: bool, block_n: int = 0, extend_rows: int = 64,
) -> Tiles:
    """Block sizes for one layer shape; a pure function of its arguments (never of a batch).

    Tile rows are ``(token, group head)`` pairs: ``group`` rows in decode, about ``extend_rows``
    in extend. In the interpreter every program and loop step costs Python time and memory is
    no constraint, so blocks are big; on a GPU the largest ``BLOCK_N`` (then ``num_stages``, then
    rows) whose tiles fit ``SMEM_BUDGET`` is taken.
    """
    d, dv = _pow2(head_dim), _pow2(v_head_dim)
    block_m = 1 if decode else max(1, extend_rows // group)
    if interpret:
        return Tiles(block_m, _pow2(block_m * group), max(16, block_n or 64), num_warps=4, num_stages=1)
    while True:  # pragma: no cover  (GPU only: the suite runs interpreted; tests/plugins covers it)
        rows = _pow2(block_m * group)
        for n in ((block_n,) if block_n else (64, 32, 16)):
            for stages in (2, 1):
                if smem_estimate(rows, n, stages, d, dv, elem_bytes) <= SMEM_BUDGET:
                    return Tiles(block_m, rows, max(16, n), num_warps=4 if rows <= 64 else 8, num_stages=stages)
        if block_m == 1:  # nothing smaller to try: the smallest tiles
            return Tiles(1, rows, max(16, block_n or 16), num_warps=4 if rows <= 64 else 8, num_stages=1)
        block_m = max(1, block_m // 2)


class TritonBackend(PagedBackend):
    """Paged attention in Triton. Capabilities are the descriptor's, as class data."""

    capabilities = CAPABILITIES
    backend_name = NAME
    new_kv_source = "args"  # the kernels take this forward's K/V from their arguments, never the cache

    def __init__(
        self,
        ctx: Any,
        *,
        decode_split_len: int | str = "auto",
        block_n: int | str = "auto",
        extend_rows: int | str = "auto",
    ) -> None:
        """``decode_split_len``: key positions per decode split (fixed, so output is batch-invariant).
        ``block_n``: keys per inner step. ``extend_rows``: target tile rows (tokens x group heads)
        of an extend program. ``"auto"`` picks for the device: big blocks in the interpreter (each
        program and loop step costs Python time there), GPU-sized ones otherwise."""
        super().__init__(ctx)
        #: the kernels run in Triton's interpreter (decided when ``kernels`` was imported)
        self.interpret = INTERPRETED
        if not self.interpret and self.kv_cache is not None and self.device.type == "cpu":  # pragma: no cover
            raise AttnplugError(  # (compiled kernels with a CPU cache: impossible under TRITON_INTERPRET=1)
                "triton: the KV cache is on the CPU but the Triton kernels were compiled for a GPU "
                "(TRITON_INTERPRET was not set when attnplug_triton.kernels was first imported); "
                "set TRITON_INTERPRET=1 before importing triton to run them in Triton's interpreter"
            )
        auto = {"decode_split_len": 64 if self.interpret else 256,
                "block_n": 64 if self.interpret else 0,  # 0: per head dim, in choose_tiles
                "extend_rows": 256 if self.interpret else 64}
        given = {"decode_split_len": decode_split_len, "block_n": block_n, "extend_rows": extend_rows}
        for field, value in given.items():
            value = auto[field] if value == "auto" else value
            least = 0 if field == "block_n" else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"TritonBackend {field}={given[field]!r} (expected 'auto' or an integer >= {least})")
            setattr(self, field, value)
        self._tiles: dict[tuple[Any, ...], Tiles] = {}
        #: MLA ``w_kc``/``w_vc`` converted for the kernels, per (weight id, dtype): ``(weight, converted)``
        self._weights: dict[tuple[int, Any], tuple[Any, torch.Tensor]] = {}

    # -- per forward: the kernels' inputs, shared by every layer -----------------------
    def build_metadata(self, batch: Any) -> Metadata:
        dev = self.device
        B = batch.batch_size
        ext = list(batch.extend_seq_lens_cpu)
        starts = [0]
        for e in ext:
            starts.append(starts[-1] + e)
        meta = Metadata(
            mode=batch.forward_mode,
            batch_size=B,
            num_tokens=starts[-1],
            req=batch.req_pool_indices.to(device=dev, dtype=_I64),
            q_start=torch.tensor(starts[:-1], dtype=_I64, device=dev),
            prefix=torch.tensor(batch.extend_prefix_lens_cpu, dtype=_I32, device=dev),
            ext=torch.tensor(ext, dtype=_I32, device=dev),
            max_ext=max(ext, default=0),
            max_seq=max(batch.seq_lens_cpu, default=0),
            starts=starts,
        )
        if batch.encoder_lens is not None:
            enc = batch.encoder_lens.to(device=dev, dtype=_I32)
            meta.encoder, meta.max_encoder = enc, int(enc.max()) if B else 0
        if batch.forward_mode is ForwardMode.TARGET_VERIFY and batch.spec_custom_mask is not None:
            meta.mask = batch.spec_custom_mask.to(device=dev, dtype=torch.uint8).contiguous()
        return meta

    # -- per layer: the launches (the base checked the call and writes K/V afterwards) ---
    def compute_extend(self, q: Any, k: Any, v: Any, layer: Any, batch: Any, meta: Metadata) -> torch.Tensor:
        out = self.empty_output(q, layer, meta.num_tokens)  # PagedBackend never calls with zero tokens
        self._attend(q, k, v, layer, meta, out, decode=False, splits=1)
        return out

    def compute_decode(self, q: Any, k: Any, v: Any, layer: Any, batch: Any, meta: Metadata) -> torch.Tensor:
        out = self.empty_output(q, layer, meta.num_tokens)  # PagedBackend never calls with zero tokens
        self._decode(q, k, v, layer, meta, out, None)
        return out

    def _decode(self, q: Any, k: Any, v: Any, layer: Any, meta: Metadata, out: torch.Tensor,
                keys: "_Keys | None") -> None:
        """Split-KV decode in runs of requests whose partials fit ``max_workspace_bytes``."""
        max_keys = meta.max_encoder if layer.is_cross_attention else meta.max_seq
        splits = max(1, triton.cdiv(max(max_keys, 1), self.decode_split_len))
        per_token = splits * layer.num_heads * (out.shape[-1] + _PARTIAL_EXTRA) * 4
        for a, b in self.decode_chunks(meta, per_token, splits):
            part = meta.requests(a, b)
            t0, t1 = meta.starts[a], meta.starts[b]
            self._attend(q[t0:t1], None if k is None else k[t0:t1], None if v is None else v[t0:t1],
                         layer, part, out[t0:t1], decode=True, splits=splits, keys=keys)

    # -- MLA (LayerSpec.mla; docs/mla.md) --------------------------------------------------
    def compute_mla(self, q: Any, k: Any, layer: Any, batch: Any, meta: Metadata) -> torch.Tensor:
        """One MLA layer in the batch's form (``ForwardBatch.mla_form``), any mode (decode: split-KV).

        * absorbed: MQA over the latent rows, the same kernel as any layer: the latent buffer is both
          the K cache (all ``kv_lora_rank + qk_rope`` entries) and the V cache (its first
          ``kv_lora_rank`` entries, ``DV`` = ``kv_lora_rank``), this forward's latent rows ``k`` both the
          new keys and the new values;
        * unabsorbed: ``_mla_decompress_kernel`` turns the cached prefix's latent rows (gathered
          through ``req_to_token``, positions ``< extend_prefix_lens`` only) and this forward's into
          per-head keys ``[c_kv @ w_kc[h]^T, k_pe]`` and values ``c_kv @ w_vc[h]``, then the same
          attention kernel runs with ``num_heads`` KV heads over them (a one-forward table maps each
          request's positions to its decompressed rows).
        """
        decode = batch.forward_mode is ForwardMode.DECODE
        m = layer.mla
        cache = self.cache
        lat, scale, scaled = self._latent(layer)
        T, H = meta.num_tokens, layer.num_heads
        k = self._latent_rows(k, layer)
        if batch.mla_form == "absorbed":
            keys = _Keys(lat, lat, cache.req_to_token, scale, scale, scaled, 1, m.latent_dim, m.kv_lora_rank)
            out = q.new_empty((T, H, m.kv_lora_rank))
            kn = vn = k
            run = meta
        else:
            kc, vc, table = self._decompress_prefix(lat, scale, scaled, layer, q.dtype, batch, meta)
            kn, vn = self._decompress(k.reshape(T, m.latent_dim), None, 1.0, False, layer, q.dtype)
            keys = _Keys(kc, vc, table, 1.0, 1.0, False, H, m.qk_head_dim, m.v_head_dim)
            out = q.new_empty((T, H, m.v_head_dim))
            run = dataclasses.replace(meta, req=torch.arange(meta.batch_size, dtype=_I64, device=q.device))
        if decode:
            self._decode(q, kn, vn, layer, run, out, keys)
        else:
            self._attend(q, kn, vn, layer, run, out, decode=False, splits=1, keys=keys)
        return out

    def _latent(self, layer: Any) -> tuple[torch.Tensor, float, bool]:
        """The layer's latent buffer ``[num_slots, 1, latent]`` with its fp8 scale and whether it is scaled."""
        cache = self.cache
        kb = cache.get_kv(layer.layer_id)[0]
        scale = cache.kv_scales(layer.layer_id)[0]
        return kb, float(scale), bool(cache.quantized)

    def _latent_rows(self, k: torch.Tensor, layer: Any) -> torch.Tensor:
        """This forward's latent rows as the kernels read them: as the cache stores them (fp8 round trip)."""
        cache = self.cache
        if cache.quantized:
            k = cache.dequantize(layer.layer_id, *cache.quantize(layer.layer_id, k, k))[0]
        return self._rowwise(k)

    def _decompress(self, lat: torch.Tensor, slots: torch.Tensor | None, scale: float, scaled: bool, layer: Any,
                    dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head keys ``[n, H, qk_nope + qk_rope]`` and values ``[n, H, v_head_dim]`` of latent rows
        ``lat[slots]`` (or every row of ``lat`` when ``slots`` is ``None``), in ``dtype``."""
        m = layer.mla
        H = layer.num_heads
        n = lat.shape[0] if slots is None else slots.shape[0]
        kd = torch.empty((n, H, m.qk_head_dim), dtype=dtype, device=lat.device)
        vd = torch.empty((n, H, m.v_head_dim), dtype=dtype, device=lat.device)
        if n == 0:
            return kd, vd
        lat2 = lat.reshape(lat.shape[0], -1)
        if lat2.stride(-1) != 1:
            lat2 = lat2.contiguous()
        wkc = self._weight(m.w_kc, dtype, lat.device)
        wvc = self._weight(m.w_vc, dtype, lat.device)
        fp32 = dtype == torch.float32 or (self.interpret and dtype == torch.bfloat16)
        block_n = 64 if self.interpret else 16
        _mla_decompress_kernel[(triton.cdiv(n, block_n), H)](
            lat2, wkc, wvc, kd, vd, lat2 if slots is None else slots, n,
            lat2.stride(0), wkc.stride(0), wkc.stride(1), wvc.stride(0), wvc.stride(1),
            kd.stride(0), kd.stride(1), vd.stride(0), vd.stride(1), scale,
            R=m.kv_lora_rank, NOPE=m.qk_nope_head_dim, ROPE=m.qk_rope_head_dim, DV=m.v_head_dim,
            BLOCK_N=block_n, BLOCK_R=_pow2(m.kv_lora_rank), BLOCK_NOPE=_pow2(m.qk_nope_head_dim),
            BLOCK_ROPE=_pow2(m.qk_rope_head_dim), BLOCK_DV=_pow2(m.v_head_dim),
            GATHER=slots is not None, SCALED=scaled, FP32_DOT=fp32, num_warps=4,
        )
        return kd, vd

    def _weight(self, w: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """``w_kc`` / ``w_vc`` in the model dtype on the device (converted once per weight tensor and dtype)."""
        key = (id(w), dtype)
        hit = self._weights.get(key)
        if hit is not None and hit[0] is w:
            return hit[1]
        t = torch.as_tensor(w).detach().to(device=device, dtype=dtype).contiguous()
        self._weights[key] = (w, t)
        return t

    def _decompress_prefix(self, lat: torch.Tensor, scale: float, scaled: bool, layer: Any, dtype: torch.dtype,
                           batch: Any, meta: Metadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The cached prefixes' per-head keys and values, and the ``[B, max prefix]`` table mapping request
        ``i``'s position ``p`` to its row (read positions ``< extend_prefix_lens`` only: garbage elsewhere
        in the cache is never decompressed)."""
        prefix = list(batch.extend_prefix_lens_cpu)
        r2t = self.cache.req_to_token
        dev = lat.device
        width = max(max(prefix, default=0), 1)
        table = torch.zeros((meta.batch_size, width), dtype=_I64, device=dev)
        parts, at = [], 0
        for i, p in enumerate(prefix):
            if p:
                parts.append(r2t[int(batch.req_pool_indices_cpu[i]), :p])
                table[i, :p] = torch.arange(at, at + p, device=dev)
                at += p
        slots = torch.cat(parts).to(_I64) if parts else torch.zeros(0, dtype=_I64, device=dev)
        kc, vc = self._decompress(lat, slots, scale, scaled, layer, dtype)
        if not at:  # the kernel never reads them; a one-row buffer keeps the pointers valid
            kc, vc = kc.new_zeros((1,) + kc.shape[1:]), vc.new_zeros((1,) + vc.shape[1:])
        return kc, vc, table

    def decode_chunks(self, meta: Metadata, per_token: int, splits: int) -> list[tuple[int, int]]:
        """Runs of requests ``[a, b)`` whose split-KV partials fit ``max_workspace_bytes``.

        One run (the whole batch) when it fits; a request whose own partials exceed the limit is
        refused here, before anything is allocated or written.
        """
        limit = self.max_workspace_bytes
        widest = max(b - a for a, b in zip(meta.starts, meta.starts[1:]))
        tokens = f"{widest} token" + ("s" if widest != 1 else "")
        self.check_workspace(widest * per_token,
                             f"decode split-KV partials of one request ({splits} splits x {tokens})")
        if meta.num_tokens * per_token <= limit:
            return [(0, meta.batch_size)]
        runs, a = [], 0
        for b in range(1, meta.batch_size + 1):
            if (meta.starts[b] - meta.starts[a]) * per_token > limit:
                runs.append((a, b - 1))
                a = b - 1
        runs.append((a, meta.batch_size))
        return runs

    # -- helpers -------------------------------------------------------------------------
    def tiles(self, layer: Any, decode: bool, fp32: bool) -> Tiles:
        """Block sizes for ``layer`` (memoised; they depend on the layer shape, never on the batch)."""
        return self.tiles_for(layer.gqa_group_size, layer.head_dim, layer.v_head_dim, decode, fp32)

    def tiles_for(self, group: int, head_dim: int, v_head_dim: int, decode: bool, fp32: bool) -> Tiles:
        """Block sizes for one attention shape (memoised; never a function of the batch)."""
        key = (decode, group, head_dim, v_head_dim, fp32)
        t = self._tiles.get(key)
        if t is None:
            t = choose_tiles(decode, group, head_dim, v_head_dim, 4 if fp32 else 2,
                             interpret=self.interpret, block_n=self.block_n, extend_rows=self.extend_rows)
            self._tiles[key] = t
        return t

    @staticmethod
    def _rowwise(x: torch.Tensor) -> torch.Tensor:
        """``x`` with a unit stride in its last dim (the kernels index ``[token, head, dim]``)."""
        return x if x.stride(-1) == 1 else x.contiguous()

    def _attend(self, q: torch.Tensor, k: Any, v: Any, layer: Any, meta: Metadata, out: torch.Tensor, *,
                decode: bool, splits: int, keys: "_Keys | None" = None) -> None:
        """One launch over the requests of ``meta`` (``q``/``k``/``v``/``out`` hold exactly their tokens).

        ``keys``: where the keys come from instead of the layer's own cache buffers (MLA: the latent
        buffer as K and V, or the decompressed per-head keys of the unabsorbed form)."""
        cache = self.cache
        cross = bool(layer.is_cross_attention)
        q = self._rowwise(q)
        if keys is None:
            kb, vb = cache.get_kv(layer.layer_id)
            r2t = cache.req_to_token
            if cross:
                k = v = q  # unused by the kernel (no new keys); any pointer will do
            else:
                if cache.quantized:  # new tokens are read as the fp8 cache stores them (docs/api.md)
                    k, v = cache.dequantize(layer.layer_id, *cache.quantize(layer.layer_id, k, v))
                k, v = self._rowwise(k), self._rowwise(v)
            k_scale, v_scale = cache.kv_scales(layer.layer_id)
            scaled = cache.quantized
            H, G, D, DV = layer.num_heads, layer.gqa_group_size, layer.head_dim, layer.v_head_dim
            Hkv = layer.num_kv_heads
        else:
            kb, vb, r2t, k_scale, v_scale, scaled = keys.kb, keys.vb, keys.r2t, keys.k_scale, keys.v_scale, keys.scaled
            k, v = self._rowwise(k), self._rowwise(v)
            H, Hkv, D, DV = layer.num_heads, keys.kv_heads, keys.head_dim, keys.v_head_dim
            G = H // Hkv
        B = meta.batch_size
        fp32_dot = q.dtype == torch.float32 or (self.interpret and q.dtype == torch.bfloat16)
        tiles = self.tiles_for(G, D, DV, decode, fp32_dot)
        keys_len = meta.encoder if cross else meta.prefix
        sinks = None
        if layer.sinks is not None:
            sinks = torch.as_tensor(layer.sinks).detach().to(device=q.device, dtype=_F32).contiguous()
        window = layer.sliding_window
        cap = layer.logit_cap or 0.0
        mask = meta.mask if not cross else None

        if decode:
            grid2 = splits
            T = meta.num_tokens  # bounded by decode_chunks against max_workspace_bytes
            part_acc = torch.empty((splits, T, H, DV), dtype=_F32, device=q.device)
            part_m = torch.empty((splits, T, H), dtype=_F32, device=q.device)
            part_l = torch.empty((splits, T, H), dtype=_F32, device=q.device)
            split_len = self.decode_split_len
        else:
            grid2 = triton.cdiv(meta.max_ext, tiles.block_m)
            part_acc = part_m = part_l = out  # unused
            split_len = 1 << 30  # one split covering every position
        _attn_kernel[(B, Hkv, grid2)](
            q, k, v, kb, vb, r2t, out, part_acc, part_m, part_l,
            q if sinks is None else sinks, q if mask is None else mask,
            meta.req, meta.q_start, keys_len, meta.ext,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            kb.stride(0), kb.stride(1), vb.stride(0), vb.stride(1), r2t.stride(0),
            out.stride(0), out.stride(1),
            part_acc.stride(0), part_acc.stride(1), part_acc.stride(2), part_m.stride(0), part_m.stride(1),
            0 if mask is None else mask.stride(0), 0 if mask is None else mask.stride(1),
            float(layer.scaling), float(cap), int(window or 0), int(split_len), splits, k_scale, v_scale,
            D=D, DV=DV, G=G,
            BLOCK_M=tiles.block_m, BLOCK_R=tiles.block_r, BLOCK_N=tiles.block_n,
            BLOCK_D=_pow2(D), BLOCK_DV=_pow2(DV),
            STORE_PARTIALS=decode, IS_CROSS=cross, HAS_WINDOW=window is not None and not cross,
            HAS_CAP=bool(cap), HAS_SINKS=sinks is not None, HAS_MASK=mask is not None,
            FP32_DOT=fp32_dot, KV_SCALED=scaled, IS_CAUSAL=cross or not layer.uses_bidirectional,
            num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        )
        if decode:
            _combine_kernel[(meta.num_tokens,)](
                part_acc, part_m, part_l, q if sinks is None else sinks, out,
                part_acc.stride(0), part_acc.stride(1), part_acc.stride(2), part_m.stride(0), part_m.stride(1),
                out.stride(0), out.stride(1), splits,
                H=H, DV=DV, BLOCK_H=_pow2(H, 1), BLOCK_DV=_pow2(DV),
                HAS_SINKS=sinks is not None,
                num_warps=4,
            )
