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
std, std clamped at 1e-6); after the agents' steps each critic takes one step on its clipped value loss. The loop
chooses one of the two strategies before its first step (:mod:`pbrl.learning.baselines`); a step's rollouts are
collected and recorded by :mod:`pbrl.learning.rollouts`.

Shape legend: b items in a batch, g generations per item, n = b·g rows, a agents, c completion positions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pbrl.data.schema import RolloutRow
from pbrl.learning.baselines import StepBaseline, choose_baseline
from pbrl.learning.critic_set import CriticSet
from pbrl.learning.logprobs import token_logprobs as scoring_token_logprobs
from pbrl.learning.losses import k3_kl, policy_gradient_loss
from pbrl.learning.rollouts import (
    Sampler,
    Scorer,
    StepOutcome,
    StepRollouts,
    collect_rollouts,
    rollout_records,
    step_rows,
)
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


@dataclass(frozen=True)
class RLHooks:
    """What a stage plugs into the RL loop: its sampler and reward model, its seeds and its live log.

    Attributes:
        sample: (agent, prompt rows, item id per row, epoch) → b·g :class:`pbrl.generation.sampling.Generation`, the
            rows being each item's prompt repeated g times; row r is generation r mod g.
        score: (prompts [joint][agent], completions [joint][agent]) → per joint response (R or None when it
            cannot be scored, its joint input ids or None).
        order_seed: seed of the item order of every epoch.
        dropout_seed: (agent, step) → the dropout seed of that training forward (None: no dropout).
        on_step: called after each step with its row count and metrics (the stage's live log and progress).
    """

    sample: Sampler
    score: Scorer
    order_seed: int
    dropout_seed: Callable[[int, int], int | None]
    on_step: Callable[[int, dict[str, float]], None] | None = None


@dataclass
class RLResult:
    rollouts: list[RolloutRow] = field(default_factory=list)  # one row per (step, item, generation, agent)
    steps: int = 0
    batch_sizes: list[int] = field(default_factory=list)  # joint responses per step
    step_metrics: list[dict[str, float]] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)  # per agent: non-finite steps
    dropped_groups: int = 0  # item groups left out: a joint response did not fit reward_max_length


def run_rl(
    policies: Sequence[TrainablePolicy],
    prompt_ids: Sequence[Sequence[list[int]]],
    item_ids: list[str],
    settings: RLSettings,
    hooks: RLHooks,
    *,
    references: Sequence[ReferencePolicy] | None,
    critics: CriticSet | None = None,
) -> RLResult:
    """``settings.epochs`` passes over the items in seeded order, ``settings.batch_size`` items per step; each
    step collects its rollouts (:func:`pbrl.learning.rollouts.collect_rollouts`) and updates every agent
    (:func:`rl_step`) against the advantage strategy chosen once here (:func:`pbrl.learning.baselines.choose_baseline`).

    Args:
        policies: a trainable agents.
        prompt_ids: [agent][item] stored prompt ids.
        item_ids: the items' ids, in the order of ``prompt_ids``.
        hooks: the sampler, the reward model, the seeds and the live log (:class:`RLHooks`).
        references: one per agent when the KL is on, else None.
        critics: the critics of an actor-critic backend (``maac``/``iac``), updated in place; None otherwise.

    Raises:
        ValueError: an actor-critic backend without critics, or critics with a group backend.
    """
    baseline = choose_baseline(settings.backend, settings.normalize, critics)
    g, a = settings.num_generations, len(policies)
    out = RLResult(skipped=[0] * a)
    rng = np.random.default_rng(hooks.order_seed)
    for epoch in range(settings.epochs):
        order = rng.permutation(len(item_ids))
        for begin in range(0, len(item_ids), settings.batch_size):
            chunk = [int(j) for j in order[begin : begin + settings.batch_size]]
            prompts, rows_items = step_rows(prompt_ids, item_ids, chunk, g, a)
            rollouts = collect_rollouts(hooks.sample, hooks.score, prompts, rows_items, epoch=epoch, num_generations=g)
            out.dropped_groups += int((~rollouts.ok).sum())
            outcome, metrics, skipped = rl_step(
                policies, rollouts, baseline.start(rollouts), settings, hooks, references, out.steps
            )
            out.skipped = [n + s for n, s in zip(out.skipped, skipped, strict=True)]
            out.rollouts += rollout_records(rollouts, out.steps, outcome)
            out.steps += 1
            out.batch_sizes.append(len(rows_items))
            out.step_metrics.append(metrics)
            if hooks.on_step is not None:
                hooks.on_step(len(rows_items), metrics)
    return out


