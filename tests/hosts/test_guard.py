"""The integration is a host engine too: its modules pass the static guard a host runs in its CI."""

from __future__ import annotations

from pathlib import Path

from attnplug.guard import assert_no_base_field_reads, find_base_field_reads

PKG = Path(__file__).resolve().parents[2] / "core" / "attnplug" / "integrations" / "transformers"


def test_integration_modules_never_read_the_base_field():
    files = sorted(PKG.glob("*.py"))
    assert {f.name for f in files} >= {"runner.py", "attention.py", "loop.py", "cache.py", "layers.py"}
    assert_no_base_field_reads({str(f): "the transformers integration decides per forward" for f in files})


def test_the_guard_would_catch_a_base_field_read_here(tmp_path):
    bad = tmp_path / "runner.py"
    bad.write_text("def pick(config):\n    return config.attention_backend\n")
    assert find_base_field_reads([bad])
