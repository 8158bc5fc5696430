"""attnplug-flashinfer on a CPU host: descriptor, availability, layout builders, and an emulator of FlashInfer.

FlashInfer's kernels need an SM80+ NVIDIA GPU, so here the layout is checked
twice: against expectations built independently in this file, and by the
``Emu*Wrapper`` classes below — an EMULATOR of FlashInfer's wrappers written
from its documented contract (CSR page table ``paged_kv_indptr`` /
``paged_kv_indices`` / ``paged_kv_last_page_len`` over an NHD ``(k, v)``
cache of ``[num_pages, page_size, kv_heads, dim]``, ``qo_indptr`` for varlen
queries, bottom-right-aligned causal mask, ``window_left``,
``logits_soft_cap``, ``sm_scale``, a flat row-major custom mask per request;
``plan`` signatures as in
flashinfer-python 0.5.0, so a misspelt keyword fails). The real backend class
runs against the emulator and must match ``attnplug.testing.reference``: this
proves the metadata and the call arguments, not the GPU kernel.
"""

from __future__ import annotations

import sys

import pytest
import torch

import attnplug_flashinfer
from attnplug import AttentionConfig, BuildContext, ForwardBatch, ForwardMode, LayerSpec
from attnplug.errors import MetadataNotInitializedError, NotSupportedError, ShapeError
from attnplug.resolution import resolve, trace
from attnplug.testing.tolerances import Tolerance
from tests.forward_check import forward_and_check
from attnplug_flashinfer import metadata as M

import _flashinfer_family_helpers as H
import _library_contracts as C
from _problems import attend64

DIST = "attnplug-flashinfer"
LIB = {"flashinfer-python": "0.5.2"}
SM90 = dict(compute_capability=(9, 0))


# ---------------------------------------------------------------------------
# (4) EMULATOR of FlashInfer's wrappers (the GPU kernels cannot run here), float64
# ---------------------------------------------------------------------------




def _scaled(plan, q_scale, k_scale):
    """``run``'s fp8 calibration scales as FlashInfer applies them: ``sm_scale *= q_scale``, ``sm_scale *=
    k_scale`` (so the soft-cap sees dequantized logits); ``v_scale`` multiplies the output."""
    for s in (q_scale, k_scale):
        assert s is None or isinstance(s, float), f"scales are Optional[float], got {type(s).__name__}"
    return {**plan, "scale": plan["scale"] * (1.0 if q_scale is None else q_scale) * (1.0 if k_scale is None else k_scale)}


class _EmuBase:
    def __init__(self, use_cuda_graph=False, bufs=None):
        self.use_cuda_graph = use_cuda_graph
        self.bufs = {k: v for k, v in (bufs or {}).items() if v is not None}
        self.plan_calls = 0
        self.p = None

    def _store(self, **arrays):
        """Like FlashInfer: under CUDA graphs plan() copies into the user buffers and run() reads them."""
        self.plan_calls += 1
        out = {}
        for name, t in arrays.items():
            if t is None:
                out[name] = None
            elif self.use_cuda_graph and name in self.bufs:
                buf = self.bufs[name]
                buf[: t.numel()].copy_(t.to(buf.dtype))
                out[name] = buf
            else:
                out[name] = t.clone()
        return out

    def _paged_rows(self, cache, i):
        k_cache, v_cache = cache
        p = self.p
        ps = k_cache.shape[1]
        lo, hi = int(p["indptr"][i]), int(p["indptr"][i + 1])
        pages = p["indices"][lo:hi].long()
        assert hi > lo, "FlashInfer needs at least one page per request"
        last = int(p["last"][i])
        assert 1 <= last <= ps, f"last_page_len {last} outside 1..{ps}"
        kv_len = ps * (hi - lo - 1) + last
        K = k_cache[pages].reshape(-1, *k_cache.shape[2:])[:kv_len]
        V = v_cache[pages].reshape(-1, *v_cache.shape[2:])[:kv_len]
        return K, V


