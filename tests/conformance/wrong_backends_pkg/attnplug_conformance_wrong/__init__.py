"""Descriptor module of a test-only distribution of deliberately wrong backends.

``conf_reference`` is correct (the float64 reference, cast back, with every
check before any write): the control. ``conf_narrow`` is the same correct
kernel claiming little (float32, MHA, no feature or speculative mode): the
control for refusal cases.
Each other backend breaks one thing while claiming it, and the conformance
suite must fail exactly the cases that exercise that thing.
"""

from __future__ import annotations

from attnplug import BackendDescriptor, Capabilities, hookimpl

CAPABILITIES = Capabilities(
    dtypes=("float32", "float16", "bfloat16"),
    kv_cache_dtypes=("float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"),
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

#: what ``conf_narrow`` claims: float32 only, MHA only, no optional feature or speculative mode
NARROW = Capabilities(dtypes=("float32",), kv_cache_dtypes=("float32",), gqa=False, mqa=False, devices=("cpu",))

#: what the MLA backends (``mla_kernel.py``) claim: both MLA forms in every mode kind, besides ordinary attention
MLA_CAPABILITIES = Capabilities(
    dtypes=("float32", "float16", "bfloat16"),
    kv_cache_dtypes=("float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"),
    v_head_dim_differs=True,
    speculative_verify=True,
    draft_extend=True,
    devices=("cpu",),
    mla_forms={"decode": ("absorbed", "unabsorbed"), "extend": ("absorbed", "unabsorbed")},
)

#: MLA backend name -> its bug (None: correct); see mla_kernel.py
MLA_BUGS = {
    "conf_mla_reference": None,
    "conf_mla_wrong_slice": "the absorbed form reads values from the wrong slice of the latent row",
    "conf_mla_scale576": "the MLA softmax scale from the latent width (1/sqrt(576)), not LayerSpec.scaling",
}

#: backend name -> the bug its kernel has (None: correct)
BUGS = {
    "conf_reference": None,
    "conf_narrow": None,
    "conf_no_scale": "drops the softmax scale",
    "conf_no_window": "ignores the sliding window",
    "conf_kv_off_by_one": "writes the KV cache one slot off",
    "conf_no_sinks": "ignores attention sinks",
    "conf_default_scale": "ignores LayerSpec.scaling (always 1/sqrt(head_dim))",
    "conf_pad_multiply": "multiplies masked padding values by zero (NaN/inf in a padding slot leaks)",
    "conf_write_first": "writes the new K/V before validating the forward",
    "conf_no_bounds": "does not check indices or lengths against their bounds",
    "conf_reused_output": "returns one reused output buffer from every forward",
    "conf_mask_everywhere": "applies a verify mask in every mode",
    "conf_new_from_cache": "reads the new tokens back through req_to_token instead of from k/v",
    "conf_nan_when_empty": "returns NaN for a query row with no visible key",
    "conf_no_v_scale": "reads an fp8 cache's values without their V scale",
    "conf_chunk_drops_last": "under a small max_workspace_bytes, a decode in pieces forgets the last request",
    "conf_workspace_oom": "under a small max_workspace_bytes, raises MemoryError (not ResourceLimitError)",
}


@hookimpl
def attnplug_register_backends(register):  # type: ignore[no-untyped-def]
    for name, bug in BUGS.items():
        register(BackendDescriptor(
            name=name,
            factory=f"attnplug_conformance_wrong.kernel:create_{name}",
            capabilities=NARROW if name == "conf_narrow" else CAPABILITIES,
            aliases=(name.replace("conf_", "confalias_"),),
            description=bug or "correct",
        ))
    for name, bug in MLA_BUGS.items():
        register(BackendDescriptor(
            name=name,
            factory=f"attnplug_conformance_wrong.mla_kernel:create_{name}",
            capabilities=MLA_CAPABILITIES,
            description=bug or "correct (MLA)",
        ))
    register(BackendDescriptor(
        name="conf_unavailable",
        factory="imaginary_kernels:create",
        capabilities=CAPABILITIES,
        probe=lambda host: ["ModuleNotFoundError: No module named 'imaginary_kernels'"],
        description="never available: for the usage-error message",
    ))
