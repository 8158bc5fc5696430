"""Small helpers shared by the suite's test modules."""

from __future__ import annotations

from typing import Any

import pytest

from ...registry import default_registry


def capabilities(name: str) -> Any:
    """The capabilities ``name`` declares in its descriptor (what cases are generated from)."""
    return default_registry().get(name).capabilities


def fail(msg: str) -> None:
    pytest.fail(msg, pytrace=False)
