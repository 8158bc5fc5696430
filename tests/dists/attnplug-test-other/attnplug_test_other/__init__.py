"""Test plugin: ``fake_triton`` (well behaved; builds a recording backend)."""

from attnplug import BackendDescriptor, Capabilities, hookimpl


def make(ctx):
    from attnplug_test_fa3like.kernels import RecordingBackend

    return "fake_triton", RecordingBackend("fake_triton")


@hookimpl
def attnplug_register_backends(register):
    register(BackendDescriptor(name="fake_triton", factory=make, capabilities=Capabilities(devices=("cpu",)),
                               priority={"cpu": 3}))
