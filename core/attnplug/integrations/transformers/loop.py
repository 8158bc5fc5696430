"""A continuous-batching greedy generation loop over a :class:`~.runner.TransformersRunner`.

The shape of a serving engine's loop: requests arrive at given steps, join
the running batch while others decode (their prompt forward and the others'
decode tokens share one ``MIXED`` forward), finish at different steps (their
own ``max_new_tokens`` or an end-of-sequence token) and leave at once, their
pages and request row freed for the next arrival. Every forward is ragged: no
padding token is ever sent to attention.

Each step: admit arrived requests while fewer than ``max_running`` run and the
step's new tokens stay within ``max_step_tokens``; run one forward over the
prompts of the admitted requests and the last token of the running ones; pick
each request's next token with the ``sampler`` (greedy by default).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Callable, Sequence

import torch

from .runner import Chunk, StepRecord, TransformersRunner

__all__ = ["GenerationResult", "Request", "Sampler", "generate", "greedy"]

#: ``sampler(rid, index, logits) -> token``: ``index`` counts the request's generated tokens (0 first).
Sampler = Callable[[Any, int, torch.Tensor], int]


@dataclasses.dataclass(frozen=True)
class Request:
    prompt: Sequence[int]
    max_new_tokens: int
    #: the step at which the request arrives (0: before the first forward)
    arrival: int = 0
    eos_token_id: int | None = None

    def __post_init__(self) -> None:
        if len(self.prompt) < 1:
            raise ValueError("Request.prompt is empty (a request needs at least one prompt token)")
        if self.max_new_tokens < 1:
            raise ValueError(f"Request.max_new_tokens={self.max_new_tokens} (expected >= 1)")


@dataclasses.dataclass
class GenerationResult:
    #: generated token ids, per request index
    tokens: list[list[int]]
    #: per request, the float32 logits each of its tokens was chosen from (when recorded)
    logits: list[list[torch.Tensor]] | None
    #: the step each request joined and finished at
    joined: list[int]
    finished: list[int]
    #: one record per forward (mode, requests, tokens, serving kernel)
    steps: list[StepRecord]
    #: the loop step of each forward (steps with nothing to run are skipped)
    forward_steps: list[int]


#: ``generate`` with the ``greedy`` sampler takes every row's argmax at once (tests switch it off to compare)
_ONE_ARGMAX = True


def greedy(rid: Any, index: int, logits: torch.Tensor) -> int:
    return int(torch.argmax(logits))


def generate(
    runner: TransformersRunner,
    requests: Sequence[Request],
    *,
    max_running: int = 8,
    max_step_tokens: int | None = None,
    sampler: Sampler = greedy,
    record_logits: bool = False,
) -> GenerationResult:
    """Serve ``requests`` with continuous batching; request ``i`` is ``rid=i`` in the runner. The loop runs
    under ``torch.inference_mode`` (entered once, not per forward): the logits the ``sampler`` gets and
    ``record_logits`` keeps are inference tensors, as ``runner.forward`` returns them anyway."""
    if max_running < 1:
        raise ValueError(f"max_running={max_running} (expected >= 1)")
    with torch.inference_mode():
        return _generate(runner, requests, max_running, max_step_tokens, sampler, record_logits)


def _generate(runner: TransformersRunner, requests: Sequence[Request], max_running: int,
              max_step_tokens: int | None, sampler: Sampler, record_logits: bool) -> GenerationResult:
    n = len(requests)
    tokens: list[list[int]] = [[] for _ in range(n)]
    logits: list[list[torch.Tensor]] | None = [[] for _ in range(n)] if record_logits else None
    joined, finished = [-1] * n, [-1] * n
    waiting = collections.deque(sorted(range(n), key=lambda i: (requests[i].arrival, i)))
    running: list[int] = []
    first_step = len(runner.steps)
    forward_steps: list[int] = []
    step = 0
    while waiting or running:
        chunks = [Chunk(i, (tokens[i][-1],), decode=True) for i in running]
        budget = None if max_step_tokens is None else max_step_tokens - len(chunks)
        while waiting and requests[waiting[0]].arrival <= step and len(running) < max_running:
            i = waiting[0]
            cost = len(requests[i].prompt)
            if budget is not None and cost > budget and chunks:
                break  # no room this step; it joins a later one
            waiting.popleft()
            running.append(i)
            joined[i] = step
            chunks.append(Chunk(i, tuple(requests[i].prompt)))
            if budget is not None:
                budget -= cost
        if not chunks:  # nothing runs until the next arrival
            step = requests[waiting[0]].arrival
            continue
        out = runner.forward(chunks)
        forward_steps.append(step)
        # greedy: every row's argmax in one call and one read (``greedy`` per row takes a row view, the
        # argmax and its read: three calls a request); the same first maximal index, NaN counted as the maximum
        picked = torch.argmax(out, dim=-1).tolist() if sampler is greedy and _ONE_ARGMAX else None
        for row, chunk in enumerate(chunks):
            i = chunk.rid
            tok = picked[row] if picked is not None else int(sampler(i, len(tokens[i]), out[row]))
            tokens[i].append(tok)
            if logits is not None:
                logits[i].append(out[row].clone())
            req = requests[i]
            if len(tokens[i]) >= req.max_new_tokens or (req.eos_token_id is not None and tok == req.eos_token_id):
                running.remove(i)
                runner.release(i)
                finished[i] = step
        step += 1
    return GenerationResult(tokens, logits, joined, finished, list(runner.steps[first_step:]), forward_steps)
