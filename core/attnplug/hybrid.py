"""``HybridBackend``: serves the split pair, routing through the one selector."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .backend import AttentionBackend
from .capabilities import Capabilities
from .selector import half_for_mode

if TYPE_CHECKING:  # annotations only: importing this module loads no torch
    import torch

    from .batch import ForwardBatch
    from .build_context import BuildContext
    from .layer import LayerSpec


class HybridBackend(AttentionBackend):
    """Two backends, one per half. Every protocol method goes to the half
    ``selector.half_for_mode`` names for the batch's mode; hooks without a
    batch (graph state, warm-up) go to both halves."""

    def __init__(
        self, prefill: AttentionBackend, decode: AttentionBackend, speculative_attention_mode: str = "prefill"
    ) -> None:
        self.prefill_backend = prefill
        self.decode_backend = decode
        self.speculative_attention_mode = speculative_attention_mode
        self.prefill_attention_backend_str = prefill.prefill_attention_backend_str
        self.decode_attention_backend_str = decode.decode_attention_backend_str

    @property
    def capabilities(self) -> Capabilities:  # type: ignore[override]
        return self.prefill_backend.capabilities

    def children(self) -> tuple[AttentionBackend, ...]:
        return (self.prefill_backend, self.decode_backend)

    def _half(self, batch: ForwardBatch) -> AttentionBackend:
        if half_for_mode(batch.forward_mode, self.speculative_attention_mode) == "decode":
            return self.decode_backend
        return self.prefill_backend

    def not_supported_reasons(self, layer: LayerSpec | None, ctx: BuildContext | None = None) -> list[str]:
        out = [f"prefill half: {r}" for r in self.prefill_backend.not_supported_reasons(layer, ctx)]
        out += [f"decode half: {r}" for r in self.decode_backend.not_supported_reasons(layer, ctx)]
        return out

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        self._half(batch).init_forward_metadata(batch)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, layer: LayerSpec,
        batch: ForwardBatch, save_kv_cache: bool = True,
    ) -> torch.Tensor:
        return self._half(batch).forward(q, k, v, layer, batch, save_kv_cache)

    def forward_extend(
        self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, layer: LayerSpec,
        batch: ForwardBatch, save_kv_cache: bool = True,
    ) -> torch.Tensor:
        """Routed to the half ``half_for_mode`` names for the batch."""
        return self._half(batch).forward_extend(q, k, v, layer, batch, save_kv_cache)

    def forward_decode(
        self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, layer: LayerSpec,
        batch: ForwardBatch, save_kv_cache: bool = True,
    ) -> torch.Tensor:
        """Routed to the half ``half_for_mode`` names for the batch."""
        return self._half(batch).forward_decode(q, k, v, layer, batch, save_kv_cache)

    def init_cuda_graph_state(self, max_batch_size: int, max_num_tokens: int) -> None:
        self.prefill_backend.init_cuda_graph_state(max_batch_size, max_num_tokens)
        self.decode_backend.init_cuda_graph_state(max_batch_size, max_num_tokens)

    def init_forward_metadata_capture_cuda_graph(self, batch: ForwardBatch) -> None:
        self._half(batch).init_forward_metadata_capture_cuda_graph(batch)

    def init_forward_metadata_replay_cuda_graph(self, batch: ForwardBatch) -> None:
        self._half(batch).init_forward_metadata_replay_cuda_graph(batch)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        # Graphs pad decode-shaped batches; the decode half owns the padding rule.
        return self.decode_backend.get_cuda_graph_seq_len_fill_value()

    def on_after_cuda_graph_warmup(self) -> None:
        self.prefill_backend.on_after_cuda_graph_warmup()
        self.decode_backend.on_after_cuda_graph_warmup()
