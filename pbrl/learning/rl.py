"""MARLHF policy learning (docs/design/algorithms.md#marlhf-policy-learning): rollouts scored by the frozen joint
reward model, group advantages,
an optional reference KL, and one REINFORCE-style update per agent.

Per batch of items, each agent samples G = ``num_generations`` responses per item (the seeded batched
sampler, :func:`pbrl.generation.sampling.generate`); joint response j is every agent's j-th sample; the reward model
scores the joint responses without gradients. Agent i's reward for joint response j is
R_ij = R_j − c·KL_ij (c = ``reference_kl_coef``, KL only when enabled, else R_ij = R_j); the advantage
backend turns each item's group R_i1..R_iG into advantages; agent i's loss is
−mean_j A_ij · log π_i(a_i^j | h_i) with the log-prob summed over every completion token, EOS included.

Advantage backends (:mod:`pbrl.learning.advantages`) are a name → function mapping of
the group-baseline family. The actor-critic backends (``maac``, ``iac``) take their baseline from critics
(:class:`pbrl.learning.critic_set.CriticSet`): A_ij = R_ij − V (V recorded before the update, a constant),
normalised over the batch when ``advantage_normalization`` is on (the reference's actor-critic rule: (A − mean) /
std, std clamped at 1e-6); after the agents' steps each critic takes one step on its clipped value loss.

Shape legend: b items in a batch, g generations per item, n = b·g rows, a agents, c completion positions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pbrl.learning.advantages import (
    ACTOR_CRITIC,
    actor_critic_advantages,
    advantage_backend,
    normalize_batch,
    normalize_group,
)
from pbrl.learning.critic_set import CriticSet
from pbrl.learning.logprobs import token_logprobs as scoring_token_logprobs
from pbrl.learning.losses import k3_kl, policy_gradient_loss
from pbrl.models.forward import has_dropout, training_forward
from pbrl.models.policies import TrainablePolicy, trainable_parameters
from pbrl.models.precision import autocast, backward_and_step


# ---------------------------------------------------------------------------------------------- KL
@torch.no_grad()
def completion_token_logprobs(
    model: Any, prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]], *, pad_token_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token log-probs of every completion token (EOS included) given the prompt, in eval mode, each distinct
    prompt computed once (:func:`pbrl.learning.logprobs.token_logprobs`).

    Returns:
        (n, c) float64 log-probs (0 at padding) and the (n, c) bool mask of real completion tokens, on CPU.
    """
    token, mask = scoring_token_logprobs(model, prompt_ids, completion_ids, pad_token_id=pad_token_id)
    return token.double().cpu(), mask.cpu()


