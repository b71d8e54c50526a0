"""The RL modules (``pbrl/learning/rl.py``, ``pbrl/learning/advantages.py``,
docs/design/algorithms.md#marlhf-policy-learning) pinned where ``make mutate`` found behaviour no test checked
(docs/results/mutation.md#the-last-measured-run). Expectations are worked out by hand in each test (never by calling
the code
under test), or come from a brute-force reference.

Wrong versions (mutmut ids of ``pbrl/learning/rl.py`` and ``advantages.py``) made to fail here, by family:

- ``rl_metrics``: every key name, the agent-0 filter of the rewards (one score per joint response), the
  ``None`` filters of rewards and advantages, the sample (not population) or missing std, the loss mean
  taking a non-loss key (``rl/reward_mean`` of a step) or none, the per-agent KL means and skip counts, and
  the NaN of an empty pass (``mean`` / ``np.std`` on nothing, ``float(None)``).
- ``normalize_group``: the standard deviation over the whole batch (``dim=None``) instead of per item.
- ``run_rl`` with critics (``maac``/``iac``): the error's backend name and wording, the critics not asked or
  asked with other prompts/completions, their fit check ignored or replacing/widening the reward check
  (``ok = …``, ``ok |= …``, ``all(dim=None | -2)``), the advantage not R − V or not normalised over the valid
  rows, invalid rows given an advantage, the critics not updated or updated with other returns or validity, the
  rollouts' ``value`` field lost or misnamed.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from pbrl.learning.advantages import advantage_backend, normalize_group
from pbrl.learning.rl import RLResult, rl_agent_step, rl_metrics
from tests.helpers import lora_dropout_policy


def _row(agent: int, reward: float | None, kl: float, advantage: float | None) -> dict:
    return {"agent_index": agent, "reward": reward, "kl": kl, "advantage": advantage}


def test_rl_metrics_hand_worked_values_and_names():
    result = RLResult(
        rollouts=[
            _row(0, 1.0, 0.5, 1.0),
            _row(1, 10.0, 1.5, 3.0),  # agent 1's reward column is never read
            _row(0, 4.0, 0.0, -1.0),
            _row(1, 40.0, 2.0, None),
            _row(0, None, 0.25, None),
            _row(1, None, 0.75, None),  # a dropped joint response: no reward
        ],
        steps=2,
        step_metrics=[
            {"rl/loss_agent_0": 0.2, "rl/loss_agent_1": 0.4, "rl/reward_mean": 100.0},
            {"rl/loss_agent_0": 0.6, "rl/loss_agent_1": 0.8, "rl/reward_mean": 50.0},
        ],
        skipped=[1, 2],
        dropped_groups=3,
    )
    got = rl_metrics(result, 2)
    expected = {
        "rl/reward_mean": (1.0 + 4.0) / 2,  # agent 0's rows with a reward
        "rl/advantage_std": math.sqrt(((1 - 1) ** 2 + (3 - 1) ** 2 + (-1 - 1) ** 2) / 3),  # population, mean 1
        "rl/kl_mean": (0.5 + 1.5 + 0.0 + 2.0 + 0.25 + 0.75) / 6,
        "rl/loss": (0.2 + 0.4 + 0.6 + 0.8) / 4,  # loss keys only, never the step's reward mean
        "rl/skipped_steps": 3.0,
        "rl/dropped_groups": 3.0,
        "rl/kl_mean_agent_0": (0.5 + 0.0 + 0.25) / 3,
        "rl/kl_mean_agent_1": (1.5 + 2.0 + 0.75) / 3,
        "rl/skipped_steps_agent_0": 1.0,
        "rl/skipped_steps_agent_1": 2.0,
    }
    assert set(got) == set(expected)
    assert got == pytest.approx(expected, abs=1e-12)


def test_rl_metrics_of_an_empty_pass_are_nan_and_zero_counts():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no mean or std of an empty list ("Mean of empty slice")
        got = rl_metrics(RLResult(skipped=[0]), 1)
    assert set(got) == {
        "rl/reward_mean",
        "rl/advantage_std",
        "rl/kl_mean",
        "rl/loss",
        "rl/skipped_steps",
        "rl/dropped_groups",
        "rl/kl_mean_agent_0",
        "rl/skipped_steps_agent_0",
    }
    for name in ("rl/reward_mean", "rl/advantage_std", "rl/kl_mean", "rl/loss", "rl/kl_mean_agent_0"):
        assert math.isnan(got[name]), name
    assert (got["rl/skipped_steps"], got["rl/dropped_groups"], got["rl/skipped_steps_agent_0"]) == (0.0, 0.0, 0.0)


def test_backend_errors_name_the_value_and_the_group_backends():
    with pytest.raises(ValueError) as info:
        advantage_backend("ppo")
    assert str(info.value) == "rl_algorithm: got 'ppo'; allowed: magrpo, mareinforce, marloo, maremax"
    with pytest.raises(ValueError, match=r"^rl_algorithm: got 'iac'; .*: magrpo, mareinforce, marloo, maremax$"):
        advantage_backend("iac")


def test_normalization_uses_each_items_own_spread():
    adv = torch.tensor([[-1.0, 1.0], [-3.0, 3.0]], dtype=torch.float64)  # population stds 1 and 3
    assert normalize_group(adv).tolist() == [[-1.0, 1.0], [-1.0, 1.0]]


# ---------------------------------------------------------------------------------------------- run_rl
ITEMS = ["a", "b", "c"]
G = 2


def _prompt(agent: int, item: int) -> list[int]:
    return [2, 17 + agent, 40 + item]


def _policy(model_dir):
    from pbrl.models.loading import load_model
    from pbrl.models.policies import TrainablePolicy, trainable_parameters

    model = load_model(model_dir, trainable=True)
    return TrainablePolicy(model, torch.optim.AdamW(trainable_parameters(model), lr=1e-2, weight_decay=0.0), 0)


def _moved_reference(model_dir, seed: int):
    from pbrl.learning.rl import ReferencePolicy
    from pbrl.models.loading import load_model

    model = load_model(model_dir)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return ReferencePolicy(model, pad_token_id=0)


class Recorder:
    """Fake sampler and scorer. Agent i's sample of generation j in epoch e is [100 + 10·i + j + 50·e, EOS];
    the joint reward is (token of agent 0 + token of agent 1 + item index) / 7 (not a binary fraction, so a
    float32 step anywhere shows); item b's generation 0 never fits (None), item c's rewards are NaN in epoch 0."""

    def __init__(self):
        self.samples: list[tuple] = []
        self.seeds: list[tuple[int, int]] = []

    def sample(self, agent, rows, items, epoch):
        from pbrl.generation.sampling import Generation

        self.samples.append((agent, [list(r) for r in rows], list(items), epoch))
        return [
            Generation(
                [100 + 10 * agent + r % G + 50 * epoch, 3],
                f"a{agent} r{r} e{epoch}",
                "eos" if agent == 0 else "length",
                1000 * epoch + 10 * agent + r,
                3,
            )
            for r in range(len(rows))
        ]

    @staticmethod
    def score(prompts, completions):
        out = []
        for p, c in zip(prompts, completions, strict=True):
            item, gen, epoch = p[0][2] - 40, (c[0][0] - 100) % 50, (c[0][0] - 100) // 50
            if item == 1 and gen == 0:
                out.append((None, None))
            elif item == 2 and epoch == 0:
                out.append((math.nan, [item, gen, epoch]))
            else:
                out.append(((c[0][0] + c[1][0] + item) / 7, [item, gen, epoch]))
        return out

    def dropout_seed(self, agent, step):
        self.seeds.append((agent, step))
        return None


def _k3(policy_logps: list[float], reference_logps: list[float]) -> float:
    return sum(math.expm1(r - p) - (r - p) for p, r in zip(policy_logps, reference_logps, strict=True))


def test_run_rl_pins_order_sampling_kl_advantages_counts_metrics_and_rollouts(tiny_model_dir):
    """Three items, G = 2, batches of 2 items, 2 epochs, order seed 0: numpy's default_rng(0) permutes the items
    as (c, a, b) then (c, b, a), so the steps hold [c, a], [b], [c, b], [a]. Step 0 is skipped for both agents
    (item c's NaN rewards); step 1 is item b alone, whose group is dropped (no signal, reward mean NaN); b's group
    is dropped again in step 2 (2 dropped groups). KL c = 0.5 against a moved reference; the gradient norm is
    clipped to 1e-12, so the policies barely move (Adam's steps are then ≈ lr·1e-4)."""
    from pbrl.learning.rl import RLHooks, RLSettings, completion_token_logprobs, run_rl

    policies = [_policy(tiny_model_dir) for _ in range(2)]
    initial = [_policy(tiny_model_dir).model for _ in range(2)]  # the same weights, never stepped
    references = [_moved_reference(tiny_model_dir, seed) for seed in (1, 2)]
    rec = Recorder()
    settings = RLSettings(
        epochs=2, batch_size=2, num_generations=G, backend="magrpo", normalize=False, kl_coef=0.5, max_grad_norm=1e-12
    )
    result = run_rl(
        policies,
        [[_prompt(i, j) for j in range(3)] for i in range(2)],
        ITEMS,
        settings,
        RLHooks(sample=rec.sample, score=rec.score, order_seed=0, dropout_seed=rec.dropout_seed),
        references=references,
    )

    chunks, epochs = [[2, 0], [1], [2, 1], [0]], [0, 0, 1, 1]
    assert result.steps == 4 and result.batch_sizes == [4, 2, 4, 2]
    assert result.skipped == [1, 1] and result.dropped_groups == 2
    assert rec.seeds == [(i, s) for s in range(4) for i in range(2)]
    assert rec.samples == [
        (i, [_prompt(i, j) for j in chunk for _ in range(G)], [ITEMS[j] for j in chunk for _ in range(G)], epoch)
        for chunk, epoch in zip(chunks, epochs, strict=True)
        for i in range(2)
    ]

    rows = result.rollouts
    assert len(rows) == sum(len(c) for c in chunks) * G * 2
    # KL of step 0 (before any update), by hand from the token log-probs of the initial policy and the reference.
    for i in range(2):
        step0 = [r for r in rows if r["step"] == 0 and r["agent_index"] == i]
        prompts, completions = [r["prompt_ids"] for r in step0], [r["completion_ids"] for r in step0]
        pol, mask = completion_token_logprobs(initial[i], prompts, completions, pad_token_id=0)
        ref, _ = completion_token_logprobs(references[i].model, prompts, completions, pad_token_id=0)
        for k, r in enumerate(step0):
            n = int(mask[k].sum())
            expected = _k3(pol[k, :n].tolist(), ref[k, :n].tolist())
            assert expected > 1e-3 and r["kl"] == pytest.approx(expected, rel=1e-12, abs=0)
    assert all(r["kl"] > 0 for r in rows)

    # Advantages: per step, item and agent, R_j − 0.5·KL_ij minus the group's mean; None for a dropped group.
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["step"], r["item_id"], r["agent_index"]), []).append(r)
    for (step, item, _), group in groups.items():
        assert [r["generation_index"] for r in group] == [0, 1]
        if item == "b":
            assert [r["reward"] for r in group][0] is None and all(r["advantage"] is None for r in group)
            continue
        shaped = [r["reward"] - 0.5 * r["kl"] for r in group]
        mean = (shaped[0] + shaped[1]) / 2
        for r, s in zip(group, shaped, strict=True):
            if item == "c" and step == 0:
                assert math.isnan(r["reward"]) and math.isnan(r["advantage"])
            else:
                assert r["advantage"] == pytest.approx(s - mean, rel=0, abs=1e-12)

    # One record in full: step 3 (epoch 1), item a, generation 1, agent 1.
    last = next(r for r in rows if (r["step"], r["item_id"], r["generation_index"], r["agent_index"]) == (3, "a", 1, 1))
    c0, c1 = 100 + 1 + 50, 100 + 10 + 1 + 50
    expected = {
        "epoch": 1,
        "step": 3,
        "item_id": "a",
        "generation_index": 1,
        "agent_index": 1,
        "prompt_ids": [2, 18, 40],
        "completion_ids": [c1, 3],
        "completion": "a1 r1 e1",
        "finish_reason": "length",
        "seed": 1011,
        "joint_ids": [0, 1, 1],
        "reward": (c0 + c1 + 0) / 7,
    }
    assert {k: last.get(k, "missing") for k in expected} == expected  # (kl and advantage: checked above)

    # Step metrics: the mean reward of the kept joint responses, NaN for none; each agent's loss.
    kept = {
        s: [r["reward"] for r in rows if r["step"] == s and r["agent_index"] == 0 and r["advantage"] is not None]
        for s in range(4)
    }
    assert [set(m) for m in result.step_metrics] == [{"rl/reward_mean", "rl/loss_agent_0", "rl/loss_agent_1"}] * 4
    assert math.isnan(result.step_metrics[0]["rl/reward_mean"]) and math.isnan(result.step_metrics[1]["rl/reward_mean"])
    for s in (2, 3):
        assert result.step_metrics[s]["rl/reward_mean"] == pytest.approx(sum(kept[s]) / len(kept[s]), abs=1e-12)
    assert math.isnan(result.step_metrics[0]["rl/loss_agent_0"])  # the NaN step's loss, reported, not stepped
    assert result.step_metrics[1]["rl/loss_agent_0"] == 0.0  # no signal: no forward, loss 0
    # −mean_j A_j log π(a_j): at step 3 the policy has barely moved from the initial one (clipped steps).
    for i in range(2):
        step3 = [r for r in rows if r["step"] == 3 and r["agent_index"] == i]
        pol, mask = completion_token_logprobs(
            initial[i], [r["prompt_ids"] for r in step3], [r["completion_ids"] for r in step3], pad_token_id=0
        )
        logps = pol.sum(-1).tolist()
        expected = -sum(r["advantage"] * lp for r, lp in zip(step3, logps, strict=True)) / len(step3)
        assert result.step_metrics[3][f"rl/loss_agent_{i}"] == pytest.approx(expected, rel=1e-3)
    # The clipped steps moved every policy, by far less than an unclipped Adam step (lr = 1e-2) would.
    for policy, start in zip(policies, initial, strict=True):
        moved = max(
            float((p - q).detach().abs().max())
            for p, q in zip(policy.model.parameters(), start.parameters(), strict=True)
        )
        assert 0 < moved < 1e-4


