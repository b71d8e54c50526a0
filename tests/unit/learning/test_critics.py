"""Actor-critic backends of MARLHF (docs/design/algorithms.md#critics, pbrl.learning.critics, critic_set,
advantages): advantages, the clipped value loss, explained
variance, critic inputs, the iac value head on the policy backbone, learning, checkpoints, the RL loop, preflight."""

from __future__ import annotations

import math

import pytest
import torch

from pbrl.errors import ArtifactError
from pbrl.generation.sampling import Generation
from pbrl.learning.advantages import actor_critic_advantages, normalize_batch
from pbrl.learning.critic_set import CriticSet, explained_variance
from pbrl.learning.critics import (
    CriticSpec,
    critic_rows,
    critic_step,
    new_critic,
    predict,
    restore_critic,
    save_critic,
    value_head,
)
from pbrl.learning.joint_template import JointTemplate
from pbrl.learning.losses import clipped_value_loss
from pbrl.learning.rl import RLHooks, RLSettings, run_rl
from pbrl.models.loading import load_model, load_tokenizer
from pbrl.models.lora import LoraSettings
from pbrl.models.policies import TrainablePolicy, trainable_parameters


# ---------------------------------------------------------------------------------------------- hand-worked
def test_advantage_is_return_minus_a_detached_value():
    returns = torch.tensor([1.0, 2.0, 0.5], dtype=torch.float64)
    values = torch.tensor([0.5, 2.5, 0.5], dtype=torch.float64, requires_grad=True)
    adv = actor_critic_advantages(returns, values)
    assert adv.tolist() == [0.5, -0.5, 0.0]
    assert not adv.requires_grad  # the policy loss never trains the critic


def test_clipped_value_loss_hand_values_and_gradient():
    old = torch.tensor([0.0, 0.0, 1.0, 0.0], dtype=torch.float64)
    values = torch.tensor([0.5, -0.1, 1.0, 2.0], dtype=torch.float64, requires_grad=True)
    returns = torch.tensor([1.0, 1.0, 0.0, 2.0], dtype=torch.float64)
    # row 0: (0.5−1)² = 0.25; clipped V = 0 + 0.2 → (0.2−1)² = 0.64; max 0.64
    # row 1: the change −0.1 is inside ±0.2: (−0.1−1)² = 1.21 both ways
    # row 2: no change: (1−0)² = 1
    # row 3: V hits R (0), but clipped V = 0.2 → (0.2−2)² = 3.24: the pessimistic max keeps 3.24
    loss = clipped_value_loss(values, old, returns, 0.2)
    assert loss.tolist() == pytest.approx([0.64, 1.21, 1.0, 3.24], abs=1e-12)
    loss.sum().backward()
    # rows 0 and 3 take the clipped branch (constant in V): no gradient; row 1: 2(V−R) = −2.2; row 2: 2·1
    assert values.grad.tolist() == pytest.approx([0.0, -2.2, 2.0, 0.0], abs=1e-12)
    assert clipped_value_loss(values, old, returns, None).tolist() == pytest.approx([0.25, 1.21, 1.0, 0.0], abs=1e-12)


def test_explained_variance_hand_values():
    assert explained_variance([1, 2, 3], [1, 2, 3]) == 1.0
    assert explained_variance([1, 1], [0, 2]) == 0.0  # Var(R) = 1, Var(R − V) = 1
    # R = (0, 2, 4): Var 8/3; R − V = (0, 0, 2): Var 4/3 − 4/9 = 8/9; 1 − (8/9)/(8/3) = 2/3
    assert explained_variance([0, 2, 2], [0, 2, 4]) == pytest.approx(2 / 3, abs=1e-12)
    assert math.isnan(explained_variance([0.3, 0.1], [1.0, 1.0]))  # Var(R) = 0: undefined, no division
    assert math.isnan(explained_variance([0.3], [1.0]))


def test_batch_normalization_centres_and_scales_valid_rows_only():
    adv = torch.tensor([1.0, 2.0, 3.0, 50.0], dtype=torch.float64)
    valid = torch.tensor([True, True, True, False])
    s = math.sqrt(2 / 3)
    assert normalize_batch(adv, valid).tolist() == pytest.approx([-1 / s, 0.0, 1 / s, 50.0], abs=1e-12)
    close = torch.tensor([0.7, 0.7 + 1e-12], dtype=torch.float64)
    assert normalize_batch(close, torch.ones(2, dtype=torch.bool)).abs().max() <= 1e-6  # std clamps at 1e-6
    one = torch.tensor([0.7, 9.0], dtype=torch.float64)
    assert normalize_batch(one, torch.tensor([True, False])).tolist() == [0.7, 9.0]  # one row: unchanged


