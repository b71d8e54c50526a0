"""The stages as plain functions on the tiny model and the toy task (no Prefect)."""

from __future__ import annotations

import json
import math
import statistics

import pytest

from pbrl.data.schema import CANDIDATES, EVAL, PAIRS, SCORES, SELECTED_PAIRS
from pbrl.data.storage import RunPaths, read_json, read_manifest
from pbrl.data.tables import read_rows
from pbrl.run.task import resolve_task
from pbrl.tasks.toy import toy_reward
from stages import STAGE_MODULES
from tests.helpers import new_run

COLLECT = ["sample-candidates", "score-with-oracle", "build-pairs", "store-round"]
LEARN = ["replay-select", "update-policies", "evaluate"]


def run_stages(run_dir, job, names, round_index=1):
    return {n: STAGE_MODULES[n].run(run_dir, round_index, job) for n in names}


@pytest.fixture(scope="module")
def collected(tiny_model_dir, tmp_path_factory):
    run_dir, job = new_run(tiny_model_dir, tmp_path_factory.mktemp("runs"))
    manifests = run_stages(run_dir, job, COLLECT)
    return run_dir, job, manifests


def test_collection_writes_every_file_with_manifest(collected):
    run_dir, job, manifests = collected
    paths = RunPaths(run_dir)
    for name in COLLECT:
        assert read_manifest(paths, 1, name) == manifests[name]
    cands = read_rows(paths.candidates(1), CANDIDATES)
    # 4 items x (3 target + 3 comparator candidates) x 2 agents
    assert len(cands) == 4 * 6 * 2
    assert {r["side"] for r in cands} == {"target", "comparator"}
    assert len(read_rows(paths.scores(1), SCORES)) == 4 * 6
    assert manifests["sample-candidates"].outputs == {
        "rounds/0001/candidates.parquet": manifests["score-with-oracle"].inputs["rounds/0001/candidates.parquet"]
    }


def test_completion_ids_are_as_generated(collected, tiny_model_dir):
    run_dir, _, _ = collected
    eos = 3  # <|im_end|> of the tiny tokenizer
    for row in read_rows(RunPaths(run_dir).candidates(1), CANDIDATES):
        ids = row["completion_ids"]
        if row["finish_reason"] == "eos":
            assert ids[-1] == eos and eos not in ids[:-1]
        else:
            assert row["finish_reason"] == "length" and len(ids) == 8 and eos not in ids


def test_same_seed_same_tokens_and_independent_comparator_stream(collected, tiny_model_dir, tmp_path):
    run_dir, _, _ = collected
    other_dir, job2 = new_run(tiny_model_dir, tmp_path)
    run_stages(other_dir, job2, ["sample-candidates"])
    a = read_rows(RunPaths(run_dir).candidates(1), CANDIDATES)
    b = read_rows(RunPaths(other_dir).candidates(1), CANDIDATES)
    assert [r["completion_ids"] for r in a] == [r["completion_ids"] for r in b]
    key = lambda r: (r["item_id"], r["candidate_index"], r["agent_index"])  # noqa: E731
    target = {key(r): r["completion_ids"] for r in a if r["side"] == "target"}
    comp = {key(r): r["completion_ids"] for r in a if r["side"] == "comparator"}
    assert sum(target[k] != comp[k] for k in target) > len(target) // 2
    assert len({r["seed"] for r in a}) == len(a)  # one seed per (side, agent, item, candidate)
    seeds_by_side = {side: {r["seed"] for r in a if r["side"] == side} for side in ("target", "comparator")}
    assert not seeds_by_side["target"] & seeds_by_side["comparator"]


def test_pair_file_has_reference_record_shape(collected):
    run_dir, job, manifests = collected
    data = json.loads((run_dir / "replay" / "iteration_0001.json").read_text())
    assert list(data) == ["iteration", "num_pairs", "pairs"]
    assert data["iteration"] == 1
    assert data["num_pairs"] == len(data["pairs"]) == manifests["build-pairs"].counts["pairs"]
    assert data["num_pairs"] > 0
    keys = [
        "prompts",
        "winner_completions",
        "loser_completions",
        "winner_reward",
        "loser_reward",
        "candidate_reward_mean",
        "raw_rewards",
        "target_raw_reward",
        "comparator_raw_reward",
    ]
    for rec in data["pairs"]:
        assert list(rec)[: len(keys)] == keys
        assert len(rec["prompts"]) == len(rec["winner_completions"]) == len(rec["loser_completions"]) == 2
        assert rec["winner_reward"] > rec["loser_reward"]
        assert isinstance(rec["raw_rewards"], list) and len(rec["raw_rewards"]) == 2
        assert {rec["target_raw_reward"], rec["comparator_raw_reward"]} == set(rec["raw_rewards"])
    index = read_json(run_dir / "replay" / "index.json")
    assert [e["round"] for e in index["rounds"]] == [1] and index["rounds"][0]["num_pairs"] == data["num_pairs"]


