"""Writing the prefill/decode name stamps.

Only the registry (after a factory returns) and wrappers call these; nothing
ever writes a backend choice anywhere else.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .backend import AttentionBackend

__all__ = ["copy_stamps", "stamp", "stamps_of"]


def stamp(backend: AttentionBackend, prefill: str, decode: str | None = None) -> None:
    """Write the effective name(s) into ``backend`` and, if it declares
    ``stamps_children``, into every child (recursively)."""
    decode = prefill if decode is None else decode
    backend.prefill_attention_backend_str = prefill
    backend.decode_attention_backend_str = decode
    if getattr(type(backend), "stamps_children", False):
        for child in backend.children():
            stamp(child, prefill, decode)


def copy_stamps(src: AttentionBackend, dst: AttentionBackend) -> None:
    """A wrapper that replaces ``src`` carries ``src``'s stamps."""
    dst.prefill_attention_backend_str = src.prefill_attention_backend_str
    dst.decode_attention_backend_str = src.decode_attention_backend_str


def stamps_of(backend: AttentionBackend) -> tuple[str | None, str | None]:
    return (backend.prefill_attention_backend_str, backend.decode_attention_backend_str)
