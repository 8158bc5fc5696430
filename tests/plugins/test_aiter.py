"""attnplug-aiter on a CPU host: descriptor, availability, layout builders, and an emulator of aiter.

aiter's kernels need an AMD MI300/MI350 GPU (gfx942/gfx950), so here the
layout is checked twice: against expectations built independently in this
file, and by ``emu_mha_batch_prefill_func`` / ``emu_paged_attention_ragged``
— an EMULATOR of the two aiter entry points the backend calls, written from
their contract (signatures as in aiter v0.1.10, so a misspelt keyword fails):
``kv_indptr``/``kv_page_indices``/``kv_last_page_lens`` over a paged cache
(``[num_blocks, block_size, kv_heads, dim]`` NHD for the decode kernel; the
3D ``[slots, kv_heads, dim]`` page-size-1 form for the prefill kernel),
``cu_seqlens_q`` for varlen queries, bottom-right-aligned causal mask,
``window_size=(left, right)``, ``logits_soft_cap``, ``sink_ptr``. The real
backend class runs against the emulator and must match
``attnplug.testing.reference``: this proves the metadata and the call
arguments, not the GPU kernels.
"""

from __future__ import annotations

import re
import sys

import pytest
import torch

import attnplug_aiter
from attnplug import AttentionConfig, BuildContext, ForwardBatch, ForwardMode, HostInfo, LayerSpec
from attnplug.errors import BackendUnavailableError, MetadataNotInitializedError, NotSupportedError, ShapeError
from attnplug.resolution import resolve, trace
from attnplug.testing.tolerances import Tolerance
from tests.forward_check import forward_and_check
from attnplug_aiter import metadata as M

import _flashinfer_family_helpers as H
import _library_contracts as C
from _problems import attend64

DIST = "attnplug-aiter"
LIB = {"amd-aiter": "0.1.10"}
MI300 = dict(gfx_arch="gfx942")


# ---------------------------------------------------------------------------
# (4) EMULATOR of aiter's kernels (the GPU kernels cannot run here), float64
# ---------------------------------------------------------------------------


CALLS: list[str] = []


@C.emulates("aiter.mha_batch_prefill_func", "amd-aiter", "0.1.10")
def emu_mha_batch_prefill_func(q, k, v, cu_seqlens_q, kv_indptr, kv_page_indices, max_seqlen_q, max_seqlen_k,
                               dropout_p=0.0, softmax_scale=None, logits_soft_cap=0.0, causal=False,
                               window_size=(-1, -1), alibi_slopes=None, deterministic=False, return_lse=False,
                               return_attn_probs=False, out=None, kv_last_page_lens=None, block_table=None,
                               seqlen_k=None, q_descale=None, k_descale=None, v_descale=None, sink_ptr=None):
    """EMULATOR of ``aiter.mha_batch_prefill_func`` for the 3D linear (page size 1) K/V form."""
    CALLS.append("mha_batch_prefill_func")
    assert k.dim() == 3 and v.dim() == 3, "the backend passes [slots, kv_heads, dim] (page size 1)"
    assert kv_last_page_lens is not None and bool((kv_last_page_lens == 1).all())
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    left, right = window_size
    res = torch.zeros(q.shape, dtype=torch.float64)
    for i in range(cu_seqlens_q.numel() - 1):
        q0, q1 = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
        k0, k1 = int(kv_indptr[i]), int(kv_indptr[i + 1])
        assert q1 - q0 <= max_seqlen_q and k1 - k0 <= max_seqlen_k
        idx = kv_page_indices[k0:k1].long()
        K, V = k[idx], v[idx]
        res[q0:q1] = attend64(q[q0:q1], K, V, scale=scale, causal=causal, left=left, right=right,
                              softcap=logits_soft_cap, sinks=sink_ptr)
    return res.to(q.dtype)


