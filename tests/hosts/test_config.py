"""Configuration reaches the runner from the standard flags or an AttentionConfig, through resolve."""

from __future__ import annotations

import argparse

import pytest

import hf_models as models
from attnplug import AttentionConfig
from attnplug.config import add_attention_args
from attnplug.errors import UnknownBackendError
from attnplug.integrations.transformers import TransformersRunner


def _parse(*argv):
    parser = argparse.ArgumentParser()
    add_attention_args(parser)
    return parser.parse_args(list(argv))


CPU = models.cpu_default()


@pytest.mark.parametrize("argv,pair", [
    ((), (CPU, CPU)),  # nothing set: resolved for the architecture and this CPU host
    (("--attention-backend", "auto"), (CPU, CPU)),
    (("--decode-attention-backend", "template"), (CPU, "template_sdpa")),
    (("--attention-backend", "torch", "--prefill-attention-backend", "triton"), ("triton", "torch_native")),
])
def test_flags_are_resolved_into_the_pair_the_runner_builds(argv, pair):
    runner = TransformersRunner(models.build("llama"), _parse(*argv), max_requests=1, max_context_len=32)
    assert runner.pair == pair
    assert (runner.backend.prefill_attention_backend_str, runner.backend.decode_attention_backend_str) == pair
    assert runner.arch == "LlamaForCausalLM"
    assert runner.resolution.config is runner.config


def test_an_unknown_backend_name_is_an_error_listing_what_is_installed():
    with pytest.raises(UnknownBackendError, match="unknown attention backend 'nope'.*torch_native"):
        TransformersRunner(models.build("llama"), AttentionConfig(attention_backend="nope"))