class EmuDecodeWrapper(_EmuBase):
    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, use_tensor_cores=False,
                 paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None, paged_kv_last_page_len_buffer=None,
                 backend="auto", jit_args=None):
        assert kv_layout == "NHD"
        self.contract_owner = {k: v for k, v in locals().items() if k not in ("self", "__class__")}
        super().__init__(use_cuda_graph, {"indptr": paged_kv_indptr_buffer, "indices": paged_kv_indices_buffer,
                                          "last": paged_kv_last_page_len_buffer})

    @C.emulates("flashinfer.BatchDecodeWithPagedKVCacheWrapper.plan", "flashinfer-python", "0.5.0")
    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
             pos_encoding_mode="NONE", window_left=-1, logits_soft_cap=None, q_data_type="float16",
             kv_data_type=None, data_type=None, sm_scale=None, rope_scale=None, rope_theta=None, non_blocking=True,
             block_tables=None, seq_lens=None, fixed_split_size=None, disable_split_kv=False):
        for t in (indptr, indices, last_page_len):
            assert t.dtype == torch.int32
        self.p = self._store(indptr=indptr, indices=indices, last=last_page_len)
        self.p.update(bs=indptr.numel() - 1, window=window_left, cap=logits_soft_cap or 0.0, ps=page_size,
                      scale=sm_scale if sm_scale is not None else head_dim ** -0.5, heads=(num_qo_heads, num_kv_heads))

    @C.emulates("flashinfer.BatchDecodeWithPagedKVCacheWrapper.run", "flashinfer-python", "0.5.0")
    def run(self, q, paged_kv_cache, *args, q_scale=None, k_scale=None, v_scale=None, **kw):
        p = _scaled(self.p, q_scale, k_scale)
        assert paged_kv_cache[0].shape[1] == p["ps"]
        assert q.shape[0] == p["bs"] and q.shape[1] == p["heads"][0]
        out = torch.zeros(q.shape, dtype=torch.float64)
        for i in range(p["bs"]):
            K, V = self._paged_rows(paged_kv_cache, i)
            out[i:i + 1] = attend64(q[i:i + 1], K, V, scale=p["scale"], causal=True, left=p["window"], softcap=p["cap"])
        return (out * (1.0 if v_scale is None else v_scale)).to(q.dtype)


