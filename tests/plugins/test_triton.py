"""attnplug-triton: descriptor, availability, gpt-oss overrides, and the Triton kernels against the reference.

The kernels run here in Triton's interpreter on CPU tensors. Triton decides
interpreted-or-compiled when ``@triton.jit`` runs, i.e. when
``attnplug_triton.kernels`` is first imported, so ``TRITON_INTERPRET=1`` is set
at the top of this file, before anything imports triton. The environment is
then put back as it was (so other test modules in the same session see their
own), and the tests that need the variable (probes, builds) set it with
``monkeypatch``.

Numeric checks: every case builds a paged KV cache whose pages are scattered
at random and whose every slot holds noise (a read of a wrong slot shows),
runs one forward and compares with ``attnplug.testing.reference`` at the
conformance suite's tolerances, and the cache with ``expected_cache_after``
(bit for bit).
"""

from __future__ import annotations

import os

_SET_INTERPRET = "TRITON_INTERPRET" not in os.environ
os.environ.setdefault("TRITON_INTERPRET", "1")  # before any import of triton

import dataclasses  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import textwrap  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

import attnplug_triton  # noqa: E402
from attnplug import (  # noqa: E402
    AttentionConfig,
    ForwardBatch,
    ForwardMode,
    HostInfo,
    LayerSpec,
    PagedKVCache,
    ShapeError,
)
from attnplug.dtypes import dtype_name  # noqa: E402
from attnplug.errors import (  # noqa: E402
    AttnplugError, BackendUnavailableError, ConfigError, MetadataNotInitializedError, ResourceLimitError,
)
from attnplug.registry import Registry, in_process_source  # noqa: E402
from attnplug.resolution import resolve  # noqa: E402
from attnplug.testing.suite.harness import same_bytes  # noqa: E402
from tests import paged_setup  # noqa: E402
from tests.paged_setup import Setup, make_batch, qkv  # noqa: E402

HAVE_TRITON = importlib.util.find_spec("triton") is not None
if HAVE_TRITON:
    from attnplug_triton import kernels as K
    from attnplug_triton.backend import SMEM_BUDGET, TritonBackend, choose_tiles, create, smem_estimate
if _SET_INTERPRET:
    del os.environ["TRITON_INTERPRET"]  # leave the session's environment as it was

needs_kernels = pytest.mark.skipif(
    not HAVE_TRITON or not K.INTERPRETED,
    reason=(
        "triton is not installed (pip install triton)" if not HAVE_TRITON else
        "attnplug_triton.kernels was imported before TRITON_INTERPRET=1 was set in this process "
        "(the kernels are compiled for a GPU); run this file on its own"
    ),
)

DIST = "attnplug-triton"
GPT = "GptOssForCausalLM"
TRITON_LIB = {"triton": "3.4.0", "torch": "2.8.0"}
CPU = HostInfo(platform="cpu", libraries=TRITON_LIB)
CPU_NO_TRITON = HostInfo(platform="cpu", libraries={"torch": "2.8.0"})
A100 = HostInfo(platform="cuda", compute_capability=(8, 0), device_name="A100", libraries=TRITON_LIB)
A100_NO_TRITON = HostInfo(platform="cuda", compute_capability=(8, 0), libraries={"torch": "2.8.0"})
A100_OLD_TRITON = HostInfo(platform="cuda", compute_capability=(8, 0), libraries={"triton": "2.3.1"})
MI300 = HostInfo(platform="rocm", gfx_arch="gfx942", libraries=TRITON_LIB)
XPU = HostInfo(platform="xpu", libraries=TRITON_LIB)
NO_GPU = "no GPU; set TRITON_INTERPRET=1 to run the kernels in Triton's interpreter on CPU"


@pytest.fixture
def interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def registry(host: HostInfo, *extra: Any) -> Registry:
    """The real triton and torch_native descriptors, loaded in-process, plus ``extra`` sources."""
    import attnplug_torch_native

    reg = Registry(host=host)
    reg.load_sources([in_process_source(attnplug_torch_native, "attnplug-torch-native", "0.1.0"),
                      in_process_source(attnplug_triton, DIST, "0.1.0"), *extra])
    return reg


# ---------------------------------------------------------------------------
# descriptor: light, available where it can run, priorities, floor
# ---------------------------------------------------------------------------


