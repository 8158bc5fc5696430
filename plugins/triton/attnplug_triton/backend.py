"""Kernel module of the ``triton`` backend: ``TritonBackend`` and its factory.

Imported only when the backend is built; imports ``torch`` and ``triton``
(through ``attnplug_triton.kernels``). The kernels are described in
``kernels.py``; this module translates a ``ForwardBatch`` into their inputs
once per forward and launches them per layer.

Per forward (``init_forward_metadata``), shared by every layer:
``req`` (the request rows of ``req_to_token``), ``q_start`` (each request's
first token in q/k/v), ``prefix`` (cached keys before this forward), ``ext``
(new tokens), the target-verify mask as bytes, and the host-side grid sizes.

Per layer: K/V are written at ``out_cache_loc`` (``PagedKVCache.set_kv``),
then one launch of ``_attn_kernel``:

* decode, grid ``(batch, kv_heads, splits)``: split-KV over fixed
  ``decode_split_len`` position ranges, then ``_combine_kernel`` (grid
  ``(batch,)``) merges the partials and adds the sinks;
* every other mode (extend, mixed, target-verify, draft-extend), grid
  ``(batch, kv_heads, blocks of BLOCK_M new tokens)``, normalised in place.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import triton

from attnplug.backend import AttentionBackend, MetadataGuard
from attnplug.batch import check_qkv
from attnplug.errors import AttnplugError, ShapeError
from attnplug.modes import ForwardMode

from . import CAPABILITIES, NAME
from .kernels import INTERPRETED, _attn_kernel, _combine_kernel

_I32, _I64, _F32 = torch.int32, torch.int64, torch.float32


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
    """One forward's kernel inputs, built once by ``init_forward_metadata``."""

    mode: ForwardMode
    batch_size: int
    num_tokens: int
    req: torch.Tensor  # int64 [B]: row of req_to_token
    q_start: torch.Tensor  # int64 [B]: first token of the request in q/k/v
    prefix: torch.Tensor  # int32 [B]: cached keys before this forward
    ext: torch.Tensor  # int32 [B]: new tokens
    max_ext: int
    max_seq: int
    encoder: torch.Tensor | None = None  # int32 [B] (cross-attention)
    max_encoder: int = 0
    mask: torch.Tensor | None = None  # uint8 [B, d, d] (target-verify custom mask)

    @property
    def is_decode(self) -> bool:
        return self.mode is ForwardMode.DECODE


def _pow2(n: int, floor: int = 16) -> int:
    return max(floor, triton.next_power_of_2(max(1, n)))


#: Shared-memory budget of one program on a GPU, estimated as ``elem * (2 * rows * d + stages *
#: block_n * (d + dv))`` (the Q tile and one layout conversion of it, plus ``num_stages`` K and V
#: tiles). The estimate matched or exceeded what Triton 3.9 allocated when the kernel was
#: compiled ahead of time for SM75, SM80 and SM90; 48 KiB fits SM75's 64 KiB, the smallest limit.
SMEM_BUDGET = 48 << 10


