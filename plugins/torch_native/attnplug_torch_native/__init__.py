"""Descriptor module of the ``torch_native`` backend (light: no torch import here).

The kernel module ``attnplug_torch_native.backend`` is imported only when the
backend is built.
"""

from __future__ import annotations

from typing import Any

from attnplug import BackendDescriptor, Capabilities, hookimpl
from attnplug.probes import module_missing
from attnplug.hookspecs import RegisterBackend

NAME = "torch_native"

CAPABILITIES = Capabilities(
    dtypes=("float32", "float16", "bfloat16"),
    # fp8 caches: each gathered block is dequantized (stored * the layer's scale) into the model
    # dtype's arithmetic; never the whole cache
    kv_cache_dtypes=("float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"),
    # the nhd cache is indexed in place; any other layout is read through PagedKVCache.read_kv
    # (only the slots a block needs), so torch_native can serve either half of any pair
    kv_layouts=None,
    head_dims=None,
    v_head_dim_differs=True,
    page_sizes=None,
    gqa=True,
    mqa=True,
    sliding_window=True,
    logit_softcap=True,
    sinks=True,
    cross_attention=True,
    bidirectional=True,
    speculative_verify=True,
    draft_extend=True,
    cuda_graph=False,
    # Not claimed: repeated forwards are bit-identical (tested), and on CPU a request's output
    # was also observed bit-identical alone or batched with longer requests, but that rests on
    # the BLAS choosing the same reduction order whatever the padded length and block split,
    # which neither MKL nor cuBLAS promises (and these capabilities cover every device).
    deterministic=False,
    devices=("cpu", "cuda", "rocm", "xpu"),
    # MLA layers (docs/mla.md): both forms in every mode, eager (attnplug_torch_native/mla.py)
    mla_forms={"decode": ("absorbed", "unabsorbed"), "extend": ("absorbed", "unabsorbed")},
)


@hookimpl
def attnplug_register_backends(register: RegisterBackend) -> None:
    register(
        BackendDescriptor(
            name=NAME,
            factory="attnplug_torch_native.backend:create",
            capabilities=CAPABILITIES,
            # the level this repository's CI runs its suite at (tox -e tests: pytest --backend=all)
            conformance_level="0.4",
            probe=module_missing("torch", "pip install torch"),
            aliases=("torch",),
            # The fallback everywhere; the default on hosts without better kernels.
            priority={"cpu": 10, "cuda": 1, "rocm": 1, "xpu": 1, "npu": 1},
            library="torch",
            description="exact paged attention in plain PyTorch (eager decode, SDPA extend): the readable reference and the fallback everywhere",
        )
    )


#: MLA architectures (docs/mla.md): their attention layers are MLA layers (``LayerSpec.mla``)
MLA_ARCHITECTURES = ("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM")


def mla_on_cpu(host: Any, config: Any) -> dict[str, Any]:
    """an MLA model (DeepSeek-V2/V3) on a CPU host: torch_native serves both MLA forms in every mode"""
    return {"attention_backend": NAME} if host.platform == "cpu" else {}


@hookimpl
def attnplug_arch_overrides(register):  # type: ignore[no-untyped-def]
    for arch in MLA_ARCHITECTURES:
        register(arch, mla_on_cpu)