def test_run_rl_zero_kl_coefficient_and_normalization(tiny_model_dir):
    """kl_coef 0 with references: the KL is measured and recorded, not applied. Then normalized advantages."""
    from pbrl.learning.rl import RLHooks, RLSettings, run_rl

    policies = [_policy(tiny_model_dir) for _ in range(2)]
    references = [_moved_reference(tiny_model_dir, seed) for seed in (1, 2)]
    rec = Recorder()
    settings = RLSettings(
        epochs=1, batch_size=1, num_generations=G, backend="magrpo", normalize=False, kl_coef=0.0, max_grad_norm=1.0
    )
    result = run_rl(
        policies,
        [[_prompt(i, 0)] for i in range(2)],
        ["a"],
        settings,
        RLHooks(sample=rec.sample, score=rec.score, order_seed=0, dropout_seed=rec.dropout_seed),
        references=references,
    )
    rewards = [(100 + 100 + 10) / 7, (101 + 111) / 7]  # generation 0 and 1 of item a, epoch 0
    mean = (rewards[0] + rewards[1]) / 2
    for r in result.rollouts:
        assert r["kl"] > 1e-3
        assert r["advantage"] == pytest.approx(rewards[r["generation_index"]] - mean, rel=0, abs=1e-12)
    # advantage_normalization: two samples, mean ± d, population std d: advantages −1 and +1 exactly.
    normalized = RLSettings(
        epochs=1, batch_size=1, num_generations=G, backend="magrpo", normalize=True, kl_coef=0.0, max_grad_norm=1.0
    )
    result = run_rl(
        policies,
        [[_prompt(i, 0)] for i in range(2)],
        ["a"],
        normalized,
        RLHooks(sample=rec.sample, score=rec.score, order_seed=0, dropout_seed=rec.dropout_seed),
        references=None,
    )
    assert [r["advantage"] for r in result.rollouts] == pytest.approx([-1.0, -1.0, 1.0, 1.0], abs=1e-12)


