"""One MADPO update on the tiny model: what moves and which way, what does not, and the non-finite guard."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

import pbrl.learning.madpo as madpo
from pbrl.learning.madpo import PairBatch
from pbrl.models.loading import load_policy
from pbrl.models.lora import LoraSettings
from pbrl.models.policies import TrainablePolicy, trainable_parameters
from tests.helpers import madpo_step
from tests.helpers import tiny_policies as policies

PROMPTS = [[2, 40, 41, 42, 3, 2, 50], [2, 60, 61, 3, 2, 50]]
WINNERS = [[70, 71, 72, 3], [80, 81, 3]]
LOSERS = [[90, 91, 3], [100, 101, 102, 103, 104]]


def batch(winners=WINNERS, losers=LOSERS) -> PairBatch:
    return PairBatch(prompt_ids=[PROMPTS, PROMPTS], winner_ids=[winners, winners], loser_ids=[losers, losers])


def snapshot(policy: TrainablePolicy) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in policy.model.named_parameters()}


def margins_alone(model) -> list[float]:
    """Δ per pair by brute force: each sequence scored alone, unpadded, with ``log_softmax``."""
    out = []
    for prompt, w, lo in zip(PROMPTS, WINNERS, LOSERS, strict=True):
        m = 0.0
        for sign, completion in ((1.0, w), (-1.0, lo)):
            with torch.no_grad():
                logp = torch.log_softmax(model(input_ids=torch.tensor([prompt + completion])).logits[0].double(), -1)
            m += sign * sum(float(logp[len(prompt) - 1 + j, t]) for j, t in enumerate(completion))
        out.append(m)
    return out


def test_every_trainable_parameter_of_every_agent_moves_and_every_margin_rises(tiny_model_dir):
    agents = policies(tiny_model_dir, lr=1e-3)
    before = [snapshot(p) for p in agents]
    margins_before = [margins_alone(p.model) for p in agents]
    stats = madpo_step(agents, batch(), beta=0.1, max_grad_norm=None)
    assert stats.skipped == (False, False)
    for p, b in zip(agents, before, strict=True):
        for name, param in p.model.named_parameters():
            assert not torch.equal(param, b[name]), f"{name} did not change"
    # The direction: every agent's winner gains log-probability on its loser, on every pair.
    for p, m0 in zip(agents, margins_before, strict=True):
        assert all(after > prior for after, prior in zip(margins_alone(p.model), m0, strict=True))


def test_lora_moves_adapters_and_never_base_weights(tiny_model_dir, tmp_path):
    agents = policies(
        tiny_model_dir, lora=LoraSettings(r=4, target_modules=("q_proj", "v_proj")), adapter_root=tmp_path
    )
    before = [snapshot(p) for p in agents]
    # lora_B starts at zero, so lora_A's first gradient is exactly zero (dL/dA = B^T ... = 0): A moves from
    # the second update on. Two updates, then every adapter weight has moved and no base weight has.
    madpo_step(agents, batch(), beta=0.1, max_grad_norm=1.0)
    madpo_step(agents, batch(), beta=0.1, max_grad_norm=1.0)
    for p, b in zip(agents, before, strict=True):
        for name, param in p.model.named_parameters():
            if param.requires_grad:
                assert "lora_" in name and not torch.equal(param, b[name]), name
            else:
                assert torch.equal(param, b[name]), f"frozen {name} changed"


def test_identical_winner_and_loser_give_log2_and_no_change(tiny_model_dir):
    agents = policies(tiny_model_dir)
    before = [snapshot(p) for p in agents]
    stats = madpo_step(agents, batch(winners=WINNERS, losers=WINNERS), beta=0.1, max_grad_norm=1.0)
    assert stats.loss == pytest.approx(math.log(2), abs=1e-7)
    assert stats.skipped == (False, False) and stats.accuracy == 0.0  # a zero margin is not a right answer
    assert torch.equal(stats.margins, torch.zeros(2, 2))
    for p, b in zip(agents, before, strict=True):
        assert all(torch.equal(param, b[n]) for n, param in p.model.named_parameters())
        assert p.optimizer.state_dict()["state"] == {}


def test_nan_margin_skips_the_step_and_leaves_state_bitwise(tiny_model_dir, monkeypatch):
    agents = policies(tiny_model_dir)
    madpo_step(agents, batch(), beta=0.1, max_grad_norm=1.0)  # optimizer state now exists
    before = [snapshot(p) for p in agents]
    opt_before = [
        {
            k: {s: v.clone() if torch.is_tensor(v) else v for s, v in st.items()}
            for k, st in p.optimizer.state_dict()["state"].items()
        }
        for p in agents
    ]
    real = madpo.agent_margins

    def poisoned(policy, *args):
        out = real(policy, *args)
        return out * torch.nan if policy is agents[1] else out

    monkeypatch.setattr(madpo, "agent_margins", poisoned)
    stats = madpo_step(agents, batch(), beta=0.1, max_grad_norm=1.0)
    # Agent 1's margin is NaN on pairs that change both agents, so the joint margin is NaN for both: both skipped.
    assert stats.skipped == (True, True)
    for p, b, ob in zip(agents, before, opt_before, strict=True):
        assert all(torch.equal(param, b[n]) for n, param in p.model.named_parameters())
        state = p.optimizer.state_dict()["state"]
        for k, st in ob.items():
            for s, v in st.items():
                assert torch.equal(state[k][s], v) if torch.is_tensor(v) else state[k][s] == v


@pytest.mark.parametrize("concurrent", [False, True])
def test_a_nan_margin_on_a_pair_that_changes_only_another_agent_skips_only_that_agent(
    tiny_model_dir, monkeypatch, concurrent
):
    """The review's reproducer: counterfactual pairs (pair 0 changes agent 0 only, pair 1 agent 1 only) and agent 0's
    margins NaN. Agent 1's loss has no gradient on pair 0, so agent 0's NaN there must not skip agent 1's step; it
    did in process (the others term carried it), and not concurrently, once phase 1 asked nobody."""
    from pbrl.learning.madpo import LocalAgent, madpo_agents_step

    agents = policies(tiny_model_dir)
    before = [snapshot(p) for p in agents]
    real = madpo.agent_margins

    def poisoned(policy, prompt_ids, winner_ids, loser_ids, *rest):  # NaN where agent 0's sides differ (pair 0)
        out = real(policy, prompt_ids, winner_ids, loser_ids, *rest)
        changed = torch.tensor([list(w) != list(lo) for w, lo in zip(winner_ids, loser_ids, strict=True)])
        return out.masked_fill(changed, torch.nan) if policy is agents[0] else out

    monkeypatch.setattr(madpo, "agent_margins", poisoned)
    pairs = PairBatch(
        prompt_ids=[PROMPTS, PROMPTS],
        winner_ids=[WINNERS, WINNERS],
        loser_ids=[[LOSERS[0], WINNERS[1]], [WINNERS[0], LOSERS[1]]],
    )
    stats = madpo_agents_step(
        [LocalAgent(p) for p in agents], pairs, beta=0.1, max_grad_norm=1.0, concurrent=concurrent
    )
    assert stats.skipped == (True, False)
    assert all(torch.equal(param, before[0][n]) for n, param in agents[0].model.named_parameters())
    assert not all(torch.equal(param, before[1][n]) for n, param in agents[1].model.named_parameters())


def test_gradient_weight_is_the_joint_margins_for_every_agent(tiny_model_dir):
    """One pair, plain SGD at lr 1: madpo_step moves agent i by β σ(−β Σ_j Δ_j) ∇Δ_i
    (docs/design/algorithms.md#loss-and-gradient), the same
    weight for every agent; ∇Δ_i and Δ_i come from a brute-force, unpadded forward and backward."""
    beta = 0.5
    agents = []
    for seed in (0, 1):
        model = load_policy(
            tiny_model_dir, checkpoint_dir=None, lora=None, device="cpu", dtype="float32", trainable=True
        )
        with torch.no_grad():
            gen = torch.Generator().manual_seed(seed)
            for p in model.parameters():
                p.add_(0.01 * torch.randn(p.shape, generator=gen))
        agents.append(TrainablePolicy(model, torch.optim.SGD(trainable_parameters(model), lr=1.0), pad_token_id=0))
    margins, grads = [], []
    for p in agents:
        m = 0.0
        for sign, completion in ((1.0, WINNERS[0]), (-1.0, LOSERS[0])):
            logp = torch.log_softmax(p.model(input_ids=torch.tensor([PROMPTS[0] + completion])).logits[0].double(), -1)
            m = m + sign * sum(logp[len(PROMPTS[0]) - 1 + j, t] for j, t in enumerate(completion))
        m.backward()
        margins.append(float(m))
        grads.append(torch.cat([q.grad.flatten() for q in trainable_parameters(p.model)]).double())
        p.model.zero_grad(set_to_none=True)
    weight = beta / (1 + math.exp(beta * sum(margins)))  # β σ(−β Δ)
    before = [torch.cat([q.detach().flatten() for q in trainable_parameters(p.model)]).double() for p in agents]
    one = PairBatch(prompt_ids=[PROMPTS[:1]] * 2, winner_ids=[WINNERS[:1]] * 2, loser_ids=[LOSERS[:1]] * 2)
    madpo_step(agents, one, beta=beta, max_grad_norm=None)
    for p, b, g in zip(agents, before, grads, strict=True):
        moved = torch.cat([q.detach().flatten() for q in trainable_parameters(p.model)]).double() - b
        assert torch.allclose(moved, weight * g, rtol=1e-3, atol=5e-6)  # float32 rounding of the update


def test_margins_match_separate_scoring(tiny_model_dir):
    from pbrl.learning.logprobs import sequence_logprobs

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    policy = TrainablePolicy(model, torch.optim.SGD(model.parameters(), lr=0.0), pad_token_id=0)
    with torch.no_grad():
        m = madpo.agent_margins(policy, PROMPTS, WINNERS, LOSERS)
        w = sequence_logprobs(model, PROMPTS, WINNERS, pad_token_id=0)
        lo = sequence_logprobs(model, PROMPTS, LOSERS, pad_token_id=0)
    assert torch.allclose(m, w - lo, atol=1e-5)
