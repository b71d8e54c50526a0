"""Every loss of pbrl, each a pure function of tensors: MADPO's preference losses, the reward model's
Bradley–Terry loss, the policy-gradient loss and the k3 KL estimate of MARLHF's RL step, and the critics'
clipped value loss.

MADPO (reference-free DPO on the joint margin of all agents, docs/design/algorithms.md#madpo). Source: DPO (Rafailov
et al. 2023, "Direct Preference Optimization", eq. 7) without a reference model,
in the multi-agent joint-margin form of CoMLRL's preference trainer: with per-agent margins
Δ_i = log π_i(a^w_i | h_i) − log π_i(a^l_i | h_i) and joint margin Δ = Σ_i Δ_i, the per-pair loss is
−log σ(β Δ). Agent i is trained on −log σ(β (Δ_i + sg(Σ_{j≠i} Δ_j))) (sg = stop-gradient), so its
gradient is −β σ(−β Δ) ∇Δ_i: the weight depends on the joint margin, the gradient flows only through
the agent's own margin.

Shape legend: b batch (pairs), a agents, n rollouts, c completion tokens. Margins are log-probability differences in
nats; β is in 1/nats,
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


# ---------------------------------------------------------------------------------------------- reward model
def bradley_terry_loss(winner_scores: torch.Tensor, loser_scores: torch.Tensor) -> torch.Tensor:
    """Per-pair Bradley–Terry loss −log σ(R(w) − R(l)), shape (b,), nats (softplus form, stable for any
    margin). Source: Bradley and Terry 1952; the reward-model loss of Ouyang et al. 2022, eq. 1."""
    return F.softplus(-(winner_scores - loser_scores))


# ---------------------------------------------------------------------------------------------- RL
def policy_gradient_loss(advantages: torch.Tensor, logps: torch.Tensor) -> torch.Tensor:
    """−mean_j A_j · log π(a^j | h): advantages (n,) (constants), logps (n,) summed token log-probs → scalar."""
    return -(advantages.to(logps.device, logps.dtype) * logps).mean()


def k3_kl(policy_logps: torch.Tensor, reference_logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-sequence KL estimate Σ_t k3_t over completion tokens, k3 = exp(Δ) − Δ − 1 with Δ = ℓ_ref − ℓ
    (Schulman 2020, "Approximating KL divergence"). Each term is ≥ 0 and 0 exactly when Δ = 0.

    Args:
        policy_logps, reference_logps: (n, c) token log-probs of the sampled completion tokens, nats.
        mask: (n, c) bool, true at real completion tokens (prompt and padding never count).

    Returns:
        (n,) float64, nats.
    """
    delta = (reference_logps.double() - policy_logps.double()).masked_fill(~mask, 0.0)  # (n, c)
    k3 = (torch.expm1(delta) - delta).clamp(min=0.0)  # (n, c); expm1 keeps small Δ exact
    return torch.where(mask, k3, torch.zeros_like(k3)).sum(dim=-1)


# ---------------------------------------------------------------------------------------------- critics
def clipped_value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip_range: float | None
) -> torch.Tensor:
    """Per-row clipped value loss max((V − R)², (V_clip − R)²), V_clip = V_old + clamp(V − V_old, −ε, ε), ε =
    ``clip_range`` (None: (V − R)²). Schulman et al. 2017 (PPO), the value clipping of OpenAI baselines ``ppo2``.

    Args:
        values: (n,) predictions at update time (carry the gradient).
        old_values: (n,) predictions recorded at rollout time (constants).
        returns: (n,) targets R.

    Returns:
        (n,) squared reward units.
    """
    unclipped = (values - returns) ** 2
    if clip_range is None:
        return unclipped
    old = old_values.detach()
    clipped = old + (values - old).clamp(-clip_range, clip_range)
    return torch.maximum(unclipped, (clipped - returns) ** 2)
