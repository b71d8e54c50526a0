"""MADPO's learning step pinned by its direction and its coupling (docs/design/algorithms.md#madpo), on the tiny model.

Wrong versions of ``pbrl.learning.madpo.madpo_agents_step`` that these tests make fail (re-check by applying each to
a copy
of the repository and running this module):

1. Each agent's loss on the negated margins, ``madpo_agent_loss(-own[i], -others, beta)`` (it then raises
   the loser's log-probability): ``test_one_step_raises_every_agents_margin_and_the_joint_margin`` fails.
2. Each agent's credit weight from its own margin only, ``others = 0 * (sum of the other agents' margins)``:
   ``test_agent_zeros_gradient_scales_with_agent_ones_margin_by_the_sigmoid_factor`` fails.

3. In process (``madpo_agents_step`` with ``concurrent=False``), agent 0's column of the margins left at 0 for
   the later agents instead of its update's own margins, or agent 0 asked for a graph-free pass it does not
   need (the saved forward): ``test_the_step_equals_the_written_out_two_phase_arithmetic_bitwise``
   fails; with ``concurrent=True`` (Ray actors) every agent whose margins another needs must be asked for phase 1
   before any update, and with pairs that change one agent each nobody is
   (``test_agents_whose_margins_nobody_needs_skip_phase_one_and_the_step_is_unchanged``).

Expectations come from a brute-force reference (each sequence scored alone by a plain forward pass and
``log_softmax``) and the closed form of the gradient, never from the code under test.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from pbrl.learning.madpo import PairBatch
from pbrl.models.lora import LoraSettings
from pbrl.models.policies import TrainablePolicy
from tests.helpers import logprob_alone, madpo_step, tiny_policies

PROMPTS = [[2, 40, 41, 42, 3, 2, 50], [2, 60, 61, 3, 2, 50]]


def reference_margins(model, prompts, winners, losers) -> list[float]:
    return [
        logprob_alone(model, p, w) - logprob_alone(model, p, lo)
        for p, w, lo in zip(prompts, winners, losers, strict=True)
    ]


def load(model_dir, seed: int, optimizer: str = "adamw", lr: float = 1e-3) -> TrainablePolicy:
    """The tiny model with its weights perturbed by ``seed`` (so agents differ), in float32."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=gen))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0) if optimizer == "adamw" else torch.optim.SGD(params, lr=lr)
    return TrainablePolicy(model, opt, pad_token_id=0)


# Per agent: two pairs whose winner is a different sequence from the loser (a clear winner by the oracle).
AGENT_PAIRS = [
    ([[70, 71, 72, 3], [80, 81, 3]], [[90, 91, 3], [100, 101, 102, 103, 104]]),
    ([[110, 111, 3], [120, 3]], [[130, 131, 132, 3], [140, 141, 3]]),
    ([[150, 151, 152, 153, 3], [160, 161, 3]], [[170, 3], [180, 181, 182, 3]]),
]


@pytest.mark.parametrize("num_agents", [2, 3])
def test_one_step_raises_every_agents_margin_and_the_joint_margin(tiny_model_dir, num_agents):
    agents = [load(tiny_model_dir, seed=10 + i) for i in range(num_agents)]
    winners = [AGENT_PAIRS[i][0] for i in range(num_agents)]
    losers = [AGENT_PAIRS[i][1] for i in range(num_agents)]
    batch = PairBatch(prompt_ids=[PROMPTS] * num_agents, winner_ids=winners, loser_ids=losers)
    before = [reference_margins(a.model, PROMPTS, winners[i], losers[i]) for i, a in enumerate(agents)]

    stats = madpo_step(agents, batch, beta=0.1, max_grad_norm=None)

    assert stats.skipped == (False,) * num_agents
    after = [reference_margins(a.model, PROMPTS, winners[i], losers[i]) for i, a in enumerate(agents)]
    for i in range(num_agents):
        for j in range(len(PROMPTS)):
            # The winner's log-probability rises relative to the loser's, for every agent and every pair.
            assert after[i][j] > before[i][j] + 1e-4, (i, j, before[i][j], after[i][j])
    for j in range(len(PROMPTS)):
        assert sum(a[j] for a in after) > sum(b[j] for b in before)
    # The stats report the margins before the step (they are what the loss was computed on).
    assert torch.allclose(stats.margins, torch.tensor(before, dtype=torch.float32).T, atol=1e-4)
    joint = [sum(b[j] for b in before) for j in range(len(PROMPTS))]
    assert stats.loss == pytest.approx(sum(-math.log(1 / (1 + math.exp(-0.1 * d))) for d in joint) / 2, rel=1e-5)