def test_pairs_keep_exact_ids_scores_and_index_matching(collected):
    run_dir, _, _ = collected
    paths = RunPaths(run_dir)
    cands = {
        (r["item_id"], r["side"], r["candidate_index"], r["agent_index"]): r
        for r in read_rows(paths.candidates(1), CANDIDATES)
    }
    scores = {(s["item_id"], s["side"], s["candidate_index"]): s for s in read_rows(paths.scores(1), SCORES)}
    pairs = read_rows(paths.pairs(1), PAIRS)
    assert pairs
    for p in pairs:
        # Iterative pairs compare target j with comparator j only, one side each.
        assert p["winner_index"] == p["loser_index"] and {p["winner_side"], p["loser_side"]} == {"target", "comparator"}
        w = scores[(p["item_id"], p["winner_side"], p["winner_index"])]
        lo = scores[(p["item_id"], p["loser_side"], p["loser_index"])]
        assert (p["winner_reward"], p["loser_reward"]) == (w["reward"], lo["reward"]) and w["reward"] > lo["reward"]
        assert (p["winner_raw_reward"], p["loser_raw_reward"]) == (w["raw_reward"], lo["raw_reward"])
        for a in range(2):
            wc = cands[(p["item_id"], p["winner_side"], p["winner_index"], a)]
            lc = cands[(p["item_id"], p["loser_side"], p["loser_index"], a)]
            # Token ids exactly as generated (never re-tokenized from the text), every agent from one index.
            assert p["winner_ids"][a] == wc["completion_ids"] and p["loser_ids"][a] == lc["completion_ids"]
            assert p["winner_completions"][a] == wc["completion"] and p["loser_completions"][a] == lc["completion"]
            assert p["prompt_ids"][a] == cands[(p["item_id"], "target", p["winner_index"], a)]["prompt_ids"]


def test_stored_winner_reproduces_its_reward(collected):
    run_dir, job, _ = collected
    task = resolve_task(job, run_dir)
    for p in read_rows(RunPaths(run_dir).pairs(1), PAIRS):
        raw = task.reward_func(*[[c] for c in p["winner_completions"]])
        assert raw[0] == pytest.approx(p["winner_raw_reward"], abs=0)
        assert p["winner_reward"] == p["winner_raw_reward"]  # identity reward_processor


def test_learning_stages_complete_a_round(collected):
    run_dir, job, _ = collected
    manifests = run_stages(run_dir, job, LEARN)
    paths = RunPaths(run_dir)
    sel = read_rows(paths.selected_pairs(1), SELECTED_PAIRS)
    assert [r["draw_order"] for r in sel] == list(range(len(sel)))
    assert [r["pair_id"] for r in sel] == [r["pair_id"] for r in read_rows(paths.pairs(1), PAIRS)]  # current
    ckpt = paths.round_checkpoint(1)
    assert (ckpt / "trainer_state.json").is_file()
    for a in range(2):
        assert (ckpt / f"agent_{a}" / "optimizer.pt").is_file()
        assert (ckpt / f"agent_{a}" / "model.safetensors").is_file()
    m = manifests["update-policies"].metrics
    pairs = read_rows(paths.pairs(1), PAIRS)
    # Values, worked out from the stored files: steps = ceil(pairs / train_batch_size) per epoch; the reward
    # mean is the mean over selected pairs of their item's mean candidate score (both sides, every candidate).
    assert manifests["update-policies"].counts["steps"] == math.ceil(len(pairs) / job.train_batch_size)
    scores = read_rows(paths.scores(1), SCORES)
    item_mean = {
        i: statistics.fmean(s["reward"] for s in scores if s["item_id"] == i) for i in {p["item_id"] for p in pairs}
    }
    expected = statistics.fmean(item_mean[p["item_id"]] for p in pairs)
    assert m["turn_1/reward_mean"] == pytest.approx(expected, abs=1e-12)
    assert m["turn_1/expected_return"] == pytest.approx(expected, abs=1e-12)
    assert m["madpo/skipped_steps"] == 0.0 and 0.0 <= m["madpo/accuracy"] <= 1.0
    # The mean joint margin is the sum of the agents' mean margins.
    assert m["madpo/margin_mean"] == pytest.approx(m["madpo/margin_agent_0"] + m["madpo/margin_agent_1"], abs=1e-9)
    assert m["madpo/loss"] > 0
    ev = read_rows(paths.eval(1), EVAL)
    assert len(ev) == 2 and all(len(r["completions"]) == 2 for r in ev)
    rewards = [toy_reward(*[[c] for c in r["completions"]])[0] for r in ev]  # the task's reward, identity processor
    assert [r["reward"] for r in ev] == pytest.approx(rewards, abs=0)
    eval_mean = manifests["evaluate"].metrics["eval/turn_1/reward_mean"]
    assert eval_mean == pytest.approx(statistics.fmean(rewards), abs=1e-12)


def test_replay_folder_of_another_run_is_refused(tiny_model_dir, tmp_path):
    from pbrl.errors import ConfigError

    shared = tmp_path / "shared-replay"
    run_a, job_a = new_run(tiny_model_dir, tmp_path / "a", preference_replay_dir=str(shared))
    run_stages(run_a, job_a, COLLECT)
    assert (shared / "iteration_0001.json").is_file()
    before = (shared / "iteration_0001.json").read_bytes()
    with pytest.raises(ConfigError, match="preference_replay_dir.*another run"):
        new_run(tiny_model_dir, tmp_path / "b", preference_replay_dir=str(shared))
    # Round files without an index (e.g. copied from elsewhere) are refused too, and never overwritten.
    (shared / "index.json").unlink()
    with pytest.raises(ConfigError, match="already holds round files"):
        new_run(tiny_model_dir, tmp_path / "c", preference_replay_dir=str(shared))
    assert (shared / "iteration_0001.json").read_bytes() == before


def test_replay_select_never_uses_later_rounds_on_disk(tiny_model_dir, tmp_path):
    run_dir, job = new_run(tiny_model_dir, tmp_path, preference_replay_mode="all_history")
    for r in (1, 2, 3):
        run_stages(run_dir, job, COLLECT + ["replay-select", "update-policies"], round_index=r)
    # Rerunning round 2's selection (e.g. after resuming from round 2) sees rounds 1-2 only.
    again = STAGE_MODULES["replay-select"].run(run_dir, 2, job)
    assert again.details["eligible_rounds"] == [1, 2]
    assert {r["source_round"] for r in read_rows(RunPaths(run_dir).selected_pairs(2), SELECTED_PAIRS)} <= {1, 2}
