"""The reward model's joint overlap (issue #55, :class:`pbrl.learning.prompt_overlap.JointWordOverlap`): words, the
idf table and the overlap worked out by hand, a segments model that reads it learns a preference about what the agents
say *between them* (which neither agent's own overlap nor the pooled states show), its saved record names it and
reloads to the same scores, and records from before it load as they were (the option's rule, and a MARLHF round
that fits and uses it: ``test_prompt_overlap.py``)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from pbrl.learning.joint_template import JointTemplate, joint_input_ids
from pbrl.learning.prompt_overlap import JointWordOverlap, words
from pbrl.learning.reward_fit import fit_bradley_terry, pair_metrics
from pbrl.learning.reward_model_build import RewardModelSpec, load_reward_model, new_reward_model, save_reward_model
from pbrl.models.loading import load_tokenizer
from tests.unit.learning.test_prompt_overlap import T

# token id -> text, for the hand-worked table (the template's own ids, 1-6, never fall inside a span)
VOCAB = {
    10: "Sort the", 11: "numbers", 12: "below_zero", 15: "strings", 16: "as_is", 17: "reverse",
    21: "numbers,", 22: "BELOW", 24: "ok",
}  # fmt: skip


def _decode(ids: list[int]) -> str:
    return " ".join(VOCAB[i] for i in ids)


def test_words_are_case_folded_runs_of_three_letters_or_more():
    text = "Return the below_zero value 3 times: numbers(x) ÉTÉ it"
    assert words(text) == {"return", "the", "below", "zero", "value", "times", "numbers", "été"}


def test_the_joint_table_and_overlap_by_hand():
    # row 1: agent 1's prompt "Sort the numbers", agent 2's "below_zero": P = {sort, the, numbers, below, zero};
    # agent 1 says "BELOW" (agent 2's word) and agent 2 "numbers," (agent 1's): R = {below, numbers}.
    first = joint_input_ids(T, [[10, 11], [12]], [[22], [21]], None)
    # row 2: "Sort the strings" and "as_is" (two-letter runs are no words): P = {sort, the, strings}; says "ok": R = {}.
    second = joint_input_ids(T, [[10, 15], [16]], [[24], [24]], None)
    table = JointWordOverlap.fit([first, second, first], _decode)  # a repeated joint prompt counts once
    assert table.documents == 2
    assert table.df == {"below": 1, "numbers": 1, "sort": 2, "strings": 1, "the": 2, "zero": 1}
    # idf = log((1 + N) / (1 + df)): sort, the -> log(3/3) = 0; the others log(3/2); unseen -> log 3
    assert table.idf("the") == 0.0 and table.idf("zero") == pytest.approx(math.log(1.5))
    assert table.idf("reverse") == pytest.approx(math.log(3))
    # row 1: (below + numbers) / (numbers + below + zero) = 2/3 — each agent used the *other* agent's prompt's
    # word, which no agent's own overlap counts; row 2: 0.
    assert table.features([first, second], _decode)[:, 0].tolist() == pytest.approx([2 / 3, 0.0])
    # an unseen item: P = {sort, the, numbers, reverse}, says reverse: log 3 / (log 1.5 + log 3)
    unseen = joint_input_ids(T, [[10, 11, 17], [16]], [[24], [17]], None)
    want = math.log(3) / (math.log(1.5) + math.log(3))
    assert table.features([unseen], _decode)[0, 0].item() == pytest.approx(want, rel=1e-6)
    assert JointWordOverlap.from_record(json.loads(json.dumps(table.to_record()))) == table


WORDS = (
    "apple banana cherry delta engine forest garden harbor island jungle kernel ladder marble nectar orange pencil "
    "quartz river saddle timber umbrella velvet walnut yellow zipper anchor bottle candle dragon ember falcon glacier "
    "hammer igloo jacket kettle lemon mirror needle oyster parrot quiver rocket silver tunnel violet window"
).split()


def _together_pairs(tokenizer, template, n, seed):
    """Each item's prompt (the same for both agents) names two words particular to it. The winner's agents name
    one each; the loser's both name the same one. Each agent names one of the item's words either way, so neither
    agent's own overlap, nor any length, tells them apart: only what they say between them does."""
    rng = np.random.default_rng(seed)
    pairs = []
    for _ in range(n):
        first, second = (str(w) for w in rng.choice(WORDS, size=2, replace=False))
        prompt = tokenizer.encode(f"Describe the {first} and the {second}.", add_special_tokens=False)
        say = {w: tokenizer.encode(f"It is about the {w}.", add_special_tokens=False) for w in (first, second)}
        repeated = first if rng.random() < 0.5 else second
        order = [first, second] if rng.random() < 0.5 else [second, first]
        winner = [say[order[0]], say[order[1]]]
        loser = [say[repeated], say[repeated]]
        pairs.append(tuple(joint_input_ids(template, [prompt, prompt], c, None) for c in (winner, loser)))
    return pairs


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