def test_value_heads_follow_the_reference_init():
    torch.manual_seed(0)
    linear, mlp = value_head(64, None), value_head(64, 8)
    assert isinstance(linear, torch.nn.Linear) and linear.bias.item() == 0.0
    assert [type(m).__name__ for m in mlp] == ["Linear", "Tanh", "Linear"] and mlp[0].weight.shape == (8, 64)
    assert 0.01 < float(mlp[0].weight.detach().std()) < 0.03 and not mlp[2].bias.any()


# ---------------------------------------------------------------------------------------------- inputs
PROMPTS = [[2, 17, 40, 5], [2, 18, 50, 5]]  # agent 0, agent 1
COMPLETIONS = [[70, 71, 3], [80, 3]]


def test_critic_rows_read_the_history_or_the_joint_action(tiny_model_dir):
    template = JointTemplate.build(load_tokenizer(tiny_model_dir), 2)
    expected_v = [
        *template.header,
        *template.prompt_markers[0],
        *PROMPTS[0],
        *template.separator,
        *template.prompt_markers[1],
        *PROMPTS[1],
        *template.response_markers[0],
        *template.response_markers[1],
    ]
    assert critic_rows("maac", "v", PROMPTS, COMPLETIONS, template=template) == [expected_v]
    expected_q = [
        *template.header,
        *template.prompt_markers[0],
        *PROMPTS[0],
        *template.separator,
        *template.prompt_markers[1],
        *PROMPTS[1],
        *template.response_markers[0],
        *COMPLETIONS[0],
        *template.response_markers[1],
        *COMPLETIONS[1],
    ]
    assert critic_rows("maac", "q", PROMPTS, COMPLETIONS, template=template) == [expected_q]
    assert critic_rows("maac", "q", PROMPTS, COMPLETIONS, template=template, max_length=5) == [None]
    assert critic_rows("iac", "v", PROMPTS, COMPLETIONS) == PROMPTS
    assert critic_rows("iac", "q", PROMPTS, COMPLETIONS) == [PROMPTS[0] + COMPLETIONS[0], PROMPTS[1] + COMPLETIONS[1]]


def test_separate_critic_values_do_not_depend_on_padding(tiny_model_dir):
    critic = new_critic(CriticSpec("separate", str(tiny_model_dir), None, 4), seed=0, learning_rate=1e-3)
    rows = [PROMPTS[0], PROMPTS[0] + COMPLETIONS[0] + [0, 0]]  # the second row ends in pad ids (pad id 0)
    together = predict(critic, rows)
    alone = torch.cat([predict(critic, [r]) for r in rows])
    assert torch.allclose(together, alone, atol=1e-6, rtol=0)
    assert predict(critic, [None, rows[0]]).tolist()[0] == 0.0


# ---------------------------------------------------------------------------------------------- iac value head
def test_iac_value_head_shares_the_policy_backbone_and_its_loss_never_reaches_the_policy(tiny_model_dir):
    policy = load_model(tiny_model_dir, trainable=True)
    critic = new_critic(
        CriticSpec("value_head", None, None, None), seed=0, learning_rate=1e-2, policy=policy, pad_token_id=0
    )
    assert critic.model.policy is policy  # the same object: one copy of the backbone in memory
    own = {p.data_ptr() for p in critic.model.parameters()}
    assert own.isdisjoint(p.data_ptr() for p in policy.parameters())  # the critic holds only its head
    assert set(critic.model.state_dict()) == {"head.weight", "head.bias"}
    assert len(critic.optimizer.param_groups[0]["params"]) == 2
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    head = critic.model.head.weight.detach().clone()
    loss, outcome = critic_step(
        critic,
        PROMPTS,
        torch.tensor([1.0, -1.0]),
        torch.zeros(2),
        value_loss_coef=0.6,
        clip_range=0.2,
        max_grad_norm=1.0,
    )
    assert outcome == "updated" and loss > 0
    assert all(p.grad is None for p in policy.parameters())  # no gradient reached the policy
    assert all(torch.equal(v, before[k]) for k, v in policy.state_dict().items())
    assert not torch.equal(critic.model.head.weight, head)  # the head learned


def test_value_head_sees_the_policy_move(tiny_model_dir):
    """The head reads the live policy: after a policy step the same row has another value (so the value clip
    around the rollout-time prediction can bind)."""
    policy = load_model(tiny_model_dir, trainable=True)
    critic = new_critic(
        CriticSpec("value_head", None, None, None), seed=0, learning_rate=1e-2, policy=policy, pad_token_id=0
    )
    before = predict(critic, PROMPTS)
    with torch.no_grad():
        policy.get_input_embeddings().weight.add_(0.1)
    assert not torch.allclose(predict(critic, PROMPTS), before)


