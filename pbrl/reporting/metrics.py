"""Run metrics: gathered from the stage manifests into ``metrics.parquet`` (one row per round, stage, metric).

The table is derived, never appended to: rebuilding it from the manifests after any stage gives the same
file, so a resumed or partially rerun run cannot hold stale or duplicated rows.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from pbrl.data.schema import METRICS
from pbrl.data.storage import STAGES, RunPaths, existing_rounds, read_manifest
from pbrl.data.tables import read_table, write_table

COUNT_METRICS = {  # manifest counts worth a metric row: (stage, count) -> metric name
    ("build-pairs", "pairs"): "pairs/count",
    ("build-pairs", "rejected_empty"): "pairs/rejected_empty",
    ("build-pairs", "items_without_pairs"): "pairs/items_without_pairs",
    ("score-with-oracle", "failed"): "oracle/failed",
    ("update-policies", "steps"): "madpo/steps",
    ("evaluate", "items_seen_in_training"): "eval/items_seen_in_training",  # held-out evaluation: 0
    ("fit-reward-model", "train_pairs"): "rm/train_pairs",
    ("fit-reward-model", "dropped_too_long"): "rm/dropped_too_long",
}
MARLHF_COLUMNS = {  # MARLHF round-table columns, shown when a run has them
    "rm/loss": "rm_loss",
    "rm/accuracy": "rm_accuracy",
    "rm/heldout_accuracy": "rm_heldout_accuracy",
    "rl/reward_mean": "rl_reward",
    "rl/advantage_std": "rl_advantage_std",
    "rl/kl_mean": "rl_kl",
    "critic/value_loss": "critic_loss",  # maac / iac only
    "critic/explained_variance": "critic_explained_variance",
    "critic/value_mean": "critic_value_mean",
}
EVAL_INTERVAL_COLUMNS = {  # evaluate's interval metrics -> round-table columns
    "eval/reward_ci_low": "eval_lo",
    "eval/reward_ci_high": "eval_hi",
    "eval/paired_diff_mean": "paired",
    "eval/paired_diff_ci_low": "paired_lo",
    "eval/paired_diff_ci_high": "paired_hi",
    "eval/win_rate": "win",  # a task without a reward: the judge's win rate vs round 0 (pbrl.judging.win_rate)
    "eval/win_rate_ci_low": "win_lo",
    "eval/win_rate_ci_high": "win_hi",
}


def round_rows(paths: RunPaths, round_index: int) -> list[dict]:
    """Metric rows of one round from its manifests (metrics, selected counts and stage seconds)."""
    rows = []
    for stage in STAGES:
        m = read_manifest(paths, round_index, stage)
        if m is None:
            continue
        values = dict(m.metrics)
        for (s, count), name in COUNT_METRICS.items():
            if s == stage and count in m.counts:
                values[name] = float(m.counts[count])
        values[f"time/{stage}_seconds"] = m.seconds
        rows += [
            {"round_index": round_index, "stage": stage, "metric": k, "value": float(v)}
            for k, v in sorted(values.items())
        ]
    return rows


def write_run_metrics(run_dir: str | Path) -> Path:
    """Rebuild ``metrics.parquet`` from every round's manifests."""
    paths = RunPaths(run_dir)
    rows = [row for r in existing_rounds(paths) for row in round_rows(paths, r)]
    write_table(paths.metrics, rows, METRICS)
    return paths.metrics


def metrics_frame(run_dir: str | Path) -> pd.DataFrame:
    """metrics.parquet as a DataFrame (round_index, stage, metric, value)."""
    return read_table(RunPaths(run_dir).metrics, METRICS).to_pandas()


def round_table(run_dir: str | Path) -> pd.DataFrame:
    """One row per round: pairs, loss, accuracy, eval reward with its 95 % interval (``eval_lo``, ``eval_hi``),
    its change vs round 0, and the paired difference to round 0 on the same draws with its interval
    (``paired``, ``paired_lo``, ``paired_hi``; :mod:`pbrl.reporting.stats`), for a task without a reward the
    judge's win rate vs round 0 with its interval (``win``, ``win_lo``, ``win_hi``), the MARLHF columns of
    :data:`MARLHF_COLUMNS` where the run has them, ``seconds`` (the wall time of the round's stages, summed over
    their manifests, s) and ``peak_rss_gb``, the largest
    ``resource/peak_rss_mb`` of the round's stages in GiB (:func:`pbrl.run.stage_record.peak_rss_mb`: a process-lifetime
    high-water mark, so with every stage in one process it includes earlier rounds). Runs evaluated before
    the intervals existed show the eval reward from ``eval/turn_1/reward_mean`` and no intervals."""
    df = metrics_frame(run_dir)
    wide = df.pivot_table(index="round_index", columns="metric", values="value", aggfunc="last")
    cols = {
        "pairs/count": "pairs",
        "iter/train_preference_pairs": "train_pairs",
        "madpo/loss": "loss",
        "madpo/accuracy": "accuracy",
        "madpo/margin_mean": "margin",
        "madpo/skipped_steps": "skipped",
        "eval/turn_1/reward_mean": "eval_reward",
        **EVAL_INTERVAL_COLUMNS,
    }
    table = pd.DataFrame(index=wide.index)
    for src, dst in cols.items():
        table[dst] = wide[src] if src in wide else float("nan")
    for src, dst in MARLHF_COLUMNS.items():
        if src in wide:
            table[dst] = wide[src]
    if "eval/reward_mean" in wide:  # the interval's centre: the mean of item means (equal without failures)
        table["eval_reward"] = wide["eval/reward_mean"].fillna(table["eval_reward"])
    # Peak RSS of the round in GiB: the largest stage value (each its process's lifetime high-water mark, MiB).
    rss = df[df["metric"] == "resource/peak_rss_mb"].groupby("round_index")["value"].max() / 1024
    table["peak_rss_gb"] = rss.reindex(table.index)
    timed = df[df["metric"].str.startswith("time/") & df["metric"].str.endswith("_seconds")]
    table["seconds"] = timed.groupby("round_index")["value"].sum().reindex(table.index)
    if 0 in table.index and pd.notna(table.loc[0, "eval_reward"]):
        table.insert(
            table.columns.get_loc("eval_reward") + 1,
            "eval_vs_round0",
            table["eval_reward"] - table.loc[0, "eval_reward"],
        )
    table.index.name = "round"
    return table