@pytest.fixture(scope="module")
def template(tokenizer):
    return JointTemplate.build(tokenizer, 2)


def _spec(model_dir, **options) -> RewardModelSpec:
    return RewardModelSpec(str(model_dir), freeze_backbone=True, pooling="segments", num_agents=2, **options)


def test_a_head_that_reads_the_joint_overlap_learns_what_the_agents_say_together(tiny_model_dir, tokenizer, template):
    pairs = _together_pairs(tokenizer, template, 60, seed=4)
    train, held = pairs[:40], pairs[40:]  # held-out items: word combinations the fit never saw
    accuracy = {}
    for joint in (False, True):
        spec = _spec(tiny_model_dir, head_components=4, prompt_overlap=True, joint_overlap=joint)
        model = new_reward_model(spec, seed=0)
        fit_bradley_terry(model, train, epochs=30, batch_size=8, learning_rate=1e-2, seed=0, max_grad_norm=1.0)
        accuracy[joint] = pair_metrics(model, held, 16).accuracy
        if joint:  # the head's last input, the joint overlap, has the largest weight, positive
            weights = model.head.weight.detach()[0]
            assert int(weights.abs().argmax()) == len(weights) - 1 and weights[-1] > 0
    assert accuracy[True] == 1.0 and accuracy[False] <= 0.6, accuracy  # measured 1.0 and 0.45: chance without it


def test_the_saved_record_names_the_joint_overlap_and_reloads_to_the_same_scores(
    tiny_model_dir, tokenizer, template, tmp_path
):
    spec = _spec(tiny_model_dir, head_components=4, joint_overlap=True)
    assert spec.head_width(64) == 2 * (4 + 1) + 2 + 1  # components and lengths, squares, the joint overlap
    model = new_reward_model(spec, seed=0)
    pairs = _together_pairs(tokenizer, template, 8, seed=1)
    fit_bradley_terry(model, pairs, epochs=2, batch_size=4, learning_rate=1e-2, seed=0, max_grad_norm=1.0)
    save_reward_model(model, spec, tmp_path / "rm", max_length=None)
    loaded, meta = load_reward_model(tmp_path / "rm")
    assert meta["features"] == ["segments_pca4", "length_squares", "joint_overlap"]
    assert meta["prompt_overlap"] is None and meta["joint_overlap"]["documents"] == 8
    assert loaded.word_overlap == model.word_overlap and torch.equal(loaded.overlap_scale, model.overlap_scale)
    unseen = [p[0] for p in _together_pairs(tokenizer, template, 4, seed=9)]
    with torch.no_grad():
        assert torch.equal(loaded(unseen), model(unseen))
    both = _spec(tiny_model_dir, prompt_overlap=True, joint_overlap=True)
    assert both.feature_names[-2:] == ["prompt_overlap", "joint_overlap"]
    old = _spec(tiny_model_dir, prompt_overlap=True)
    fitted = new_reward_model(old, seed=0)
    fit_bradley_terry(fitted, pairs, epochs=1, batch_size=4, learning_rate=1e-2, seed=0, max_grad_norm=1.0)
    save_reward_model(fitted, old, tmp_path / "old", max_length=None)
    record = json.loads((tmp_path / "old" / "reward_model.json").read_text())
    del record["joint_overlap"]  # a record written before the joint overlap existed
    (tmp_path / "old" / "reward_model.json").write_text(json.dumps(record))
    reloaded = load_reward_model(tmp_path / "old")[0]
    assert not reloaded.joint_overlap and reloaded.word_overlap is None and reloaded.overlap_shift.shape == (2,)
    with torch.no_grad():
        assert torch.equal(reloaded(unseen), fitted(unseen))


def test_a_model_that_reads_the_joint_overlap_refuses_to_score_before_its_table_is_fitted(
    tiny_model_dir, tokenizer, template
):
    with pytest.raises(ValueError, match="reward_joint_overlap: the overlap table is not fitted"):
        new_reward_model(_spec(tiny_model_dir, joint_overlap=True), seed=0)(
            list(_together_pairs(tokenizer, template, 1, seed=0)[0])
        )
    model = new_reward_model(_spec(tiny_model_dir, joint_overlap=True), seed=0)
    with pytest.raises(ValueError, match="reward_joint_overlap: head_scores needs the rows' overlaps"):
        model.head_scores(torch.zeros(1, model.feature_shift.shape[0]))
    with pytest.raises(ValueError, match="reward_joint_overlap: allowed only with reward_pooling='segments'"):
        RewardModelSpec(str(tiny_model_dir), pooling="last_token", joint_overlap=True)
