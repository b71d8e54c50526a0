"""Per-round Prefect artifacts: a table of the round's metrics and a markdown summary."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect.artifacts import create_markdown_artifact, create_table_artifact

from pbrl.metrics import round_rows
from pbrl.storage import RunPaths


def publish_round(run_dir: str, round_index: int, stages: list[dict[str, Any]]) -> None:
    """Create the ``round-metrics`` table and ``round-summary`` markdown artifacts (keys are stable; the
    UI shows the newest version, the description names the run and round)."""
    paths = RunPaths(run_dir)
    rows = round_rows(paths, round_index)
    name = paths.root.name
    create_table_artifact(key="round-metrics", table=rows, description=f"{name}: metrics of round {round_index}")
    metric = {r["metric"]: r["value"] for r in rows}
    lines = [f"# {name}: round {round_index}", "", "| stage | state | seconds |", "|---|---|---|"]
    lines += [f"| {s['stage']} | {s['state']} | {s['manifest'].get('seconds', 0):.1f} |" for s in stages]
    lines += ["", "| metric | value |", "|---|---|"]
    for key in ("pairs/count", "iter/train_preference_pairs", "madpo/loss", "madpo/accuracy",
                "madpo/skipped_steps", "eval/turn_1/reward_mean"):
        if key in metric:
            lines.append(f"| {key} | {metric[key]:.4g} |")
    lines += ["", f"Run folder: [{paths.root.resolve()}]({Path(paths.root).resolve().as_uri()})"]
    create_markdown_artifact(key="round-summary", markdown="\n".join(lines),
                             description=f"{name}: summary of round {round_index}")
