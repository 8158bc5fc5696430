"""``PagedBackend``: the shared forward skeleton, and the robustness it gives every backend.

A toy kernel on the base (exact attention through the float64 reference, able to
raise on demand) checks the mechanism once: bounds checked per forward, structure
per layer, and a forward that raises writes nothing, whichever way the kernel
reads its new K/V.
"""

from __future__ import annotations

import pytest
import torch

from attnplug import (
    AttentionConfig, BuildContext, Capabilities, ForwardBatch, ForwardMode, HostInfo, LayerSpec, NotSupportedError,
    PageAllocator, PagedBackend, PagedKVCache, ShapeError,
)
from attnplug.errors import AttnplugError, ResourceLimitError
from attnplug.testing.reference import reference_attention

H, KV, D, PS = 4, 2, 8, 4
CAPS = Capabilities(dtypes=("float32", "bfloat16"), devices=("cpu",))


class ToyBackend(PagedBackend):
    """Exact attention (the reference) with switches to fail inside the kernel."""

    capabilities = CAPS
    backend_name = "toy"
    fail_with: BaseException | None = None

    def build_metadata(self, batch):
        self.builds_seen = getattr(self, "builds_seen", 0) + 1
        return "meta"

    def compute_extend(self, q, k, v, layer, batch, meta):
        assert meta == "meta"
        if self.fail_with is not None:
            raise self.fail_with
        kb, vb = self.cache.get_kv(layer.layer_id)
        if type(self).new_kv_source == "cache":  # the kernel sees its new K/V in the cache
            assert torch.equal(kb[batch.out_cache_loc], k.to(kb.dtype))
        return reference_attention(q, k, v, layer, batch, kb, vb, self.cache.req_to_token).to(q.dtype)


class CacheReadingToy(ToyBackend):
    new_kv_source = "cache"

    def compute_extend(self, q, k, v, layer, batch, meta):
        if self.fail_with is not None:
            raise self.fail_with
        kb, vb = self.cache.get_kv(layer.layer_id)
        assert torch.equal(kb[batch.out_cache_loc], k.to(kb.dtype))
        # the reference reads new tokens from k/v: give it the cache without them
        return torch.zeros(q.shape[0], layer.num_heads, layer.v_head_dim, dtype=q.dtype)


