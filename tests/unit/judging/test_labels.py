"""People as the judge (issue #52, ``judge: human``): a round stops at judge-pairs until its pairs are labelled, the
labels written into the run's answer store are exactly what judge-pairs and build-pairs use, nothing is lost or
given twice (two labellers at once, a form taken twice, undo), a stale or wrong submission is refused whole with
the pairs named, and the label deadline fails the round or lets it go on. Stages are called directly on the tiny
model; ``tests/flow/test_label_deadline.py`` runs them under Prefect, ``tests/browser/test_ui_labels.py`` in the
Prefect UI."""

from __future__ import annotations

import json
import multiprocessing
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from pbrl.data.schema import PAIRS, VERDICTS
from pbrl.data.storage import RunPaths
from pbrl.data.tables import read_rows
from pbrl.errors import ConfigError, LabelError, LabelsNeeded
from pbrl.run.judging import answer_store
from pbrl.run.labelling import (
    key_of,
    label_status,
    labels_needed,
    new_session,
    read_request,
    relabel,
    waiting_for,
    write_labels,
)
from tests.helpers import new_run, tiny_job
from tests.unit.judging.test_judge_stages import run_round

HUMAN = {"preference_source": "judge", "judge": "human", "pair_selection": "all", "preference_pairs_per_sample": None}


def labelled_round(tiny_model_dir: Path, folder: Path, **overrides):
    """A tiny human-judged run with round 1 sampled and scored, waiting for labels: (run_dir, job, waiting)."""
    run_dir, job = new_run(tiny_model_dir, folder, **{**HUMAN, "num_iterations": 1, **overrides})
    with pytest.raises(LabelsNeeded) as stopped:
        run_round(run_dir, job, 1, until="judge-pairs")
    waiting = waiting_for(RunPaths(run_dir), 1, job)
    assert stopped.value.missing == len(waiting.missing) == waiting.total > 2
    return run_dir, job, waiting


def test_the_round_trains_on_exactly_the_labels_given_a_tie_and_a_skip_giving_no_pair(tiny_model_dir, tmp_path):
    run_dir, job, waiting = labelled_round(tiny_model_dir, tmp_path)
    paths = RunPaths(run_dir)
    assert {a.shown_first for a in waiting.askings} == {"x", "y"}  # one order per pair, drawn (seeded) and recorded
    assert len({a.question_id for a in waiting.askings}) == waiting.total  # each pair asked once
    choices = ["A", "B", "tie", "skip"] + ["A", "B"] * waiting.total
    labels = {a.question_id: c for a, c in zip(waiting.askings, choices, strict=False)}
    done = write_labels(waiting, labels, labeller="ada", via="test")
    assert done.written == list(labels) and not done.already and not done.later
    manifests = run_round(run_dir, job, 1, until="build-pairs")
    verdicts = read_rows(paths.verdicts(1), VERDICTS)
    assert [(v["question_id"], v["verdict"], v["labeller"], v["judge"]) for v in verdicts] == [
        (q, None if c == "skip" else c, "ada", "human") for q, c in labels.items()
    ]
    # what each label means for the pair: A is the joint response shown first (x or y, as drawn for the pair)
    expected = set()
    for asking in waiting.askings:
        choice = labels[asking.question_id]
        if choice in ("tie", "skip"):
            continue
        other = {"x": "y", "y": "x"}[asking.shown_first]
        winner = asking.question.x if (asking.shown_first if choice == "A" else other) == "x" else asking.question.y
        loser = asking.question.y if winner is asking.question.x else asking.question.x
        expected.add((asking.item_id, winner.side, winner.index, loser.side, loser.index))
    pairs = read_rows(paths.pairs(1), PAIRS)
    got = {(p["item_id"], p["winner_side"], p["winner_index"], p["loser_side"], p["loser_index"]) for p in pairs}
    assert got == expected and len(pairs) == waiting.total - 2
    counts = manifests["build-pairs"].counts
    assert counts["judged_ties"] == 1 and counts["judged_undecided"] == 1, counts