# ---------------------------------------------------------------------------------------------- learning
@pytest.mark.parametrize(
    ("backend", "kind", "lr", "epochs"),
    [("iac", "separate", 1e-3, 8), ("iac", "value_head", 3e-2, 8), ("maac", "separate", 1e-3, 16)],
)
def test_critic_learns_a_fixed_reward_per_prompt(tiny_model_dir, backend, kind, lr, epochs):
    """Four items, each with its own fixed reward whatever the responses: the explained variance of the
    values the critic predicts before each epoch's step starts near 0 and rises above 0.5."""
    policies = [load_model(tiny_model_dir, trainable=True) for _ in range(2)]
    count = 1 if backend == "maac" else 2
    critics = [
        new_critic(
            CriticSpec(kind, str(tiny_model_dir) if kind == "separate" else None, None, None),
            seed=k,
            learning_rate=lr,
            policy=policies[k] if kind == "value_head" else None,
            pad_token_id=0,
        )
        for k in range(count)
    ]
    template = JointTemplate.build(load_tokenizer(tiny_model_dir), 2) if backend == "maac" else None
    critic_set = CriticSet(backend, "v", critics, template=template, max_grad_norm=1.0)
    prompts = [[[2, 17, 40 + k, 5] for k in range(4)], [[2, 18, 50 + k, 5] for k in range(4)]]  # [agent][item]
    completions = [[[70 + k, 3] for k in range(4)], [[80, 3] for _ in range(4)]]
    rewards = torch.tensor([-1.0, 0.0, 1.0, 2.0], dtype=torch.float64)
    history = []
    for _ in range(epochs):
        batch = critic_set.evaluate(prompts, completions)
        history.append(min(explained_variance(batch.values[i], rewards) for i in range(2)))
        critic_set.update(batch, rewards.expand(2, 4), torch.ones(4, dtype=torch.bool))
    assert history[0] < 0.1 and max(history) > 0.5, history
    metrics = critic_set.metrics()
    suffix = "" if backend == "maac" else "_agent_1"
    for name in ("critic/value_loss", "critic/explained_variance", "critic/value_mean"):
        assert math.isfinite(metrics[name + suffix]), name