def make(cls=ToyBackend, lens=(6, 3), num_layers=2, dtype="float32"):
    cache = PagedKVCache(num_layers, num_pages=16, num_kv_heads=KV, head_dim=D, page_size=PS, dtype=dtype,
                         max_requests=4, max_context_len=32)
    for kb, vb in zip(cache.k_buffers, cache.v_buffers):
        kb.normal_()
        vb.normal_()
    alloc = PageAllocator(16, seed=3)
    for row, n in zip((2, 0), lens):
        cache.assign_pages(row, n, alloc.alloc(-(-n // PS)))
    ctx = BuildContext(config=AttentionConfig(), host=HostInfo(platform="cpu"), dtype=dtype, num_heads=H,
                       num_kv_heads=KV, head_dim=D, page_size=PS, kv_cache=cache, max_context_len=32)
    return cls(ctx), cache


def decode_batch(cache, lens=(6, 3)):
    loc = torch.stack([cache.slots(2, lens[0] - 1, lens[0])[0], cache.slots(0, lens[1] - 1, lens[1])[0]])
    return ForwardBatch.decode([2, 0], list(lens), loc)


def qkv(n, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(n, H, D, generator=g).to(dtype), torch.randn(n, KV, D, generator=g).to(dtype),
            torch.randn(n, KV, D, generator=g).to(dtype))


def snapshot(cache):
    return [(k.clone(), v.clone()) for k, v in zip(cache.k_buffers, cache.v_buffers)]


def restore(cache, snap):
    """Put ``snapshot``'s buffers back into ``cache``."""
    for (kb, vb), (a, b) in zip(zip(cache.k_buffers, cache.v_buffers), snap):
        kb.copy_(a)
        vb.copy_(b)


def same(cache, snap):
    return all(torch.equal(k, a) and torch.equal(v, b) for (k, v), (a, b) in zip(zip(cache.k_buffers,
                                                                                       cache.v_buffers), snap))


LAYER = LayerSpec(layer_id=1, num_heads=H, num_kv_heads=KV, head_dim=D)


# -- the skeleton ------------------------------------------------------------------
@pytest.mark.parametrize("cls", [ToyBackend, CacheReadingToy])
def test_forward_writes_new_kv_once_and_returns_the_kernel_output(cls):
    backend, cache = make(cls)
    batch = decode_batch(cache)
    q, k, v = qkv(2)
    backend.init_forward_metadata(batch)
    out = backend.forward(q, k, v, LAYER, batch)
    assert out.shape == (2, H, D)
    kb, vb = cache.get_kv(1)
    assert torch.equal(kb[batch.out_cache_loc], k) and torch.equal(vb[batch.out_cache_loc], v)


@pytest.mark.parametrize("cls", [ToyBackend, CacheReadingToy])
@pytest.mark.parametrize("error", [RuntimeError("kernel failed"), MemoryError("can't allocate"),
                                   KeyboardInterrupt()])
def test_a_forward_that_raises_writes_nothing(cls, error):
    backend, cache = make(cls)
    batch = decode_batch(cache)
    before = snapshot(cache)
    backend.init_forward_metadata(batch)
    backend.fail_with = error
    with pytest.raises(type(error)):
        backend.forward(*qkv(2), LAYER, batch)
    assert same(cache, before)


@pytest.mark.parametrize("cls", [ToyBackend, CacheReadingToy])
def test_save_kv_cache_false_leaves_the_cache_unchanged(cls):
    backend, cache = make(cls)
    batch = decode_batch(cache)
    before = snapshot(cache)
    backend.init_forward_metadata(batch)
    backend.forward(*qkv(2), LAYER, batch, save_kv_cache=False)
    assert same(cache, before)


def test_metadata_is_checked_and_built_once_per_forward_whatever_the_layers():
    backend, cache = make(num_layers=2)
    batch = decode_batch(cache)
    calls = []
    real = cache.check_batch
    cache.check_batch = lambda *a, **k: (calls.append(1), real(*a, **k))[1]
    backend.init_forward_metadata(batch)
    for layer_id in (0, 1, 0, 1):
        backend.forward(*qkv(2), LayerSpec(layer_id=layer_id, num_heads=H, num_kv_heads=KV, head_dim=D), batch)
    assert calls == [1] and backend.builds_seen == 1 and backend.metadata_builds == 1


def test_idle_returns_an_empty_output_without_checks():
    backend, cache = make()
    batch = ForwardBatch.idle()
    backend.init_forward_metadata(batch)
    q = torch.zeros(0, H, D)
    assert backend.forward(q, q[:, :KV], q[:, :KV], LAYER, batch).shape == (0, H, D)


@pytest.mark.parametrize("cls", [ToyBackend, CacheReadingToy])
def test_a_backend_built_without_a_cache_serves_idle_and_refuses_the_rest_by_name(cls):
    """Found by mypy (BuildContext.kv_cache is optional): an IDLE forward of a backend built without a
    KV cache raised AttributeError from the forward record; a real forward names the missing cache."""
    ctx = BuildContext(config=AttentionConfig(), host=HostInfo(platform="cpu"), num_heads=H, num_kv_heads=KV,
                       head_dim=D, page_size=PS)
    backend = cls(ctx)
    batch = ForwardBatch.idle()
    backend.init_forward_metadata(batch)
    q = torch.zeros(0, H, D)
    assert backend.forward(q, q[:, :KV], q[:, :KV], LAYER, batch).shape == (0, H, D)
    _, cache = make()
    with pytest.raises(AttnplugError, match="built without a KV cache"):
        backend.init_forward_metadata(decode_batch(cache))


def test_the_kernel_is_chosen_by_the_batch_mode_not_the_method_called():
    seen = []

    class Split(ToyBackend):
        def compute_decode(self, q, k, v, layer, batch, meta):
            seen.append("decode")
            return super().compute_extend(q, k, v, layer, batch, meta)

        def compute_extend(self, q, k, v, layer, batch, meta):
            seen.append("extend")
            return super().compute_extend(q, k, v, layer, batch, meta)

    backend, cache = make(Split)
    batch = decode_batch(cache)
    backend.init_forward_metadata(batch)
    backend.forward_extend(*qkv(2), LAYER, batch)
    assert seen[0] == "decode"


def test_output_is_fresh_and_owned_by_the_caller():
    backend, cache = make()
    batch = decode_batch(cache)
    backend.init_forward_metadata(batch)
    out0 = backend.forward(*qkv(2), LayerSpec(layer_id=0, num_heads=H, num_kv_heads=KV, head_dim=D), batch)
    kept = out0.clone()
    backend.forward(*qkv(2), LAYER, batch)
    assert torch.equal(out0, kept)


# -- bounds: errors name the field, the value and the bound; the cache stays intact --------
def _rejected(backend, cache, batch, q, k, v, layer=LAYER, match=None, exc=ShapeError):
    before = snapshot(cache)
    with pytest.raises(exc, match=match):
        backend.init_forward_metadata(batch)
        backend.forward(q, k, v, layer, batch)
    assert same(cache, before)


def test_out_of_range_slot_is_refused_before_anything_is_written():
    backend, cache = make()
    batch = ForwardBatch.decode([2, 0], [6, 3], [5, cache.num_slots])
    _rejected(backend, cache, batch, *qkv(2),
              match=rf"out_cache_loc\[1\]={cache.num_slots} is out of range .*num_slots={cache.num_slots}")


@pytest.mark.parametrize("field,make_batch,match", [
    ("out_cache_loc", lambda: ForwardBatch.decode([2, 0], [6, 3], [5, -1]), r"out_cache_loc\[1\]=-1"),
    ("req_pool_indices", lambda: ForwardBatch.decode([-1, 0], [6, 3], [5, 6]), r"req_pool_indices\[0\]=-1"),
    ("extend_seq_lens", lambda: ForwardBatch.extend([0], [0], [-1], []), r"extend_seq_lens\[0\]=-1"),
    ("extend_prefix_lens", lambda: ForwardBatch.extend([0], [-2], [3], [1, 2, 3]), r"extend_prefix_lens\[0\]=-2"),
    ("float slots", lambda: ForwardBatch.decode([0], [3], torch.tensor([1.5])), "integer"),
    ("encoder_lens", lambda: ForwardBatch.decode([0], [3], [4], encoder_lens=torch.tensor([-1])),
     r"encoder_lens\[0\]=-1"),
])
def test_negative_or_non_integer_indices_never_wrap(field, make_batch, match):
    with pytest.raises(ShapeError, match=match):
        make_batch()


def test_request_row_beyond_the_pool_is_refused():
    backend, cache = make()
    batch = ForwardBatch.decode([2, 4], [6, 3], [5, 6])
    _rejected(backend, cache, batch, *qkv(2), match=r"req_pool_indices\[1\]=4 is out of range .*max_requests=4")


@pytest.mark.parametrize("layer_id", [-1, 2, 99])
def test_layer_id_outside_the_cache_is_refused(layer_id):
    backend, cache = make(num_layers=2)
    batch = decode_batch(cache)
    layer = LayerSpec(layer_id=layer_id, num_heads=H, num_kv_heads=KV, head_dim=D)
    _rejected(backend, cache, batch, *qkv(2), layer=layer,
              match=rf"layer_id={layer_id} is out of range .*num_layers=2")


def test_a_length_beyond_the_assigned_positions_is_refused_naming_the_request():
    backend, cache = make(lens=(6, 3))
    # request 1 (row 0) has 3 positions assigned; claim it holds 9
    batch = ForwardBatch.decode([2, 0], [6, 9], [5, 7])
    _rejected(backend, cache, batch, *qkv(2),
              match=r"request 1 \(req_to_token row 0\): position 3 .* maps to slot -1, which is unassigned")


def test_a_wild_req_to_token_entry_is_refused():
    backend, cache = make()
    cache.req_to_token[2, 1] = 10**6
    _rejected(backend, cache, decode_batch(cache), *qkv(2), match=r"position 1 .*slot 1000000.*out of range")


def test_seq_len_beyond_the_cache_context_is_refused():
    backend, cache = make()
    batch = ForwardBatch.decode([2, 0], [33, 3], [5, 6])
    _rejected(backend, cache, batch, *qkv(2), match=r"request 0: seq_lens=33 exceeds max_context_len=32")


def test_cache_reading_kernels_need_new_tokens_mapped_to_their_slots():
    backend, cache = make(CacheReadingToy)
    free = cache.num_slots - 1  # a slot the request's position does not map to
    batch = ForwardBatch.decode([2, 0], [6, 3], [int(cache.slots(2, 5, 6)[0]), free])
    _rejected(backend, cache, batch, *qkv(2), match=r"request 1: new token 1 .*req_to_token maps its position")


def test_args_reading_kernels_accept_new_tokens_not_mapped_yet():
    backend, cache = make(ToyBackend)
    cache.req_to_token[0, 2] = -1  # the engine maps the new position after attention
    free = cache.num_slots - 1
    batch = ForwardBatch.decode([2, 0], [6, 3], [int(cache.slots(2, 5, 6)[0]), free])
    backend.init_forward_metadata(batch)
    backend.forward(*qkv(2), LAYER, batch)
    assert torch.equal(cache.get_kv(1)[0][free], qkv(2)[1][1])


# -- dtypes, shapes, modes -----------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.complex64, torch.float16, torch.float64])
def test_unclaimed_dtypes_are_refused_with_the_claimed_list(dtype):
    backend, cache = make()
    batch = decode_batch(cache)
    q, k, v = (torch.ones(2, H, D, dtype=dtype), torch.ones(2, KV, D, dtype=dtype), torch.ones(2, KV, D, dtype=dtype))
    name = str(dtype).replace("torch.", "")
    _rejected(backend, cache, batch, q, k, v, exc=NotSupportedError,
              match=rf"dtype={name} \(supported: float32, bfloat16\)")


def test_k_and_v_none_on_self_attention_names_them():
    backend, cache = make()
    batch = decode_batch(cache)
    q, _, _ = qkv(2)
    _rejected(backend, cache, batch, q, None, None, match="k and v are None for self-attention layer 1")


def test_wrong_shapes_name_the_tensor_and_both_shapes():
    backend, cache = make()
    batch = decode_batch(cache)
    q, k, v = qkv(2)
    _rejected(backend, cache, batch, q, k[:, :1], v,
              match=r"k has shape \(2, 1, 8\), expected \(2, 2, 8\)")


def test_an_unclaimed_mode_is_refused_at_metadata():
    backend, cache = make()
    loc = torch.cat([cache.slots(2, 4, 6), cache.slots(0, 1, 3)])
    batch = ForwardBatch.extend([2, 0], [4, 1], [2, 2], loc, mode=ForwardMode.TARGET_VERIFY, spec_num_draft_tokens=2)
    with pytest.raises(NotSupportedError, match="forward mode target_verify is not claimed"):
        backend.init_forward_metadata(batch)


def test_workspace_limit_names_the_setting():
    backend, _ = make()
    backend.check_workspace(backend.max_workspace_bytes, "scores")
    with pytest.raises(ResourceLimitError, match=r"toy: scores needs .* GiB.*BuildContext.max_workspace_bytes"):
        backend.check_workspace(backend.max_workspace_bytes + 1, "scores")


# -- geometry validated at construction ------------------------------------------------
@pytest.mark.parametrize("kw,field", [
    (dict(num_kv_heads=0), "num_kv_heads"), (dict(head_dim=0), "head_dim"), (dict(page_size=0), "page_size"),
    (dict(num_pages=-1), "num_pages"), (dict(v_head_dim=-1), "v_head_dim"), (dict(max_requests=0), "max_requests"),
    (dict(head_dim=2.5), "head_dim"),
])
def test_cache_geometry_is_validated(kw, field):
    args = dict(num_layers=1, num_pages=4, num_kv_heads=1, head_dim=8)
    args.update(kw)
    with pytest.raises(ValueError, match=rf"PagedKVCache.{field}="):
        PagedKVCache(**args)


@pytest.mark.parametrize("kw,field", [
    (dict(page_size=0), "page_size"), (dict(num_heads=0), "num_heads"), (dict(head_dim=-5), "head_dim"),
    (dict(num_kv_heads=3, num_heads=4), "num_heads"), (dict(max_context_len=0), "max_context_len"),
    (dict(is_draft="yes"), "is_draft"),
])
def test_build_context_geometry_is_validated(kw, field):
    with pytest.raises(ValueError, match=rf"BuildContext.{field}="):
        BuildContext(config=AttentionConfig(), host=HostInfo(platform="cpu"), **kw)


def test_set_kv_and_assign_pages_check_their_bounds():
    cache = PagedKVCache(1, num_pages=2, num_kv_heads=1, head_dim=2, page_size=2, max_requests=2)
    with pytest.raises(ShapeError, match=r"loc\[0\]=-1 is out of range"):
        cache.set_kv(0, torch.tensor([-1]), torch.ones(1, 1, 2), torch.ones(1, 1, 2))
    with pytest.raises(ShapeError, match="layer_id=-1"):
        cache.get_kv(-1)
    with pytest.raises(ValueError, match="request row 2 is out of range"):
        cache.assign_pages(2, 1, [0])
    with pytest.raises(ValueError, match="page 5 is out of range"):
        cache.assign_pages(0, 2, [5])
    assert cache.req_to_token.eq(-1).all()  # nothing assigned yet: every position unassigned
    cache.assign_pages(1, 3, [1, 0])
    assert cache.slots(1, 0, 3).tolist() == [2, 3, 0]
    cache.release(1)
    assert cache.req_to_token[1].eq(-1).all()


def test_not_supported_reasons_without_ctx_uses_the_build_context():
    """A backend built for a float32 context answers for that context when asked without one."""
    from attnplug import AttentionBackend

    class Plain(AttentionBackend):
        capabilities = Capabilities(dtypes=("bfloat16",), devices=("cpu",))

        def __init__(self, ctx):
            self.ctx = ctx

    ctx = BuildContext(config=AttentionConfig(), host=HostInfo(platform="cpu"), dtype="float32")
    layer = LayerSpec(layer_id=0, num_heads=2, num_kv_heads=2, head_dim=8)
    assert "dtype=float32 (supported: bfloat16)" in Plain(ctx).not_supported_reasons(layer)
    backend, _ = make()
    backend.ctx = backend.ctx.replace(dtype="float16")
    assert any("dtype=float16" in r for r in backend.not_supported_reasons(LAYER))


@pytest.mark.parametrize("n,text", [(0, "0 B"), (512, "512 B"), (4096, "4.00 KiB"), (3 << 19, "1.50 MiB"),
                                    (5 << 30, "5.00 GiB")])
def test_format_bytes_keeps_small_sizes_readable(n, text):
    from attnplug.paged import format_bytes

    assert format_bytes(n) == text


def test_a_small_workspace_limit_is_stated_in_its_own_unit():
    backend, _ = make()
    backend.max_workspace_bytes = 4096
    with pytest.raises(ResourceLimitError, match=r"toy: scores needs 5.00 KiB, above the workspace limit of 4.00 KiB"):
        backend.check_workspace(5 * 1024, "scores")
