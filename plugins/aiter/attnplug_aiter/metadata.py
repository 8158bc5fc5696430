"""Host-independent half of the aiter backend: ``ForwardBatch`` -> aiter's layout.

Torch only (no aiter import), so every builder here is tested on CPU.

Like SGLang's ``AiterAttnBackend``, the layout is **token-level** (block size
1) whatever the cache page size: the cache of one layer is viewed as
``[num_slots, 1, kv_heads, dim]`` (``paged_attention_ragged``, layout
``"NHD"``, ``block_size=1``) or ``[num_slots, kv_heads, dim]`` (the "3D linear,
page_size=1" form of ``mha_batch_prefill_func``), so a "page" is a slot:

* ``kv_indptr[i+1] - kv_indptr[i]`` = number of keys of row ``i``;
* ``kv_indices[kv_indptr[i] + k]`` = the slot of its ``k``-th key, in
  position order (through ``req_to_token``);
* ``kv_last_page_lens[i] = 1``;
* ``cu_seqlens_q`` (``qo_indptr``): CSR offsets of each row's query tokens.

``mha_batch_prefill_func(causal=True)`` aligns the causal mask at the bottom
right (query ``a`` of a row sits at key position ``kv_len - q_len + a``) and
``window_size=(W, 0)`` keeps keys ``j >= p - W`` (``LayerSpec`` convention).
``paged_attention_ragged`` has no window and no mask: every listed key is
attended, so the window (decode) and a target-verify tree mask are applied
by *listing only the visible keys* (a verify draft token becomes its own
one-query row).

The new tokens are in the cache when the kernels run (the core's
``PagedBackend`` writes them first), so every listed index is a cache slot.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch

from attnplug.probes import version_key as parse_version  # noqa: F401  (the plugin's version order)
from attnplug.errors import ShapeError
from attnplug.kvcache import indptr
from attnplug import ForwardMode

SUPPORTED_GFX: tuple[str, ...] = ("gfx942", "gfx950")
MAX_GQA_RATIO = 16  # paged_attention_ragged dispatches num_heads / num_kv_heads in 1..16
PARTITION_SIZE = 256  # paged_attention_ragged's split-KV partition (SGLang: _AITER_PARTITION_SIZE_ROCM)
I32 = torch.int32


@dataclasses.dataclass(frozen=True)
class TokenKV:
    """Token-level rows: ``kv_indptr``/``kv_indices``/``kv_last_page_lens`` plus the host-side lengths."""

    kv_indptr: torch.Tensor  # int32 [rows+1]
    kv_indices: torch.Tensor  # int32 [kv_indptr[-1]] slot ids
    kv_last_page_lens: torch.Tensor  # int32 [rows], all 1
    kv_lens: tuple[int, ...]

    @property
    def max_kv_len(self) -> int:
        return max(self.kv_lens, default=0)


def _rows(keys: list[torch.Tensor], device: Any) -> TokenKV:
    lens = tuple(int(x.numel()) for x in keys)
    idx = torch.cat(keys).to(I32) if keys else torch.zeros(0, dtype=I32, device=device)
    return TokenKV(indptr(lens, device), idx, torch.ones(len(lens), dtype=I32, device=device), lens)


def key_slots(req_to_token: torch.Tensor, req: int, seq_len: int) -> torch.Tensor:
    """The cache slots of one request's keys (prefix and new tokens), in position order."""
    return req_to_token[req, :seq_len].to(torch.int64)


def extend_rows(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: Sequence[int],
    extend_lens: Sequence[int],
    window: int | None = None,
) -> TokenKV:
    """One row per request over all its keys (prefix + new). ``window`` drops the keys that no query
    of the row can see (``j < prefix - W``), used for decode where the row has one query."""
    device = req_to_token.device
    keys = []
    for r, p0, e in zip(req_pool_indices.tolist(), prefix_lens, extend_lens):
        ks = key_slots(req_to_token, r, p0 + e)
        if window is not None:
            first = max(0, p0 - window)  # the earliest query (position p0) sees j >= p0 - W
            ks = ks[first:]
        keys.append(ks)
    return _rows(keys, device)


def verify_rows(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: Sequence[int],
    num_draft: int,
    spec_custom_mask: torch.Tensor | None,
    window: int | None = None,
) -> TokenKV:
    """One row per draft token (one query each): the prefix keys it sees, then the drafts its mask row
    allows (causal when ``spec_custom_mask`` is ``None``), with the window applied by position."""
    device = req_to_token.device
    d = int(num_draft)
    causal = torch.ones(d, d, dtype=torch.bool).tril()
    keys = []
    for i, (r, p0) in enumerate(zip(req_pool_indices.tolist(), prefix_lens)):
        all_keys = key_slots(req_to_token, r, p0 + d)
        mask = causal if spec_custom_mask is None else spec_custom_mask[i].cpu().bool()
        for a in range(d):
            visible = torch.cat([torch.ones(p0, dtype=torch.bool), mask[a]])
            if window is not None:
                visible &= torch.arange(p0 + d) >= (p0 + a - window)
            keys.append(all_keys[visible.nonzero().reshape(-1).to(device)])
    return _rows(keys, device)


