"""cpu_fused's ``attend_write`` (issue 30, round 6): the op and the skeleton's K/V write in one call, against the
path it replaced (``compute`` and then ``write_new_kv``'s two index copies).

``CpuFusedBackend.compute_and_write`` (the skeleton's hook, ``PagedBackend.compute_and_write``) calls
``torch.ops.attnplug_cpu_fused.attend_write`` where every request of a forward goes through the op and the new
K/V are stored as they are (an unquantized ``nhd`` cache in the model dtype); ``fused_write = False`` switches
the old path back on. Each family runs one forward both ways on two identical setups and requires the same
output bits and the same cache bytes (and the float64 reference, and a write at ``out_cache_loc`` only, through
``forward_and_check``); a forward whose op raises, and one with ``save_kv_cache=False``, write nothing; the
forwards the op cannot take whole never call it. ``test_the_checks_catch_a_broken_write`` runs the same checks
against wrong stand-ins for the op (the V write skipped, a row written at the wrong slot, the rows written
before the attention) and requires each to fail them.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

from attnplug import ForwardMode, ShapeError
from attnplug.testing.suite.harness import same_bytes

from test_cpu_fused import (  # noqa: F401  (threads: a fixture)
    BF16, DTYPE_IDS, E4M3, F16, F32, LENS, Setup, decode_batch, extend_batch, inputs, make, needs_kernel, op_setup,
    run_and_check, threads,
)


def _count_calls(s: Setup) -> list[int]:
    """Count ``attend_write`` calls of the setup's backend (its ``_write_op`` wrapped)."""
    calls = [0]
    op = s.backend._write_op

    def counted(*a: Any) -> Any:
        calls[0] += 1
        return op(*a)
    s.backend._write_op = counted
    return calls


def _layer_bytes(s: Setup) -> tuple[torch.Tensor, torch.Tensor]:
    kc, vc = s.cache.get_kv(0)
    return kc.clone(), vc.clone()


# scenario -> (make's keyword arguments, the batch, thread count)
def _decode(lens: list[int]) -> Callable[[Setup], Any]:
    return lambda s: decode_batch(s, lens)


def _extend(mode: ForwardMode, prefix: list[int], ext: list[int], drafts: bool = False) -> Callable[[Setup], Any]:
    def build(s: Setup) -> Any:
        mask = None
        if drafts:
            e = ext[0]
            mask = (torch.rand(len(prefix), e, e, generator=s.gen) > 0.5) | torch.eye(e, dtype=torch.bool)
        return extend_batch(s, mode, prefix, ext, mask=mask)
    return build


SCENARIOS: dict[str, tuple[dict[str, Any], Callable[[Setup], Any]]] = {
    "decode_batch1_f32": (dict(dtype=F32, head_dim=16), _decode([40])),
    "decode_ragged_f32": (dict(dtype=F32, head_dim=32), _decode(LENS)),
    "decode_bf16_window_sinks": (dict(dtype=BF16, head_dim=32, layer_kw=dict(
        sliding_window=9, sinks=torch.linspace(-1.0, 2.0, 8))), _decode(LENS)),
    "decode_f16_mqa_softcap": (dict(dtype=F16, kv_heads=1, group=8, head_dim=48, layer_kw=dict(
        scaling=1.0, logit_cap=5.0)), _decode([3, 70])),
    "decode_v_head_dim_differs": (dict(dtype=BF16, head_dim=32, v_head_dim=64), _decode([17, 1, 33])),
    "decode_page_size_1": (dict(dtype=F32, head_dim=16, page_size=1), _decode([9, 2])),
    "extend_short": (dict(dtype=F32, head_dim=32), _extend(ForwardMode.EXTEND, [0, 20, 5], [3, 16, 1])),
    "mixed_short_bf16": (dict(dtype=BF16, head_dim=48), _extend(ForwardMode.MIXED, [10, 30], [1, 4])),
    "verify_tree_mask": (dict(dtype=F32, head_dim=32), _extend(ForwardMode.TARGET_VERIFY, [5, 27], [4, 4], True)),
}


