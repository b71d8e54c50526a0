"""The reward model's low-rank head input (reward_head_components, pbrl.learning.segment_pca): each agent's pooled
features on their principal components, checked against hand-worked values, then through a fit, save and load."""

from __future__ import annotations

import pytest
import torch

from pbrl.config import parse_job
from pbrl.errors import ConfigError
from pbrl.learning.joint_template import JointTemplate
from pbrl.learning.reward_fit import fit_bradley_terry, pair_metrics
from pbrl.learning.reward_model import RewardModelSpec, load_reward_model, new_reward_model, save_reward_model
from pbrl.learning.segment_pca import segment_projection
from pbrl.models.loading import load_tokenizer
from tests.test_reward_model import _length_pairs


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
    assert model.head.in_features == 2 * (3 + 1) and model.feature_projection.shape == (2 * (hidden + 1), 8)
    pairs = _length_pairs(template, 24, seed=3)  # the winner's agent-2 response is 2 tokens shorter
    with model.remembered_features():
        fit_bradley_terry(model, pairs, epochs=20, batch_size=4, learning_rate=5e-2, seed=0, max_grad_norm=1.0)
        fitted = pair_metrics(model, pairs, 16)
    assert fitted.accuracy >= 0.9  # the length difference is one of the head's inputs
    assert float(model.feature_projection.abs().sum()) > 0

    save_reward_model(model, spec, tmp_path / "rm", max_length=None)
    loaded, meta = load_reward_model(tmp_path / "rm")
    assert meta["head_components"] == 3
    assert torch.equal(loaded.feature_projection, model.feature_projection)
    rows = [row for pair in pairs[:4] for row in pair]
    with torch.no_grad():
        assert torch.equal(loaded(rows), model(rows))
