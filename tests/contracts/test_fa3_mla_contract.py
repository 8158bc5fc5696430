"""fa3's MLA call (``sgl_kernel.flash_attn.flash_attn_with_kvcache`` with ``qv=``, SGLang's FA3 MLA mode) against
sgl-kernel's real signatures (0.3.0 … 0.3.21 and sglang-kernel 0.4.10, read from the wheels by
``scripts/extract_signatures.py``; every one has ``qv``) and FA3's ``q_v`` preconditions in ``_library_contracts``
(q/k head size <= 64, V head size <= 512, fp16/bf16, qv shaped like q with the V width). The plugin runs on CPU
with the emulator of ``tests/plugins/test_fa3_mla.py`` (a mock: the kernel needs a Hopper GPU).
"""

from __future__ import annotations

import pytest
import torch

import _fa3_family_helpers as H
import _library_contracts as C
from _drive import check_versions
from attnplug import ForwardMode
from attnplug_fa3.backend import LIBRARY_CALLS
from packaging.version import Version as version_key

import test_fa3_mla as T

QUAL = "sgl_kernel.flash_attn.flash_attn_with_kvcache"
MIN_SGL_KERNEL = H.registry("attnplug-fa3").get("fa3").min_library_version  # the floor the plugin declares
SUPPORTED = [(lib, v) for lib in ("sgl-kernel", "sglang-kernel") for v in C.versions(lib)
             if version_key(v) >= version_key(MIN_SGL_KERNEL)]


def _record(case, page_size, dtype):
    mode, prefix, ext, tree = T.CASES[case]
    problem = T.mla_problem(prefix, ext, mode=mode, page_size=page_size, tree=tree, dtype=dtype)
    return C.record_mla_forward(QUAL, T.emulate_fa3_mla.__wrapped__, problem,
                                lambda cache, layer, kernel: T.build(cache, layer, kernel=kernel))


def test_the_mla_call_is_the_listed_one_and_has_qv_in_every_supported_release():
    assert LIBRARY_CALLS == (QUAL,)
    assert SUPPORTED and all("qv" in C.signature(lib, v, QUAL).parameters for lib, v in SUPPORTED)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("page_size", [1, 64])
@pytest.mark.parametrize("case", sorted(T.CASES))
def test_mla_calls_bind_to_every_supported_sgl_kernel_mocked_no_gpu(case, page_size, dtype):
    calls = _record(case, page_size, dtype)
    assert [c.qualname for c in calls] == [QUAL] and calls[0].kwargs["qv"] is not None
    verdicts = check_versions(SUPPORTED, lambda lib, v: ([], calls))
    assert not any(verdicts.values())


def test_a_wrong_mla_call_is_caught_by_the_binding():
    """The tier can fail: the whole 576-wide query as q beside qv breaks q_v's head-size rule and FA3's V-dim
    rule; an fp8 latent breaks q_v's dtype rule; a misspelt keyword (q_v) does not bind."""
    calls = _record("decode", 16, torch.bfloat16)
    kw = dict(calls[0].kwargs)
    wide = C.Call(QUAL, (), dict(kw, q=torch.zeros(*kw["q"].shape[:-1], 576, dtype=torch.bfloat16),
                                 k_cache=torch.zeros(*kw["k_cache"].shape[:-1], 576, dtype=torch.bfloat16)))
    found = C.problems(wide, "sgl-kernel", "0.3.21")
    assert any("q_v is only supported for head_size <= 64" in p for p in found), found
    assert any("V head dim 512 differs from Q/K head dim 576" in p for p in found), found
    f8 = C.Call(QUAL, (), {n: (t.to(torch.float8_e4m3fn) if n in ("q", "qv", "k_cache", "v_cache") else t)
                           for n, t in kw.items()})
    assert any("q_v needs fp16/bf16 q" in p for p in C.problems(f8, "sgl-kernel", "0.3.21"))
    typo = C.Call(QUAL, (), {("q_v" if n == "qv" else n): t for n, t in kw.items()})
    assert any("does not bind" in p for p in C.problems(typo, "sgl-kernel", "0.3.0"))


@pytest.mark.parametrize("mode", [ForwardMode.DECODE])
def test_the_mha_calls_still_bind_with_the_new_preconditions(mode):
    """The q_v / V-dim checks added for MLA accept fa3's ordinary calls (v_head_dim == head_dim, no qv)."""
    import test_fa3

    p = H.make_problem(dtype=torch.bfloat16, head_dim=64, page_size=16, mode=mode, ext=(1, 1, 1))
    rec = C.Recorder()
    be = test_fa3.build(p)
    be.kernel = rec.wrap(QUAL, test_fa3.emulate_flash_attn_with_kvcache.__wrapped__)
    test_fa3.run(p, be)
    check_versions(SUPPORTED, lambda lib, v: ([], rec.calls))
