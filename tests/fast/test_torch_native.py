"""The torch_native kernel module against the float64 reference (attnplug.testing.reference).

Every case builds a paged KV cache whose pages are scattered at random
(``PageAllocator``), fills every slot with noise (so a read of a wrong slot
shows), runs one forward and compares the output with ``reference_attention``
computed from the cache as it was before the forward, and the cache after the
forward with ``expected_cache_after`` (exact: new K/V at ``out_cache_loc`` and
nowhere else).

torch_native is plain PyTorch: eager decode, SDPA extend (``check_path`` checks the eager paths
ran). The fused C++ kernel that once lived here is the ``cpu_fused`` backend; its tests are in
tests/plugins/test_cpu_fused.py.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import pytest
import torch

from attnplug import (
    AttentionConfig,
    BuildContext,
    ForwardBatch,
    ForwardMode,
    HostInfo,
    LayerSpec,
    PageAllocator,
    PagedKVCache,
    ShapeError,
)
from attnplug.errors import MetadataNotInitializedError, ResourceLimitError
from attnplug.errors import AttnplugError
from attnplug.testing.suite.harness import same_bytes
from attnplug_torch_native import CAPABILITIES
from attnplug_torch_native.backend import TorchNativeBackend, create
from tests import paged_setup
from tests.paged_setup import Setup, make_batch, new_slots, place, qkv, run_and_check

HOST = HostInfo(platform="cpu")

#: ``fused`` values a correctness case runs under (the eager paths only, since the fused kernel is
#: cpu_fused's; the parameter stays so the case ids stay stable)
FUSED_PATHS = [pytest.param("off", id="eager")]


def mode_paths(modes: Sequence[ForwardMode]) -> list[Any]:
    """``(mode, fused)`` pairs: every mode on the eager paths."""
    return [pytest.param(m, "off", id=f"{m.name}-eager") for m in modes]


def make_setup(
    *,
    page_size: int = 16,
    heads: int = 8,
    kv_heads: int = 2,
    head_dim: int = 16,
    v_head_dim: int | None = None,
    dtype: torch.dtype = torch.float32,
    kv_dtype: torch.dtype | None = None,
    num_layers: int = 1,
    seed: int = 0,
    layer_kw: dict[str, Any] | None = None,
    decode_block_bytes: Any = "auto",
    extend_score_bytes: int = 64 << 20,
    via_registry: bool = False,
    fused: str = "off",
) -> Setup:
    num_pages = max(8, 512 // page_size)
    return paged_setup.make_setup(
        "torch_native",
        lambda ctx: TorchNativeBackend(ctx, decode_block_bytes=decode_block_bytes,
                                       extend_score_bytes=extend_score_bytes),
        host=HOST, page_size=page_size, heads=heads, kv_heads=kv_heads, head_dim=head_dim, v_head_dim=v_head_dim,
        dtype=dtype, kv_dtype=kv_dtype, num_layers=num_layers, seed=seed, layer_kw=layer_kw, num_pages=num_pages,
        max_context_len=160, via_registry=via_registry,
        # positions no request owns point far outside the cache (engines leave such garbage)
        unassigned=num_pages * page_size + 12345,
    )


def check_path(s: Setup, fused: str, batch: ForwardBatch, layer: LayerSpec | None = None) -> None:
    """After forwards of ``batch``: the eager paths ran (their workspace exists)."""
    assert fused == "off"
    assert s.backend.workspace.grows > 0, "the eager paths did not run"


# ---------------------------------------------------------------------------
# building
# ---------------------------------------------------------------------------


def test_built_through_registry_entry_point_and_stamped():
    s = make_setup(via_registry=True)
    b = s.backend
    assert isinstance(b, TorchNativeBackend)
    assert b.prefill_attention_backend_str == b.decode_attention_backend_str == "torch_native"
    assert type(b).capabilities is CAPABILITIES
    assert b.not_supported_reasons(s.layers[0]) == []
    run_and_check(s, make_batch(s, ForwardMode.DECODE, [5, 17], [1, 1]))


def test_factory_returns_effective_name():
    s = make_setup()
    name, backend = create(s.backend.ctx)
    assert name == "torch_native" and isinstance(backend, TorchNativeBackend)


def test_not_supported_reasons_are_the_generic_ones():
    paged_setup.assert_claims_every_feature(make_setup().backend, fp8="fp8", refused={"kv_cache_dtype": "float64"})


def test_forward_without_kv_cache_raises_clearly():
    s = make_setup()
    backend = TorchNativeBackend(s.backend.ctx.replace(kv_cache=None))
    batch = ForwardBatch.decode([0], [3], [5])
    with pytest.raises(AttnplugError, match="without a KV cache"):
        backend.init_forward_metadata(batch)


# ---------------------------------------------------------------------------
# every mode, page sizes 1 and 16, scattered pages
# ---------------------------------------------------------------------------

EXTEND_CASES = {
    "no_prefix_ragged": ([0, 0, 0], [5, 17, 1]),
    "prefix_mid_page": ([3, 21, 16], [4, 9, 2]),
    "single_token_extends": ([0, 7, 30], [1, 1, 1]),
    "zero_new_tokens_in_batch": ([4, 0], [0, 6]),
}


@pytest.mark.parametrize("fused", FUSED_PATHS)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("case", sorted(EXTEND_CASES))
def test_extend(page_size, case, fused):
    prefix, ext = EXTEND_CASES[case]
    s = make_setup(page_size=page_size, seed=1, fused=fused)
    batch = make_batch(s, ForwardMode.EXTEND, prefix, ext)
    run_and_check(s, batch)
    check_path(s, fused, batch)


@pytest.mark.parametrize("mode,fused",
                         mode_paths([ForwardMode.MIXED, ForwardMode.DRAFT_EXTEND, ForwardMode.DRAFT_EXTEND_V2]))
def test_extend_shaped_modes(mode, fused):
    s = make_setup(page_size=16, seed=2, fused=fused)
    # MIXED: two extends and two decode-like requests (one new token on a prefix)
    batch = make_batch(s, mode, [0, 19, 33, 8], [6, 3, 1, 1])
    run_and_check(s, batch)
    check_path(s, fused, batch)


@pytest.mark.parametrize("fused", FUSED_PATHS)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (8, 1), (4, 4)], ids=["gqa4", "mqa", "mha"])
def test_decode(page_size, heads, kv_heads, fused):
    s = make_setup(page_size=page_size, heads=heads, kv_heads=kv_heads, seed=3, fused=fused)
    # ragged; one request decodes its very first token (no cached prefix); prefixes end mid-page
    batch = make_batch(s, ForwardMode.DECODE, [0, 40, 16, 7, 63], [1] * 5)
    run_and_check(s, batch)
    check_path(s, fused, batch)


@pytest.mark.parametrize("block", [1, 8200, 20000, None],
                         ids=["one_kv_head_per_block", "one_request_per_block", "two_per_block", "whole_batch"])
def test_decode_block_split(block):
    # decode processes blocks of requests (max_len 64, 2 KV heads x 16 dims x 4 B: 8192 B of K per
    # request); 8200 B gives one request per block, 20000 B blocks of 2, 2 and 1 requests, and 1 B
    # splits every request's KV heads into blocks of one head
    s = make_setup(page_size=16, heads=8, kv_heads=2, seed=3, decode_block_bytes=block, fused="off")
    run_and_check(s, make_batch(s, ForwardMode.DECODE, [0, 40, 16, 7, 63], [1] * 5))


@pytest.mark.parametrize("layer_kind", ["plain", "sinks", "window_softcap"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_decode_long_request_split_by_kv_heads(dtype, layer_kind):
    # a request whose keys alone exceed decode_block_bytes is split by KV heads: 4 KV heads x 16
    # dims x 4 B x 64 keys = 16384 B; 12300 B holds 3 heads' keys, so the long requests get blocks of
    # heads 0-2 and 3 while the short ones are grouped whole
    kw = {"plain": {}, "sinks": dict(sinks=torch.linspace(-1.0, 2.0, 8)),
          "window_softcap": dict(sliding_window=50, logit_cap=3.0)}[layer_kind]
    s = make_setup(page_size=16, heads=8, kv_heads=4, dtype=dtype, seed=13, layer_kw=kw, decode_block_bytes=12300,
                   fused="off")
    batch = make_batch(s, ForwardMode.DECODE, [63, 2, 0, 58], [1] * 4)
    run_and_check(s, batch)
    meta = s.backend.build_metadata(batch)
    plan = meta.decode_plan(s.layers[0].sliding_window, False, 12300, 4 * 16 * 4, dtype != torch.float32)
    # (the window of 50 still leaves 51 keys, 13056 B: split too)
    assert [(b.b0, b.b1, b.h0, b.h1) for b in plan] == [(0, 1, 0, 3), (0, 1, 3, 4), (1, 3, 0, 4), (3, 4, 0, 3),
                                                        (3, 4, 3, 4)]


@pytest.mark.parametrize("fused", FUSED_PATHS)
@pytest.mark.parametrize("heads,kv_heads", [(8, 1), (4, 4)], ids=["mqa", "mha"])
def test_extend_head_layouts(heads, kv_heads, fused):
    s = make_setup(page_size=16, heads=heads, kv_heads=kv_heads, seed=3, fused=fused)
    batch = make_batch(s, ForwardMode.EXTEND, [0, 21], [6, 5])
    run_and_check(s, batch)
    check_path(s, fused, batch)


@pytest.mark.parametrize("fused", FUSED_PATHS)
def test_decode_new_slot_not_yet_in_req_to_token(fused):
    # The engine writes the new token to a slot req_to_token does not map yet: the new K/V
    # must come from the arguments (the kernel never reads the new token from the cache).
    s = make_setup(page_size=1, seed=19, fused=fused)
    req, prefix = [5, 2], [9, 30]
    place(s, req, prefix)
    loc = torch.tensor(s.alloc.alloc(2))
    batch = ForwardBatch.decode(req, [p + 1 for p in prefix], loc)
    run_and_check(s, batch)
    check_path(s, fused, batch)


@pytest.mark.parametrize("fused", FUSED_PATHS)
def test_decode_all_first_tokens(fused):
    s = make_setup(seed=4, fused=fused)
    batch = make_batch(s, ForwardMode.DECODE, [0, 0, 0], [1, 1, 1])
    run_and_check(s, batch)
    check_path(s, fused, batch)


@pytest.mark.parametrize("fused", FUSED_PATHS)
@pytest.mark.parametrize("custom", [False, True], ids=["causal", "custom_mask"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_target_verify(custom, page_size, fused):
    s = make_setup(page_size=page_size, seed=5, fused=fused)
    d = 4
    mask = None
    if custom:  # a tree: every draft sees itself; some see earlier drafts, one sees a *later* one
        mask = torch.rand(3, d, d, generator=s.gen) > 0.5
        mask |= torch.eye(d, dtype=torch.bool)
        mask[0, 1, 3] = True  # causal by position still hides it (reference semantics)
    batch = make_batch(s, ForwardMode.TARGET_VERIFY, [9, 16, 30], [d] * 3, spec_num_draft_tokens=d,
                       spec_custom_mask=mask)
    run_and_check(s, batch)
    check_path(s, fused, batch)
    if custom:  # the mask matters: the causal answer differs
        layer = s.layers[0]
        q, k, v = qkv(s, layer, batch.num_tokens)
        s.backend.init_forward_metadata(batch)
        masked = s.backend.forward(q, k, v, layer, batch, save_kv_cache=False)
        causal = dataclasses.replace(batch, spec_custom_mask=None)
        s.backend.init_forward_metadata(causal)
        plain = s.backend.forward(q, k, v, layer, causal, save_kv_cache=False)
        assert not torch.allclose(masked, plain)


@pytest.mark.parametrize("fused", FUSED_PATHS)
def test_target_verify_mask_row_hiding_everything_gives_zero(fused):
    s = make_setup(seed=6, fused=fused)
    d = 3
    mask = torch.ones(1, d, d, dtype=torch.bool)
    mask[0, 1, :] = False  # draft 1 sees no draft; with no prefix it sees nothing at all
    batch = make_batch(s, ForwardMode.TARGET_VERIFY, [0], [d], spec_num_draft_tokens=d, spec_custom_mask=mask)
    out = run_and_check(s, batch)
    assert torch.count_nonzero(out[1]) == 0
    check_path(s, fused, batch)


def test_idle_returns_empty():
    s = make_setup(heads=8, kv_heads=2, head_dim=16, v_head_dim=12)
    layer = s.layers[0]
    batch = ForwardBatch.idle()
    s.backend.init_forward_metadata(batch)
    q = torch.zeros(0, 8, 16)
    k, v = torch.zeros(0, 2, 16), torch.zeros(0, 2, 12)
    for fn in (s.backend.forward, s.backend.forward_extend, s.backend.forward_decode):
        out = fn(q, k, v, layer, batch)
        assert out.shape == (0, 8, 12) and out.dtype == torch.float32


# ---------------------------------------------------------------------------
# layer features
# ---------------------------------------------------------------------------

FEATURES = {
    "window0": dict(sliding_window=0),
    "window5": dict(sliding_window=5),
    "softcap": dict(logit_cap=1.5, scaling=1.0),  # scale up so the cap bites
    "sinks": dict(sinks=torch.linspace(-2.0, 3.0, 8)),
    "all": dict(sliding_window=7, logit_cap=2.0, sinks=torch.linspace(3.0, -1.0, 8)),
}


@pytest.mark.parametrize("feature", sorted(FEATURES))
@pytest.mark.parametrize("mode,fused",
                         mode_paths([ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.TARGET_VERIFY]))
def test_layer_features(feature, mode, fused):
    # eager decode: blocks of one KV head (decode_block_bytes=1)
    s = make_setup(page_size=16, seed=7, layer_kw=FEATURES[feature], decode_block_bytes=1, fused=fused)
    if mode is ForwardMode.DECODE:
        batch = make_batch(s, mode, [0, 25, 12], [1, 1, 1])
    elif mode is ForwardMode.TARGET_VERIFY:
        batch = make_batch(s, mode, [11, 20], [3, 3], spec_num_draft_tokens=3,
                           spec_custom_mask=torch.tensor([[1, 0, 0], [1, 1, 0], [0, 1, 1]], dtype=torch.bool)
                           .expand(2, 3, 3).contiguous())
    else:
        batch = make_batch(s, mode, [0, 13, 5], [9, 6, 1])
    run_and_check(s, batch)
    check_path(s, fused, batch)


@pytest.mark.parametrize("score_bytes", [1, 4 * 8 * 40 * 3], ids=["one_query_chunks", "three_query_chunks"])
@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.TARGET_VERIFY])
def test_extend_in_query_chunks(score_bytes, mode):
    # long extends are processed in query chunks seeing only the keys they can (causal, window);
    # the eager extend's chunking
    s = make_setup(page_size=16, seed=20, extend_score_bytes=score_bytes, fused="off",
                   layer_kw=dict(sliding_window=6, sinks=torch.linspace(-1.0, 1.0, 8)))
    if mode is ForwardMode.TARGET_VERIFY:
        mask = torch.rand(2, 5, 5, generator=s.gen) > 0.4
        batch = make_batch(s, mode, [17, 3], [5, 5], spec_num_draft_tokens=5, spec_custom_mask=mask)
    else:
        batch = make_batch(s, mode, [19, 0], [21, 11])
    run_and_check(s, batch)


@pytest.mark.parametrize("mode,fused", mode_paths([ForwardMode.EXTEND, ForwardMode.DECODE]))
@pytest.mark.parametrize("with_kv", [False, True], ids=["kv_none", "kv_given"])
def test_cross_attention(mode, with_kv, fused):
    s = make_setup(page_size=16, seed=8, layer_kw=dict(is_cross_attention=True, sliding_window=2),
                   fused=fused)
    enc = [13, 0, 20]  # one request without encoder tokens: its output is zero
    req = [6, 3, 1]
    seq = [14, 3, 25] if mode is ForwardMode.DECODE else [2, 3, 13]
    # encoder tokens live at positions 0 … enc-1; the decoder's own prefix must be mapped too
    # (the core checks every cached position a forward reads)
    place(s, req, [max(e, n) for e, n in zip(enc, seq)])
    loc = torch.tensor([200, 201, 202, 203, 204, 205][: (3 if mode is ForwardMode.DECODE else 6)])
    if mode is ForwardMode.DECODE:
        batch = ForwardBatch.decode(req, seq, loc, encoder_lens=torch.tensor(enc))
    else:
        batch = ForwardBatch.extend(req, [0, 2, 10], [2, 1, 3], loc, encoder_lens=torch.tensor(enc))
    out = run_and_check(s, batch, with_kv=with_kv)  # also checks nothing was written
    row = 1 if mode is ForwardMode.DECODE else 2
    assert torch.count_nonzero(out[row]) == 0
    check_path(s, fused, batch)


@pytest.mark.parametrize("dims", [(24, 8), (32, 16)], ids=["24_8", "32_16"])
@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE])
def test_v_head_dim_differs(mode, dims):
    D, Dv = dims
    s = make_setup(head_dim=D, v_head_dim=Dv, seed=9, layer_kw=dict(sinks=torch.zeros(8)))
    batch = make_batch(s, mode, [5, 31], [7, 1] if mode is ForwardMode.EXTEND else [1, 1])
    run_and_check(s, batch)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("mode,fused", mode_paths([ForwardMode.EXTEND, ForwardMode.DECODE]))
def test_half_dtypes(dtype, mode, fused):
    s = make_setup(dtype=dtype, seed=10, layer_kw=dict(logit_cap=20.0, sinks=torch.ones(8)), fused=fused)
    batch = make_batch(s, mode, [3, 40], [12, 1] if mode is ForwardMode.EXTEND else [1, 1])
    run_and_check(s, batch)
    check_path(s, fused, batch)


BF16_DECODE_LAYERS = {
    "plain": dict(scaling=1.0),
    "softcap": dict(scaling=1.0, logit_cap=400.0),  # bites a little, leaves scores apart
    "sinks": dict(scaling=1.0, sinks=torch.linspace(-2.0, 9.0, 8)),
    "window": dict(scaling=1.0, sliding_window=9),
}


@pytest.mark.parametrize("fused,block", [
    pytest.param("off", 1, id="eager_one_request_blocks"),
    pytest.param("off", None, id="eager_whole_batch_block"),
])
@pytest.mark.parametrize("layer_kind", sorted(BF16_DECODE_LAYERS))
def test_bf16_decode_with_large_scores(layer_kind, fused, block):
    # keys sharing a large common part (as real keys do) and scaling 1.0: scores of hundreds whose
    # differences are a few units, where a bf16-rounded score (off by up to |s| * 2^-8) changes
    # the softmax past the suite's tolerance; ragged lengths pad the eager decode's blocks
    s = make_setup(dtype=torch.bfloat16, head_dim=16, seed=31, layer_kw=BF16_DECODE_LAYERS[layer_kind],
                   decode_block_bytes=block, fused=fused)
    common = torch.randn(s.cache.head_dim, generator=s.gen) * 12
    s.cache.k_buffers[0].add_(common.to(torch.bfloat16))
    batch = make_batch(s, ForwardMode.DECODE, [40, 3, 77, 0], [1, 1, 1, 1])
    run_and_check(s, batch)
    check_path(s, fused, batch)


@pytest.mark.parametrize("fused,block", [
    pytest.param("off", 1, id="eager_one_request_blocks"),
    pytest.param("off", None, id="eager_whole_batch_block"),
])
def test_bf16_decode_with_every_score_far_below_zero(fused, block):
    # keys (cached and new) share a large common part and every query points against it, so every
    # real score is hundreds below zero, a few units apart. In a padded eager block the padding keys
    # (zeroed: score 0) must not become the row maximum the bf16 scores are shifted by: shifted by 0,
    # s - m rounds to bf16 with an error of units and exp() underflows to zero for every key
    s = make_setup(dtype=torch.bfloat16, head_dim=16, seed=32, layer_kw=dict(scaling=1.0),
                   decode_block_bytes=block, fused=fused)
    layer = s.layers[0]
    common = torch.randn(s.cache.head_dim, generator=s.gen) * 12
    s.cache.k_buffers[0].add_(common.to(torch.bfloat16))
    batch = make_batch(s, ForwardMode.DECODE, [40, 3, 77, 0], [1, 1, 1, 1])
    T, g = batch.num_tokens, s.gen
    q = (-8 * common / common.norm() + torch.randn(T, layer.num_heads, layer.head_dim, generator=g))
    k = common + torch.randn(T, layer.num_kv_heads, layer.head_dim, generator=g)
    v = torch.randn(T, layer.num_kv_heads, layer.v_head_dim, generator=g)
    q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))
    kc = s.cache.k_buffers[0]
    cached = torch.cat([s.cache.req_to_token[r, :p] for r, p in zip([7, 6, 5, 4], [40, 3, 77, 0])])
    scores = torch.einsum("thd,nkd->thnk", q.double(), torch.cat([kc[cached], k]).double())
    assert float(scores.max()) < -100, "the case needs every real score far below zero"
    run_and_check(s, batch, inputs=(q, k, v))
    check_path(s, fused, batch)


def test_bf16_shifted_scores_round_s_minus_max_once():
    """``_shifted_scores`` (bf16 decode): the rounding error of each score is relative to its distance
    from the row maximum, not to the score itself; a plain bf16 matmul is far outside that bound."""
    s = make_setup(dtype=torch.bfloat16, fused="off")
    g = torch.Generator().manual_seed(3)
    rows, G, L, D = 6, 4, 300, 128
    q = (3 * torch.randn(rows, G, D, generator=g)).to(torch.bfloat16)
    K = (3 * torch.randn(rows, L, D, generator=g)).to(torch.bfloat16)
    exact = torch.bmm(q.double(), K.double().transpose(1, 2))
    blk = s.backend.build_metadata(ForwardBatch.decode([0], [1], torch.tensor([0]))).decode_plan(
        None, False, None, 1, True)[0]._replace(hidden=None)
    shifted, m = s.backend._shifted_scores(q, K.transpose(1, 2), blk, rows, 1, G)
    dist = exact - m.double()
    bound = dist.abs() * 2.0 ** -8 + exact.abs().amax() * 2.0 ** -16  # one bf16 rounding + float32 accumulation
    assert bool(((shifted.double() - dist).abs() <= bound).all())
    assert float(dist.amax(dim=2).abs().max()) <= float(exact.abs().amax()) * 2.0 ** -7  # m is the row maximum
    plain = torch.bmm(q, K.transpose(1, 2)).double() - m.double()
    assert not bool(((plain - dist).abs() <= bound).all())


@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE])
def test_fp32_model_with_bf16_kv_cache(mode):
    s = make_setup(dtype=torch.float32, kv_dtype=torch.bfloat16, seed=11)
    run_and_check(s, make_batch(s, mode, [6, 19], [5, 1] if mode is ForwardMode.EXTEND else [1, 1]))


# ---------------------------------------------------------------------------
# KV writes, metadata, errors
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("mode,fused", mode_paths([ForwardMode.EXTEND, ForwardMode.DECODE]))
def test_save_kv_cache_false_writes_nothing(mode, fused):
    s = make_setup(seed=12, fused=fused)
    # save=False: the cache must stay bit-identical; the output still uses the new k/v
    batch = make_batch(s, mode, [4, 17], [3, 1] if mode is ForwardMode.EXTEND else [1, 1])
    run_and_check(s, batch, save=False)
    check_path(s, fused, batch)


@pytest.mark.parametrize("mode,fused", mode_paths([ForwardMode.EXTEND, ForwardMode.DECODE]))
def test_metadata_built_once_serves_every_layer(mode, fused):
    s = make_setup(num_layers=3, seed=13, decode_block_bytes=4096, fused=fused)
    s.layers[2] = LayerSpec(2, 8, 2, 16, sliding_window=4)  # a layer whose mask differs
    batch = make_batch(s, mode, [9, 30], [6, 1] if mode is ForwardMode.EXTEND else [1, 1])
    s.backend.init_forward_metadata(batch)
    for layer in s.layers:
        run_and_check(s, batch, layer, init=False)
    assert s.backend.metadata_builds == 1
    grows = s.backend.workspace.grows
    for layer in s.layers:  # a second pass over the layers allocates no workspace
        run_and_check(s, batch, layer, init=False)
    assert s.backend.workspace.grows == grows
    for layer in s.layers:
        check_path(s, fused, batch, layer)


def test_forward_before_init_raises():
    s = make_setup(seed=14)
    layer = s.layers[0]
    batch = make_batch(s, ForwardMode.DECODE, [4], [1])
    q, k, v = qkv(s, layer, 1)
    with pytest.raises(MetadataNotInitializedError):
        s.backend.forward(q, k, v, layer, batch)
    other = make_batch(s, ForwardMode.DECODE, [6], [1], req_ids=[2])
    s.backend.init_forward_metadata(other)
    with pytest.raises(MetadataNotInitializedError):  # metadata was built for another forward
        s.backend.forward_decode(q, k, v, layer, batch)


@pytest.mark.parametrize("field", ["q", "k", "v"])
def test_wrong_shapes_name_the_field(field):
    s = make_setup(seed=15)
    layer = s.layers[0]
    batch = make_batch(s, ForwardMode.EXTEND, [2], [3])
    s.backend.init_forward_metadata(batch)
    q, k, v = qkv(s, layer, 3)
    bad = {"q": q[:, :4], "k": k[:2], "v": v[..., :5]}[field]
    args = {"q": q, "k": k, "v": v, field: bad}
    with pytest.raises(ShapeError, match=rf"^{field} has shape"):
        s.backend.forward(args["q"], args["k"], args["v"], layer, batch)


def test_dtype_mismatch_and_missing_kv_raise():
    s = make_setup(seed=16)
    layer = s.layers[0]
    batch = make_batch(s, ForwardMode.DECODE, [2], [1])
    s.backend.init_forward_metadata(batch)
    q, k, v = qkv(s, layer, 1)
    with pytest.raises(ShapeError, match="dtypes differ"):
        s.backend.forward(q, k.half(), v, layer, batch)
    with pytest.raises(ShapeError, match="k and v"):
        s.backend.forward(q, None, None, layer, batch)


def test_layer_not_matching_the_cache_raises():
    s = make_setup(seed=17)
    batch = make_batch(s, ForwardMode.DECODE, [2], [1])
    s.backend.init_forward_metadata(batch)
    layer = LayerSpec(0, 8, 4, 16)  # the cache has 2 KV heads
    q, k, v = qkv(s, layer, 1)
    with pytest.raises(ShapeError, match="kv_cache"):
        s.backend.forward(q, k, v, layer, batch)


# ---------------------------------------------------------------------------
# determinism
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("mode,fused", mode_paths([ForwardMode.EXTEND, ForwardMode.DECODE]))
def test_repeated_forward_is_bit_identical(mode, fused):
    s = make_setup(seed=18, fused=fused)
    layer = s.layers[0]
    batch = make_batch(s, mode, [5, 21, 2], [4, 7, 1] if mode is ForwardMode.EXTEND else [1, 1, 1])
    q, k, v = qkv(s, layer, batch.num_tokens)
    outs = []
    for _ in range(3):
        s.backend.init_forward_metadata(batch)
        outs.append(s.backend.forward(q, k, v, layer, batch))
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    check_path(s, fused, batch)


def test_deterministic_is_not_claimed():
    # Batch invariance would need the BLAS reduction order to be independent of the padded
    # batch length and of the block split, which torch does not promise; see the plugin docs.
    assert CAPABILITIES.deterministic is False


# ---------------------------------------------------------------------------
# robustness: garbage in unowned slots never reaches an output (issue 9, item 1)
# ---------------------------------------------------------------------------

GARBAGE_MODES = [ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.MIXED, ForwardMode.TARGET_VERIFY,
                 ForwardMode.DRAFT_EXTEND]
GARBAGE_LAYERS = {
    "plain": {},
    "window3": dict(sliding_window=3),
    "sinks": dict(sinks=torch.linspace(-1.0, 2.0, 8)),
    "window3_sinks": dict(sliding_window=3, sinks=torch.linspace(2.0, -1.0, 8)),
    "softcap": dict(logit_cap=1.5, scaling=1.0),
}


def fill_garbage(s: Setup, owned: torch.Tensor) -> None:
    """Every slot not in ``owned``: NaN, +inf and -inf in turn (slot 0 always among them)."""
    mask = torch.ones(s.cache.num_slots, dtype=torch.bool)
    mask[owned] = False
    bad = mask.nonzero().squeeze(1)
    assert int(bad[0]) == 0, "slot 0 (the padding slot) must hold garbage in this test"
    vals = torch.tensor([float("nan"), float("inf"), float("-inf")])[torch.arange(bad.numel()) % 3]
    for buf in s.cache.k_buffers + s.cache.v_buffers:
        buf[bad] = vals.to(buf.dtype)[:, None, None].expand(-1, *buf.shape[1:])


def garbage_batch(s: Setup, mode: ForwardMode) -> ForwardBatch:
    """Ragged requests on pages other than page 0; positions beyond a request's pages stay -1."""
    s.cache.req_to_token.fill_(-1)  # unassigned, as the core leaves it
    s.alloc = PageAllocator(s.cache.num_pages, shuffle=True, seed=5)
    s.alloc.alloc(1)  # whichever page it is, keep it away from the requests ...
    if mode is ForwardMode.DECODE:
        prefix, ext, kw = [10, 0, 29, 7], [1, 1, 1, 1], {}
    elif mode is ForwardMode.TARGET_VERIFY:
        mask = torch.tensor([[1, 0, 0], [1, 1, 0], [0, 1, 1]], dtype=torch.bool).expand(3, 3, 3).contiguous()
        prefix, ext, kw = [12, 0, 27], [3, 3, 3], dict(spec_num_draft_tokens=3, spec_custom_mask=mask)
    elif mode is ForwardMode.MIXED:
        prefix, ext, kw = [0, 19, 33, 4], [7, 1, 1, 9], {}
    else:
        prefix, ext, kw = [0, 21, 6], [13, 4, 1], {}
    ps = s.cache.page_size
    req_ids = [7 - i for i in range(len(prefix))]
    for r, p, e in zip(req_ids, prefix, ext):
        pages = [pg for pg in s.alloc.alloc((p + e + ps - 1) // ps + 1) if pg != 0][: (p + e + ps - 1) // ps]
        s.cache.assign_pages(r, p + e, pages)
    loc = new_slots(s, req_ids, prefix, ext)
    owned = torch.cat([s.cache.req_to_token[r, :p] for r, p in zip(req_ids, prefix)])
    fill_garbage(s, owned)  # new tokens' slots hold garbage too: the kernel takes them from k/v
    if mode is ForwardMode.DECODE:
        return ForwardBatch.decode(req_ids, [p + 1 for p in prefix], loc, **kw)
    return ForwardBatch.extend(req_ids, prefix, ext, loc, mode=mode, **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layer_kind", sorted(GARBAGE_LAYERS))
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("mode,fused", mode_paths(GARBAGE_MODES))
def test_garbage_in_unowned_slots_never_reaches_an_output(mode, fused, page_size, layer_kind, dtype):
    s = make_setup(page_size=page_size, seed=31, dtype=dtype, layer_kw=GARBAGE_LAYERS[layer_kind],
                   decode_block_bytes=4096, fused=fused)  # eager: several padded decode blocks
    batch = garbage_batch(s, mode)
    out = run_and_check(s, batch)  # equals the float64 reference (which reads owned slots only)
    assert bool(torch.isfinite(out).all())
    check_path(s, fused, batch)


@pytest.mark.parametrize("save", [True, False])
def test_garbage_with_whole_batch_decode_block_and_no_save(save):
    # eager: one padded block for the whole batch (the default off CPU), with and without the KV write
    s = make_setup(page_size=16, seed=32, dtype=torch.bfloat16, decode_block_bytes=None, fused="off")
    out = run_and_check(s, garbage_batch(s, ForwardMode.DECODE), save=save)
    assert bool(torch.isfinite(out).all())


@pytest.mark.parametrize("fused", FUSED_PATHS)
def test_garbage_cross_attention_decode_and_extend(fused):
    for mode in (ForwardMode.DECODE, ForwardMode.EXTEND):
        s = make_setup(page_size=16, seed=33, layer_kw=dict(is_cross_attention=True), fused=fused)
        batch = garbage_batch(s, mode)
        enc = [min(3, p) for p in batch.extend_prefix_lens_cpu]
        batch.encoder_lens = torch.tensor(enc)
        out = run_and_check(s, batch, with_kv=False)
        assert bool(torch.isfinite(out).all())
        check_path(s, fused, batch)


# ---------------------------------------------------------------------------
# robustness: sizes bounded before allocating (issue 9, item 6)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("layer_kind", ["plain", "sinks"])  # SDPA path / matmul path
def test_long_prefill_masks_and_scores_are_built_per_bounded_chunk(layer_kind):
    # 2048 new tokens: one [ext, seq] mask would be 4 MiB (and scores 8 heads x 16 MiB); with a
    # 64 KiB bound every mask / score chunk stays within it, and the output is still exact.
    n, budget, heads = 2048, 64 << 10, 2
    gen = torch.Generator().manual_seed(3)
    cache = PagedKVCache(1, n // 16, 1, 8, page_size=16, max_requests=1, max_context_len=n)
    ctx = BuildContext(config=AttentionConfig(attention_backend="torch_native"), host=HOST, dtype="float32",
                       num_heads=heads, num_kv_heads=1, head_dim=8, page_size=16, kv_cache=cache,
                       max_batch_size=1, max_context_len=n)
    backend = TorchNativeBackend(ctx, extend_score_bytes=budget)
    cache.assign_pages(0, n, list(range(n // 16)))
    kw = dict(sinks=torch.tensor([0.5, -0.5])) if layer_kind == "sinks" else {}
    layer = LayerSpec(0, heads, 1, 8, **kw)
    batch = ForwardBatch.extend([0], [0], [n], cache.req_to_token[0, :n].clone())
    q = torch.randn(n, heads, 8, generator=gen)
    k, v = torch.randn(n, 1, 8, generator=gen), torch.randn(n, 1, 8, generator=gen)
    backend.init_forward_metadata(batch)
    out = backend.forward(q, k, v, layer, batch)
    assert 0 < backend.largest_chunk_bytes <= budget
    # dense float64 causal attention (the reference's semantics, vectorised for this size)
    s64 = torch.einsum("thd,jd->htj", q.double(), k[:, 0].double()) * layer.scaling
    s64.masked_fill_(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    m = s64.amax(-1, keepdim=True)
    if layer_kind == "sinks":
        m = torch.maximum(m, layer.sinks.double().view(heads, 1, 1))
    w = torch.exp(s64 - m)
    den = w.sum(-1, keepdim=True)
    if layer_kind == "sinks":
        den = den + torch.exp(layer.sinks.double().view(heads, 1, 1) - m)
    ref = torch.einsum("htj,jd->thd", w / den, v[:, 0].double())
    torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-4)


def test_unchunkable_workspace_over_the_limit_is_refused_before_allocating():
    s = make_setup(page_size=16, seed=34, fused="off")
    s.backend.max_workspace_bytes = 4096  # BuildContext.max_workspace_bytes, lowered for the test
    for mode in (ForwardMode.EXTEND, ForwardMode.DECODE):
        batch = make_batch(s, mode, [40, 3], [5, 1] if mode is ForwardMode.EXTEND else [1, 1],
                           req_ids=[1, 2] if mode is ForwardMode.EXTEND else [3, 4])
        layer = s.layers[0]
        q, k, v = qkv(s, layer, batch.num_tokens)
        before = [b.clone() for b in s.cache.get_kv(0)]
        s.backend.init_forward_metadata(batch)
        with pytest.raises(ResourceLimitError, match="max_workspace_bytes"):
            s.backend.forward(q, k, v, layer, batch)
        assert all(same_bytes(a, b) for a, b in zip(before, s.cache.get_kv(0))), "a refused forward wrote"


from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    mode=st.sampled_from([ForwardMode.DECODE, ForwardMode.EXTEND, ForwardMode.MIXED]),
    page_size=st.sampled_from([1, 4, 16]),
    window=st.sampled_from([None, 0, 2, 9]),
    sinks=st.booleans(),
    lens=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 9)), min_size=1, max_size=5),
    block=st.sampled_from([1, 4096, None]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    fused=st.just("off"),
)
def test_property_random_ragged_batches_with_garbage_match_the_reference(mode, page_size, window, sinks, lens,
                                                                          block, dtype, fused):
    # block: the eager decode's block size
    kw: dict[str, Any] = {}
    if window is not None:
        kw["sliding_window"] = window
    if sinks:
        kw["sinks"] = torch.linspace(-1.0, 1.5, 8)
    s = make_setup(page_size=page_size, seed=len(lens), dtype=dtype, layer_kw=kw, decode_block_bytes=block,
                   fused=fused)
    s.cache.req_to_token.fill_(-1)
    s.alloc = PageAllocator(s.cache.num_pages, shuffle=True, seed=sum(p for p, _ in lens))
    prefix = [p for p, _ in lens]
    ext = [1] * len(lens) if mode is ForwardMode.DECODE else [e for _, e in lens]
    req_ids = list(range(len(lens)))
    place(s, req_ids, [p + e for p, e in zip(prefix, ext)])
    loc = new_slots(s, req_ids, prefix, ext)
    owned = torch.cat([s.cache.req_to_token[r, :p] for r, p in zip(req_ids, prefix)])
    mask = torch.ones(s.cache.num_slots, dtype=torch.bool)
    mask[owned] = False
    for buf in s.cache.k_buffers + s.cache.v_buffers:
        buf[mask] = float("nan")
    if mode is ForwardMode.DECODE:
        batch = ForwardBatch.decode(req_ids, [p + 1 for p in prefix], loc)
    else:
        batch = ForwardBatch.extend(req_ids, prefix, ext, loc, mode=mode)
    run_and_check(s, batch)
    check_path(s, fused, batch)