# ---------------------------------------------------------------------------------------------- rl_agent_step
PROMPTS = [[2, 17, 40, 41, 5], [2, 17, 40, 41, 5]]
COMPLETIONS = [[70, 71, 3], [80, 3]]
ADVANTAGES = torch.tensor([1.0, -1.0], dtype=torch.float64)


def test_rl_agent_step_draws_dropout_masks_from_its_seed_and_refuses_none(tiny_model_dir, tmp_path):
    policy = lora_dropout_policy(tiny_model_dir, tmp_path)  # SGD at lr 0: the weights never move
    first = rl_agent_step(policy, PROMPTS, COMPLETIONS, ADVANTAGES, max_grad_norm=1.0, seed=1)
    again = rl_agent_step(policy, PROMPTS, COMPLETIONS, ADVANTAGES, max_grad_norm=1.0, seed=1)
    other = rl_agent_step(policy, PROMPTS, COMPLETIONS, ADVANTAGES, max_grad_norm=1.0, seed=2)
    assert first == again and first[1] == "updated"
    assert abs(first[0] - other[0]) > 1e-4  # another mask, another loss: dropout acted
    with pytest.raises(ValueError) as info:
        rl_agent_step(policy, PROMPTS, COMPLETIONS, ADVANTAGES, max_grad_norm=1.0, seed=None)
    assert str(info.value) == "seeds: a policy has dropout (lora_dropout > 0); its forwards need a dropout seed"