def _both_ways(name: str, nthreads: int = 1, save: bool = True,
               qkv: Callable[[Setup, Any], Any] | None = None) -> tuple[Setup, Setup, list[int], list[int]]:
    """The scenario's forward on two identical setups, ``attend_write`` on and off, each checked against the
    reference and a write at ``out_cache_loc`` only; then the same output bits and cache bytes."""
    kw, batch_of = SCENARIOS[name]
    old = torch.get_num_threads()
    torch.set_num_threads(nthreads)
    try:
        runs = []
        for fused in (True, False):
            s = make(seed=7, **kw)
            s.backend.fused_write = fused
            calls = _count_calls(s)
            batch = batch_of(s)
            q, k, v = qkv(s, batch) if qkv else inputs(s, batch.num_tokens)
            out = run_and_check(s, batch, qkv=(q, k, v), save=save)
            runs.append((s, calls, out))
        (on, on_calls, out_on), (off, off_calls, out_off) = runs
        assert same_bytes(out_on, out_off), "attend_write's output differs from the op's then the write's"
        for a, b in zip(_layer_bytes(on), _layer_bytes(off)):
            assert same_bytes(a, b), "attend_write left other cache bytes than the op and the index copies"
        return on, off, on_calls, off_calls
    finally:
        torch.set_num_threads(old)


@needs_kernel
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_attend_write_gives_the_output_and_cache_of_the_op_then_the_write(name, threads):  # noqa: F811  (the fixture)
    on, off, on_calls, off_calls = _both_ways(name, threads)
    assert on_calls[0] == 1 and off_calls[0] == 0, (on_calls, off_calls)


