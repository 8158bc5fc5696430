"""attnplug-intel-amx: descriptor, availability (this machine has AMX but no sgl-kernel CPU build), op arguments,
and EMULATORS of sgl-kernel's CPU ops.

``decode_attention_cpu`` / ``extend_attention_cpu`` need the CPU build of
sgl-kernel, which is not installed here, so ``emulate_decode`` and
``emulate_extend`` stand in for them, written from the ops' documented
contract (slot buffers read through ``req_to_token`` rows
``req_pool_indices``; decode writes ``key``/``value`` at ``loc`` then attends
to ``seq_lens[b]`` keys; extend reads the prefix from the buffers and the new
tokens from ``k_extend`` rows ``extend_start_loc[b] …``, causal among them;
``logit_cap``; ``sliding_window_size`` = visible keys including the query's
own, 0 for none; per-head ``sinks``). The real backend class runs with the
emulators as its ops and must match ``attnplug.testing.reference``: this
proves the arguments, not the AMX kernels.
"""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch

import attnplug_intel_amx
import _fa3_family_helpers as H
from _problems import attend64
from attnplug import AttentionConfig, ForwardMode, LayerSpec
from attnplug.errors import BackendUnavailableError, NotSupportedError
from attnplug.host import detect_host
from attnplug.resolution import resolve
from attnplug_intel_amx import metadata as M
from attnplug_intel_amx.backend import IntelAmxBackend, Ops, load_ops

DIST = "attnplug-intel-amx"
SGL = {"sgl_kernel": "0.3.16"}


# -- (4) the emulators ----------------------------------------------------------------
def _window_left(sliding_window_size):
    return sliding_window_size - 1 if sliding_window_size > 0 else -1


def _check_common(query, sm_scale, logit_cap, k_scale, v_scale, sinks):
    assert isinstance(sm_scale, float) and isinstance(logit_cap, float)
    assert isinstance(k_scale, float) and isinstance(v_scale, float)
    assert (k_scale, v_scale) == (1.0, 1.0), "a 16-bit cache is read as stored: its scales are 1.0"
    if sinks is not None:  # the ops read sinks through data_ptr<scalar_t>(): the query's dtype
        assert sinks.dtype == query.dtype, f"sinks must be in the query's dtype {query.dtype}, got {sinks.dtype}"
        assert sinks.numel() == query.shape[1] and sinks.is_contiguous()


def emulate_decode(query, k_cache, v_cache, output, key, value, loc, attn_logits, req_to_token, req_pool_indices,
                   seq_lens, sm_scale, logit_cap, k_scale=1.0, v_scale=1.0, is_cross_attention=False,
                   sliding_window_size=0, encoder_lens=None, sinks=None):
    """EMULATOR of ``torch.ops.sgl_kernel.decode_attention_cpu`` (not installed here), float64."""
    assert req_pool_indices.dtype == torch.int64 and seq_lens.dtype == torch.int64
    B, Hq = query.shape[:2]
    assert tuple(attn_logits.shape) == (B, Hq, M.NUM_KV_SPLITS, v_cache.shape[-1] + 1)
    assert attn_logits.dtype == torch.float32 and not is_cross_attention and encoder_lens is None
    _check_common(query, sm_scale, logit_cap, k_scale, v_scale, sinks)
    k_cache[loc] = key
    v_cache[loc] = value
    for b in range(B):
        slots = req_to_token[int(req_pool_indices[b]), :int(seq_lens[b])].long()
        o = attend64(query[b:b + 1], k_cache[slots], v_cache[slots], scale=sm_scale, causal=True,
                       left=_window_left(sliding_window_size), softcap=logit_cap, sinks=sinks)
        output[b] = o[0].to(output.dtype)


