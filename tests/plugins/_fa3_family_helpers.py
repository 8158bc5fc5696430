"""Shared test helpers of the fa3, trtllm_mha and intel_amx plugin tests (private; not a conftest).

* ``make_problem``: one layer's problem asked of the conformance suite's
  harness (``harness.make_problem``: a paged KV cache full of noise with pages
  scattered at random, requests in scattered ``req_to_token`` rows, one
  ``ForwardBatch`` and the layer's q/k/v; fp8 queries exact in e4m3 and sinks
  exact in bfloat16 through ``Case.exact_in``); the expected output comes from
  ``attnplug.testing.reference.reference_attention`` only.
* ``_problems.attend64`` (shared with the flashinfer and aiter emulators): the float64 attention arithmetic the kernel emulators share
  (scores, bottom-right-aligned causal/window masks, soft-cap, sinks). Each
  emulator does its own reading of its library's layout and calls this for
  the arithmetic only.
* hand-built hosts and a registry holding one real plugin (through its entry
  point) plus ``attnplug-torch-native``.
"""

from __future__ import annotations

import math
import subprocess
import sys
import types
from typing import Any, Sequence

import torch

from attnplug import ForwardMode, LayerSpec, PagedKVCache
from attnplug.host import HostInfo
from attnplug.registry import Registry
from attnplug.testing.reference import reference_attention

PY = sys.executable