def _precision_policy(model_dir, mode):
    from pbrl.models.loading import load_model
    from pbrl.models.policies import TrainablePolicy, trainable_parameters
    from pbrl.models.precision import make_precision

    model = load_model(model_dir, trainable=True)
    return TrainablePolicy(
        model,
        torch.optim.AdamW(trainable_parameters(model), lr=1e-3, weight_decay=0.0),
        0,
        precision=make_precision(mode, "cpu"),
    )


@pytest.mark.parametrize("seed", [None, 3])
def test_rl_agent_step_runs_its_forward_under_the_policys_autocast(tiny_model_dir, seed):
    losses = {
        mode: rl_agent_step(
            _precision_policy(tiny_model_dir, mode), PROMPTS, COMPLETIONS, ADVANTAGES, max_grad_norm=1.0, seed=seed
        )[0]
        for mode in ("no", "bf16")
    }
    # bfloat16 matmuls (8 significant bits) move a few-nat loss by well over float32 rounding, yet stay close.
    assert losses["bf16"] != losses["no"] and abs(losses["bf16"] - losses["no"]) < 0.05 * abs(losses["no"])


def test_rl_agent_step_steps_through_the_fp16_loss_scaler(tiny_model_dir):
    """Scaled by 2^120 the float16 gradients overflow: the step is skipped, the weights stay, the scale halves."""
    policy = _precision_policy(tiny_model_dir, "fp16")
    policy.precision.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**120)
    before = {n: p.detach().clone() for n, p in policy.model.named_parameters()}
    _, outcome = rl_agent_step(policy, PROMPTS, COMPLETIONS, ADVANTAGES, max_grad_norm=1.0, seed=None)
    assert outcome == "skipped" and policy.precision.scaler.get_scale() == 2.0**119
    assert all(torch.equal(p, before[n]) for n, p in policy.model.named_parameters())


