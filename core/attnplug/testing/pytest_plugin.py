"""attnplug pytest plugin (placeholder while the conformance suite is written)."""
from __future__ import annotations


def pytest_addoption(parser):  # type: ignore[no-untyped-def]
    group = parser.getgroup("attnplug", "attnplug conformance suite")
    group.addoption("--backend", action="append", default=[], dest="attnplug_backends",
                    help="run the attnplug conformance suite against this backend (repeatable; 'all')")
