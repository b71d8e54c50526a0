"""The reward model's low-rank head input (reward_head_components, pbrl.learning.segment_head): each agent's pooled
features on their principal components, checked against hand-worked values, then through a fit, save and load."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from pbrl.config import parse_job
from pbrl.errors import ConfigError
from pbrl.learning.joint_template import JointTemplate, joint_input_ids
from pbrl.learning.reward_fit import fit_bradley_terry, pair_metrics
from pbrl.learning.reward_model import HeadExtras, JointRewardModel
from pbrl.learning.reward_model_build import RewardModelSpec, load_reward_model, new_reward_model, save_reward_model
from pbrl.learning.segment_head import length_squares, segment_projection
from pbrl.models.loading import load_tokenizer
from tests.unit.learning.test_reward_model import _length_pairs


def test_projection_by_hand():
    """2 agents, h = 2. Agent 0's pooled rows are ±(1, 1): they vary only along (1, 1)/√2, where they sit at ±√2
    (population spread √2), so each weight is (1/√2)/√2 = 1/2; agent 1's vary only along its second dimension
    (±3: weight 1/3). Lengths pass through."""
    z = torch.tensor(
        [
            [1.0, 1.0, 0.5, 0.0, 3.0, -1.0],
            [-1.0, -1.0, -0.5, 0.0, -3.0, 1.0],
        ]
    )  # columns: agent 0 (pooled 0, pooled 1, length), agent 1 (pooled 0, pooled 1, length)
    p = segment_projection(z, num_agents=2, components=1)
    assert p.shape == (6, 4)  # m = a·(k+1)
    projected = z @ p  # (2, 4): agent 0's component, its length, agent 1's component, its length
    assert projected[:, 1].tolist() == [0.5, -0.5] and projected[:, 3].tolist() == [-1.0, 1.0]
    assert [abs(x) for x in projected[:, 0].tolist()] == pytest.approx([1.0, 1.0], abs=1e-6)  # unit variance
    assert [abs(x) for x in projected[:, 2].tolist()] == pytest.approx([1.0, 1.0], abs=1e-6)
    assert [abs(float(x)) for x in p[:2, 0]] == pytest.approx([0.5, 0.5], abs=1e-6)
    assert float(p[3, 2]) == 0.0 and abs(float(p[4, 2])) == pytest.approx(1 / 3, abs=1e-6)

    wide = segment_projection(z, num_agents=2, components=4)  # 2 centred rows have rank 1: components 2-4 stay 0
    assert wide.shape == (6, 10)
    assert float(wide[:, 1:4].abs().sum()) == 0.0 and float(wide[2, 4]) == 1.0
    assert float(wide[:, 6:9].abs().sum()) == 0.0 and torch.equal(wide[:, [0, 4, 5, 9]], p)
    unseen = torch.tensor([[0.0, 0.0, 0.0, 5.0, 0.0, 0.0]])  # off every training direction of agent 1
    assert float((unseen @ wide).abs().max()) == 0.0  # a direction without variance adds nothing


def test_projection_errors_name_the_field():
    with pytest.raises(ValueError, match="reward_head_components"):
        segment_projection(torch.zeros((3, 6)), num_agents=2, components=0)
    with pytest.raises(ValueError, match="2 agents"):
        segment_projection(torch.zeros((3, 7)), num_agents=2, components=1)


def test_components_need_segments_pooling():
    base = {"trainer": "marlhf_iter", "task": "toy", "agent_model": "tiny-random", "num_agents": 2}
    with pytest.raises(ConfigError, match="reward_head_components"):
        parse_job({**base, "reward_head_components": 4, "reward_pooling": "last_token"})
    assert parse_job({**base, "reward_head_components": 4}).reward_head_components == 4


def test_a_fitted_projected_head_learns_saves_and_loads(tiny_model_dir, tmp_path):
    template = JointTemplate.build(load_tokenizer(tiny_model_dir), 2)
    spec = RewardModelSpec(
        str(tiny_model_dir), freeze_backbone=True, pooling="segments", num_agents=2, head_components=3
    )
    model = new_reward_model(spec, seed=0)
    hidden = model.backbone.config.hidden_size
    # each agent's 3 components and length, then the two lengths' squares
    assert model.head.in_features == 2 * (3 + 1) + 2 and model.feature_projection.shape == (2 * (hidden + 1), 8)
    pairs = _length_pairs(template, 24, seed=3)  # the winner's agent-2 response is 2 tokens shorter
    with model.remembered_features():
        fit_bradley_terry(model, pairs, epochs=20, batch_size=4, learning_rate=5e-2, seed=0, max_grad_norm=1.0)
        fitted = pair_metrics(model, pairs, 16)
    assert fitted.accuracy >= 0.9  # the length difference is one of the head's inputs
    assert float(model.feature_projection.abs().sum()) > 0

    save_reward_model(model, spec, tmp_path / "rm", max_length=None)
    loaded, meta = load_reward_model(tmp_path / "rm")
    assert meta["head_components"] == 3 and meta["length_squares"] is True and loaded.length_squares
    assert torch.equal(loaded.feature_projection, model.feature_projection)
    rows = [row for pair in pairs[:4] for row in pair]
    with torch.no_grad():
        assert torch.equal(loaded(rows), model(rows))


def test_length_squares_by_hand():
    z = torch.tensor([[1.0, 2.0, 0.5, 3.0, -1.0, -2.0], [0.0, 0.0, -3.0, 0.0, 0.0, 0.25]])  # a = 2, h = 2
    assert length_squares(z, 2).tolist() == [[0.25, 4.0], [9.0, 0.0625]]  # columns 2 and 5, squared
    with pytest.raises(ValueError, match="2 agents"):
        length_squares(torch.zeros((1, 7)), 2)


def test_head_scores_read_the_projection_then_the_squares(tiny_model_dir):
    """h = 64, a = 2, k = 1: the head's 6 inputs are [component_1, length_1, component_2, length_2, length_1²,
    length_2²] of the standardized features; with weights (0, 0, 0, 1, 0, -1) and bias 0.5 the score is
    z_len2 − z_len2² + 0.5: 2 − 4 + 0.5 = −1.5 for a standardized length of 2, 0.5 at 0."""
    spec = RewardModelSpec(
        str(tiny_model_dir), freeze_backbone=True, pooling="segments", num_agents=2, head_components=1
    )
    model = new_reward_model(spec, seed=0)
    f = 2 * 65
    with torch.no_grad():
        model.feature_shift.fill_(1.0)
        model.feature_scale.fill_(2.0)
        model.feature_projection.zero_()
        model.feature_projection[64, 1] = model.feature_projection[129, 3] = 1.0  # the lengths pass through
        model.head.weight.copy_(torch.tensor([[0.0, 0.0, 0.0, 1.0, 0.0, -1.0]]))
        model.head.bias.fill_(0.5)
        features = torch.ones((2, f))
        features[0, 129] = 5.0  # agent 2's length: (5 − 1) / 2 = 2 standardized
        assert model.head_scores(features).tolist() == [-1.5, 0.5]


def _band_pairs(template, n, seed):
    """The winner's agent-2 response has 4 tokens, the loser's 1 or 9 (alternately): the preferred length lies in
    a band, as the docs task's summary-to-explanation ratio does."""
    rng = np.random.default_rng(seed)
    pairs = []
    for j in range(n):
        prompts = [[int(x) for x in rng.integers(5, 300, 4)] for _ in range(2)]
        first = [int(x) for x in rng.integers(5, 300, 3)]
        mid, off = ([int(x) for x in rng.integers(5, 300, k)] for k in (4, 1 if j % 2 else 9))
        pairs.append(tuple(joint_input_ids(template, prompts, [first, c], None) for c in (mid, off)))
    return pairs


