"""The one support query (attnplug.support): one description of what is asked, one wording of why not.

Built from a build context, from a configuration half and from a suite case, it gives the same reasons for
the same ask; ``Registry.build``, the chain, the suite and ``not_supported_reasons`` all answer with it.
"""

from __future__ import annotations

import pytest

from attnplug import AttentionConfig, BuildContext, Capabilities, HostInfo, LayerSpec
from attnplug.errors import NotSupportedError, PluginError
from attnplug.resolution.passes import support_problems
from attnplug.support import SupportQuery, device_kind, reasons
from attnplug.testing.suite import cases as C

NARROW = Capabilities(dtypes=("bfloat16",), page_sizes=(16,), head_dims=(128,), sliding_window=False,
                      deterministic=False, cuda_graph=False, speculative_verify=False, devices=("cuda",),
                      kv_layouts=("nhd",))
CPU = HostInfo(platform="cpu")
ROCM = HostInfo(platform="rocm", gfx_arch="gfx942")
WINDOW = LayerSpec(layer_id=2, num_heads=4, num_kv_heads=4, head_dim=128, sliding_window=8)
WIDE = LayerSpec(layer_id=5, num_heads=4, num_kv_heads=4, head_dim=256)


@pytest.mark.parametrize("fields,expected", [
    ({"dtype": "float16"}, ["dtype=float16 (supported: bfloat16)"]),
    ({"page_size": 8}, ["page_size=8 (supported: 16)"]),
    ({"kv_layout": "hnd"}, ["kv_layout=hnd (reads: nhd)"]),
    ({"deterministic": True}, ["deterministic (batch-invariant) output is not claimed"]),
    ({"cuda_graph": True}, ["CUDA-graph capture is not claimed"]),
])
def test_a_config_half_and_a_query_give_the_same_words(fields: dict, expected: list[str]) -> None:
    cfg = AttentionConfig(**fields)
    got = reasons(SupportQuery.from_config(cfg, "decode"), NARROW)
    assert [r for r in got if not r.startswith("kv_cache_dtype")] == expected

    class View:
        def get(self, name: str):  # the chain's view, reduced to what support_problems reads
            return type("D", (), {"capabilities": NARROW})()

    assert support_problems(View(), "narrow", cfg, "decode") == got


@pytest.mark.parametrize("mode,half,refused", [("prefill", "prefill", True), ("prefill", "decode", False),
                                               ("decode", "decode", True), ("decode", "prefill", False)])
def test_target_verify_is_asked_of_the_half_that_serves_it(mode: str, half: str, refused: bool) -> None:
    cfg = AttentionConfig(speculative_attention_mode=mode, dtype="bfloat16",
                          extra={"speculative_algorithm": "EAGLE"})
    got = reasons(SupportQuery.from_config(cfg, half), NARROW)
    assert ("forward mode target_verify is not claimed" in got) is refused, got


def test_layers_are_named_once_per_reason_and_the_floor_is_one_of_the_reasons() -> None:
    q = SupportQuery(layers=(WINDOW, WIDE, WINDOW.__class__(layer_id=7, num_heads=4, num_kv_heads=4, head_dim=256)),
                     floor_problem="backend 'x' (d) needs lib >= 2, found 1")
    assert reasons(q, NARROW) == ["layer 2: sliding_window=8 is not claimed",
                                  "layer 5: head_dim=256 (supported: 128)",
                                  "backend 'x' (d) needs lib >= 2, found 1"]
    # a query about one layer (not_supported_reasons, a suite case) words its reasons bare
    assert reasons(q.replace(layers=(WINDOW,), name_layers=False, floor_problem=None), NARROW) == \
        ["sliding_window=8 is not claimed"]


@pytest.mark.parametrize("device,host,kind", [("cuda:0", None, "cuda"), ("cuda", ROCM, "rocm"), ("cpu", ROCM, "cpu"),
                                              ("cuda:1", HostInfo(platform="cuda", compute_capability=(9, 0)), "cuda")])
def test_device_kind_names_rocm_devices_as_the_host_does(device: str, host: HostInfo | None, kind: str) -> None:
    assert device_kind(device, host) == kind


def test_not_supported_reasons_reads_the_context_through_the_query() -> None:
    """The backend's own answer now includes the device as the host names it (ROCm) -- the drift the
    separate translation had."""
    from attnplug.backend import AttentionBackend

    class Rocm(AttentionBackend):
        capabilities = Capabilities(devices=("rocm",), dtypes=("bfloat16",))

    ctx = BuildContext(config=AttentionConfig(), host=ROCM, device="cuda:0", dtype="bfloat16")
    assert Rocm().not_supported_reasons(WINDOW, ctx) == ["sliding_window=8 is not claimed"]
    cpu_ctx = BuildContext(config=AttentionConfig(), host=ROCM, device="cpu", dtype="bfloat16")
    assert Rocm().not_supported_reasons(WINDOW, cpu_ctx) == ["device=cpu (supported: rocm)",
                                                            "sliding_window=8 is not claimed"]


def test_every_suite_skip_reason_is_the_querys_answer() -> None:
    caps = Capabilities(dtypes=("float32",), page_sizes=(1, 16), head_dims=(64,), sliding_window=True)
    seen = refused = 0
    for case in [c for fam in C.GENERATORS for c in C.cases_for(fam, caps)]:
        if case.family == "cuda_graph":
            continue
        want = reasons(C.case_query(case).replace(backend="b"), caps)
        assert C.skip_reason(case, caps, "b") == (f"{C.NOT_CLAIMED} b: {'; '.join(want)}" if want else None)
        seen, refused = seen + 1, refused + bool(want)
    assert seen > 10 and 0 < refused < seen


def test_build_refuses_a_library_below_its_floor_before_the_factory_runs() -> None:
    """The floor is Registry.build's (flashinfer and aiter no longer re-check it in their factories)."""
    import types

    from attnplug import BackendDescriptor, hookimpl
    from attnplug.registry import Registry, in_process_source

    ran = []

    def factory(ctx):  # never reached on the old library
        ran.append(ctx)
        raise AssertionError("the factory ran")

    mod = types.ModuleType("floored")

    @hookimpl
    def attnplug_register_backends(register):
        register(BackendDescriptor(name="floored", factory=factory, capabilities=Capabilities(),
                                   library="somelib", min_library_version="2.1"))

    mod.attnplug_register_backends = attnplug_register_backends
    for version, refused in (("2.0.9", True), ("2.1.post1", False)):
        host = HostInfo(platform="cpu", libraries={"somelib": version})
        reg = Registry(host=host)
        reg.load_sources([in_process_source(mod, "attnplug-floored")])
        ctx = BuildContext(config=AttentionConfig(), host=host)
        if refused:
            with pytest.raises(NotSupportedError, match=r"needs somelib >= 2.1, found 2.0.9") as info:
                reg.build("floored", ctx)
            assert "kernel library's floor" in str(info.value) and not ran
        else:
            with pytest.raises(PluginError, match="the factory ran"):
                reg.build("floored", ctx)
            assert ran
