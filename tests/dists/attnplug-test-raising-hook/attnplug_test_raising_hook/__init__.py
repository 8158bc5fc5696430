"""Test plugin whose register hook raises after registering one backend."""

from attnplug import BackendDescriptor, hookimpl


@hookimpl
def attnplug_register_backends(register):
    register(BackendDescriptor(name="half_registered", factory="x:y"))
    raise RuntimeError("boom from the register hook")