def test_descriptor_imports_neither_torch_nor_triton():
    code = textwrap.dedent("""
        import json, sys
        import attnplug_triton
        from attnplug import HostInfo
        from attnplug.registry import Registry, in_process_source
        reg = Registry(host=HostInfo(platform="cuda", compute_capability=(8, 0), libraries={"triton": "3.4.0"}))
        reg.load_sources([in_process_source(attnplug_triton, "attnplug-triton")])
        reg.availability("triton")
        print(json.dumps({m: m in sys.modules for m in ("torch", "triton", "numpy", "attnplug_triton.backend")}))
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ATTNPLUG_", "TRITON_"))}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {
        "torch": False, "triton": False, "numpy": False, "attnplug_triton.backend": False}


def test_registers_through_its_entry_point():
    from attnplug.registry import entry_point_sources

    sources, _ = entry_point_sources()
    mine = [s for s in sources if s.distribution == DIST]
    assert [(s.name, s.module) for s in mine] == [("triton", "attnplug_triton")]
    desc = registry(A100).get("triton")
    assert desc.distribution == DIST and desc.factory == "attnplug_triton.backend:create"
    assert desc.library == "triton" and desc.min_library_version == "3.0"


@pytest.mark.parametrize("host,env,reasons", [
    (A100, None, []),
    (A100, "0", []),  # compiled kernels on a GPU: the interpreter is not needed
    (MI300, None, []),
    (CPU, None, [NO_GPU]),
    (CPU, "0", [NO_GPU]),
    (CPU, "false", [NO_GPU]),
    (CPU, "1", []),
    (CPU, "true", []),  # Triton's own reading of the variable
    (XPU, None, ["the kernels are built for CUDA and ROCm GPUs, this host is xpu; "
                 "set TRITON_INTERPRET=1 to run them in Triton's interpreter on CPU"]),
    (XPU, "1", []),
    (A100_NO_TRITON, None, ["kernel library 'triton' is not installed (pip install triton)"]),
    # ROCm and nightly torch wheels bring the triton module as differently named distributions
    (HostInfo(platform="rocm", gfx_arch="gfx942", libraries={"pytorch-triton-rocm": "3.4.0"}), None, []),
    (HostInfo(platform="cuda", compute_capability=(9, 0), libraries={"pytorch-triton": "3.5.0"}), None, []),
    (CPU_NO_TRITON, "1", ["kernel library 'triton' is not installed (pip install triton)"]),
], ids=lambda x: getattr(x, "platform", x))
def test_availability_rules(monkeypatch, host, env, reasons):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if env is not None:
        monkeypatch.setenv("TRITON_INTERPRET", env)
    avail = registry(host).get("triton").check_availability(host)
    assert list(avail.reasons) == reasons
    assert avail.available is (not reasons)


def test_priorities_and_floor():
    desc = registry(A100).get("triton")
    assert desc.priority_on(A100) == 20 and desc.priority_on(MI300) == 20
    assert desc.priority_on(CPU) is None and desc.priority_on(XPU) is None
    assert desc.library_floor_problem(A100) is None
    problem = desc.library_floor_problem(A100_OLD_TRITON)
    assert problem and "triton >= 3.0" in problem and "2.3.1" in problem and DIST in problem


def test_default_fill_on_a_gpu_but_never_on_cpu(interpret):
    """Interpreter on (available on CPU), yet the CPU default stays torch_native; on CUDA triton wins."""
    assert registry(CPU).availability("triton").available
    assert resolve(AttentionConfig(), host=CPU, registry=registry(CPU)).pair == ("torch_native", "torch_native")
    assert resolve(AttentionConfig(), host=A100, registry=registry(A100)).pair == ("triton", "triton")


def test_chosen_by_name_on_cpu_only_with_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(BackendUnavailableError, match="TRITON_INTERPRET=1"):
        resolve(AttentionConfig(attention_backend="triton"), host=CPU, registry=registry(CPU))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    res = resolve(AttentionConfig(attention_backend="triton"), host=CPU, registry=registry(CPU))
    assert res.pair == ("triton", "triton")


def test_library_floor_fails_at_start_up():
    with pytest.raises(ConfigError, match="triton >= 3.0, found 2.3.1"):
        resolve(AttentionConfig(attention_backend="triton"), host=A100_OLD_TRITON,
                registry=registry(A100_OLD_TRITON))


# ---------------------------------------------------------------------------
# gpt-oss: the family catch-all and the mxfp4 dtype fact
# ---------------------------------------------------------------------------

TRITON_DEFAULT = ("arch_overrides", DIST, {"attention_backend": "triton"})


#: the record closing every resolution here: triton, fa3 and flashinfer read the core's default layout
NHD_LAYOUT = ("kv_layout", "attnplug", {"kv_layout": "nhd"})


def test_gpt_oss_picks_triton_where_no_specific_override_applies():
    res = resolve(AttentionConfig(), arch=GPT, host=A100, registry=registry(A100))
    assert res.pair == ("triton", "triton")
    assert [r.as_tuple() for r in res.records] == [TRITON_DEFAULT, NHD_LAYOUT]
    # another architecture gets the platform default (triton too here, but by priority)
    res = resolve(AttentionConfig(), arch="LlamaForCausalLM", host=A100, registry=registry(A100))
    assert [r.as_tuple()[0] for r in res.records] == ["default_fill", "kv_layout"]


def test_gpt_oss_catch_all_has_negative_precedence():
    from attnplug.settle import collect_arch_overrides

    mine = [o for o in collect_arch_overrides(registry(A100)) if o.distribution == DIST]
    assert [(o.name, o.archs, o.precedence) for o in mine] == [
        ("gpt_oss_default", (GPT,), -10), ("gpt_oss_mxfp4_dtype", (GPT,), 0)]


def test_a_specific_override_wins_over_the_catch_all():
    """With the stand-in fa3 plugin of the resolution tests, gpt-oss on SM90 picks fa3."""
    from tests.dists_resolution import fa3 as fa3_stand_in

    h100 = HostInfo(platform="cuda", compute_capability=(9, 0), libraries={**TRITON_LIB, "sgl-kernel": "0.3.5"})
    reg = registry(h100, in_process_source(fa3_stand_in, "attnplug-fa3", "1.0.0"))
    res = resolve(AttentionConfig(), arch=GPT, host=h100, registry=reg)
    assert res.pair == ("fa3", "fa3")
    assert [r.as_tuple() for r in res.records] == [
        TRITON_DEFAULT, ("arch_overrides", "attnplug-fa3", {"attention_backend": "fa3"}), NHD_LAYOUT]


def test_user_choice_overrules_the_catch_all():
    res = resolve(AttentionConfig(attention_backend="torch_native"), arch=GPT, host=A100, registry=registry(A100))
    assert res.pair == ("torch_native", "torch_native")
    rec = [r for r in res.records if r.source == DIST][0]
    assert rec.overruled and not rec.applied


def test_gpt_oss_on_cpu_never_picks_the_interpreter(interpret):
    res = resolve(AttentionConfig(), arch=GPT, host=CPU, registry=registry(CPU))
    assert res.pair == ("torch_native", "torch_native")
    assert all(r.source != DIST for r in res.records)


@pytest.mark.parametrize("extra,user_dtype,dtype", [
    ({"quantization": "mxfp4"}, None, "bfloat16"),
    ({"quantization": "mxfp4"}, "float16", "float16"),  # the user's dtype is pinned
    ({}, None, AttentionConfig().dtype),
])
def test_mxfp4_gpt_oss_runs_in_bfloat16(extra, user_dtype, dtype):
    kw = {"extra": extra} if user_dtype is None else {"extra": extra, "dtype": user_dtype}
    res = resolve(AttentionConfig(**kw), arch=GPT, host=A100, registry=registry(A100))
    assert res.config.dtype == dtype
    res = resolve(AttentionConfig(**kw), arch="LlamaForCausalLM", host=A100, registry=registry(A100))
    assert res.config.dtype == (user_dtype or AttentionConfig().dtype)


# ---------------------------------------------------------------------------
# kernels: setup helpers
# ---------------------------------------------------------------------------


def make_setup(
    *, page_size: int = 16, heads: int = 8, kv_heads: int = 2, head_dim: int = 32, v_head_dim: int | None = None,
    dtype: torch.dtype = torch.float32, kv_dtype: torch.dtype | None = None, num_layers: int = 1, seed: int = 0,
    layer_kw: dict[str, Any] | None = None, via_registry: bool = False, unassigned: int | None = None,
    canary: float | None = None, max_workspace_bytes: int = 4 << 30, num_pages: int | None = None,
    **backend_kw: Any,
) -> Setup:
    """A paged cache with noise in every slot and a triton backend over it (``paged_setup.make_setup``:
    ``unassigned`` and ``canary`` there)."""
    return paged_setup.make_setup(
        "triton", lambda ctx: TritonBackend(ctx, **backend_kw), host=CPU, page_size=page_size, heads=heads,
        kv_heads=kv_heads, head_dim=head_dim, v_head_dim=v_head_dim, dtype=dtype, kv_dtype=kv_dtype,
        num_layers=num_layers, seed=seed, layer_kw=layer_kw, num_pages=num_pages or max(8, 640 // page_size),
        max_context_len=320, via_registry=via_registry, unassigned=unassigned, canary=canary,
        max_workspace_bytes=max_workspace_bytes,
    )


def run_and_check(s: Setup, batch: ForwardBatch, layer: LayerSpec | None = None, **kw: Any) -> torch.Tensor:
    """``paged_setup.run_and_check`` with new K/V drawn for every layer but a cross-attention one (``save``,
    ``init``, ``q_scale`` and ``edit`` there)."""
    layer = layer or s.layers[0]
    return paged_setup.run_and_check(s, batch, layer, with_kv=not layer.is_cross_attention, **kw)


def cache_bytes(cache: PagedKVCache) -> list[torch.Tensor]:
    """Every byte of the cache: each layer's K and V buffers and ``req_to_token``."""
    return [b.clone() for b in cache.k_buffers + cache.v_buffers] + [cache.req_to_token.clone()]


def assert_cache_unchanged(cache: PagedKVCache, before: list[torch.Tensor]) -> None:
    after = cache_bytes(cache)
    assert all(same_bytes(a, b) for a, b in zip(before, after)), "a rejected forward changed the KV cache"


DTYPES = [torch.float32, torch.float16, torch.bfloat16]
EXTEND_CASES = {
    "no_prefix_ragged": ([0, 0, 0], [5, 17, 1]),
    "prefix_mid_page": ([3, 21, 16], [4, 9, 2]),
    "long_prefix": ([150, 0], [3, 40]),
    "single_token_extends": ([0, 7, 30], [1, 1, 1]),
    "zero_new_tokens_in_batch": ([4, 0], [0, 6]),
}
HEADS = {"gqa4": (8, 2), "mqa": (8, 1), "mha": (4, 4), "gqa3": (6, 2)}


# ---------------------------------------------------------------------------
# kernels: building and protocol
# ---------------------------------------------------------------------------


@needs_kernels
def test_built_through_the_registry_and_stamped(interpret):
    s = make_setup(via_registry=True)
    b = s.backend
    assert isinstance(b, TritonBackend) and b.interpret
    assert b.prefill_attention_backend_str == b.decode_attention_backend_str == "triton"
    assert type(b).capabilities is attnplug_triton.CAPABILITIES
    assert b.not_supported_reasons(s.layers[0], b.ctx) == []
    run_and_check(s, make_batch(s, ForwardMode.DECODE, [5, 17], [1, 1]))


@needs_kernels
def test_factory_returns_the_effective_name():
    s = make_setup()
    name, backend = create(s.backend.ctx)
    assert name == "triton" and isinstance(backend, TritonBackend)


@needs_kernels
def test_refuses_in_words_what_it_does_not_claim():
    paged_setup.assert_claims_every_feature(make_setup().backend, fp8="float8_e4m3fn",
                                            refused={"dtype": "float64", "kv_cache_dtype": "float64"})


@needs_kernels
def test_metadata_once_per_forward_and_required():
    s = make_setup(num_layers=3)
    batch = make_batch(s, ForwardMode.EXTEND, [3, 0], [2, 5])
    q, k, v = qkv(s, s.layers[0], batch.num_tokens)
    with pytest.raises(MetadataNotInitializedError, match="init_forward_metadata"):
        s.backend.forward(q, k, v, s.layers[0], batch)
    s.backend.init_forward_metadata(batch)
    for layer in s.layers:
        run_and_check(s, batch, layer, init=False)
    assert s.backend.metadata_builds == 1
    with pytest.raises(MetadataNotInitializedError):
        s.backend.forward(q, k, v, s.layers[0], dataclasses.replace(batch))


@needs_kernels
@pytest.mark.parametrize("bad", ["q_heads", "k_heads", "v_dim", "k_dtype", "k_none"])
def test_bad_input_raises_before_writing(bad):
    s = make_setup()
    batch = make_batch(s, ForwardMode.DECODE, [4, 9], [1, 1])
    q, k, v = qkv(s, s.layers[0], batch.num_tokens)
    q, k, v = {
        "q_heads": (q[:, :7], k, v), "k_heads": (q, k.repeat(1, 2, 1), v), "v_dim": (q, k, v[..., :16]),
        "k_dtype": (q, k.double(), v), "k_none": (q, None, None),
    }[bad]
    before = [b.clone() for b in s.cache.get_kv(0)]
    s.backend.init_forward_metadata(batch)
    with pytest.raises(ShapeError):
        s.backend.forward(q, k, v, s.layers[0], batch)
    assert all(torch.equal(a, b) for a, b in zip(before, s.cache.get_kv(0)))


@needs_kernels
def test_forward_without_kv_cache_raises_clearly():
    s = make_setup()
    backend = TritonBackend(s.backend.ctx.replace(kv_cache=None))
    batch = ForwardBatch.decode([0], [3], [5])
    with pytest.raises(AttnplugError, match="triton was built without a KV cache"):
        backend.init_forward_metadata(batch)  # the batch's indices are checked against the cache here


@needs_kernels
def test_idle_returns_empty_and_writes_nothing():
    s = make_setup()
    batch = ForwardBatch.idle()
    s.backend.init_forward_metadata(batch)
    q = torch.zeros(0, 8, 32)
    out = s.backend.forward(q, q[:, :2], q[:, :2], s.layers[0], batch)
    assert out.shape == (0, 8, 32)


def test_compiled_kernels_on_cpu_fail_in_words():
    """Without TRITON_INTERPRET the kernels are compiled for a GPU; on a CPU cache the build says so."""
    if not HAVE_TRITON:
        pytest.skip("triton is not installed (pip install triton)")
    code = textwrap.dedent("""
        from attnplug import AttentionConfig, BuildContext, HostInfo, PagedKVCache
        from attnplug.errors import AttnplugError
        from attnplug_triton.backend import TritonBackend
        cache = PagedKVCache(1, 4, 1, 16)
        ctx = BuildContext(config=AttentionConfig(), host=HostInfo(), head_dim=16, kv_cache=cache)
        try:
            TritonBackend(ctx)
        except AttnplugError as exc:
            print(exc)
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "compiled for a GPU" in proc.stdout and "TRITON_INTERPRET=1" in proc.stdout


# ---------------------------------------------------------------------------
# kernels: numerics against the float64 reference
# ---------------------------------------------------------------------------


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
@pytest.mark.parametrize("ps", [1, 16])
@pytest.mark.parametrize("case", list(EXTEND_CASES))
def test_extend(case, ps, dtype):
    s = make_setup(page_size=ps, dtype=dtype)
    prefix, ext = EXTEND_CASES[case]
    run_and_check(s, make_batch(s, ForwardMode.EXTEND, prefix, ext))


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
@pytest.mark.parametrize("ps", [1, 16])
def test_decode(ps, dtype):
    # seq_len 1 (no prefix), page crossings (17), several decode splits (150 > 64 per split)
    s = make_setup(page_size=ps, dtype=dtype)
    run_and_check(s, make_batch(s, ForwardMode.DECODE, [0, 16, 5, 149], [1, 1, 1, 1]))


@needs_kernels
@pytest.mark.parametrize("mode", ["decode", "extend"])
@pytest.mark.parametrize("heads", list(HEADS))
def test_head_layouts(heads, mode):
    h, kv = HEADS[heads]
    s = make_setup(heads=h, kv_heads=kv, dtype=torch.float16)
    if mode == "decode":
        run_and_check(s, make_batch(s, ForwardMode.DECODE, [0, 20, 70], [1, 1, 1]))
    else:
        run_and_check(s, make_batch(s, ForwardMode.EXTEND, [7, 0, 19], [4, 6, 3]))


@needs_kernels
@pytest.mark.parametrize("dims", [(48, 48), (80, 80), (96, 64), (64, 128), (192, 128), (256, 256)])
def test_head_dims_padded(dims):
    d, dv = dims
    s = make_setup(head_dim=d, v_head_dim=dv, dtype=torch.bfloat16)
    run_and_check(s, make_batch(s, ForwardMode.EXTEND, [5, 18], [3, 4]))
    run_and_check(s, make_batch(s, ForwardMode.DECODE, [9, 33], [1, 1], req_ids=[2, 3]))


FEATURES = {
    "window4": dict(sliding_window=4),
    "window0": dict(sliding_window=0),  # sees only itself
    "softcap": dict(logit_cap=2.0),
    "sinks": dict(sinks=torch.linspace(-1.0, 4.0, 8)),
    "window_sinks_softcap": dict(sliding_window=6, sinks=torch.linspace(0.0, 3.0, 8), logit_cap=5.0),
}


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_name)
@pytest.mark.parametrize("feature", list(FEATURES))
def test_features(feature, dtype):
    s = make_setup(dtype=dtype, layer_kw=FEATURES[feature], page_size=4)
    q_scale = 3.0 if "softcap" in feature else 1.0
    run_and_check(s, make_batch(s, ForwardMode.EXTEND, [9, 0, 30], [5, 7, 2]), q_scale=q_scale)
    run_and_check(s, make_batch(s, ForwardMode.DECODE, [0, 12, 90], [1, 1, 1], req_ids=[1, 2, 3]), q_scale=q_scale)
    run_and_check(s, make_batch(s, ForwardMode.MIXED, [10, 0, 23], [1, 6, 1], req_ids=[0, 4, 5]), q_scale=q_scale)


@needs_kernels
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("custom_mask", [False, True])
def test_target_verify(custom_mask, window):
    s = make_setup(dtype=torch.float16, layer_kw={"sliding_window": window})
    d = 5
    kw: dict[str, Any] = {"spec_num_draft_tokens": d}
    if custom_mask:
        mask = torch.rand(3, d, d, generator=s.gen) < 0.5
        kw["spec_custom_mask"] = torch.tril(mask) | torch.eye(d, dtype=torch.bool)
    run_and_check(s, make_batch(s, ForwardMode.TARGET_VERIFY, [5, 27, 16], [d, d, d], **kw))


@needs_kernels
@pytest.mark.parametrize("mode", [ForwardMode.DRAFT_EXTEND, ForwardMode.DRAFT_EXTEND_V2, ForwardMode.MIXED])
def test_other_extend_modes(mode):
    s = make_setup(dtype=torch.bfloat16, page_size=1)
    run_and_check(s, make_batch(s, mode, [6, 21, 3], [2, 3, 1]))


@needs_kernels
@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE])
@pytest.mark.parametrize("ps", [1, 16])
def test_cross_attention(mode, ps):
    s = make_setup(page_size=ps, layer_kw={"is_cross_attention": True})
    prefix, ext = ([7, 12, 20], [4, 6, 2]) if mode is ForwardMode.EXTEND else ([7, 16, 80], [1, 1, 1])
    enc = [5, 12, 75] if mode is ForwardMode.DECODE else [5, 12, 9]
    run_and_check(s, make_batch(s, mode, prefix, ext, encoder_lens=enc))


@needs_kernels
@pytest.mark.parametrize("model,kv", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32),
                                      (torch.float16, torch.bfloat16)], ids=str)
def test_kv_cache_in_another_dtype(model, kv):
    s = make_setup(dtype=model, kv_dtype=kv)
    run_and_check(s, make_batch(s, ForwardMode.EXTEND, [7, 20], [4, 2]))
    run_and_check(s, make_batch(s, ForwardMode.DECODE, [6, 64], [1, 1], req_ids=[1, 2]))


@needs_kernels
@pytest.mark.parametrize("mode", ["extend", "decode"])
def test_no_save_reads_new_tokens_from_the_arguments(mode):
    s = make_setup()
    if mode == "decode":
        run_and_check(s, make_batch(s, ForwardMode.DECODE, [4, 40], [1, 1]), save=False)
    else:
        run_and_check(s, make_batch(s, ForwardMode.EXTEND, [4, 40], [3, 5]), save=False)


@needs_kernels
def test_prefill_then_decodes_read_what_was_written():
    s = make_setup(page_size=4, dtype=torch.float16)
    reqs = [3, 5]
    s.cache.assign_pages(3, 40, s.alloc.alloc(10))
    s.cache.assign_pages(5, 40, s.alloc.alloc(10))
    lens = [0, 0]
    for mode, ext in [("extend", [6, 13]), ("extend", [5, 2]), ("decode", [1, 1]), ("decode", [1, 1])]:
        loc = torch.cat([s.cache.req_to_token[r, p:p + e] for r, p, e in zip(reqs, lens, ext)])
        if mode == "decode":
            batch = ForwardBatch.decode(reqs, [p + 1 for p in lens], loc)
        else:
            batch = ForwardBatch.extend(reqs, lens, ext, loc)
        run_and_check(s, batch)
        lens = [p + e for p, e in zip(lens, ext)]


# ---------------------------------------------------------------------------
# robustness (issue 9): garbage in unowned slots, rejected forwards write nothing, bounded workspaces
# ---------------------------------------------------------------------------

#: cache dtype and the garbage its unowned slots (and the rows around the buffers) hold
GARBAGE = {"float32_nan": (torch.float32, float("nan")), "bfloat16_inf": (torch.bfloat16, float("inf"))}
_VERIFY_MASK = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
#: mode, prefix lens, new tokens, batch fields; ragged so a short request sits beside a longer one
#: (lengths 11 and 8 as in issue 9); cross-attention reads encoder_lens cached tokens instead
GARBAGE_MODES: dict[str, tuple[ForwardMode, list[int], list[int], dict[str, Any]]] = {
    "extend": (ForwardMode.EXTEND, [0, 5, 3], [11, 3, 1], {}),
    "decode": (ForwardMode.DECODE, [10, 7, 0], [1, 1, 1], {}),
    "mixed": (ForwardMode.MIXED, [10, 0, 5], [1, 8, 1], {}),
    "target_verify": (ForwardMode.TARGET_VERIFY, [8, 3], [3, 3],
                      {"spec_num_draft_tokens": 3, "spec_custom_mask": _VERIFY_MASK.expand(2, 3, 3).clone()}),
    "draft_extend": (ForwardMode.DRAFT_EXTEND, [6, 9], [2, 1], {}),
    "cross_extend": (ForwardMode.EXTEND, [4, 9], [3, 2], {"encoder_lens": [6, 11]}),
    "cross_decode": (ForwardMode.DECODE, [4, 9, 2], [1, 1, 1], {"encoder_lens": [11, 8, 0]}),  # 0: sees nothing
}


def fill_unowned(s: Setup, batch: ForwardBatch, layer: LayerSpec, value: float) -> int:
    """Write ``value`` into every slot this forward must not read, in every layer; returns how many.

    Owned are the slots of the positions a request reads from the cache: its cached prefix
    (self-attention) or its encoder tokens (cross-attention). Everything else is garbage: free
    slots, the rest of a request's last page, and this forward's ``out_cache_loc`` (its new K/V
    come from the arguments and are written only after the kernel returned).
    """
    owned = torch.zeros(s.cache.num_slots, dtype=torch.bool)
    reads = batch.encoder_lens.tolist() if layer.is_cross_attention else batch.extend_prefix_lens_cpu
    for row, n in zip(batch.req_pool_indices_cpu, reads):
        owned[s.cache.req_to_token[row, :n]] = True
    for buf in s.cache.k_buffers + s.cache.v_buffers:
        buf[~owned] = value
    return int((~owned).sum())


@needs_kernels
@pytest.mark.parametrize("garbage", list(GARBAGE))
@pytest.mark.parametrize("sinks", [False, True], ids=["no_sinks", "sinks_softcap"])
@pytest.mark.parametrize("window", [None, 2], ids=["no_window", "window2"])
@pytest.mark.parametrize("ps", [1, 4, 16])
@pytest.mark.parametrize("mode", list(GARBAGE_MODES))
def test_garbage_in_unowned_slots_never_reaches_an_output(mode, ps, window, sinks, garbage):
    """NaN/inf in every slot no request owns, and just outside the buffers (so an unmasked load through
    a ``-1`` index would show), with ``req_to_token`` -1 where unassigned: the output equals the float64
    reference and is finite. Small split length and token blocks, so decode has empty splits (before the
    window, past a short request's end) and an extend request spans several programs."""
    dtype, value = GARBAGE[garbage]
    fmode, prefix, ext, kw = GARBAGE_MODES[mode]
    layer_kw: dict[str, Any] = {"sliding_window": window, "is_cross_attention": "encoder_lens" in kw}
    if sinks:  # with a soft-cap too: tanh of a garbage score must be selected away like the score
        layer_kw.update(sinks=torch.linspace(-1.0, 2.0, 8), logit_cap=3.0)
    s = make_setup(page_size=ps, dtype=dtype, layer_kw=layer_kw, canary=value, decode_split_len=4, block_n=16,
                   extend_rows=8)
    batch = make_batch(s, fmode, prefix, ext, **kw)
    assert fill_unowned(s, batch, s.layers[0], value) > 0
    out = run_and_check(s, batch)
    assert torch.isfinite(out).all()


@needs_kernels
@pytest.mark.parametrize("garbage", list(GARBAGE))
@pytest.mark.parametrize("mode", ["extend", "decode", "target_verify"])
def test_garbage_in_out_cache_loc_with_save_false(mode, garbage):
    """``save_kv_cache=False``: the new tokens' slots keep their garbage, and the output never sees it."""
    dtype, value = GARBAGE[garbage]
    fmode, prefix, ext, kw = GARBAGE_MODES[mode]
    s = make_setup(page_size=4, dtype=dtype, canary=value, decode_split_len=4, block_n=16,
                   layer_kw={"sinks": torch.linspace(0.0, 1.0, 8)})
    batch = make_batch(s, fmode, prefix, ext, **kw)
    fill_unowned(s, batch, s.layers[0], value)
    out = run_and_check(s, batch, save=False)
    assert torch.isfinite(out).all()
    k_cache, _ = s.cache.get_kv(0)
    assert (k_cache[batch.out_cache_loc].float().isnan() | k_cache[batch.out_cache_loc].float().isinf()).all()


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_name)
def test_a_value_no_query_sees_is_selected_out_not_multiplied_by_zero(dtype):
    """Target-verify with a mask under which no draft token sees the last one (not even itself), and
    NaN as that token's k and v: every output is finite and equals the reference (0 * NaN would not)."""
    s = make_setup(dtype=dtype, page_size=4)
    mask = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 1, 0]], dtype=torch.bool).expand(2, 3, 3).clone()
    batch = make_batch(s, ForwardMode.TARGET_VERIFY, [5, 9], [3, 3], spec_num_draft_tokens=3,
                       spec_custom_mask=mask)

    def poison_last_draft(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        for t in (2, 5):  # the third draft token of each request
            k[t], v[t] = float("nan"), float("nan")

    out = run_and_check(s, batch, edit=poison_last_draft)
    assert torch.isfinite(out).all()


@needs_kernels
@pytest.mark.parametrize("sinks", [False, True], ids=["no_sinks", "sinks"])
def test_combine_skips_empty_splits_whatever_their_partials_hold(sinks):
    """``_combine_kernel`` alone: a split that saw no key (running max -inf) contributes nothing even when
    its accumulator and sum hold NaN; a token whose every split is empty gets zeros (plus nothing from
    a sink's own value, which has no V)."""
    splits, T, H, DV = 3, 2, 4, 16
    g = torch.Generator().manual_seed(5)
    acc = torch.randn(splits, T, H, DV, generator=g)
    m = torch.randn(splits, T, H, generator=g)
    l = torch.rand(splits, T, H, generator=g) + 0.5
    acc[1], m[1], l[1] = float("nan"), float("-inf"), float("nan")  # token 0: split 1 empty
    acc[:, 1], m[:, 1], l[:, 1] = float("nan"), float("-inf"), float("nan")  # token 1: every split empty
    sink = torch.linspace(-1.0, 1.0, H)
    out = torch.full((T, H, DV), 7.0)
    K._combine_kernel[(T,)](
        acc, m, l, sink, out, acc.stride(0), acc.stride(1), acc.stride(2), m.stride(0), m.stride(1),
        out.stride(0), out.stride(1), splits, H=H, DV=DV, BLOCK_H=H, BLOCK_DV=DV, HAS_SINKS=sinks,
    )
    live = [0, 2]
    top = torch.stack([m[s_, 0] for s_ in live]).max(0).values
    if sinks:
        top = torch.maximum(top, sink)
    num = sum(torch.exp(m[s_, 0] - top)[:, None] * acc[s_, 0] for s_ in live)
    den = sum(torch.exp(m[s_, 0] - top) * l[s_, 0] for s_ in live) + (torch.exp(sink - top) if sinks else 0)
    torch.testing.assert_close(out[0], num / den[:, None], atol=1e-6, rtol=1e-5)
    assert torch.equal(out[1], torch.zeros(H, DV))


def _rejected(s: Setup, mode: str, case: str) -> tuple[Any, ...]:
    """(batch, q, k, v, layer) of a forward the backend must refuse, over a cache with NaN in every
    slot the valid version of the batch does not read."""
    layer = s.layers[0]
    prefix, ext = ([6, 13], [1, 1]) if mode == "decode" else ([6, 13], [3, 2])
    fmode = ForwardMode.DECODE if mode == "decode" else ForwardMode.EXTEND
    batch = make_batch(s, fmode, prefix, ext, req_ids=[3, 5])
    fill_unowned(s, batch, layer, float("nan"))
    q, k, v = qkv(s, layer, batch.num_tokens)
    rows, loc = batch.req_pool_indices_cpu, batch.out_cache_loc.clone()

    def rebuild(rows: list[int] = rows, loc: torch.Tensor = loc, seq: list[int] | None = None) -> ForwardBatch:
        if mode == "decode":
            return ForwardBatch.decode(rows, seq or [p + 1 for p in prefix], loc)
        return ForwardBatch.extend(rows, [x - e for x, e in zip(seq, ext)] if seq else prefix, ext, loc)

    if case == "q_float64":
        return batch, q.double(), k.double(), v.double(), layer
    if case == "q_int32":
        return batch, q.to(torch.int32), k.to(torch.int32), v.to(torch.int32), layer
    if case == "q_complex64":
        return batch, q.to(torch.complex64), k.to(torch.complex64), v.to(torch.complex64), layer
    if case == "k_dtype_differs":
        return batch, q, k.to(torch.float16), v, layer
    if case == "out_cache_loc_past_the_cache":
        bad = loc.clone()
        bad[-1] = s.cache.num_slots
        return rebuild(loc=bad), q, k, v, layer
    if case == "req_pool_index_past_the_rows":
        return rebuild(rows=[rows[0], s.cache.max_requests]), q, k, v, layer
    if case == "seq_len_past_max_context_len":
        return rebuild(seq=[prefix[0] + ext[0], s.cache.max_context_len + 1]), q, k, v, layer
    if case == "prefix_position_unassigned":
        s.cache.req_to_token[rows[1], 4] = -1
        return batch, q, k, v, layer
    if case == "layer_id_past_the_cache":
        return batch, q, k, v, dataclasses.replace(layer, layer_id=s.cache.num_layers)
    raise AssertionError(case)


REJECTED = {
    "q_float64": (AttnplugError, "dtype=float64 \\(supported: float32, float16, bfloat16\\)"),
    "q_int32": (AttnplugError, "dtype=int32"),
    "q_complex64": (AttnplugError, "dtype=complex64"),
    "k_dtype_differs": (ShapeError, "k"),
    "out_cache_loc_past_the_cache": (ShapeError, "out_cache_loc\\[\\d+\\]=\\d+ is out of range"),
    "req_pool_index_past_the_rows": (ShapeError, "req_pool_indices\\[1\\]=8 is out of range"),
    "seq_len_past_max_context_len": (ShapeError, "seq_lens=321 exceeds max_context_len=320"),
    "prefix_position_unassigned": (ShapeError, "position 4 .* is unassigned"),
    "layer_id_past_the_cache": (ShapeError, "layer_id=1 is out of range"),
}


@needs_kernels
@pytest.mark.parametrize("mode", ["extend", "decode"])
@pytest.mark.parametrize("case", list(REJECTED))
def test_a_rejected_forward_leaves_the_cache_byte_identical(case, mode):
    """Bad dtypes are refused per layer, bad indices once per forward; either way no byte of the cache
    (K/V of every layer, garbage NaN slots included, and req_to_token) changes."""
    s = make_setup(page_size=4, canary=float("nan"))
    batch, q, k, v, layer = _rejected(s, mode, case)
    before = cache_bytes(s.cache)
    exc, match = REJECTED[case]
    with pytest.raises(exc, match=match):
        s.backend.init_forward_metadata(batch)
        s.backend.forward(q, k, v, layer, batch)
    assert_cache_unchanged(s.cache, before)


@needs_kernels
@pytest.mark.parametrize("mode", ["extend", "decode"])
def test_a_kernel_that_raises_writes_nothing(monkeypatch, mode):
    """A launch failure (simulated: a GPU out of memory or a failed launch cannot happen here) escapes
    the forward and the new K/V were not written: the core writes them only after compute returned."""
    s = make_setup(page_size=4)
    fmode = ForwardMode.DECODE if mode == "decode" else ForwardMode.EXTEND
    batch = make_batch(s, fmode, [6, 13], [1, 1] if mode == "decode" else [3, 2])
    q, k, v = qkv(s, s.layers[0], batch.num_tokens)
    before = cache_bytes(s.cache)

    def launch_fails(*args: Any, **kw: Any) -> None:
        raise RuntimeError("simulated launch failure")

    monkeypatch.setattr(s.backend, "_attend", launch_fails)
    s.backend.init_forward_metadata(batch)
    with pytest.raises(RuntimeError, match="simulated launch failure"):
        s.backend.forward(q, k, v, s.layers[0], batch)
    assert_cache_unchanged(s.cache, before)


def _partials_per_token(layer: LayerSpec, splits: int) -> int:
    return splits * layer.num_heads * (layer.v_head_dim + 2) * 4


@needs_kernels
def test_decode_partials_are_chunked_under_the_workspace_limit():
    """Partials for the whole batch exceed ``max_workspace_bytes``: the decode runs in runs of requests
    that fit, and the output is bit-identical to one unbounded launch (and matches the reference)."""
    prefix = [69, 3, 40, 0, 22]  # longest 70 keys -> 5 splits of 16
    per_token = _partials_per_token(make_setup().layers[0], 5)
    limited = make_setup(decode_split_len=16, block_n=16, max_workspace_bytes=2 * per_token + 7, seed=3)
    free = make_setup(decode_split_len=16, block_n=16, seed=3)
    outs = []
    for s in (limited, free):
        batch = make_batch(s, ForwardMode.DECODE, prefix, [1] * 5)
        fill_unowned(s, batch, s.layers[0], float("nan"))
        outs.append(run_and_check(s, batch))
        meta = s.backend.build_metadata(batch)
        runs = s.backend.decode_chunks(meta, per_token, 5)
        assert runs == ([(0, 2), (2, 4), (4, 5)] if s is limited else [(0, 5)])
    assert same_bytes(outs[0], outs[1])


@needs_kernels
def test_a_decode_whose_partials_cannot_fit_is_refused_before_allocating():
    s = make_setup(decode_split_len=16, max_workspace_bytes=1000)
    batch = make_batch(s, ForwardMode.DECODE, [40, 3], [1, 1])
    q, k, v = qkv(s, s.layers[0], batch.num_tokens)
    before = cache_bytes(s.cache)
    s.backend.init_forward_metadata(batch)
    want = r"decode split-KV partials of one request \(3 splits x 1 token\).*max_workspace_bytes"
    with pytest.raises(ResourceLimitError, match=want):
        s.backend.forward(q, k, v, s.layers[0], batch)
    assert_cache_unchanged(s.cache, before)


# ---------------------------------------------------------------------------
# kernels: fixed tiles -> split-KV and multi-block extends agree, batch invariance
# ---------------------------------------------------------------------------


@needs_kernels
@pytest.mark.parametrize("split", [1, 7, 16, 1000])
def test_decode_split_lengths(split):
    s = make_setup(decode_split_len=split, block_n=16, dtype=torch.float32,
                   layer_kw={"sinks": torch.linspace(0.0, 2.0, 8), "sliding_window": 20})
    run_and_check(s, make_batch(s, ForwardMode.DECODE, [0, 16, 70, 33], [1, 1, 1, 1]))


@needs_kernels
@pytest.mark.parametrize("rows", [8, 16])
def test_extend_over_several_token_blocks(rows):
    # G = 4, so 2 or 4 tokens a program: every request spans several programs
    s = make_setup(extend_rows=rows, block_n=16, layer_kw={"sliding_window": 9})
    run_and_check(s, make_batch(s, ForwardMode.EXTEND, [5, 0, 40], [13, 7, 11]))
    run_and_check(s, make_batch(s, ForwardMode.TARGET_VERIFY, [5, 27], [4, 4], req_ids=[1, 2],
                                spec_num_draft_tokens=4))


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.EXTEND])
def test_request_alone_equals_request_in_a_batch(mode, dtype):
    s = make_setup(dtype=dtype, decode_split_len=16, block_n=16, layer_kw={"sinks": torch.linspace(0.0, 2.0, 8)})
    prefix, ext = ([3, 40, 150], [1, 1, 1]) if mode is ForwardMode.DECODE else ([3, 40, 150], [2, 9, 5])
    batch = make_batch(s, mode, prefix, ext)
    layer = s.layers[0]
    q, k, v = qkv(s, layer, batch.num_tokens)
    s.backend.init_forward_metadata(batch)
    together = s.backend.forward(q, k, v, layer, batch)
    t0 = ext[0]
    rows = slice(t0, t0 + ext[1])
    req = batch.req_pool_indices[1:2]
    loc = batch.out_cache_loc[rows]
    alone_batch = (ForwardBatch.decode(req, [prefix[1] + 1], loc) if mode is ForwardMode.DECODE
                   else ForwardBatch.extend(req, [prefix[1]], [ext[1]], loc))
    s.backend.init_forward_metadata(alone_batch)
    alone = s.backend.forward(q[rows], k[rows], v[rows], layer, alone_batch)
    assert torch.equal(together[rows], alone)
    s.backend.init_forward_metadata(batch)
    assert torch.equal(s.backend.forward(q, k, v, layer, batch), together)  # repeatable


