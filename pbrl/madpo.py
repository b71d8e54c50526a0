"""One MADPO update step over a batch of pairs (SPEC §5.5): every agent moves with its own margin and the
others' margins detached, so the credit weight −β σ(−βΔ) is the joint margin's for every agent.

Margins are computed once per batch with gradients; their detached copies are the "others" terms. This
equals computing them first without gradients (no agent has moved yet) and halves the forward passes.
These training forwards run in train mode, so dropout (``lora_dropout``) takes effect, with masks drawn
from a seed per agent and step; sampling and evaluation forwards run in eval mode without gradients.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from pbrl.losses import madpo_agent_loss, madpo_loss, preference_accuracy
from pbrl.precision import Precision, autocast, backward_and_step
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
    """An agent being trained: its model (float32 trainable parameters), AdamW, pad id, and the mixed precision
    of its training forwards and steps (None: float32, see :mod:`pbrl.precision`)."""

    model: Any
    optimizer: torch.optim.Optimizer
    pad_token_id: int
    precision: Precision | None = None


@dataclass(frozen=True)
class StepStats:
    loss: float  # mean joint MADPO loss of the batch, nats
    accuracy: float  # share of pairs with joint margin > 0
    margins: torch.Tensor  # (b, a) detached per-agent margins, nats
    skipped: tuple[bool, ...]  # per agent: update skipped (non-finite loss or gradient)


def has_dropout(model: torch.nn.Module) -> bool:
    """True when ``model`` holds a dropout module with p > 0 (e.g. peft's ``lora_dropout``)."""
    kinds = (torch.nn.Dropout, torch.nn.Dropout1d, torch.nn.Dropout2d, torch.nn.Dropout3d, torch.nn.AlphaDropout,
             torch.nn.FeatureAlphaDropout)
    return any(isinstance(m, kinds) and m.p > 0 for m in model.modules())


def _cuda_indices(model: torch.nn.Module) -> list[int]:
    """The CUDA devices holding ``model``'s resident parameters (several when accelerate split it)."""
    indices = set()
    for param in model.parameters():
        if param.device.type == "cuda":
            indices.add(param.device.index if param.device.index is not None else torch.cuda.current_device())
    return sorted(indices)


@contextmanager
def training_forward(model: torch.nn.Module, seed: int, precision: Precision | None = None) -> Iterator[None]:
    """Inside the block, every forward of ``model`` runs in train mode, so its dropout takes effect, with
    masks drawn from torch's RNG seeded with ``seed``: the same seed gives the same masks (a resumed run
    is bitwise identical), and the global RNG state is restored on exit (``torch.random.fork_rng``).
    With ``precision`` (``mixed_precision`` bf16/fp16), the forwards also run under its autocast
    (:func:`pbrl.precision.autocast`); the float32 master weights are not cast.

    Score with ``sequence_logprobs(..., dropout=True)`` inside the block (it otherwise forces eval mode).
    Every submodule's mode is restored on exit. Backward draws no random numbers (the masks are saved by
    the forward). A model split over several GPUs by ``agent_devices: auto`` gets ``seed`` on each of them.
    """
    modes = [(module, module.training) for module in model.modules()]
    cuda = _cuda_indices(model)
    model.train()
    try:
        with torch.random.fork_rng(devices=cuda), autocast(precision):
            torch.random.default_generator.manual_seed(seed)
            for index in cuda:
                with torch.cuda.device(index):
                    torch.cuda.manual_seed(seed)
            yield
    finally:
        for module, was_training in modes:
            module.training = was_training


def agent_margins(policy: TrainablePolicy, prompt_ids, winner_ids, loser_ids, seed: int | None = None
                  ) -> torch.Tensor:
    """Δ_i per pair: log π(a^w|h) − log π(a^l|h), shape (b,), both sides in one padded forward pass.

    With ``seed``, the forward is a training forward (:func:`training_forward`: dropout on, masks from
    ``seed``); without, dropout is off. Either runs under the policy's mixed-precision autocast. A pair
    whose winner and loser completions are the same token ids has Δ_i ≡ 0 for every θ: it is set to an
    exact constant 0 without a forward pass (so it moves nothing, not even by rounding).
    """
    rows = [j for j in range(len(prompt_ids)) if list(winner_ids[j]) != list(loser_ids[j])]
    margins = torch.zeros(len(prompt_ids))
    if not rows:
        return margins
    p = [prompt_ids[j] for j in rows]
    completions = [winner_ids[j] for j in rows] + [loser_ids[j] for j in rows]
    if seed is None:
        with autocast(policy.precision):
            logps = sequence_logprobs(policy.model, p * 2, completions, pad_token_id=policy.pad_token_id)  # (2b',)
    else:
        with training_forward(policy.model, seed, policy.precision):
            logps = sequence_logprobs(policy.model, p * 2, completions, pad_token_id=policy.pad_token_id,
                                      dropout=True)
    diff = logps[: len(rows)] - logps[len(rows):]
    return margins.to(diff.device, diff.dtype).index_put((torch.tensor(rows, device=diff.device),), diff)


def trainable_parameters(model: Any) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def madpo_step(policies: Sequence[TrainablePolicy], batch: PairBatch, *, beta: float,
               max_grad_norm: float | None, seeds: Sequence[int] | None = None) -> StepStats:
    """Update every agent once on ``batch``; an agent whose loss or gradient norm is not finite is skipped
    (its parameters and optimizer state untouched). Each agent's step is
    :func:`pbrl.precision.backward_and_step` in its ``precision`` (fp16: scaled loss, unscaled clipping).

    ``seeds``: one dropout seed per agent for this step's training forwards (derive them with
    :func:`pbrl.seeds.derive_seed`, a new one per step). Without ``seeds`` the forwards run without dropout,
    which only models without dropout allow.

    Raises:
        ValueError: ``seeds`` is not one per agent, or is missing while a model has dropout.
    """
    if seeds is not None and len(seeds) != len(policies):
        raise ValueError(f"seeds: got {len(seeds)} for {len(policies)} agents; give one dropout seed per agent")
    if seeds is None and any(has_dropout(p.model) for p in policies):
        raise ValueError("seeds: a policy has dropout (lora_dropout > 0), so its training forwards need one "
                         "dropout seed per agent")
    own = [agent_margins(p, batch.prompt_ids[i], batch.winner_ids[i], batch.loser_ids[i],
                         None if seeds is None else seeds[i])
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
        stepped = backward_and_step(policy.optimizer, loss, trainable_parameters(policy.model),
                                    max_grad_norm=max_grad_norm, precision=policy.precision)
        skipped.append(not stepped)
    return StepStats(
        loss=float(madpo_loss(margins, beta).mean()),
        accuracy=float(preference_accuracy(margins)),
        margins=margins,
        skipped=tuple(skipped),
    )
