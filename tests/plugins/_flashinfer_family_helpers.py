"""Shared fixtures for the flashinfer and aiter plugin tests (private: not a conftest).

Builds paged problems with scattered pages, prefixes that end mid-page, ragged
lengths (``MODE_CASES`` and ``VARIANTS``: the batches and layers both emulated backends run, ``case_problem``
one of them; ``context``: a problem's build context; ``check_output``: a forward's output against the float64
reference); hand-built hosts; a subprocess check that a descriptor import stays light.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import types
from typing import Any, Sequence

import torch

from attnplug import ForwardBatch, ForwardMode, HostInfo, LayerSpec, PagedKVCache


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
    """One layer's problem, asked of the conformance suite's harness (``harness.make_problem``): requests
    in random pool rows on shuffled pages, noise in every slot, the new tokens' slots following each
    prefix in the same page table (a prefix ending mid-page shares its last page).

    ``tree_mask``: a target-verify batch gets a random tree mask (every draft sees itself and a random
    subset of earlier drafts); other modes get none. ``kv_dtype`` fp8: the cache stores fp8 with the
    layer's ``kv_scales``. ``seed`` picks the case (and so its data)."""
    from attnplug.dtypes import dtype_name
    from attnplug.testing.suite import harness
    from attnplug.testing.suite.cases import Case, Features, Scenario, Shape

    verify = mode is ForwardMode.TARGET_VERIFY
    sc = Scenario("plugin", mode.value, tuple(prefix_lens), tuple(extend_lens),
                  draft=extend_lens[0] if verify else None, custom_mask=tree_mask and verify)
    quantized = kv_dtype is not None and kv_dtype.itemsize == 1
    case = Case("plugin_test", f"seed{seed}", sc, dtype=dtype_name(dtype), page_size=page_size,
                shape=Shape("plugin", num_heads, num_kv_heads, head_dim),
                features=Features(sliding_window=sliding_window, logit_cap=logit_cap, sinks=sinks),
                kv_cache_dtype=None if kv_dtype is None else dtype_name(kv_dtype),
                kv_scales=kv_scales if quantized else None)
    p = harness.make_problem(case, "cpu")
    q, k, v = p.qkv[0]
    assert k is not None and v is not None
    k_before, v_before = p.before[0]
    return Problem(p.cache, p.batch, q, k, v, p.layers[0], k_before, v_before)


#: the batches both emulated backends run: case -> (mode, cached prefix per request, new tokens per request)
MODE_CASES = {
    "extend_prefix": (ForwardMode.EXTEND, [0, 5, 17, 3], [4, 1, 6, 9]),
    "decode": (ForwardMode.DECODE, [0, 16, 32, 15], [1, 1, 1, 1]),
    "verify": (ForwardMode.TARGET_VERIFY, [5, 17, 3], [4, 4, 4]),
    "draft_extend": (ForwardMode.DRAFT_EXTEND, [7, 2], [3, 3]),
}


def check_output(pb: Problem, out: torch.Tensor, tol: Any) -> None:
    """``out``, a forward of ``pb``, against the float64 reference over the cache as it was before (with the
    layer's KV scales), within ``tol`` (``atol``/``rtol``)."""
    from attnplug.testing.reference import reference_attention

    ref = reference_attention(pb.q, pb.k, pb.v, pb.layer, pb.batch, pb.k_before, pb.v_before, pb.cache.req_to_token,
                              *pb.cache.kv_scales(0))
    torch.testing.assert_close(out.double(), ref, atol=tol.atol, rtol=tol.rtol)


#: layer variants both emulated backends run: name -> ``make_problem`` keywords
VARIANTS: dict[str, dict[str, Any]] = {
    "plain": {},
    "window": dict(sliding_window=5),
    "softcap_mqa": dict(logit_cap=2.0, num_kv_heads=1),
}


def case_problem(case: str, page_size: int, **kw: Any) -> Problem:
    """The ``MODE_CASES`` batch ``case`` as a ``make_problem`` (verify with a random tree mask; the seed from
    the case and page size), with more ``make_problem`` keywords ``kw`` (a ``VARIANTS`` entry, a dtype)."""
    mode, prefix, ext = MODE_CASES[case]
    return make_problem(mode, prefix, ext, page_size=page_size, tree_mask=True, seed=len(case) + page_size, **kw)


def context(pb: Problem, host: HostInfo, dtype: str, config: Any = None, **kw: Any) -> Any:
    """The build context of problem ``pb`` on ``host``: its layer's heads and head dim, its cache and page size,
    the layer itself (``config``: default ``AttentionConfig()``; ``kw``: more ``BuildContext`` fields)."""
    from attnplug import AttentionConfig, BuildContext

    c = pb.cache
    return BuildContext(config or AttentionConfig(), host, dtype=dtype, num_heads=pb.layer.num_heads,
                        num_kv_heads=pb.layer.num_kv_heads, head_dim=pb.layer.head_dim, page_size=c.page_size,
                        kv_cache=c, max_context_len=c.max_context_len, layers=(pb.layer,), **kw)


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


def assert_descriptor_light(dist: str, descriptor: str, library: str) -> None:
    """Discovering ``dist`` (and probing it) loads its ``descriptor`` module, neither torch nor the kernel
    library's module ``library`` (``modules_after_discovery``)."""
    mods = modules_after_discovery(dist, descriptor)
    assert descriptor in mods
    assert not {"torch", library} & mods, sorted({"torch", library} & mods)


def fake_module(name: str, version: str, **attrs: Any) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__version__ = version
    for k, v in attrs.items():
        setattr(mod, k, v)
    return mod
