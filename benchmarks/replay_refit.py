"""Benchmark: MARLHF's reward model of every round refitted under other replay sample sizes, by the stages themselves
(docs/results/marlhf.md#a-larger-replay-sample-for-the-reward-model-the-heads-capacity-at-32-items-every-stored-pair-once-2026-12-07).

Under ``preference_replay_mode: all_history`` the reward model of round r trains on
``preference_replay_sample_size`` pairs drawn from every stored round (None: as many as round r built, so a round
whose preference has saturated, with few pairs, also fits on few). For each kept run folder (e.g.
``benchmarks/learning.py --trainer marlhf_iter --keep``) and each sample size, the run is copied (its policy
checkpoints left out: neither stage reads them) and replay-select and fit-reward-model of every round that fitted a
reward model are rerun in the copy with the job's ``preference_replay_sample_size`` replaced; the stages' own
manifests give the fitted and the held-out pairs and ``rm/heldout_accuracy`` (pairs of items the fit never saw).
The run's agents are as they were: only the reward model changes, so what a run with that sample size would then
learn is not measured here. A sample size ``run`` keeps the job's own value (the stored figures again).

Writes ``benchmarks/results/replay-refit-<model>[-<tag>].json``. Nothing is timed.

Run: ``python benchmarks/replay_refit.py RUN_DIR [RUN_DIR ...] --sample-sizes run 1000 2000 [--tag TAG]``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchkit import write_runs_result
from stored_pairs import fitted_rounds

import stages.fit_reward_model as fit
import stages.replay_select as replay
from pbrl.data.storage import RunPaths
from pbrl.run.folder import open_job

RUN_OWN = "run"  # a sample size that keeps the job's own preference_replay_sample_size


def refit_run(run_dir: Path, sample_size: int | str) -> list[dict[str, Any]]:
    """One row per round of ``run_dir`` that fitted a reward model: the counts and held-out metrics of
    fit-reward-model rerun (after replay-select) in a copy of the run with ``preference_replay_sample_size`` =
    ``sample_size`` (:data:`RUN_OWN`: the job's own). ``run_dir`` itself is never written.

    Raises:
        ValueError: ``sample_size`` is neither :data:`RUN_OWN` nor an integer >= 1.
    """
    if sample_size != RUN_OWN and not (isinstance(sample_size, int) and sample_size >= 1):
        raise ValueError(f"sample size: got {sample_size!r}; an integer >= 1 or {RUN_OWN!r}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="pbrl-replay-refit-") as scratch:
        copy = Path(scratch) / run_dir.name
        shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns("checkpoints"))
        job = open_job(copy)
        if sample_size != RUN_OWN:
            job = job.model_copy(update={"preference_replay_sample_size": sample_size})
        paths = RunPaths(copy)
        for r in fitted_rounds(copy):  # in order: round r reads the features rounds < r stored
            replay.run(copy, r, job)
            fit.run(copy, r, job)
            manifest = json.loads(paths.manifest(r, fit.NAME).read_text())
            counts, metrics = manifest["counts"], manifest["metrics"]
            rows.append(
                {
                    "run": run_dir.name,
                    "sample_size": sample_size,
                    "round": r,
                    "pairs": counts["pairs"],
                    "train_pairs": counts["train_pairs"],
                    "heldout_pairs": counts["heldout_pairs"],
                    "heldout_accuracy": _rounded(metrics.get("rm/heldout_accuracy")),
                    "heldout_low": _rounded(metrics.get("rm/heldout_accuracy_lo")),
                    "heldout_high": _rounded(metrics.get("rm/heldout_accuracy_hi")),
                }
            )
            print(_row_line(rows[-1]), flush=True)
    return rows


def summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per sample size (first-seen order): the mean and the worst held-out accuracy over the rounds, the rounds at
    >= 0.75 and the rounds measured (a round without held-out pairs is left out and not counted)."""
    out = []
    for size in dict.fromkeys(r["sample_size"] for r in rows):
        accuracies = [
            r["heldout_accuracy"] for r in rows if r["sample_size"] == size and r["heldout_accuracy"] is not None
        ]
        out.append(
            {
                "sample_size": size,
                "mean": round(statistics.fmean(accuracies), 4),
                "worst": min(accuracies),
                "rounds_at_075": sum(a >= 0.75 for a in accuracies),
                "rounds": len(accuracies),
            }
        )
    return out


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def _row_line(r: dict[str, Any]) -> str:
    accuracy = (
        "no held-out pairs"
        if r["heldout_accuracy"] is None
        else (f"unseen {r['heldout_accuracy']:.3f} [{r['heldout_low']:.2f}, {r['heldout_high']:.2f}]")
    )
    return (
        f"{r['run']} sample size {r['sample_size']} round {r['round']}: {r['pairs']} pairs, "
        f"{r['train_pairs']} fitted, {r['heldout_pairs']} held out, {accuracy}"
    )


def _sample_size(text: str) -> int | str:
    return text if text == RUN_OWN else int(text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="kept MARLHF run folders (all_history replay)")
    parser.add_argument(
        "--sample-sizes", nargs="+", type=_sample_size, default=[RUN_OWN], help=f"integers >= 1, or {RUN_OWN!r}"
    )
    parser.add_argument("--tag", default="", help="added to the result's name")
    args = parser.parse_args()
    rows = [row for run_dir in args.runs for size in args.sample_sizes for row in refit_run(run_dir, size)]
    table = summary(rows)
    print("\nsample size   mean   worst   rounds >= 0.75")
    for s in table:
        print(f"{s['sample_size']!s:>11}  {s['mean']:.3f}  {s['worst']:.3f}   {s['rounds_at_075']} of {s['rounds']}")
    path = write_runs_result("replay-refit", args.runs, args.tag, {"rows": rows, "summary": table})
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