@dataclass
class ReferencePolicy:
    """A frozen reference for agent i: a separate model (full fine-tuning), or the agent's own peft model
    with its adapter disabled (LoRA: the base weights, no second copy in memory)."""

    model: Any
    pad_token_id: int
    disable_adapter: bool = False

    def token_logprobs(
        self, prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.disable_adapter:
            with self.model.disable_adapter():
                return completion_token_logprobs(self.model, prompt_ids, completion_ids, pad_token_id=self.pad_token_id)
        return completion_token_logprobs(self.model, prompt_ids, completion_ids, pad_token_id=self.pad_token_id)


# ---------------------------------------------------------------------------------------------- update
def apply_update(policy: TrainablePolicy, loss: torch.Tensor, max_grad_norm: float | None) -> bool:
    """One AdamW step of ``policy`` on ``loss`` through :func:`pbrl.models.precision.backward_and_step` (the step
    MADPO takes: its mixed precision, the gradient norm clipped to ``max_grad_norm``). A non-finite loss or
    gradient norm skips the step (parameters and optimizer state untouched). Returns whether it was skipped."""
    if not torch.isfinite(loss):
        return True
    return not backward_and_step(
        policy.optimizer,
        loss,
        trainable_parameters(policy.model),
        max_grad_norm=max_grad_norm,
        precision=policy.precision,
    )


def training_token_logprobs(
    policy: TrainablePolicy,
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    *,
    seed: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The training forward of an RL step: (n, c) float32 token log-probs of every completion token, with
    gradients, and the (n, c) bool mask of real tokens (:func:`pbrl.learning.logprobs.token_logprobs`: the g rows
    of an item share one prompt forward, whose gradient sums theirs; with dropout, one mask over the prompt).
    Seeded by ``seed`` (dropout masks, :func:`pbrl.models.forward.training_forward`), or without dropout when
    ``seed`` is None; under the policy's autocast.

    Raises:
        ValueError: ``seed`` is None while the model has dropout.
    """
    if seed is None:
        if has_dropout(policy.model):
            raise ValueError("seeds: a policy has dropout (lora_dropout > 0); its forwards need a dropout seed")
        with autocast(policy.precision):
            return scoring_token_logprobs(policy.model, prompt_ids, completion_ids, pad_token_id=policy.pad_token_id)
    with training_forward(policy.model, seed, policy.precision):
        return scoring_token_logprobs(
            policy.model, prompt_ids, completion_ids, pad_token_id=policy.pad_token_id, dropout=True
        )


def rl_agent_step(
    policy: TrainablePolicy,
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    advantages: torch.Tensor,
    *,
    max_grad_norm: float | None,
    seed: int | None,
    token_logprobs: torch.Tensor | None = None,
) -> tuple[float, str]:
    """Update one agent on n rows. Rows with A = 0 carry no signal: when every row's A is 0 the agent is not
    stepped (AdamW momentum would still move it). The forward is :func:`training_token_logprobs` (seeded by
    ``seed``), unless the caller already ran it and passes its ``token_logprobs`` (n, c) with their graph.

    Returns:
        (loss, outcome) with outcome ``"updated"``, ``"no_signal"`` or ``"skipped"`` (non-finite).

    Raises:
        ValueError: ``seed`` is None while the model has dropout.
    """
    if not bool((advantages != 0).any()):
        return 0.0, "no_signal"
    if token_logprobs is None:
        token_logprobs, _ = training_token_logprobs(policy, prompt_ids, completion_ids, seed=seed)
    # Summed in float64 as sequence_logprobs does; padding positions hold 0.
    logps = token_logprobs.double().sum(-1) if token_logprobs.shape[1] else token_logprobs.new_zeros(len(advantages))
    loss = policy_gradient_loss(advantages, logps)
    return float(loss.detach()), "skipped" if apply_update(policy, loss, max_grad_norm) else "updated"


# ---------------------------------------------------------------------------------------------- loop
@dataclass(frozen=True)
class RLSettings:
    """Plain values of the RL loop (a stage unpacks them from its job)."""

    epochs: int
    batch_size: int  # items per update step
    num_generations: int
    backend: str
    normalize: bool
    kl_coef: float | None  # None: no reference KL
    max_grad_norm: float | None


@dataclass
class RLResult:
    rollouts: list[dict[str, Any]] = field(default_factory=list)  # one row per (step, item, generation, agent)
    steps: int = 0
    batch_sizes: list[int] = field(default_factory=list)  # joint responses per step
    step_metrics: list[dict[str, float]] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)  # per agent: non-finite steps
    dropped_groups: int = 0  # item groups left out: a joint response did not fit reward_max_length


Sampler = Callable[[int, list[list[int]], list[str], int], list[Any]]  # (agent, prompt rows, item ids, epoch)
Scorer = Callable[[list[list[list[int]]], list[list[list[int]]]], list[tuple[float | None, list[int] | None]]]


# Over 60 lines: one RL step reads top to bottom as the algorithm (rollouts, rewards, KL, advantages, each
# agent's update, the critics); split up, the step's shared per-row tensors would have to travel between helpers.
def run_rl(
    policies: Sequence[TrainablePolicy],
    prompt_ids: Sequence[Sequence[list[int]]],
    item_ids: list[str],
    settings: RLSettings,
    *,
    sample: Sampler,
    score: Scorer,
    references: Sequence[ReferencePolicy] | None,
    order_seed: int,
    dropout_seed: Callable[[int, int], int | None],
    critics: CriticSet | None = None,
    on_step: Callable[[int, dict[str, float]], None] | None = None,
) -> RLResult:
    """``settings.epochs`` passes over the items in seeded order, ``settings.batch_size`` items per step.

    Args:
        policies: a trainable agents.
        prompt_ids: [agent][item] stored prompt ids.
        item_ids: the items' ids, in the order of ``prompt_ids``.
        sample: (agent, prompt rows, item id per row, epoch) → b·g :class:`pbrl.generation.sampling.Generation`, the
            rows being each item's prompt repeated g times; row r is generation r mod g.
        score: (prompts [joint][agent], completions [joint][agent]) → per joint response (R or None when it
            cannot be scored, its joint input ids or None).
        references: one per agent when the KL is on, else None.
        order_seed: seed of the item order of every epoch.
        dropout_seed: (agent, step) → the dropout seed of that training forward (None: no dropout).
        critics: the critics of an actor-critic backend (``maac``/``iac``), updated in place; None otherwise.
        on_step: called after each step with its item count and metrics (the stage's live log and progress).

    Raises:
        ValueError: an actor-critic backend without critics, or critics with a group backend.
    """
    if (settings.backend in ACTOR_CRITIC) != (critics is not None):
        raise ValueError(
            f"rl_algorithm: {settings.backend!r} " + ("needs critics" if critics is None else "takes no critics")
        )
    backend = None if critics is not None else advantage_backend(settings.backend)
    g, a = settings.num_generations, len(policies)
    out = RLResult(skipped=[0] * a)
    rng = np.random.default_rng(order_seed)
    for epoch in range(settings.epochs):
        order = rng.permutation(len(item_ids))
        for begin in range(0, len(item_ids), settings.batch_size):
            chunk = [int(j) for j in order[begin : begin + settings.batch_size]]
            rows_items = [item_ids[j] for j in chunk for _ in range(g)]
            prompts = [[prompt_ids[i][j] for j in chunk for _ in range(g)] for i in range(a)]  # [a][n]
            gens = [sample(i, prompts[i], rows_items, epoch) for i in range(a)]  # [a][n]
            completions = [[x.completion_ids for x in gens[i]] for i in range(a)]  # [a][n]
            scored = score(
                [[prompts[i][r] for i in range(a)] for r in range(len(rows_items))],
                [[completions[i][r] for i in range(a)] for r in range(len(rows_items))],
            )
            ok = torch.tensor([s[0] is not None for s in scored]).view(len(chunk), g).all(dim=-1)  # (b,)
            out.dropped_groups += int((~ok).sum())
            rewards = torch.tensor([s[0] if s[0] is not None else 0.0 for s in scored], dtype=torch.float64).view(
                len(chunk), g
            )  # (b, g)
            kl = torch.zeros((a, len(rows_items)), dtype=torch.float64)  # (a, n)
            critic_batch = critics.evaluate(prompts, completions) if critics is not None else None
            if critic_batch is not None:  # a critic input that does not fit leaves its item group out
                ok &= critic_batch.ok.view(len(chunk), g).all(dim=-1)
            valid = ok.repeat_interleave(g)  # (n,)
            metrics: dict[str, float] = {}
            advantages = torch.zeros((a, len(rows_items)), dtype=torch.float64)  # (a, n)
            returns = torch.zeros((a, len(rows_items)), dtype=torch.float64)  # (a, n): R − c·KL_i
            for i in range(a):
                step_seed, tokens = dropout_seed(i, out.steps), None
                if references is not None:  # KL to the reference, from the step's own training forward
                    tokens, mask = training_token_logprobs(policies[i], prompts[i], completions[i], seed=step_seed)
                    pol = (
                        tokens.detach().double().cpu()
                        if not has_dropout(policies[i].model)
                        else completion_token_logprobs(  # dropout on: the KL is measured without it
                            policies[i].model, prompts[i], completions[i], pad_token_id=policies[i].pad_token_id
                        )[0]
                    )
                    ref, _ = references[i].token_logprobs(prompts[i], completions[i])
                    kl[i] = k3_kl(pol, ref, mask.cpu())
                shaped = rewards - (settings.kl_coef or 0.0) * kl[i].view(len(chunk), g)  # (b, g)
                returns[i] = shaped.reshape(-1)
                if critic_batch is not None:
                    adv = actor_critic_advantages(returns[i], critic_batch.values[i])  # (n,)
                    adv = normalize_batch(adv, valid) if settings.normalize else adv
                    advantages[i] = torch.where(valid, adv, torch.zeros_like(adv))
                else:
                    adv = backend(shaped)
                    adv = normalize_group(adv) if settings.normalize else adv
                    advantages[i] = torch.where(ok[:, None], adv, torch.zeros_like(adv)).reshape(-1)  # (n,)
                loss, outcome = rl_agent_step(
                    policies[i],
                    prompts[i],
                    completions[i],
                    advantages[i],
                    max_grad_norm=settings.max_grad_norm,
                    seed=step_seed,
                    token_logprobs=tokens,
                )
                del tokens  # the graph of this agent's forward
                out.skipped[i] += outcome == "skipped"
                metrics[f"rl/loss_agent_{i}"] = loss
            if critic_batch is not None:  # after the policy steps: a value head sees its moved backbone
                metrics.update(critics.update(critic_batch, returns, valid))
            metrics["rl/reward_mean"] = float(rewards.reshape(-1)[valid].mean()) if valid.any() else float("nan")
            for r in range(len(rows_items)):
                for i in range(a):
                    x = gens[i][r]
                    out.rollouts.append(
                        {
                            "epoch": epoch,
                            "step": out.steps,
                            "item_id": rows_items[r],
                            "generation_index": r % g,
                            "agent_index": i,
                            "prompt_ids": list(prompts[i][r]),
                            "completion_ids": list(x.completion_ids),
                            "completion": x.text,
                            "finish_reason": x.finish_reason,
                            "seed": x.seed,
                            "joint_ids": scored[r][1],
                            "reward": scored[r][0],
                            "kl": float(kl[i, r]),
                            "advantage": float(advantages[i, r]) if bool(valid[r]) else None,
                            "value": float(critic_batch.values[i, r])
                            if critic_batch is not None and bool(valid[r])
                            else None,  # written once ROLLOUTS declares it
                        }
                    )
            out.steps += 1
            out.batch_sizes.append(len(rows_items))
            out.step_metrics.append(metrics)
            if on_step is not None:
                on_step(len(rows_items), metrics)
    return out


ROLLOUTS_FILE = "rollouts.parquet"


def rollouts_path(round_dir: Path) -> Path:
    """``rounds/<r>/rollouts.parquet``."""
    return Path(round_dir) / ROLLOUTS_FILE


def rl_metrics(result: RLResult, num_agents: int) -> dict[str, float]:
    """Round metrics of an RL pass: ``rl/reward_mean`` (reward-model score per joint response),
    ``rl/advantage_std`` (population std of every agent's advantages), ``rl/kl_mean`` (and per agent),
    ``rl/loss`` (mean over steps and agents), skipped steps (total and per agent), dropped groups."""

    def mean(xs: list[float]) -> float:
        return float(np.mean(xs)) if xs else float("nan")

    rewards = [r["reward"] for r in result.rollouts if r["agent_index"] == 0 and r["reward"] is not None]
    advantages = [r["advantage"] for r in result.rollouts if r["advantage"] is not None]
    out = {
        "rl/reward_mean": mean(rewards),
        "rl/advantage_std": float(np.std(advantages)) if advantages else float("nan"),
        "rl/kl_mean": mean([r["kl"] for r in result.rollouts]),
        "rl/loss": mean([v for m in result.step_metrics for k, v in m.items() if k.startswith("rl/loss_agent_")]),
        "rl/skipped_steps": float(sum(result.skipped)),
        "rl/dropped_groups": float(result.dropped_groups),
    }
    for i in range(num_agents):
        out[f"rl/kl_mean_agent_{i}"] = mean([r["kl"] for r in result.rollouts if r["agent_index"] == i])
        out[f"rl/skipped_steps_agent_{i}"] = float(result.skipped[i])
    return out