# ---------------------------------------------------------------------------------------------- actor-critic path
class _StubCritics:
    """What ``run_rl`` asks of a :class:`pbrl.learning.critic_set.CriticSet`, with hand-set values: V of agent i for
    generation k of item x is ``VALUES[x] + 0.1 * i + 0.01 * k``; the critic input of item "c" does not fit."""

    VALUES = {"a": 0.5, "b": 0.25, "c": 1.0}

    def __init__(self, item_of_row):
        self.item_of_row = item_of_row  # filled by the sampler: the item of each row of the step
        self.evaluated, self.updated = [], []

    def evaluate(self, prompts, completions):
        from pbrl.learning.critic_set import CriticBatch

        self.evaluated.append((prompts, completions))
        rows = self.item_of_row
        values = torch.tensor(
            [[self.VALUES[x] + 0.1 * i + 0.01 * (r % 2) for r, x in enumerate(rows)] for i in range(2)],
            dtype=torch.float64,
        )  # (a, n)
        return CriticBatch(rows=[[None] * len(rows)], values=values, ok=torch.tensor([x != "c" for x in rows]))

    def update(self, batch, returns, valid):
        self.updated.append((batch, returns.clone(), valid.clone()))
        return {"critic/value_loss": 0.75}


def _actor_critic_pass(tiny_model_dir, *, normalize: bool):
    from pbrl.generation.sampling import Generation
    from pbrl.learning.rl import RLHooks, RLSettings, run_rl
    from pbrl.models.loading import load_model
    from pbrl.models.policies import TrainablePolicy, trainable_parameters

    def policy():
        model = load_model(tiny_model_dir, trainable=True)
        return TrainablePolicy(model, torch.optim.AdamW(trainable_parameters(model), lr=1e-3, weight_decay=0.0), 0)

    item_of_row: list[str] = []
    critics = _StubCritics(item_of_row)

    def sample(agent, rows, items, epoch):
        item_of_row[:] = items
        return [Generation([100 + 10 * agent + r % 2, 3], "", "eos", r, 3) for r in range(len(rows))]

    def score(prompts, completions):
        # Joint response r: R = (first token of agent 0 + first token of agent 1) / 100, so 2.1 for generation 0
        # and 2.12 for generation 1; item "a"'s generation 1 cannot be scored (its whole group is left out).
        return [
            (None, None) if (item_of_row[r], r % 2) == ("a", 1) else ((c[0][0] + c[1][0]) / 100, [1])
            for r, c in enumerate(completions)
        ]

    prompts = [[[2, 17], [2, 18], [2, 19]], [[2, 27], [2, 28], [2, 29]]]  # [agent][item]
    settings = RLSettings(
        epochs=1, batch_size=3, num_generations=2, backend="iac", normalize=normalize, kl_coef=None, max_grad_norm=1.0
    )
    result = run_rl(
        [policy(), policy()],
        prompts,
        ["a", "b", "c"],
        settings,
        RLHooks(sample=sample, score=score, order_seed=0, dropout_seed=lambda agent, step: None),
        references=None,
        critics=critics,
    )
    return result, critics, prompts


