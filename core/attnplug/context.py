"""``BuildContext``: the one frozen object a backend factory receives."""

from __future__ import annotations

import dataclasses
from typing import Any

from .config import AttentionConfig
from .dtypes import dtype_name
from .host import HostInfo
from .layer import LayerSpec


@dataclasses.dataclass(frozen=True, eq=False)
class BuildContext:
    """Everything a factory may look at. Never a whole engine, never globals.

    ``kv_cache`` is the engine's ``PagedKVCache`` (or ``None`` for a backend
    built only to be inspected). ``layers`` describes the model's attention
    layers when the engine knows them up front. ``is_draft`` is true when the
    backend is built for a speculative draft runner.
    """

    config: AttentionConfig
    host: HostInfo
    device: str = "cpu"
    dtype: str = "float32"
    kv_cache_dtype: str | None = None
    num_heads: int = 1
    num_kv_heads: int = 1
    head_dim: int = 64
    v_head_dim: int | None = None
    page_size: int = 1
    kv_cache: Any = None
    max_batch_size: int = 256
    max_context_len: int = 4096
    is_draft: bool = False
    layers: tuple[LayerSpec, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", dtype_name(self.dtype))
        object.__setattr__(self, "kv_cache_dtype", dtype_name(self.kv_cache_dtype or self.dtype))
        if self.v_head_dim is None:
            object.__setattr__(self, "v_head_dim", self.head_dim)
        object.__setattr__(self, "layers", tuple(self.layers))
        if self.kv_cache is not None and getattr(self.kv_cache, "page_size", self.page_size) != self.page_size:
            raise ValueError(
                f"BuildContext.page_size={self.page_size} but kv_cache.page_size={self.kv_cache.page_size}"
            )

    def replace(self, **changes: Any) -> "BuildContext":
        return dataclasses.replace(self, **changes)
