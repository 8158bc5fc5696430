"""``BackendWrapper``: the base for anything that wraps one backend.

It forwards every protocol method, optional ones included, to the inner
backend and carries the inner backend's stamps. Subclasses override only what
they add (e.g. a sidecar that keeps extra state around ``forward``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .backend import AttentionBackend
from .capabilities import Capabilities
from .stamps import copy_stamps

if TYPE_CHECKING:  # annotations only: importing this module loads no torch
    import torch

    from .batch import ForwardBatch
    from .build_context import BuildContext
    from .layer import LayerSpec


class BackendWrapper(AttentionBackend):
    def __init__(self, inner: AttentionBackend) -> None:
        self.inner = inner
        copy_stamps(inner, self)

    @property
    def capabilities(self) -> Capabilities:  # type: ignore[override]
        return self.inner.capabilities

    def children(self) -> tuple[AttentionBackend, ...]:
        return (self.inner,)

    def not_supported_reasons(self, layer: LayerSpec | None, ctx: BuildContext | None = None) -> list[str]:
        return self.inner.not_supported_reasons(layer, ctx)

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        self.inner.init_forward_metadata(batch)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, layer: LayerSpec,
        batch: ForwardBatch, save_kv_cache: bool = True,
    ) -> torch.Tensor:
        return self.inner.forward(q, k, v, layer, batch, save_kv_cache)

    def forward_extend(
        self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, layer: LayerSpec,
        batch: ForwardBatch, save_kv_cache: bool = True,
    ) -> torch.Tensor:
        """Forwarded to the inner backend."""
        return self.inner.forward_extend(q, k, v, layer, batch, save_kv_cache)

    def forward_decode(
        self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, layer: LayerSpec,
        batch: ForwardBatch, save_kv_cache: bool = True,
    ) -> torch.Tensor:
        """Forwarded to the inner backend."""
        return self.inner.forward_decode(q, k, v, layer, batch, save_kv_cache)

    def init_cuda_graph_state(self, max_batch_size: int, max_num_tokens: int) -> None:
        self.inner.init_cuda_graph_state(max_batch_size, max_num_tokens)

    def init_forward_metadata_capture_cuda_graph(self, batch: ForwardBatch) -> None:
        self.inner.init_forward_metadata_capture_cuda_graph(batch)

    def init_forward_metadata_replay_cuda_graph(self, batch: ForwardBatch) -> None:
        self.inner.init_forward_metadata_replay_cuda_graph(batch)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return self.inner.get_cuda_graph_seq_len_fill_value()

    def on_after_cuda_graph_warmup(self) -> None:
        self.inner.on_after_cuda_graph_warmup()