@dataclasses.dataclass
class ForwardLayout:
    """Built once per forward, shared by every layer; window-dependent rows memoised.

    ``kind``: ``"decode"`` (``paged_attention_ragged``, one query per request),
    ``"prefill"`` (``mha_batch_prefill_func``, causal), ``"verify"`` (one row
    per draft token; causal verify without a mask takes ``"prefill"``).
    """

    mode: ForwardMode
    kind: str
    cu_seqlens_q: torch.Tensor
    req_pool_indices: torch.Tensor
    prefix_lens: tuple[int, ...]
    extend_lens: tuple[int, ...]
    num_draft: int | None
    spec_custom_mask: torch.Tensor | None
    req_to_token: torch.Tensor
    _memo: dict[int | None, TokenKV] = dataclasses.field(default_factory=dict)

    @property
    def max_q_len(self) -> int:
        return max(self.extend_lens, default=0)

    def rows(self, window: int | None = None) -> TokenKV:
        """The ``TokenKV`` the kernel reads for a layer with this sliding window."""
        win = window if self.kind in ("decode", "verify") else None  # prefill: the kernel applies it
        if win not in self._memo:
            if self.kind == "verify":
                self._memo[win] = verify_rows(self.req_to_token, self.req_pool_indices, self.prefix_lens,
                                              self.num_draft or 0, self.spec_custom_mask, win)
            else:
                self._memo[win] = extend_rows(self.req_to_token, self.req_pool_indices, self.prefix_lens,
                                              self.extend_lens, win)
        return self._memo[win]

    def query_indptr(self) -> torch.Tensor:
        """``cu_seqlens_q`` for the rows: per request (prefill) or one per row (decode, verify)."""
        if self.kind == "prefill":
            return self.cu_seqlens_q
        n = sum(self.extend_lens)
        return torch.arange(n + 1, dtype=I32, device=self.cu_seqlens_q.device)


def build_layout(batch: Any, req_to_token: torch.Tensor) -> ForwardLayout:
    """Translate a validated ``ForwardBatch`` into aiter's layout (rows are built on first use)."""
    mode = batch.forward_mode
    if mode is ForwardMode.IDLE:
        raise ShapeError("aiter: an idle batch has no layout (forward returns an empty output)")
    if mode is ForwardMode.DECODE:
        kind = "decode"
    elif mode is ForwardMode.TARGET_VERIFY and batch.spec_custom_mask is not None:
        kind = "verify"
    else:
        kind = "prefill"
    return ForwardLayout(
        mode=mode,
        kind=kind,
        cu_seqlens_q=batch.qo_indptr(req_to_token.device),
        req_pool_indices=batch.req_pool_indices.to(req_to_token.device),
        prefix_lens=tuple(batch.extend_prefix_lens_cpu),
        extend_lens=tuple(batch.extend_seq_lens_cpu),
        num_draft=batch.spec_num_draft_tokens,
        spec_custom_mask=batch.spec_custom_mask if kind == "verify" else None,
        req_to_token=req_to_token,
    )


# ---------------------------------------------------------------------------
# per-layer arguments and guards
# ---------------------------------------------------------------------------


def window_size(layer: Any) -> tuple[int, int]:
    """``mha_batch_prefill_func``'s ``window_size``: ``(W, 0)`` with a window, ``(-1, -1)`` without."""
    return (-1, -1) if layer.sliding_window is None else (int(layer.sliding_window), 0)


def logits_soft_cap(layer: Any) -> float:
    return float(layer.logit_cap) if layer.logit_cap else 0.0


def max_num_partitions(max_context_len: int) -> int:
    """``paged_attention_ragged``'s ``max_num_partitions`` (sizes its workspace)."""
    return (max_context_len + PARTITION_SIZE - 1) // PARTITION_SIZE


def workspace_bytes(max_rows: int, num_heads: int, head_dim: int, max_context_len: int) -> int:
    """Workspace of ``paged_attention_ragged``: fp32 partial outputs plus max/sum per partition."""
    parts = max_num_partitions(max_context_len)
    return max_rows * num_heads * parts * head_dim * 4 + 2 * max_rows * num_heads * parts * 4


def check_gfx(gfx_arch: str | None) -> None:
    if gfx_arch not in SUPPORTED_GFX:
        raise RuntimeError(f"aiter: gfx_arch={gfx_arch!r}; aiter's kernels are built for {', '.join(SUPPORTED_GFX)}")