def emulate_extend(q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, req_to_token, req_pool_indices,
                   seq_lens, extend_seq_lens, extend_start_loc, max_len_extend, sm_scale, logit_cap, k_scale=1.0,
                   v_scale=1.0, is_cross_attention=False, sliding_window_size=0, encoder_lens=None, sinks=None,
                   tree_mask=None, is_causal=True):
    """EMULATOR of ``torch.ops.sgl_kernel.extend_attention_cpu`` (not installed here), float64."""
    assert req_pool_indices.dtype == torch.int64 and seq_lens.dtype == torch.int64
    assert extend_seq_lens.dtype == req_to_token.dtype and extend_start_loc.dtype == req_to_token.dtype
    assert tree_mask is None and is_causal is True, "an extend is causal among its new tokens, with no tree"
    _check_common(q_extend, sm_scale, logit_cap, k_scale, v_scale, sinks)
    for b in range(seq_lens.numel()):
        e, s0 = int(extend_seq_lens[b]), int(extend_start_loc[b])
        assert e <= max_len_extend
        pre = int(seq_lens[b]) - e
        slots = req_to_token[int(req_pool_indices[b]), :pre].long()
        K = torch.cat([k_buffer[slots], k_extend[s0:s0 + e]])
        V = torch.cat([v_buffer[slots], v_extend[s0:s0 + e]])
        o = attend64(q_extend[s0:s0 + e], K, V, scale=sm_scale, causal=True,
                       left=_window_left(sliding_window_size), softcap=logit_cap, sinks=sinks)
        o_extend[s0:s0 + e] = o.to(o_extend.dtype)


#: the recorded schemas of sgl-kernel's CPU ops, per build generation (tests/contracts/sgl_kernel_cpu_schemas.json)
SCHEMAS = json.loads((Path(__file__).resolve().parents[1] / "contracts" / "sgl_kernel_cpu_schemas.json")
                     .read_text())["schemas"]
#: spellings in the registrations that the emulators take under SGLang's names
_SPELLINGS = {"v_cahce": "v_cache"}


def _type_ok(value, type_text):
    if type_text == "Tensor":
        return isinstance(value, torch.Tensor)
    if type_text == "Optional[Tensor]":
        return value is None or isinstance(value, torch.Tensor)
    if type_text == "float":
        return isinstance(value, (float, int)) and not isinstance(value, bool)
    if type_text == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if type_text == "bool":
        return isinstance(value, bool)
    raise AssertionError(f"the mock knows no schema type {type_text}")


class MockSglKernelOp:
    """MOCK of a ``torch.ops.sgl_kernel.<op>`` packet (the CPU build is not installed here): carries a
    recorded schema as a real ``torch._C.FunctionSchema`` (``.default._schema``), binds every call to it as
    the dispatcher would (positional in schema order, then keywords by name, defaults, type checks:
    ``Tensor``, ``Tensor?``, ``float``, ``int``, ``bool``), records the bound call, then runs the emulator."""

    def __init__(self, schema, emulator):
        self.default = types.SimpleNamespace(_schema=torch._C.parse_schema(schema))
        self.emulator = emulator
        self.calls = []

    def __call__(self, *args, **kwargs):
        params = list(self.default._schema.arguments)
        name = self.default._schema.name
        assert len(args) <= len(params), f"{name}: {len(args)} positional arguments, the schema has {len(params)}"
        bound = {}
        for p, value in zip(params, args):
            bound[p.name] = value
        for key, value in kwargs.items():
            assert key in {p.name for p in params}, f"{name}: no argument named {key!r}"
            assert key not in bound, f"{name}: {key!r} given twice"
            bound[key] = value
        for p in params:
            if p.name not in bound:
                assert p.has_default_value(), f"{name}: missing argument {p.name!r}"
                bound[p.name] = p.default_value
            assert _type_ok(bound[p.name], str(p.type)), \
                f"{name}: argument {p.name!r} must be {p.type}, got {type(bound[p.name]).__name__}"
        self.calls.append(bound)
        return self.emulator(**{_SPELLINGS.get(k, k): v for k, v in bound.items()})


def mock_ops(generation="window_sinks"):
    """``Ops`` bound to MOCK ops carrying the recorded schemas of one build generation."""
    sch = SCHEMAS[generation]
    return Ops.from_ops(MockSglKernelOp(sch["decode_attention_cpu"], emulate_decode),
                        MockSglKernelOp(sch["extend_attention_cpu"], emulate_extend))


