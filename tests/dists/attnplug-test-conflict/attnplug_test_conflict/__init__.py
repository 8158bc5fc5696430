"""Test plugin that registers ``fake_fa3`` (owned by attnplug-test-fa3like) and an alias clash."""

from attnplug import BackendDescriptor, hookimpl


@hookimpl
def attnplug_register_backends(register):
    register(BackendDescriptor(name="fake_fa3", factory="x:y"))
    register(BackendDescriptor(name="conflict_ok", factory="x:y", aliases=("fa3_alias",)))