@C.emulates("aiter.paged_attention_ragged", "amd-aiter", "0.1.10")
def emu_paged_attention_ragged(out, workspace_buffer, query, key_cache, value_cache, scale, kv_indptr,
                               kv_page_indices, kv_last_page_lens, block_size, max_num_partitions, alibi_slopes,
                               kv_cache_dtype, kv_cache_layout, logits_soft_cap, k_scale, v_scale,
                               fp8_out_scale=None, partition_size=256, mtp=1):
    """EMULATOR of ``aiter.paged_attention_ragged`` (one query per row, every listed key attended)."""
    CALLS.append("paged_attention_ragged")
    assert kv_cache_layout == "NHD" and kv_cache_dtype == "auto" and block_size in (1, 16, 32)
    assert key_cache.dim() == 4 and key_cache.shape[1] == block_size
    assert query.shape[-1] in (64, 128), "aiter's ragged decode dispatches head sizes 64/128 only"
    assert query.shape[1] // key_cache.shape[2] <= 16
    for i in range(query.shape[0]):
        k0, k1 = int(kv_indptr[i]), int(kv_indptr[i + 1])
        pages = kv_page_indices[k0:k1].long()
        n = block_size * (k1 - k0 - 1) + int(kv_last_page_lens[i])
        assert n <= max_num_partitions * partition_size
        K = key_cache[pages].reshape(-1, *key_cache.shape[2:])[:n]
        V = value_cache[pages].reshape(-1, *value_cache.shape[2:])[:n]
        out[i] = attend64(query[i:i + 1], K, V, scale=scale, causal=False, softcap=logits_soft_cap)[0]
    return out


@pytest.fixture
def fake_aiter(monkeypatch):
    mod = H.fake_module("aiter", "0.1.10", mha_batch_prefill_func=emu_mha_batch_prefill_func,
                        paged_attention_ragged=emu_paged_attention_ragged)
    monkeypatch.setitem(sys.modules, "aiter", mod)
    import attnplug_aiter.backend as B

    # no distribution on disk provides this in-memory module: say amd-aiter 0.1.10 does
    monkeypatch.setattr(B, "library_provider", lambda dists: ("amd-aiter", "0.1.10") if "amd-aiter" in dists else None)
    CALLS.clear()
    return mod


def _build(pb):
    from attnplug_aiter.backend import AiterBackend

    return AiterBackend(H.context(pb, H.host("rocm", LIB, **MI300), "bfloat16"))


#: bfloat16 outputs: tighter than the suite's bfloat16 tolerance
TOL = Tolerance(atol=2e-2, rtol=2e-2)


#: the layer variants aiter runs: the family's, and sinks (with a window: the prefill kernel's sink_ptr)
VARIANTS = {**H.VARIANTS, "sinks": dict(sinks=True, sliding_window=7)}


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("case", sorted(H.MODE_CASES))
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_emulated_backend_matches_reference(fake_aiter, case, page_size, variant):
    pb = H.case_problem(case, page_size, dtype=torch.bfloat16, **VARIANTS[variant])
    forward_and_check(_build(pb), pb.cache, pb.layer, pb.batch, pb.q, pb.k, pb.v, dtype=torch.bfloat16, tol=TOL)
    mode = pb.batch.forward_mode
    expected_kernel = "mha_batch_prefill_func"
    if mode in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY) and variant != "sinks":
        expected_kernel = "paged_attention_ragged"
    assert CALLS == [expected_kernel]


def test_causal_verify_without_mask_uses_the_prefill_kernel(fake_aiter):
    pb = H.make_problem(ForwardMode.TARGET_VERIFY, [5, 9], [3, 3], page_size=4, dtype=torch.bfloat16)
    assert pb.batch.spec_custom_mask is None
    be = _build(pb)
    be.init_forward_metadata(pb.batch)
    H.check_output(pb, be.forward(pb.q, pb.k, pb.v, pb.layer, pb.batch), TOL)
    assert CALLS == ["mha_batch_prefill_func"]


@pytest.mark.parametrize("case", ["extend_prefix", "decode", "verify"])
def test_emulated_without_cache_write_leaves_the_cache_unchanged(fake_aiter, case):
    mode, prefix, ext = H.MODE_CASES[case]
    pb = H.make_problem(mode, prefix, ext, page_size=16, dtype=torch.bfloat16, tree_mask=True, sliding_window=6)
    be = _build(pb)
    be.init_forward_metadata(pb.batch)
    H.check_output(pb, be.forward(pb.q, pb.k, pb.v, pb.layer, pb.batch, save_kv_cache=False), TOL)
    assert torch.equal(pb.cache.k_buffers[0], pb.k_before) and torch.equal(pb.cache.v_buffers[0], pb.v_before)