class EmuPagedPrefillWrapper(_EmuBase):
    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, qo_indptr_buf=None,
                 paged_kv_indptr_buf=None, paged_kv_indices_buf=None, paged_kv_last_page_len_buf=None,
                 custom_mask_buf=None, mask_indptr_buf=None, backend="auto", jit_args=None):
        assert kv_layout == "NHD"
        self.contract_owner = {k: v for k, v in locals().items() if k not in ("self", "__class__")}
        super().__init__(use_cuda_graph, {"qo": qo_indptr_buf, "indptr": paged_kv_indptr_buf,
                                          "indices": paged_kv_indices_buf, "last": paged_kv_last_page_len_buf})

    @C.emulates("flashinfer.BatchPrefillWithPagedKVCacheWrapper.plan", "flashinfer-python", "0.5.0")
    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads, num_kv_heads,
             head_dim_qk, page_size, head_dim_vo=None, custom_mask=None, packed_custom_mask=None, causal=False,
             pos_encoding_mode="NONE", use_fp16_qk_reduction=False, sm_scale=None, window_left=-1,
             logits_soft_cap=None, rope_scale=None, rope_theta=None, q_data_type="float16", kv_data_type=None,
             non_blocking=True, prefix_len_ptr=None, token_pos_in_items_ptr=None, token_pos_in_items_len=0,
             max_item_len_ptr=None, seq_lens=None, seq_lens_q=None, block_tables=None, max_token_per_sequence=None,
             max_sequence_kv=None, fixed_split_size=None, disable_split_kv=False):
        self.p = self._store(qo=qo_indptr, indptr=paged_kv_indptr, indices=paged_kv_indices,
                             last=paged_kv_last_page_len)
        if custom_mask is not None:
            assert custom_mask.dtype == torch.bool and not causal
        mask = None if custom_mask is None else custom_mask.clone()
        self.p.update(bs=qo_indptr.numel() - 1, causal=causal, mask=mask,
                      window=window_left, cap=logits_soft_cap or 0.0, ps=page_size,
                      scale=sm_scale if sm_scale is not None else head_dim_qk ** -0.5)

    @C.emulates("flashinfer.BatchPrefillWithPagedKVCacheWrapper.run", "flashinfer-python", "0.5.0")
    def run(self, q, paged_kv_cache, *args, q_scale=None, k_scale=None, v_scale=None, **kw):
        p = _scaled(self.p, q_scale, k_scale)
        out = torch.zeros(q.shape, dtype=torch.float64)
        moff = 0
        for i in range(p["bs"]):
            q0, q1 = int(p["qo"][i]), int(p["qo"][i + 1])
            K, V = self._paged_rows(paged_kv_cache, i)
            L = K.shape[0]
            mask = None
            if p["mask"] is not None:
                mask = p["mask"][moff:moff + (q1 - q0) * L].reshape(q1 - q0, L)
                moff += (q1 - q0) * L
            out[q0:q1] = attend64(q[q0:q1], K, V, scale=p["scale"], causal=p["causal"], left=p["window"],
                                  softcap=p["cap"], mask=mask)
        if p["mask"] is not None:
            assert moff == p["mask"].numel(), "custom mask length != sum(qo_len * kv_len)"
        return (out * (1.0 if v_scale is None else v_scale)).to(q.dtype)


@pytest.fixture
def fake_flashinfer(monkeypatch):
    mod = H.fake_module("flashinfer", "0.5.0", BatchDecodeWithPagedKVCacheWrapper=EmuDecodeWrapper,
                        BatchPrefillWithPagedKVCacheWrapper=EmuPagedPrefillWrapper)
    monkeypatch.setitem(sys.modules, "flashinfer", mod)
    import importlib.metadata as im

    real = im.version
    monkeypatch.setattr(im, "version", lambda n: (_ for _ in ()).throw(im.PackageNotFoundError(n))
                        if n == "flashinfer-python" else real(n))
    return mod


def _build(pb, fake=None, deterministic=False, **kw):
    """A FlashInferBackend over ``pb`` on an SM90 host (``fake``: the emulated module, installed by its fixture;
    ``kw``: more ``BuildContext`` fields)."""
    from attnplug_flashinfer.backend import FlashInferBackend

    return FlashInferBackend(H.context(pb, H.host("cuda", LIB, **SM90), "float16",
                                       AttentionConfig(deterministic=deterministic), **kw))


#: float16 outputs: tighter than the suite's float16 tolerance
TOL = Tolerance(atol=3e-3, rtol=3e-3)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("case", sorted(H.MODE_CASES))
@pytest.mark.parametrize("variant", list(H.VARIANTS))
def test_emulated_backend_matches_reference(fake_flashinfer, case, page_size, variant):
    pb = H.case_problem(case, page_size, **H.VARIANTS[variant])
    forward_and_check(_build(pb, fake_flashinfer), pb.cache, pb.layer, pb.batch, pb.q, pb.k, pb.v, dtype=torch.float16,
                      tol=TOL)


@pytest.mark.parametrize("case", ["extend_prefix", "decode", "verify"])
def test_emulated_without_cache_write_leaves_the_cache_unchanged(fake_flashinfer, case):
    mode, prefix, ext = H.MODE_CASES[case]
    pb = H.make_problem(mode, prefix, ext, page_size=16, tree_mask=True, sliding_window=6, seed=3)
    be = _build(pb, fake_flashinfer)
    be.init_forward_metadata(pb.batch)
    out = be.forward(pb.q, pb.k, pb.v, pb.layer, pb.batch, save_kv_cache=False)
    H.check_output(pb, out, TOL)
    assert torch.equal(pb.cache.k_buffers[0], pb.k_before) and torch.equal(pb.cache.v_buffers[0], pb.v_before)


