"""Host-independent half of the flashinfer backend: ``ForwardBatch`` -> FlashInfer layout.

Torch only (no flashinfer import), so every builder here is tested on CPU.

FlashInfer's paged layout (docs: "Page Table Layout", ``kv_layout.rst``) is a
CSR page table. For request ``i`` with ``L_i`` keys in pages of ``P`` slots:

* ``paged_kv_indptr[i+1] - paged_kv_indptr[i] = ceil(L_i / P)`` pages;
* ``paged_kv_indices[paged_kv_indptr[i] + k]`` is the page holding positions
  ``k*P … k*P + P-1`` (attnplug page ``p`` is slots ``p*P … p*P + P-1``, so
  the page of position ``k*P`` is ``req_to_token[r, k*P] // P``);
* ``paged_kv_last_page_len[i] = L_i - P * (pages_i - 1)``, in ``1 … P``.

``qo_indptr`` is the CSR offset of each request's query tokens. A causal mask
with ``qo_len < kv_len`` is aligned at the bottom right (query ``a`` of a
request sits at position ``kv_len - qo_len + a``), which is attnplug's
"new tokens follow the prefix". ``window_left = W`` keeps keys ``j >= p - W``
(the ``LayerSpec.sliding_window`` convention); ``-1`` is no window.

A custom mask (target-verify) is one flat bool array: request after request,
a row-major ``[qo_len_i, kv_len_i]`` block (``mask_indptr`` is implied:
``cumsum(qo_len * kv_len)``).

All index tensors are int32, as the FlashInfer wrappers take them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import torch

from attnplug.probes import version_key as parse_version  # noqa: F401  (the plugin's version order)
from attnplug.errors import ShapeError
from attnplug.kvcache import indptr
from attnplug import ForwardMode

I32 = torch.int32


# ---------------------------------------------------------------------------
# layout builders
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PagedKV:
    """FlashInfer's paged page table for ``kv_lens`` keys per request."""

    kv_indptr: torch.Tensor  # int32 [B+1]
    kv_indices: torch.Tensor  # int32 [kv_indptr[-1]]  page ids
    kv_last_page_len: torch.Tensor  # int32 [B], each in 1..page_size
    kv_lens: tuple[int, ...]
    page_size: int

    @property
    def batch_size(self) -> int:
        return len(self.kv_lens)


