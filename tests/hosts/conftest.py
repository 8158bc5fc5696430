"""The hosts tier: a real model library (transformers) served through attnplug.

Models are built from small configs with seeded random weights (``hf_models.py``);
transformers' own greedy ``generate()`` with eager attention is the reference,
computed once per architecture and shared by every backend's test.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="the hosts tier needs transformers (pinned in constraints.txt)")
os.environ.setdefault("TRITON_INTERPRET", "1")  # read when triton is first imported
sys.path.insert(0, str(Path(__file__).parent))

import hf_models as models

_REFS: dict[tuple[str, int], list] = {}


@pytest.fixture(scope="session")
def reference():
    """``reference(arch, new_tokens=32)``: per prompt, (token ids, [steps, vocab] logits), memoised."""

    def get(arch: str, new_tokens: int = models.NEW_TOKENS, lens: tuple[int, ...] = models.PROMPT_LENS):
        key = (arch, new_tokens, lens)
        if key not in _REFS:
            _REFS[key] = models.reference(models.build(arch), models.prompts(lens), new_tokens)
        return _REFS[key]

    return get
