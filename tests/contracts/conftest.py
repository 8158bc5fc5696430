"""The library contract tier: every library call each GPU plugin makes, bound against the real
signatures (``signatures.json``; the installed flashinfer-python) and the libraries' preconditions.

The plugins' emulators and the precondition table live in ``tests/plugins``; this tier imports them.
"""

from __future__ import annotations

import sys
from pathlib import Path

PLUGIN_TESTS = Path(__file__).resolve().parents[1] / "plugins"
if str(PLUGIN_TESTS) not in sys.path:
    sys.path.insert(0, str(PLUGIN_TESTS))
