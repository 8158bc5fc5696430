"""The core and its plugins obey their own rule: no decision reads the base field."""

from __future__ import annotations

from pathlib import Path

from attnplug.guard import assert_no_base_field_reads, find_base_field_reads

REPO = Path(__file__).resolve().parents[2]

#: The one exemption: the config module defines the field and the pair accessor,
#: whose fallback ``prefill or base`` is the only legitimate read of the base.
CONFIG_MODULE = REPO / "core" / "attnplug" / "config.py"

DECISION_TREES = {
    REPO / "core" / "attnplug": "core decisions read the pair attention_backends(), never the base field",
    REPO / "plugins": "plugins read the stamps or the pair, never the base field",
}


def test_core_and_plugins_never_read_the_base_field():
    assert_no_base_field_reads(DECISION_TREES, exclude=[CONFIG_MODULE])


def test_the_exemption_is_real():
    """The config module does read the base field, so the guard sees it and the exemption matters."""
    findings = find_base_field_reads({CONFIG_MODULE: "config"})
    assert any(f.expr == "self.attention_backend" for f in findings)
