"""``BuildContext``: the one frozen object a backend factory receives."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from .config import AttentionConfig
from .dtypes import dtype_name, kv_dtype_name
from .host import HostInfo
from .layer import LayerSpec

if TYPE_CHECKING:  # annotations only: importing this module loads no torch
    from .kvcache import PagedKVCache


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
    #: typed as what a built object holds: the default ``None`` (omit the argument) means ``head_dim``,
    #: filled by ``__post_init__``
    v_head_dim: int = None  # type: ignore[assignment]
    page_size: int = 1
    kv_cache: PagedKVCache | None = None
    max_batch_size: int = 256
    max_context_len: int = 4096
    is_draft: bool = False
    layers: tuple[LayerSpec, ...] = ()
    #: largest single workspace (bytes) a backend may allocate for one call; larger work is
    #: chunked or refused with ``ResourceLimitError`` naming this field
    max_workspace_bytes: int = 4 << 30

    def __post_init__(self) -> None:
        for name in ("num_heads", "num_kv_heads", "head_dim", "page_size", "max_batch_size",
                     "max_context_len", "max_workspace_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"BuildContext.{name}={value!r} (expected a positive integer)")
        if self.v_head_dim is not None and (
            isinstance(self.v_head_dim, bool) or not isinstance(self.v_head_dim, int) or self.v_head_dim < 1
        ):
            raise ValueError(f"BuildContext.v_head_dim={self.v_head_dim!r} (expected a positive integer or None)")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"BuildContext.num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if not isinstance(self.is_draft, bool):
            raise ValueError(f"BuildContext.is_draft={self.is_draft!r} (expected True or False)")
        object.__setattr__(self, "dtype", dtype_name(self.dtype))
        object.__setattr__(self, "kv_cache_dtype", kv_dtype_name(self.kv_cache_dtype, self.dtype))
        if self.v_head_dim is None:
            object.__setattr__(self, "v_head_dim", self.head_dim)
        object.__setattr__(self, "layers", tuple(self.layers))
        if self.kv_cache is not None and getattr(self.kv_cache, "page_size", self.page_size) != self.page_size:
            raise ValueError(
                f"BuildContext.page_size={self.page_size} but kv_cache.page_size={self.kv_cache.page_size}"
            )

    def replace(self, **changes: Any) -> "BuildContext":
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)