def test_the_squares_let_a_linear_head_prefer_a_length_band(tiny_model_dir):
    """Linear in the log lengths a head can only prefer shorter or longer; with the squares it orders a middle
    length above both extremes, on pairs it never saw (the tiny backbone's pooled states carry one component)."""
    template = JointTemplate.build(load_tokenizer(tiny_model_dir), 2)
    pairs = _band_pairs(template, 100, seed=5)
    train, held = pairs[:80], pairs[80:]
    spec = RewardModelSpec(
        str(tiny_model_dir), freeze_backbone=True, pooling="segments", num_agents=2, head_components=1
    )
    accuracy = {}
    for squares in (True, False):
        built = new_reward_model(spec, seed=0)
        width = built.head.in_features - (0 if squares else 2)
        model = JointRewardModel(
            built.backbone, torch.nn.Linear(width, 1), built.pad_token_id, "segments", 130, HeadExtras(squares)
        )
        with model.remembered_features():
            fit_bradley_terry(model, train, epochs=40, batch_size=8, learning_rate=5e-2, seed=0, max_grad_norm=1.0)
            accuracy[squares] = pair_metrics(model, held, 16).accuracy
    assert accuracy[True] == 1.0 and accuracy[False] <= 0.75, accuracy


def test_a_model_saved_before_the_squares_loads_and_scores_without_them(tiny_model_dir, tmp_path):
    """A reward_model.json without ``length_squares`` (written before it existed) loads a head without the squares
    and scores as the saved model did."""
    template = JointTemplate.build(load_tokenizer(tiny_model_dir), 2)
    spec = RewardModelSpec(
        str(tiny_model_dir), freeze_backbone=True, pooling="segments", num_agents=2, head_components=2
    )
    built = new_reward_model(spec, seed=0)
    old = JointRewardModel(built.backbone, torch.nn.Linear(6, 1), built.pad_token_id, "segments", 130)
    pairs = _band_pairs(template, 16, seed=1)
    with old.remembered_features():
        fit_bradley_terry(old, pairs, epochs=2, batch_size=8, learning_rate=5e-2, seed=0, max_grad_norm=1.0)
    save_reward_model(old, spec, tmp_path / "rm", max_length=None)
    meta_file = tmp_path / "rm" / "reward_model.json"
    meta = json.loads(meta_file.read_text())
    assert meta.pop("length_squares") is False
    meta_file.write_text(json.dumps(meta))
    loaded, _ = load_reward_model(tmp_path / "rm")
    rows = [row for pair in pairs[:4] for row in pair]
    assert not loaded.length_squares and loaded.head.in_features == 6
    with torch.no_grad():
        assert torch.equal(loaded(rows), old(rows))
