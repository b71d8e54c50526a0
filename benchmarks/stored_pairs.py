"""The pairs a refit of a kept run's stored rounds reads (``reward_head.py``, ``replay_refit.py``): which rounds
fitted a reward model, and every pair of the rounds up to r, as fit-reward-model reads a round's selection."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import stages.fit_reward_model as fit
from pbrl.data.schema import PAIR_JOINT_IDS
from pbrl.data.storage import RunPaths
from pbrl.data.tables import read_pairs, read_rows
from pbrl.run.folder import open_job
from pbrl.run.reward_records import pair_joint_ids_path


def fitted_rounds(run_dir: Path) -> list[int]:
    """The rounds of ``run_dir`` whose fit-reward-model finished (its manifest exists), ascending."""
    paths = RunPaths(run_dir)
    return sorted(
        int(d.name) for d in paths.root.joinpath("rounds").iterdir() if paths.manifest(int(d.name), fit.NAME).is_file()
    )


def history_pairs(run_dir: Path, round_index: int, every_built: bool = False) -> tuple[list[dict], list[dict], list]:
    """Every stored pair of ``run_dir``'s fitted rounds up to ``round_index``, each once (the union of the rounds'
    replay selections by ``pair_id``, oldest round first; with ``every_built`` every pair those rounds built), as
    :func:`stages.fit_reward_model.usable_pairs` returns a round's: (pairs, kept, usable)."""
    job, paths = open_job(run_dir), RunPaths(run_dir)
    seen: dict[str, tuple[dict, dict | None, Any]] = {}
    for r in (r for r in fitted_rounds(run_dir) if r <= round_index):
        pairs, kept, usable = built_pairs(paths, r, job) if every_built else fit.usable_pairs(paths, r, job)
        usable_of = {p["pair_id"]: u for p, u in zip(kept, usable, strict=True)}
        for p in pairs:
            seen.setdefault(p["pair_id"], (p, p if p["pair_id"] in usable_of else None, usable_of.get(p["pair_id"])))
    pairs = [p for p, _, _ in seen.values()]
    kept_usable = [(k, u) for _, k, u in seen.values() if k is not None]
    return pairs, [k for k, _ in kept_usable], [u for _, u in kept_usable]


def built_pairs(paths: RunPaths, round_index: int, job: Any) -> tuple[list[dict], list[dict], list]:
    """Every pair round ``round_index`` built (its ``pairs.parquet``, selected or not), as
    :func:`stages.fit_reward_model.usable_pairs` returns a round's selection: (pairs, kept, usable)."""
    pairs = read_pairs(paths.pairs(round_index))
    rows = read_rows(pair_joint_ids_path(paths.round_dir(round_index)), PAIR_JOINT_IDS)
    joint = {row["pair_id"]: row for row in rows}
    kept = [p for p in pairs if joint[p["pair_id"]]["dropped"] is None]
    return pairs, kept, fit.joint_inputs(kept, joint, job)