def test_graph_capture_then_replay_reads_fixed_buffers(fake_aiter):
    pb = H.make_problem(ForwardMode.DECODE, [4, 20], [1, 1], page_size=4, dtype=torch.bfloat16, seed=1)
    be = _build(pb)
    be.init_cuda_graph_state(max_batch_size=4, max_num_tokens=4)
    be.init_forward_metadata_capture_cuda_graph(pb.batch)
    H.check_output(pb, be.forward(pb.q, pb.k, pb.v, pb.layer, pb.batch), TOL)
    pb2 = H.make_problem(ForwardMode.DECODE, [9, 2], [1, 1], page_size=4, dtype=torch.bfloat16, seed=2)
    be.kv_cache = pb2.cache
    be.init_forward_metadata_replay_cuda_graph(pb2.batch)
    rows = be._guard.require(pb2.batch).rows(None)
    assert rows.kv_indices.data_ptr() == be._graph[None]["kv_indices"].data_ptr()
    H.check_output(pb2, be.forward(pb2.q, pb2.k, pb2.v, pb2.layer, pb2.batch), TOL)
    with pytest.raises(Exception, match="decode batch size 3"):
        be.init_forward_metadata_replay_cuda_graph(
            H.make_problem(ForwardMode.DECODE, [1, 2, 3], [1, 1, 1], page_size=4).batch)


def test_forward_guards(fake_aiter):
    pb = H.make_problem(ForwardMode.EXTEND, [2], [3], page_size=4, dtype=torch.bfloat16)
    be = _build(pb)
    with pytest.raises(MetadataNotInitializedError):
        be.forward(pb.q, pb.k, pb.v, pb.layer, pb.batch)
    be.init_forward_metadata(pb.batch)
    for geometry, words in ((dict(head_dim=256), r"head_dim=256 \(supported: 64, 128\)"),
                            (dict(num_heads=32, num_kv_heads=1), r"GQA ratio num_heads/num_kv_heads=32 \(supported")):
        bad = H.make_problem(ForwardMode.EXTEND, [2], [3], page_size=4, dtype=torch.bfloat16, **geometry)
        assert any(re.search(words, r) for r in be.not_supported_reasons(bad.layer))
        bb = _build(bad)
        bb.init_forward_metadata(bad.batch)
        with pytest.raises(NotSupportedError, match=words):  # the per-layer verdict, at forward
            bb.forward(bad.q, bad.k, bad.v, bad.layer, bad.batch)
    with pytest.raises(NotSupportedError, match=r"dtype=float32 \(supported: float16, bfloat16\)"):
        be.forward(pb.q.float(), pb.k.float(), pb.v.float(), pb.layer, pb.batch)
    idle = ForwardBatch.idle()
    be.init_forward_metadata(idle)
    assert be.forward(pb.q[:0], pb.k[:0], pb.v[:0], pb.layer, idle).shape == (0, 4, 64)


def test_build_refuses_other_gfx_and_old_library(fake_aiter, monkeypatch):
    from attnplug_aiter.backend import AiterBackend

    pb = H.make_problem(ForwardMode.DECODE, [3], [1], page_size=4, dtype=torch.bfloat16)
    ctx = BuildContext(AttentionConfig(), H.host("rocm", LIB, gfx_arch="gfx90a"), dtype="bfloat16",
                       num_heads=4, num_kv_heads=2, head_dim=64, page_size=4, kv_cache=pb.cache)
    with pytest.raises(RuntimeError, match="gfx_arch='gfx90a'"):
        AiterBackend(ctx)
    # the floor is Registry.build's (the support query), checked before the factory runs
    old = H.host("rocm", {"amd-aiter": "0.1.9"}, **MI300)
    reg = H.registry(DIST)
    with pytest.raises(NotSupportedError, match=r"amd-aiter >= 0.1.10, found 0.1.9"):
        reg.build("aiter", ctx.replace(host=old, device="cuda"))


