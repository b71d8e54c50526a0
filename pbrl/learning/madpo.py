"""One MADPO update step over a batch of pairs (docs/design/algorithms.md#the-update-step): every agent moves with its
own margin and the others' margins detached, so the credit weight −β σ(−βΔ) is the joint margin's for every agent.

With several agents, the margins of agents 1…a−1 are first computed without gradients where another agent's
gradient needs them (their detached values are the "others" terms; no agent has moved yet; counterfactual pairs need
none, :func:`phase_one_agents`), then each agent in turn scores with gradients, steps and frees its graph, agent 0
first: its margins from that forward, before it steps, join the others terms of the later agents (Ray actors, which
work in parallel, compute the detached margins others need first: ``concurrent``). One agent's graph is alive at a
time, so training memory does not grow with the number of agents. Each distinct prompt of a batch runs once
(:func:`pbrl.learning.logprobs.shared_prompt_logprobs`). These training forwards run in train mode, so dropout
(``lora_dropout``) takes effect, with masks drawn from a seed per agent and step; sampling and evaluation forwards run
in eval mode without gradients.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch

from pbrl.learning.logprobs import sequence_logprobs, shared_prompt_logprobs, uses_activation_checkpointing
from pbrl.learning.losses import madpo_agent_loss, madpo_loss, preference_accuracy
from pbrl.learning.madpo_phases import Phases, run_phases
from pbrl.models.forward import has_dropout, training_forward
from pbrl.models.policies import TrainablePolicy, trainable_parameters
from pbrl.models.precision import autocast, backward_and_step


@dataclass(frozen=True)
class PairBatch:
    """b pairs, per agent: ``prompt_ids[i][j]``, ``winner_ids[i][j]``, ``loser_ids[i][j]`` (token id lists)."""

    prompt_ids: list[list[list[int]]]
    winner_ids: list[list[list[int]]]
    loser_ids: list[list[list[int]]]

    @property
    def size(self) -> int:
        return len(self.prompt_ids[0])

    def agent(self, i: int) -> AgentPairs:
        """Agent ``i``'s side of the batch."""
        return AgentPairs(self.prompt_ids[i], self.winner_ids[i], self.loser_ids[i])


class AgentPairs(NamedTuple):
    """One agent's side of b pairs (:meth:`PairBatch.agent`): per pair its prompt, winner and loser token ids."""

    prompt_ids: list[list[int]]
    winner_ids: list[list[int]]
    loser_ids: list[list[int]]

    def rows(self, part: slice) -> AgentPairs:
        """The pairs of one micro-batch."""
        return AgentPairs(self.prompt_ids[part], self.winner_ids[part], self.loser_ids[part])


def _check_seeds(agents: Sequence[StepAgent], seeds: Sequence[int] | None) -> None:
    """Raises ValueError: ``seeds`` is not one per agent, or is missing while a model has dropout."""
    if seeds is not None and len(seeds) != len(agents):
        raise ValueError(f"seeds: got {len(seeds)} for {len(agents)} agents; give one dropout seed per agent")
    if seeds is None and any(agent.has_dropout() for agent in agents):
        raise ValueError(
            "seeds: a policy has dropout (lora_dropout > 0), so its training forwards need one dropout seed per agent"
        )


@dataclass(frozen=True)
class StepStats:
    loss: float  # mean joint MADPO loss of the batch, nats
    accuracy: float  # share of pairs with joint margin > 0
    margins: torch.Tensor  # (b, a) per-agent margins from each agent's training forward (before it stepped), nats
    skipped: tuple[bool, ...]  # per agent: update skipped (non-finite loss or gradient)
    # per agent: its winner and loser ids are the same in every pair of the batch (e.g. counterfactual pairs of
    # joint_mode cross that change another agent), so its margins are exactly 0 and it was not asked at all
    idle: tuple[bool, ...] = ()


def identical_sides(winner_ids: Sequence[Sequence[int]], loser_ids: Sequence[Sequence[int]]) -> bool:
    """True when every pair of one agent's batch has the same winner and loser token ids: the agent's margin
    Δ_i = log π(y^w|h) − log π(y^l|h) is then 0 for every θ, and its MADPO gradient too."""
    return all(list(w) == list(lo) for w, lo in zip(winner_ids, loser_ids, strict=True))


