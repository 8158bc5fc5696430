"""Probes that read ``HostInfo`` only (never this machine), so hand-built hosts decide."""

from __future__ import annotations

from typing import Callable

from attnplug.host import HostInfo


def needs_library(dist: str) -> Callable[[HostInfo], list[str]]:
    def probe(host: HostInfo) -> list[str]:
        if host.library_version(dist) is None:
            return [f"ModuleNotFoundError: distribution {dist!r} is not installed on this host"]
        return []

    return probe


def all_of(*probes: Callable[[HostInfo], list[str]]) -> Callable[[HostInfo], list[str]]:
    def probe(host: HostInfo) -> list[str]:
        return [r for p in probes for r in p(host)]

    return probe


def sm_in(allowed: tuple[int, ...]) -> Callable[[HostInfo], list[str]]:
    def probe(host: HostInfo) -> list[str]:
        sm = host.sm()
        if sm is None or sm not in allowed:
            return [f"needs SM{'/'.join(map(str, allowed))}; this host is {host.describe().split(';')[0]}"]
        return []

    return probe


def not_a_backend(ctx):  # factory placeholder: resolution never builds
    raise RuntimeError("resolution tests never build backends")
