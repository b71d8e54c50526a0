"""One MADPO update step over a batch of pairs (SPEC §5.5): every agent moves with its own margin and the
others' margins detached, so the credit weight −β σ(−βΔ) is the joint margin's for every agent.

Margins are computed once per batch with gradients; their detached copies are the "others" terms. This
equals computing them first without gradients (no agent has moved yet) and halves the forward passes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pbrl.losses import madpo_agent_loss, madpo_loss, preference_accuracy
from pbrl.scoring import sequence_logprobs


@dataclass(frozen=True)
class PairBatch:
    """b pairs, per agent: ``prompt_ids[i][j]``, ``winner_ids[i][j]``, ``loser_ids[i][j]`` (token id lists)."""

    prompt_ids: list[list[list[int]]]
    winner_ids: list[list[list[int]]]
    loser_ids: list[list[list[int]]]

    @property
    def size(self) -> int:
        return len(self.prompt_ids[0])


@dataclass
class TrainablePolicy:
    model: Any
    optimizer: torch.optim.Optimizer
    pad_token_id: int


@dataclass(frozen=True)
class StepStats:
    loss: float  # mean joint MADPO loss of the batch, nats
    accuracy: float  # share of pairs with joint margin > 0
    margins: torch.Tensor  # (b, a) detached per-agent margins, nats
    skipped: tuple[bool, ...]  # per agent: update skipped (non-finite loss or gradient)


def agent_margins(policy: TrainablePolicy, prompt_ids, winner_ids, loser_ids) -> torch.Tensor:
    """Δ_i per pair: log π(a^w|h) − log π(a^l|h), shape (b,), both sides in one padded forward pass.

    A pair whose winner and loser completions are the same token ids has Δ_i ≡ 0 for every θ: it is set to
    an exact constant 0 without a forward pass (so it moves nothing, not even by rounding).
    """
    rows = [j for j in range(len(prompt_ids)) if list(winner_ids[j]) != list(loser_ids[j])]
    margins = torch.zeros(len(prompt_ids))
    if not rows:
        return margins
    p = [prompt_ids[j] for j in rows]
    logps = sequence_logprobs(policy.model, p * 2, [winner_ids[j] for j in rows] + [loser_ids[j] for j in rows],
                              pad_token_id=policy.pad_token_id)  # (2b',)
    diff = logps[: len(rows)] - logps[len(rows):]
    return margins.to(diff.device, diff.dtype).index_put((torch.tensor(rows, device=diff.device),), diff)


def trainable_parameters(model: Any) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def madpo_step(policies: Sequence[TrainablePolicy], batch: PairBatch, *, beta: float,
               max_grad_norm: float | None) -> StepStats:
    """Update every agent once on ``batch``; an agent whose loss or gradient norm is not finite is skipped
    (its parameters and optimizer state untouched)."""
    own = [agent_margins(p, batch.prompt_ids[i], batch.winner_ids[i], batch.loser_ids[i])
           for i, p in enumerate(policies)]
    margins = torch.stack([m.detach().float().cpu() for m in own], dim=1)  # (b, a)
    total = margins.sum(dim=1)  # (b,)
    skipped = []
    for i, policy in enumerate(policies):
        others = (total - margins[:, i]).to(own[i].device)
        loss = madpo_agent_loss(own[i], others, beta).mean()
        if not torch.isfinite(loss):
            skipped.append(True)
            continue
        if not loss.requires_grad:  # every pair identical for this agent: zero gradient, nothing to do
            skipped.append(False)
            continue
        policy.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        params = trainable_parameters(policy.model)
        if max_grad_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
        else:
            norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params if p.grad is not None]))
        if not torch.isfinite(norm):
            policy.optimizer.zero_grad(set_to_none=True)
            skipped.append(True)
            continue
        policy.optimizer.step()
        policy.optimizer.zero_grad(set_to_none=True)
        skipped.append(False)
    return StepStats(
        loss=float(madpo_loss(margins, beta).mean()),
        accuracy=float(preference_accuracy(margins)),
        margins=margins,
        skipped=tuple(skipped),
    )
