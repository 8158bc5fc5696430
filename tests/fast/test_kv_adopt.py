"""A ``PagedKVCache`` adopts memory a host engine allocated (``buffers=``, ``KVLayout.wrap``): every
layout views the engine's buffer without a copy, reads and writes go through it, and a buffer it
cannot adopt is refused naming the layout, the field and the expected value."""

from __future__ import annotations

import pytest
import torch

from attnplug import PagedKVCache
from attnplug.kvlayout import HND, NHD, KVGeometry
from attnplug.registry import default_registry

GEOM = dict(num_layers=2, num_pages=6, num_kv_heads=2, head_dim=32, page_size=16)


def _layouts() -> list[object]:
    out: list[object] = [NHD, HND]
    try:
        out.append(default_registry().kv_layout("vllm_cpu"))
    except Exception as exc:
        print(f'vllm_cpu layout not tested: {exc}')
    return out


LAYOUTS = _layouts()
IDS = [getattr(x, "name", x) for x in LAYOUTS]


def _buffers(dtype: torch.dtype = torch.float32, n: int = 2) -> list[torch.Tensor]:
    g = KVGeometry(6, 16, 2, 32, 32)
    # vLLM's per-layer shape: [blocks, kv_heads, block_size, head_dim + v_head_dim]
    return [torch.zeros(g.num_pages, g.num_kv_heads, g.page_size, 64, dtype=dtype) for _ in range(n)]


def _rows(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, 2, 32, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("layout", LAYOUTS, ids=IDS)
def test_writes_land_in_the_engines_buffer_and_engine_writes_are_read(layout: object) -> None:
    bufs = _buffers()
    cache = PagedKVCache(**GEOM, layout=layout, buffers=bufs)  # type: ignore[arg-type]
    slots = torch.tensor([37, 2, 90, 16, 5])  # scattered, out of order, across pages
    k, v = _rows(5, 0), _rows(5, 1)
    cache.set_kv(1, slots, k, v)
    got_k, got_v = cache.read_kv(1, slots)
    assert torch.equal(got_k, k) and torch.equal(got_v, v)
    # the values are in the engine's memory (no copy was made) and nowhere else
    assert int((bufs[1] != 0).sum()) == int((k != 0).sum() + (v != 0).sum())
    assert int((bufs[0] != 0).sum()) == 0
    # every storage tensor of the layer lies inside the engine's buffer
    lo, hi = bufs[1].data_ptr(), bufs[1].data_ptr() + bufs[1].numel() * bufs[1].element_size()
    kv_views = [t for t in cache.layer_storage(1) if t.dtype == bufs[1].dtype]
    assert kv_views and all(lo <= t.data_ptr() < hi for t in kv_views)
    # the engine zeroing its memory is seen by the cache
    bufs[1].zero_()
    assert int((cache.read_kv(1, slots)[0] != 0).sum()) == 0


@pytest.mark.parametrize("layout", LAYOUTS, ids=IDS)
def test_two_caches_sharing_one_buffer_on_disjoint_pages_never_collide(layout: object) -> None:
    """vLLM lets layers of different KV-cache groups share one tensor, each on its own blocks."""
    shared = _buffers(n=1)[0]
    a = PagedKVCache(**{**GEOM, "num_layers": 1}, layout=layout, buffers=[shared])  # type: ignore[arg-type]
    b = PagedKVCache(**{**GEOM, "num_layers": 1}, layout=layout, buffers=[shared])  # type: ignore[arg-type]
    sa, sb = torch.arange(0, 32), torch.arange(48, 96)  # pages 0-1 for a, pages 3-5 for b
    ka, va, kb, vb = _rows(32, 2), _rows(32, 3), _rows(48, 4), _rows(48, 5)
    a.set_kv(0, sa, ka, va)
    b.set_kv(0, sb, kb, vb)
    assert torch.equal(a.read_kv(0, sa)[0], ka) and torch.equal(a.read_kv(0, sa)[1], va)
    assert torch.equal(b.read_kv(0, sb)[0], kb) and torch.equal(b.read_kv(0, sb)[1], vb)


def test_the_vllm_cpu_layout_adopts_vllms_tensor_as_its_own_storage() -> None:
    layout = next((x for x in LAYOUTS if getattr(x, "name", None) == "vllm_cpu"), None)
    if layout is None:
        pytest.skip("the vllm_cpu plugin is not installed")
    bufs = _buffers()
    cache = PagedKVCache(**GEOM, layout=layout, buffers=bufs)  # type: ignore[arg-type]
    raw = cache.layer_storage(0)[0]
    assert raw.data_ptr() == bufs[0].data_ptr() and tuple(raw.shape) == tuple(bufs[0].shape)


@pytest.mark.parametrize("layout", LAYOUTS, ids=IDS)
@pytest.mark.parametrize("case,match", [
    ("numel", r"layout .*buffer has 6144 elements .*expected kv_numel=12288 = 6 pages"),
    ("strided", r"layout .*is not contiguous"),
    ("dtype", r"buffers\[0\] is torch.bfloat16 on cpu, expected torch.float32"),
    ("count", r"1 buffers given for num_layers=2"),
    ("type", r"buffers\[0\] is list"),
])
def test_a_buffer_it_cannot_adopt_is_refused_naming_what_is_wrong(layout: object, case: str, match: str) -> None:
    bufs: list[object] = list(_buffers())
    if case == "numel":
        bufs = [b[:3] for b in _buffers()]  # type: ignore[index]
    elif case == "strided":
        bufs = [torch.zeros(6, 2, 16, 128)[..., ::2] for _ in range(2)]
    elif case == "dtype":
        bufs = _buffers(torch.bfloat16)  # type: ignore[assignment]
    elif case == "count":
        bufs = bufs[:1]
    elif case == "type":
        bufs = [[0.0] * 10, bufs[1]]
    with pytest.raises((ValueError, TypeError), match=match):
        PagedKVCache(**GEOM, layout=layout, buffers=bufs)  # type: ignore[arg-type]
