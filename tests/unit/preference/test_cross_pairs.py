"""``joint_mode: cross``: every combination of the agents' candidates is a joint response, and counterfactual pairs
(one agent's candidate differs) train only the agent whose choice decided the outcome
(docs/design/algorithms.md#cross-joint-responses-and-counterfactual-pairs).

The combinations, their scores and the allowed pairs are written out by hand below; the stages run on candidate
files written by hand (no sampling), the MADPO step on the tiny model. The flow test at the end runs a whole cross
run with Prefect.

Wrong versions these tests make fail:

- combinations numbered or decoded another way (agent 0 fastest, or the comparator candidates first):
  ``test_grid_numbers_every_combination_agent_0_slowest`` and the stage tests;
- an iterative pair of two target combinations, or a comparator combination that also changes a shared agent:
  ``test_iterative_cross_pairs_stay_target_vs_comparator_by_hand``;
- the guard drawing with replacement, from another seed, or unsorted: ``test_the_guard_samples_reproducibly...``;
- an agent with identical sides still stepping (AdamW moves weights with old momentum even at a zero gradient):
  ``test_counterfactual_step_leaves_the_unchanged_agent_exactly_alone``.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from itertools import product
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from pbrl.config import parse_job
from pbrl.data.replay_store import CROSS_KEYS, EXTRA_KEYS
from pbrl.data.schema import CANDIDATES, CROSS_PAIRS, CROSS_SCORES, PAIR_JOINT_IDS
from pbrl.data.seeds import numpy_rng
from pbrl.data.storage import RunPaths, read_json
from pbrl.data.tables import read_pairs, read_rows, write_table
from pbrl.errors import ArtifactError, ConfigError
from pbrl.learning.madpo import PairBatch
from pbrl.preference.pairs import (
    CandidateRef,
    CrossGrid,
    Pair,
    changed_agents,
    cross_candidate_pairs,
    cross_joint_responses,
    iterative_candidate_pairs,
)
from pbrl.preference.selection import order_counterfactual, select_pairs
from pbrl.run.folder import prepare_run
from stages import STAGE_MODULES
from tests.helpers import madpo_step, tiny_job, tiny_policies

T, C = "target", "comparator"
LENGTH_CODE = "tests.unit.preference.test_cross_pairs:length_code"
CALLS_ENV = "PBRL_TEST_CROSS_CALLS"  # a file: the batch size of every length_code call, one per line (the reward runs
# in a worker process forked by the stage, pbrl.preference.reward_worker, so it cannot append to a list here)
RNG = np.random.default_rng(0)  # orderings other than 'random' never draw from it


def length_code(*completions: Sequence[str], batch_items: Sequence[dict] | None = None) -> list[float]:
    """A reward that names its joint response: agent i's completion length is decimal digit i, so
    ("a", "bbbb") scores 14 and ("a", "bb", "ccc") scores 123. One call per batch (recorded in ``$CALLS_ENV``)."""
    if log := os.environ.get(CALLS_ENV):
        with open(log, "a") as f:
            f.write(f"{len(completions[0])}\n")
    joint = zip(*completions, strict=True)
    return [float(sum(len(t) * 10 ** (len(texts) - 1 - i) for i, t in enumerate(texts))) for texts in joint]


def base_job(model_dir: Path, output_dir: Path, **overrides: Any):
    """A ``madpo`` job on the toy task (tiny_job's sizes, without the iterative options)."""
    data: dict[str, Any] = {
        "trainer": "madpo",
        "task": "toy",
        "task_options": {"num_items": 2},
        "agent_model": str(model_dir),
        "run_name": "run",
        "output_dir": str(output_dir),
        "preference_num_candidates": 2,
        "preference_pairs_per_sample": None,
        "pair_selection": "all",
        "max_new_tokens": 8,
        "eval_num_samples": 2,
        "train_batch_size": 2,
        "joint_mode": "cross",
        "reward_func": LENGTH_CODE,
    }
    data.update(overrides)
    return parse_job(data)


def write_candidates(paths: RunPaths, texts: dict[tuple[str, str], list[list[str]]]) -> None:
    """Round 1's candidates.parquet by hand: ``texts[(item, side)][k][i]`` is agent i's candidate k. Token ids are
    the characters' codes (so they differ exactly when the texts do)."""
    rows = []
    for (item, side), candidates in texts.items():
        for k, per_agent in enumerate(candidates):
            for i, text in enumerate(per_agent):
                rows.append(
                    {
                        "item_id": item,
                        "side": side,
                        "candidate_index": k,
                        "agent_index": i,
                        "prompt": f"agent {i} on {item}",
                        "prompt_ids": [2, 10 + i, 3],
                        "completion": text,
                        "completion_ids": [ord(c) for c in text],
                        "finish_reason": "length",
                        "stop_token_id": None,
                        "seed": 0,
                        "ids_source": "generated",
                    }
                )
    write_table(paths.candidates(1), rows, CANDIDATES)


def run_stages(run_dir: Path, job, names: Sequence[str]) -> dict:
    return {n: STAGE_MODULES[n].run(run_dir, 1, job) for n in names}


# ---------------------------------------------------------------------------------------------- combinations
def test_grid_numbers_every_combination_agent_0_slowest():
    grid = CrossGrid.of([0, 1, 2], num_agents=2)
    assert grid.size == 9
    # By hand: m = 3 * pos_0 + pos_1.
    assert [grid.ref(m).agents for m in range(9)] == [((T, a), (T, b)) for a in range(3) for b in range(3)]
    assert [grid.ref(4 * j).agents for j in range(3)] == [((T, j), (T, j)) for j in range(3)]  # aligned j = 4j
    three = CrossGrid.of([0, 1], [0], num_agents=3)  # choices T0, T1, C0: 27 combinations, m = 9 p0 + 3 p1 + p2
    assert three.size == 27
    assert three.ref(5) == CandidateRef(C, 5, ((T, 0), (T, 1), (C, 0)))
    assert three.ref(13) == CandidateRef(T, 13, ((T, 1), (T, 1), (T, 1)))
    assert all(three.number(three.ref(m).agents) == m for m in range(27))
    with pytest.raises(ValueError, match="outside the grid"):
        three.ref(27)


def test_two_agents_every_combination_scored_by_hand(tiny_model_dir, tmp_path, monkeypatch):
    job = base_job(tiny_model_dir, tmp_path, preference_num_candidates=3)
    run_dir = prepare_run(job, resume=False)
    paths = RunPaths(run_dir)
    lengths = {"toy-000": ([1, 2, 3], [4, 5, 6]), "toy-001": ([7, 8, 9], [1, 1, 2])}
    write_candidates(
        paths,
        {(item, T): [["a" * l0[k], "b" * l1[k]] for k in range(3)] for item, (l0, l1) in lengths.items()},
    )
    monkeypatch.setenv(CALLS_ENV, str(tmp_path / "calls"))
    manifest = run_stages(run_dir, job, ["score-with-oracle"])["score-with-oracle"]
    rows = read_rows(paths.scores(1), CROSS_SCORES)
    # By hand: 3^2 = 9 combinations per item, numbered 3 a + b, scored 10 * len(agent 0's) + len(agent 1's).
    expected = [
        (item, 3 * a + b, [a, b], 10.0 * l0[a] + l1[b])
        for item, (l0, l1) in lengths.items()
        for a, b in product(range(3), repeat=2)
    ]
    assert [(r["item_id"], r["candidate_index"], r["candidate_indices"], r["reward"]) for r in rows] == expected
    assert expected[:4] == [("toy-000", 0, [0, 0], 14.0), ("toy-000", 1, [0, 1], 15.0), ("toy-000", 2, [0, 2], 16.0),
                            ("toy-000", 3, [1, 0], 24.0)]  # fmt: skip
    assert all(r["side"] == T and r["candidate_sides"] == [T, T] and r["raw_reward"] == r["reward"] for r in rows)
    assert (tmp_path / "calls").read_text().split() == ["18"]  # one batched call, one entry per joint response
    assert manifest.counts == {"joint_responses": 18, "failed": 0, "joint_combinations": 18, "items_capped": 0}
    assert manifest.details["joint_mode"] == "cross" and manifest.details["max_joint_responses_per_item"] == 256


def test_three_agents_every_combination_scored_by_hand(tiny_model_dir, tmp_path):
    job = base_job(tiny_model_dir, tmp_path, num_agents=3, task_options={"num_items": 1, "num_agents": 3})
    run_dir = prepare_run(job, resume=False)
    paths = RunPaths(run_dir)
    l0, l1, l2 = [1, 2], [3, 4], [5, 6]
    write_candidates(paths, {("toy-000", T): [["a" * l0[k], "b" * l1[k], "c" * l2[k]] for k in range(2)]})
    run_stages(run_dir, job, ["score-with-oracle"])
    rows = read_rows(paths.scores(1), CROSS_SCORES)
    # By hand: 2^3 = 8 combinations, m = 4 a + 2 b + c, scored 100 l0 + 10 l1 + l2:
    # 135 136 145 146 235 236 245 246.
    assert [r["candidate_indices"] for r in rows] == [[a, b, c] for a, b, c in product(range(2), repeat=3)]
    assert [r["candidate_index"] for r in rows] == list(range(8))
    assert [r["reward"] for r in rows] == [135.0, 136.0, 145.0, 146.0, 235.0, 236.0, 245.0, 246.0]


def test_iterative_cross_scores_target_and_comparator_choices(tiny_model_dir, tmp_path):
    run_dir, job = new_iter_run(tiny_model_dir, tmp_path)
    paths = RunPaths(run_dir)
    rows = read_rows(paths.scores(1), CROSS_SCORES)
    # Choices per agent: T0, T1, C0, so 9 combinations per item; a combination is on the target side only when
    # both agents' candidates are target ones (4 of 9).
    assert len(rows) == 2 * 9
    first = [(r["candidate_sides"], r["candidate_indices"], r["side"], r["reward"]) for r in rows[:9]]
    assert first == [
        ([T, T], [0, 0], T, 13.0),
        ([T, T], [0, 1], T, 14.0),
        ([T, C], [0, 0], C, 15.0),
        ([T, T], [1, 0], T, 23.0),
        ([T, T], [1, 1], T, 24.0),
        ([T, C], [1, 0], C, 25.0),
        ([C, T], [0, 0], C, 33.0),
        ([C, T], [0, 1], C, 34.0),
        ([C, C], [0, 0], C, 35.0),
    ]


ITER_TEXTS = {
    # target: agent 0 lengths 1, 2; agent 1 lengths 3, 4. comparator: agent 0 length 3, agent 1 length 5.
    (item, side): cands
    for item in ("toy-000", "toy-001")
    for side, cands in ((T, [["a", "bbb"], ["aa", "bbbb"]]), (C, [["xxx", "yyyyy"]]))
}


def new_iter_run(model_dir: Path, tmp_path: Path, **overrides: Any):
    job = tiny_job(
        model_dir,
        tmp_path,
        task_options={"num_items": 2},
        preference_num_candidates=2,
        comparator_num_candidates=1,
        joint_mode="cross",
        reward_func=LENGTH_CODE,
        **overrides,
    )
    run_dir = prepare_run(job, resume=False)
    write_candidates(RunPaths(run_dir), ITER_TEXTS)
    run_stages(run_dir, job, ["score-with-oracle"])
    return run_dir, job


# ---------------------------------------------------------------------------------------------- pairs
def _refs(grid: CrossGrid, scores: dict[tuple, float]) -> dict[CandidateRef, float]:
    return {grid.ref(grid.number(agents)): s for agents, s in scores.items()}


def test_base_cross_pairs_are_every_untied_pair_of_combinations():
    grid = CrossGrid.of([0, 1], num_agents=2)
    scores = {((T, 0), (T, 0)): 1.0, ((T, 0), (T, 1)): 3.0, ((T, 1), (T, 0)): 3.0, ((T, 1), (T, 1)): 0.5}
    pairs = cross_candidate_pairs(_refs(grid, scores), iterative=False, tie_tolerance=1e-9)
    # By hand, numbers 0..3 scored 1, 3, 3, .5: every pair but {1, 2} (a tie), as (winner, loser, changed agents).
    assert [(p.winner.index, p.loser.index, changed_agents(p)) for p in pairs] == [
        (0, 3, (0, 1)),
        (1, 0, (1,)),
        (1, 3, (0,)),
        (2, 0, (0,)),
        (2, 3, (1,)),
    ]


def test_iterative_cross_pairs_stay_target_vs_comparator_by_hand():
    grid = CrossGrid.of([0, 1], [0], num_agents=2)
    refs = {grid.ref(m): float(m) for m in range(grid.size)}  # distinct scores: no ties
    pairs = cross_candidate_pairs(refs, iterative=True, tie_tolerance=1e-9)
    got = {frozenset((p.winner.agents, p.loser.agents)) for p in pairs}
    # By hand: y = x with a non-empty set of agents switched to the comparator candidate C0.
    targets = [((T, a), (T, b)) for a in range(2) for b in range(2)]
    expected = set()
    for x in targets:
        for switched in ((0,), (1,), (0, 1)):
            y = tuple((C, 0) if i in switched else x[i] for i in range(2))
            expected.add(frozenset((x, y)))
    assert got == expected and len(pairs) == 4 * 3
    for p in pairs:
        target, comparator = (p.winner, p.loser) if p.winner.side == T else (p.loser, p.winner)
        assert target.side == T and comparator.side == C
        for i in changed_agents(p):  # every changed agent: a target candidate against a comparator candidate
            assert target.agents[i][0] == T and comparator.agents[i][0] == C


def test_counterfactual_order_takes_the_agents_in_turn():
    grid = CrossGrid.of([0, 1, 2], num_agents=2)

    def pair(w, lo, gap) -> Pair:
        return Pair(grid.ref(grid.number(w)), grid.ref(grid.number(lo)), 1.0 + gap, 1.0)

    a0_big = pair(((T, 1), (T, 0)), ((T, 0), (T, 0)), 0.5)
    a0_small = pair(((T, 2), (T, 0)), ((T, 0), (T, 0)), 0.25)
    a1 = pair(((T, 0), (T, 1)), ((T, 0), (T, 0)), 0.75)
    both = pair(((T, 1), (T, 1)), ((T, 0), (T, 0)), 1.0)
    # By hand (the docstring's example): agent 0's .5, agent 1's .75, agent 0's .25, then the two-agent pair.
    ordered = order_counterfactual([both, a1, a0_small, a0_big], np.random.default_rng(0))
    assert ordered == [a0_big, a1, a0_small, both]
    kept = select_pairs([both, a1, a0_small, a0_big], pair_selection="counterfactual", pairs_per_sample=2, rng=RNG)
    assert kept == [a0_big, a1]  # the cap spreads over the agents instead of taking agent 0's two first
    aligned = iterative_candidate_pairs({0: 1.0}, {0: 0.0}, tie_tolerance=1e-9)
    with pytest.raises(ValueError, match="not a pair of cross joint responses"):
        select_pairs(aligned, pair_selection="counterfactual", pairs_per_sample=None, rng=RNG)


def test_the_guard_samples_reproducibly_without_replacement_with_the_run_seed(tiny_model_dir, tmp_path):
    grid = CrossGrid.of(range(4), [0, 1], num_agents=3)  # 216 combinations
    draw = cross_joint_responses(grid, max_per_item=20, rng=numpy_rng(7, round_index=1, stage="s", item="i"))
    again = cross_joint_responses(grid, max_per_item=20, rng=numpy_rng(7, round_index=1, stage="s", item="i"))
    other = cross_joint_responses(grid, max_per_item=20, rng=numpy_rng(7, round_index=1, stage="s", item="j"))
    numbers = [r.index for r in draw]
    assert draw == again and numbers != [r.index for r in other]
    assert numbers == sorted(set(numbers)) and len(numbers) == 20  # without replacement, in number order
    expected = sorted(numpy_rng(7, round_index=1, stage="s", item="i").choice(216, size=20, replace=False).tolist())
    assert numbers == expected
    assert len(cross_joint_responses(grid, max_per_item=216, rng=np.random.default_rng(0))) == 216  # all, no draw

    # Through the stage: the run seed, round and item seed the draw; a rerun writes the same bytes.
    job = base_job(tiny_model_dir, tmp_path, preference_num_candidates=3, max_joint_responses_per_item=4, seed=11)
    run_dir = prepare_run(job, resume=False)
    paths = RunPaths(run_dir)
    write_candidates(
        paths, {(item, T): [["a" * (k + 1), "b" * (k + 2)] for k in range(3)] for item in ("toy-000", "toy-001")}
    )
    manifest = run_stages(run_dir, job, ["score-with-oracle"])["score-with-oracle"]
    first = paths.scores(1).read_bytes()
    rows = read_rows(paths.scores(1), CROSS_SCORES)
    for item in ("toy-000", "toy-001"):
        rng = numpy_rng(11, round_index=1, stage="score-with-oracle", item=item)
        drawn = sorted(rng.choice(9, size=4, replace=False).tolist())
        assert [r["candidate_index"] for r in rows if r["item_id"] == item] == drawn
    assert manifest.counts == {"joint_responses": 8, "failed": 0, "joint_combinations": 18, "items_capped": 2}
    assert any("max_joint_responses_per_item=4" in m for m in manifest.messages)
    run_stages(run_dir, job, ["score-with-oracle"])
    assert paths.scores(1).read_bytes() == first


def test_cross_pairs_keep_candidate_ids_and_read_back_with_their_token_ids(tiny_model_dir, tmp_path):
    run_dir, job = new_iter_run(
        tiny_model_dir, tmp_path, pair_selection="counterfactual", preference_pairs_per_sample=3
    )
    paths = RunPaths(run_dir)
    manifests = run_stages(run_dir, job, ["build-pairs", "store-round"])
    stored = read_rows(paths.pairs(1), CROSS_PAIRS)
    # On disk: no token ids, each agent's candidate on both sides instead.
    assert all(r["prompt_ids"] is None and r["winner_ids"] is None and r["loser_ids"] is None for r in stored)
    meta = json.loads(pq.read_schema(paths.pairs(1)).metadata[b"pbrl.candidates"])
    assert meta["file"] == "candidates.parquet"
    # By hand for toy-000 (scores 10 l0 + l1; numbers 3 p0 + p1 over the choices T0, T1, C0): agent 0's
    # counterfactual pairs are (C0,T0)=33 > (T0,T0)=13 and (C0,T1)=34 > (T0,T1)=14 (gap 20), then gap 10 twice;
    # agent 1's are (T0,C0)=15 > (T0,T0)=13 and (T1,C0)=25 > (T1,T0)=23 (gap 2), then gap 1 twice. In turn, each by
    # largest gap (equal gaps in number order), capped at 3: agent 0's first, agent 1's first, agent 0's second.
    item0 = [r for r in stored if r["item_id"] == "toy-000"]
    assert [
        (r["winner_candidate_sides"], r["winner_candidate_indices"], r["loser_candidate_indices"], r["changed_agents"])
        for r in item0
    ] == [([C, T], [0, 0], [0, 0], [0]), ([T, C], [0, 0], [0, 0], [1]), ([C, T], [0, 1], [0, 1], [0])]
    assert all(r["loser_candidate_sides"] == [T, T] for r in item0)
    assert [r["winner_reward"] - r["loser_reward"] for r in item0] == [20.0, 2.0, 20.0]
    assert manifests["build-pairs"].counts["counterfactual_pairs"] == 6
    # Read back: every agent's exact token ids, from the candidate rows each names; prompts the target side's.
    cands = {
        (c["item_id"], c["side"], c["candidate_index"], c["agent_index"]): c
        for c in read_rows(paths.candidates(1), CANDIDATES)
    }
    for r in read_pairs(paths.pairs(1)):
        for i in range(2):
            w = cands[(r["item_id"], r["winner_candidate_sides"][i], r["winner_candidate_indices"][i], i)]
            lo = cands[(r["item_id"], r["loser_candidate_sides"][i], r["loser_candidate_indices"][i], i)]
            assert r["winner_ids"][i] == w["completion_ids"] and r["loser_ids"][i] == lo["completion_ids"]
            assert r["winner_completions"][i] == w["completion"] and r["prompt_ids"][i] == [2, 10 + i, 3]
            assert (r["winner_ids"][i] == r["loser_ids"][i]) == (i not in r["changed_agents"])
    # The replay file: the reference's keys first, pbrl's, then each agent's candidates.
    record = read_json(paths.root / "replay" / "iteration_0001.json")["pairs"][0]
    assert list(record)[-len(CROSS_KEYS) - len(EXTRA_KEYS) :] == [*EXTRA_KEYS, *CROSS_KEYS]
    assert record["winner_candidate_sides"] == [C, T] and record["changed_agents"] == [0]
    # A changed candidates file is refused, never read with the wrong ids.
    table = pq.read_table(paths.candidates(1))
    pq.write_table(table.slice(1), paths.candidates(1))
    with pytest.raises(ArtifactError, match="changed since the pairs were built"):
        read_pairs(paths.pairs(1))


def test_marlhf_cross_pairs_give_the_reward_model_their_joint_ids(tiny_model_dir, tmp_path):
    from pbrl.learning.joint_template import joint_template_for, pair_joint_rows
    from pbrl.run.settings import policy_source

    job = base_job(tiny_model_dir, tmp_path, trainer="marlhf", preference_num_candidates=2)
    run_dir = prepare_run(job, resume=False)
    paths = RunPaths(run_dir)
    write_candidates(paths, {(item, T): [["a", "bbbb"], ["aa", "bbb"]] for item in ("toy-000", "toy-001")})
    run_stages(run_dir, job, ["score-with-oracle", "build-pairs"])
    pairs = read_pairs(paths.pairs(1))
    assert len(pairs) == 2 * 6  # 4 combinations scored 14 13 24 23: every pair of them
    source = policy_source(job)
    template, _ = joint_template_for(source.models[0], source.models)
    stored = read_rows(paths.round_dir(1) / "pair_joint_ids.parquet", PAIR_JOINT_IDS)
    assert stored == pair_joint_rows(pairs, template, job.reward_max_length)


# ---------------------------------------------------------------------------------------------- MADPO
PROMPT = [2, 40, 41, 3, 2, 50]
Y = {"a": [70, 71, 3], "b": [80, 81, 82, 3], "c": [90, 3], "d": [100, 101, 3]}


def snapshot(policy) -> tuple[dict[str, torch.Tensor], dict]:
    params = {n: p.detach().clone() for n, p in policy.model.named_parameters()}
    state = {
        k: {n: v.clone() if torch.is_tensor(v) else v for n, v in st.items()}
        for k, st in policy.optimizer.state.items()
    }
    return params, state


def same(a: tuple[dict, dict], b: tuple[dict, dict]) -> bool:
    (pa, sa), (pb, sb) = a, b
    return (
        all(torch.equal(pa[n], pb[n]) for n in pa)
        and sa.keys() == sb.keys()
        and all(
            all(torch.equal(v, sb[k][n]) if torch.is_tensor(v) else v == sb[k][n] for n, v in st.items())
            for k, st in sa.items()
        )
    )


def test_counterfactual_step_leaves_the_unchanged_agent_exactly_alone(tiny_model_dir):
    agents = tiny_policies(tiny_model_dir, lr=1e-2)
    # An ordinary step first, so that both agents have AdamW momentum (which would move them at a zero gradient).
    first = madpo_step(
        agents,
        PairBatch([[PROMPT], [PROMPT]], [[Y["a"]], [Y["c"]]], [[Y["b"]], [Y["d"]]]),
        beta=0.1,
        max_grad_norm=1.0,
    )
    assert first.idle == (False, False)
    before = [snapshot(p) for p in agents]

    def no_forward(*args, **kwargs):
        raise AssertionError("agent 1's sides are identical: it must not run a forward pass")

    agents[1].model.forward = no_forward
    # Two counterfactual pairs that change agent 0 only: agent 1 writes "c" on both sides of both.
    batch = PairBatch(
        prompt_ids=[[PROMPT, PROMPT], [PROMPT, PROMPT]],
        winner_ids=[[Y["a"], Y["b"]], [Y["c"], Y["c"]]],
        loser_ids=[[Y["b"], Y["a"]], [Y["c"], Y["c"]]],
    )
    stats = madpo_step(agents, batch, beta=0.1, max_grad_norm=1.0)
    assert stats.idle == (False, True) and stats.skipped == (False, False)
    assert torch.equal(stats.margins[:, 1], torch.zeros(2))  # exactly 0, not merely small
    assert same(snapshot(agents[1]), before[1])  # weights and AdamW state (step counts included) untouched
    assert not same(snapshot(agents[0]), before[0])
    # The joint loss is agent 0's margins alone: -log σ(β Δ_0) per pair.
    expected = sum(-math.log(1 / (1 + math.exp(-0.1 * float(m)))) for m in stats.margins[:, 0]) / 2
    assert stats.loss == pytest.approx(expected, rel=1e-6)


def test_a_pair_identical_for_an_agent_costs_it_nothing_within_a_mixed_batch(tiny_model_dir):
    agents = tiny_policies(tiny_model_dir, lr=1e-2)
    # Pair 0 changes agent 0 only, pair 1 agent 1 only: each agent steps on its own pair, and its margin on the
    # other pair is exactly 0.
    batch = PairBatch(
        prompt_ids=[[PROMPT, PROMPT], [PROMPT, PROMPT]],
        winner_ids=[[Y["a"], Y["a"]], [Y["c"], Y["c"]]],
        loser_ids=[[Y["b"], Y["a"]], [Y["c"], Y["d"]]],
    )
    stats = madpo_step(agents, batch, beta=0.1, max_grad_norm=1.0)
    assert stats.idle == (False, False)
    assert stats.margins[1, 0] == 0.0 and stats.margins[0, 1] == 0.0
    assert stats.margins[0, 0] != 0.0 and stats.margins[1, 1] != 0.0


# ---------------------------------------------------------------------------------------------- options
@pytest.mark.parametrize("trainer", ["madpo", "madpo_iter", "marlhf", "marlhf_iter"])
def test_cross_is_an_option_of_every_trainer(trainer):
    data = {"trainer": trainer, "task": "toy", "agent_model": "some/path", "joint_mode": "cross"}
    job = parse_job({**data, "pair_selection": "counterfactual", "max_joint_responses_per_item": 64})
    assert (job.joint_mode, job.max_joint_responses_per_item) == ("cross", 64)


@pytest.mark.parametrize(
    ("extra", "field", "words"),
    [
        ({"pair_selection": "counterfactual"}, "pair_selection", "needs joint_mode='cross'"),
        (
            {"joint_mode": "cross", "collaboration_mode": "centralized"},
            "joint_mode",
            "collaboration_mode='decentralized'",
        ),
        ({"joint_mode": "cross", "num_agents": 6}, "joint_mode", "40 candidates per agent and 6 agents"),
        ({"joint_mode": "cross", "max_joint_responses_per_item": 1}, "max_joint_responses_per_item", ">= 2"),
        ({"joint_mode": "cross", "max_joint_responses_per_item": None}, "max_joint_responses_per_item", "int"),
    ],
)
def test_cross_options_are_refused_outside_their_setting(extra, field, words):
    with pytest.raises(ConfigError) as info:
        parse_job({"trainer": "madpo_iter", "task": "toy", "agent_model": "some/path", **extra})
    assert [p.field for p in info.value.problems] == [field] and words in str(info.value)


# ---------------------------------------------------------------------------------------------- the flow
@pytest.mark.flow
@pytest.mark.usefixtures("prefect_api")
def test_a_cross_run_resumes_bitwise_and_reruns_fully_cached(tiny_model_dir, tmp_path):
    from pbrl import orchestration
    from tests.helpers import assert_same_artifacts, run_artifacts

    def job(name: str, rounds: int):
        return tiny_job(
            tiny_model_dir,
            tmp_path,
            run_name=name,
            num_iterations=rounds,
            joint_mode="cross",
            pair_selection="counterfactual",
            max_joint_responses_per_item=24,  # of 36 combinations per item: the guard draws
        )

    orchestration.train(job("fresh", 2))
    orchestration.train(job("resumed", 1))
    out = orchestration.train(job("resumed", 2), resume=True)
    assert {s["round"] for s in out["stages"] if s["state"] != "Cached"} == {2}
    fresh, resumed = tmp_path / "fresh", tmp_path / "resumed"
    assert_same_artifacts(run_artifacts(resumed, trainer_state=True), run_artifacts(fresh, trainer_state=True))
    paths = RunPaths(resumed)
    assert read_json(paths.manifest(1, "score-with-oracle"))["counts"]["items_capped"] == 4
    assert read_json(paths.manifest(1, "build-pairs"))["counts"]["counterfactual_pairs"] > 0

    again = orchestration.train(job("resumed", 2), resume=True)
    assert again["stages"] and all(s["state"] == "Cached" for s in again["stages"])
    # A lost pairs file is rebuilt byte for byte (the candidates' hash included), so nothing after it reruns.
    before = paths.pairs(2).read_bytes()
    paths.pairs(2).unlink()
    rebuilt = orchestration.train(job("resumed", 2), resume=True)
    assert {(s["round"], s["stage"]) for s in rebuilt["stages"] if s["state"] != "Cached"} == {(2, "build-pairs")}
    assert paths.pairs(2).read_bytes() == before


# ---------------------------------------------------------------------------------------------- the benchmark
def test_the_learning_benchmark_compares_the_modes_at_equal_steps():
    import importlib
    import sys

    from pbrl.config import load_job

    benchmarks = str(Path(__file__).resolve().parents[3] / "benchmarks")
    sys.path.insert(0, benchmarks)  # the benchmark scripts import their helper module `benchkit`
    try:
        learning = importlib.import_module("learning")
    finally:
        sys.path.remove(benchmarks)
    sizes = ["agent_model=some/path", "task_options={num_train_items: 4, num_eval_items: 4}"]
    equal = learning.equal_steps_overrides(load_job(learning.CONFIG, sizes))
    # 4 training items x 2 pairs per item (the demo's) = 8 draws per round in either mode.
    assert equal == ["preference_replay_mode=nearest_k", "preference_replay_k=1", "preference_replay_sample_size=8"]
    job = load_job(learning.CONFIG, [*sizes, *equal, *learning.joint_mode_overrides("cross")])
    assert (job.joint_mode, job.pair_selection, job.preference_replay_sample_size) == ("cross", "counterfactual", 8)
    # Aligned is spelled out whatever the config's own mode (the demo's is cross); no mode keeps the config's.
    job = load_job(learning.CONFIG, [*sizes, *equal, *learning.joint_mode_overrides("aligned")])
    assert (job.joint_mode, job.pair_selection) == ("aligned", "comparator_reward")
    assert learning.joint_mode_overrides(None) == []

    def seed(gains: list[float], cpu: list[float]) -> dict:
        return {"rounds": [{"round": 0}] + [
            {"round": r + 1, "eval/paired_diff_mean": g, "gain_per_cpu_minute": g / c, "optimizer_steps": 4}
            for r, (g, c) in enumerate(zip(gains, cpu, strict=True))
        ]}  # fmt: skip

    results = {
        "aligned": [seed([0.1, 0.2], [2.0, 4.0]), seed([0.3, 0.2], [2.0, 4.0])],
        "cross": [seed([0.2, 0.4], [2.0, 4.0]), seed([0.2, 0.2], [2.0, 4.0])],
    }
    summary = learning.compare_summary(results, rounds=2)
    # By hand, round 2: aligned gains per CPU-minute .05 and .05 (mean .05), cross .1 and .05 (mean .075): 1.5.
    assert summary[1]["aligned/gain_per_cpu_minute"] == pytest.approx(0.05)
    assert summary[1]["cross_over_aligned_gain_per_cpu_minute"] == pytest.approx(1.5)
    assert (
        summary[0]["cross/eval/paired_diff_mean"] == pytest.approx(0.2) and summary[0]["aligned/optimizer_steps"] == 4
    )
