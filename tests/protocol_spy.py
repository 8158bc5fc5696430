"""One protocol spy and one way to call any protocol method, shared by the container/wrapper tests.

``RecordingBackend`` implements only the required methods, answers its tag from every forward and
records each call it gets; ``ProtocolSpy`` (a mixin in front of any backend class) records every
protocol method looked up on the instance, optional ones included, so a test sees which child a
container or wrapper routed a call to (``SpyBackend``: the spy in front of ``RecordingBackend``);
``call_protocol_method`` calls one method by name with placeholder arguments.
"""

from __future__ import annotations

from typing import Any

from attnplug.backend import PROTOCOL_METHODS, AttentionBackend


class RecordingBackend(AttentionBackend):
    """Implements only the required methods; answers ``tag`` from every forward and records each call
    (``(method, forward_mode)``) in ``calls``."""

    def __init__(self, tag: Any = "r") -> None:
        self.tag = tag
        self.calls: list[tuple[str, Any]] = []

    def init_forward_metadata(self, batch: Any) -> None:
        self.calls.append(("init_forward_metadata", batch.forward_mode))

    def forward_extend(self, q: Any, k: Any, v: Any, layer: Any, batch: Any, save_kv_cache: bool = True) -> Any:
        self.calls.append(("forward_extend", batch.forward_mode))
        return self.tag

    def forward_decode(self, q: Any, k: Any, v: Any, layer: Any, batch: Any, save_kv_cache: bool = True) -> Any:
        self.calls.append(("forward_decode", batch.forward_mode))
        return self.tag


class ProtocolSpy:
    """Mixin: ``self.names`` lists the protocol methods looked up on this object, in order."""

    names: list[str]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.__dict__["names"] = []
        super().__init__(*args, **kwargs)

    def __getattribute__(self, name: str) -> Any:
        if name in PROTOCOL_METHODS:
            object.__getattribute__(self, "__dict__").setdefault("names", []).append(name)
        return object.__getattribute__(self, name)


class SpyBackend(ProtocolSpy, RecordingBackend):
    """A ``RecordingBackend`` that also records every protocol method looked up on it by name."""


def call_protocol_method(backend: Any, name: str, batch: Any, layer: Any) -> Any:
    """``backend.<name>(...)`` with placeholder arguments (q/k/v ``None``; ``batch`` and ``layer`` as given)."""
    args = {
        "init_forward_metadata": (batch,),
        "forward": (None, None, None, layer, batch),
        "forward_extend": (None, None, None, layer, batch),
        "forward_decode": (None, None, None, layer, batch),
        "not_supported_reasons": (layer,),
        "init_cuda_graph_state": (4, 4),
        "init_forward_metadata_capture_cuda_graph": (batch,),
        "init_forward_metadata_replay_cuda_graph": (batch,),
        "get_cuda_graph_seq_len_fill_value": (),
        "on_after_cuda_graph_warmup": (),
    }
    if set(args) != set(PROTOCOL_METHODS):  # a new protocol method needs its placeholder arguments here
        raise AssertionError(f"call_protocol_method knows {sorted(args)}, the protocol is {sorted(PROTOCOL_METHODS)}")
    return getattr(backend, name)(*args[name])
