"""What one ``attnplug bench`` run measures: the sweep, parsed and checked (no torch).

Every shape flag takes a comma-separated list; the sweep is their product.
A bad value raises ``BenchUsageError`` with one line naming the flag, the
value and what was expected; the command prints it and exits 2.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Callable, Iterator, TypeVar

T = TypeVar("T")

MODES: tuple[str, ...] = ("decode", "extend", "verify", "mixed")

#: goal per mode: (at most this many times the contiguous floor, must also beat the per-request loop)
GOALS: dict[str, tuple[float, bool]] = {
    "decode": (1.3, False),
    "extend": (1.15, True),
    "verify": (1.15, True),
    "mixed": (1.15, True),
}

#: batch size used when ``--batch`` is not given, per mode
DEFAULT_BATCH: dict[str, int] = {"decode": 32, "extend": 4, "verify": 32, "mixed": 4}

DEFAULT_MAX_KV_GIB = 8.0

#: ``--overhead`` without ``--batch``/``--context``: these (batch, context) pairs (the rows of
#: docs/performance.md's per-layer cost table)
OVERHEAD_PAIRS: tuple[tuple[int, int], ...] = ((1, 128), (4, 256), (32, 1024))


def goal_met(mode: str, ms: float, floor_ms: float, loop_ms: float) -> bool:
    """Whether a backend row meets its mode's goal (``GOALS``): at most the ratio to the floor,
    and for extend-shaped modes strictly faster than the per-request loop."""
    ratio, need_loop = GOALS[mode]
    return ms <= ratio * floor_ms and (not need_loop or ms < loop_ms)


class BenchUsageError(ValueError):
    """A bad ``attnplug bench`` argument (the message is the one line the user sees)."""


@dataclasses.dataclass(frozen=True)
class Problem:
    """One point of the sweep (one paged batch, measured against every backend side by side).

    ``context`` is the number of tokens each request already has in the paged
    cache before this forward: decode and mixed's decode requests read
    ``context`` cached tokens plus the new one; extend reads ``context`` plus
    ``new_tokens``; verify reads ``context`` plus ``draft``.
    """

    mode: str
    dtype: str
    batch: int
    context: int
    heads: int
    kv_heads: int
    head_dim: int
    page_size: int
    new_tokens: int = 512
    draft: int = 4
    #: the KV-cache dtype (``None``: the model dtype); an fp8 cache stores 1 byte per value
    kv_dtype: str | None = None

    @property
    def cache_dtype(self) -> str:
        return self.kv_dtype or self.dtype

    def requests(self) -> list[tuple[int, int]]:
        """``(cached prefix, new tokens)`` per request."""
        if self.mode == "decode":
            return [(self.context, 1)] * self.batch
        if self.mode == "extend":
            return [(self.context, self.new_tokens)] * self.batch
        if self.mode == "verify":
            return [(self.context, self.draft)] * self.batch
        # mixed: decode requests and prefill chunks alternate (request 0 decodes)
        return [(self.context, 1 if i % 2 == 0 else self.new_tokens) for i in range(self.batch)]

    def kv_bytes(self) -> int:
        """Bytes of K and V every request reads (its whole sequence), summed over the batch."""
        size = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}.get(
            self.cache_dtype, 4)
        tokens = sum(p + e for p, e in self.requests())
        return tokens * self.kv_heads * 2 * self.head_dim * size

    def label(self) -> str:
        extra = {"extend": f" +{self.new_tokens} new", "verify": f" +{self.draft} draft",
                 "mixed": f" (decode + {self.new_tokens}-token chunks)"}.get(self.mode, "")
        kv = f" kv {self.kv_dtype}" if self.kv_dtype else ""
        return (f"{self.mode} {self.dtype}{kv} batch {self.batch} context {self.context}{extra} "
                f"heads {self.heads}/{self.kv_heads} kv head_dim {self.head_dim} page {self.page_size}")

    def to_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Spec:
    backends: tuple[str, ...]  # names as given, or ("all",)
    modes: tuple[str, ...]
    dtypes: tuple[str, ...]
    batches: tuple[int, ...] | None  # None: the per-mode default
    contexts: tuple[int, ...]
    heads: int
    kv_heads: tuple[int, ...]
    head_dims: tuple[int, ...]
    page_sizes: tuple[int, ...]
    new_tokens: int
    draft: int
    device: str
    repeats: int
    warmup: int
    seed: int
    warm: bool
    max_kv_gib: float
    bandwidth_mib: int
    threads: int | None = None
    #: "wall" (time.perf_counter) or "cpu" (the calling thread's CPU time: one-thread runs on a
    #: shared machine, where a call that loses its core to another job would count the wait)
    clock: str = "wall"
    #: KV-cache dtypes to sweep (``None``: the model dtype, what ``--kv-cache-dtype auto`` means)
    kv_dtypes: tuple[str | None, ...] = (None,)
    #: ``--overhead``: measure the per-layer overhead above each backend's kernel instead of the usual rows
    overhead: bool = False
    #: ``(batch, context)`` pairs measured instead of the product of ``batches`` and ``contexts``
    pairs: tuple[tuple[int, int], ...] | None = None
    #: ``--mla``: MLA absorbed decode rows (``bench/mla.py``) instead of the usual rows
    mla: bool = False

    def problems(self) -> Iterator[Problem]:
        for mode, dtype, kvd in itertools.product(self.modes, self.dtypes, self.kv_dtypes):
            batches = self.batches or (DEFAULT_BATCH[mode],)
            shapes = self.pairs or tuple(itertools.product(batches, self.contexts))
            for (b, ctx), d, kv, ps in itertools.product(shapes, self.head_dims, self.kv_heads, self.page_sizes):
                yield Problem(mode, dtype, b, ctx, self.heads, kv, d, ps, self.new_tokens, self.draft,
                              None if kvd == dtype else kvd)


def kv_dtype_list(text: str) -> tuple[str | None, ...]:
    """``"auto,fp8_e4m3"`` -> ``(None, "float8_e4m3fn")``: KV-cache dtypes, ``auto`` = the model dtype."""
    from ..dtypes import kv_dtype_name

    out: list[str | None] = []
    for item in name_list("--kv-cache-dtype", text):
        try:
            name = kv_dtype_name(item)
        except ValueError:
            name = "?"
        if name not in (None, "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"):
            raise BenchUsageError(f"--kv-cache-dtype {item!r} is not a KV-cache dtype bench runs (auto, fp8_e4m3, "
                                  f"fp8_e5m2, float32, float16, bfloat16)")
        if name not in out:
            out.append(name)
    return tuple(out)


def int_list(flag: str, text: str, *, minimum: int = 1) -> tuple[int, ...]:
    """``"1,8,32"`` -> ``(1, 8, 32)``; every item an integer >= ``minimum``."""
    items = [t.strip() for t in str(text).split(",")]
    out = []
    for item in items:
        try:
            value = int(item)
        except ValueError:
            raise BenchUsageError(f"{flag} {text!r}: {item!r} is not an integer "
                                  f"(expected a comma-separated list of integers >= {minimum})") from None
        if value < minimum:
            raise BenchUsageError(f"{flag} {text!r}: {value} is below {minimum}")
        out.append(value)
    return tuple(dict.fromkeys(out))


def name_list(flag: str, text: str, allowed: tuple[str, ...] | None = None) -> tuple[str, ...]:
    items = [t.strip() for t in str(text).split(",")]
    if not all(items):
        raise BenchUsageError(f"{flag} {text!r}: empty item (expected a comma-separated list of names)")
    if allowed is not None:
        if items == ["all"]:
            return allowed
        bad = [i for i in items if i not in allowed]
        if bad:
            raise BenchUsageError(f"{flag} {bad[0]!r} is not one of {', '.join(allowed)} (or all)")
    return tuple(dict.fromkeys(items))


def dtype_list(text: str) -> tuple[str, ...]:
    from ..dtypes import dtype_name

    out = []
    for item in name_list("--dtype", text):
        try:
            name = dtype_name(item)
        except ValueError:
            name = ""
        if name not in ("float32", "float16", "bfloat16"):
            raise BenchUsageError(f"--dtype {item!r} is not a benchmarkable dtype "
                                  f"(expected float32, float16 or bfloat16)")
        out.append(name)
    return tuple(dict.fromkeys(out))


def prepared_or_noted(notes: list[str], name: str, prepare: Callable[[], T]) -> T | None:
    """``prepare()`` for one backend's rows; a refusal (any ``AttnplugError``) becomes the note ``"<name>:
    skipped (why)"`` and anything else it raises ``"<name>: failed (Type: message)"``, so one backend that
    cannot run, or breaks, leaves the other rows running. ``None`` when a note was written."""
    from ..errors import AttnplugError

    try:
        return prepare()
    except AttnplugError as exc:
        notes.append(f"{name}: skipped ({exc})")
    except Exception as exc:  # a backend that breaks is reported; the other rows still run
        notes.append(f"{name}: failed ({type(exc).__name__}: {exc})")
    return None