def _agent_zero_update(model_dir, agent1_winner: list[int], agent1_loser: list[int], beta: float):
    """One plain-SGD (lr 1) step on one pair; returns agent 0's parameter change (= −gradient) as one vector."""
    agents = [load(model_dir, seed=20, optimizer="sgd", lr=1.0), load(model_dir, seed=21, optimizer="sgd", lr=1.0)]
    before = torch.cat([p.detach().flatten().clone() for p in agents[0].model.parameters()]).double()
    batch = PairBatch(
        prompt_ids=[PROMPTS[:1], PROMPTS[:1]],
        winner_ids=[[[70, 71, 72, 3]], [agent1_winner]],
        loser_ids=[[[90, 91, 3]], [agent1_loser]],
    )
    madpo_step(agents, batch, beta=beta, max_grad_norm=None)
    after = torch.cat([p.detach().flatten() for p in agents[0].model.parameters()]).double()
    return after - before


def test_agent_zeros_gradient_scales_with_agent_ones_margin_by_the_sigmoid_factor(tiny_model_dir):
    """Agent 0's pair and weights are the same in both steps; only agent 1's margin differs.

    ∇_θ0 L = −β σ(−β (Δ_0 + Δ_1)) ∇Δ_0, so the ratio of agent 0's updates is σ(−β(Δ_0 + Δ_1)) / σ(−β Δ_0):
    step A has Δ_1 = 0 exactly (agent 1's winner equals its loser); step B has agent 1's winner much less
    likely than its loser (Δ_1 ≈ −10 nats), which must raise agent 0's credit weight.
    """
    beta = 0.2
    ref0 = load(tiny_model_dir, seed=20).model
    ref1 = load(tiny_model_dir, seed=21).model
    d0 = reference_margins(ref0, PROMPTS[:1], [[70, 71, 72, 3]], [[90, 91, 3]])[0]
    long_winner, short_loser = [110, 111, 112, 113, 3], [120, 3]
    d1 = reference_margins(ref1, PROMPTS[:1], [long_winner], [short_loser])[0]
    assert d1 < -5  # a real change in agent 1's margin, several nats

    def sigma(x: float) -> float:
        return 1 / (1 + math.exp(-x))

    expected_ratio = sigma(-beta * (d0 + d1)) / sigma(-beta * d0)
    assert expected_ratio > 1.3  # large enough that "agent 1 does not matter" (ratio 1) is far off

    step_a = _agent_zero_update(tiny_model_dir, [120, 3], [120, 3], beta)
    step_b = _agent_zero_update(tiny_model_dir, long_winner, short_loser, beta)
    assert step_a.norm() > 0
    # Same direction (∇Δ_0 does not depend on agent 1), magnitudes in the hand-worked ratio.
    cosine = float(step_a @ step_b / (step_a.norm() * step_b.norm()))
    assert cosine == pytest.approx(1.0, abs=1e-5)
    assert float(step_b.norm() / step_a.norm()) == pytest.approx(expected_ratio, rel=1e-3)
    # And the absolute size: with SGD at lr 1 the change is +β σ(−β Δ_0) ∇Δ_0 (∇Δ_0 by brute force).
    model = load(tiny_model_dir, seed=20).model
    ids = torch.tensor([PROMPTS[0] + [70, 71, 72, 3]]), torch.tensor([PROMPTS[0] + [90, 91, 3]])
    margin = 0.0
    for sign, seq, completion in ((1, ids[0], [70, 71, 72, 3]), (-1, ids[1], [90, 91, 3])):
        logp = torch.log_softmax(model(input_ids=seq).logits[0].double(), dim=-1)  # (t, v)
        start = len(PROMPTS[0]) - 1
        margin = margin + sign * sum(logp[start + j, tok] for j, tok in enumerate(completion))
    margin.backward()
    grad = torch.cat([p.grad.flatten() for p in model.parameters()]).double()
    assert torch.allclose(step_a, beta * sigma(-beta * d0) * grad, rtol=1e-3, atol=5e-6)


