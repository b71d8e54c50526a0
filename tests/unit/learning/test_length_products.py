"""The products of the agents' lengths in the ``segments`` head (reward_length_products,
pbrl.learning.segment_head.length_products): hand-worked values, where the head reads them, what they let a linear
head learn (a band on the agents' length ratio), the saved record, older records, and the option's rule."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from pbrl.config import parse_job
from pbrl.errors import ConfigError
from pbrl.learning.joint_template import JointTemplate, joint_input_ids
from pbrl.learning.reward_fit import fit_bradley_terry, pair_metrics
from pbrl.learning.reward_model_build import RewardModelSpec, load_reward_model, new_reward_model, save_reward_model
from pbrl.learning.segment_head import length_products
from pbrl.models.loading import load_tokenizer


def test_length_products_by_hand():
    z = torch.tensor([[1.0, 2.0, 0.5, 3.0, -1.0, -2.0], [0.0, 0.0, -3.0, 0.0, 0.0, 0.25]])  # a = 2, h = 2
    assert length_products(z, 2).tolist() == [[-1.0], [-0.75]]  # columns 2 and 5: 0.5·(−2), −3·0.25
    three = torch.arange(9.0).reshape(1, 9)  # a = 3, h = 2: lengths 2, 5, 8 at columns 2, 5, 8
    assert length_products(three, 3).tolist() == [[10.0, 16.0, 40.0]]  # (1, 2), (1, 3), (2, 3)
    assert length_products(three[:, :3], 1).shape == (1, 0)  # one agent: no pair
    with pytest.raises(ValueError, match="2 agents"):
        length_products(torch.zeros((1, 7)), 2)


def _spec(tiny_model_dir, **options) -> RewardModelSpec:
    options = {"head_components": 1, **options}
    return RewardModelSpec(str(tiny_model_dir), freeze_backbone=True, pooling="segments", num_agents=2, **options)


def test_head_reads_the_products_after_the_squares(tiny_model_dir):
    """h = 64, a = 2, k = 1: the head's 7 inputs are [component_1, length_1, component_2, length_2, length_1²,
    length_2², length_1·length_2] of the standardized features. Standardized lengths 2 and −1 (raw 5 and −1 with
    shift 1 and scale 2): weights on the product (−1) and the bias (0.5) give −(2·−1) + 0.5 = 2.5; at lengths 0: 0.5."""
    model = new_reward_model(_spec(tiny_model_dir, length_products=True), seed=0)
    assert model.head.in_features == 7 and model.length_products
    with torch.no_grad():
        model.feature_shift.fill_(1.0)
        model.feature_scale.fill_(2.0)
        model.feature_projection.zero_()
        model.feature_projection[64, 1] = model.feature_projection[129, 3] = 1.0  # the lengths pass through
        model.head.weight.copy_(torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -1.0]]))
        model.head.bias.fill_(0.5)
        features = torch.ones((2, 130))
        features[0, 64], features[0, 129] = 5.0, -1.0
        assert model.head_inputs(features)[0].tolist() == [0.0, 2.0, 0.0, -1.0, 4.0, 1.0, -2.0]
        assert model.head_scores(features).tolist() == [2.5, 0.5]


def _ratio_pairs(template, n, seed):
    """Agent 1 writes s tokens (s drawn from 2 to 16); the winner's agent 2 writes 2s, the loser's s or 8s
    (alternately): the preference is a band on the agents' length ratio, as the docs task's summary-to-explanation
    ratio is, and no band on either agent's length alone holds it (the winner's 4–32 tokens overlap the loser's
    2–128)."""
    rng = np.random.default_rng(seed)
    pairs = []
    for j in range(n):
        prompts = [[int(x) for x in rng.integers(5, 300, 4)] for _ in range(2)]
        s = int(rng.integers(2, 17))
        first = [int(x) for x in rng.integers(5, 300, s)]
        good, bad = ([int(x) for x in rng.integers(5, 300, k)] for k in (2 * s, s if j % 2 else 8 * s))
        pairs.append(tuple(joint_input_ids(template, prompts, [first, c], None) for c in (good, bad)))
    return pairs


def test_the_products_let_a_linear_head_prefer_a_ratio_band(tiny_model_dir):
    """With each length and its square only, a linear head cannot say "agent 2 about twice agent 1" over agent 1's
    range of lengths; with their product it can, on pairs it never saw."""
    template = JointTemplate.build(load_tokenizer(tiny_model_dir), 2)
    pairs = _ratio_pairs(template, 120, seed=7)
    train, held = pairs[:90], pairs[90:]
    accuracy = {}
    for products in (True, False):
        model = new_reward_model(_spec(tiny_model_dir, length_products=products), seed=0)
        with model.remembered_features():
            fit_bradley_terry(model, train, epochs=30, batch_size=8, learning_rate=5e-2, seed=0, max_grad_norm=1.0)
            accuracy[products] = pair_metrics(model, held, 16).accuracy
    assert accuracy[True] >= 0.95 and accuracy[False] <= 0.8, accuracy


def test_the_record_names_the_products_and_older_records_load_without_them(tiny_model_dir, tmp_path):
    template = JointTemplate.build(load_tokenizer(tiny_model_dir), 2)
    pairs = _ratio_pairs(template, 16, seed=1)
    rows = [row for pair in pairs[:4] for row in pair]
    for products in (True, False):
        spec = _spec(tiny_model_dir, length_products=products)
        model = new_reward_model(spec, seed=0)
        with model.remembered_features():
            fit_bradley_terry(model, pairs, epochs=2, batch_size=8, learning_rate=5e-2, seed=0, max_grad_norm=1.0)
        folder = tmp_path / f"rm-{products}"
        save_reward_model(model, spec, folder, max_length=None)
        record = json.loads((folder / "reward_model.json").read_text())
        expected = ["segments_pca1", "length_squares", *(["length_products"] if products else [])]
        assert record["features"] == expected and record["length_products"] is products
        if not products:  # a record written before the option existed has no such key
            del record["length_products"]
            (folder / "reward_model.json").write_text(json.dumps(record))
        loaded, _ = load_reward_model(folder)
        assert loaded.length_products is products and loaded.head.in_features == 6 + products
        with torch.no_grad():
            assert torch.equal(loaded(rows), model(rows))


def test_the_option_goes_with_segments_only():
    base = {"trainer": "marlhf_iter", "task": "toy", "agent_model": "tiny-random", "num_agents": 2}
    with pytest.raises(ConfigError) as info:
        parse_job({**base, "reward_length_products": True, "reward_pooling": "last_token"})
    assert [p.field for p in info.value.problems] == ["reward_length_products"]
    assert parse_job({**base, "reward_length_products": True}).reward_length_products
    assert not parse_job(base).reward_length_products
    with pytest.raises(ValueError, match="reward_length_products: allowed only with reward_pooling='segments'"):
        RewardModelSpec("tiny-random", pooling="last_token", length_products=True)
