"""Shared fixtures for the flashinfer and aiter plugin tests (private: not a conftest).

Builds paged problems with scattered pages, prefixes that end mid-page, ragged
lengths; hand-built hosts; a subprocess check that a descriptor import stays light.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import types
from typing import Any, Sequence

import torch

from attnplug import ForwardBatch, ForwardMode, HostInfo, LayerSpec, PageAllocator, PagedKVCache
from _problems import fill_kv_noise


@dataclasses.dataclass
class Problem:
    cache: PagedKVCache
    batch: ForwardBatch
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    layer: LayerSpec
    k_before: torch.Tensor
    v_before: torch.Tensor


def make_problem(
    mode: ForwardMode,
    prefix_lens: Sequence[int],
    extend_lens: Sequence[int],
    *,
    page_size: int,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    dtype: torch.dtype = torch.float16,
    sliding_window: int | None = None,
    logit_cap: float | None = None,
    sinks: bool = False,
    tree_mask: bool = False,
    seed: int = 0,
    kv_dtype: torch.dtype | None = None,
    kv_scales: tuple[float, float] = (1.0, 1.0),
) -> Problem:
    """A batch whose requests sit in pool rows 3, 0, 5, … (not batch order) on shuffled pages.

    Prefix K/V are random in the cache; the new tokens' slots follow the prefix
    in the same page table (so a prefix ending mid-page shares its last page).
    ``kv_dtype`` fp8: the cache stores fp8 with the layer's ``kv_scales`` (dequantized values ~ N(0, 1)).
    """
    g = torch.Generator().manual_seed(seed)
    b = len(prefix_lens)
    seq = [p + e for p, e in zip(prefix_lens, extend_lens)]
    pages_per = [(s + page_size - 1) // page_size for s in seq]
    cache = PagedKVCache(1, sum(pages_per) + 5, num_kv_heads, head_dim, page_size=page_size, dtype=kv_dtype or dtype,
                         max_requests=2 * b + 6, max_context_len=max(seq) + page_size)
    alloc = PageAllocator(cache.num_pages, shuffle=True, seed=seed)
    rows = [(3 + 5 * i) % (2 * b + 6) for i in range(b)]
    for r, s, n in zip(rows, seq, pages_per):
        cache.assign_pages(r, s, alloc.alloc(n))
    kb, vb = fill_kv_noise(cache, g, dtype, kv_scales)
    out_loc = torch.cat([cache.req_to_token[r, p:p + e] for r, p, e in zip(rows, prefix_lens, extend_lens)])
    n_tok = sum(extend_lens)
    kw: dict[str, Any] = {}
    if mode is ForwardMode.TARGET_VERIFY:
        d = extend_lens[0]
        kw["spec_num_draft_tokens"] = d
        if tree_mask:  # a random tree: every draft sees itself and a random subset of earlier drafts
            m = torch.rand(b, d, d, generator=g) < 0.5
            m = (m & torch.ones(d, d, dtype=torch.bool).tril()) | torch.eye(d, dtype=torch.bool)
            kw["spec_custom_mask"] = m
    if mode is ForwardMode.DECODE:
        batch = ForwardBatch.decode(rows, seq, out_loc)
    else:
        batch = ForwardBatch.extend(rows, list(prefix_lens), list(extend_lens), out_loc, mode=mode, **kw)
    layer = LayerSpec(0, num_heads, num_kv_heads, head_dim, sliding_window=sliding_window, logit_cap=logit_cap,
                      sinks=(torch.randn(num_heads, generator=g) if sinks else None))
    q = torch.randn(n_tok, num_heads, head_dim, generator=g).to(dtype)
    k = torch.randn(n_tok, num_kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(n_tok, num_kv_heads, head_dim, generator=g).to(dtype)
    return Problem(cache, batch, q, k, v, layer, kb.clone(), vb.clone())


def registry(*dists: str) -> Any:
    """A registry that discovered only ``dists`` (through their entry points)."""
    from attnplug.registry import Registry

    return Registry.discover(env={"ATTNPLUG_PLUGINS": ",".join(dists)})


def check_registered_and_unavailable(dist: str, name: str, *, library: str, floor: str, capabilities: Any,
                                     reasons: Sequence[str], build_match: str) -> None:
    """``dist``, loaded alone through its entry point, registers ``name`` as declared (library, floor,
    capabilities); on a CPU host with torch only ``name`` is unavailable with each of ``reasons`` (a
    fragment of some reason) and building it raises ``BackendUnavailableError`` matching ``build_match``."""
    import pytest

    from attnplug import AttentionConfig, BuildContext
    from attnplug.errors import BackendUnavailableError
    reg = registry(dist)
    (rec,) = [p for p in reg.plugins if p.distribution == dist]
    assert rec.status == "loaded", rec.error
    d = reg.get(name)
    assert d.distribution == dist and d.library == library and d.min_library_version == floor
    assert d.capabilities is capabilities
    cpu = host("cpu", {"torch": "2.13.0"})
    avail = reg.availability(name, cpu)
    assert not avail
    for fragment in reasons:
        assert any(fragment in r for r in avail.reasons), (fragment, avail.reasons)
    with pytest.raises(BackendUnavailableError, match=build_match):
        reg.build(name, BuildContext(AttentionConfig(), cpu))


def host(platform: str, libraries: dict[str, str], **kw: Any) -> HostInfo:
    return HostInfo(platform=platform, libraries=libraries, **kw)


def modules_after_discovery(dist: str, descriptor: str) -> set[str]:
    """Top-level modules loaded after discovering ``dist`` through its entry point and probing it
    (fresh interpreter): the descriptor must load neither torch nor its kernel library."""
    code = (
        "import sys, json\n"
        "from attnplug.registry import Registry\n"
        f"reg = Registry.discover(env={{'ATTNPLUG_PLUGINS': {dist!r}}})\n"
        f"import {descriptor}\n"
        "for n in reg.names(): reg.availability(n)\n"
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return set(json.loads(out))


def fake_module(name: str, version: str, **attrs: Any) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__version__ = version
    for k, v in attrs.items():
        setattr(mod, k, v)
    return mod
