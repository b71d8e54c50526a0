"""The pairs a refit of a kept run's stored rounds reads (``reward_head.py``, ``replay_refit.py``): which rounds
fitted a reward model, and every pair of the rounds up to r, as fit-reward-model reads a round's selection."""

from __future__ import annotations

from pathlib import Path

import stages.fit_reward_model as fit
from pbrl.data.storage import RunPaths
from pbrl.data.tables import read_pairs, read_selected_pairs
from pbrl.run.folder import open_job


def fitted_rounds(run_dir: Path) -> list[int]:
    """The rounds of ``run_dir`` whose fit-reward-model finished (its manifest exists), ascending."""
    paths = RunPaths(run_dir)
    return sorted(
        int(d.name) for d in paths.root.joinpath("rounds").iterdir() if paths.manifest(int(d.name), fit.NAME).is_file()
    )


def history_pairs(run_dir: Path, round_index: int, every_built: bool = False) -> tuple[list[dict], list[dict], list]:
    """Every stored pair of ``run_dir``'s fitted rounds up to ``round_index``, each once (the union of the rounds'
    replay selections by ``pair_id``, oldest round first; with ``every_built`` every pair those rounds built, in
    their ``pairs.parquet`` order), as :func:`stages.fit_reward_model.usable_pairs` returns a round's: (pairs, kept,
    usable)."""
    job, paths = open_job(run_dir), RunPaths(run_dir)
    pairs: dict[str, dict] = {}
    for r in (r for r in fitted_rounds(run_dir) if r <= round_index):
        if every_built:
            chosen = read_pairs(paths.pairs(r))
        else:
            chosen = read_selected_pairs(paths.selected_pairs(r), paths.pairs)
        for p in chosen:
            pairs.setdefault(p["pair_id"], p)
    kept, usable = fit.kept_inputs(paths, list(pairs.values()), job)
    return list(pairs.values()), kept, usable