# ---------------------------------------------------------------------------
# (3) builders against independent expectations
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("page_size", [1, 16])
def test_token_rows_match_independent_walk(page_size):
    pb = H.make_problem(ForwardMode.EXTEND, [0, 5, 17, 3, 16], [4, 1, 6, 9, 16], page_size=page_size, seed=7)
    b, r2t = pb.batch, pb.cache.req_to_token
    lay = M.build_layout(b, r2t)
    rows = lay.rows()
    exp_indices, exp_indptr = [], [0]
    for r, s in zip(b.req_pool_indices.tolist(), b.seq_lens_cpu):
        exp_indices += [int(r2t[r, j]) for j in range(s)]
        exp_indptr.append(exp_indptr[-1] + s)
    assert rows.kv_indices.tolist() == exp_indices and rows.kv_indptr.tolist() == exp_indptr
    assert rows.kv_last_page_lens.tolist() == [1] * 5 and rows.kv_indices.dtype == torch.int32
    assert lay.cu_seqlens_q.tolist() == [0, 4, 5, 11, 20, 36] and lay.max_q_len == 16


def test_decode_window_trims_rows_and_verify_rows_follow_the_tree():
    r2t = torch.arange(40).reshape(2, 20) + 100
    batch = ForwardBatch.decode([1, 0], [10, 3], [129, 102])
    lay = M.build_layout(batch, r2t)
    w = lay.rows(window=4)  # the query at position 9 sees 5..9; at position 2 sees 0..2
    assert w.kv_indices.tolist() == [125, 126, 127, 128, 129, 100, 101, 102] and w.kv_lens == (5, 3)
    tree = torch.tensor([[[1, 0, 0], [1, 1, 0], [1, 0, 1]]], dtype=torch.bool)
    vb = ForwardBatch.extend([0], [2], [3], [102, 103, 104], mode=ForwardMode.TARGET_VERIFY,
                             spec_num_draft_tokens=3, spec_custom_mask=tree)
    v = M.build_layout(vb, r2t)
    assert v.kind == "verify" and v.query_indptr().tolist() == [0, 1, 2, 3]
    rows = v.rows()
    assert rows.kv_indptr.tolist() == [0, 3, 7, 11]
    assert rows.kv_indices.tolist() == [100, 101, 102, 100, 101, 102, 103, 100, 101, 102, 104]
    rw = v.rows(window=1)  # positions 2,3,4 see j >= p-1
    assert rw.kv_indices.tolist() == [101, 102, 102, 103, 104]


def test_guards_and_versions():
    assert M.parse_version("0.1.10.post1+rocm7.0") > M.parse_version("0.1.10") > M.parse_version("0.1.9.post1")
    assert M.parse_version("0.1.10+rocm7.0") == M.parse_version("0.1.10")
    # the floor is Registry.build's (the support query), before the factory imports aiter
    for version, refused in (("0.1.12", False), ("0.1.9", True)):
        host = HostInfo(platform="rocm", gfx_arch="gfx942", libraries={"amd-aiter": version})
        problems = H.registry(DIST).build_problems(H.registry(DIST).get("aiter"),
                                                  BuildContext(config=AttentionConfig(), host=host, device="cuda",
                                                               dtype="bfloat16", head_dim=128))
        assert any("found 0.1.9" in p for p in problems) is refused, problems
    assert M.window_size(LayerSpec(0, 2, 1, 64, sliding_window=8)) == (8, 0)
    assert M.window_size(LayerSpec(0, 2, 1, 64)) == (-1, -1)
    assert M.max_num_partitions(4096) == 16 and M.max_num_partitions(4097) == 17
    with pytest.raises(ShapeError, match="idle"):
        M.build_layout(ForwardBatch.idle(), torch.zeros(1, 1, dtype=torch.int64))


# ---------------------------------------------------------------------------
# (1)(2) registration, availability, light import
# ---------------------------------------------------------------------------


def test_registers_through_entry_point_and_is_unavailable_on_this_cpu_host():
    H.check_registered_and_unavailable(DIST, "aiter", library="amd-aiter", floor="0.1.10",
                                       capabilities=attnplug_aiter.CAPABILITIES,
                                       reasons=("'amd-aiter' is not installed", "gfx942/gfx950"), build_match="aiter")