def rl_step(
    policies: Sequence[TrainablePolicy],
    rollouts: StepRollouts,
    baseline: StepBaseline,
    settings: RLSettings,
    hooks: RLHooks,
    references: Sequence[ReferencePolicy] | None,
    step: int,
) -> tuple[StepOutcome, dict[str, float], list[bool]]:
    """Update ``step`` of the pass: every agent on ``rollouts`` (agent 0 first), then the baseline. Agent i's reward
    is R − c·KL_i (:func:`reference_kl`, c = ``kl_coef``), its advantages ``baseline``'s, its step
    :func:`rl_agent_step` (dropout seed ``hooks.dropout_seed(i, step)``).

    Returns:
        The step's per-row KL, advantages, values and kept rows; its metrics (``rl/loss_agent_<i>``, the
        baseline's, ``rl/reward_mean`` over the kept joint responses); per agent, whether its step was skipped.
    """
    b, g = rollouts.rewards.shape
    ok = baseline.keep(rollouts.ok)  # (b,)
    valid = ok.repeat_interleave(g)  # (n,)
    kl = torch.zeros((len(policies), b * g), dtype=torch.float64)  # (a, n)
    advantages = torch.zeros((len(policies), b * g), dtype=torch.float64)  # (a, n)
    returns = torch.zeros((len(policies), b * g), dtype=torch.float64)  # (a, n): R − c·KL_i
    metrics: dict[str, float] = {}
    skipped = []
    for i, policy in enumerate(policies):
        step_seed, tokens = hooks.dropout_seed(i, step), None
        if references is not None:  # KL to the reference, from the step's own training forward
            tokens, kl[i] = reference_kl(policy, references[i], rollouts.prompts[i], rollouts.completions[i], step_seed)
        shaped = rollouts.rewards - (settings.kl_coef or 0.0) * kl[i].view(b, g)  # (b, g)
        returns[i] = shaped.reshape(-1)
        advantages[i] = baseline.advantages(i, shaped, ok)
        loss, outcome = rl_agent_step(
            policy,
            rollouts.prompts[i],
            rollouts.completions[i],
            advantages[i],
            max_grad_norm=settings.max_grad_norm,
            seed=step_seed,
            token_logprobs=tokens,
        )
        del tokens  # the graph of this agent's forward
        skipped.append(outcome == "skipped")
        metrics[f"rl/loss_agent_{i}"] = loss
    metrics.update(baseline.update(returns, valid))  # after the policy steps: a value head sees its moved backbone
    rewards = rollouts.rewards.reshape(-1)
    metrics["rl/reward_mean"] = float(rewards[valid].mean()) if valid.any() else float("nan")
    return StepOutcome(kl, advantages, baseline.values, valid), metrics, skipped


def reference_kl(
    policy: TrainablePolicy,
    reference: ReferencePolicy,
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    seed: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The training forward of an agent's step (:func:`training_token_logprobs`, seeded by ``seed``) and the k3 KL
    (:func:`pbrl.learning.losses.k3_kl`) of its completions to ``reference``, measured without dropout.

    Returns:
        (n, c) token log-probs with their graph (for :func:`rl_agent_step`), and the (n,) float64 KL, nats.
    """
    tokens, mask = training_token_logprobs(policy, prompt_ids, completion_ids, seed=seed)
    pol = (
        tokens.detach().double().cpu()
        if not has_dropout(policy.model)
        else completion_token_logprobs(  # dropout on: the KL is measured without it
            policy.model, prompt_ids, completion_ids, pad_token_id=policy.pad_token_id
        )[0]
    )
    ref, _ = reference.token_logprobs(prompt_ids, completion_ids)
    return tokens, k3_kl(pol, ref, mask.cpu())


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
