"""The attention configuration and the pair accessor.

This is the only module that reads the base ``attention_backend`` field.
Every decision elsewhere reads the pair ``attention_backends()`` and picks the
half it needs (see ``docs/guard.md`` for why: the split-configuration bug).
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Literal, Mapping

from .dtypes import AUTO, dtype_name
from .errors import ConfigError

__all__ = [
    "BACKEND_FIELDS",
    "SPECULATIVE_ATTENTION_MODES",
    "AttentionConfig",
    "SpeculativeAttentionMode",
    "add_attention_args",
    "config_from_args",
]

SpeculativeAttentionMode = Literal["prefill", "decode"]
SPECULATIVE_ATTENTION_MODES: tuple[str, ...] = ("prefill", "decode")

#: The fields a user can set from the standard command-line flags.
BACKEND_FIELDS: tuple[str, ...] = (
    "attention_backend",
    "prefill_attention_backend",
    "decode_attention_backend",
    "speculative_draft_attention_backend",
)


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """What the operator asked for. Immutable: resolution returns a new one.

    ``None`` means "not set": the resolution chain may fill it; a field that is
    not ``None`` in the user's config is pinned and never overridden.
    """

    attention_backend: str | None = None
    prefill_attention_backend: str | None = None
    decode_attention_backend: str | None = None
    speculative_attention_mode: SpeculativeAttentionMode = "prefill"
    speculative_draft_attention_backend: str | None = None
    deterministic: bool = False
    dtype: str | None = None
    kv_cache_dtype: str | None = None
    page_size: int | None = None
    #: the KV-cache layout (``kvlayout.py``); ``None``: resolution picks one both halves read
    kv_layout: str | None = None
    cuda_graph: bool = False
    #: Free-form, host-specific switches (e.g. ``{"diffusion_lm": True}``) that
    #: registered rules may look at. Keys are strings; values are plain data.
    extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.speculative_attention_mode not in SPECULATIVE_ATTENTION_MODES:
            raise ConfigError(
                f"speculative_attention_mode={self.speculative_attention_mode!r} "
                f"(expected one of {SPECULATIVE_ATTENTION_MODES})"
            )
        for name in BACKEND_FIELDS:
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ConfigError(f"{name}={value!r} (expected a non-empty backend name or None)")
        if self.kv_layout is not None and (not isinstance(self.kv_layout, str) or not self.kv_layout.strip()):
            raise ConfigError(f"kv_layout={self.kv_layout!r} (expected a layout name such as 'nhd', or None)")
        if self.page_size is not None and (not isinstance(self.page_size, int) or isinstance(self.page_size, bool)
                                           or self.page_size < 1):
            raise ConfigError(f"page_size={self.page_size!r} (expected a positive integer)")
        for name in ("deterministic", "cuda_graph"):
            value = getattr(self, name)
            if not isinstance(value, bool):  # "yes", 1, "false": never truthy by accident
                raise ConfigError(f"{name}={value!r} ({type(value).__name__}; expected True or False)")
        for name in ("dtype", "kv_cache_dtype"):
            value = getattr(self, name)
            if value is None or (name == "kv_cache_dtype" and value == AUTO):
                continue
            if not isinstance(value, str):
                raise ConfigError(f"{name}={value!r} ({type(value).__name__}; expected a dtype name such as "
                                  f"'float16', or None)")
            try:
                dtype_name(value)
            except ValueError as exc:
                raise ConfigError(f"{name}={value!r}: {exc}") from None
        if not isinstance(self.extra, Mapping) or not all(isinstance(k, str) for k in self.extra):
            raise ConfigError(f"extra={self.extra!r} (expected a mapping with str keys)")

    def attention_backends(self) -> tuple[str | None, str | None]:
        """The ``(prefill, decode)`` pair; each half falls back to the base field."""
        base = self.attention_backend
        return (self.prefill_attention_backend or base, self.decode_attention_backend or base)

    def is_split(self) -> bool:
        """True when the two halves name different backends."""
        prefill, decode = self.attention_backends()
        return prefill != decode

    def replace(self, **changes: Any) -> "AttentionConfig":
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    def explicit_fields(self) -> dict[str, Any]:
        """Fields whose value differs from the default: what the user chose."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[operator]
            if value != default:
                out[f.name] = value
        return out

    def to_dict(self) -> dict[str, Any]:
        """The fields as JSON-ready data."""
        d = dataclasses.asdict(self)
        d["extra"] = dict(self.extra)
        return d


def add_attention_args(parser: argparse.ArgumentParser, title: str = "attention backends") -> argparse._ArgumentGroup:
    """Add the standard attention flags to a host engine's parser, in their own group.

    Backend names are not a closed list: any installed plugin's name or alias is
    accepted here and checked at resolution (``attnplug list`` shows them).
    """
    g = parser.add_argument_group(title)
    g.add_argument("--attention-backend", default=None, metavar="NAME",
                   help="backend for both prefill and decode unless a split flag overrides a half")
    g.add_argument("--prefill-attention-backend", default=None, metavar="NAME",
                   help="backend for extend/prefill forwards (falls back to --attention-backend)")
    g.add_argument("--decode-attention-backend", default=None, metavar="NAME",
                   help="backend for decode forwards (falls back to --attention-backend)")
    g.add_argument("--speculative-attention-mode", default="prefill", choices=SPECULATIVE_ATTENTION_MODES,
                   help="which half serves target-verify and draft-extend-v2 (default: prefill)")
    g.add_argument("--speculative-draft-attention-backend", default=None, metavar="NAME",
                   help="backend for the draft model's runner (default: the configured pair)")
    g.add_argument("--kv-cache-dtype", default=None, metavar="DTYPE",
                   help="KV-cache dtype: auto (= the model dtype; the default), fp8_e4m3, fp8_e5m2, or a dtype "
                        "name; both halves must support it (one cache serves both)")
    g.add_argument("--kv-layout", default=None, metavar="NAME",
                   help="KV-cache layout (default: the first one both halves read; attnplug list shows them)")
    g.add_argument("--deterministic-inference", dest="deterministic", action="store_true", default=False,
                   help="require a backend that declares deterministic, batch-invariant output")
    return g


def config_from_args(ns: argparse.Namespace, **extra_fields: Any) -> AttentionConfig:
    """Build an ``AttentionConfig`` from a namespace parsed with ``add_attention_args``."""
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(AttentionConfig):
        if hasattr(ns, f.name):
            kwargs[f.name] = getattr(ns, f.name)
    kwargs.update(extra_fields)
    return AttentionConfig(**kwargs)