@needs_kernels
def test_tiles_depend_on_the_layer_only():
    for decode in (True, False):
        for g in (1, 3, 4, 8, 64):
            for d, dv in ((64, 64), (128, 128), (256, 256), (192, 128), (512, 512)):
                for eb in (2, 4):
                    t = choose_tiles(decode, g, d, dv, eb, interpret=False)
                    assert t.block_r >= max(16, t.block_m * g) and t.block_n >= 16
                    assert t.block_r & (t.block_r - 1) == 0 and t.block_n & (t.block_n - 1) == 0
                    if decode:
                        assert t.block_m == 1
                    fits = smem_estimate(t.block_r, t.block_n, t.num_stages, d, dv, eb) <= SMEM_BUDGET
                    smallest = (t.block_m, t.block_n, t.num_stages) == (1, 16, 1)
                    assert fits or smallest, (decode, g, d, dv, eb, t)
    # the interpreter takes big blocks: few programs, few loop steps
    t = choose_tiles(False, 4, 128, 128, 4, interpret=True, extend_rows=256)
    assert (t.block_m, t.block_r, t.block_n) == (64, 256, 64)


# ---------------------------------------------------------------------------
# the GPU path: no GPU here, so compile ahead of time for GPU targets
# ---------------------------------------------------------------------------