PROMPTS_3 = [[2, 40, 41, 42, 3, 2, 50], [2, 60, 61, 3, 2, 50], [2, 40, 41, 42, 3, 2, 50]]
# Per agent, three pairs; agent 1's third pair has the same sides (it moves nobody).
WINNERS = [
    [[70, 71, 72, 3], [80, 81, 3], [75, 3]],
    [[71, 3], [82, 83, 84, 3], [76, 77, 3]],
    [[73, 3], [85, 3], [78, 79, 3]],
]
LOSERS = [
    [[90, 91, 3], [100, 101, 102, 103, 104], [95, 96, 3]],
    [[92, 3], [105, 3], [76, 77, 3]],
    [[93, 94, 3], [106, 3], [97, 3]],
]


def check_step_against_two_phase(tiny_model_dir, tmp_path, batch, concurrent, order) -> None:
    """Runs :func:`pbrl.learning.madpo.madpo_agents_step` over agents whose calls return handles (as Ray actors' do)
    for two steps and checks the order of the calls, then that its parameters, AdamW state and statistics equal,
    bit for bit, the two-phase ``madpo_step`` written out here: every agent's detached margins, then each agent's
    update in turn against the sum of the others' (Σ_{j≠i} in agent order)."""
    from pbrl.learning.losses import madpo_loss
    from pbrl.learning.madpo import (
        AgentPairs,
        LocalAgent,
        _agent_update,
        _detached_margins,
        madpo_agents_step,
        micro_batches,
    )

    num_agents = len(batch.winner_ids)
    lora = LoraSettings(r=4, dropout=0.1)  # dropout on: the seeds choose the masks
    reference = tiny_policies(tiny_model_dir, lora, adapter_root=tmp_path / "a", n=num_agents)
    remote = tiny_policies(tiny_model_dir, lora, adapter_root=tmp_path / "b", n=num_agents)
    events: list[str] = []

    class Deferred(LocalAgent):
        def detached_margins(self, *args):
            events.append(f"margins {remote.index(self.policy)}")
            return lambda: LocalAgent.detached_margins(self, *args)

        def update(self, *args, **kw):
            events.append(f"update {remote.index(self.policy)}")
            return lambda: LocalAgent.update(self, *args, **kw)

    def gather(handles):
        events.append("gather")
        return [h() for h in handles]

    for step in range(2):
        seeds = [1000 + 10 * step + i for i in range(num_agents)]
        parts = micro_batches(batch.size, 2)  # two micro-batches: [0, 2) and [2, 3)
        args = [(batch.prompt_ids[i], batch.winner_ids[i], batch.loser_ids[i]) for i in range(num_agents)]
        margins = torch.stack(
            [_detached_margins(p, AgentPairs(*args[i]), seeds[i], parts) for i, p in enumerate(reference)], 1
        )
        others = [
            sum((margins[:, j] for j in range(num_agents) if j != i), torch.zeros(batch.size))
            for i in range(num_agents)
        ]
        skipped = [
            _agent_update(p, AgentPairs(*args[i]), others[i], seeds[i], parts, beta=0.1, max_grad_norm=1.0)[1]
            for i, p in enumerate(reference)
        ]
        events.clear()
        mode = {} if concurrent is None else {"concurrent": concurrent}
        stats = madpo_agents_step(
            [Deferred(p) for p in remote],
            batch,
            beta=0.1,
            max_grad_norm=1.0,
            seeds=seeds,
            micro_batch_size=2,
            gather=gather,
            **mode,
        )
        assert events == order
        assert torch.equal(stats.margins, margins) and stats.skipped == tuple(skipped) == (False,) * num_agents
        assert stats.loss == float(madpo_loss(margins, 0.1).mean())
    for ref, got, idle in zip(reference, remote, stats.idle, strict=True):
        for (name, a), (_, b) in zip(ref.model.named_parameters(), got.model.named_parameters(), strict=True):
            assert torch.equal(a, b), name
        sa, sb = ref.optimizer.state_dict()["state"], got.optimizer.state_dict()["state"]
        assert sa.keys() == sb.keys() and (len(sa) == 0) == idle  # an idle agent never stepped
        assert all(torch.equal(sa[k][n], sb[k][n]) for k in sa for n in sa[k])