def test_actor_critic_pass_hand_values(tiny_model_dir):
    """One step of 3 items x 2 generations: item "a" is out (a reward failed), item "c" is out (its critic input
    did not fit), only item "b" is valid. Its advantages are R − V (R = 2.1, 2.12; V = 0.25 + 0.1 i + 0.01 k); the
    critics get every return and that validity mask; the rollouts record V and A for valid rows only."""
    result, critics, prompts = _actor_critic_pass(tiny_model_dir, normalize=False)
    rows = critics.item_of_row  # the item of each row of the step, in the step's seeded order
    assert sorted(rows) == ["a", "a", "b", "b", "c", "c"]
    # The critics saw [agent][row] prompts and completions, every row of the step.
    ((seen_prompts, seen_completions),) = critics.evaluated
    index = {"a": 0, "b": 1, "c": 2}
    assert seen_prompts == [[prompts[i][index[x]] for x in rows] for i in range(2)]
    assert seen_completions == [[[100 + 10 * i + r % 2, 3] for r in range(6)] for i in range(2)]
    ((batch, returns, valid),) = critics.updated
    assert valid.tolist() == [x == "b" for x in rows]
    expected_returns = [0.0 if (x, r % 2) == ("a", 1) else 2.1 + 0.02 * (r % 2) for r, x in enumerate(rows)]
    assert returns.shape == (2, 6)
    for i in range(2):  # no KL: every agent's return is the joint reward (0 where it failed)
        assert returns[i].tolist() == pytest.approx(expected_returns, abs=1e-12)
    assert result.step_metrics[0]["critic/value_loss"] == 0.75
    assert result.dropped_groups == 1  # the reward failure; the critic's misfit is not a dropped reward
    by_key = {(r["agent_index"], r["item_id"], r["generation_index"]): r for r in result.rollouts}
    for i in range(2):
        for k in range(2):
            v = 0.25 + 0.1 * i + 0.01 * k
            assert by_key[(i, "b", k)]["value"] == pytest.approx(v, abs=1e-12)
            assert by_key[(i, "b", k)]["advantage"] == pytest.approx(2.1 + 0.02 * k - v, abs=1e-12)
            for x in ("a", "c"):
                assert by_key[(i, x, k)]["value"] is None and by_key[(i, x, k)]["advantage"] is None