def smem_estimate(rows: int, block_n: int, stages: int, d: int, dv: int, elem_bytes: int) -> int:
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
    while True:
        rows = _pow2(block_m * group)
        for n in ((block_n,) if block_n else (64, 32, 16)):
            for stages in (2, 1):
                if smem_estimate(rows, n, stages, d, dv, elem_bytes) <= SMEM_BUDGET:
                    return Tiles(block_m, rows, max(16, n), num_warps=4 if rows <= 64 else 8, num_stages=stages)
        if block_m == 1:  # nothing smaller to try: the smallest tiles
            return Tiles(1, rows, max(16, block_n or 16), num_warps=4 if rows <= 64 else 8, num_stages=1)
        block_m = max(1, block_m // 2)


class TritonBackend(AttentionBackend):
    """Paged attention in Triton. Capabilities are the descriptor's, as class data."""

    capabilities = CAPABILITIES

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
        self.ctx = ctx
        self.kv_cache = ctx.kv_cache
        self.device = torch.device(ctx.device if ctx.kv_cache is None else ctx.kv_cache.device)
        #: the kernels run in Triton's interpreter (decided when ``kernels`` was imported)
        self.interpret = INTERPRETED
        if not self.interpret and self.kv_cache is not None and self.device.type == "cpu":
            raise AttnplugError(
                "triton: the KV cache is on the CPU but the Triton kernels were compiled for a GPU "
                "(TRITON_INTERPRET was not set when attnplug_triton.kernels was first imported); "
                "set TRITON_INTERPRET=1 before importing triton to run them in Triton's interpreter"
            )
        if decode_split_len == "auto":
            decode_split_len = 64 if self.interpret else 256
        if block_n == "auto":
            block_n = 64 if self.interpret else 0  # 0: per head dim, below
        if extend_rows == "auto":
            extend_rows = 256 if self.interpret else 64
        if int(decode_split_len) < 1:
            raise ValueError(f"decode_split_len={decode_split_len} (expected >= 1)")
        self.decode_split_len = int(decode_split_len)
        self.block_n = int(block_n)
        self.extend_rows = int(extend_rows)
        self._guard = MetadataGuard(NAME)
        self._tiles: dict[tuple[Any, ...], Tiles] = {}
        #: how many times ``init_forward_metadata`` built metadata (tests: once per forward)
        self.metadata_builds = 0

    # -- metadata --------------------------------------------------------
    def init_forward_metadata(self, batch: Any) -> None:
        mode = batch.forward_mode
        meta: Metadata | None = None
        if mode is not ForwardMode.IDLE:
            meta = self._metadata(batch)
        self.metadata_builds += 1
        self._guard.set(batch, meta)

    def _metadata(self, batch: Any) -> Metadata:
        dev = self.device
        B = batch.batch_size
        prefix = batch.extend_prefix_lens_cpu
        ext = batch.extend_seq_lens_cpu
        starts, t = [], 0
        for e in ext:
            starts.append(t)
            t += e
        meta = Metadata(
            mode=batch.forward_mode,
            batch_size=B,
            num_tokens=t,
            req=batch.req_pool_indices.to(device=dev, dtype=_I64),
            q_start=torch.tensor(starts, dtype=_I64, device=dev),
            prefix=torch.tensor(prefix, dtype=_I32, device=dev),
            ext=torch.tensor(ext, dtype=_I32, device=dev),
            max_ext=max(ext, default=0),
            max_seq=max(batch.seq_lens_cpu, default=0),
        )
        if batch.encoder_lens is not None:
            enc = batch.encoder_lens.to(device=dev, dtype=_I32)
            meta.encoder, meta.max_encoder = enc, int(enc.max()) if B else 0
        if batch.forward_mode is ForwardMode.TARGET_VERIFY and batch.spec_custom_mask is not None:
            meta.mask = batch.spec_custom_mask.to(device=dev, dtype=torch.uint8).contiguous()
        return meta

    # -- forward -----------------------------------------------------------
    def forward_extend(self, q: Any, k: Any, v: Any, layer: Any, batch: Any, save_kv_cache: bool = True) -> Any:
        return self._forward(q, k, v, layer, batch, save_kv_cache)

    def forward_decode(self, q: Any, k: Any, v: Any, layer: Any, batch: Any, save_kv_cache: bool = True) -> Any:
        return self._forward(q, k, v, layer, batch, save_kv_cache)

    def _forward(self, q: Any, k: Any, v: Any, layer: Any, batch: Any, save_kv_cache: bool) -> Any:
        meta = self._guard.require(batch)
        if meta is None:  # idle
            return q.new_empty((0, layer.num_heads, layer.v_head_dim))
        self._check(q, k, v, layer, batch)
        if save_kv_cache and k is not None and not layer.is_cross_attention and meta.num_tokens:
            self._cache().set_kv(layer.layer_id, batch.out_cache_loc, k, v)
        out = q.new_empty((meta.num_tokens, layer.num_heads, layer.v_head_dim))
        if meta.num_tokens:
            self._attend(q, k, v, layer, meta, out)
        return out

    # -- helpers -----------------------------------------------------------
    def _cache(self) -> Any:
        if self.kv_cache is None:
            raise AttnplugError(
                "triton was built without a KV cache (BuildContext.kv_cache is None); "
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
        if layer.is_cross_attention and batch.encoder_lens is None:
            raise ShapeError(f"cross-attention layer {layer.layer_id} but ForwardBatch.encoder_lens is None")
        if q.device.type != self.device.type or (k is not None and k.device.type != self.device.type):
            raise ShapeError(f"q/k/v are on {q.device}, the KV cache on {self.device}")

    def tiles(self, layer: Any, decode: bool, fp32: bool) -> Tiles:
        """Block sizes for ``layer`` (memoised; they depend on the layer shape, never on the batch)."""
        key = (decode, layer.gqa_group_size, layer.head_dim, layer.v_head_dim, fp32)
        t = self._tiles.get(key)
        if t is None:
            t = choose_tiles(decode, layer.gqa_group_size, layer.head_dim, layer.v_head_dim, 4 if fp32 else 2,
                             interpret=self.interpret, block_n=self.block_n, extend_rows=self.extend_rows)
            self._tiles[key] = t
        return t

    @staticmethod
    def _rowwise(x: torch.Tensor) -> torch.Tensor:
        """``x`` with a unit stride in its last dim (the kernels index ``[token, head, dim]``)."""
        return x if x.stride(-1) == 1 else x.contiguous()

    def _attend(self, q: torch.Tensor, k: Any, v: Any, layer: Any, meta: Metadata, out: torch.Tensor) -> None:
        kb, vb = self._cache().get_kv(layer.layer_id)
        r2t = self._cache().req_to_token
        cross = bool(layer.is_cross_attention)
        q = self._rowwise(q)
        if cross:
            k = v = q  # unused by the kernel (no new keys); any pointer will do
        else:
            k, v = self._rowwise(k), self._rowwise(v)
        H, G, D, DV = layer.num_heads, layer.gqa_group_size, layer.head_dim, layer.v_head_dim
        B = meta.batch_size
        decode = meta.is_decode
        fp32_dot = q.dtype == torch.float32 or (self.interpret and q.dtype == torch.bfloat16)
        tiles = self.tiles(layer, decode, fp32_dot)
        keys_len = meta.encoder if cross else meta.prefix
        max_keys = meta.max_encoder if cross else meta.max_seq
        sinks = None
        if layer.sinks is not None:
            sinks = torch.as_tensor(layer.sinks).detach().to(device=q.device, dtype=_F32).contiguous()
        window = layer.sliding_window
        cap = layer.logit_cap or 0.0
        mask = meta.mask if not cross else None

        if decode:
            splits = max(1, triton.cdiv(max(max_keys, 1), self.decode_split_len))
            grid2 = splits
            T = meta.num_tokens
            part_acc = torch.empty((splits, T, H, DV), dtype=_F32, device=q.device)
            part_m = torch.empty((splits, T, H), dtype=_F32, device=q.device)
            part_l = torch.empty((splits, T, H), dtype=_F32, device=q.device)
            split_len = self.decode_split_len
        else:
            splits = 1
            grid2 = triton.cdiv(meta.max_ext, tiles.block_m)
            part_acc = part_m = part_l = out  # unused
            split_len = 1 << 30  # one split covering every position
        _attn_kernel[(B, layer.num_kv_heads, grid2)](
            q, k, v, kb, vb, r2t, out, part_acc, part_m, part_l,
            q if sinks is None else sinks, q if mask is None else mask,
            meta.req, meta.q_start, keys_len, meta.ext,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            kb.stride(0), kb.stride(1), vb.stride(0), vb.stride(1), r2t.stride(0),
            out.stride(0), out.stride(1),
            part_acc.stride(0), part_acc.stride(1), part_acc.stride(2), part_m.stride(0), part_m.stride(1),
            0 if mask is None else mask.stride(0), 0 if mask is None else mask.stride(1),
            float(layer.scaling), float(cap), int(window or 0), int(split_len), splits,
            D=D, DV=DV, G=G,
            BLOCK_M=tiles.block_m, BLOCK_R=tiles.block_r, BLOCK_N=tiles.block_n,
            BLOCK_D=_pow2(D), BLOCK_DV=_pow2(DV),
            STORE_PARTIALS=decode, IS_CROSS=cross, HAS_WINDOW=window is not None and not cross,
            HAS_CAP=bool(cap), HAS_SINKS=sinks is not None, HAS_MASK=mask is not None,
            FP32_DOT=fp32_dot,
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