@pytest.mark.parametrize(
    ("concurrent", "num_agents", "order"),
    [
        (True, 2, ["margins 0", "margins 1", "gather", "update 0", "update 1", "gather"]),
        # In process agent 0 skips phase 1: its update's own margins are its "others" term for the later agents.
        (False, 2, ["margins 1", "gather", "update 0", "gather", "update 1", "gather"]),
        (None, 2, ["margins 1", "gather", "update 0", "gather", "update 1", "gather"]),  # in process is the default
        (False, 3, ["margins 1", "margins 2", "gather", "update 0", "gather", "update 1", "update 2", "gather"]),
        # One agent has no others: no graph-free pass, concurrent or not.
        (True, 1, ["update 0", "gather"]),
        (False, 1, ["update 0", "gather"]),
    ],
)
def test_the_step_equals_the_written_out_two_phase_arithmetic_bitwise(
    tiny_model_dir, tmp_path, concurrent, num_agents, order
):
    """Every pair changes two agents or more here, so every agent's detached margins are needed (concurrent, Ray:
    every agent has phase 1; in process agent 0 has none, and its training forward's margins give the same bits)."""
    batch = PairBatch(
        prompt_ids=[PROMPTS_3] * num_agents, winner_ids=WINNERS[:num_agents], loser_ids=LOSERS[:num_agents]
    )
    check_step_against_two_phase(tiny_model_dir, tmp_path, batch, concurrent, order)


def counterfactual(agent_of_pair: list[int | None], num_agents: int) -> PairBatch:
    """Pair j changes only agent ``agent_of_pair[j]`` (None: it changes agents 1 and 2); every other agent has the
    winner's ids on both sides."""
    changes = [{1, 2} if changed is None else {changed} for changed in agent_of_pair]
    losers = [[LOSERS[0][j] if i in c else WINNERS[i][j] for j, c in enumerate(changes)] for i in range(num_agents)]
    return PairBatch(prompt_ids=[PROMPTS_3] * num_agents, winner_ids=WINNERS[:num_agents], loser_ids=losers)


@pytest.mark.parametrize(
    ("agent_of_pair", "num_agents", "concurrent", "order"),
    [
        # Each pair changes one agent: nobody's detached margins are needed, in process or concurrent.
        ([0, 1, 0], 2, False, ["update 0", "gather", "update 1", "gather"]),
        ([0, 1, 0], 2, True, ["update 0", "update 1", "gather"]),
        ([1, 0, 1], 3, False, ["update 0", "gather", "update 1", "gather"]),  # agent 2 idle: never asked
        # Pair 0 changes agents 1 and 2: they need each other's margins; agent 0's are nobody's business.
        (
            [None, 0, 0],
            3,
            False,
            ["margins 1", "margins 2", "gather", "update 0", "gather", "update 1", "update 2", "gather"],
        ),
        ([None, 0, 0], 3, True, ["margins 1", "margins 2", "gather", "update 0", "update 1", "update 2", "gather"]),
    ],
)
def test_agents_whose_margins_nobody_needs_skip_phase_one_and_the_step_is_unchanged(
    tiny_model_dir, tmp_path, agent_of_pair, num_agents, concurrent, order
):
    """A pair that changes one agent moves nobody else (the others' gradient there is a constant times ∇Δ ≡ 0),
    so an agent is asked for detached margins only if some pair changes it and another agent: counterfactual pairs
    cost one training forward and backward per agent. The step still equals the written-out two phases bit for
    bit, statistics included (each agent's margins then come from its training forward)."""
    batch = counterfactual(agent_of_pair, num_agents)
    check_step_against_two_phase(tiny_model_dir, tmp_path, batch, concurrent, order)


def test_phase_one_agents_by_hand():
    """Hand-worked: which agents' detached margins another agent's gradient needs."""
    from pbrl.learning.madpo import changed_pairs, phase_one_agents

    def batch(changes: list[set[int]], agents: int) -> list[list[bool]]:  # pair j changes the agents in changes[j]
        pairs = PairBatch(
            prompt_ids=[[[1]] * len(changes)] * agents,
            winner_ids=[[[5]] * len(changes)] * agents,
            loser_ids=[[[6] if i in c else [5] for c in changes] for i in range(agents)],
        )
        assert changed_pairs(pairs) == [[i in c for c in changes] for i in range(agents)]
        return changed_pairs(pairs)

    assert phase_one_agents(batch([{0}, {1}], 2)) == [False, False]  # counterfactual pairs
    assert phase_one_agents(batch([{0, 1}], 2)) == [True, True]
    assert phase_one_agents(batch([{0}, {1, 2}, {2}], 3)) == [False, True, True]
    assert phase_one_agents(batch([set(), {0, 1, 2}], 3)) == [True, True, True]
    assert phase_one_agents(batch([{0}], 1)) == [False]  # one agent has no others