@needs_kernel
def test_attend_write_takes_q_k_v_split_out_of_one_projection():
    def strided(s: Setup, batch: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        L, T = s.layer, batch.num_tokens
        qw, kw = L.num_heads * L.head_dim, L.num_kv_heads * L.head_dim
        qkv = torch.randn(T, qw + 2 * kw + 16, generator=s.gen).to(s.dtype)  # 16 spare columns: padded rows
        q = qkv[:, :qw].view(T, L.num_heads, L.head_dim)
        k = qkv[:, qw:qw + kw].view(T, L.num_kv_heads, L.head_dim)
        v = qkv[:, qw + kw:qw + 2 * kw].view(T, L.num_kv_heads, L.head_dim)
        assert not k.is_contiguous() and not v.is_contiguous()
        return q, k, v
    _, _, on_calls, _ = _both_ways("decode_ragged_f32", qkv=strided)
    assert on_calls[0] == 1


@needs_kernel
@pytest.mark.parametrize("name", ["decode_batch1_f32", "decode_ragged_f32", "extend_short", "verify_tree_mask"])
def test_nothing_is_written_when_the_forward_saves_nothing(name):
    on, off, on_calls, off_calls = _both_ways(name, save=False)  # forward_and_check: the cache as before
    assert on_calls[0] == 0 and off_calls[0] == 0


def _raise_in_the_op(s: Setup, batch: Any, value: int, first_req: bool) -> None:
    """A forward whose op fails inside the kernel: ``req_to_token`` rewritten after the checks *around* torch's
    write counter (through numpy, which the per-layer guard cannot see), so the kernel reads a wild slot. The
    error names the request; every byte of the layer's cache is as before; the op was called."""
    calls = _count_calls(s)
    s.backend.init_forward_metadata(batch)
    q, k, v = inputs(s, batch.num_tokens)
    before = _layer_bytes(s)
    # a cached position the kernel reads (the new tokens come from k/v): of the request with the longest prefix
    prefix = [n - 1 for n in batch.seq_lens_cpu] if batch.forward_mode is ForwardMode.DECODE \
        else list(batch.extend_prefix_lens_cpu)
    i = prefix.index(max(prefix)) if first_req else len(prefix) - 1 - prefix[::-1].index(max(prefix))
    row = batch.req_pool_indices_cpu[i]
    s.cache.req_to_token.numpy()[row, prefix[i] // 2] = value
    with pytest.raises(ShapeError, match=rf"request {i} \(req_to_token row {row}\): position \d+ maps to slot "
                                         rf"{value}"):
        s.backend.forward(q, k, v, s.layer, batch)
    assert calls[0] == 1, "the forward did not go through attend_write"
    for a, b in zip(_layer_bytes(s), before):
        assert same_bytes(a, b), "a forward whose op raised wrote into the cache"


@needs_kernel
@pytest.mark.parametrize("value", [10 ** 12, -1, -(2 ** 40)])
@pytest.mark.parametrize("name", ["decode_batch1_f32", "decode_ragged_f32", "extend_short", "mixed_short_bf16"])
def test_a_forward_whose_op_raises_writes_nothing(name, value):
    kw, batch_of = SCENARIOS[name]
    s = make(seed=7, **kw)
    _raise_in_the_op(s, batch_of(s), value, first_req=value != -1)


NOT_TAKEN: dict[str, tuple[dict[str, Any], Callable[[Setup], Any], str]] = {
    # (make's arguments, the batch, why the op cannot take the forward whole)
    "fp8_cache": (dict(dtype=BF16, kv_dtype=E4M3, head_dim=32, scales=(0.5, 1.25)), _decode(LENS),
                  "the cache stores quantized rows"),
    "long_extend": (dict(dtype=F32, head_dim=32), _extend(ForwardMode.EXTEND, [0, 5], [40, 2]),
                    "one request is the tiled kernel's"),
    "bidirectional": (dict(dtype=F32, head_dim=32, layer_kw=dict(causality="bidirectional")),
                      _extend(ForwardMode.EXTEND, [0, 3], [5, 2]), "the eager paths run it"),
    "cross_attention": (dict(dtype=F32, head_dim=32, layer_kw=dict(is_cross_attention=True)),
                        lambda s: decode_batch(s, [5, 30], encoder_lens=[13, 55]), "nothing is written"),
}


@needs_kernel
@pytest.mark.parametrize("name", sorted(NOT_TAKEN))
def test_attend_write_is_not_called_for_a_forward_the_op_cannot_take_whole(name):
    kw, batch_of, _why = NOT_TAKEN[name]
    s = make(seed=8, **kw)
    calls = _count_calls(s)
    run_and_check(s, batch_of(s))
    assert calls[0] == 0


# ---------------------------------------------------------------------------
# the checks fail on a broken write
# ---------------------------------------------------------------------------


def _broken(kind: str, s: Setup) -> Callable[..., Any]:
    """A wrong stand-in for ``attend_write`` made of the real ops."""
    attend = torch.ops.attnplug_cpu_fused.attend.default

    def op(q: Any, kn: Any, vn: Any, kc: Any, vc: Any, r2t: Any, params: Any, work: Any, slots: Any) -> Any:
        out = torch.empty(q.shape[0], q.shape[1], vc.shape[2], dtype=q.dtype)
        if kind == "writes_first":
            kc.index_copy_(0, slots, kn)
            vc.index_copy_(0, slots, vn)
        attend(q, kn, vn, kc, vc, r2t, params, work, out)
        if kind == "skips_v":
            kc.index_copy_(0, slots, kn)
        elif kind == "wrong_slot":
            kc.index_copy_(0, (slots + 1) % kc.shape[0], kn)
            vc.index_copy_(0, slots, vn)
        return out
    return op


@needs_kernel
@pytest.mark.parametrize("kind", ["skips_v", "wrong_slot", "writes_first"])
def test_the_checks_catch_a_broken_write(kind, monkeypatch):
    real = make

    def broken_make(**kw: Any) -> Setup:
        s = real(**kw)
        s.backend._write_op = _broken(kind, s)
        return s
    monkeypatch.setitem(globals(), "make", broken_make)
    with pytest.raises(AssertionError):
        if kind == "writes_first":
            kw, batch_of = SCENARIOS["decode_ragged_f32"]
            s = broken_make(seed=7, **kw)
            _raise_in_the_op(s, batch_of(s), 10 ** 12, first_req=False)
        else:
            _both_ways("decode_ragged_f32")


# ---------------------------------------------------------------------------
# the op: schema, fake, opcheck, torch.compile, errors
# ---------------------------------------------------------------------------


def _write_args(dtype: torch.dtype = F32, mode: ForwardMode = ForwardMode.DECODE, **layer_kw: Any) -> tuple[Any, ...]:
    s, batch, q, k, v, meta = op_setup(dtype, mode, **layer_kw)
    call = s.backend._call(q, s.layer, meta)
    assert call.whole
    return (q, k, v, *call.head, batch.out_cache_loc.to(torch.int64))


@needs_kernel
@pytest.mark.parametrize("case", ["f32_decode", "bf16_decode_sinks_window", "f32_verify_mask"])
def test_opcheck_passes_for_attend_write(case):
    if case == "f32_decode":
        args = _write_args()
    elif case == "bf16_decode_sinks_window":
        args = _write_args(BF16, sinks=torch.linspace(-1.0, 1.0, 8), sliding_window=9)
    else:
        args = _write_args(F32, ForwardMode.TARGET_VERIFY)
    torch.library.opcheck(torch.ops.attnplug_cpu_fused.attend_write.default, args)


@needs_kernel
def test_attend_write_schema_declares_the_caches_and_work_mutated_and_returns_the_output():
    schema = torch.ops.attnplug_cpu_fused.attend_write.default._schema
    mutated = [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    assert mutated == ["k_cache", "v_cache", "work"]
    assert len(schema.returns) == 1 and schema.returns[0].alias_info is None


@needs_kernel
def test_a_function_calling_attend_write_compiles_fullgraph():
    args = _write_args()
    q, kn, vn, kc, vc, *rest = args

    def f(q: torch.Tensor, kn: torch.Tensor, vn: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor) -> torch.Tensor:
        return torch.ops.attnplug_cpu_fused.attend_write(q * 1.0, kn, vn, kc, vc, *rest) + 0.0

    torch._dynamo.reset()
    kc2, vc2 = kc.clone(), vc.clone()
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(q, kn, vn, kc2, vc2)
    want = f(q, kn, vn, kc, vc)
    assert same_bytes(got, want) and same_bytes(kc2, kc) and same_bytes(vc2, vc)
    assert torch.count_nonzero(got) > 0


@needs_kernel
def test_attend_write_refuses_bad_arguments_before_writing_naming_them():
    args = list(_write_args())
    kc, vc = args[3], args[4]
    before = (kc.clone(), vc.clone())
    cases = [
        (8, args[8].clone().fill_(kc.shape[0]), r"slots\[0\]=\d+ is out of range \(expected 0 <= slot < \d+\); "
                                                r"nothing was written"),
        (8, args[8].clone().fill_(-1), r"slots\[0\]=-1 is out of range"),
        (8, args[8].to(torch.int32), r"slots must be an int64 CPU tensor \[T\]"),
        (8, args[8][:1], r"slots must be an int64 CPU tensor \[T\]"),
        (1, args[1].to(BF16), r"k_new/v_new are BFloat16/Float, the caches Float/Float"),
        (7, args[7].to(torch.int32), r"work must be a contiguous int64 CPU tensor \[1 \+ B \+ M, 8\]"),  # attend's own check
    ]
    for i, value, message in cases:
        bad = list(args)
        bad[i] = value
        with pytest.raises(RuntimeError, match=message):
            torch.ops.attnplug_cpu_fused.attend_write(*bad)
        assert same_bytes(kc, before[0]) and same_bytes(vc, before[1]), f"argument {i}: the caches changed"


# ---------------------------------------------------------------------------
# a decode forward's work rows (FusedMeta._decode_plan) against the general loop over chunks
# ---------------------------------------------------------------------------


@needs_kernel
@pytest.mark.parametrize("window", [None, 0, 5, 40], ids=lambda w: f"window{w}")
@pytest.mark.parametrize("lens", [[1], LENS, [40], [3, 70, 1, 2]], ids=["one_token", "ragged", "batch1", "four"])
def test_the_decode_work_rows_are_the_general_loops(lens, window, monkeypatch):
    from attnplug_cpu_fused import backend as cf_backend

    s = make(dtype=F32, head_dim=16, seed=5, layer_kw=dict(sliding_window=window))
    batch = decode_batch(s, lens)
    s.backend.init_forward_metadata(batch)
    for chunk in (16, 1):
        fast = s.backend.build_metadata(batch)
        monkeypatch.setattr(cf_backend, "_DECODE_PLAN", False)
        general = s.backend.build_metadata(batch)
        want = general.plan(window, False, chunk)
        monkeypatch.setattr(cf_backend, "_DECODE_PLAN", True)
        got = fast.plan(window, False, chunk)
        assert torch.equal(got[0], want[0]) and got[1:] == want[1:], (got, want)
        assert list(range(len(lens))) == [i for i, _, _ in general.chunks(chunk)]  # _prepare's work requests
    # and a forward through each gives the same output bits
    outs = []
    for on in (True, False):
        monkeypatch.setattr(cf_backend, "_DECODE_PLAN", on)
        s2 = make(dtype=F32, head_dim=16, seed=5, layer_kw=dict(sliding_window=window))
        outs.append(run_and_check(s2, decode_batch(s2, lens)))
    assert same_bytes(outs[0], outs[1])
