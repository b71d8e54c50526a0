"""The joint reward model (docs/design/algorithms.md#joint-reward-model): template and truncation, pooling under
padding, Bradley–Terry fitting,
safe save/load, and the fit-reward-model stage on the tiny model."""

from __future__ import annotations

import contextlib
import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from pbrl.data.schema import PAIR_JOINT_IDS, PAIRS, ROLLOUTS
from pbrl.data.storage import RunPaths
from pbrl.data.tables import read_rows
from pbrl.learning.joint_template import DROP_TOO_LONG, JointTemplate, check_same_vocabulary, joint_input_ids
from pbrl.learning.losses import bradley_terry_loss
from pbrl.learning.reward_fit import fit_bradley_terry, heldout_split, pair_metrics
from pbrl.learning.reward_model import STANDARDIZE_EPS, row_features, standardize
from pbrl.learning.reward_model_build import RewardModelSpec, load_reward_model, new_reward_model, save_reward_model
from pbrl.learning.reward_scoring import RewardScorer
from pbrl.learning.segment_head import segment_features
from pbrl.models.loading import load_tokenizer
from pbrl.models.lora import LoraSettings
from pbrl.run.reward_records import pair_joint_ids_path
from stages import STAGE_MODULES
from tests.helpers import new_run

# A template with one-token pieces, so joint inputs can be written out by hand.
T = JointTemplate(header=(1,), prompt_markers=((2,), (3,)), response_markers=((4,), (5,)), separator=(6,))
PROMPTS = [[10, 11, 12], [20, 21]]
COMPLETIONS = [[30, 31], [40, 41, 42]]
FULL = [1, 2, 10, 11, 12, 6, 3, 20, 21, 4, 30, 31, 5, 40, 41, 42]  # 16 tokens, 11 of them fixed: prompts first


def test_joint_template_puts_every_prompt_then_every_response_in_agent_order():
    assert joint_input_ids(T, PROMPTS, COMPLETIONS, None).ids == FULL
    assert joint_input_ids(T, PROMPTS, COMPLETIONS, 16).ids == FULL


@pytest.mark.parametrize(
    ("max_length", "expected", "cut"),
    [
        (13, [1, 2, 6, 3, 20, 21, 4, 30, 31, 5, 40, 41, 42], 3),  # agent 1's prompt goes first, from its left
        (12, [1, 2, 6, 3, 21, 4, 30, 31, 5, 40, 41, 42], 4),  # then agent 2's, from its left
        (11, [1, 2, 6, 3, 4, 30, 31, 5, 40, 41, 42], 5),  # no prompt token left, every response token kept
    ],
)
def test_over_max_length_cuts_prompts_and_keeps_every_response_token(max_length, expected, cut):
    joint = joint_input_ids(T, PROMPTS, COMPLETIONS, max_length)
    assert joint.ids == expected and joint.prompt_tokens_cut == cut and joint.reason is None
    assert joint.ids[-3:] == COMPLETIONS[1]  # the last agent's response, whole, at the end


def test_responses_that_do_not_fit_drop_the_joint_input():
    joint = joint_input_ids(T, PROMPTS, COMPLETIONS, 10)
    assert joint.ids is None and joint.reason == DROP_TOO_LONG


def test_template_needs_one_prompt_and_completion_per_agent():
    with pytest.raises(ValueError, match="2 agents"):
        joint_input_ids(T, PROMPTS[:1], COMPLETIONS[:1], None)


def test_bradley_terry_loss_hand_values():
    loss = bradley_terry_loss(torch.tensor([2.0, 0.0, -1.0, 100.0]), torch.tensor([0.0, 0.0, 1.0, -100.0]))
    # −log σ(2) = log(1 + e^−2) = 0.126928; −log σ(0) = log 2; −log σ(−2) = 2.126928; −log σ(200) ≈ 0
    assert loss.tolist() == pytest.approx([0.1269280110, math.log(2), 2.1269280110, 0.0], abs=1e-6)


def test_heldout_split_is_seeded_disjoint_and_keeps_one_training_pair():
    train, held = heldout_split(list(range(10)), 0.2, seed=3)
    assert len(held) == 2 and sorted(train + held) == list(range(10))
    assert heldout_split(list(range(10)), 0.2, seed=3) == (train, held)
    assert heldout_split(list(range(1)), 0.2, seed=3) == ([0], [])
    assert len(heldout_split(list(range(2)), 0.2, seed=3)[1]) == 1


