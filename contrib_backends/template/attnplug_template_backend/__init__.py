"""Descriptor module of the ``template_sdpa`` backend.

This is what the ``attnplug.backends`` entry point names. It must stay light:
no torch, no kernel library. It declares the backend's name, aliases,
capabilities (every claim is tested by ``pytest --backend=template_sdpa``) and
where the factory lives; the kernel module ``attnplug_template_backend.backend``
is imported only when the backend is built.
"""

from __future__ import annotations

from attnplug import BackendDescriptor, Capabilities, hookimpl
from attnplug.hookspecs import RegisterBackend
from attnplug.probes import module_missing

NAME = "template_sdpa"

#: Claim only what the kernel implements. Unclaimed features (soft-cap, sinks,
#: cross-attention, CUDA graphs) are skipped by the conformance suite with the
#: reason, and refused by ``not_supported_reasons``.
CAPABILITIES = Capabilities(
    dtypes=("float32", "float16", "bfloat16"),
    head_dims=None,
    v_head_dim_differs=True,
    page_sizes=None,
    gqa=True,
    mqa=True,
    sliding_window=True,
    logit_softcap=False,
    sinks=False,
    cross_attention=False,
    speculative_verify=True,
    draft_extend=True,
    cuda_graph=False,
    deterministic=True,  # one request at a time: a request's output never depends on its batch
    devices=("cpu",),
)


@hookimpl
def attnplug_register_backends(register: RegisterBackend) -> None:
    register(
        BackendDescriptor(
            name=NAME,
            factory="attnplug_template_backend.backend:create",
            capabilities=CAPABILITIES,
            probe=module_missing("torch", "pip install torch"),
            aliases=("template",),
            priority={},  # never a default: chosen only by name
            library="torch",
            description="template backend: per-request torch SDPA over the paged cache",
            conformance_level="0.2",  # the level its CI checks (pyproject: --conformance-level)
        )
    )
