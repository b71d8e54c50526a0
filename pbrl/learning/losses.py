"""MADPO preference losses: reference-free DPO on the joint margin of all agents (SPEC §5.5).

Source: DPO (Rafailov et al. 2023, "Direct Preference Optimization", eq. 7) without a reference model,
in the multi-agent joint-margin form of CoMLRL's preference trainer: with per-agent margins
Δ_i = log π_i(a^w_i | h_i) − log π_i(a^l_i | h_i) and joint margin Δ = Σ_i Δ_i, the per-pair loss is
−log σ(β Δ). Agent i is trained on −log σ(β (Δ_i + sg(Σ_{j≠i} Δ_j))) (sg = stop-gradient), so its
gradient is −β σ(−β Δ) ∇Δ_i: the weight depends on the joint margin, the gradient flows only through
the agent's own margin.

Shape legend: b batch (pairs), a agents. Margins are log-probability differences in nats; β is in 1/nats,
so β Δ is unitless and the losses are in nats.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _check_beta(beta: float) -> None:
    if not beta > 0:
        raise ValueError(f"beta: got {beta!r}; must be > 0")


def madpo_loss(margins: torch.Tensor, beta: float) -> torch.Tensor:
    """Per-pair MADPO loss −log σ(β Σ_i Δ_i) on the joint margin.

    Args:
        margins: (b, a) per-agent margins Δ_i in nats (winner minus loser sequence log-prob).
        beta: inverse temperature β > 0 (``dpo_beta``).

    Returns:
        (b,) per-pair losses in nats; the batch loss is their mean. Computed with ``F.logsigmoid``, so
        margins of any size give finite values.

    Raises:
        ValueError: ``margins`` is not 2-D, or ``beta`` is not > 0.
    """
    _check_beta(beta)
    if margins.ndim != 2:
        raise ValueError(f"margins: got shape {tuple(margins.shape)}; expected (b, a)")
    return -F.logsigmoid(beta * margins.sum(dim=-1))


def madpo_agent_loss(own_margin: torch.Tensor, other_margins: torch.Tensor, beta: float) -> torch.Tensor:
    """Per-pair loss of one agent: −log σ(β (Δ_i + sg(Σ_{j≠i} Δ_j))).

    Same value as :func:`madpo_loss` on the full margins, but only ``own_margin`` receives gradient:
    ∂L/∂Δ_i = −β σ(−β Δ) with Δ the joint margin; ``other_margins`` is detached here.

    Args:
        own_margin: (b,) agent i's margins Δ_i in nats, differentiable.
        other_margins: (b,) the other agents' summed margins Σ_{j≠i} Δ_j in nats (zeros for one agent).
        beta: inverse temperature β > 0.

    Returns:
        (b,) per-pair losses in nats.

    Raises:
        ValueError: the two inputs are not both (b,) with the same b, or ``beta`` is not > 0.
    """
    _check_beta(beta)
    if own_margin.ndim != 1 or own_margin.shape != other_margins.shape:
        raise ValueError(
            f"own_margin {tuple(own_margin.shape)} and other_margins {tuple(other_margins.shape)} "
            "must both have shape (b,)"
        )
    return -F.logsigmoid(beta * (own_margin + other_margins.detach()))


def preference_accuracy(margins: torch.Tensor) -> torch.Tensor:
    """Share of pairs whose joint margin Σ_i Δ_i is strictly positive (the winner is more likely).

    Args:
        margins: (b, a) per-agent margins in nats, b ≥ 1.

    Returns:
        Scalar float tensor in [0, 1] (no gradient). A joint margin of exactly 0 counts as wrong.

    Raises:
        ValueError: ``margins`` is not 2-D or has no rows.
    """
    if margins.ndim != 2 or margins.shape[0] == 0:
        raise ValueError(f"margins: got shape {tuple(margins.shape)}; expected (b, a) with b >= 1")
    return (margins.detach().sum(dim=-1) > 0).float().mean()