@pytest.fixture(scope="module")
def template(tiny_model_dir):
    return JointTemplate.build(load_tokenizer(tiny_model_dir), 2)


def _joint(template, rng, eos=3):
    prompts = [[int(x) for x in rng.integers(5, 300, rng.integers(3, 9))] for _ in range(2)]
    completions = [[*(int(x) for x in rng.integers(5, 300, rng.integers(1, 7))), eos] for _ in range(2)]
    return joint_input_ids(template, prompts, completions, None).ids


def test_scores_alone_equal_left_and_right_padded_with_pad_equal_to_eos(tiny_model_dir, template):
    model = new_reward_model(RewardModelSpec(str(tiny_model_dir)), seed=0)
    model.pad_token_id = 3  # pad == EOS, and every completion ends in EOS
    rng = np.random.default_rng(0)
    rows = [_joint(template, rng) for _ in range(5)]
    assert len({len(r) for r in rows}) > 1
    with torch.no_grad():
        alone = torch.cat([model([r]) for r in rows])
        right, left = model(rows, "right"), model(rows, "left")
    assert torch.allclose(right, alone, atol=1e-5, rtol=0) and torch.allclose(left, alone, atol=1e-5, rtol=0)
    assert alone.dtype == torch.float32 and len(set(alone.tolist())) == 5  # the head reads each row's own end


def _separable_pairs(template, n, seed):
    """Winner joint responses end their last response in token 200, losers in token 201."""
    rng = np.random.default_rng(seed)
    pairs = []
    for _ in range(n):
        prompts = [[int(x) for x in rng.integers(5, 300, 4)] for _ in range(2)]
        body = [[int(x) for x in rng.integers(5, 300, 3)] for _ in range(2)]
        pairs.append(
            tuple(joint_input_ids(template, prompts, [body[0], [*body[1], end]], None).ids for end in (200, 201))
        )
    return pairs


def test_bradley_terry_fit_separates_a_separable_set_on_held_out_pairs(tiny_model_dir, template):
    pairs = _separable_pairs(template, 40, seed=1)
    train_idx, held_idx = heldout_split(list(range(len(pairs))), 0.25, seed=2)
    train, held = [pairs[i] for i in train_idx], [pairs[i] for i in held_idx]
    model = new_reward_model(RewardModelSpec(str(tiny_model_dir)), seed=0)
    before = pair_metrics(model, train, 16)
    stats = fit_bradley_terry(model, train, epochs=4, batch_size=4, learning_rate=3e-3, seed=0, max_grad_norm=1.0)
    after, heldout = pair_metrics(model, train, 16), pair_metrics(model, held, 16)
    assert stats == {"steps": 4 * math.ceil(len(train) / 4), "skipped_steps": 0}
    assert after.loss < before.loss and after.margin_mean > before.margin_mean
    assert heldout.accuracy >= 0.9 and len(held) == 10


