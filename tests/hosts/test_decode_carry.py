"""cpu_fused's decode forwards carry the previous decode forward's work and prepared calls through the transformers
host (issue 30, round 8: ``CpuFusedBackend._carry``): the very logits of the path that builds them every forward.

Requests join and finish at different steps (the batch size changes, rows are reused by later requests), at page
sizes where decode steps open pages: the tokens and every logit bit for bit equal with the carry on and off, and
at batch 1 every decode forward after the first of a request carries.
"""

from __future__ import annotations

import pytest
import torch

import hf_models as models
from attnplug import AttentionConfig, ForwardMode
from attnplug.integrations.transformers import Request, TransformersRunner, generate

def _record(monkeypatch, runner) -> list:
    """Every metadata the runner's backend builds, in order."""
    metas: list = []
    build = runner.backend.build_metadata

    def recorded(batch):
        metas.append(build(batch))
        return metas[-1]
    monkeypatch.setattr(runner.backend, "build_metadata", recorded)
    return metas


pytestmark = pytest.mark.skipif(models.cpu_default() != "cpu_fused", reason="cpu_fused's kernel is not installed")


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_the_carry_gives_the_very_logits_of_the_rebuilt_work(page_size, monkeypatch):
    from attnplug_cpu_fused import backend as cf_backend

    prompts = models.prompts((7, 3, 12, 5))
    reqs = [Request(p, n, arrival=a) for p, n, a in zip(prompts, (9, 4, 6, 8), (0, 0, 2, 5))]
    out, carried = {}, {}
    for on in (True, False):
        monkeypatch.setattr(cf_backend, "_CARRY", on)
        runner = TransformersRunner(models.build("llama"), AttentionConfig(attention_backend="cpu_fused"),
                                    max_requests=3, max_context_len=64, page_size=page_size)
        metas = _record(monkeypatch, runner)
        out[on] = generate(runner, reqs, max_running=2, record_logits=True)
        carried[on] = sum(m.carried for m in metas)
    assert out[True].tokens == out[False].tokens
    for a, b in zip(out[True].logits, out[False].logits):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert carried[False] == 0 and carried[True] > 0


def test_every_decode_forward_at_batch_1_after_the_first_carries(monkeypatch):
    runner = TransformersRunner(models.build("llama"), AttentionConfig(attention_backend="cpu_fused"),
                                max_requests=1, max_context_len=64, page_size=4)
    metas = _record(monkeypatch, runner)
    for _ in range(2):  # the second request follows the first's decode forwards: an extend between
        generate(runner, [Request(models.prompts((6,))[0], 10)], max_running=1)
    modes = [(m.mode, m.carried) for m in metas]
    first = (ForwardMode.EXTEND, False), (ForwardMode.DECODE, False)
    assert modes == [*first, *[(ForwardMode.DECODE, True)] * 8] * 2, modes
