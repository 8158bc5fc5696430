"""``import attnplug`` and the integration package import neither transformers nor torch."""

from __future__ import annotations

import subprocess
import sys


def test_importing_attnplug_and_the_integration_loads_neither_torch_nor_transformers():
    code = (
        "import sys, attnplug, attnplug.integrations, attnplug.integrations.transformers as t\n"
        "assert 'generate' in t.__all__ and 'TransformersRunner' in dir(t)\n"
        "heavy = sorted(m for m in ('torch', 'transformers') if m in sys.modules)\n"
        "print(heavy)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_using_a_name_loads_transformers():
    code = ("import sys, attnplug.integrations.transformers as t\n"
            "t.TransformersRunner\n"
            "print('transformers' in sys.modules, 'torch' in sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True", "True"]