EMULATED = mock_ops("window_sinks")
LEGACY = mock_ops("legacy")


def build(p, ops=None):
    ctx = H.context(p, H.cpu_host(True, **SGL), v_head_dim=p.layer.v_head_dim)
    return IntelAmxBackend(ctx, ops=ops or EMULATED)


def run(p, save=True, ops=None):
    return H.forward(build(p, ops), p, save)


def problem(**kw):
    """``H.make_problem`` with head dims the extend op accepts (multiples of 32)."""
    kw.setdefault("head_dim", 32)
    return H.make_problem(**kw)


# -- (1) registration and availability ------------------------------------------------
def test_this_machine_reports_the_missing_library():
    reg = H.registry(DIST)
    desc = reg.get("intel_amx")
    assert desc.distribution == DIST and desc.library == "sgl-kernel"
    avail = reg.availability("intel_amx")
    assert not avail and any("'sgl-kernel'" in r and "not installed" in r for r in avail.reasons), avail.reasons
    if detect_host().has_amx:  # this machine: AMX present, so the library is the only reason
        assert not any("AMX" in r for r in avail.reasons), avail.reasons


@pytest.mark.parametrize("host, ok", [
    (H.cpu_host(True, **SGL), True),
    (H.cpu_host(False, **SGL), False),
    (H.cpu_host(True), False),
    (H.cuda_host(90, **SGL), False),
])
def test_available_exactly_on_amx_cpus_with_the_library(host, ok):
    avail = H.registry(DIST).availability("intel_amx", host)
    assert bool(avail) is ok, avail.reasons


def test_missing_flag_is_named():
    host = H.cpu_host(False, **SGL)
    assert any("amx_bf16" in r and "amx_tile" in r for r in attnplug_intel_amx.probe(host))


def test_descriptor_imports_neither_torch_nor_sgl_kernel():
    mods = H.imports_after("attnplug_intel_amx")
    assert not mods & {"torch", "sgl_kernel"}, mods


def test_loading_the_ops_here_fails_in_words():
    with pytest.raises(BackendUnavailableError, match="sgl_kernel"):
        load_ops()


# -- (3) op arguments ---------------------------------------------------------------------
@pytest.mark.parametrize("ps", [1, 16])
def test_extend_arguments(ps):
    p = problem(prefix=(0, 21, 17, 5), ext=(7, 3, 1, 30), page_size=ps)
    meta = M.build_metadata(p.batch, p.cache.req_to_token)
    assert meta.req_pool_indices.tolist() == p.rows and meta.req_pool_indices.dtype == torch.int64
    assert meta.seq_lens.tolist() == p.seq and meta.seq_lens.dtype == torch.int64
    assert meta.extend_seq_lens.tolist() == [7, 3, 1, 30] and meta.extend_seq_lens.dtype == p.cache.req_to_token.dtype
    assert meta.extend_start_loc.tolist() == [0, 7, 10, 11] and meta.max_len_extend == 30
    assert tuple(meta.attn_logits(4, 16).shape) == (4, 4, 8, 17) and meta.attn_logits(4, 16) is meta.attn_logits(4, 16)


def test_decode_arguments_and_window():
    p = problem(mode=ForwardMode.DECODE, prefix=(15, 16, 40), ext=(1, 1, 1), page_size=16)
    meta = M.build_metadata(p.batch, p.cache.req_to_token)
    assert meta.extend_seq_lens.tolist() == [1, 1, 1] and meta.extend_start_loc.tolist() == [0, 1, 2]
    assert meta.seq_lens.tolist() == [16, 17, 41]
    assert (M.window_arg(None), M.window_arg(0), M.window_arg(6)) == (0, 1, 7)