def test_a_stale_or_wrong_submission_is_refused_whole_naming_each_pair(tiny_model_dir, tmp_path):
    run_dir, job, waiting = labelled_round(tiny_model_dir, tmp_path)
    first, second = waiting.askings[0].question_id, waiting.askings[1].question_id
    with pytest.raises(LabelError) as refused:
        write_labels(waiting, {first: "A", "r0001-q09999": "B", second: "maybe"}, labeller=None, via="test")
    message = str(refused.value)
    assert "pairs r0001-q09999 are not asked in round 1 of run run" in message
    assert f"choices {second}='maybe' are none of A, B, tie, skip, later" in message
    assert "nothing of it was stored" in message and f"pbrl label {run_dir}" in message
    stale = {first: "not what the form showed"}  # the pair's content changed since the form was made
    with pytest.raises(LabelError, match=f"pairs {first} changed in round 1"):
        write_labels(waiting, {first: "A"}, labeller=None, via="test", shown_keys=stale)
    assert len(answer_store(RunPaths(run_dir))) == 0  # nothing of either submission was stored


def test_the_first_label_stands_and_later_leaves_a_pair_to_ask_again(tiny_model_dir, tmp_path):
    run_dir, job, waiting = labelled_round(tiny_model_dir, tmp_path)
    a, b, c = (x.question_id for x in waiting.askings[:3])
    one = write_labels(waiting, {a: "A", b: "later"}, labeller="ada", via="ui")
    two = write_labels(waiting, {a: "B", b: "B", c: "tie"}, labeller="bo", via="terminal")
    assert (one.written, one.later, two.written, two.already) == ([a], [b], [b, c], [a])
    store = answer_store(RunPaths(run_dir))
    assert (
        store.get(key_of(waiting.askings[0])).verdict == "A"
        and store.extra(key_of(waiting.askings[0]))["labeller"] == "ada"
    )
    after = waiting_for(RunPaths(run_dir), 1, job)
    assert [x.question_id for x in after.missing] == [x.question_id for x in waiting.askings[3:]]
    assert label_status(RunPaths(run_dir)) == [(1, waiting.total - 3, waiting.total, None)]
    lines = (RunPaths(run_dir).root / "judge" / "answers.jsonl").read_text().splitlines()
    assert len(lines) == 3  # a, b, c once each


def test_undo_replaces_only_the_sessions_own_label(tiny_model_dir, tmp_path):
    run_dir, job, waiting = labelled_round(tiny_model_dir, tmp_path)
    mine, theirs = new_session(), new_session()
    a, b = (x.question_id for x in waiting.askings[:2])
    write_labels(waiting, {a: "A"}, labeller="ada", via="terminal", session=mine)
    write_labels(waiting, {b: "A"}, labeller="bo", via="terminal", session=theirs)
    relabel(waiting, a, "tie", labeller="ada", via="terminal", session=mine)
    with pytest.raises(LabelError, match=f"pair {b} was labelled by bo; their label stands"):
        relabel(waiting, b, "B", labeller="ada", via="terminal", session=mine)
    store = answer_store(RunPaths(run_dir))
    assert store.get(key_of(waiting.askings[0])).verdict == "tie"
    assert store.get(key_of(waiting.askings[1])).verdict == "A"


def _label_all(run_dir: str, labeller: str, choice: str, start, done) -> None:
    from pbrl.run.folder import open_job

    job = open_job(Path(run_dir))
    waiting = waiting_for(RunPaths(run_dir), 1, job)
    start.wait()
    got = write_labels(waiting, {a.question_id: choice for a in waiting.askings}, labeller=labeller, via="test")
    done.put((labeller, got.written))