def changed_pairs(batch: PairBatch) -> list[list[bool]]:
    """(a, b): whether pair r changes agent i (its winner and loser ids differ)."""
    return [
        [list(w) != list(lo) for w, lo in zip(batch.winner_ids[i], batch.loser_ids[i], strict=True)]
        for i in range(len(batch.winner_ids))
    ]


def phase_one_agents(differs: list[list[bool]]) -> list[bool]:
    """Per agent: whether the others need its detached margins (phase 1 of :func:`madpo_agents_step`); ``differs``
    is :func:`changed_pairs` of the batch, (a, b).

    Agent i's margin on pair r enters agent j's loss through the others term, and agent j's gradient there is
    −β σ(−βΔ_r) ∇Δ_{j,r}: it moves θ_j only where j's own sides differ on r (elsewhere Δ_{j,r} ≡ 0 without a
    graph, and the step leaves the others term out). So agent i's detached margins are needed only when some pair
    has different sides for i *and* for another agent. Counterfactual pairs (``pair_selection: counterfactual``),
    which change one agent each, need none: every agent's training forward alone gives all its margins."""
    shared = [sum(column) >= 2 for column in zip(*differs, strict=True)]  # (b,): pairs that change two agents or more
    return [any(d and s for d, s in zip(row, shared, strict=True)) for row in differs]


def _score(model: Any) -> Any:
    """Shared-prompt scoring (each distinct prompt once, its KV cache reused by every completion), unless the
    model recomputes activations (``gradient_checkpointing``), where transformers turns the KV cache off."""
    return sequence_logprobs if uses_activation_checkpointing(model) else shared_prompt_logprobs