_AOT = textwrap.dedent("""
    import json, sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from attnplug_triton.backend import choose_tiles
    from attnplug_triton.kernels import INTERPRETED, _attn_kernel, _combine_kernel

    assert not INTERPRETED
    p2 = lambda n: max(16, triton.next_power_of_2(n))
    kind, arch, warp = sys.argv[1], sys.argv[2], int(sys.argv[3])
    target = GPUTarget(kind, int(arch) if kind == "cuda" else arch, warp)
    out = []
    # (dtype, kv dtype, head_dim, v_head_dim, group, decode, cross-attention): an fp8 cache (dequantized
    # per block) in e5m2 everywhere, in e4m3 (fp8e4nv) where the GPU has it (SM89+)
    rows = [("bf16", "bf16", 128, 128, 8, True, False), ("fp16", "bf16", 192, 128, 4, False, False),
            ("fp32", "fp32", 64, 64, 1, False, False), ("fp16", "fp16", 64, 64, 2, True, True),
            ("bf16", "fp8e5", 128, 128, 8, True, False)]
    if kind == "cuda" and int(arch) >= 89:
        rows.append(("bf16", "fp8e4nv", 128, 128, 4, False, False))
    for dt, kv, d, dv, g, decode, cross in rows:
        t = choose_tiles(decode, g, d, dv, 4 if dt == "fp32" else 2, interpret=False)
        consts = dict(D=d, DV=dv, G=g, BLOCK_M=t.block_m, BLOCK_R=t.block_r, BLOCK_N=t.block_n, BLOCK_D=p2(d),
                      BLOCK_DV=p2(dv), STORE_PARTIALS=decode, IS_CROSS=cross, HAS_WINDOW=not cross,
                      HAS_CAP=not cross, HAS_SINKS=True, HAS_MASK=not decode, FP32_DOT=dt == "fp32",
                      KV_SCALED=kv.startswith("fp8"), IS_CAUSAL=cross or dt != "fp32")  # fp32: bidirectional
        types = {n: "*" + dt for n in ("Q", "K_new", "V_new", "Out")}
        types.update({"K_cache": "*" + kv, "V_cache": "*" + kv, "Req_to_token": "*i64", "Part_acc": "*fp32",
                      "Part_m": "*fp32", "Part_l": "*fp32", "Sinks": "*fp32", "Mask": "*u8", "Req": "*i64",
                      "Q_start": "*i64", "Prefix_len": "*i32", "Ext_len": "*i32", "scale": "fp32", "cap": "fp32",
                      "window": "i32", "split_len": "i32", "num_splits": "i32", "k_scale": "fp32",
                      "v_scale": "fp32"})
        sig = {n: "constexpr" if n in consts else types.get(n, "i64") for n in _attn_kernel.arg_names}
        k = triton.compile(ASTSource(_attn_kernel, sig, consts), target=target,
                           options=dict(num_warps=t.num_warps, num_stages=t.num_stages))
        out.append(k.metadata.shared)
    consts = dict(H=16, DV=128, BLOCK_H=16, BLOCK_DV=128, HAS_SINKS=True)
    sig = {n: "constexpr" if n in consts else ("*fp32" if n[0].isupper() else "i64") for n in _combine_kernel.arg_names}
    sig["Out"], sig["num_splits"] = "*bf16", "i32"
    triton.compile(ASTSource(_combine_kernel, sig, consts), target=target, options=dict(num_warps=4))
    print(json.dumps(out))
""")


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed (pip install triton)")
@pytest.mark.parametrize("target", [("cuda", "75", "32"), ("cuda", "90", "32"), ("hip", "gfx942", "64")],
                         ids=lambda t: t[0] + t[1])
def test_kernels_compile_for_gpus_within_shared_memory(target):
    """Triton's full compiler (to cubin / hsaco) accepts the kernels at the tiles the backend picks,
    and their shared memory fits the smallest limit of the targets (SM75: 64 KiB)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    proc = subprocess.run([sys.executable, "-c", _AOT, *target], capture_output=True, text=True, env=env, timeout=600)
    if proc.returncode and ("ptxas" in proc.stderr or "lld" in proc.stderr) and "not found" in proc.stderr.lower():
        pytest.skip(f"Triton's GPU toolchain is not usable here: {proc.stderr.strip().splitlines()[-1]}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    shared = json.loads(proc.stdout.strip().splitlines()[-1])
    assert max(shared) <= 64 << 10, shared
