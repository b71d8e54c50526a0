"""Configured options pinned through the stages that use them, on the tiny model and the toy task (no Prefect).

Wrong versions these tests make fail (re-check by applying each to a copy of the repository):

3. build-pairs ignores the configured ``tie_tolerance`` (``tie_tolerance=1e-9`` in ``stages/build_pairs.py``,
   in the iterative or the base branch): ``test_build_pairs_applies_the_configured_tie_tolerance`` or
   ``test_base_trainer_build_pairs_applies_the_configured_tie_tolerance`` fails.
4. update-policies never restores the optimizer state of the previous round's checkpoint (every round starts
   a fresh AdamW; e.g. ``optimizer.load_state_dict(...)`` skipped in ``pbrl.models.policies.trainable_policy``):
   ``test_second_round_continues_adamw_from_the_first_rounds_state`` fails.
6a. build-pairs keeps pairs with an empty completion (``usable = candidates``):
   ``test_build_pairs_rejects_every_pair_with_an_empty_or_blank_completion`` fails.
6b. the ``history`` comparator samples the current weights instead of C_max(0, r-1-k)
   (``round_index - 1`` for ``history`` in ``compared_round``, ``pbrl/generation/comparator_factory.py``):
   ``test_comparators_sample_the_checkpoint_they_name`` fails.
6c. the pair record's rewards or ``candidate_reward_mean`` taken from raw instead of processed scores, or the
   mean over one side only: ``test_reward_processor_orders_pairs_and_fills_the_pair_record`` fails.

Expectations are worked out in the tests from the stored scores (by hand: gaps, means, an affine processor),
from a brute-force log-prob reference, or from a configuration that must agree (STYLE 15).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from pbrl.data.schema import CANDIDATES, PAIRS, SCORES, SELECTED_PAIRS
from pbrl.data.seeds import numpy_rng
from pbrl.data.storage import RunPaths
from pbrl.data.tables import read_rows, write_table
from pbrl.learning.madpo import PairBatch
from pbrl.models.policies import TrainablePolicy
from stages import STAGE_MODULES
from stages.update_policies import item_grouped_order
from tests.helpers import madpo_step, new_run

COLLECT = ["sample-candidates", "score-with-oracle", "build-pairs", "store-round"]
LEARN = ["replay-select", "update-policies"]


def affine_processor(raw: float) -> float:
    """A decreasing reward_processor (importable as ``tests.pinned.test_stages:affine_processor``)."""
    return 10.0 - 3.0 * raw


def run_stages(run_dir, job, names, round_index=1):
    return {n: STAGE_MODULES[n].run(run_dir, round_index, job) for n in names}


def index_gaps(scores: list[dict]) -> dict[tuple[str, int], float]:
    """(item, candidate index) -> target reward − comparator reward, for indices scored on both sides."""
    by = {(s["item_id"], s["side"], s["candidate_index"]): s["reward"] for s in scores if s["failure"] is None}
    return {
        (i, k): by[(i, "target", k)] - by[(i, "comparator", k)]
        for (i, side, k) in by
        if side == "target" and (i, "comparator", k) in by
    }


@pytest.fixture(scope="module")
def scored(tiny_model_dir, tmp_path_factory):
    """Round 1 sampled and scored, every pair kept (``all``), 4 candidates per side."""
    run_dir, job = new_run(
        tiny_model_dir,
        tmp_path_factory.mktemp("runs"),
        pair_selection="all",
        preference_pairs_per_sample=None,
        preference_num_candidates=4,
    )
    run_stages(run_dir, job, ["sample-candidates", "score-with-oracle"])
    return run_dir, job


def test_build_pairs_applies_the_configured_tie_tolerance(scored):
    run_dir, job = scored
    paths = RunPaths(run_dir)
    gaps = index_gaps(read_rows(paths.scores(1), SCORES))
    sizes = sorted(abs(g) for g in gaps.values() if g != 0)
    assert len(sizes) >= 4
    tolerance = (sizes[len(sizes) // 2 - 1] + sizes[len(sizes) // 2]) / 2  # between two gaps: half tie, half not
    expected = {k for k, g in gaps.items() if abs(g) > tolerance}
    assert 0 < len(expected) < len([g for g in gaps.values() if g != 0])  # the tolerance changes the outcome

    manifest = STAGE_MODULES["build-pairs"].run(run_dir, 1, job.model_copy(update={"tie_tolerance": tolerance}))
    pairs = read_rows(paths.pairs(1), PAIRS)
    assert {(p["item_id"], p["winner_index"]) for p in pairs} == expected
    assert manifest.counts["pairs"] == len(expected)
    for p in pairs:
        assert p["winner_reward"] - p["loser_reward"] > tolerance
        assert p["winner_side"] == ("target" if gaps[(p["item_id"], p["winner_index"])] > 0 else "comparator")

    # The default tolerance (1e-9) keeps every index whose scores differ.
    STAGE_MODULES["build-pairs"].run(run_dir, 1, job)
    assert len(read_rows(paths.pairs(1), PAIRS)) == len([g for g in gaps.values() if abs(g) > 1e-9])


def test_base_trainer_build_pairs_applies_the_configured_tie_tolerance(tiny_model_dir, tmp_path):
    """Base trainers pair an item's own target candidates: every unordered pair whose gap exceeds the tolerance."""
    from pbrl.config import parse_job
    from pbrl.run.folder import prepare_run

    job = parse_job(
        {
            "trainer": "madpo",
            "task": "toy",
            "task_options": {"num_items": 4},
            "agent_model": str(tiny_model_dir),
            "run_name": "base",
            "output_dir": str(tmp_path),
            "preference_num_candidates": 4,
            "pair_selection": "all",
            "preference_pairs_per_sample": None,
            "max_new_tokens": 8,
            "temperature": 1.0,
            "top_p": 1.0,
        }
    )
    run_dir = prepare_run(job, resume=False)
    run_stages(run_dir, job, ["sample-candidates", "score-with-oracle"])
    paths = RunPaths(run_dir)
    by_item: dict[str, dict[int, float]] = {}
    for s in read_rows(paths.scores(1), SCORES):
        assert s["side"] == "target"
        by_item.setdefault(s["item_id"], {})[s["candidate_index"]] = s["reward"]
    gaps = {(item, i, j): abs(sc[i] - sc[j]) for item, sc in by_item.items() for i in sc for j in sc if i < j}
    sizes = sorted(g for g in gaps.values() if g > 0)
    tolerance = (sizes[len(sizes) // 2 - 1] + sizes[len(sizes) // 2]) / 2
    expected = {k for k, g in gaps.items() if g > tolerance}
    assert 0 < len(expected) < len(sizes)

    STAGE_MODULES["build-pairs"].run(run_dir, 1, job.model_copy(update={"tie_tolerance": tolerance}))
    pairs = read_rows(paths.pairs(1), PAIRS)
    got = {
        (p["item_id"], min(p["winner_index"], p["loser_index"]), max(p["winner_index"], p["loser_index"]))
        for p in pairs
    }
    assert got == expected and len(pairs) == len(expected)


def test_build_pairs_rejects_every_pair_with_an_empty_or_blank_completion(scored, tmp_path):
    run_dir, job = scored
    paths = RunPaths(run_dir)
    gaps = index_gaps(read_rows(paths.scores(1), SCORES))
    decided = sorted(k for k, g in gaps.items() if abs(g) > 1e-9)
    assert len(decided) >= 3
    # Blank agent 0's target completion of the first decided index, and agent 1's comparator completion
    # (whitespace only) of the second; the scores stay as they were.
    blank = {(decided[0][0], "target", decided[0][1], 0): "", (decided[1][0], "comparator", decided[1][1], 1): " \n "}
    original = paths.candidates(1).read_bytes()
    rows = read_rows(paths.candidates(1), CANDIDATES)
    for r in rows:
        key = (r["item_id"], r["side"], r["candidate_index"], r["agent_index"])
        if key in blank:
            r["completion"] = blank[key]
    try:
        write_table(paths.candidates(1), rows, CANDIDATES)
        manifest = STAGE_MODULES["build-pairs"].run(run_dir, 1, job)
        pairs = read_rows(paths.pairs(1), PAIRS)
    finally:
        paths.candidates(1).write_bytes(original)
    assert {(p["item_id"], p["winner_index"]) for p in pairs} == set(decided[2:])
    assert manifest.counts["rejected_empty"] == 2 and manifest.counts["pairs"] == len(decided) - 2
    assert any("rejected" in m for m in manifest.messages)
    for p in pairs:
        assert all(c.strip() for c in p["winner_completions"] + p["loser_completions"])


def test_reward_processor_orders_pairs_and_fills_the_pair_record(tiny_model_dir, tmp_path):
    """Processed = 10 − 3·raw reverses the raw order: the pair's winner has the *lower* raw reward."""
    run_dir, job = new_run(
        tiny_model_dir,
        tmp_path,
        reward_processor="tests.pinned.test_stages:affine_processor",
        pair_selection="all",
        preference_pairs_per_sample=None,
        preference_num_candidates=4,
        train_batch_size=64,
    )
    manifests = run_stages(run_dir, job, COLLECT + LEARN)
    paths = RunPaths(run_dir)
    scores = read_rows(paths.scores(1), SCORES)
    raw = {(s["item_id"], s["side"], s["candidate_index"]): s["raw_reward"] for s in scores if s["failure"] is None}
    for s in scores:
        assert s["reward"] == pytest.approx(10.0 - 3.0 * s["raw_reward"], abs=1e-12)
    # Mean processed score of every candidate compared for the item: both sides, 4 + 4 candidates.
    item_mean = {}
    for item in {k[0] for k in raw}:
        values = [10.0 - 3.0 * v for k, v in raw.items() if k[0] == item]
        assert len(values) == 8
        item_mean[item] = sum(values) / len(values)

    data = json.loads((run_dir / "replay" / "iteration_0001.json").read_text())
    assert data["num_pairs"] > 0
    pairs = read_rows(paths.pairs(1), PAIRS)
    for rec, p in zip(data["pairs"], pairs, strict=True):
        raw_w = raw[(p["item_id"], p["winner_side"], p["winner_index"])]
        raw_l = raw[(p["item_id"], p["loser_side"], p["loser_index"])]
        assert raw_w < raw_l  # the processor reversed the order
        assert rec["raw_rewards"] == [raw_w, raw_l]
        assert rec["winner_reward"] == pytest.approx(10.0 - 3.0 * raw_w, abs=1e-12)
        assert rec["loser_reward"] == pytest.approx(10.0 - 3.0 * raw_l, abs=1e-12)
        assert rec["candidate_reward_mean"] == pytest.approx(item_mean[p["item_id"]], abs=1e-12)
        target_raw = raw[(p["item_id"], "target", p["winner_index"])]
        assert rec["target_raw_reward"] == target_raw
        assert rec["comparator_raw_reward"] == raw[(p["item_id"], "comparator", p["winner_index"])]
    # update-policies logs the mean candidate reward of the selected pairs (``current``: every pair of round 1).
    expected = sum(item_mean[p["item_id"]] for p in pairs) / len(pairs)
    metrics = manifests["update-policies"].metrics
    assert metrics["turn_1/reward_mean"] == pytest.approx(expected, abs=1e-12)
    assert metrics["turn_1/expected_return"] == pytest.approx(expected, abs=1e-12)


def test_comparators_sample_the_checkpoint_they_name(tiny_model_dir, tmp_path):
    """Round 2 after one update: ``current`` and ``current_copy`` sample C_1 on the comparator stream;
    ``history`` (k = 1) samples C_max(0, 2-1-1) = C_0, the initial policy.

    The reference for C_0 is a second run whose round 1 had no pairs, hence no update (its round 2 samples the
    initial policy on both sides), with the same seed: seeds depend on (seed, round, side, agent, item, index).
    """
    run_dir, job = new_run(
        tiny_model_dir, tmp_path / "a", comparator_policy="history", comparator_history_k=1, agent_learning_rate=5e-2
    )
    run_stages(run_dir, job, COLLECT + LEARN)
    paths = RunPaths(run_dir)
    assert paths.round_checkpoint(1).is_dir()

    def round_two(run, variant_job) -> dict[str, dict]:
        manifest = STAGE_MODULES["sample-candidates"].run(run, 2, variant_job)
        rows = read_rows(RunPaths(run).candidates(2), CANDIDATES)
        return {
            "manifest": manifest.details["sides"],
            **{
                side: {
                    (r["item_id"], r["candidate_index"], r["agent_index"]): r["completion_ids"]
                    for r in rows
                    if r["side"] == side
                }
                for side in ("target", "comparator")
            },
        }

    history = round_two(run_dir, job)
    current = round_two(run_dir, job.model_copy(update={"comparator_policy": "current", "comparator_history_k": None}))
    copy = round_two(
        run_dir, job.model_copy(update={"comparator_policy": "current_copy", "comparator_history_k": None})
    )
    # Every toy score lies in [0, 1], so a tie tolerance of 10 leaves round 1 without pairs or update.
    other_dir, other_job = new_run(tiny_model_dir, tmp_path / "b", comparator_policy="current", tie_tolerance=10.0)
    assert run_stages(other_dir, other_job, COLLECT + LEARN)["update-policies"].counts["pairs"] == 0
    initial = round_two(other_dir, other_job)

    # The update changed what C_1 samples (otherwise nothing below could tell C_0 from C_1).
    assert initial["target"] != current["target"]
    assert current["comparator"] != initial["comparator"]
    # history k=1 in round 2: the comparator is the initial policy; the target is C_1 as always.
    assert history["comparator"] == initial["comparator"]
    assert history["target"] == current["target"]
    assert history["manifest"] == {"target": "checkpoints/round_0001", "comparator": "checkpoints/initial"}
    # current_copy: the same weights as current (a frozen copy), on the comparator stream.
    assert copy["comparator"] == current["comparator"] and copy["target"] == current["target"]
    assert (
        copy["manifest"]
        == current["manifest"]
        == {"target": "checkpoints/round_0001", "comparator": "checkpoints/round_0001"}
    )


def _brute_margin(model, prompt: list[int], winner: list[int], loser: list[int]) -> float:
    out = 0.0
    for sign, completion in ((1.0, winner), (-1.0, loser)):
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=torch.tensor([prompt + completion])).logits[0].double(), -1)
        out += sign * sum(float(logp[len(prompt) - 1 + j, t]) for j, t in enumerate(completion))
    return out


