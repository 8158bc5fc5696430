"""Descriptor module of a test-only distribution of deliberately wrong backends.

``conf_reference`` is correct (the float64 reference, cast back): the control.
Each other backend breaks one thing while claiming it, and the conformance
suite must fail exactly the cases that exercise that thing.
"""

from __future__ import annotations

from attnplug import BackendDescriptor, Capabilities, hookimpl

CAPABILITIES = Capabilities(
    dtypes=("float32", "float16", "bfloat16"),
    kv_cache_dtypes=("float32", "float16", "bfloat16"),
    v_head_dim_differs=True,
    sliding_window=True,
    logit_softcap=True,
    sinks=True,
    cross_attention=True,
    speculative_verify=True,
    draft_extend=True,
    deterministic=True,
    devices=("cpu",),
)

#: backend name -> the bug its kernel has (None: correct)
BUGS = {
    "conf_reference": None,
    "conf_no_scale": "drops the softmax scale",
    "conf_no_window": "ignores the sliding window",
    "conf_kv_off_by_one": "writes the KV cache one slot off",
    "conf_no_sinks": "ignores attention sinks",
}


@hookimpl
def attnplug_register_backends(register):  # type: ignore[no-untyped-def]
    for name, bug in BUGS.items():
        register(BackendDescriptor(
            name=name,
            factory=f"attnplug_conformance_wrong.kernel:create_{name}",
            capabilities=CAPABILITIES,
            aliases=(name.replace("conf_", "confalias_"),),
            description=bug or "correct",
        ))
    register(BackendDescriptor(
        name="conf_unavailable",
        factory="imaginary_kernels:create",
        capabilities=CAPABILITIES,
        probe=lambda host: ["ModuleNotFoundError: No module named 'imaginary_kernels'"],
        description="never available: for the usage-error message",
    ))