# -- hosts -------------------------------------------------------------------
def cuda_host(sm: int, **libs: str) -> HostInfo:
    name = {80: "A100", 86: "A10", 89: "L40S", 90: "H100", 100: "B200", 103: "B300", 120: "RTX 5090"}.get(sm, "GPU")
    return HostInfo(platform="cuda", device_name=name, compute_capability=(sm // 10, sm % 10), device_count=1,
                    libraries={"torch": "2.13.0", **{k.replace("_", "-"): v for k, v in libs.items()}})


def cpu_host(amx: bool, **libs: str) -> HostInfo:
    flags = {"avx512f", "avx512_bf16"} | ({"amx_bf16", "amx_tile", "amx_int8"} if amx else set())
    return HostInfo(platform="cpu", cpu_flags=frozenset(flags),
                    libraries={"torch": "2.13.0", **{k.replace("_", "-"): v for k, v in libs.items()}})


def rocm_host(**libs: str) -> HostInfo:
    return HostInfo(platform="rocm", gfx_arch="gfx942", device_count=1,
                    libraries={"torch": "2.13.0", **{k.replace("_", "-"): v for k, v in libs.items()}})


def registry(dist: str, host: HostInfo | None = None) -> Registry:
    """A fresh registry with ``dist`` and attnplug-torch-native, found through their real entry points."""
    return Registry.discover(env={"ATTNPLUG_PLUGINS": f"{dist},attnplug-torch-native"}, host=host)


def imports_after(module: str) -> set[str]:
    """Top-level modules present in ``sys.modules`` after importing ``module`` in a fresh interpreter."""
    code = f"import sys, {module}; print(' '.join(sorted({{m.split('.')[0] for m in sys.modules}})))"
    out = subprocess.run([PY, "-c", code], capture_output=True, text=True, check=True).stdout
    return set(out.split())


# -- problems ----------------------------------------------------------------
def make_problem(
    *,
    mode: ForwardMode = ForwardMode.EXTEND,
    prefix: Sequence[int] = (0, 5, 17),
    ext: Sequence[int] = (7, 3, 1),
    page_size: int = 16,
    dtype: torch.dtype = torch.float16,  # the three plugins claim float16/bfloat16 only
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    v_head_dim: int | None = None,
    window: int | None = None,
    cap: float | None = None,
    sinks: bool = False,
    custom_mask: bool = False,
    seed: int = 0,
    kv_dtype: torch.dtype | None = None,
    kv_scales: tuple[float, float] = (1.0, 1.0),
) -> types.SimpleNamespace:
    """One layer's problem, asked of the conformance suite's harness (``harness.make_problem``): noise in
    every slot, requests in random ``req_to_token`` rows on shuffled pages (positions no request holds
    stay unassigned, -1). Decode: ``ext`` must be all ones; target-verify: all equal (the draft count),
    ``custom_mask`` a random tree mask (each draft sees itself and a random subset of earlier drafts).

    Sinks are drawn exactly representable in bfloat16 (fa3 hands sinks to the kernel in bfloat16,
    sgl-kernel's check; intel_amx in the query's dtype), so the float64 reference and the emulated
    kernel see the same numbers. ``kv_dtype`` fp8: the cache stores fp8 with the layer's ``kv_scales``
    (prefix values ~ N(0, 1) after dequantization), and q holds values e4m3 represents exactly, so a
    kernel path that quantizes q with scale 1 computes what the reference computes from the unquantized
    q. ``seed`` picks the case (and so its data). The expected output comes from
    ``attnplug.testing.reference.reference_attention`` only."""
    from attnplug.dtypes import FP8_E4M3, dtype_name
    from attnplug.testing.suite import harness
    from attnplug.testing.suite.cases import Case, Features, Scenario, Shape

    prefix, ext = list(prefix), list(ext)
    seq = [p + e for p, e in zip(prefix, ext)]
    if mode is ForwardMode.DECODE:
        assert all(e == 1 for e in ext)
    verify = mode is ForwardMode.TARGET_VERIFY
    sc = Scenario("plugin", mode.value, tuple(prefix), tuple(ext), draft=ext[0] if verify else None,
                  custom_mask=custom_mask and verify)
    quantized = kv_dtype is not None and kv_dtype.itemsize == 1
    case = Case("fa3_family", f"seed{seed}", sc, dtype=dtype_name(dtype), page_size=page_size,
                shape=Shape("plugin", num_heads, num_kv_heads, head_dim, v_head_dim),
                features=Features(sliding_window=window, logit_cap=cap, sinks=sinks),
                kv_cache_dtype=None if kv_dtype is None else dtype_name(kv_dtype),
                kv_scales=kv_scales if quantized else None,
                exact_in=(("sinks", "bfloat16"),) + ((("q", FP8_E4M3),) if quantized else ()))
    hp = harness.make_problem(case, "cpu")
    cache, batch, layer = hp.cache, hp.batch, hp.layers[0]
    q, k, v = hp.qkv[0]
    assert k is not None and v is not None
    kb, vb = cache.get_kv(0)
    before = (kb.clone(), vb.clone())
    expected = reference_attention(q, k, v, layer, batch, before[0], before[1], cache.req_to_token,
                                   *cache.kv_scales(0))
    return types.SimpleNamespace(cache=cache, batch=batch, layer=layer, q=q, k=k, v=v, before=before,
                                 expected=expected, rows=hp.req_rows, prefix=prefix, ext=ext, seq=seq,
                                 page_size=page_size)


def pages_of(cache: PagedKVCache, row: int, length: int) -> list[int]:
    """Independent expectation: the page of positions ``j*page_size …`` of a request, from its first slot."""
    ps = cache.page_size
    return [int(cache.req_to_token[row, j * ps]) // ps for j in range(math.ceil(length / ps))]


def context(p: types.SimpleNamespace, host: HostInfo, *, config: Any = None, dtype: Any = None,
            **kw: Any) -> Any:
    """The build context of problem ``p`` on ``host``: its layer's heads and head dim, its page size and
    cache (``dtype``: default q's dtype; ``kw``: more ``BuildContext`` fields)."""
    from attnplug import AttentionConfig, BuildContext

    return BuildContext(config=config or AttentionConfig(), host=host, dtype=p.q.dtype if dtype is None else dtype,
                        num_heads=p.layer.num_heads, num_kv_heads=p.layer.num_kv_heads, head_dim=p.layer.head_dim,
                        page_size=p.page_size, kv_cache=p.cache, max_context_len=p.cache.max_context_len, **kw)


def forward(backend: Any, p: types.SimpleNamespace, save: bool = True) -> torch.Tensor:
    """``init_forward_metadata`` of ``p``'s batch, then its mode's forward (``forward_decode`` for DECODE,
    ``forward_extend`` otherwise) on ``p``'s q/k/v."""
    backend.init_forward_metadata(p.batch)
    fwd = backend.forward_decode if p.batch.forward_mode is ForwardMode.DECODE else backend.forward_extend
    return fwd(p.q, p.k, p.v, p.layer, p.batch, save_kv_cache=save)


def assert_written_at_loc_only(p: types.SimpleNamespace, save: bool) -> None:
    """After a forward of ``p``: its new K/V at ``out_cache_loc`` when ``save`` (nothing written otherwise),
    every other slot as it was before."""
    kb, vb = p.cache.get_kv(0)
    loc = p.batch.out_cache_loc
    if save:
        assert torch.equal(kb[loc], p.k) and torch.equal(vb[loc], p.v)
        kb[loc], vb[loc] = p.before[0][loc], p.before[1][loc]
    assert torch.equal(kb, p.before[0]) and torch.equal(vb, p.before[1])


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype | None = None) -> None:
    """``got`` within the suite's tolerance for ``dtype`` (default: ``got``'s dtype) of the float64 ``want``."""
    from attnplug.dtypes import dtype_name
    from attnplug.testing.tolerances import tolerance_for

    tol = tolerance_for(dtype_name(dtype or got.dtype))
    g, w = got.double(), want.double()
    assert g.shape == w.shape, f"shape {tuple(g.shape)} != {tuple(w.shape)}"
    err = (g - w).abs() - tol.rtol * w.abs()
    assert float(err.max()) <= tol.atol if err.numel() else True, f"max excess error {float(err.max())}"


# -- the declared KV-dtype rule ------------------------------------------------------------
#: The core's reason for a bfloat16 model over a float16 cache on a backend declaring
#: ``kv_cache_dtype_follows_model`` (fa3, trtllm_mha and intel_amx all do).
KV_FOLLOWS_MODEL = ("kv_cache_dtype=float16 with dtype=bfloat16: a non-fp8 KV cache must be in the model dtype "
                    "(kv_cache_dtype_follows_model)")


def check_kv_follows_model(dist: str, name: str, host: HostInfo, backend: Any, *, page_size: int = 16) -> None:
    """A bfloat16 model with a float16 cache is refused by ``name``'s declared capability everywhere it is
    asked: resolution moves away (and a pinned half is a ``ConfigError``), ``Registry.build`` refuses before
    the factory runs, and the built ``backend`` answers it in ``not_supported_reasons``. The same model
    with a cache in its own dtype resolves to ``name``."""
    import pytest

    from attnplug import AttentionConfig, BuildContext
    from attnplug.errors import ConfigError, NotSupportedError
    from attnplug.resolution import resolve, trace

    reg = registry(dist, host)
    assert reg.get(name).capabilities.kv_cache_dtype_follows_model is True
    assert resolve(AttentionConfig(dtype="bfloat16", kv_cache_dtype="bfloat16"), host=host,
                   registry=reg).pair == (name, name)
    moved = resolve(AttentionConfig(dtype="bfloat16", kv_cache_dtype="float16"), host=host, registry=reg)
    assert name not in moved.pair and KV_FOLLOWS_MODEL in moved.rejected()[name]
    pinned = trace(AttentionConfig(attention_backend=name, dtype="bfloat16", kv_cache_dtype="float16"),
                   host=host, registry=reg)
    assert isinstance(pinned.error, ConfigError) and KV_FOLLOWS_MODEL in str(pinned.error)
    ctx = BuildContext(config=AttentionConfig(), host=host, dtype="bfloat16", kv_cache_dtype="float16",
                       num_heads=4, num_kv_heads=2, head_dim=64, page_size=page_size)
    with pytest.raises(NotSupportedError) as exc:
        reg.build(name, ctx)
    assert KV_FOLLOWS_MODEL in str(exc.value)
    layer = LayerSpec(0, 4, 2, 64)
    assert KV_FOLLOWS_MODEL in backend.not_supported_reasons(layer, backend.ctx.replace(
        dtype="bfloat16", kv_cache_dtype="float16", kv_cache=None))
    assert not any("kv_cache_dtype" in r for r in backend.not_supported_reasons(layer, backend.ctx.replace(
        dtype="bfloat16", kv_cache_dtype="bfloat16", kv_cache=None)))