# ---------------------------------------------------------------------------------------------- checkpoints
@pytest.mark.parametrize(
    ("kind", "lora"), [("separate", False), ("separate", True), ("value_head", False), ("value_head", True)]
)
def test_saved_critic_restores_bitwise_and_continues_identically(tiny_model_dir, tmp_path, kind, lora):
    """LoRA: the critic's own adapter (separate), or a head on a LoRA policy (value_head)."""
    settings = LoraSettings(r=2) if lora else None

    def build(policy, width=8):
        spec = (
            CriticSpec("separate", str(tiny_model_dir), settings, width)
            if kind == "separate"
            else CriticSpec("value_head", None, None, width)
        )
        return new_critic(spec, seed=3, learning_rate=1e-2, policy=policy, pad_token_id=0)

    def step(critic):
        return critic_step(
            critic,
            PROMPTS,
            torch.tensor([1.0, -1.0]),
            predict(critic, PROMPTS),
            value_loss_coef=0.6,
            clip_range=0.2,
            max_grad_norm=1.0,
        )

    policy = load_model(tiny_model_dir, trainable=True, lora=settings if kind == "value_head" else None, seed=0)
    first = build(policy)
    if kind == "separate" and lora:  # only the adapter and the head train
        trained = [n for n, p in first.model.named_parameters() if p.requires_grad]
        assert trained and all("lora_A" in n or "lora_B" in n or n.startswith("head.") for n in trained)
    step(first)
    save_critic(first, tmp_path / "critic_0")
    second = build(policy)
    restore_critic(second, tmp_path / "critic_0")
    for (name, a), (_, b) in zip(first.model.named_parameters(), second.model.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    step(first), step(second)
    assert all(torch.equal(a, b) for a, b in zip(first.parameters, second.parameters, strict=True))
    with pytest.raises(ArtifactError, match="critic.json"):
        restore_critic(build(policy, width=None), tmp_path / "critic_0")  # another head: refused, not half-loaded


# ---------------------------------------------------------------------------------------------- RL loop
def _trainable(model_dir):
    model = load_model(model_dir, trainable=True)
    return TrainablePolicy(model, torch.optim.AdamW(trainable_parameters(model), lr=1e-3, weight_decay=0.0), 0)


@pytest.mark.parametrize("backend", ["maac", "iac"])
def test_rl_loop_uses_return_minus_value_and_updates_the_critics(tiny_model_dir, backend):
    policies = [_trainable(tiny_model_dir) for _ in range(2)]
    count = 1 if backend == "maac" else 2
    critics = [
        new_critic(CriticSpec("separate", str(tiny_model_dir), None, None), seed=k, learning_rate=1e-3)
        for k in range(count)
    ]
    template = JointTemplate.build(load_tokenizer(tiny_model_dir), 2) if backend == "maac" else None
    critic_set = CriticSet(backend, "q", critics, template=template, max_grad_norm=1.0)
    weights = [p.detach().clone() for c in critics for p in c.parameters]

    def sample(agent, rows, items, epoch):
        return [Generation([100 + 10 * agent + r % 2, 3], "", "eos", r, 3) for r in range(len(rows))]

    def score(prompts, completions):
        return [(float(c[0][0] + c[1][0]) / 100, [1]) for c in completions]

    settings = RLSettings(
        epochs=1, batch_size=2, num_generations=2, backend=backend, normalize=False, kl_coef=None, max_grad_norm=1.0
    )
    result = run_rl(
        policies,
        [[[2, 17], [2, 19]], [[2, 18], [2, 20]]],
        ["a", "b"],
        settings,
        RLHooks(sample=sample, score=score, order_seed=0, dropout_seed=lambda agent, step: None),
        references=None,
        critics=critic_set,
    )
    rows = result.rollouts  # row r·2 + i: joint response r of the step, agent i
    assert len(rows) == 8 and [r["agent_index"] for r in rows] == [0, 1] * 4
    assert sorted({r["reward"] for r in rows}) == [2.1, 2.12]  # ((100 + j) + (110 + j)) / 100 for j = 0, 1
    values = {(k, n % 4): v for n, (k, v, _) in enumerate(critic_set.seen)}  # (critic, row) → V at rollout time
    assert len(values) == count * 4
    for r in range(4):
        for i in range(2):
            v = values[(0 if backend == "maac" else i, r)]
            assert rows[2 * r + i]["advantage"] == pytest.approx(rows[2 * r + i]["reward"] - v, abs=1e-12)
    assert all(
        not torch.equal(w, p) for w, p in zip(weights, [p for c in critics for p in c.parameters], strict=True)
    )  # every critic weight moved
    assert "critic/value_loss" + ("" if backend == "maac" else "_agent_0") in result.step_metrics[0]


def test_actor_critic_loop_needs_critics_and_group_loop_refuses_them(tiny_model_dir):
    settings = RLSettings(
        epochs=1, batch_size=1, num_generations=2, backend="maac", normalize=False, kl_coef=None, max_grad_norm=None
    )
    with pytest.raises(ValueError, match="needs critics"):
        run_rl(
            [],
            [],
            [],
            settings,
            RLHooks(sample=None, score=None, order_seed=0, dropout_seed=lambda a, s: None),
            references=None,
        )


# ---------------------------------------------------------------------------------------------- preflight
def test_preflight_accepts_maac_and_iac_and_refuses_what_is_not_built(tiny_model_dir, tmp_path):
    from pbrl.errors import ConfigError
    from pbrl.run.folder import prepare_run
    from tests.helpers import tiny_job

    for backend in ("maac", "iac"):
        ok = prepare_run(
            tiny_job(
                tiny_model_dir, tmp_path, trainer="marlhf_iter", rl_algorithm=backend, run_name=backend, critic_type="q"
            ),
            resume=False,
        )
        assert (ok / "run.json").is_file()
    with pytest.raises(ConfigError) as info:
        prepare_run(
            tiny_job(
                tiny_model_dir,
                tmp_path,
                trainer="marlhf_iter",
                rl_algorithm="maac",
                use_separate_critic=False,
                value_head_hidden_dim=8,
                run_name="bad",
            ),
            resume=False,
        )
    assert {p.field for p in info.value.problems} == {"use_separate_critic", "value_head_hidden_dim"}
    with pytest.raises(ConfigError) as info:
        prepare_run(
            tiny_job(
                tiny_model_dir,
                tmp_path,
                trainer="marlhf_iter",
                rl_algorithm="iac",
                use_separate_critic=False,
                critic_model_name=str(tiny_model_dir),
                critic_devices="cpu",
                run_name="bad2",
            ),
            resume=False,
        )
    assert {p.field for p in info.value.problems} == {"critic_model_name", "critic_devices"}
    assert not (tmp_path / "bad").exists() and not (tmp_path / "bad2").exists()
