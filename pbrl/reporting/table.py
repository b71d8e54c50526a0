"""The round table as people read it: a compact form that fits 80 columns, a wide form with every column of
:func:`pbrl.reporting.metrics.round_table`, and every metric of ``metrics.parquet`` (``pbrl report --all``).

The compact form has, per trainer, only the columns that apply: round, pairs, the learning columns (MADPO: loss
and pair accuracy; MARLHF: the reward model's held-out accuracy, the RL reward and KL), the eval reward and the
paired gain vs round 0, each with its 95 % interval in one cell (``2.60 [2.44, 2.75]``, ``+0.44 [+0.20, +0.65]``),
and the round's seconds. The same rows feed the terminal (:func:`round_table_rich`), the Prefect artifact
(:func:`round_table_markdown`) and anything else (:func:`round_table_rows`). A cell is never cut: where a terminal
is narrower than the table, an interval wraps at its spaces instead.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
from rich import box
from rich.table import Table

from pbrl.data.storage import RunPaths
from pbrl.reporting.metrics import metrics_frame, round_table

DASH = "–"  # not measured in this round (NaN)
MARLHF_TRAINERS = ("marlhf", "marlhf_iter")


@dataclass(frozen=True)
class Column:
    """One column of the printed table: its header (``\\n`` splits it over two lines on a terminal; other forms
    join the lines with a space) and how a row of the round table becomes its cell."""

    header: str
    cell: Callable[[pd.Series], str]


def _value(row: pd.Series, name: str) -> float | None:
    value = row.get(name)
    return None if value is None or pd.isna(value) else float(value)


def decimals_for(values: Sequence[float]) -> int:
    """Decimals that show the largest magnitude in ``values`` with about 3 significant digits: 2 for
    ``[0.1, 100)`` down to 0 from 100 (``123``) and up to 3 below 0.1 (``0.012``); 2 when nothing is finite."""
    finite = [abs(v) for v in values if v is not None and math.isfinite(v)]
    biggest = max(finite, default=0.0)
    if biggest == 0.0:
        return 2
    if biggest >= 1:
        return max(0, min(2, 2 - math.floor(math.log10(biggest))))
    return max(2, min(3, 1 - math.floor(math.log10(biggest))))


def number(name: str, table: pd.DataFrame, fixed: int | None = None, sign: bool = False) -> Callable[[pd.Series], str]:
    """A cell of ``table[name]`` with the column's decimals (:func:`decimals_for`), or ``fixed`` decimals."""
    places = fixed if fixed is not None else decimals_for(table[name].tolist() if name in table else [])
    spec = f"{'+' if sign else ''}.{places}f"

    def cell(row: pd.Series) -> str:
        value = _value(row, name)
        return DASH if value is None else f"{value:{spec}}"

    return cell


def count(name: str) -> Callable[[pd.Series], str]:
    """A whole-number cell (pairs, steps)."""

    def cell(row: pd.Series) -> str:
        value = _value(row, name)
        return DASH if value is None else f"{value:.0f}"

    return cell


def interval(name: str, low: str, high: str, table: pd.DataFrame, sign: bool = False) -> Callable[[pd.Series], str]:
    """``value [low, high]`` with one number of decimals for the three (from the column's values and ends);
    the value alone when the round has no interval (runs evaluated before intervals existed)."""
    values = [v for col in (name, low, high) if col in table for v in table[col].tolist()]
    spec = f"{'+' if sign else ''}.{decimals_for(values)}f"

    def cell(row: pd.Series) -> str:
        value, lo, hi = _value(row, name), _value(row, low), _value(row, high)
        if value is None:
            return DASH
        if lo is None or hi is None:
            return f"{value:{spec}}"
        return f"{value:{spec}} [{lo:{spec}}, {hi:{spec}}]"

    return cell


def duration(name: str) -> Callable[[pd.Series], str]:
    """Seconds in at most 4 characters: ``42``, ``950``, ``17m``, ``26h``."""

    def cell(row: pd.Series) -> str:
        value = _value(row, name)
        if value is None:
            return DASH
        if value < 1000:
            return f"{value:.0f}"
        if value < 60 * 1000:
            return f"{value / 60:.0f}m"
        return f"{value / 3600:.0f}h"

    return cell


def trainer_of(run_dir: str | Path) -> str | None:
    """The run's trainer from its ``run.json`` (None when the file is missing or names none)."""
    path = RunPaths(run_dir).run_json
    if not path.is_file():
        return None
    return json.loads(path.read_text(encoding="utf-8")).get("config", {}).get("trainer")


def is_marlhf_table(table: pd.DataFrame, trainer: str | None) -> bool:
    """MARLHF columns for a MARLHF trainer or, when the trainer is unknown, for a table that has them."""
    if trainer is not None:
        return trainer in MARLHF_TRAINERS
    return "rl_reward" in table or "rm_heldout_accuracy" in table


