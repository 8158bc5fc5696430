"""The margin rule itself (see greedy_rule.py)."""

from __future__ import annotations

import pytest
import torch

from attnplug.testing.tolerances import Tolerance, tolerance_for
from greedy_rule import Follower, MarginViolation, check_step, margin

TOL = Tolerance(atol=1e-3, rtol=0.0)  # margin 2e-3


def test_margin_is_twice_the_tolerance_at_the_top_logit():
    fp32 = tolerance_for("float32")
    assert margin(torch.tensor([2.0, -3.0]), fp32) == pytest.approx(2 * (fp32.atol + fp32.rtol * 2.0))


def test_clear_step_requires_the_reference_token():
    ref = torch.tensor([0.0, 1.0, 0.5])
    assert check_step(ref, 1, TOL) is False
    with pytest.raises(MarginViolation, match="clear step .* chose 2, reference 1"):
        check_step(ref, 2, TOL)


def test_near_tie_accepts_any_tied_token_and_nothing_else():
    ref = torch.tensor([1.0, 1.0015, 0.9990, 0.5])  # top-2 gap 1.5e-3 <= 2e-3; tied: >= 0.9995
    assert check_step(ref, 1, TOL) is True
    assert check_step(ref, 0, TOL) is True
    with pytest.raises(MarginViolation, match=r"not among the tied tokens \[0, 1\]"):
        check_step(ref, 2, TOL)
    with pytest.raises(MarginViolation):
        check_step(ref, 3, TOL)


def test_follower_continues_from_the_reference_token_and_counts_ties():
    ref_logits = [torch.tensor([[0.0, 1.0], [1.0, 1.0005]])]
    f = Follower([[1, 1]], ref_logits, TOL)
    assert f(0, 0, torch.tensor([0.0, 1.0])) == 1
    # near-tie: the backend picks 0, the follower returns the reference's 1 and records the tie
    assert f(0, 1, torch.tensor([1.0005, 1.0])) == 1
    assert f.near_ties == [(0, 1)] and f.checked == 2
    with pytest.raises(MarginViolation, match="request 0, token 0: clear step"):
        f(0, 0, torch.tensor([1.0, 0.0]))
