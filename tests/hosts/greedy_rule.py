"""The margin rule for comparing greedy token ids where float near-ties meet argmax.

Random-weight models make near-tied logits likely, and two correct attention
implementations round differently. The rule, per generated token:

* ``margin = 2 * (atol + rtol * |top-1 reference logit|)`` with the dtype's
  tolerance from ``attnplug.testing.tolerances``. If every logit is within
  tolerance of the reference, the argmax can only differ when the reference's
  top-1/top-2 gap is at most this margin; so:
* **clear step** (reference gap > margin): the backend's argmax must equal the
  reference token;
* **near-tie** (gap <= margin): the backend's argmax must be one of the tied
  tokens (reference logit >= top-1 - margin); both runs then continue from the
  *reference's* token, so one tie never makes the rest of the comparison moot.

``Follower`` is a sampler for ``attnplug.integrations.transformers.generate``
that applies the rule at every step and always returns the reference token; a
violation raises at the step where it happens. ``follow_reference`` runs ``generate`` with one and
checks the whole run against the reference (tokens, steps checked, every logit within tolerance).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch

from attnplug.testing.tolerances import Tolerance


class MarginViolation(AssertionError):
    pass


def margin(ref_logits: torch.Tensor, tol: Tolerance) -> float:
    return 2.0 * tol.bound(float(ref_logits.max().abs()))


def check_step(ref_logits: torch.Tensor, choice: int, tol: Tolerance) -> bool:
    """Apply the rule to one step; returns True for a near-tie, raises ``MarginViolation``."""
    m = margin(ref_logits, tol)
    top = torch.topk(ref_logits, 2).values
    gap = float(top[0] - top[1])
    best = int(torch.argmax(ref_logits))
    if gap > m:
        if choice != best:
            raise MarginViolation(f"clear step (gap {gap:.3g} > margin {m:.3g}): chose {choice}, reference {best}")
        return False
    tied = set(torch.nonzero(ref_logits >= top[0] - m).flatten().tolist())
    if choice not in tied:
        raise MarginViolation(f"near-tie (gap {gap:.3g} <= margin {m:.3g}): chose {choice}, "
                              f"not among the tied tokens {sorted(tied)}")
    return True


@dataclasses.dataclass
class Follower:
    """Sampler: checks the backend's argmax against the reference, then follows the reference."""

    ref_tokens: Sequence[Sequence[int]]
    ref_logits: Sequence[torch.Tensor]
    tol: Tolerance
    near_ties: list[tuple[Any, int]] = dataclasses.field(default_factory=list)
    checked: int = 0

    def __call__(self, rid: Any, index: int, logits: torch.Tensor) -> int:
        choice = int(torch.argmax(logits))
        try:
            tie = check_step(self.ref_logits[rid][index], choice, self.tol)
        except MarginViolation as exc:
            raise MarginViolation(f"request {rid}, token {index}: {exc}") from None
        if tie:
            self.near_ties.append((rid, index))
        self.checked += 1
        return int(self.ref_tokens[rid][index])


def follow_reference(runner: Any, ref: Sequence[tuple[Sequence[int], torch.Tensor]], prompts: Sequence[Any],
                     lens: Sequence[int], new_tokens: int, tol: Tolerance) -> tuple[Any, Follower]:
    """``generate`` on ``prompts`` (of ``lens`` tokens) with a ``Follower`` of ``ref`` (per prompt: the reference's
    tokens and logits), checked: the reference's tokens, every step checked by the margin rule, every logit
    within ``tol`` of the reference's. Returns the result and the follower."""
    from attnplug.integrations.transformers import Request, generate

    follower = Follower([t for t, _ in ref], [lg for _, lg in ref], tol)
    res = generate(runner, [Request(p, new_tokens) for p in prompts], sampler=follower, record_logits=True)
    assert res.tokens == [t for t, _ in ref]
    assert follower.checked == len(lens) * new_tokens
    for i, (_, ref_logits) in enumerate(ref):
        got = torch.stack(res.logits[i])
        excess = (got - ref_logits).abs() - (tol.atol + tol.rtol * ref_logits.abs())
        assert float(excess.max()) <= 0, f"prompt {i} (len {lens[i]}): logits off by {float(excess.max())} past tol"
    return res, follower