def _load(model, tensors: dict[str, torch.Tensor]) -> None:
    result = model.load_state_dict(tensors, strict=False)
    assert not result.unexpected_keys and set(result.missing_keys) <= {"lm_head.weight"}  # tied to the embeddings


def _batch(pairs: list[dict]) -> PairBatch:
    return PairBatch(
        prompt_ids=[[p["prompt_ids"][a] for p in pairs] for a in range(2)],
        winner_ids=[[p["winner_ids"][a] for p in pairs] for a in range(2)],
        loser_ids=[[p["loser_ids"][a] for p in pairs] for a in range(2)],
    )


def _weights_after(model_dir, state_dicts, batches, lr: float, fresh_before: int | None = None):
    """Reference: per agent one model and one AdamW (weight decay 0) stepped over ``batches`` in order,
    starting from ``state_dicts`` (None: the initial model); ``fresh_before`` = index of the batch before
    which the optimizer is replaced by a fresh one."""
    agents = []
    for a in range(2):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        if state_dicts is not None:
            _load(model, state_dicts[a])
        agents.append(TrainablePolicy(model, torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0), 0))
    for n, batch in enumerate(batches):
        if n == fresh_before:
            for ag in agents:
                ag.optimizer = torch.optim.AdamW(ag.model.parameters(), lr=lr, weight_decay=0.0)
        madpo_step(agents, batch, beta=0.1, max_grad_norm=1.0)
    return [dict(ag.model.state_dict()) for ag in agents]


