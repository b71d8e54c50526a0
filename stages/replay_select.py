"""Stage 5, replay-select: this round's training pairs B(r) from the eligible stored rounds
(docs/design/algorithms.md#replay-buffer).

Eligible rounds come from the replay index, restricted to rounds <= r, so a resumed run never uses a
later round left on disk by an earlier attempt. The selection is a list of (source round, pair index)
draws; update-policies reads the stored token ids of those pairs from each round's pairs.parquet.

With ``log_reward_distribution`` (iterative trainers, as in the reference) the stage also writes
``reward_distribution.json`` (the reference's ``reward_distributions/iteration_<k>.json`` record: histograms of
the round's raw candidate rewards per side and of the selected pairs' target/comparator raw rewards over the
task's reward range) and ``reward_distribution.png``, and adds the reference's scalar metrics.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from pbrl.config import IterativeJob, JobConfig
from pbrl.data.replay_store import run_identity, stored_rounds
from pbrl.data.schema import PAIRS, SCORES, SELECTED_PAIRS
from pbrl.data.seeds import numpy_rng
from pbrl.data.storage import RunPaths, StageManifest, hash_path, write_json
from pbrl.data.tables import read_rows, write_table
from pbrl.errors import ArtifactError
from pbrl.preference.replay import ReplayDataset, ReplayMode, ReplaySelection, select_replay
from pbrl.reporting.reward_hist import check_reward_range, distribution_metrics, distribution_record, plot_distribution
from pbrl.run.folder import job_replay_dir
from pbrl.run.stage_record import StageRecord
from pbrl.run.task import resolve_task

NAME = "replay-select"


@dataclass(frozen=True)
class ReplayOptions:
    """The job's replay options as plain values; base trainers have none (the current round's pairs, no
    reward-distribution record)."""

    mode: ReplayMode = "current"
    k: int | None = None
    lam: float | None = None
    sample_size: int | None = None
    log_distribution: bool = False


def replay_options(job: JobConfig) -> ReplayOptions:
    """``preference_replay_mode``, ``_k``, ``_lambda``, ``_sample_size`` and ``log_reward_distribution`` of an
    iterative job (options the iterative trainers alone have); the defaults of :class:`ReplayOptions` otherwise."""
    if not isinstance(job, IterativeJob):
        return ReplayOptions()
    return ReplayOptions(
        mode=job.preference_replay_mode,
        k=job.preference_replay_k,
        lam=job.preference_replay_lambda,
        sample_size=job.preference_replay_sample_size,
        log_distribution=job.log_reward_distribution,
    )


def _entries(paths: RunPaths, round_index: int, job: JobConfig) -> list[dict]:
    directory = job_replay_dir(paths, job)
    return stored_rounds(directory, run_identity(paths), round_index)


def input_files(paths: RunPaths, round_index: int, job: JobConfig) -> list[Path]:
    files = [paths.root / e["pairs_file"] for e in _entries(paths, round_index, job)]
    if replay_options(job).log_distribution:
        rounds = [e["round"] for e in _entries(paths, round_index, job)]
        files += [paths.scores(round_index), *(paths.pairs(r) for r in rounds)]
    return files


def _distribution(paths: RunPaths, round_index: int, job: JobConfig, rows: list[dict]) -> dict:
    """The reward-distribution record of this round (raw rewards; failed responses left out)."""
    task = resolve_task(job, paths.root)
    low, high = check_reward_range(
        getattr(task.reward_func, "reward_range", None) or task.reward_range, source=task.name
    )
    scores = read_rows(paths.scores(round_index), SCORES)
    side = {
        s: [r["raw_reward"] for r in scores if r["side"] == s and r["raw_reward"] is not None]
        for s in ("target", "comparator")
    }
    pairs = {r: read_rows(paths.pairs(r), PAIRS) for r in sorted({row["source_round"] for row in rows})}
    chosen = [pairs[row["source_round"]][row["pair_index"]] for row in rows]
    return distribution_record(
        round_index,
        low,
        high,
        target=side["target"],
        comparator=side["comparator"],
        selected_target=[p["target_raw_reward"] for p in chosen if p["target_raw_reward"] is not None],
        selected_comparator=[p["comparator_raw_reward"] for p in chosen if p["comparator_raw_reward"] is not None],
    )


def run(run_dir: str | Path, round_index: int, job: JobConfig) -> StageManifest:
    record = StageRecord(NAME, run_dir, round_index, job)
    paths = record.paths
    options = replay_options(job)
    entries = _entries(paths, round_index, job)
    _check_entries(paths, entries, round_index)
    selection = select_replay(
        [ReplayDataset(e["round"], e["num_pairs"]) for e in entries],
        mode=options.mode,
        current_round=round_index,
        k=options.k,
        lam=options.lam,
        sample_size=options.sample_size,
        rng=numpy_rng(job.seed, round_index=round_index, stage=NAME),
    )
    rows = _selected_rows(selection)
    write_table(paths.selected_pairs(round_index), rows, SELECTED_PAIRS)
    _record_selection(record, entries, selection, options.mode)
    outputs = [paths.selected_pairs(round_index)]
    if options.log_distribution:
        outputs += _write_distribution(record, rows)
    return record.finish(input_files(paths, round_index, job), outputs)


def _check_entries(paths: RunPaths, entries: list[dict], round_index: int) -> None:
    """Check the replay index lists this round and that every stored pairs file is as it was stored.

    Raises:
        ArtifactError: the round is not stored, or a pairs file changed since (names the round to store again).
    """
    if round_index not in {e["round"] for e in entries}:
        raise ArtifactError(f"replay index has no round {round_index}: run store-round first")
    for e in entries:
        if hash_path(paths.root / e["pairs_file"]) != e["pairs_sha256"]:
            raise ArtifactError(
                f"{paths.root / e['pairs_file']}: changed since round {e['round']} was stored; "
                f"rerun store-round for round {e['round']}"
            )


def _selected_rows(selection: ReplaySelection) -> list[dict]:
    """The :data:`~pbrl.data.schema.SELECTED_PAIRS` rows of ``selection``, in draw order."""
    return [
        {
            "draw_order": n,
            "pair_id": f"r{d.source_round:04d}-p{d.pair_index:05d}",
            "source_round": d.source_round,
            "pair_index": d.pair_index,
        }
        for n, d in enumerate(selection.draws)
    ]


def _record_selection(record: StageRecord, entries: list[dict], selection: ReplaySelection, mode: str) -> None:
    """The selection's counts, ``iter/*`` metrics (each eligible round's share of the draws) and details."""
    selected = len(selection.draws)
    current = next(e["num_pairs"] for e in entries if e["round"] == record.round_index)
    record.counts = {"selected": selected, "current_pairs": current}
    record.metrics = {
        "iter/current_preference_pairs": float(current),
        "iter/total_preference_pairs": float(sum(e["num_pairs"] for e in entries)),
        "iter/train_preference_pairs": float(selected),
    }
    shares = Counter(d.source_round for d in selection.draws)
    for r in selection.eligible_rounds:
        record.metrics[f"iter/selection_share/round_{r:04d}"] = shares[r] / selected if selected else 0.0
    record.details = {
        "mode": mode,
        "eligible_rounds": selection.eligible_rounds,
        "weights": [float(w) for w in selection.weights],
        "sample_size": selection.sample_size,
    }


def _write_distribution(record: StageRecord, rows: list[dict]) -> list[Path]:
    """Write ``reward_distribution.json`` and ``.png`` of the round and add their metrics; returns both paths."""
    paths, round_index = record.paths, record.round_index
    distribution = _distribution(paths, round_index, record.job, rows)
    json_path = paths.round_dir(round_index) / "reward_distribution.json"
    write_json(json_path, distribution)
    png = plot_distribution(distribution, paths.round_dir(round_index) / "reward_distribution.png")
    record.metrics.update(distribution_metrics(distribution))
    return [json_path, png]
