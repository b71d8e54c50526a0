"""The actor-critic parts (``pbrl/learning/critics.py``, ``critic_set.py``, docs/design/algorithms.md#critics)
pinned where ``make mutate`` found behaviour no test
checked (docs/results/mutation.md#the-last-measured-run). Expectations are worked out by hand in each test, never by
calling the
code under test.

Wrong versions (mutmut ids of ``pbrl/learning/critics.py`` and ``critic_set.py``) made to fail here, by family:

- ``CriticSet.metrics``: every metric name and suffix, the per-critic filter of the seen rows, the non-finite
  losses kept (or the finite ones dropped), the NaN of a critic with no rows or losses, the iac means over every
  critic (loss, explained variance, value mean, summed skips) and their presence for maac.
- ``_meta`` / ``restore_critic``: the key names of ``critic.json`` (the file format), the LoRA settings left out
  of it (a LoRA critic's folder then restores into a critic without LoRA), the "other weights" refusal's
  message (folder, missing and extra names, three of each).
- ``clipped_value_loss``: the clip's lower bound dropped (``clamp(None, ε)``).
- ``critic_step``: the outcomes and losses of no rows (NaN, ``"no_rows"``), a non-finite loss and a non-finite
  gradient (``"skipped"``, weights untouched).
- ``CriticSet.metrics`` of critics that saw nothing: NaN by the rule, never numpy's warning mean of nothing.
- ``new_critic``: the spec's head width ignored (separate or value head), a value head built without a pad
  token id (``or`` → ``and``), the errors' wording, AdamW's weight decay (0, not torch's 0.01).
- ``ValueModel``: the "exactly one body" error's wording.
- ``CriticSet``: the refused backend's message, the initial skip counts, maac's target (the agents' mean return),
  ``evaluate`` passing the backend, critic type and ``reward_max_length`` to the rows, ``update`` passing
  ``clip_range``, counting skips (added, only skips), leaving out a critic with no valid rows, and reporting
  the step's loss.
"""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch

from pbrl.errors import ArtifactError
from pbrl.learning.critic_set import CriticBatch, CriticSet
from pbrl.learning.critics import CriticSpec, ValueModel, critic_step, new_critic, predict, restore_critic, save_critic
from pbrl.learning.losses import clipped_value_loss
from pbrl.models.lora import LoraSettings


def _critic_set(backend: str, critics: int) -> CriticSet:
    return CriticSet(backend, "v", [object()] * critics)  # metrics() reads only what the steps recorded


def test_iac_metrics_hand_values():
    """Critic 0 saw V = (1, 2) for R = (1, 3) and losses (0.5, NaN, 1.5); critic 1 saw V = (0, 0, 3) for
    R = (0, 2, 4) and no finite loss; 1 and 2 skipped steps."""
    cs = _critic_set("iac", 2)
    cs.seen = [(0, 1.0, 1.0), (1, 0.0, 0.0), (0, 2.0, 3.0), (1, 0.0, 2.0), (1, 3.0, 4.0)]
    cs.losses = [[0.5, math.nan, 1.5], [math.inf]]
    cs.skipped = [1, 2]
    got = cs.metrics()
    assert set(got) == {
        f"critic/{m}{s}"
        for m in ("value_loss", "explained_variance", "value_mean", "skipped_steps")
        for s in ("_agent_0", "_agent_1", "")
    }
    assert got["critic/value_loss_agent_0"] == pytest.approx(1.0, abs=1e-12)  # mean of the finite 0.5, 1.5
    assert math.isnan(got["critic/value_loss_agent_1"])  # no finite loss
    # critic 0: Var(R) = 1, R − V = (0, 1), Var = 0.25 → 0.75; critic 1: R = (0, 2, 4), Var 8/3; R − V = (0, 2, 1),
    # mean 1, Var 2/3 → 1 − (2/3)/(8/3) = 0.75 too
    assert got["critic/explained_variance_agent_0"] == pytest.approx(0.75, abs=1e-12)
    assert got["critic/explained_variance_agent_1"] == pytest.approx(0.75, abs=1e-12)
    assert got["critic/value_mean_agent_0"] == pytest.approx(1.5, abs=1e-12)
    assert got["critic/value_mean_agent_1"] == pytest.approx(1.0, abs=1e-12)
    assert (got["critic/skipped_steps_agent_0"], got["critic/skipped_steps_agent_1"]) == (1.0, 2.0)
    # Over every critic: finite losses (0.5, 1.5); all five rows: R = (1, 0, 3, 2, 4) mean 2 Var 2,
    # R − V = (0, 0, 1, 2, 1) mean 0.8 Var 0.56 → 1 − 0.28 = 0.72; V mean 6/5; skips 3.
    assert got["critic/value_loss"] == pytest.approx(1.0, abs=1e-12)
    assert got["critic/explained_variance"] == pytest.approx(0.72, abs=1e-12)
    assert got["critic/value_mean"] == pytest.approx(1.2, abs=1e-12)
    assert got["critic/skipped_steps"] == 3.0


