"""attnplug-triton's MLA path (both forms, every mode), run in Triton's interpreter on CPU.

The conformance suite's MLA families check the claims case by case; these tests cover the kernel
module's own pieces: the decompression kernel against the reference's ``mla_decompress``, both forms over
scattered pages with fp8 latents, garbage in slots no request owns (never decompressed, never read), the
weights converted once, and batch invariance (the backend claims ``deterministic``).
``TRITON_INTERPRET=1`` is set before anything imports triton (as in ``test_triton.py``).
"""

from __future__ import annotations

import os

_SET_INTERPRET = "TRITON_INTERPRET" not in os.environ
os.environ.setdefault("TRITON_INTERPRET", "1")  # before any import of triton

import importlib.util  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from attnplug import ForwardBatch  # noqa: E402
from attnplug.dtypes import dtype_name  # noqa: E402
from attnplug.registry import default_registry  # noqa: E402
from attnplug.testing.reference import mla_decompress, reference_mla  # noqa: E402
from attnplug.testing.suite.cases import Case, Scenario, Shape  # noqa: E402
from attnplug.testing.suite.mla_problem import make_mla_problem  # noqa: E402
from attnplug.testing.tolerances import tolerance_for  # noqa: E402

HAVE_TRITON = importlib.util.find_spec("triton") is not None
if HAVE_TRITON:
    from attnplug_triton import kernels as K
if _SET_INTERPRET:
    del os.environ["TRITON_INTERPRET"]

pytestmark = pytest.mark.skipif(
    not HAVE_TRITON or not K.INTERPRETED,
    reason="triton is not installed" if not HAVE_TRITON else
    "attnplug_triton.kernels was imported before TRITON_INTERPRET=1 was set in this process; run this file on its own")

