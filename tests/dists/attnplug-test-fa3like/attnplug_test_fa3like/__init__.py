"""Test plugin: ``fake_fa3`` and ``fake_flashinfer`` stand in for GPU families.

No kernel library and no torch: their backends record calls instead of
computing, which is all the registry and stamp tests need.
"""

from attnplug import BackendDescriptor, Capabilities, hookimpl

CAPS = Capabilities(devices=("cpu",), speculative_verify=True, draft_extend=True)


@hookimpl
def attnplug_register_backends(register):
    register(BackendDescriptor(name="fake_fa3", factory="attnplug_test_fa3like.kernels:make_fa3",
                               capabilities=CAPS, aliases=("fa3_alias",), priority={"cpu": 5}))
    register(BackendDescriptor(name="fake_flashinfer", factory="attnplug_test_fa3like.kernels:make_flashinfer",
                               capabilities=CAPS, deprecated_aliases=("old_flashinfer",), priority={"cpu": 4}))
    register(BackendDescriptor(name="fake_gpu_only", factory="attnplug_test_fa3like.kernels:make_fa3",
                               capabilities=Capabilities(devices=("cuda",)),
                               probe=lambda host: [] if host.sm() and host.sm() >= 90 else ["needs SM90+"]))


@hookimpl
def attnplug_resolve_name(name, host):
    # A host-dependent name: picks by host, the way a hybrid constructor would.
    if name == "fake_hybrid":
        return "fake_fa3" if host.platform == "cuda" else "fake_flashinfer"
    return None
