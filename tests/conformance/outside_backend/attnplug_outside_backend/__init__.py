"""Descriptor module of a test-only outside distribution (no torch here).

``outside_v01``: a minimal backend written from the 0.1 docs. It implements
``AttentionBackend`` directly (not ``PagedBackend``), keeps its own bounds
check, writes the new K/V into the cache first and reads every request's keys
back through ``req_to_token`` padded to the batch's longest request, masking
padding by multiplying probabilities by zero. All of that met level 0.1.

``outside_paged``: the same backend upgraded the way the failure messages of
level 0.2 say: it subclasses ``PagedBackend`` (bounds checks, refusal, the KV
write placed after compute, metadata) and its compute reads only the slots a
request owns (``read_kv``), takes the new K/V from its arguments and masks by
selecting.
"""

from __future__ import annotations

from attnplug import BackendDescriptor, Capabilities, hookimpl

CAPABILITIES = Capabilities(dtypes=("float32",), devices=("cpu",))


@hookimpl
def attnplug_register_backends(register):  # type: ignore[no-untyped-def]
    register(BackendDescriptor(
        name="outside_v01", factory="attnplug_outside_backend.kernel:create_v01", capabilities=CAPABILITIES,
        description="an outside backend certified at conformance level 0.1", conformance_level="0.1",
    ))
    register(BackendDescriptor(
        name="outside_paged", factory="attnplug_outside_backend.kernel:create_paged", capabilities=CAPABILITIES,
        description="outside_v01 upgraded: a PagedBackend subclass", conformance_level="0.4",
    ))