def test_two_labellers_at_once_never_duplicate_or_lose_a_label(tiny_model_dir, tmp_path):
    run_dir, job, waiting = labelled_round(tiny_model_dir, tmp_path)
    context = multiprocessing.get_context("spawn")
    start, done = context.Event(), context.Queue()
    workers = [context.Process(target=_label_all, args=(str(run_dir), name, choice, start, done))
               for name, choice in (("ada", "A"), ("bo", "B"))]  # fmt: skip
    for worker in workers:
        worker.start()
    start.set()
    written = dict(done.get(timeout=120) for _ in workers)
    for worker in workers:
        worker.join(timeout=60)
    ids = [a.question_id for a in waiting.askings]
    assert sorted(written["ada"] + written["bo"]) == sorted(ids)  # each pair written by exactly one of them
    lines = [json.loads(line) for line in (RunPaths(run_dir).root / "judge" / "answers.jsonl").read_text().splitlines()]
    assert sorted(line["question_id"] for line in lines) == sorted(ids)
    by = {line["question_id"]: (line["labeller"], line["verdict"]) for line in lines}
    assert all(by[q] == ("ada", "A") for q in written["ada"]) and all(by[q] == ("bo", "B") for q in written["bo"])


def _expire(run_dir: Path) -> None:
    path = RunPaths(run_dir).round_dir(1) / "labels.json"
    record = json.loads(path.read_text())
    record["requested_at"] = (datetime.now(UTC) - timedelta(hours=3)).isoformat(timespec="seconds")
    path.write_text(json.dumps(record))


def test_past_the_deadline_fail_names_the_unlabelled_pairs_and_continue_trains_on_those_labelled(
    tiny_model_dir, tmp_path
):
    for policy in ("fail", "continue"):
        run_dir, job, waiting = labelled_round(tiny_model_dir, tmp_path / policy, judge_label_timeout_hours=2.0,
                                               judge_label_timeout_policy=policy)  # fmt: skip
        requested = datetime.fromisoformat(read_request(RunPaths(run_dir), 1)["requested_at"])
        assert waiting.deadline == requested + timedelta(hours=2) and not waiting.expired()
        write_labels(waiting, {waiting.askings[0].question_id: "A"}, labeller=None, via="test")
        _expire(run_dir)
        if policy == "fail":
            with pytest.raises(LabelError) as failed:
                run_round(run_dir, job, 1, until="judge-pairs")
            assert f"{waiting.total - 1} of {waiting.total} pairs still unlabelled" in str(failed.value)
            assert "judge_label_timeout_policy=continue" in str(failed.value)
            continue
        run_round(run_dir, job, 1, until="build-pairs")
        verdicts = read_rows(RunPaths(run_dir).verdicts(1), VERDICTS)
        assert [v["verdict"] for v in verdicts] == ["A"] + [None] * (waiting.total - 1)
        assert {v["reason"] for v in verdicts[1:]} == {
            "not labelled within judge_label_timeout_hours (judge_label_timeout_policy: continue)"
        }
        assert len(read_rows(RunPaths(run_dir).pairs(1), PAIRS)) == 1


def test_the_waiting_message_says_how_many_and_how_to_go_on(tiny_model_dir, tmp_path):
    run_dir, job, waiting = labelled_round(tiny_model_dir, tmp_path)
    n = waiting.total
    assert str(labels_needed(waiting)) == (
        f"run run round 1: waiting for {n} labels (of {n} pairs): label in the UI (the deployment "
        f"pbrl-train/continue with run_name run) or with `pbrl label {run_dir}`, then resume "
        f"(`pbrl train --run {run_dir} --resume`)"
    )


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"judge": "reward_noisy", "judge_label_batch_size": 3}, "judge_label_batch_size"),
        ({"judge_position_swap": True}, "judge_position_swap"),
        ({"judge_label_timeout_policy": "continue"}, "judge_label_timeout_policy"),
        ({"judge_pair_choice": "uncertain"}, "judge_pair_choice"),
    ],
)
def test_labelling_options_out_of_place_are_refused_naming_the_field(tiny_model_dir, tmp_path, overrides, field):
    with pytest.raises(ConfigError, match=field):
        tiny_job(tiny_model_dir, tmp_path, **{**HUMAN, **overrides})


