"""Stage 7, update-policies (MADPO, SPEC §5.5): ``num_train_epochs`` passes over the selected pairs.

Round r starts from the policy (and each agent's AdamW state) after round r-1 and writes
``checkpoints/round_<r>/``: per agent the weights (or LoRA adapter) and optimizer state, then
``trainer_state.json`` last. The folder is assembled under a temporary name and renamed, so a process
killed mid-update leaves no checkpoint that a later stage would read. A round without pairs writes none.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from pbrl.config import JobConfig
from pbrl.errors import ArtifactError
from pbrl.madpo import PairBatch, TrainablePolicy, madpo_step, trainable_parameters
from pbrl.models import load_optimizer_state, save_agent, save_optimizer
from pbrl.policies import TRAINER_STATE, load_agent, policy_checkpoint, read_trainer_state
from pbrl.replay_store import replay_dir, run_identity, stored_rounds
from pbrl.schema import PAIRS, SELECTED_PAIRS, read_rows
from pbrl.seeds import numpy_rng
from pbrl.stagekit import StageRecord
from pbrl.storage import RunPaths, StageManifest, atomic_dir, write_json

NAME = "update-policies"


def _source_rounds(paths: RunPaths, round_index: int) -> list[int]:
    return sorted({r["source_round"] for r in read_rows(paths.selected_pairs(round_index), SELECTED_PAIRS)})


def input_files(paths: RunPaths, round_index: int, job: JobConfig) -> list[Path]:
    return [paths.selected_pairs(round_index), *(paths.pairs(r) for r in _source_rounds(paths, round_index)),
            policy_checkpoint(paths, round_index - 1)]


def selected_pairs(paths: RunPaths, round_index: int) -> list[dict]:
    """The selected pairs in draw order, with their stored token ids (never re-tokenized)."""
    selection = read_rows(paths.selected_pairs(round_index), SELECTED_PAIRS)
    by_round: dict[int, list[dict]] = {}
    for r in sorted({s["source_round"] for s in selection}):
        by_round[r] = read_rows(paths.pairs(r), PAIRS)
    out = []
    for s in selection:
        rows = by_round[s["source_round"]]
        if not 0 <= s["pair_index"] < len(rows) or rows[s["pair_index"]]["pair_id"] != s["pair_id"]:
            raise ArtifactError(f"{paths.selected_pairs(round_index)}: pair {s['pair_id']} not found in "
                                f"{paths.pairs(s['source_round'])}")
        out.append(rows[s["pair_index"]])
    return out


def _batch(pairs: list[dict], num_agents: int) -> PairBatch:
    return PairBatch(
        prompt_ids=[[p["prompt_ids"][i] for p in pairs] for i in range(num_agents)],
        winner_ids=[[p["winner_ids"][i] for p in pairs] for i in range(num_agents)],
        loser_ids=[[p["loser_ids"][i] for p in pairs] for i in range(num_agents)],
    )


def run(run_dir: str | Path, round_index: int, job: JobConfig) -> StageManifest:
    record = StageRecord(NAME, run_dir, round_index, job)
    paths = record.paths
    pairs = selected_pairs(paths, round_index)
    start = policy_checkpoint(paths, round_index - 1)
    if not pairs:
        if job.trainer in ("madpo", "marlhf"):
            record.say("no preference pairs: every comparison tied or was rejected, so the policies were "
                       "not updated")
        else:
            record.say("no pairs selected: the policies are not updated this round")
        record.counts = {"pairs": 0, "steps": 0, "skipped_steps": 0}
        record.details = {"checkpoint": paths.rel(start), "updated": False}
        return record.finish([paths.selected_pairs(round_index), start], [])

    policies = []
    for agent in range(job.num_agents):
        policy = load_agent(job, paths, agent, start, trainable=True)
        # weight_decay=0: a pair that carries no preference signal must not move the weights (decay would).
        optimizer = torch.optim.AdamW(trainable_parameters(policy.model), lr=job.agent_learning_rate,
                                      weight_decay=0.0)
        state_file = start / f"agent_{agent}" / "optimizer.pt"
        if state_file.is_file():
            optimizer.load_state_dict(load_optimizer_state(state_file))
        policies.append(TrainablePolicy(policy.model, optimizer, policy.tokenizer.pad_token_id))

    rng = numpy_rng(job.seed, round_index=round_index, stage=NAME)
    losses, accuracies, steps, skipped = [], [], 0, [0] * job.num_agents
    margin_sums = torch.zeros(job.num_agents, dtype=torch.float64)
    n_margins = 0
    for _ in range(job.num_train_epochs):
        order = rng.permutation(len(pairs))
        for begin in range(0, len(pairs), job.train_batch_size):
            chunk = [pairs[j] for j in order[begin:begin + job.train_batch_size]]
            stats = madpo_step(policies, _batch(chunk, job.num_agents), beta=job.dpo_beta,
                               max_grad_norm=job.max_grad_norm)
            steps += 1
            losses.append(stats.loss)
            accuracies.append(stats.accuracy)
            finite = torch.isfinite(stats.margins).all(dim=1)
            margin_sums += stats.margins[finite].sum(dim=0).double()
            n_margins += int(finite.sum())
            for i, s in enumerate(stats.skipped):
                skipped[i] += int(s)

    previous = read_trainer_state(start)
    checkpoint = paths.round_checkpoint(round_index)
    with atomic_dir(checkpoint) as tmp:
        for agent, policy in enumerate(policies):
            save_agent(policy.model, tmp / f"agent_{agent}")
            save_optimizer(policy.optimizer, tmp / f"agent_{agent}" / "optimizer.pt")
        directory = replay_dir(paths, job)
        write_json(tmp / TRAINER_STATE, {
            "round": round_index,
            "started_from": paths.rel(start),
            "optimizer_steps": previous.get("optimizer_steps", 0) + steps,
            "replay_index": stored_rounds(directory, run_identity(paths), round_index),
        })

    finite_losses = [x for x in losses if math.isfinite(x)]
    reward_mean = sum(p["candidate_reward_mean"] for p in pairs) / len(pairs)
    record.metrics = {
        "madpo/loss": sum(finite_losses) / len(finite_losses) if finite_losses else float("nan"),
        "madpo/accuracy": sum(accuracies) / len(accuracies),
        "madpo/margin_mean": float(margin_sums.sum() / n_margins) if n_margins else float("nan"),
        "turn_1/reward_mean": reward_mean,
        "turn_1/expected_return": reward_mean,
    }
    for i in range(job.num_agents):
        record.metrics[f"madpo/margin_agent_{i}"] = float(margin_sums[i] / n_margins) if n_margins else float("nan")
        record.metrics[f"madpo/skipped_steps_agent_{i}"] = float(skipped[i])
    record.metrics["madpo/skipped_steps"] = float(sum(skipped))
    record.counts = {"pairs": len(pairs), "epochs": job.num_train_epochs, "steps": steps,
                     "skipped_steps": sum(skipped)}
    if sum(skipped):
        record.say(f"{sum(skipped)} agent step(s) skipped: non-finite loss or gradient")
    record.details = {"checkpoint": paths.rel(checkpoint), "updated": True}
    return record.finish(input_files(paths, round_index, job), [checkpoint])
