"""Stage 5, replay-select: this round's training pairs B(r) from the eligible stored rounds (SPEC §5.4).

Eligible rounds come from the replay index, restricted to rounds <= r, so a resumed run never uses a
later round left on disk by an earlier attempt. The selection is a list of (source round, pair index)
draws; update-policies reads the stored token ids of those pairs from each round's pairs.parquet.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from pbrl.config import JobConfig
from pbrl.errors import ArtifactError
from pbrl.replay import ReplayDataset, select_replay
from pbrl.replay_store import replay_dir, run_identity, stored_rounds
from pbrl.schema import SELECTED_PAIRS, write_table
from pbrl.seeds import numpy_rng
from pbrl.stagekit import StageRecord
from pbrl.storage import RunPaths, StageManifest, hash_path

NAME = "replay-select"


def _entries(paths: RunPaths, round_index: int, job: JobConfig) -> list[dict]:
    directory = replay_dir(paths, job)
    return stored_rounds(directory, run_identity(paths), round_index)


def input_files(paths: RunPaths, round_index: int, job: JobConfig) -> list[Path]:
    return [paths.root / e["pairs_file"] for e in _entries(paths, round_index, job)]


def run(run_dir: str | Path, round_index: int, job: JobConfig) -> StageManifest:
    record = StageRecord(NAME, run_dir, round_index, job)
    paths = record.paths
    entries = _entries(paths, round_index, job)
    if round_index not in {e["round"] for e in entries}:
        raise ArtifactError(f"replay index has no round {round_index}: run store-round first")
    for e in entries:
        if hash_path(paths.root / e["pairs_file"]) != e["pairs_sha256"]:
            raise ArtifactError(f"{paths.root / e['pairs_file']}: changed since round {e['round']} was stored; "
                                f"rerun store-round for round {e['round']}")
    mode = getattr(job, "preference_replay_mode", "current")
    selection = select_replay(
        [ReplayDataset(e["round"], e["num_pairs"]) for e in entries],
        mode=mode, current_round=round_index, k=getattr(job, "preference_replay_k", None),
        lam=getattr(job, "preference_replay_lambda", None),
        sample_size=getattr(job, "preference_replay_sample_size", None),
        rng=numpy_rng(job.seed, round_index=round_index, stage=NAME),
    )
    rows = [
        {"draw_order": n, "pair_id": f"r{d.source_round:04d}-p{d.pair_index:05d}", "source_round": d.source_round,
         "pair_index": d.pair_index}
        for n, d in enumerate(selection.draws)
    ]
    write_table(paths.selected_pairs(round_index), rows, SELECTED_PAIRS)
    current = next(e["num_pairs"] for e in entries if e["round"] == round_index)
    record.counts = {"selected": len(rows), "current_pairs": current}
    record.metrics = {
        "iter/current_preference_pairs": float(current),
        "iter/total_preference_pairs": float(sum(e["num_pairs"] for e in entries)),
        "iter/train_preference_pairs": float(len(rows)),
    }
    shares = Counter(d.source_round for d in selection.draws)
    for r in selection.eligible_rounds:
        record.metrics[f"iter/selection_share/round_{r:04d}"] = shares[r] / len(rows) if rows else 0.0
    record.details = {"mode": mode, "eligible_rounds": selection.eligible_rounds,
                      "weights": [float(w) for w in selection.weights], "sample_size": selection.sample_size}
    return record.finish(input_files(paths, round_index, job), [paths.selected_pairs(round_index)])
