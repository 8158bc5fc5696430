"""The configuration pair: each half falls back to the base field, for every combination."""

from __future__ import annotations

import argparse
import dataclasses
import itertools

import pytest

from attnplug import AttentionConfig
from attnplug.config import add_attention_args, config_from_args
from attnplug.errors import ConfigError

# (base, prefill, decode) -> expected (prefill, decode), written out by hand.
PAIR_TABLE = {
    (None, None, None): (None, None),
    ("b", None, None): ("b", "b"),
    (None, "p", None): ("p", None),
    (None, None, "d"): (None, "d"),
    ("b", "p", None): ("p", "b"),
    ("b", None, "d"): ("b", "d"),
    (None, "p", "d"): ("p", "d"),
    ("b", "p", "d"): ("p", "d"),
}


def test_table_covers_every_combination():
    assert set(PAIR_TABLE) == set(itertools.product([None, "b"], [None, "p"], [None, "d"]))


@pytest.mark.parametrize("fields,expected", sorted(PAIR_TABLE.items(), key=str))
def test_pair_with_base_fallback(fields, expected):
    base, prefill, decode = fields
    cfg = AttentionConfig(attention_backend=base, prefill_attention_backend=prefill, decode_attention_backend=decode)
    assert cfg.attention_backends() == expected
    assert cfg.is_split() == (expected[0] != expected[1])


def test_split_only_config_answers_from_the_fields_that_were_set():
    # The split-configuration bug: base unset, both halves set. The pair must not be (None, None).
    cfg = AttentionConfig(prefill_attention_backend="fa3", decode_attention_backend="flashinfer")
    assert cfg.attention_backends() == ("fa3", "flashinfer")


def test_config_is_immutable_and_replace_returns_new():
    cfg = AttentionConfig(attention_backend="x")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.attention_backend = "y"  # type: ignore[misc]
    new = cfg.replace(decode_attention_backend="z")
    assert cfg.attention_backends() == ("x", "x")
    assert new.attention_backends() == ("x", "z")


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"speculative_attention_mode": "verify"}, "speculative_attention_mode"),
        ({"attention_backend": ""}, "attention_backend"),
        ({"decode_attention_backend": 3}, "decode_attention_backend"),
        ({"page_size": 0}, "page_size"),
    ],
)
def test_bad_values_name_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        AttentionConfig(**kwargs)


def test_explicit_fields_are_what_differs_from_defaults():
    cfg = AttentionConfig(prefill_attention_backend="a", deterministic=True)
    assert cfg.explicit_fields() == {"prefill_attention_backend": "a", "deterministic": True}
    assert AttentionConfig().explicit_fields() == {}


def test_argparse_helper_adds_standard_flags_in_own_group():
    parser = argparse.ArgumentParser()
    group = add_attention_args(parser)
    assert group.title == "attention backends"
    ns = parser.parse_args(
        ["--prefill-attention-backend", "fa3", "--decode-attention-backend", "flashinfer",
         "--speculative-attention-mode", "decode", "--speculative-draft-attention-backend", "triton"]
    )
    cfg = config_from_args(ns)
    assert cfg.attention_backends() == ("fa3", "flashinfer")
    assert cfg.speculative_attention_mode == "decode"
    assert cfg.speculative_draft_attention_backend == "triton"
    assert cfg.explicit_fields().keys() == {
        "prefill_attention_backend", "decode_attention_backend", "speculative_attention_mode",
        "speculative_draft_attention_backend",
    }


def test_argparse_helper_rejects_unknown_speculative_mode(capsys):
    parser = argparse.ArgumentParser()
    add_attention_args(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--speculative-attention-mode", "both"])
    assert "speculative-attention-mode" in capsys.readouterr().err


def test_config_from_args_ignores_host_flags_and_takes_extra_fields():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model")
    add_attention_args(parser)
    ns = parser.parse_args(["--model", "m", "--attention-backend", "triton"])
    cfg = config_from_args(ns, page_size=16)
    assert cfg.attention_backends() == ("triton", "triton")
    assert cfg.page_size == 16