def paged_kv(
    req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, kv_lens: Sequence[int], page_size: int
) -> PagedKV:
    """The page table of the first ``kv_lens[i]`` positions of each request (one gather, no loop)."""
    check_page_size(page_size)
    lens = [int(x) for x in kv_lens]
    if any(n < 1 for n in lens):
        raise ShapeError(f"flashinfer needs kv_lens >= 1 for every request (got {lens})")
    device = req_to_token.device
    if lens and max(lens) > req_to_token.shape[1]:
        raise ShapeError(f"kv_lens max {max(lens)} exceeds req_to_token width {req_to_token.shape[1]}")
    pages = [(n + page_size - 1) // page_size for n in lens]
    kv_indptr = indptr(pages, device)
    total = sum(pages)
    req = req_pool_indices.to(device=device, dtype=torch.int64)
    if total:
        counts = torch.as_tensor(pages, dtype=torch.int64, device=device)
        owner = torch.repeat_interleave(torch.arange(len(lens), device=device), counts)
        k = torch.arange(total, device=device) - kv_indptr[:-1].to(torch.int64)[owner]
        first_slots = req_to_token[req[owner], k * page_size]
        kv_indices = torch.div(first_slots, page_size, rounding_mode="floor").to(I32)
    else:
        kv_indices = torch.zeros(0, dtype=I32, device=device)
    last = torch.as_tensor([n - page_size * (p - 1) for n, p in zip(lens, pages)], dtype=I32, device=device)
    return PagedKV(kv_indptr, kv_indices, last, tuple(lens), page_size)


def verify_custom_mask(
    prefix_lens: Sequence[int],
    num_draft: int,
    spec_custom_mask: torch.Tensor | None,
    window: int | None = None,
    device: Any = "cpu",
) -> torch.Tensor:
    """The flat bool custom mask of a target-verify forward.

    Request ``i`` contributes a row-major ``[num_draft, prefix_i + num_draft]``
    block: draft ``a`` sees the whole prefix and draft ``b`` iff
    ``spec_custom_mask[i, a, b]`` (causal when ``None``). With a sliding
    window ``W`` the keys ``j < p - W`` (``p = prefix_i + a``) are hidden too:
    folded in here so one planned mask serves a windowed layer.
    """
    d = int(num_draft)
    causal = torch.ones(d, d, dtype=torch.bool, device=device).tril()
    blocks = []
    for i, p0 in enumerate(int(x) for x in prefix_lens):
        draft = causal if spec_custom_mask is None else spec_custom_mask[i].to(device=device, dtype=torch.bool)
        block = torch.cat([torch.ones(d, p0, dtype=torch.bool, device=device), draft], dim=1)
        if window is not None:
            qpos = p0 + torch.arange(d, device=device)
            kpos = torch.arange(p0 + d, device=device)
            block = block & (kpos[None, :] >= (qpos - window)[:, None])
        blocks.append(block.reshape(-1))
    return torch.cat(blocks) if blocks else torch.zeros(0, dtype=torch.bool, device=device)


@dataclasses.dataclass
class ForwardLayout:
    """What one forward needs, built once in ``init_forward_metadata`` and shared by every layer.

    ``paged`` covers each request's keys *after* this forward (prefix + new
    tokens: the kernels read the new K/V back from the cache, written first).
    ``kind`` is ``"decode"`` (BatchDecode wrapper), ``"prefill"`` (causal
    BatchPrefill) or ``"verify"`` (BatchPrefill with a custom mask).
    Per-window masks are built on first use.
    """

    mode: ForwardMode
    kind: str
    qo_indptr: torch.Tensor
    paged: PagedKV
    prefix_lens: tuple[int, ...]
    extend_lens: tuple[int, ...]
    num_draft: int | None = None
    spec_custom_mask: torch.Tensor | None = None
    _memo: dict[Any, Any] = dataclasses.field(default_factory=dict)

    @property
    def batch_size(self) -> int:
        return self.paged.batch_size

    def custom_mask(self, window: int | None) -> torch.Tensor:
        key = ("mask", window)
        if key not in self._memo:
            self._memo[key] = verify_custom_mask(
                self.prefix_lens, self.num_draft or 0, self.spec_custom_mask, window, self.qo_indptr.device
            )
        return self._memo[key]

def build_layout(batch: Any, req_to_token: torch.Tensor, page_size: int) -> ForwardLayout:
    """Translate a validated ``ForwardBatch`` into FlashInfer's layout (no per-layer work)."""
    mode = batch.forward_mode
    if mode is ForwardMode.IDLE:
        raise ShapeError("flashinfer: an idle batch has no layout (forward returns an empty output)")
    device = req_to_token.device
    seq = batch.seq_lens_cpu
    prefix, ext = batch.extend_prefix_lens_cpu, batch.extend_seq_lens_cpu
    if mode is ForwardMode.DECODE:
        kind = "decode"
    elif mode is ForwardMode.TARGET_VERIFY:
        kind = "verify"
    else:
        kind = "prefill"
    return ForwardLayout(
        mode=mode,
        kind=kind,
        qo_indptr=batch.qo_indptr(device),
        paged=paged_kv(req_to_token, batch.req_pool_indices, seq, page_size),
        prefix_lens=tuple(prefix),
        extend_lens=tuple(ext),
        num_draft=batch.spec_num_draft_tokens,
        spec_custom_mask=batch.spec_custom_mask if kind == "verify" else None,
    )


# ---------------------------------------------------------------------------
# per-layer kernel arguments and guards
# ---------------------------------------------------------------------------


def window_left(layer: Any) -> int:
    """``LayerSpec.sliding_window`` as FlashInfer's ``window_left`` (``-1``: none)."""
    return -1 if layer.sliding_window is None else int(layer.sliding_window)


def logits_soft_cap(layer: Any) -> float:
    """``LayerSpec.logit_cap`` as FlashInfer's ``logits_soft_cap`` (``0.0``: none)."""
    return float(layer.logit_cap) if layer.logit_cap else 0.0


def check_page_size(page_size: int) -> None:
    if not isinstance(page_size, int) or page_size < 1:
        raise ShapeError(f"flashinfer: page_size={page_size!r} (expected a positive integer)")


def num_pages_for(kv_len: int, page_size: int) -> int:
    return math.ceil(kv_len / page_size)
