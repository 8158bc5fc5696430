"""Small helpers shared by the suite's test modules."""

from __future__ import annotations

from typing import Any, NoReturn

import pytest

from ...registry import default_registry


def capabilities(name: str) -> Any:
    """The capabilities ``name`` declares in its descriptor (what cases are generated from)."""
    return default_registry().get(name).capabilities


def fail(msg: str, requirement: str | None = None) -> NoReturn:
    """Fail this case with ``msg``. ``requirement``: the id in ``requirements.REQUIREMENTS`` this check
    enforces when it is not the family's own (a requirement added to the family later); the pytest
    plugin appends that requirement's contract, how to meet it and its docs anchor, and decides by its
    level whether the failure fails the run (``--conformance-level``)."""
    try:
        pytest.fail(msg, pytrace=False)
    except pytest.fail.Exception as exc:
        exc.attnplug_requirement = requirement  # type: ignore[attr-defined]
        raise
