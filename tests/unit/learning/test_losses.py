"""MADPO losses against numbers worked out by hand.

Series used below: −log σ(x) = log 2 − x/2 + x²/8 − x⁴/192 + …, and σ(x) = 1/2 + x/4 − x³/48 + ….
"""

from __future__ import annotations

import math

import pytest
import torch

from pbrl.learning.losses import madpo_agent_loss, madpo_loss, preference_accuracy

BETA = 0.1
# margins [0.5, −0.2]: joint Δ = 0.3, β Δ = 0.03.
# −log σ(0.03)  = 0.693147180559945 − 0.015 + 0.0001125 − 0.0000000042 = 0.678259676341449
LOSS_POS = 0.678259676341449
# −log σ(−0.03) = 0.693147180559945 + 0.015 + 0.0001125 − 0.0000000042 = 0.708259676341448
LOSS_NEG = 0.708259676341448
# ∂L/∂Δ_i = −β σ(−β Δ) = −0.1 · (0.5 − 0.0075 + 0.0000005625) = −0.04925005625
GRAD_POS = -0.04925005625


def test_hand_worked_pair_loss() -> None:
    margins = torch.tensor([[0.5, -0.2]], dtype=torch.float64)
    torch.testing.assert_close(madpo_loss(margins, BETA), torch.tensor([LOSS_POS], dtype=torch.float64))


def test_swapping_winner_and_loser_negates_the_margin() -> None:
    margins = torch.tensor([[-0.5, 0.2]], dtype=torch.float64)
    torch.testing.assert_close(madpo_loss(margins, BETA), torch.tensor([LOSS_NEG], dtype=torch.float64))


def test_zero_margins_give_log_two() -> None:
    loss = madpo_loss(torch.zeros(3, 2, dtype=torch.float64), BETA)
    torch.testing.assert_close(loss, torch.full((3,), math.log(2.0), dtype=torch.float64))


def test_batch_loss_is_the_mean_of_per_pair_values() -> None:
    margins = torch.tensor([[0.5, -0.2], [-0.5, 0.2]], dtype=torch.float64)
    per_pair = madpo_loss(margins, BETA)
    torch.testing.assert_close(per_pair, torch.tensor([LOSS_POS, LOSS_NEG], dtype=torch.float64))
    # (0.678259676341449 + 0.708259676341448) / 2 = 0.693259676341449
    torch.testing.assert_close(per_pair.mean(), torch.tensor(0.693259676341449, dtype=torch.float64))


def test_agent_loss_has_the_joint_value_and_the_joint_weight_for_every_agent() -> None:
    margins = torch.tensor([[0.5, -0.2], [-0.5, 0.2]], dtype=torch.float64)
    joint = margins.sum(dim=1)
    expected_grad = -BETA * torch.sigmoid(-BETA * joint)  # formula, per pair
    torch.testing.assert_close(expected_grad[0], torch.tensor(GRAD_POS, dtype=torch.float64))
    for agent in range(margins.shape[1]):
        own = margins[:, agent].clone().requires_grad_(True)
        others = (joint - margins[:, agent]).clone().requires_grad_(True)
        loss = madpo_agent_loss(own, others, BETA)
        torch.testing.assert_close(loss.detach(), madpo_loss(margins, BETA))
        loss.sum().backward()
        torch.testing.assert_close(own.grad, expected_grad)
        assert others.grad is None  # the other agents' margins receive no gradient


def test_three_agents_share_the_weight() -> None:
    margins = torch.tensor([[0.4, -0.3, 0.2]], dtype=torch.float64, requires_grad=True)
    madpo_loss(margins, 1.0).sum().backward()
    # Δ = 0.3, β = 1: every agent gets −σ(−0.3) = −(1 / (1 + e^0.3)) = −0.425557483188341
    torch.testing.assert_close(margins.grad, torch.full((1, 3), -0.425557483188341, dtype=torch.float64))


def test_large_margins_stay_finite() -> None:
    margins = torch.tensor([[1e4, 0.0], [-1e4, 0.0]], requires_grad=True)
    loss = madpo_loss(margins, 1.0)
    # −log σ(1e4) underflows to 0; −log σ(−1e4) = 1e4 + log(1 + e^−1e4) = 1e4.
    torch.testing.assert_close(loss.detach(), torch.tensor([0.0, 1e4]))
    loss.sum().backward()
    assert torch.isfinite(margins.grad).all()
    own = torch.tensor([-1e4, 1e4], requires_grad=True)
    agent_loss = madpo_agent_loss(own, torch.tensor([-1e4, 1e4]), 1.0)
    torch.testing.assert_close(agent_loss.detach(), torch.tensor([2e4, 0.0]))
    agent_loss.sum().backward()
    torch.testing.assert_close(own.grad, torch.tensor([-1.0, 0.0]))


def test_preference_accuracy_counts_strictly_positive_joint_margins() -> None:
    margins = torch.tensor([[0.5, -0.2], [0.1, -0.4], [0.0, 0.0], [-1.0, 3.0]])
    # joint margins 0.3, −0.3, 0.0, 2.0 → 2 of 4 are > 0
    assert preference_accuracy(margins).item() == pytest.approx(0.5)


def test_bad_arguments_are_rejected() -> None:
    with pytest.raises(ValueError, match="beta"):
        madpo_loss(torch.zeros(1, 2), 0.0)
    with pytest.raises(ValueError, match=r"\(b, a\)"):
        madpo_loss(torch.zeros(2), 0.1)
    with pytest.raises(ValueError, match="own_margin"):
        madpo_agent_loss(torch.zeros(2), torch.zeros(3), 0.1)
    with pytest.raises(ValueError, match="margins"):
        preference_accuracy(torch.zeros(0, 2))