def agent_margins(policy: TrainablePolicy, prompt_ids, winner_ids, loser_ids, seed: int | None = None) -> torch.Tensor:
    """Δ_i per pair: log π(a^w|h) − log π(a^l|h), shape (b,), both sides in one scoring call.

    Each distinct prompt of the batch runs once and its KV cache (with its autograd graph) serves the winner
    and the loser of every pair of that prompt (:func:`pbrl.learning.logprobs.shared_prompt_logprobs`; equal to
    :func:`pbrl.learning.logprobs.sequence_logprobs` within float32 rounding); with activation checkpointing on, the
    rows are scored in one padded forward pass instead.
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
    score = _score(policy.model)
    if seed is None:
        with autocast(policy.precision):
            logps = score(policy.model, p * 2, completions, pad_token_id=policy.pad_token_id)  # (2b',)
    else:
        with training_forward(policy.model, seed, policy.precision):
            logps = score(policy.model, p * 2, completions, pad_token_id=policy.pad_token_id, dropout=True)
    diff = logps[: len(rows)] - logps[len(rows) :]
    return margins.to(diff.device, diff.dtype).index_put((torch.tensor(rows, device=diff.device),), diff)


def micro_batches(size: int, micro_batch_size: int | None) -> list[slice]:
    """The row slices of a batch of ``size`` pairs cut into micro-batches of at most ``micro_batch_size`` (None:
    one slice, the whole batch)."""
    step = size if micro_batch_size is None else max(1, int(micro_batch_size))
    return [slice(s, min(s + step, size)) for s in range(0, size, max(step, 1))]


def micro_seed(seed: int | None, index: int) -> int | None:
    """The dropout seed of micro-batch ``index`` of a step whose agent seed is ``seed`` (micro-batch 0 keeps it)."""
    if seed is None or index == 0:
        return seed
    return (seed * 1_000_003 + index) % 2**63


def _detached_margins(policy: TrainablePolicy, pairs: AgentPairs, seed: int | None, parts: list[slice]) -> torch.Tensor:
    """(b,) float32 margins without a graph, micro-batch by micro-batch with the training forwards' seeds (so
    the same dropout masks, hence the same values as the training forward that follows)."""
    with torch.no_grad():
        return torch.cat(
            [agent_margins(policy, *pairs.rows(s), micro_seed(seed, k)).float().cpu() for k, s in enumerate(parts)]
        )


class _AccumulatedGradients(torch.autograd.Function):
    """A scalar 0 whose gradient with respect to ``params`` is ``grads`` (times the incoming gradient, e.g. the
    fp16 loss scale): adding it to the last micro-batch's loss makes one backward hold every micro-batch's
    gradient. The gradients are kept on the context, not saved as a graph tensor."""

    @staticmethod
    def forward(ctx, grads, *params):
        ctx.grads = grads
        return params[0].new_zeros(())

    @staticmethod
    def backward(ctx, upstream):
        return (None, *[None if g is None else upstream * g for g in ctx.grads])


def _agent_update(
    policy: TrainablePolicy,
    pairs: AgentPairs,
    others: torch.Tensor,
    seed: int | None,
    parts: list[slice],
    *,
    beta: float,
    max_grad_norm: float | None,
) -> tuple[torch.Tensor, bool]:
    """One agent's step on the batch (its mean MADPO loss, ``others`` (b,) detached), micro-batch by
    micro-batch: each micro-batch's graph is freed once its gradient is taken, so memory grows with the
    micro-batch. Returns the agent's detached margins (b,) and whether the step was skipped."""
    params = trainable_parameters(policy.model)
    scaler = policy.precision.scaler if policy.precision is not None else None
    accumulated: list[torch.Tensor | None] | None = None
    margins, loss_value, final = [], 0.0, None
    for k, s in enumerate(parts):
        own = agent_margins(policy, *pairs.rows(s), micro_seed(seed, k))
        margins.append(own.detach().float().cpu())
        loss = madpo_agent_loss(own, others[s].to(own.device), beta).sum() / len(pairs.prompt_ids)  # its share
        loss_value += float(loss.detach())
        if not loss.requires_grad or not torch.isfinite(loss):
            continue
        if k == len(parts) - 1:
            final = loss
            continue
        # Not the last micro-batch: keep its true (unscaled) gradient and free its graph now.
        scale = scaler.get_scale() if scaler is not None else 1.0
        grads = torch.autograd.grad(loss * scale, params, allow_unused=True)
        accumulated = _accumulate(accumulated, [None if g is None else g / scale for g in grads])
    own_margins = torch.cat(margins)
    if not math.isfinite(loss_value):
        return own_margins, True
    if final is None and accumulated is None:  # every pair identical for this agent: zero gradient
        return own_margins, False
    if accumulated is not None:  # the earlier micro-batches' gradients join the last one's in its backward
        carried = _AccumulatedGradients.apply(accumulated, *params)
        final = carried if final is None else final + carried
    stepped = backward_and_step(
        policy.optimizer, final, params, max_grad_norm=max_grad_norm, precision=policy.precision
    )
    return own_margins, not stepped