def test_metadata_is_planned_once_per_forward_and_shared_by_layers(fake_flashinfer):
    pb = H.make_problem(ForwardMode.EXTEND, [3, 9], [5, 2], page_size=4)
    be = _build(pb, fake_flashinfer)
    be.init_forward_metadata(pb.batch)
    for _ in range(3):
        out = be.forward(pb.q, pb.k, pb.v, pb.layer, pb.batch)
    H.check_output(pb, out, TOL)
    (wrapper,) = be._eager.values()
    assert wrapper.plan_calls == 1


@pytest.mark.parametrize("mode, qlens", [(ForwardMode.DECODE, [1, 1]), (ForwardMode.EXTEND, [2, 3])])
@pytest.mark.parametrize("save", [True, False])
def test_deterministic_plans_disable_split_kv_on_the_fa2_path(fake_flashinfer, monkeypatch, mode, qlens, save):
    """Determinism: every plan gets disable_split_kv=True (CUDA-graph safe, unlike fixed_split_size) and
    the prefill wrappers are pinned to backend="fa2" (on SM90 "auto" would pick FA3, which ignores it)."""
    seen, built = [], []
    for cls in (EmuDecodeWrapper, EmuPagedPrefillWrapper):
        orig_plan, orig_init = cls.plan, cls.__init__
        monkeypatch.setattr(cls, "plan", lambda self, *a, _o=orig_plan, **kw: (seen.append(kw), _o(self, *a, **kw))[1])
        monkeypatch.setattr(cls, "__init__", lambda self, *a, _o=orig_init, _c=cls, **kw:
                            (built.append((_c, kw)), _o(self, *a, **kw))[1])
    pb = H.make_problem(mode, [4, 8], qlens, page_size=4)
    be = _build(pb, fake_flashinfer, deterministic=True)
    be.init_forward_metadata(pb.batch)
    H.check_output(pb, be.forward(pb.q, pb.k, pb.v, pb.layer, pb.batch, save_kv_cache=save), TOL)
    assert seen and all(kw.get("disable_split_kv") is True and "fixed_split_size" not in kw for kw in seen)
    assert built and all(kw.get("backend") == "fa2" for c, kw in built)


def test_prefill_backend_is_pinned_for_fp8_kv_and_determinism_only():
    from attnplug_flashinfer.backend import prefill_backend, split_arguments

    assert prefill_backend("bfloat16", False) == "auto"
    assert prefill_backend("float8_e4m3fn", False) == "fa2" and prefill_backend("float8_e5m2", False) == "fa2"
    assert prefill_backend("bfloat16", True) == "fa2"
    assert split_arguments(False) == {} and split_arguments(True) == {"disable_split_kv": True}


def test_cuda_graph_verify_capture_and_replay(fake_flashinfer):
    pb = H.make_problem(ForwardMode.TARGET_VERIFY, [4, 20], [3, 3], page_size=4, tree_mask=True, seed=1)
    be = _build(pb, fake_flashinfer)
    be.init_cuda_graph_state(max_batch_size=4, max_num_tokens=12)
    be.init_forward_metadata_capture_cuda_graph(pb.batch)
    H.check_output(pb, be.forward(pb.q, pb.k, pb.v, pb.layer, pb.batch), TOL)
    pb2 = H.make_problem(ForwardMode.TARGET_VERIFY, [9, 2], [3, 3], page_size=4, tree_mask=True, seed=2)
    be.kv_cache = pb2.cache
    be.init_forward_metadata_replay_cuda_graph(pb2.batch)
    H.check_output(pb2, be.forward(pb2.q, pb2.k, pb2.v, pb2.layer, pb2.batch), TOL)
    with pytest.raises(Exception, match="covers decode and target_verify"):
        be.init_forward_metadata_capture_cuda_graph(H.make_problem(ForwardMode.EXTEND, [1], [2], page_size=4).batch)