REG = default_registry()


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    """Triton reads ``TRITON_INTERPRET`` again when it imports parts lazily (and the probe reads it): set
    for each test, as the process had it when the kernels were imported, and restored after."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
R, ROPE, NOPE, V, H = 64, 16, 32, 24, 4  # a DeepSeek-shaped MLA layer, scaled down for the interpreter


def _problem(form, mode, *, dtype=torch.float32, kv_dtype=None, page_size=4, seq=(1, 17, 45), new=None,
             garbage=False, heads=H, dims=(R, NOPE, ROPE, V), rows=None, seed=0):
    """One batch of requests ``seq`` long (``new`` of them this forward's: decode 1, extend up to 5) in
    ``form``, asked of the conformance suite's MLA builder (``make_mla_problem``): noise in every latent slot
    (NaN in every slot no request reads with ``garbage``; an fp8 latent has scale 0.5), pages scattered,
    requests in ``rows`` (default random ``req_to_token`` rows), a layer of ``heads`` with ``dims``
    ``(kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim)`` and its decompression weights.
    Returns the cache, batch, the triton backend built over them, layer, q and new latent rows."""
    new = tuple(new or ([1] * len(seq) if mode == "decode" else [min(s, 5) for s in seq]))
    sc = Scenario("triton_mla", mode, tuple(s - n for s, n in zip(seq, new)), new)
    quantized = kv_dtype is not None and kv_dtype.itemsize == 1
    case = Case("triton_mla", f"seed{seed}", sc, dtype=dtype_name(dtype), page_size=page_size,
                shape=Shape("triton_mla", heads, 1, dims[0] + dims[2], dims[0]),
                kv_cache_dtype=None if kv_dtype is None else dtype_name(kv_dtype),
                kv_scales=(0.5, 0.5) if quantized else None, garbage="nan" if garbage else None, mla_form=form)
    p = make_mla_problem(case, "cpu", dims=dims, rows=rows)
    _, backend = REG.build("triton", p.context("triton"))
    return p.cache, p.batch, backend, p.layer, p.q, p.latent


def _check(form, mode, **kw):
    cache, batch, backend, layer, q, lat = _problem(form, mode, **kw)
    expect = reference_mla(q, lat, layer, batch, cache.read_latent(0), cache.req_to_token,
                           scale=cache.kv_scales(0)[0])
    backend.init_forward_metadata(batch)
    out = backend.forward(q, lat, None, layer, batch)
    tol = tolerance_for(str(q.dtype)[6:], str(cache.dtype)[6:])
    assert out.dtype == q.dtype
    torch.testing.assert_close(out.double(), expect, atol=tol.atol, rtol=tol.rtol, equal_nan=True)
    return out


@pytest.mark.parametrize("form", ["absorbed", "unabsorbed"])
@pytest.mark.parametrize("mode", ["decode", "extend"])
@pytest.mark.parametrize("dtype,kv_dtype,page_size", [
    (torch.float32, None, 1), (torch.float32, None, 16), (torch.bfloat16, None, 4),
    (torch.float16, None, 64), (torch.float32, torch.float8_e4m3fn, 4), (torch.bfloat16, torch.float8_e5m2, 16)])
def test_both_forms_match_the_reference(form, mode, dtype, kv_dtype, page_size):
    _check(form, mode, dtype=dtype, kv_dtype=kv_dtype, page_size=page_size)


@pytest.mark.parametrize("form", ["absorbed", "unabsorbed"])
@pytest.mark.parametrize("mode", ["decode", "extend"])
def test_garbage_in_unowned_slots_reaches_no_output(form, mode):
    out = _check(form, mode, garbage=True)
    assert bool(torch.isfinite(out).all())


def test_deepseek_v3_shape_in_both_forms():
    """The real latent: 512 + 64, nope 128, v 128 (one extend each; the interpreter is slow)."""
    for form in ("absorbed", "unabsorbed"):
        _check(form, "extend", heads=2, dims=(512, 128, 64, 128), seq=(3, 20), new=(3, 2), page_size=16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_decompression_kernel_matches_the_reference_decompression(dtype):
    """``_mla_decompress_kernel`` (gathered through slots and read in place) against ``mla_decompress``."""
    cache, batch, backend, layer, q, lat = _problem("unabsorbed", "extend", dtype=dtype)
    buf = cache.get_kv(0)[0]
    slots = torch.tensor([40, 3, 7, 0, 51])
    kd, vd = backend._decompress(buf, slots, 1.0, False, layer, dtype)
    ek, ev = mla_decompress(buf[slots], layer)
    tol = tolerance_for(str(dtype)[6:])
    torch.testing.assert_close(kd.double(), ek, atol=tol.atol, rtol=tol.rtol)
    torch.testing.assert_close(vd.double(), ev, atol=tol.atol, rtol=tol.rtol)
    kd2, vd2 = backend._decompress(buf[slots], None, 1.0, False, layer, dtype)  # rows in place
    assert torch.equal(kd, kd2) and torch.equal(vd, vd2)


def test_the_weights_are_converted_once_per_layer_weight_and_dtype():
    cache, batch, backend, layer, q, lat = _problem("unabsorbed", "extend")
    backend.init_forward_metadata(batch)
    backend.forward(q, lat, None, layer, batch, save_kv_cache=False)
    backend.forward(q, lat, None, layer, batch, save_kv_cache=False)
    assert len(backend._weights) == 2  # w_kc and w_vc, once each


@pytest.mark.parametrize("form", ["absorbed", "unabsorbed"])
@pytest.mark.parametrize("mode", ["decode", "extend"])
def test_a_request_computes_the_same_bits_alone_or_in_a_batch(form, mode):
    """The backend claims deterministic (batch-invariant) output: request 1 of a batch of three equals
    the same request run alone, bit for bit, in both forms."""
    cache, batch, backend, layer, q, lat = _problem(form, mode, seq=(9, 40, 23), rows=(2, 0, 1))
    backend.init_forward_metadata(batch)
    out = backend.forward(q, lat, None, layer, batch, save_kv_cache=False)
    starts = [0]
    for e in batch.extend_seq_lens_cpu:
        starts.append(starts[-1] + e)
    a, b = starts[1], starts[2]
    one = ForwardBatch.decode([0], [40], batch.out_cache_loc[a:b]) if mode == "decode" else \
        ForwardBatch.extend([0], [batch.extend_prefix_lens_cpu[1]], [b - a], batch.out_cache_loc[a:b])
    one.mla_form = form
    backend.init_forward_metadata(one)
    alone = backend.forward(q[a:b], lat[a:b], None, layer, one, save_kv_cache=False)
    assert torch.equal(alone, out[a:b])