def test_maac_metrics_have_no_suffix_and_a_critic_that_saw_nothing_is_nan():
    cs = _critic_set("maac", 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # NaN by the rule, not numpy's mean of nothing (a RuntimeWarning)
        got = cs.metrics()
    assert set(got) == {"critic/value_loss", "critic/explained_variance", "critic/value_mean", "critic/skipped_steps"}
    assert all(math.isnan(got[k]) for k in ("critic/value_loss", "critic/explained_variance", "critic/value_mean"))
    assert got["critic/skipped_steps"] == 0.0
    cs.seen, cs.losses, cs.skipped = [(0, 2.0, 1.0), (0, 4.0, 5.0)], [[0.25, 0.75]], [4]
    got = cs.metrics()  # R = (1, 5): Var 4; R − V = (−1, 1): Var 1 → 0.75
    assert got == pytest.approx(
        {
            "critic/value_loss": 0.5,
            "critic/explained_variance": 0.75,
            "critic/value_mean": 3.0,
            "critic/skipped_steps": 4.0,
        },
        abs=1e-12,
    )


def test_iac_metrics_of_critics_that_saw_nothing_are_nan_without_warnings():
    cs = _critic_set("iac", 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = cs.metrics()
    for name in ("value_loss", "explained_variance", "value_mean"):
        assert all(math.isnan(got[f"critic/{name}{s}"]) for s in ("_agent_0", "_agent_1", "")), name
    assert got["critic/skipped_steps"] == 0.0


# ---------------------------------------------------------------------------------------------- checkpoint
def test_critic_json_records_the_spec_in_its_documented_keys(tiny_model_dir, tmp_path):
    spec = CriticSpec("separate", str(tiny_model_dir), LoraSettings(r=2), 8)
    save_critic(new_critic(spec, seed=0, learning_rate=1e-3, pad_token_id=0), tmp_path / "critic_0")
    assert json.loads((tmp_path / "critic_0" / "critic.json").read_text()) == {
        "kind": "separate",
        "source": str(tiny_model_dir),
        "head_hidden_dim": 8,
        "lora": {"r": 2, "alpha": 16, "dropout": 0.0, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]},
    }
    plain = new_critic(CriticSpec("separate", str(tiny_model_dir), None, 8), seed=0, learning_rate=1e-3, pad_token_id=0)
    with pytest.raises(ArtifactError, match="critic.json: written for critic"):
        restore_critic(plain, tmp_path / "critic_0")  # a LoRA critic's folder is not a full-weights critic's


def test_a_critic_of_the_joint_template_records_its_version_and_refuses_another(tiny_model_dir, tmp_path):
    def build(template):
        spec = CriticSpec("separate", str(tiny_model_dir), None, None, joint_template=template)
        return new_critic(spec, seed=0, learning_rate=1e-3, pad_token_id=0)

    save_critic(build("joint-v2"), tmp_path / "v2")
    assert json.loads((tmp_path / "v2" / "critic.json").read_text())["joint_template"] == "joint-v2"
    restore_critic(build("joint-v2"), tmp_path / "v2")
    for other in ("joint-v3", None):  # a later template, or a critic that reads no joint template
        with pytest.raises(ArtifactError, match="critic.json: written for critic"):
            restore_critic(build(other), tmp_path / "v2")
    save_critic(build(None), tmp_path / "plain")  # a folder without the key, as saved before it was recorded
    assert "joint_template" not in json.loads((tmp_path / "plain" / "critic.json").read_text())
    restore_critic(build(None), tmp_path / "plain")
    with pytest.raises(ArtifactError, match="critic.json: written for critic"):
        restore_critic(build("joint-v2"), tmp_path / "plain")


def test_a_weights_file_with_other_names_is_refused_naming_three_of_each(tiny_model_dir, tmp_path):
    from safetensors.torch import save_file

    critic = new_critic(
        CriticSpec("separate", str(tiny_model_dir), None, 8), seed=0, learning_rate=1e-3, pad_token_id=0
    )
    folder = tmp_path / "critic_0"
    save_critic(critic, folder)
    trained = sorted(n for n, p in critic.model.named_parameters() if p.requires_grad)
    assert len(trained) > 4
    weights = folder / "weights.safetensors"
    save_file({f"extra_{k}": torch.zeros(1) for k in range(5)}, weights)  # no trained weight, five others
    with pytest.raises(ArtifactError) as info:
        restore_critic(critic, folder)
    assert str(info.value) == (
        f"{weights}: holds other weights than the critic trains (missing {trained[:3]}, "
        "extra ['extra_0', 'extra_1', 'extra_2'])"
    )


# ---------------------------------------------------------------------------------------------- value loss and step
ROWS = [[2, 17, 40, 5], [2, 18, 50, 5, 9]]


def _separate(model_dir, seed: int = 0, width: int | None = None):
    return new_critic(
        CriticSpec("separate", str(model_dir), None, width), seed=seed, learning_rate=1e-3, pad_token_id=0
    )


def test_the_value_clip_holds_below_as_well():
    # V fell by 1 from V_old = 0 (clip 0.2 → V_clip = −0.2); R = −2: (V − R)² = 1, (V_clip − R)² = 3.24 → 3.24
    old, values, returns = (torch.tensor([x], dtype=torch.float64) for x in (0.0, -1.0, -2.0))
    assert clipped_value_loss(values, old, returns, 0.2).tolist() == pytest.approx([3.24], abs=1e-12)


def test_critic_step_outcomes(tiny_model_dir):
    critic = _separate(tiny_model_dir)
    before = [p.detach().clone() for p in critic.parameters]
    nothing = torch.zeros(0, dtype=torch.float64)
    loss, outcome = critic_step(critic, [], nothing, nothing, value_loss_coef=0.6, clip_range=0.2, max_grad_norm=1.0)
    assert math.isnan(loss) and outcome == "no_rows"
    old = torch.zeros(2, dtype=torch.float64)
    # R = 1e200: (V − R)² overflows float64 → the loss is inf and nothing steps
    loss, outcome = critic_step(
        critic,
        ROWS,
        torch.full((2,), 1e200, dtype=torch.float64),
        old,
        value_loss_coef=0.6,
        clip_range=None,
        max_grad_norm=None,
    )
    assert loss == math.inf and outcome == "skipped"
    # R = 1e39: the loss (≈ 1e78) is finite in float64, but dL/dV ≈ 6e38 overflows the float32 values: skipped
    loss, outcome = critic_step(
        critic,
        ROWS,
        torch.full((2,), 1e39, dtype=torch.float64),
        old,
        value_loss_coef=0.6,
        clip_range=None,
        max_grad_norm=None,
    )
    assert math.isfinite(loss) and loss > 1e77 and outcome == "skipped"
    assert all(torch.equal(p, b) for p, b in zip(critic.parameters, before, strict=True)) and not critic.optimizer.state
    loss, outcome = critic_step(
        critic, ROWS, torch.ones(2, dtype=torch.float64), old, value_loss_coef=0.6, clip_range=None, max_grad_norm=None
    )
    assert outcome == "updated" and critic.optimizer.state


# ---------------------------------------------------------------------------------------------- building
def test_new_critic_builds_the_specs_head_and_adamw_without_weight_decay(tiny_model_dir):
    critic = _separate(tiny_model_dir, width=8)
    head = critic.model.head
    assert [type(m).__name__ for m in head] == ["Linear", "Tanh", "Linear"]
    assert (head[0].out_features, head[2].in_features, head[2].out_features) == (8, 8, 1)
    assert critic.optimizer.param_groups[0]["weight_decay"] == 0.0
    assert type(_separate(tiny_model_dir).model.head).__name__ == "Linear"  # no width: one linear layer
    from pbrl.models.loading import load_model

    on_policy = new_critic(
        CriticSpec("value_head", None, None, 8),
        seed=0,
        learning_rate=1e-3,
        policy=load_model(tiny_model_dir, trainable=True),
        pad_token_id=0,
    )
    assert [type(m).__name__ for m in on_policy.model.head] == ["Linear", "Tanh", "Linear"]
    assert on_policy.model.head[0].out_features == 8


def test_new_critic_and_value_model_refuse_what_they_cannot_build(tiny_model_dir):
    from pbrl.models.loading import load_model

    policy = load_model(tiny_model_dir, trainable=True)
    spec = CriticSpec("value_head", None, None, None)
    for kwargs in ({"policy": policy}, {"pad_token_id": 0}, {}):
        with pytest.raises(ValueError) as info:
            new_critic(spec, seed=0, learning_rate=1e-3, **kwargs)
        assert str(info.value) == "a value-head critic needs the agent's policy model and its pad token id"
    with pytest.raises(ValueError) as info:
        new_critic(CriticSpec("shared", None, None, None), seed=0, learning_rate=1e-3)
    assert str(info.value) == "critic kind: got 'shared'; allowed: separate, value_head"
    with pytest.raises(ValueError) as info:
        ValueModel(torch.nn.Linear(4, 1), 0)
    assert str(info.value) == "ValueModel: give exactly one of backbone (separate critic) or policy (value head)"
    with pytest.raises(ValueError) as info:
        CriticSet("magrpo", "v", [])
    assert str(info.value) == "rl_algorithm: got 'magrpo'; critics serve maac, iac"


# ---------------------------------------------------------------------------------------------- the critic set
def test_maac_targets_the_agents_mean_return_and_iac_each_agents_own():
    returns = torch.tensor([[1.0, 2.0], [3.0, 6.0]], dtype=torch.float64)  # (a, n)
    assert _critic_set("maac", 1).targets(returns).tolist() == [[2.0, 4.0]]
    assert _critic_set("iac", 2).targets(returns).tolist() == [[1.0, 2.0], [3.0, 6.0]]


def test_evaluate_builds_rows_from_the_backend_type_and_max_length(tiny_model_dir):
    from pbrl.learning.joint_template import JointTemplate
    from pbrl.models.loading import load_tokenizer

    template = JointTemplate.build(load_tokenizer(tiny_model_dir), 2)
    prompts = [[[2, 17, 40, 5]], [[2, 18, 50, 5]]]  # [agent][row]
    completions = [[[70, 71, 3]], [[80, 3]]]
    joint_q = [
        *template.header,
        *template.prompt_markers[0],
        *prompts[0][0],
        *template.separator,
        *template.prompt_markers[1],
        *prompts[1][0],
        *template.response_markers[0],
        *completions[0][0],
        *template.response_markers[1],
        *completions[1][0],
    ]
    critic = _separate(tiny_model_dir)
    got = CriticSet("maac", "q", [critic], template=template).evaluate(prompts, completions)
    assert got.rows == [[joint_q]] and got.ok.tolist() == [True]
    assert got.values.shape == (2, 1) and got.values[0, 0] == got.values[1, 0]  # one critic's value for both agents
    cut = CriticSet("maac", "q", [critic], template=template, max_length=5)  # the responses alone do not fit
    cut = cut.evaluate(prompts, completions)
    assert cut.rows == [[None]] and cut.ok.tolist() == [False]
    iac = CriticSet("iac", "v", [critic, _separate(tiny_model_dir, seed=1)]).evaluate(prompts, completions)
    assert iac.rows == [[prompts[0][0]], [prompts[1][0]]]  # the history only (V), each agent's own


def test_update_steps_with_the_sets_clip_counts_skips_and_reports_the_loss(tiny_model_dir):
    critic = _separate(tiny_model_dir)
    rows = [ROWS[0], ROWS[1]]
    now = predict(critic, rows)  # (2,): the values the update will compute, before any step
    old = now + 5.0  # V_old far above V: with clip 0.2, V_clip = V_old − 0.2
    returns = torch.tensor([[1.0, -1.0]], dtype=torch.float64)
    cs = CriticSet("maac", "q", [critic], clip_range=0.2)
    batch = CriticBatch(rows=[rows], values=old[None, :].expand(2, 2).clone(), ok=torch.tensor([True, True]))
    metrics = cs.update(batch, returns.expand(2, 2), torch.tensor([True, True]))
    clipped = old - 0.2
    expected = [max(float((now[r] - returns[0, r]) ** 2), float((clipped[r] - returns[0, r]) ** 2)) for r in range(2)]
    assert metrics == {"critic/value_loss": pytest.approx(sum(expected) / 2, rel=1e-5)}
    assert cs.losses == [[metrics["critic/value_loss"]]] and cs.skipped == [0]
    huge = torch.full((2, 2), 1e200, dtype=torch.float64)
    for _ in range(2):  # two skipped steps are counted twice
        cs.update(batch, huge, torch.tensor([True, True]))
    assert cs.skipped == [2]
    assert cs.update(batch, returns.expand(2, 2), torch.tensor([False, False])) == {}  # no valid row: no step
    assert len(cs.losses[0]) == 3 and cs.skipped == [2]