def test_cuda_graph_capture_then_replay_reads_fixed_buffers(fake_flashinfer):
    pb = H.make_problem(ForwardMode.DECODE, [4, 20], [1, 1], page_size=4, seed=1)
    be = _build(pb, fake_flashinfer)
    be.init_cuda_graph_state(max_batch_size=4, max_num_tokens=4)
    be.init_forward_metadata_capture_cuda_graph(pb.batch)
    H.check_output(pb, be.forward(pb.q, pb.k, pb.v, pb.layer, pb.batch), TOL)
    # replay: same batch size, other lengths and pages (the same wrapper, re-planned into its buffers)
    pb2 = H.make_problem(ForwardMode.DECODE, [9, 2], [1, 1], page_size=4, seed=2)
    be.kv_cache = pb2.cache
    be.init_forward_metadata_replay_cuda_graph(pb2.batch)
    ((config, wrapper),) = be._graph_wrappers[(2, "decode")].items()
    assert wrapper.use_cuda_graph and wrapper.p["indptr"].data_ptr() == be._graph_buffers[config]["kv_indptr"].data_ptr()
    H.check_output(pb2, be.forward(pb2.q, pb2.k, pb2.v, pb2.layer, pb2.batch), TOL)
    with pytest.raises(Exception, match="no CUDA graph was captured for batch size 3"):
        be.init_forward_metadata_replay_cuda_graph(
            H.make_problem(ForwardMode.DECODE, [1, 2, 3], [1, 1, 1], page_size=4).batch)


def test_forward_guards(fake_flashinfer):
    pb = H.make_problem(ForwardMode.EXTEND, [2], [3], page_size=4)
    be = _build(pb, fake_flashinfer)
    with pytest.raises(MetadataNotInitializedError):
        be.forward(pb.q, pb.k, pb.v, pb.layer, pb.batch)
    be.init_forward_metadata(pb.batch)
    assert any("head_dim=96" in r for r in be.not_supported_reasons(LayerSpec(0, 4, 2, 96)))
    with pytest.raises(NotSupportedError, match=r"dtype=float32 \(supported: float16, bfloat16\)"):
        be.forward(pb.q.float(), pb.k.float(), pb.v.float(), pb.layer, pb.batch)
    p96 = H.make_problem(ForwardMode.EXTEND, [2], [3], page_size=4, head_dim=96)  # the layer verdict, per layer
    be96 = _build(p96, fake_flashinfer)
    be96.init_forward_metadata(p96.batch)
    with pytest.raises(NotSupportedError, match=r"head_dim=96 \(supported: 64, 128, 256\)"):
        be96.forward(p96.q, p96.k, p96.v, p96.layer, p96.batch)
    idle = ForwardBatch.idle()
    be.init_forward_metadata(idle)
    assert be.forward(pb.q[:0], pb.k[:0], pb.v[:0], pb.layer, idle).shape == (0, 4, 64)


# ---------------------------------------------------------------------------
# (3) builders against independent expectations
# ---------------------------------------------------------------------------


