"""``benchmarks/reward_model.py``'s data (issue #55): a joint response's texts are the candidates its score row names
(with ``joint_mode: cross`` joint response j combines agent 0's candidate 0 with agent 1's candidate j: the script
once read both agents' candidate j), and its content features are worked out by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tests.helpers import benchmark_script


@pytest.fixture(scope="module")
def rm():
    with benchmark_script("reward_model") as module:
        yield module


def _candidate(side: str, index: int, agent: int) -> dict:
    return {"item_id": "q", "side": side, "candidate_index": index, "agent_index": agent,
            "prompt_ids": [agent], "completion_ids": [index], "completion": f"{side}-{index}-{agent}"}  # fmt: skip


def test_a_cross_joint_response_reads_the_candidates_its_score_row_names(rm):
    candidates = [_candidate(s, i, a) for s in ("target", "comparator") for i in range(2) for a in range(2)]
    scores = [
        {"item_id": "q", "side": "target", "candidate_index": 1, "reward": 2.0, "failure": None,
         "candidate_sides": ["target", "comparator"], "candidate_indices": [0, 1]},
        {"item_id": "q", "side": "target", "candidate_index": 0, "reward": 1.0, "failure": None,
         "candidate_sides": None, "candidate_indices": None},  # aligned: candidate 0 of each agent
        {"item_id": "q", "side": "target", "candidate_index": 2, "reward": None, "failure": "raised",
         "candidate_sides": ["target", "target"], "candidate_indices": [1, 1]},
    ]  # fmt: skip
    joint = rm.assemble(scores, candidates, 2)
    assert [j["completions"] for j in joint] == [["target-0-0", "comparator-1-1"], ["target-0-0", "target-0-1"]]
    assert [j["reward"] for j in joint] == [2.0, 1.0] and joint[0]["completion_ids"] == [[0], [1]]


def test_word_overlap_weighs_the_words_particular_to_a_prompt(rm):
    prompts = [["def add(left, right)", "explain add"], ["def mul(left, right)", "explain mul"]]
    responses = [{"completions": ["add adds left", "x"]}, {"completions": ["nothing", "it does mul"]}]
    out = rm.word_overlap(responses, prompts, 2)
    # agent 0, 2 distinct prompts: def, left, right in both (idf 0); add, mul in one (idf log 2). Response 0 says
    # add and left: log 2 / log 2 = 1; response 1 says none of them: 0. Agent 1: explain (idf 0), add / mul
    # (log 2): response 0 says neither (0), response 1 says mul (1).
    assert out.tolist() == [[1.0, 0.0], [0.0, 1.0]]
    assert math.isclose(rm.word_overlap([responses[0]], [prompts[0]], 2)[0, 0], 0.0)  # one prompt: every idf 0


def test_the_overlap_and_length_representations_run_no_backbone(rm, tiny_model_dir, monkeypatch):
    from types import SimpleNamespace

    def no_backbone(*_):
        raise AssertionError("the backbone ran")

    monkeypatch.setattr(rm, "backbone_features", no_backbone)
    job = SimpleNamespace(agent_model=str(tiny_model_dir), num_agents=2)
    # agent 0's prompts: [40, 41, 41, 43] (41 said twice) and [40, 42]; 40 is in both (idf 0), 41, 42, 43 in one
    # each (idf log 1.5 = L). Response 0 says 41: idf alone L / 2L = 1/2 (the product), tf-idf 2L / (2L + L) = 2/3;
    # response 1 says only 40: 0. Agent 1's prompt, [50] in both, weighs 0: 0.
    responses = [
        {"item_id": "a", "prompt_ids": [[40, 41, 41, 43], [50]], "completion_ids": [[41, 41], [7]], "completions": []},
        {"item_id": "b", "prompt_ids": [[40, 42], [50]], "completion_ids": [[40], [50, 51]], "completions": []},
    ]
    wanted = ["prompt_overlap", "overlap_tf", "segment_lengths"]
    features = rm.representations(responses, {"a": {}, "b": {}}, job, wanted)
    assert list(features) == wanted
    # the lengths: log(1 + response tokens) per agent, 2 and 1 tokens, then 1 and 2
    assert np.allclose(features["segment_lengths"], np.log1p([[2, 1], [1, 2]]))
    assert features["overlap_tf"]({"a", "b"}).ravel().tolist() == pytest.approx([2 / 3, 0.0, 0.0, 0.0])
    assert features["prompt_overlap"]({"a", "b"}).ravel().tolist() == pytest.approx([1 / 2, 0.0, 0.0, 0.0])


def test_the_joint_overlap_representation_is_the_products_on_the_decoded_words(rm, tiny_model_dir):
    from types import SimpleNamespace

    from pbrl.models.loading import load_tokenizer

    tokenizer = load_tokenizer(tiny_model_dir)

    def response(item: str, prompt: str, said: list[str]) -> dict:
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        return {"item_id": item, "prompt_ids": [ids, ids], "completions": said,
                "completion_ids": [tokenizer.encode(t, add_special_tokens=False) for t in said]}  # fmt: skip

    # two items' joint prompts, {sort, the, numbers} and {sort, the, strings}: sort and the weigh 0, the others
    # log 1.5. Response 0's agents say "the" and "numbers" between them: 1; response 1 says only "sort": 0.
    responses = [
        response("a", "Sort the numbers", ["the", "numbers"]),
        response("b", "Sort the strings", ["sort", "ok"]),
    ]
    job = SimpleNamespace(agent_model=str(tiny_model_dir), num_agents=2)
    features = rm.representations(responses, {"a": {}, "b": {}}, job, ["joint_overlap", "overlaps+joint"])
    assert features["joint_overlap"]({"a", "b"}).ravel().tolist() == [1.0, 0.0]
    both = features["overlaps+joint"]({"a", "b"})  # each agent's token overlap, then the joint overlap
    assert both.shape == (2, 3) and both[:, 2].tolist() == [1.0, 0.0]