def columns_for(table: pd.DataFrame, trainer: str | None, wide: bool = False) -> list[Column]:
    """The printed columns of ``table`` (:func:`~pbrl.reporting.metrics.round_table`) for ``trainer``: the
    compact ones (the module docstring), or with ``wide`` every column of the round table that applies."""
    marlhf = is_marlhf_table(table, trainer)
    cols = [Column("round", lambda row: f"{row.name}"), Column("pairs", count("pairs"))]
    if wide:
        cols.append(Column("train\npairs", count("train_pairs")))
    if marlhf:
        if wide:
            cols += [
                Column("RM\nloss", number("rm_loss", table, 3)),
                Column("RM\nacc", number("rm_accuracy", table, 2)),
            ]
        cols += [
            Column("RM held-\nout acc" if wide else "RM\nacc", number("rm_heldout_accuracy", table, 2)),
            Column("RL\nreward", number("rl_reward", table)),
        ]
        if wide:
            cols.append(Column("adv\nstd", number("rl_advantage_std", table)))
        cols.append(Column("KL", number("rl_kl", table, 3)))
        if wide and "critic_loss" in table and table["critic_loss"].notna().any():
            cols += [
                Column("critic\nloss", number("critic_loss", table)),
                Column("expl\nvar", number("critic_explained_variance", table, 2)),
                Column("value\nmean", number("critic_value_mean", table)),
            ]
    else:
        cols += [Column("loss", number("loss", table, 3)), Column("acc", number("accuracy", table, 2))]
        if wide:
            cols += [Column("margin", number("margin", table)), Column("skipped", count("skipped"))]
    cols.append(Column("eval\n[95% CI]", interval("eval_reward", "eval_lo", "eval_hi", table)))
    if wide:  # with the eval column's decimals
        places = decimals_for([v for c in ("eval_reward", "eval_lo", "eval_hi") if c in table for v in table[c]])
        cols.append(Column("vs r0", number("eval_vs_round0", table, places, sign=True)))
    cols.append(Column("paired gain\n[95% CI]", interval("paired", "paired_lo", "paired_hi", table, sign=True)))
    if "win" in table and table["win"].notna().any():  # judged without a reward: the judge's win rate vs round 0
        cols.append(Column("win vs r0\n[95% CI]", interval("win", "win_lo", "win_hi", table)))
    cols.append(Column("secs", duration("seconds")))
    if wide:
        cols.append(Column("peak\nGB", number("peak_rss_gb", table, 2)))
    return cols


def shown_columns(table: pd.DataFrame, trainer: str | None, wide: bool = False) -> tuple[list[Column], list[list[str]]]:
    """The columns to print and their cells, one row per round: :func:`columns_for`, less the wide columns that
    hold nothing in this run (e.g. ``peak GB`` of a run from before it was measured)."""
    cols = columns_for(table, trainer, wide)
    cells = [[c.cell(row) for c in cols] for _, row in table.iterrows()]
    essential = {c.header for c in columns_for(table, trainer)}
    keep = [i for i, c in enumerate(cols) if c.header in essential or any(row[i] != DASH for row in cells)]
    return [cols[i] for i in keep], [[row[i] for i in keep] for row in cells]


def table_rows(table: pd.DataFrame, trainer: str | None, wide: bool = False) -> tuple[list[str], list[list[str]]]:
    """(headers on one line each, one row of cells per round) of an in-memory round table."""
    cols, cells = shown_columns(table, trainer, wide)
    return [c.header.replace("-\n", "-").replace("\n", " ") for c in cols], cells


def round_table_rows(run_dir: str | Path, wide: bool = False) -> tuple[list[str], list[list[str]]]:
    """The round table of the run in ``run_dir`` as text: (headers, one row of cells per round), compact (the
    module docstring) or ``wide``. Reads ``metrics.parquet`` (rebuild it first with
    :func:`~pbrl.reporting.metrics.write_run_metrics`) and ``run.json``.

    Raises:
        ArtifactError: ``metrics.parquet`` is missing or does not match its schema.
    """
    return table_rows(round_table(run_dir), trainer_of(run_dir), wide)


def round_table_markdown(run_dir: str | Path, wide: bool = False) -> str:
    """:func:`round_table_rows` as a markdown table (the Prefect artifact), numbers right-aligned.

    Raises:
        ArtifactError: as :func:`round_table_rows`.
    """
    headers, rows = round_table_rows(run_dir, wide)
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---:" for _ in headers) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def round_table_rich(table: pd.DataFrame, trainer: str | None, title: str | None = None, wide: bool = False) -> Table:
    """The round table for a terminal: no borders, two spaces between columns, two-line headers, numbers
    right-aligned. Every column's minimum width is its longest word, so a narrow terminal wraps an interval at
    its spaces rather than cutting a number to ``2…``."""
    cols, cells = shown_columns(table, trainer, wide)
    # SIMPLE_HEAD: a rule under the header and a one-space column separator; with one space of right padding,
    # two spaces between columns.
    out = Table(
        title=title, box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 1, 0, 0), header_style="bold"
    )
    for i, col in enumerate(cols):
        words = [w for text in [col.header, *(row[i] for row in cells)] for w in text.split()]
        out.add_column(col.header, justify="right", no_wrap=False, min_width=max(map(len, words), default=1))
    for row in cells:
        out.add_row(*row)
    return out


def all_metrics_rich(run_dir: str | Path) -> Table:
    """Every metric of ``metrics.parquet``, one row per (stage, metric) and one column per round (``pbrl report
    --all``): as narrow as the number of rounds allows.

    Raises:
        ArtifactError: ``metrics.parquet`` is missing or does not match its schema.
    """
    df = metrics_frame(run_dir)
    wide = df.pivot_table(index=["metric", "stage"], columns="round_index", values="value", aggfunc="last")
    out = Table(
        title=f"{Path(run_dir).name}: every metric",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        pad_edge=False,
        padding=(0, 1, 0, 0),
    )
    out.add_column("metric", no_wrap=True)
    out.add_column("stage", no_wrap=True, style="dim")
    for r in wide.columns:
        out.add_column(f"round {r}", justify="right", no_wrap=True)
    for (metric, stage), values in wide.iterrows():
        out.add_row(metric, stage, *(DASH if pd.isna(v) else f"{v:.4g}" for v in values))
    return out