def _expected_page_table(r2t, rows, lens, ps):
    """Independent: walk every position, keep each page the first time it appears."""
    indptr, indices, last = [0], [], []
    for r, n in zip(rows, lens):
        pages = list(dict.fromkeys(int(r2t[r, j]) // ps for j in range(n)))
        indices += pages
        indptr.append(indptr[-1] + len(pages))
        last.append(n - ps * (len(pages) - 1))
    return indptr, indices, last


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_paged_kv_matches_independent_walk(page_size):
    pb = H.make_problem(ForwardMode.EXTEND, [0, 5, 17, 3, 16], [4, 1, 6, 9, 16], page_size=page_size, seed=7)
    b = pb.batch
    p = M.paged_kv(pb.cache.req_to_token, b.req_pool_indices, b.seq_lens_cpu, page_size)
    ei, ex, el = _expected_page_table(pb.cache.req_to_token, b.req_pool_indices.tolist(), b.seq_lens_cpu, page_size)
    assert p.kv_indptr.tolist() == ei and p.kv_indices.tolist() == ex and p.kv_last_page_len.tolist() == el
    assert p.kv_indptr.dtype == p.kv_indices.dtype == p.kv_last_page_len.dtype == torch.int32
    assert all(1 <= x <= page_size for x in el)
    pb.cache.check_page_aligned(b.req_pool_indices, b.seq_lens_cpu)
    lay = M.build_layout(b, pb.cache.req_to_token, page_size)
    assert lay.qo_indptr.tolist() == [0, 4, 5, 11, 20, 36] and lay.kind == "prefill"


def test_paged_kv_hand_case_and_misaligned_table():
    from attnplug import PagedKVCache

    cache = PagedKVCache(1, 8, 2, 64, page_size=4, max_requests=2, max_context_len=8)
    r2t = cache.req_to_token
    r2t[1, :6] = torch.tensor([28, 29, 30, 31, 8, 9])  # pages 7 then 2, page size 4
    p = M.paged_kv(r2t, torch.tensor([1]), [6], 4)
    assert (p.kv_indptr.tolist(), p.kv_indices.tolist(), p.kv_last_page_len.tolist()) == ([0, 2], [7, 2], [2])
    r2t[1, 5] = 11  # position 5 must be offset 1 of page 2 (slot 9)
    with pytest.raises(ShapeError, match=r"req_to_token\[1, 5\]"):
        cache.check_page_aligned(torch.tensor([1]), [6])
    with pytest.raises(ShapeError, match="kv_lens >= 1"):
        M.paged_kv(r2t, torch.tensor([1]), [0], 4)


def test_verify_mask_layout():
    tree = torch.tensor([[[1, 0, 0], [1, 1, 0], [1, 0, 1]]], dtype=torch.bool)
    m = M.verify_custom_mask([2], 3, tree)
    expect = [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 0, 1]]
    assert m.reshape(3, 5).int().tolist() == expect
    mw = M.verify_custom_mask([2], 3, tree, window=1)  # query positions 2,3,4 see j >= p-1
    assert mw.reshape(3, 5).int().tolist() == [[0, 1, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 0, 0, 1]]


def test_version_and_page_size_guards():
    assert M.parse_version("0.5.0rc1+cu128") < M.parse_version("0.5.0") < M.parse_version("0.6.18")
    # the floor is Registry.build's (the support query), before the factory imports flashinfer
    for version, refused in (("0.5.0", False), ("0.4.1", True)):
        host = H.host("cuda", {"flashinfer-python": version}, **SM90)
        problems = H.registry(DIST).build_problems(H.registry(DIST).get("flashinfer"),
                                                  BuildContext(config=AttentionConfig(), host=host, device="cuda",
                                                               dtype="bfloat16", head_dim=128))
        assert any("flashinfer-python >= 0.5.0, found 0.4.1" in p for p in problems) is refused, problems
    with pytest.raises(ShapeError, match="page_size=0"):
        M.check_page_size(0)
    assert M.window_left(LayerSpec(0, 2, 1, 64)) == -1 and M.window_left(LayerSpec(0, 2, 1, 64, sliding_window=7)) == 7
    assert M.logits_soft_cap(LayerSpec(0, 2, 1, 64, logit_cap=30.0)) == 30.0


# ---------------------------------------------------------------------------
# (1)(2) registration, availability, light import
# ---------------------------------------------------------------------------


def test_registers_through_entry_point_and_is_unavailable_on_this_cpu_host():
    H.check_registered_and_unavailable(DIST, "flashinfer", library="flashinfer-python", floor="0.5.0",
                                       capabilities=attnplug_flashinfer.CAPABILITIES,
                                       reasons=("flashinfer-python", "cuda"), build_match="flashinfer-python")


@pytest.mark.parametrize("host_kw, available", [
    (dict(platform="cuda", compute_capability=(9, 0), libraries=LIB), True),
    (dict(platform="cuda", compute_capability=(8, 0), libraries=LIB), True),
    (dict(platform="cuda", compute_capability=(10, 0), libraries=LIB), True),
    (dict(platform="cuda", compute_capability=(7, 5), libraries=LIB), False),
    (dict(platform="cuda", compute_capability=(9, 0), libraries={}), False),
    (dict(platform="cuda", compute_capability=None, libraries=LIB), False),
    (dict(platform="rocm", gfx_arch="gfx942", libraries=LIB), False),
    (dict(platform="cpu", libraries=LIB), False),
])
def test_available_exactly_on_sm80_plus_with_the_library(host_kw, available):
    from attnplug import HostInfo

    reg = H.registry(DIST)
    assert bool(reg.availability("flashinfer", HostInfo(**host_kw))) is available


def test_priority_per_host():
    from attnplug import HostInfo

    d = H.registry(DIST).get("flashinfer")
    assert d.priority_on(HostInfo(platform="cuda", compute_capability=(9, 0))) == 50
    assert d.priority_on(HostInfo(platform="rocm")) is None and d.priority_on(HostInfo()) is None


def test_descriptor_imports_neither_torch_nor_flashinfer():
    H.assert_descriptor_light(DIST, "attnplug_flashinfer", "flashinfer")


def test_library_floor_problem_names_the_library():
    from attnplug import HostInfo

    d = H.registry(DIST).get("flashinfer")
    old = HostInfo(platform="cuda", compute_capability=(9, 0), libraries={"flashinfer-python": "0.4.1"})
    assert "flashinfer-python >= 0.5.0, found 0.4.1" in d.library_floor_problem(old)
    assert d.library_floor_problem(H.host("cuda", LIB, **SM90)) is None


# ---------------------------------------------------------------------------
# (5) resolution: no gpt-oss override from flashinfer; the diffusion-LM forcing rule
# ---------------------------------------------------------------------------


def test_gpt_oss_declares_no_flashinfer_override_and_default_fill_picks_it_on_cuda():
    reg = H.registry(DIST, "attnplug-torch-native")
    res = trace(AttentionConfig(), arch="GptOssForCausalLM", host=H.host("cuda", LIB, **SM90), registry=reg)
    assert res.ok, res.error
    assert not [r for r in res.records if r.source == DIST and "arch" in r.pass_name]
    assert res.pair == ("flashinfer", "flashinfer")
    cpu = resolve(AttentionConfig(), arch="GptOssForCausalLM", host=H.host("cpu", LIB), registry=reg)
    assert cpu.pair == ("torch_native", "torch_native")


def test_diffusion_lm_forces_flashinfer_with_cuda_graphs():
    reg = H.registry(DIST, "attnplug-torch-native")
    cfg = AttentionConfig(extra={"diffusion_lm": True})
    res = resolve(cfg, arch="LLaDAModelLM", host=H.host("cuda", LIB, **SM90), registry=reg)
    assert res.pair == ("flashinfer", "flashinfer") and res.config.cuda_graph is True
    assert any(r.source == DIST and r.rule == "diffusion_lm_flashinfer" for r in res.records)
    off_cuda = resolve(cfg, host=H.host("cpu", {}), registry=reg)
    assert off_cuda.pair == ("torch_native", "torch_native")
    # the user's backend is never overridden; the forced CUDA graphs then rule torch_native out, in words
    pinned = trace(cfg.replace(attention_backend="torch_native"), host=H.host("cuda", LIB, **SM90), registry=reg)
    assert pinned.pair == ("torch_native", "torch_native")
    assert "CUDA-graph capture is not claimed" in str(pinned.error) and "flashinfer" in str(pinned.error)


# -- fp8 KV: the cache's scales reach run(k_scale=, v_scale=) (mocked: no GPU) -------------------------
FP8_SCALES = (0.04, 2.5)  # (k_scale, v_scale)


def _build_fp8(pb, kv="float8_e4m3fn"):
    return _build(pb, kv_cache_dtype=kv)


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("case", ["extend_prefix", "decode", "verify"])
def test_fp8_kv_passes_the_cache_scales_to_run_mocked_no_gpu(fake_flashinfer, monkeypatch, case, kv_dtype):
    """Mocked wrappers (no GPU): an fp8 cache with scales (0.04, 2.5) calls ``run(q, cache, k_scale=0.04,
    v_scale=2.5)`` (floats; ``plan(sm_scale=)`` stays the layer's), and the emulated wrappers applying them
    as FlashInfer does match the float64 reference."""
    rec = C.Recorder()
    monkeypatch.setattr(fake_flashinfer, "BatchDecodeWithPagedKVCacheWrapper",
                        rec.wrap_class("flashinfer.BatchDecodeWithPagedKVCacheWrapper", EmuDecodeWrapper))
    monkeypatch.setattr(fake_flashinfer, "BatchPrefillWithPagedKVCacheWrapper",
                        rec.wrap_class("flashinfer.BatchPrefillWithPagedKVCacheWrapper", EmuPagedPrefillWrapper))
    mode, prefix, ext = H.MODE_CASES[case]
    pb = H.make_problem(mode, prefix, ext, page_size=16, tree_mask=True, sliding_window=6, logit_cap=3.0,
                        kv_dtype=kv_dtype, kv_scales=FP8_SCALES, seed=5)
    be = _build_fp8(pb, str(kv_dtype).replace("torch.", ""))
    be.init_forward_metadata(pb.batch)
    out = be.forward(pb.q, pb.k, pb.v, pb.layer, pb.batch)
    runs = [c for c in rec.calls if c.qualname.endswith(".run")]
    plans = [c for c in rec.calls if c.qualname.endswith(".plan")]
    assert runs and plans
    for c in runs:
        assert c.kwargs["k_scale"] == FP8_SCALES[0] and c.kwargs["v_scale"] == FP8_SCALES[1]
        assert type(c.kwargs["k_scale"]) is float and "q_scale" not in c.kwargs
        assert c.args[0].dtype == torch.float16 and c.args[1][0].dtype == kv_dtype
    assert all(c.kwargs["sm_scale"] == pb.layer.scaling and c.kwargs["kv_data_type"] == kv_dtype for c in plans)
    H.check_output(pb, out, TOL)


def test_fp8_kv_with_the_v_scale_ignored_misses_the_reference_mocked_no_gpu(fake_flashinfer, monkeypatch):
    """The check above can fail: the same forward with ``v_scale`` dropped is far from the reference."""
    real = EmuDecodeWrapper.run

    def run_without_v_scale(self, q, cache, *args, **kw):
        kw.pop("v_scale", None)
        return real(self, q, cache, *args, **kw)

    monkeypatch.setattr(EmuDecodeWrapper, "run", run_without_v_scale)
    mode, prefix, ext = H.MODE_CASES["decode"]
    pb = H.make_problem(mode, prefix, ext, page_size=16, kv_dtype=torch.float8_e4m3fn, kv_scales=FP8_SCALES)
    be = _build_fp8(pb)
    be.init_forward_metadata(pb.batch)
    out = be.forward(pb.q, pb.k, pb.v, pb.layer, pb.batch)
    with pytest.raises(AssertionError):
        H.check_output(pb, out, TOL)


def test_a_16_bit_cache_passes_no_scales(fake_flashinfer):
    from attnplug_flashinfer.backend import FlashInferBackend

    mode, prefix, ext = H.MODE_CASES["decode"]
    pb = H.make_problem(mode, prefix, ext, page_size=16)
    assert _build(pb, fake_flashinfer).scale_arguments(0) == {}
    assert isinstance(_build(pb, fake_flashinfer), FlashInferBackend)
