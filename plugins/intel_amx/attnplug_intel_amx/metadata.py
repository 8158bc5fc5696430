"""Arguments of sgl-kernel's CPU attention ops from a ``ForwardBatch`` (torch only).

Both ops read the canonical per-layer slot buffers ``[slots, kv_heads,
dim]`` directly, through ``req_to_token`` (int32 or int64; the page size
does not matter to them):

* ``decode_attention_cpu(query, k_cache, v_cache, output, key, value, loc,
  attn_logits, req_to_token, req_pool_indices, seq_lens, sm_scale,
  logit_cap[, is_cross_attention, sliding_window_size, encoder_lens,
  sinks])``: writes ``key``/``value`` at ``loc`` itself, then request ``b``
  attends to ``req_to_token[req_pool_indices[b], :seq_lens[b]]``;
  ``attn_logits`` is float32 scratch ``[batch, heads, 8 kv splits,
  v_head_dim + 1]``;
* ``extend_attention_cpu(q_extend, k_extend, v_extend, o_extend, k_buffer,
  v_buffer, req_to_token, req_pool_indices, seq_lens, extend_seq_lens,
  extend_start_loc, max_len_extend, sm_scale, logit_cap[, …])``: request
  ``b``'s prefix is read from the buffers at its first ``seq_lens[b] -
  extend_seq_lens[b]`` positions, its new tokens from ``k_extend``/
  ``v_extend`` rows ``extend_start_loc[b] …``, causal among them.

``req_pool_indices`` and ``seq_lens`` are int64; ``extend_seq_lens`` and
``extend_start_loc`` have ``req_to_token``'s dtype. ``sliding_window_size``
counts the visible keys including the query's own (SGLang passes its window
+ 1), 0 meaning no window.
"""

from __future__ import annotations

import dataclasses
import torch

from attnplug import ForwardBatch, ForwardMode

#: kv splits of the decode op's scratch buffer (SGLang's IntelAMXAttnBackend uses 8)
NUM_KV_SPLITS = 8


@dataclasses.dataclass
class AmxMetadata:
    """One forward's op arguments, shared by every layer (``attn_logits`` per head count / value dim)."""

    mode: ForwardMode
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    extend_seq_lens: torch.Tensor
    extend_start_loc: torch.Tensor
    max_len_extend: int
    _logits: dict[tuple[int, int], torch.Tensor] = dataclasses.field(default_factory=dict)

    @property
    def batch_size(self) -> int:
        return int(self.seq_lens.numel())

    def attn_logits(self, num_heads: int, v_head_dim: int) -> torch.Tensor:
        """float32 ``[batch, num_heads, NUM_KV_SPLITS, v_head_dim + 1]`` scratch (built once per shape)."""
        key = (num_heads, v_head_dim)
        if key not in self._logits:
            self._logits[key] = torch.zeros(self.batch_size, num_heads, NUM_KV_SPLITS, v_head_dim + 1,
                                            dtype=torch.float32, device=self.seq_lens.device)
        return self._logits[key]


def build_metadata(batch: ForwardBatch, req_to_token: torch.Tensor) -> AmxMetadata | None:
    """The ops' per-forward arguments for ``batch`` (``None`` when idle)."""
    mode = batch.forward_mode
    if mode is ForwardMode.IDLE:
        return None
    device, index = req_to_token.device, req_to_token.dtype
    starts = batch.qo_indptr(device).to(index)  # the core's cu_seqlens_q: starts, then the token count
    return AmxMetadata(
        mode=mode,
        req_pool_indices=batch.req_pool_indices.to(device=device, dtype=torch.int64),
        seq_lens=batch.seq_lens.to(device=device, dtype=torch.int64),
        extend_seq_lens=starts[1:] - starts[:-1],
        extend_start_loc=starts[:-1],
        max_len_extend=batch.max_extend_len,
    )


def window_arg(sliding_window: int | None) -> int:
    """The ops' ``sliding_window_size``: visible keys including the query's own (``window + 1``), 0 for none."""
    return 0 if sliding_window is None else int(sliding_window) + 1
