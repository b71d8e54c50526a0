"""Advantages of MARLHF policy learning (docs/design/algorithms.md#marlhf-policy-learning): how an agent's rewards
become the advantages of its update.

Advantage backends are a name → function mapping (:data:`ADVANTAGE_BACKENDS`, :class:`AdvantageBackend`) of
the group-baseline family: each item's group R_i1..R_iG becomes advantages. The actor-critic backends (``maac``,
``iac``: :data:`ACTOR_CRITIC`) take their baseline from critics (:class:`pbrl.learning.critic_set.CriticSet`):
A_ij = R_ij − V (V recorded before the update, a constant), normalised over the batch when
``advantage_normalization`` is on (the reference's actor-critic rule: (A − mean) / std, std clamped at 1e-6).

Shape legend: b items in a batch, g generations per item, n = b·g rows.
"""

from __future__ import annotations

from typing import Protocol

import torch

ACTOR_CRITIC = ("maac", "iac")
NORMALIZATION_EPS = 1e-6  # a group's standard deviation is clamped here before dividing (never by zero)


# ---------------------------------------------------------------------------------------------- group baselines
class AdvantageBackend(Protocol):
    def __call__(self, rewards: torch.Tensor) -> torch.Tensor:
        """Advantages (b, g) from rewards (b, g): one row per item, one column per joint response."""
        ...


def group_mean_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """``magrpo``: A_j = R_j − mean(R) over the item's group. (b, g) → (b, g)."""
    return rewards - rewards.mean(dim=-1, keepdim=True)


def raw_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """``mareinforce``: A_j = R_j (no baseline). (b, g) → (b, g)."""
    return rewards.clone()


def leave_one_out_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """``marloo``: A_j = R_j − mean_{k≠j} R_k (Kool et al. 2019, "Buy 4 REINFORCE samples"). (b, g) → (b, g).

    Raises:
        ValueError: g < 2 (no other sample to average).
    """
    g = rewards.shape[-1]
    if g < 2:
        raise ValueError(f"num_generations: got {g}; rl_algorithm='marloo' needs >= 2 samples per item")
    others = (rewards.sum(dim=-1, keepdim=True) - rewards) / (g - 1)
    return rewards - others


def group_max_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """``maremax``: A_j = R_j − max(R) over the item's group (every advantage ≤ 0). (b, g) → (b, g)."""
    return rewards - rewards.max(dim=-1, keepdim=True).values


ADVANTAGE_BACKENDS: dict[str, AdvantageBackend] = {
    "magrpo": group_mean_advantages,
    "mareinforce": raw_advantages,
    "marloo": leave_one_out_advantages,
    "maremax": group_max_advantages,
}


def advantage_backend(name: str) -> AdvantageBackend:
    """The backend named by ``rl_algorithm``.

    Raises:
        ValueError: an actor-critic backend (its baseline is a critic, :class:`pbrl.learning.critic_set.CriticSet`,
            not a function of the rewards) or an unknown name.
    """
    if name in ADVANTAGE_BACKENDS:
        return ADVANTAGE_BACKENDS[name]
    if name in ACTOR_CRITIC:
        raise ValueError(
            f"rl_algorithm: got {name!r}; an actor-critic backend takes its baseline from critics "
            f"(pbrl.learning.critic_set.CriticSet), not from the group; group backends: "
            f"{', '.join(ADVANTAGE_BACKENDS)}"
        )
    raise ValueError(f"rl_algorithm: got {name!r}; allowed: {', '.join(ADVANTAGE_BACKENDS)}")


def normalize_group(advantages: torch.Tensor, eps: float = NORMALIZATION_EPS) -> torch.Tensor:
    """``advantage_normalization``: each group's advantages divided by their population standard deviation,
    clamped at ``eps`` (all-equal advantages stay 0; a 1e-12 spread is not blown up). (b, g) → (b, g)."""
    return advantages / advantages.std(dim=-1, unbiased=False, keepdim=True).clamp(min=eps)


# ---------------------------------------------------------------------------------------------- actor-critic
def actor_critic_advantages(returns: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """A = R − V with V a constant (detached): returns (n,), values (n,) → (n,). docs/design/algorithms.md#critics."""
    return returns - values.detach().to(returns.dtype)


def normalize_batch(advantages: torch.Tensor, valid: torch.Tensor, eps: float = NORMALIZATION_EPS) -> torch.Tensor:
    """``advantage_normalization`` for the actor-critic backends (the reference's ``_prepare_advantages``): over the
    valid rows of the batch, (A − mean) / max(std, ``eps``) (population std); unchanged with fewer than 2 valid
    rows. Invalid rows are returned as they are. (n,), (n,) bool → (n,)."""
    if int(valid.sum()) < 2:
        return advantages
    kept = advantages[valid]
    out = advantages.clone()
    out[valid] = (kept - kept.mean()) / kept.std(unbiased=False).clamp(min=eps)
    return out