def test_least_sure_asks_the_smallest_margins_a_missing_margin_first_ties_drawn():
    import numpy as np

    from pbrl.preference.questions import least_sure

    rng = np.random.default_rng(0)
    # |margins| 2.0, 0.1, None, 0.5, 0.1, 3.0: budget 3 asks None (cannot tell), then the two 0.1s
    assert least_sure([2.0, -0.1, None, 0.5, 0.1, -3.0], 3, rng) == [False, True, True, False, True, False]
    # two equal margins for one place: either may be asked, as the draw says, and exactly one is
    picks = {tuple(least_sure([0.2, -0.2, 1.0], 1, np.random.default_rng(s))) for s in range(20)}
    assert picks == {(True, False, False), (False, True, False)}
    assert least_sure([1.0, 2.0], None, rng) == [True, True] and least_sure([1.0, 2.0], 5, rng) == [True, True]


def test_uncertain_choice_asks_the_pairs_the_trained_policies_are_least_sure_about(tiny_model_dir, tmp_path):
    import torch

    from pbrl.learning.logprobs import sequence_logprobs
    from pbrl.models.policies import load_agent
    from pbrl.run.askings import round_askings
    from pbrl.run.pair_margins import margins_path
    from pbrl.run.policy_records import policy_checkpoint
    from pbrl.run.settings import policy_source

    judged = {"preference_source": "judge", "judge": "reward_noisy", "pair_selection": "all",
              "preference_pairs_per_sample": None, "judge_max_pairs": 3, "judge_pair_choice": "uncertain"}  # fmt: skip
    run_dir, job = new_run(tiny_model_dir, tmp_path, **judged)
    paths = RunPaths(run_dir)
    run_round(run_dir, job, 1)  # round 1: no model to ask yet, the budget is drawn at random
    assert not margins_path(paths, 1).is_file()
    run_round(run_dir, job, 2, until="judge-pairs")
    kept = json.loads(margins_path(paths, 2).read_text())
    assert kept["model"] == str(policy_checkpoint(paths, 1).relative_to(paths.root))
    margins = kept["margins"]
    assert len(margins) > 3 and any(m != 0 for m in margins)
    askings, counts = round_askings(paths, 2, job, ("writer", "editor"))
    asked = sorted({int(a.question_id.split("-q")[1]) for a in askings})
    smallest = sorted(range(len(margins)), key=lambda i: abs(margins[i]))[:3]
    assert asked == sorted(smallest) and counts["questions_by_margin"] == 3
    # one margin worked out here: β Σ_agents [log π(x) − log π_ref(x)] − [log π(y) − log π_ref(y)]
    from pbrl.data.tables import read_joint_responses

    joint = read_joint_responses(paths.candidates(2), job.num_agents)
    question = askings[0].question
    x, y = (
        joint[(askings[0].item_id, question.x.side, question.x.index)],
        joint[(askings[0].item_id, question.y.side, question.y.index)],
    )
    total = 0.0
    for agent in range(job.num_agents):
        for checkpoint, sign in ((policy_checkpoint(paths, 1), 1.0), (paths.initial, -1.0)):
            policy = load_agent(policy_source(job), agent, checkpoint, trainable=False)
            with torch.no_grad():
                lp = sequence_logprobs(policy.model, [x[agent]["prompt_ids"], y[agent]["prompt_ids"]],
                                       [x[agent]["completion_ids"], y[agent]["completion_ids"]],
                                       pad_token_id=policy.tokenizer.pad_token_id)  # fmt: skip
            total += sign * float(lp[0] - lp[1])
    assert margins[asked[0]] == pytest.approx(job.dpo_beta * total, rel=0.05)  # batched vs two rows: bf16 padding
