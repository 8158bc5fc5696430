"""Run a plugin backend over a problem with its library calls recorded (emulators do the math)."""

from __future__ import annotations

from typing import Any

import _library_contracts as C
from attnplug import ForwardMode


def forward(backend: Any, pb: Any, *, save: bool = True) -> Any:
    """One forward of ``pb`` (either helper family's problem object) through ``backend``."""
    backend.init_forward_metadata(pb.batch)
    fwd = backend.forward_decode if pb.batch.forward_mode is ForwardMode.DECODE else backend.forward_extend
    return fwd(pb.q, pb.k, pb.v, pb.layer, pb.batch, save_kv_cache=save)


def unchecked(emulator: Any) -> Any:
    """The emulator without its own precondition check (this tier reports per version instead)."""
    return getattr(emulator, "__wrapped__", emulator)


def assert_binds(calls: list[C.Call], library: str, version: str, declared: tuple[str, ...] | None = None) -> None:
    assert calls, "the plugin made no library call"
    found = [p for call in calls for p in C.problems(call, library, version)]
    assert not found, "\n".join(dict.fromkeys(found))


def check_versions(library_versions: list[tuple[str, str]], run_at: Any) -> dict[str, list[str]]:
    """For each ``(library, version)``: ``run_at(library, version)`` returns ``(refusals, calls)``. A refused
    combination is fine (the plugin said no in words); an accepted one must bind and meet every
    precondition. Returns ``{"library version": refusals}`` so callers can assert which were refused."""
    assert library_versions, "no recorded signatures for the library the plugin declares"
    verdicts: dict[str, list[str]] = {}
    failures: list[str] = []
    for library, version in library_versions:
        refusals, calls = run_at(library, version)
        verdicts[f"{library} {version}"] = refusals
        if refusals:
            continue
        assert calls, f"{library} {version}: the plugin accepted the layer but made no library call"
        failures += [p for call in calls for p in C.problems(call, library, version)]
        failures += C.sequence_problems(calls, library, version)
    assert not failures, "\n".join(dict.fromkeys(failures))
    return verdicts
