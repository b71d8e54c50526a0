"""One MADPO update step over a batch of pairs (docs/design/algorithms.md#the-update-step): every agent moves with its
own margin and the
others' margins detached, so the credit weight −β σ(−βΔ) is the joint margin's for every agent.

With several agents, the margins of agents 1…a−1 are first computed without gradients where another agent's
gradient needs them (their detached values are the "others" terms; no agent has moved yet; counterfactual pairs need
none, :func:`phase_one_agents`), then each agent in turn scores with gradients, steps and frees its graph, agent 0
first: its margins from that forward, before it steps, join the others terms of the later
agents (Ray actors, which work in parallel, compute the detached margins others need first: ``concurrent``). One agent's
graph is alive at a time, so training memory does not grow with the number of agents.
Each distinct prompt of a batch runs once (:func:`pbrl.learning.logprobs.shared_prompt_logprobs`).
These training forwards run in train mode, so dropout (``lora_dropout``) takes effect, with masks drawn
from a seed per agent and step; sampling and evaluation forwards run in eval mode without gradients.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from pbrl.learning.logprobs import sequence_logprobs, shared_prompt_logprobs, uses_activation_checkpointing
from pbrl.learning.losses import madpo_agent_loss, madpo_loss, preference_accuracy
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
    rows
    are scored in one padded forward pass instead.
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


def _detached_margins(
    policy: TrainablePolicy, prompt_ids, winner_ids, loser_ids, seed: int | None, parts: list[slice]
) -> torch.Tensor:
    """(b,) float32 margins without a graph, micro-batch by micro-batch with the training forwards' seeds (so
    the same dropout masks, hence the same values as the training forward that follows)."""
    with torch.no_grad():
        return torch.cat(
            [
                agent_margins(policy, prompt_ids[s], winner_ids[s], loser_ids[s], micro_seed(seed, k)).float().cpu()
                for k, s in enumerate(parts)
            ]
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
    prompt_ids,
    winner_ids,
    loser_ids,
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
    size = len(prompt_ids)
    params = trainable_parameters(policy.model)
    scaler = policy.precision.scaler if policy.precision is not None else None
    accumulated: list[torch.Tensor | None] | None = None
    margins, loss_value, final = [], 0.0, None
    for k, s in enumerate(parts):
        own = agent_margins(policy, prompt_ids[s], winner_ids[s], loser_ids[s], micro_seed(seed, k))
        margins.append(own.detach().float().cpu())
        loss = madpo_agent_loss(own, others[s].to(own.device), beta).sum() / size  # this micro-batch's share
        loss_value += float(loss.detach())
        if not loss.requires_grad or not torch.isfinite(loss):
            continue
        if k == len(parts) - 1:
            final = loss
            continue
        # Not the last micro-batch: keep its true (unscaled) gradient and free its graph now.
        scale = scaler.get_scale() if scaler is not None else 1.0
        grads = torch.autograd.grad(loss * scale, params, allow_unused=True)
        grads = [None if g is None else g / scale for g in grads]
        accumulated = (
            grads
            if accumulated is None
            else [a if g is None else (g if a is None else a + g) for a, g in zip(accumulated, grads, strict=True)]
        )
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
        return _detached_margins(self.policy, prompt_ids, winner_ids, loser_ids, seed, parts)

    def update(
        self, prompt_ids, winner_ids, loser_ids, others, seed, parts, *, beta, max_grad_norm
    ) -> tuple[torch.Tensor, bool]:
        return _agent_update(
            self.policy, prompt_ids, winner_ids, loser_ids, others, seed, parts, beta=beta, max_grad_norm=max_grad_norm
        )


# Over 60 lines because of its docstring (the two phases, memory and the in-process order); the code is ~40 lines.
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
    "others" term of agent i is the sum over the other agents' margins (Σ_{j≠i} Δ_j),
    phase 2 asks every agent for its step. ``gather`` turns a phase's list of per-agent results (or handles,
    e.g. Ray object refs with ``ray.get``) into the results.

    ``concurrent`` (remote agents, e.g. :mod:`pbrl.distributed.ray_agents`): every agent of a phase is asked before
    ``gather`` is called, so they work in parallel; every agent that :func:`phase_one_agents` names computes its
    detached margins in phase 1. In process (the default, agents one after another) agent 0 skips phase 1: its
    update is asked first, and the margins its training forward computes before it steps (the same function on
    the same weights with the same dropout seeds, hence the same values, bitwise on CPU) are its "others" term for
    the agents after it. That saves one of the step's 3a forward-or-backward passes per micro-batch (a
    detached forward costs about half a forward and backward; measured on SmolLM2,
    docs/results/benchmarks.md#shared-prompts-and-memory)
    and gives the same step. An agent whose margins no other agent's gradient needs skips phase 1 too (a pair that
    changes only agent i moves nobody else): with counterfactual pairs, a step is one training forward and backward
    per agent and micro-batch. The returned ``margins`` are each agent's from its training forward.

    Agent i's others term is left out (0) on the pairs that do not change it: its loss there has no gradient, so
    its step is skipped only when its loss on its own pairs is not finite, in every mode and agent order.

    An agent whose winner and loser ids are the same in every pair of the batch (:func:`identical_sides`; with
    ``joint_mode: cross``, counterfactual pairs that change other agents) is not asked in either phase: its
    margins are exactly 0, its weights and optimizer state do not move, and ``StepStats.idle`` marks it.
    Within a batch, such pairs cost an agent nothing either (:func:`agent_margins` skips them).

    Raises:
        ValueError: ``seeds`` is not one per agent, or is missing while a model has dropout.
    """
    if seeds is not None and len(seeds) != len(agents):
        raise ValueError(f"seeds: got {len(seeds)} for {len(agents)} agents; give one dropout seed per agent")
    if seeds is None and any(agent.has_dropout() for agent in agents):
        raise ValueError(
            "seeds: a policy has dropout (lora_dropout > 0), so its training forwards need one dropout seed per agent"
        )
    parts = micro_batches(batch.size, micro_batch_size)
    n = len(agents)
    agent_seeds = [None if seeds is None else seeds[i] for i in range(n)]
    args = [(batch.prompt_ids[i], batch.winner_ids[i], batch.loser_ids[i]) for i in range(n)]
    # An agent whose sides are identical in every pair has margins ≡ 0 and no gradient: it is not asked at all (no
    # forward, no backward, no optimizer step, no round trip to a remote agent); its margins column stays 0.
    differs = changed_pairs(batch)  # (a, b)
    idle = [not any(row) for row in differs]  # identical_sides of each agent's pairs
    needed = phase_one_agents(differs)  # a subset of the agents that are not idle
    # Agent i's others term only where a pair changes i: elsewhere its loss has no gradient, and a term there (a
    # NaN margin of another agent on a pair that changes only that agent) would skip i's step for nothing, in one
    # mode and not the other (phase 1 is not asked for those margins).
    changes = torch.tensor(differs).T  # (b, a)

    def detached(ids: list[int]) -> None:  # phase 1 for agents ``ids``: their columns of ``margins``
        ids = [i for i in ids if needed[i]]
        if not ids:
            return
        for i, m in zip(
            ids, gather([agents[i].detached_margins(*args[i], agent_seeds[i], parts) for i in ids]), strict=True
        ):
            margins[:, i] = m

    def updates(ids: list[int]) -> list[Any]:  # phase 2 for agents ``ids``, against the others' columns
        asked = [i for i in ids if not idle[i]]
        got = (
            gather(
                [
                    agents[i].update(
                        *args[i],
                        margins[:, [j for j in range(n) if j != i]].sum(dim=1).where(changes[:, i], 0.0),
                        agent_seeds[i],
                        parts,
                        beta=beta,
                        max_grad_norm=max_grad_norm,
                    )
                    for i in asked
                ]
            )
            if asked
            else []
        )
        by_agent = dict(zip(asked, got, strict=True))
        return [by_agent.get(i, (torch.zeros(batch.size), False)) for i in ids]

    margins = torch.zeros(batch.size, n)  # (b, a): column i is agent i's detached margins (0 until computed)
    if concurrent and n > 1:
        detached(list(range(n)))
        results = updates(list(range(n)))
    else:  # agents one after another (or a single agent: no others to wait for)
        detached(list(range(1, n)))
        results = updates([0])
        margins[:, 0] = results[0][0]  # agent 0's own margins, from its update's forward, for the later agents
        results += updates(list(range(1, n)))
    for i, (own, _) in enumerate(results):  # the statistics: every agent's margins from its training forward
        margins[:, i] = own
    skipped = [was_skipped for _, was_skipped in results]
    return StepStats(
        loss=float(madpo_loss(margins, beta).mean()),
        accuracy=float(preference_accuracy(margins)),
        margins=margins,
        skipped=tuple(skipped),
        idle=tuple(idle),
    )