@pytest.mark.parametrize("host_kw, available", [
    (dict(platform="rocm", gfx_arch="gfx942", libraries=LIB), True),
    (dict(platform="rocm", gfx_arch="gfx950", libraries=LIB), True),
    (dict(platform="rocm", gfx_arch="gfx90a", libraries=LIB), False),
    (dict(platform="rocm", gfx_arch=None, libraries=LIB), False),
    (dict(platform="rocm", gfx_arch="gfx942", libraries={}), False),
    (dict(platform="cuda", compute_capability=(9, 0), libraries=LIB), False),
    (dict(platform="cpu", libraries=LIB), False),
])
def test_available_exactly_on_mi300_mi350_with_the_library(host_kw, available):
    assert bool(H.registry(DIST).availability("aiter", HostInfo(**host_kw))) is available


def test_descriptor_imports_neither_torch_nor_aiter():
    H.assert_descriptor_light(DIST, "attnplug_aiter", "aiter")


def test_priority_and_floor():
    d = H.registry(DIST).get("aiter")
    assert d.priority_on(HostInfo(platform="rocm", gfx_arch="gfx942")) == 50
    assert d.priority_on(HostInfo(platform="cuda")) is None
    old = HostInfo(platform="rocm", gfx_arch="gfx942", libraries={"amd-aiter": "0.1.5.post4"})
    assert "amd-aiter >= 0.1.10, found 0.1.5.post4" in d.library_floor_problem(old)


def test_the_unrelated_pypi_aiter_distribution_never_counts():
    """PyPI's ``aiter`` is an async-iterator package: a host with only it has no kernel library."""
    reg = H.registry(DIST)
    wrong = HostInfo(platform="rocm", gfx_arch="gfx942", libraries={"aiter": "0.1.10"})
    reasons = reg.availability("aiter", wrong).reasons
    assert any("'amd-aiter' is not installed" in r for r in reasons)
    right = HostInfo(platform="rocm", gfx_arch="gfx942", libraries={"amd-aiter": "0.1.10"})
    assert reg.availability("aiter", right)


def test_kernels_extra_names_amd_aiter_never_aiter():
    import tomllib
    from pathlib import Path

    meta = tomllib.loads((Path(__file__).parents[2] / "plugins/aiter/pyproject.toml").read_text())
    extra = meta["project"]["optional-dependencies"]["kernels"]
    assert extra == ["amd-aiter>=0.1.10"]


def test_build_refuses_a_module_aiter_from_the_wrong_distribution(monkeypatch):
    """Mocked: which distribution owns the module (no aiter of either kind is installed here)."""
    import attnplug_aiter.backend as B

    monkeypatch.setattr(B, "library_provider", lambda dists: ("aiter", "0.1.10") if "aiter" in dists else None)
    with pytest.raises(BackendUnavailableError, match="unrelated async-iterator package"):
        B._import_aiter()


# ---------------------------------------------------------------------------
# (5) the gpt-oss family rule: aiter on ROCm
# ---------------------------------------------------------------------------


def test_gpt_oss_picks_aiter_exactly_on_rocm():
    reg = H.registry(DIST, "attnplug-torch-native")
    rocm = HostInfo(platform="rocm", gfx_arch="gfx942", libraries=LIB)
    res = trace(AttentionConfig(), arch="GptOssForCausalLM", host=rocm, registry=reg)
    assert res.ok, res.error
    assert res.pair == ("aiter", "aiter")
    assert any(r.source == DIST and r.declared.get("attention_backend") == "aiter" for r in res.records)
    for other in (HostInfo(platform="cuda", compute_capability=(9, 0), libraries=LIB), HostInfo(platform="cpu")):
        r = resolve(AttentionConfig(), arch="GptOssForCausalLM", host=other, registry=reg)
        assert r.pair == ("torch_native", "torch_native")
        assert not [x for x in r.records if x.source == DIST]
    # another architecture on the same ROCm host: no override, the platform default fills aiter anyway
    plain = trace(AttentionConfig(), arch="LlamaForCausalLM", host=rocm, registry=reg)
    assert plain.pair == ("aiter", "aiter") and not [x for x in plain.records if x.source == DIST]
    # the user's choice is never overridden
    pinned = resolve(AttentionConfig(attention_backend="torch_native"), arch="GptOssForCausalLM", host=rocm,
                     registry=reg)
    assert pinned.pair == ("torch_native", "torch_native")
