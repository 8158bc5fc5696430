"""trtllm_mha's MLA call (``flashinfer.decode.trtllm_batch_decode_with_kv_cache_mla``) against flashinfer-python's
real signatures: each supported release's recorded one (0.6.0 … 0.7.4; the function moved from decode.py to
mla.py and then the mla package, decode re-exports it) and the installed package's, plus the preconditions in
``_library_contracts`` (4-D query, 32/64-token blocks of 576, int32 tables, one dtype, float scales). The
plugin runs on CPU with the emulator of ``tests/plugins/test_trtllm_mla.py`` (a mock: the kernel needs a GPU).
"""

from __future__ import annotations

import inspect

import pytest
import torch

import _library_contracts as C
from _drive import check_versions
from attnplug_trtllm_mha import LIBRARY, MIN_VERSION
from packaging.version import Version as version_key

import test_trtllm_mla as T

QUAL = "flashinfer.decode.trtllm_batch_decode_with_kv_cache_mla"
SUPPORTED = [(LIBRARY, v) for v in C.versions(LIBRARY) if version_key(v) >= version_key(MIN_VERSION)]


def _record(seq, page_size, kv_dtype=None):
    return C.record_mla_forward(QUAL, T.emulate_mla_decode.__wrapped__,
                                T.mla_problem(seq, page_size=page_size, kv_dtype=kv_dtype),
                                lambda cache, layer, kernel: T.build(cache, layer, kernel=kernel))


@pytest.mark.parametrize("page_size", [32, 64])
@pytest.mark.parametrize("kv_dtype", [None, torch.float8_e4m3fn])
def test_mla_decode_binds_to_every_supported_flashinfer_mocked_no_gpu(page_size, kv_dtype):
    calls = _record([1, 40, 97], page_size, kv_dtype)
    assert [c.qualname for c in calls] == [QUAL]
    check_versions(SUPPORTED, lambda lib, v: ([], calls))


def test_mla_decode_binds_to_the_installed_flashinfer():
    try:
        from flashinfer.decode import trtllm_batch_decode_with_kv_cache_mla as real
    except ImportError:
        pytest.skip("flashinfer-python is not installed in this environment")
    import importlib.metadata as im

    version = im.distribution(LIBRARY).version
    calls = _record([3, 70], 64)
    found = [p for c in calls for p in C.problems(c, LIBRARY, version, sig=inspect.signature(real))]
    assert not found, "\n".join(found)


def test_a_wrong_call_is_caught_by_the_binding():
    """The tier can fail: a 3-D query on 16-token blocks breaks two preconditions; a misspelt keyword does not
    bind; 0.5.0 (below the floor) has no ``sparse_mla_top_k``."""
    q = torch.zeros(2, 8, 576, dtype=torch.bfloat16)
    kv = torch.zeros(4, 16, 576, dtype=torch.bfloat16)
    i32 = torch.zeros(2, 3, dtype=torch.int32)
    bad = C.Call(QUAL, (), dict(query=q, kv_cache=kv, workspace_buffer=torch.zeros(8, dtype=torch.uint8),
                                qk_nope_head_dim=128, kv_lora_rank=512, qk_rope_head_dim=64, block_tables=i32,
                                seq_lens=i32[:, 0], max_seq_len=48))
    found = C.problems(bad, LIBRARY, "0.7.4")
    assert any("must be 4-D" in p for p in found) and any("supported block_size are 32 and 64" in p for p in found)
    typo = C.Call(QUAL, (), dict(bad.kwargs, block_table=i32))
    assert any("does not bind" in p for p in C.problems(typo, LIBRARY, "0.7.4"))
    assert any("does not bind" in p for p in C.problems(C.Call(QUAL, (), dict(bad.kwargs, sparse_mla_top_k=0)),
                                                          LIBRARY, "0.5.0"))