def test_second_round_continues_adamw_from_the_first_rounds_state(tiny_model_dir, tmp_path):
    """Each round is one full batch, so round 2's update is one step: it must equal the uninterrupted AdamW
    continuation (one optimizer over both rounds) and differ from a fresh optimizer's first step."""
    lr = 1e-2
    run_dir, job = new_run(
        tiny_model_dir,
        tmp_path,
        train_batch_size=64,
        agent_learning_rate=lr,
        num_iterations=2,
        comparator_policy="current",
    )
    paths = RunPaths(run_dir)
    manifests = {r: run_stages(run_dir, job, COLLECT + LEARN, round_index=r) for r in (1, 2)}
    rounds = []
    for r in (1, 2):
        selection = read_rows(paths.selected_pairs(r), SELECTED_PAIRS)
        pairs = read_rows(paths.pairs(r), PAIRS)
        assert [s["pair_id"] for s in selection] == [p["pair_id"] for p in pairs]  # replay "current"
        # The stage shuffles the pairs with its own seeded generator before batching.
        order = numpy_rng(job.seed, round_index=r, stage="update-policies").permutation(len(pairs))
        rounds.append([pairs[j] for j in item_grouped_order(pairs, order)])  # the stage's item-grouped order
        counts = manifests[r]["update-policies"].counts
        assert counts["steps"] == 1 and counts["pairs"] == len(pairs) > 0

    # AdamW step counters in the checkpoints: 1 after round 1, 2 after round 2 (a fresh optimizer would say 1).
    for r, expected_steps in ((1, 1), (2, 2)):
        for a in range(2):
            state = torch.load(paths.round_checkpoint(r) / f"agent_{a}" / "optimizer.pt", weights_only=True)
            assert state["state"] and {float(s["step"]) for s in state["state"].values()} == {expected_steps}
    trainer_state = json.loads((paths.round_checkpoint(2) / "trainer_state.json").read_text())
    assert trainer_state["optimizer_steps"] == 2

    stored = [load_file(paths.round_checkpoint(2) / f"agent_{a}" / "model.safetensors") for a in range(2)]
    after_one = [load_file(paths.round_checkpoint(1) / f"agent_{a}" / "model.safetensors") for a in range(2)]
    batches = [_batch(rounds[0]), _batch(rounds[1])]
    continued = _weights_after(tiny_model_dir, None, batches, lr)
    fresh = _weights_after(tiny_model_dir, after_one, batches[1:], lr, fresh_before=0)
    # The stage batches and scores the pairs its own way, so gradients agree only to rounding (~1e-7), which
    # AdamW's normalised step (lr 1e-2) turns into differences up to ~1e-4 where a gradient is near zero.
    for a in range(2):
        gap_fresh = 0.0
        for name, tensor in stored[a].items():
            assert torch.allclose(tensor, continued[a][name], atol=5e-4, rtol=0), (a, name)
            gap_fresh = max(gap_fresh, float((tensor - fresh[a][name]).abs().max()))
        assert gap_fresh > 5e-3  # a fresh optimizer's first step is a different step, ten times the tolerance

    # Metric values of round 2, from margins scored by brute force on the round-1 weights.
    models = []
    for a in range(2):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        _load(model, after_one[a])
        models.append(model)
    joint = [
        sum(_brute_margin(models[a], p["prompt_ids"][a], p["winner_ids"][a], p["loser_ids"][a]) for a in range(2))
        for p in rounds[1]
    ]
    metrics = manifests[2]["update-policies"].metrics
    assert metrics["madpo/loss"] == pytest.approx(
        sum(-math.log(1 / (1 + math.exp(-0.1 * d))) for d in joint) / len(joint), rel=1e-5
    )
    assert metrics["madpo/accuracy"] == pytest.approx(sum(d > 0 for d in joint) / len(joint), abs=1e-12)
    assert metrics["madpo/margin_mean"] == pytest.approx(sum(joint) / len(joint), rel=1e-4, abs=1e-5)
    agent_0 = [_brute_margin(models[0], p["prompt_ids"][0], p["winner_ids"][0], p["loser_ids"][0]) for p in rounds[1]]
    assert metrics["madpo/margin_agent_0"] == pytest.approx(sum(agent_0) / len(agent_0), rel=1e-4, abs=1e-5)
    assert metrics["madpo/skipped_steps"] == 0.0