# -- (4) backend + emulated ops vs the float64 reference -------------------------------------------
@pytest.mark.parametrize("ps", [1, 16])
@pytest.mark.parametrize("features", [{}, {"window": 6}, {"cap": 2.0, "sinks": True}, {"v_head_dim": 64}])
def test_extend_with_prefix(ps, features):
    p = problem(prefix=(0, 21, 17, 5), ext=(7, 3, 1, 30), page_size=ps, **features)
    H.assert_close(run(p), p.expected)


@pytest.mark.parametrize("ps", [1, 16])
def test_decode(ps):
    p = problem(mode=ForwardMode.DECODE, prefix=(15, 16, 40, 0), ext=(1, 1, 1, 1), page_size=ps,
                       window=5, sinks=True, cap=3.0)
    H.assert_close(run(p), p.expected)


def test_mixed_and_bfloat16():
    p = problem(mode=ForwardMode.MIXED, prefix=(9, 0), ext=(2, 5), page_size=16, dtype=torch.bfloat16)
    H.assert_close(run(p), p.expected, torch.bfloat16)


@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE])
@pytest.mark.parametrize("save", [True, False])
def test_kv_cache_write(mode, save):
    ext = (4, 9) if mode is ForwardMode.EXTEND else (1, 1)
    p = problem(mode=mode, prefix=(3, 12), ext=ext, page_size=16)
    H.assert_close(run(p, save=save), p.expected)
    H.assert_written_at_loc_only(p, save)


def test_legacy_ops_serve_plain_layers_and_refuse_window_and_sinks():
    p = problem(prefix=(3, 12), ext=(4, 9), page_size=16, cap=2.0)
    H.assert_close(run(p, ops=LEGACY), p.expected)
    w = problem(prefix=(3, 12), ext=(4, 9), page_size=16, window=4, sinks=True)
    b = build(w, LEGACY)
    reasons = b.not_supported_reasons(w.layer)
    assert any("sliding_window=4" in r and "newer" in r for r in reasons) and any("sinks" in r for r in reasons)
    b.init_forward_metadata(w.batch)
    with pytest.raises(NotSupportedError, match="sliding_window"):
        b.forward_extend(w.q, w.k, w.v, w.layer, w.batch)


# -- (5) overrides ------------------------------------------------------------------------------
@pytest.mark.parametrize("host, want", [
    (H.cpu_host(True, **SGL), ("intel_amx", "intel_amx")),
    (H.cpu_host(False, **SGL), ("torch_native", "torch_native")),
    (H.cpu_host(True), ("torch_native", "torch_native")),  # preferred but unavailable: compat fallback
])
def test_gpt_oss_override(host, want):
    res = resolve(AttentionConfig(), arch="GptOssForCausalLM", host=host, registry=H.registry(DIST, host))
    assert res.pair == want


def test_gpt_oss_override_not_on_gpu_hosts():
    assert attnplug_intel_amx.gpt_oss_on_amx(H.cuda_host(90, **SGL), AttentionConfig()) == {}


# -- (6) guards ---------------------------------------------------------------------------------
def test_a_16_bit_cache_in_another_dtype_is_refused_by_the_declared_capability():
    """The ops take q and the cache in one dtype (``kv_cache_dtype_follows_model``): an AMX host resolves
    a bf16 model over an fp16 cache to torch_native, and building intel_amx for it is refused."""
    p = problem(prefix=(0,), ext=(3,), page_size=16)
    H.check_kv_follows_model(DIST, "intel_amx", H.cpu_host(True, **SGL), build(p))


def test_guards():
    p = problem(prefix=(0, 4), ext=(3, 2), page_size=16)
    b = build(p)
    ctx = b.ctx.replace(dtype="bfloat16", kv_cache_dtype="float16", kv_cache=None)
    assert H.KV_FOLLOWS_MODEL in b.not_supported_reasons(LayerSpec(0, 4, 2, 16), ctx)
    assert any("cross-attention" in r for r in b.not_supported_reasons(LayerSpec(0, 4, 2, 16, is_cross_attention=True)))
    with pytest.raises(Exception, match="init_forward_metadata"):
        b.forward_extend(p.q, p.k, p.v, p.layer, p.batch)