def _accumulate(total: list[torch.Tensor | None] | None, grads: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """Per parameter, the running sum of the micro-batches' gradients (None: no gradient yet)."""
    if total is None:
        return grads
    return [a if g is None else (g if a is None else a + g) for a, g in zip(total, grads, strict=True)]


class StepAgent(Protocol):
    """One agent as :func:`madpo_agents_step` drives it: the two phases of a step on the agent's side of the
    batch. Each method returns its result, or a handle that the step's ``gather`` turns into it (so that a
    remote agent's calls run in parallel with the others': :mod:`pbrl.distributed.ray_agents`). :class:`LocalAgent` is
    the in-process one."""

    def has_dropout(self) -> bool: ...

    def detached_margins(self, prompt_ids, winner_ids, loser_ids, seed: int | None, parts: list[slice]) -> Any:
        """Phase 1: the agent's (b,) float32 CPU margins without a graph (:func:`_detached_margins`)."""
        ...

    def update(
        self,
        prompt_ids,
        winner_ids,
        loser_ids,
        others: torch.Tensor,
        seed: int | None,
        parts: list[slice],
        *,
        beta: float,
        max_grad_norm: float | None,
    ) -> Any:
        """Phase 2: the agent's step against ``others`` (b,); ``((b,) own margins, skipped)``
        (:func:`_agent_update`)."""
        ...


@dataclass(frozen=True)
class LocalAgent:
    """A :class:`StepAgent` in this process: the :class:`TrainablePolicy` functions, results returned as they are."""

    policy: TrainablePolicy

    def has_dropout(self) -> bool:
        return has_dropout(self.policy.model)

    def detached_margins(self, prompt_ids, winner_ids, loser_ids, seed, parts) -> torch.Tensor:
        return _detached_margins(self.policy, AgentPairs(prompt_ids, winner_ids, loser_ids), seed, parts)

    def update(
        self, prompt_ids, winner_ids, loser_ids, others, seed, parts, *, beta, max_grad_norm
    ) -> tuple[torch.Tensor, bool]:
        pairs = AgentPairs(prompt_ids, winner_ids, loser_ids)
        return _agent_update(self.policy, pairs, others, seed, parts, beta=beta, max_grad_norm=max_grad_norm)


def madpo_agents_step(
    agents: Sequence[StepAgent],
    batch: PairBatch,
    *,
    beta: float,
    max_grad_norm: float | None,
    seeds: Sequence[int] | None = None,
    micro_batch_size: int | None = None,
    gather: Callable[[list[Any]], list[Any]] = list,
    concurrent: bool = False,
) -> StepStats:
    """Update every agent once on ``batch``; an agent whose loss or gradient norm is not finite is skipped
    (its parameters and optimizer state untouched). Each agent's step is
    :func:`pbrl.models.precision.backward_and_step` in its ``precision`` (fp16: scaled loss, unscaled clipping).

    Memory: one agent's autograd graph is alive at a time. ``micro_batch_size`` (``gradient_accumulation_steps``
    in the stage) cuts the batch into micro-batches whose gradients are accumulated into the one step, so the
    graph alive at a time covers one micro-batch of one agent; the step equals the whole-batch step (the loss is
    the batch mean either way) up to float rounding and, with dropout, the masks (one seed per micro-batch).
    ``seeds``: one dropout seed per agent for this step's training forwards (derive them with
    :func:`pbrl.data.seeds.derive_seed`, a new one per step); without ``seeds`` the forwards run without dropout,
    which only models without dropout allow.

    The agents are :class:`StepAgent` s (:class:`LocalAgent` in process, Ray actors remotely): phase 1 asks the
    agents whose margins another agent's gradient needs (:func:`phase_one_agents`) for their detached margins, the
    "others" term of agent i is the sum over the other agents' margins (Σ_{j≠i} Δ_j), phase 2 asks every agent for
    its step (:class:`pbrl.learning.madpo_phases.Phases`; the order of the two, ``concurrent`` or in process:
    :func:`pbrl.learning.madpo_phases.run_phases`). ``gather`` turns a phase's list of per-agent results (or
    handles, e.g. Ray object refs with ``ray.get``) into the results. The returned ``margins`` are each agent's
    from its training forward.

    Raises:
        ValueError: ``seeds`` is not one per agent, or is missing while a model has dropout.
    """
    _check_seeds(agents, seeds)
    parts = micro_batches(batch.size, micro_batch_size)
    differs = changed_pairs(batch)  # (a, b)
    phases = Phases(
        agents,
        batch,
        [None if seeds is None else seeds[i] for i in range(len(agents))],
        parts,
        needed=phase_one_agents(differs),  # a subset of the agents that are not idle
        idle=[not any(row) for row in differs],  # identical_sides of each agent's pairs
        changes=torch.tensor(differs).T,  # (b, a)
        gather=gather,
        beta=beta,
        max_grad_norm=max_grad_norm,
    )
    margins, results = run_phases(phases, concurrent)
    for i, (own, _) in enumerate(results):  # the statistics: every agent's margins from its training forward
        margins[:, i] = own
    return StepStats(
        loss=float(madpo_loss(margins, beta).mean()),
        accuracy=float(preference_accuracy(margins)),
        margins=margins,
        skipped=tuple(was_skipped for _, was_skipped in results),
        idle=tuple(phases.idle),
    )