def test_actor_critic_pass_normalizes_over_the_valid_rows_only(tiny_model_dir):
    """With advantage_normalization the two valid rows of each agent, A = 1.85 − 0.1 i and 1.86 − 0.1 i, become
    (A − mean) / population std = −1 and +1 (invalid rows never enter the mean)."""
    result, _, _ = _actor_critic_pass(tiny_model_dir, normalize=True)
    by_key = {(r["agent_index"], r["item_id"], r["generation_index"]): r for r in result.rollouts}
    for i in range(2):
        assert by_key[(i, "b", 0)]["advantage"] == pytest.approx(-1.0, abs=1e-6)
        assert by_key[(i, "b", 1)]["advantage"] == pytest.approx(1.0, abs=1e-6)


def test_run_rl_names_the_backend_that_needs_or_refuses_critics():
    from pbrl.learning.rl import RLHooks, RLSettings, run_rl

    def settings(backend):
        return RLSettings(
            epochs=1,
            batch_size=1,
            num_generations=2,
            backend=backend,
            normalize=False,
            kl_coef=None,
            max_grad_norm=None,
        )

    with pytest.raises(ValueError) as info:
        run_rl(
            [],
            [],
            [],
            settings("maac"),
            RLHooks(sample=None, score=None, order_seed=0, dropout_seed=lambda a, s: None),
            references=None,
        )
    assert str(info.value) == "rl_algorithm: 'maac' needs critics"
    with pytest.raises(ValueError) as info:
        run_rl(
            [],
            [],
            [],
            settings("magrpo"),
            RLHooks(sample=None, score=None, order_seed=0, dropout_seed=lambda a, s: None),
            references=None,
            critics=_StubCritics([]),
        )
    assert str(info.value) == "rl_algorithm: 'magrpo' takes no critics"