def test_freeze_backbone_trains_the_head_only(tiny_model_dir, template):
    model = new_reward_model(RewardModelSpec(str(tiny_model_dir), freeze_backbone=True), seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fit_bradley_terry(
        model,
        _separable_pairs(template, 4, seed=1),
        epochs=1,
        batch_size=2,
        learning_rate=1e-2,
        seed=0,
        max_grad_norm=None,
    )
    changed = {k for k, v in model.state_dict().items() if not torch.equal(v, before[k])}
    assert changed == {"head.weight", "head.bias"}


@pytest.mark.parametrize(
    "spec_kw",
    [
        {},
        {"freeze_backbone": True},
        {"lora": LoraSettings(r=2)},
        {"backbone_layers": 1},
        {"freeze_backbone": True, "backbone_layers": 1},
        {"lora": LoraSettings(r=2), "backbone_layers": 1},
    ],
    ids=["full", "head", "lora", "full-cut", "head-cut", "lora-cut"],
)
def test_saved_model_loads_safely_and_scores_the_same(tiny_model_dir, template, tmp_path, spec_kw):
    spec = RewardModelSpec(str(tiny_model_dir), **spec_kw)
    model = new_reward_model(spec, seed=0)
    pairs = _separable_pairs(template, 4, seed=1)
    fit_bradley_terry(model, pairs, epochs=1, batch_size=2, learning_rate=1e-2, seed=0, max_grad_norm=1.0)
    save_reward_model(model, spec, tmp_path / "rm", max_length=64)
    files = {p.name for p in (tmp_path / "rm").rglob("*") if p.is_file()}
    assert not any(f.endswith((".bin", ".pt", ".pkl")) for f in files) and "head.safetensors" in files
    loaded, meta = load_reward_model(tmp_path / "rm")
    rows = [p[0] for p in pairs]
    with torch.no_grad():
        assert torch.allclose(loaded(rows), model(rows), atol=1e-6, rtol=0)
    assert meta["trained"] == spec.trained and meta["max_length"] == 64
    assert not any(p.requires_grad for p in loaded.parameters())
    layers = spec.backbone_layers or 2  # the tiny model has 2
    assert meta["backbone_layers"] == spec.backbone_layers
    assert loaded.backbone.config.num_hidden_layers == layers
    assert sum(1 for n, _ in loaded.backbone.named_modules() if n.endswith("self_attn")) == layers


def test_a_cut_backbone_reads_the_normed_hidden_state_of_its_last_kept_layer(tiny_model_dir, template):
    """``reward_backbone_layers: 1`` on the 2-layer tiny model: the features are the segments of
    norm(hidden_states[1]) of the whole body's own forward (issue #30: layer 10 of SmolLM2's 30 held-out as well
    as layer 30 at a third of the cost), and the policies' shared weights keep both layers."""
    from transformers import AutoModel

    from pbrl.models.loading import shared_backbone

    spec = RewardModelSpec(str(tiny_model_dir), freeze_backbone=True, pooling="segments", num_agents=2)
    cut = new_reward_model(replace(spec, backbone_layers=1), seed=0)
    whole = AutoModel.from_pretrained(tiny_model_dir, dtype=torch.float32)
    rows = [_joint_input(template, np.random.default_rng(s)) for s in range(3)]
    for row in rows:
        with torch.no_grad():
            hidden = whole(input_ids=torch.tensor([row.ids]), output_hidden_states=True).hidden_states
            want = segment_features(whole.norm(hidden[1]), [row.response_spans])
            assert torch.allclose(cut.features([row]), want, atol=1e-5, rtol=0)
            assert not torch.allclose(want, segment_features(hidden[2], [row.response_spans]), atol=1e-3)
    again = shared_backbone(tiny_model_dir)  # another tree over the same shared weights: uncut
    assert again.config.num_hidden_layers == 2 and len(again.layers) == 2
    assert cut.backbone.layers[0].mlp.up_proj.weight is again.layers[0].mlp.up_proj.weight  # one copy in memory


@pytest.mark.parametrize("layers", [0, 3, True])
def test_a_layer_count_outside_the_backbone_names_the_field(tiny_model_dir, layers):
    spec = RewardModelSpec(str(tiny_model_dir), freeze_backbone=True, backbone_layers=layers)
    with pytest.raises(ValueError, match=r"reward_backbone_layers: got .*; the backbone has 2 layers"):
        new_reward_model(spec, seed=0)


# ---------------------------------------------------------------------------------------------- segments pooling
def test_segment_features_hand_values():
    """Both rows' hidden states are [0, 1], [2, 3], [4, 5], [6, 7], [8, 9]. Row 0: agent 1's response at positions
    1-2 (mean of [2, 3] and [4, 5]), agent 2's empty (zeros, log 1 = 0). Row 1: agent 1 at position 0, agent 2 at
    positions 2-4 (mean of [4, 5], [6, 7], [8, 9])."""
    hidden = torch.arange(20, dtype=torch.float32).view(2, 5, 2) % 10  # (b=2, t=5, h=2)
    got = segment_features(hidden, [((1, 3), (4, 4)), ((0, 1), (2, 5))])
    want = torch.tensor(
        [
            [3.0, 4.0, math.log(3), 0.0, 0.0, 0.0],
            [0.0, 1.0, math.log(2), 6.0, 7.0, math.log(4)],
        ]
    )
    assert got.shape == (2, 2 * (2 + 1)) and torch.allclose(got, want)


def _joint_input(template, rng, eos=3):
    prompts = [[int(x) for x in rng.integers(5, 300, rng.integers(3, 9))] for _ in range(2)]
    completions = [[*(int(x) for x in rng.integers(5, 300, rng.integers(0, 7))), eos] for _ in range(2)]
    return joint_input_ids(template, prompts, completions, None)


def test_joint_input_spans_are_the_completions():
    joint = joint_input_ids(T, PROMPTS, COMPLETIONS, 14)  # 2 prompt tokens cut: spans shift with them
    assert [joint.ids[s:e] for s, e in joint.response_spans] == COMPLETIONS
    assert joint_input_ids(T, PROMPTS, COMPLETIONS, None).response_spans == ((10, 12), (13, 16))


def test_segments_scores_alone_equal_left_and_right_padded(tiny_model_dir, template):
    spec = RewardModelSpec(str(tiny_model_dir), pooling="segments", num_agents=2)
    model = new_reward_model(spec, seed=0)
    assert model.head.in_features == 2 * (model.backbone.config.hidden_size + 1) + 2  # + the lengths' squares
    rng = np.random.default_rng(0)
    rows = [_joint_input(template, rng) for _ in range(5)]
    with torch.no_grad():
        alone = torch.cat([model([r]) for r in rows])
        right, left = model(rows, "right"), model(rows, "left")
    assert torch.allclose(right, alone, atol=1e-5, rtol=0) and torch.allclose(left, alone, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="response spans"):
        model([r.ids for r in rows])  # ids alone cannot be pooled by segment


@pytest.mark.parametrize("agents", [2, 3])
def test_cross_joint_responses_share_their_prefixes_and_score_as_alone(tiny_model_dir, agents):
    """Cross joint responses of one item repeat the header and every prompt, and every combination with the
    same first candidates repeats everything up to the next response: those prefixes now run once (the fit of
    issue #30 ran each joint response whole). Scores and features equal each row's own plain forward."""
    import itertools

    from pbrl.models.forward import pad_rows, shared_prefix_hidden

    template = JointTemplate.build(load_tokenizer(tiny_model_dir), agents)
    rng = np.random.default_rng(agents)
    prompts = [[int(x) for x in rng.integers(5, 300, 40)] for _ in range(agents)]
    candidates = [[[int(x) for x in rng.integers(5, 300, rng.integers(0, 6))] + [3] for _ in range(2)]
                  for _ in range(agents)]  # fmt: skip
    rows = [joint_input_ids(template, prompts, list(c), None) for c in itertools.product(*candidates)]
    for pooling in ("segments", "last_token"):
        spec = RewardModelSpec(str(tiny_model_dir), pooling=pooling, num_agents=agents)
        model = new_reward_model(spec, seed=0)
        with torch.no_grad():
            alone = torch.cat([model.features([r], "left") for r in rows])  # the plain forward, row by row
            shared = model.features(rows)
            batched = row_features(model, rows[::-1], batch_size=1)  # an item's rows 4 a forward, back in order
        assert torch.allclose(shared, alone, atol=1e-5, rtol=0)
        assert torch.allclose(batched, alone.flip(0), atol=1e-5, rtol=0)

    tokens = []
    model.backbone.register_forward_pre_hook(
        lambda _m, _a, kwargs: tokens.append(int(kwargs["attention_mask"][:, -kwargs["input_ids"].shape[1] :].sum())),
        with_kwargs=True,
    )
    ids = [r.ids for r in rows]
    with torch.no_grad():
        hidden = shared_prefix_hidden(model.backbone, ids, [[s for s, _ in r.response_spans] for r in rows], 0)
    prefix = rows[0].response_spans[0][0]  # the header and every prompt: the same in every row
    assert len(tokens) == agents + 1 and tokens[0] == prefix  # level 0 once, not 2**agents times
    assert sum(tokens) < sum(len(r) for r in ids) / 2
    _, mask, _, _ = pad_rows(ids, 0, "right")
    assert torch.all(hidden[mask == 0] == 0)  # padding positions hold zeros


def test_shared_prefix_cuts_are_checked():
    from pbrl.models.forward import shared_prefix_hidden

    with pytest.raises(ValueError, match=r"rows \[1\]"):
        shared_prefix_hidden(torch.nn.Identity(), [[1, 2, 3], [1, 2]], [[1], [3]], 0)
    with pytest.raises(ValueError, match="as many per row"):
        shared_prefix_hidden(torch.nn.Identity(), [[1, 2, 3], [1, 2]], [[1], [1, 2]], 0)


def _rows_run(model) -> list[int]:
    """The number of rows ``model`` runs through its backbone, forward by forward (filled as it runs)."""
    runs: list[int] = []
    compute = model._compute_features

    def counted(rows, *args, **kwargs):
        runs.append(len(rows))
        return compute(rows, *args, **kwargs)

    model._compute_features = counted
    return runs


def _length_pairs(template, n, seed):
    """The winner's agent-2 response is 2 tokens shorter than the loser's; tokens are random otherwise."""
    rng = np.random.default_rng(seed)
    pairs = []
    for _ in range(n):
        prompts = [[int(x) for x in rng.integers(5, 300, 4)] for _ in range(2)]
        first = [int(x) for x in rng.integers(5, 300, 3)]
        size = int(rng.integers(2, 6))
        short, long = ([int(x) for x in rng.integers(5, 300, k)] for k in (size, size + 2))
        pairs.append(tuple(joint_input_ids(template, prompts, [first, c], None) for c in (short, long)))
    return pairs


def test_frozen_segments_model_learns_lengths_with_one_backbone_pass(tiny_model_dir, template):
    """A frozen backbone is run once over the distinct rows (not once per step and epoch); the standardization is
    their features' mean and spread; the head learns that the shorter response wins, on pairs it never saw."""
    spec = RewardModelSpec(str(tiny_model_dir), freeze_backbone=True, pooling="segments", num_agents=2)
    model = new_reward_model(spec, seed=0)
    runs = _rows_run(model)
    pairs = _length_pairs(template, 140, seed=3)
    train, held = pairs[:120], pairs[120:]
    stats = fit_bradley_terry(model, train, epochs=30, batch_size=8, learning_rate=1e-2, seed=0, max_grad_norm=1.0)
    assert stats["steps"] == 30 * 15 and runs == [16] * 15  # 240 distinct rows, once, 16 per forward
    features = row_features(model, [r for p in train for r in p])
    assert torch.allclose(model.feature_shift, features.mean(0), atol=1e-5)
    assert torch.allclose(model.feature_scale, features.std(0, unbiased=False).clamp(min=1e-6), atol=1e-5)
    weights = model.head.weight.detach()[0]  # per agent: the mean hidden state (h = 64), then log(1 + length)
    assert int(weights.abs().argmax()) == 129 and weights[129] < 0  # agent 2's length decides, shorter is better
    assert pair_metrics(model, held, 16).accuracy >= 0.85  # 20 unseen pairs: chance would be 0.5


def test_standardize_reads_a_column_constant_on_the_training_rows_as_0_on_every_row():
    values = torch.tensor([[1.0, 5.0, 2.0], [3.0, 5.0, 2.5], [2.0, 7.0, 3.0]])  # the last row unseen in training
    shift, scale = torch.tensor([2.0, 5.0, 2.25]), torch.tensor([1.0, STANDARDIZE_EPS, 0.25])
    # by hand: (1-2)/1, (3-2)/1, (2-2)/1; column 2 constant (spread clamped to 1e-6): 0, not (7-5)/1e-6 = 2e6;
    # (2-2.25)/0.25, (2.5-2.25)/0.25, (3-2.25)/0.25
    assert standardize(values, shift, scale).tolist() == [[-1.0, 0.0, -1.0], [1.0, 0.0, 1.0], [0.0, 0.0, 3.0]]


def test_a_length_constant_in_training_does_not_blow_up_an_unseen_rows_score(tiny_model_dir):
    """Every training row's second agent used all its tokens (a constant log length, its spread clamped to 1e-6):
    a rollout of another length scored about -5.6e7 in a MARLHF round (2026-12-06). The constant column reads 0,
    so the unseen length scores as the training length does."""
    spec = RewardModelSpec(
        str(tiny_model_dir), freeze_backbone=True, pooling="segments", num_agents=2, head_components=2
    )
    model = new_reward_model(spec, seed=0)
    f = model.feature_shift.shape[0]  # a·(h+1): agent 2's log length is the last column
    features = torch.randn(12, f, generator=torch.Generator().manual_seed(0))
    features[:, -1] = math.log1p(48)
    model.standardize_on(features)
    with torch.no_grad():
        model.head.weight.fill_(1.0)
        unseen = features[:1].clone()
        unseen[0, -1] = math.log1p(30)
        assert model.head_scores(unseen).item() == model.head_scores(features[:1]).item()
        assert abs(model.head_scores(unseen).item()) < 100


def test_a_head_input_outside_its_training_range_is_clamped_to_it_and_the_range_is_saved(tiny_model_dir, tmp_path):
    """Nearly every training row's second agent used all 48 tokens (a log-length spread of 0.0038 in a MARLHF
    round, 2026-12-06): a 33-token rollout stood 96 spreads away and scored 2,868 where the median was 0.94. Each
    head input is clamped to its range on the training rows; inside it nothing changes; the range is saved, and a
    record saved without one loads unclamped."""
    spec = RewardModelSpec(
        str(tiny_model_dir), freeze_backbone=True, pooling="segments", num_agents=2, head_components=2
    )
    model = new_reward_model(spec, seed=0)
    features = torch.randn(12, model.feature_shift.shape[0], generator=torch.Generator().manual_seed(0))
    features[:, -1] = math.log1p(48)
    features[0, -1] = math.log1p(47)  # one row of 47 tokens: a spread of 0.006, not 0
    model.standardize_on(features)
    with torch.no_grad():
        model.head.weight.fill_(1.0)
        unseen = features[1:2].clone()
        unseen[0, -1] = math.log1p(30)
        unclamped = model.head_scores(unseen).item()  # no range yet: ±inf
        model.set_input_range(features)
        inputs = model.head_inputs(features)
        assert torch.equal(model.input_low, inputs.min(0).values) and torch.equal(
            model.input_high, inputs.max(0).values
        )
        assert torch.equal(model.head_scores(features), model.head(inputs).squeeze(-1))  # training rows: unchanged
        x = model.head_inputs(unseen)
        assert x[0, 5] < model.input_low[5] and x[0, 7] > model.input_high[7]  # its length, and the length squared
        clamped = torch.minimum(torch.maximum(x, model.input_low), model.input_high)
        assert model.head_scores(unseen).item() == model.head(clamped).item()
        assert unclamped > 1000 > abs(model.head_scores(unseen).item())
    save_reward_model(model, spec, tmp_path / "rm", max_length=None)
    loaded, _ = load_reward_model(tmp_path / "rm")
    assert torch.equal(loaded.input_low, model.input_low) and torch.equal(loaded.input_high, model.input_high)
    head_file = tmp_path / "rm" / "head.safetensors"
    older = {k: v for k, v in load_file(head_file).items() if k not in ("input_low", "input_high")}
    save_file(older, head_file)  # as saved before 2026-12-06
    old, _ = load_reward_model(tmp_path / "rm")
    assert torch.isinf(old.input_low).all() and torch.isinf(old.input_high).all()
    assert old.head_scores(unseen).item() == pytest.approx(unclamped, rel=1e-5)


def test_the_fit_sets_each_head_input_range_on_its_training_rows(tiny_model_dir, template):
    spec = RewardModelSpec(str(tiny_model_dir), freeze_backbone=True, pooling="segments", num_agents=2)
    model = new_reward_model(spec, seed=0)
    train = _length_pairs(template, 40, seed=3)
    fit_bradley_terry(model, train, epochs=2, batch_size=8, learning_rate=1e-2, seed=0, max_grad_norm=1.0)
    inputs = model.head_inputs(row_features(model, [r for p in train for r in p]))  # rows repeat: the same range
    assert torch.equal(model.input_low, inputs.min(0).values) and torch.equal(model.input_high, inputs.max(0).values)


def test_saved_segments_model_scores_the_same_and_older_records_read_as_last_token(tiny_model_dir, template, tmp_path):
    import json

    spec = RewardModelSpec(str(tiny_model_dir), freeze_backbone=True, pooling="segments", num_agents=2)
    model = new_reward_model(spec, seed=0)
    pairs = _length_pairs(template, 6, seed=1)
    fit_bradley_terry(model, pairs, epochs=2, batch_size=2, learning_rate=1e-2, seed=0, max_grad_norm=1.0)
    save_reward_model(model, spec, tmp_path / "rm", max_length=64)
    loaded, meta = load_reward_model(tmp_path / "rm")
    rows = [p[0] for p in pairs]
    with torch.no_grad():
        assert torch.allclose(loaded(rows), model(rows), atol=1e-6, rtol=0)
    assert meta["pooling"] == "segments"
    assert not torch.equal(loaded.feature_scale, torch.ones_like(loaded.feature_scale))
    old_spec = RewardModelSpec(str(tiny_model_dir), freeze_backbone=True)  # written before pooling existed
    save_reward_model(new_reward_model(old_spec, seed=0), old_spec, tmp_path / "old", max_length=None)
    record = json.loads((tmp_path / "old" / "reward_model.json").read_text())
    del record["pooling"], record["num_agents"]
    (tmp_path / "old" / "reward_model.json").write_text(json.dumps(record))
    assert load_reward_model(tmp_path / "old")[0].pooling == "last_token"


def test_other_vocabulary_is_refused(tiny_model_dir, tmp_path):
    from pbrl.models.tiny import build_tiny_model

    other = load_tokenizer(build_tiny_model(tmp_path / "other", seed=5))
    with pytest.raises(ValueError, match="reward_model_name"):
        check_same_vocabulary(load_tokenizer(tiny_model_dir), [load_tokenizer(tiny_model_dir), other], "x")


# ---------------------------------------------------------------------------------------------- stages
MARLHF = {
    "trainer": "marlhf_iter",
    "num_iterations": 1,
    "reward_num_train_epochs": 2,
    "reward_train_batch_size": 2,
    "reward_learning_rate": 1e-3,
    "num_generations": 2,
    "train_batch_size": 2,
    "reference_kl_enabled": True,
}
STAGES = [
    "sample-candidates",
    "score-with-oracle",
    "build-pairs",
    "store-round",
    "replay-select",
    "fit-reward-model",
    "update-policies",
]


@pytest.fixture(scope="module")
def marlhf_round(tiny_model_dir, tmp_path_factory):
    run_dir, job = new_run(tiny_model_dir, tmp_path_factory.mktemp("runs"), **MARLHF)
    manifests = {n: STAGE_MODULES[n].run(run_dir, 1, job) for n in STAGES}
    return run_dir, job, manifests


def test_fit_stage_writes_model_and_metrics(marlhf_round):
    run_dir, _, manifests = marlhf_round
    fit = manifests["fit-reward-model"]
    assert fit.details["fitted"] and (run_dir / fit.details["reward_model"] / "head.safetensors").is_file()
    for name in ("rm/loss", "rm/accuracy", "rm/margin_mean", "rm/heldout_loss", "rm/heldout_accuracy"):
        assert name in fit.metrics, name
    assert fit.counts["train_pairs"] + fit.counts["heldout_pairs"] == fit.counts["pairs"] > 0
    assert "rounds/0001/pair_joint_ids.parquet" in manifests["build-pairs"].outputs


def test_ids_scored_at_fit_time_and_at_rl_time_are_identical(marlhf_round):
    """The stored joint ids of the pairs are what the RL-time scorer builds from the same stored token ids,
    and every rollout's stored joint ids are its own prompt and completion ids in the template."""
    run_dir, job, manifests = marlhf_round
    paths = RunPaths(run_dir)
    scorer = RewardScorer(run_dir / manifests["fit-reward-model"].details["reward_model"], job.num_agents)
    pairs = read_rows(paths.pairs(1), PAIRS)
    stored = {r["pair_id"]: r for r in read_rows(pair_joint_ids_path(paths.round_dir(1)), PAIR_JOINT_IDS)}
    rl_time = scorer.score([p["prompt_ids"] for p in pairs], [p["winner_ids"] for p in pairs])
    assert [ids for _, ids in rl_time] == [stored[p["pair_id"]]["winner_joint_ids"] for p in pairs]
    rollouts = read_rows(paths.round_dir(1) / "rollouts.parquet", ROLLOUTS)
    by_joint: dict = {}
    for r in rollouts:
        by_joint.setdefault((r["step"], r["item_id"], r["generation_index"]), []).append(r)
    for rows in by_joint.values():
        rows.sort(key=lambda r: r["agent_index"])
        ids = joint_input_ids(
            scorer.template, [r["prompt_ids"] for r in rows], [r["completion_ids"] for r in rows], job.reward_max_length
        ).ids
        assert all(r["joint_ids"] == ids for r in rows)
        alone = scorer.score([[r["prompt_ids"] for r in rows]], [[r["completion_ids"] for r in rows]])[0][0]
        assert all(r["reward"] == pytest.approx(alone, rel=1e-6, abs=1e-5) for r in rows)  # batched vs alone


def test_update_stage_records_rl_metrics_and_rollouts(marlhf_round):
    run_dir, job, manifests = marlhf_round
    update = manifests["update-policies"]
    for name in ("rl/reward_mean", "rl/advantage_std", "rl/kl_mean", "rl/kl_mean_agent_0", "rl/loss"):
        assert name in update.metrics, name
    assert update.metrics["rl/kl_mean"] >= 0
    rollouts = read_rows(RunPaths(run_dir).round_dir(1) / "rollouts.parquet", ROLLOUTS)
    assert len(rollouts) == update.counts["joint_responses"] * job.num_agents
    assert "rounds/0001/rollouts.parquet" in update.outputs


def test_reward_model_scores_new_comparisons_when_asked(marlhf_round):
    run_dir, job, _ = marlhf_round
    job2 = job.model_copy(update={"preference_scoring_reward": "reward_model", "num_iterations": 2})
    STAGE_MODULES["sample-candidates"].run(run_dir, 2, job2)
    manifest = STAGE_MODULES["score-with-oracle"].run(run_dir, 2, job2)
    assert manifest.details["scored_by"] == "reward_model" and manifest.details["reward_model_round"] == 1
    assert "rounds/0001/reward_model" in manifest.inputs


def test_the_heldout_pairs_are_the_pairs_of_items_never_seen_in_fitting():
    """Issue #30: rm/heldout_* held out 20 % of *pairs*, whose responses also appeared in training pairs (0.77-0.83
    there against chance on unseen items): held-out pairs are now every pair of held-out items."""
    items = ["a", "a", "b", "c", "c", "c", "d", "b"]
    train, held = heldout_split(items, 0.25, seed=5)
    assert sorted(train + held) == list(range(8))
    assert {items[i] for i in held}.isdisjoint({items[i] for i in train})
    assert len({items[i] for i in held}) == 1  # round(0.25 * 4) items
    assert heldout_split(items, 0.25, seed=5) == (train, held)  # seeded
    assert heldout_split(["a", "a"], 0.5, seed=0) == ([0, 1], [])  # one item: nothing can be held out


def test_pair_scores_run_each_distinct_row_once(tiny_model_dir, template):
    """Found measuring 410 pairs of 128 joint responses: every pair's rows were scored again. Each distinct row is
    scored once now, with the same scores as per pair."""
    from pbrl.learning.reward_fit import pair_correct
    from pbrl.learning.reward_model import score_joint

    spec = RewardModelSpec(str(tiny_model_dir), freeze_backbone=True, pooling="segments", num_agents=2)
    model = new_reward_model(spec, seed=0)
    rows = [r for p in _length_pairs(template, 3, seed=4) for r in p]  # 6 distinct rows
    pairs = [(rows[i], rows[j]) for i in range(6) for j in range(6) if i != j]  # 30 pairs over them
    runs = _rows_run(model)
    metrics, correct = pair_metrics(model, pairs, 16), pair_correct(model, pairs, 16)
    assert runs == [6, 6]  # one forward of the 6 rows per call, not 60 rows
    each = [score_joint(model, [r], 1)[0] for r in rows]
    assert correct == [each[i] > each[j] for i in range(6) for j in range(6) if i != j]
    assert metrics.accuracy == 0.5  # every ordered pair and its reverse


def test_remembered_features_run_a_frozen_backbone_once_per_row_across_fit_and_metrics(tiny_model_dir, template):
    """Measured on the MARLHF docs config: after the fit's one pass, the training pairs' metrics ran the backbone
    over the same rows again (about 40 % of fit-reward-model) and the held-out pairs twice (loss/accuracy, then
    the per-pair verdicts). Inside ``remembered_features`` each distinct row runs once, with identical scores;
    a backbone that trains is never remembered, and nothing is kept after the block."""
    from pbrl.learning.reward_fit import pair_correct

    pairs = _length_pairs(template, 20, seed=6)
    train, held = pairs[:16], pairs[16:]  # 32 + 8 distinct rows
    results = []
    for remember in (False, True):
        spec = RewardModelSpec(str(tiny_model_dir), freeze_backbone=True, pooling="segments", num_agents=2)
        model = new_reward_model(spec, seed=0)
        runs = _rows_run(model)
        with model.remembered_features() if remember else contextlib.nullcontext():
            fit_bradley_terry(model, train, epochs=3, batch_size=4, learning_rate=1e-2, seed=0, max_grad_norm=1.0)
            metrics = pair_metrics(model, train, 16), pair_metrics(model, held, 16), pair_correct(model, held, 16)
        results.append((runs, metrics))
        assert model._memo is None
    (calls_plain, plain), (calls_remembered, remembered) = results
    assert calls_plain == [16, 16] * 2 + [8, 8] and calls_remembered == [16, 16, 8]  # 32 training rows, 8 held out
    assert remembered == plain  # the same scores, bit for bit

    spec = RewardModelSpec(str(tiny_model_dir), freeze_backbone=False, pooling="segments", num_agents=2)
    trained = new_reward_model(spec, seed=0)
    with trained.remembered_features():
        assert trained._memo is None  # its features change with every step
