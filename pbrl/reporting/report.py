"""``report.png``: one figure of a run, to keep.

Panels, in order (rows of three):

* **Evaluation reward** per round with its 95 % interval (resampling items), the round-0 baseline dashed;
* **Paired gain vs round 0** with its 95 % interval against a zero line: per item, reward now minus reward at round 0
  on the same draws (:mod:`pbrl.reporting.stats`); an interval above 0 is a gain beyond the sampling noise;
* **Reward parts** per round, where the task's reward has declared parts
  (:data:`pbrl.tasks.reward_parts.REWARD_PARTS`);
* **Training per step**, on the reference's env-step axis with the round boundaries (the logged ``train_log`` rows
  of each round's update-policies manifest, and each round's mean): MADPO's loss and pair accuracy; MARLHF's RL
  reward;
* **Per round**: MADPO's mean joint margin and each agent's; MARLHF's reward model (train and held-out pair
  accuracy) and the RL pass's KL to the reference;
* **Completions**: the mean completion length per agent on the evaluation draws, and the share cut at
  ``max_new_tokens``;
* MARLHF with a critic (``maac``, ``iac``): the critic's value loss and explained variance per round.

The title names the run, trainer, task, model(s) and seed. Every number comes from the run folder: the round
table (:func:`pbrl.reporting.metrics.round_table`), the manifests, ``eval.parquet`` and ``items.parquet``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from pbrl.data.items import read_items  # noqa: E402
from pbrl.data.schema import EVAL  # noqa: E402
from pbrl.data.storage import RunPaths, existing_rounds, read_manifest  # noqa: E402
from pbrl.data.tables import read_rows  # noqa: E402
from pbrl.reporting.metrics import metrics_frame, round_table  # noqa: E402
from pbrl.tasks.reward_parts import REWARD_PARTS, RewardParts  # noqa: E402

MARLHF_TRAINERS = ("marlhf", "marlhf_iter")
AGENT_COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown")


# ------------------------------------------------------------------------------------------------ the data
def run_config(run_dir: str | Path) -> dict[str, Any]:
    """The job stored in ``run.json`` (``{}`` when the file is missing)."""
    path = RunPaths(run_dir).run_json
    return json.loads(path.read_text(encoding="utf-8")).get("config", {}) if path.is_file() else {}


def title_of(run_dir: str | Path, config: Mapping[str, Any]) -> str:
    """``<run> — <trainer>, task <task>, model <model>, seed <seed>`` (agents listed when they differ)."""
    agents = config.get("agents") or [config.get("agent_model")]
    models = ", ".join(dict.fromkeys(str(Path(a).name) for a in agents if a)) or "?"
    return (
        f"{Path(run_dir).name} — {config.get('trainer', '?')}, task {config.get('task') or 'custom'}, "
        f"model {models}, seed {config.get('seed', '?')}"
    )


def train_steps(run_dir: str | Path) -> pd.DataFrame:
    """The logged training steps of every round (``details.train_log`` of the update-policies manifests), one row
    per step: ``round``, ``env_step`` and the step's metrics (``madpo/loss``, ``rl/reward_mean`` …)."""
    paths = RunPaths(run_dir)
    rows = []
    for r in existing_rounds(paths):
        manifest = read_manifest(paths, r, "update-policies")
        if manifest is not None:
            rows += [{"round": r, **row} for row in manifest.details.get("train_log", [])]
    return pd.DataFrame(rows, columns=None if rows else ["round", "env_step"])


def completion_stats(run_dir: str | Path) -> pd.DataFrame:
    """Per round and agent, on the evaluation draws: ``tokens`` (mean completion length in tokens, a generated
    EOS included) and ``cut`` (share of completions that ran to ``max_new_tokens``); columns ``round``, ``agent``.
    """
    paths = RunPaths(run_dir)
    rows = []
    for r in existing_rounds(paths):
        if not paths.eval(r).is_file():
            continue
        draws = read_rows(paths.eval(r), EVAL)
        for agent in range(min((len(d["completion_ids"]) for d in draws), default=0)):
            lengths = [len(d["completion_ids"][agent]) for d in draws]
            cut = [d["finish_reasons"][agent] == "length" for d in draws]
            rows.append({"round": r, "agent": agent, "tokens": sum(lengths) / len(lengths), "cut": sum(cut) / len(cut)})
    return pd.DataFrame(rows, columns=["round", "agent", "tokens", "cut"])


def reward_parts(run_dir: str | Path, parts_of: RewardParts | None) -> pd.DataFrame:
    """Per round (index), the mean of each part of the task's reward over the evaluation draws, as ``parts_of``
    (the task's, :data:`pbrl.tasks.reward_parts.REWARD_PARTS`) splits a joint response; empty without it. A draw
    without parts (an empty completion) counts 0 for each."""
    paths = RunPaths(run_dir)
    if parts_of is None or not paths.items.is_file():
        return pd.DataFrame()
    items = {item["item_id"]: item for item in read_items(paths, "eval")}
    means: dict[int, dict[str, float]] = {}
    for r in existing_rounds(paths):
        if not paths.eval(r).is_file():
            continue
        found = [parts_of(d["completions"], items[d["item_id"]]) for d in read_rows(paths.eval(r), EVAL)]
        names = list(dict.fromkeys(k for parts in found if parts for k in parts))
        means[r] = {k: sum((parts or {}).get(k, 0.0) for parts in found) / len(found) for k in names} if found else {}
    return pd.DataFrame.from_dict(means, orient="index").sort_index()


def round_ends(run_dir: str | Path) -> pd.Series:
    """Env step at the end of each trained round (``train/env_step``), indexed by round."""
    df = metrics_frame(run_dir)
    return df[df["metric"] == "train/env_step"].groupby("round_index")["value"].last()


# ------------------------------------------------------------------------------------------------ the panels
def draw_eval(ax: Axes, table: pd.DataFrame) -> None:
    """Eval reward per round with its 95 % interval; the round-0 baseline dashed."""
    ev = table["eval_reward"].dropna()
    lo = table.get("eval_lo", pd.Series(dtype=float)).reindex(ev.index)
    hi = table.get("eval_hi", pd.Series(dtype=float)).reindex(ev.index)
    err = [(ev - lo).fillna(0).values, (hi - ev).fillna(0).values]
    ax.errorbar(ev.index, ev.values, yerr=err, marker="o", capsize=4, color="tab:blue", label="mean, 95 % interval")
    if 0 in ev.index:
        ax.axhline(ev.loc[0], color="grey", linestyle="--", linewidth=1, label="round 0")
    ax.set(title="Evaluation reward", xlabel="round", ylabel="mean task reward")
    _legend(ax)


def draw_gain(ax: Axes, table: pd.DataFrame) -> None:
    """The paired gain vs round 0 with its 95 % interval against 0; green where the interval is above 0."""
    ax.axhline(0, color="black", linewidth=1)
    gain = table["paired"].dropna() if "paired" in table else pd.Series(dtype=float)
    said = ""
    if gain.empty and "win" in table and table["win"].notna().any():  # judged without a reward
        draw_win_rate(ax, table)
        return
    if gain.empty:
        _note(ax, "no paired gain yet: it needs round 0 and a trained round")
    else:
        lo, hi = table["paired_lo"].reindex(gain.index), table["paired_hi"].reindex(gain.index)
        ax.plot(gain.index, gain.values, color="tab:purple", linewidth=1)
        for r in gain.index:
            color = "tab:green" if lo[r] > 0 else "tab:red" if hi[r] < 0 else "tab:grey"
            ax.errorbar([r], [gain[r]], yerr=[[gain[r] - lo[r]], [hi[r] - gain[r]]], marker="D", capsize=4, color=color)
        last = gain.index[-1]
        said = f"\nround {last}: {gain[last]:+.2f} [{lo[last]:+.2f}, {hi[last]:+.2f}]"
        ax.set_xlim(-0.3, max(table.index) + 0.5)
    ax.set(title="Paired gain vs round 0 (same draws)" + said, xlabel="round", ylabel="reward now − round 0")


def draw_win_rate(ax: Axes, table: pd.DataFrame) -> None:
    """A task without a reward: the judge's win rate of each round against round 0 (same draws) with its 95 %
    interval, against 1/2 (no change); green where the interval is above 1/2."""
    win = table["win"].dropna()
    lo, hi = table["win_lo"].reindex(win.index), table["win_hi"].reindex(win.index)
    ax.axhline(0.5, color="black", linewidth=1)
    ax.plot(win.index, win.values, color="tab:purple", linewidth=1)
    for r in win.index:
        color = "tab:green" if lo[r] > 0.5 else "tab:red" if hi[r] < 0.5 else "tab:grey"
        ax.errorbar([r], [win[r]], yerr=[[win[r] - lo[r]], [hi[r] - win[r]]], marker="D", capsize=4, color=color)
    last = win.index[-1]
    ax.set_xlim(-0.3, max(table.index) + 0.5)
    ax.set_ylim(0, 1)
    ax.set(title=f"Judge's win rate vs round 0 (same draws)\nround {last}: {win[last]:.2f} [{lo[last]:.2f}, "
           f"{hi[last]:.2f}]", xlabel="round", ylabel="share of draws preferred to round 0")  # fmt: skip


def draw_parts(ax: Axes, parts: pd.DataFrame) -> None:
    """Each part of the task's reward per round."""
    for name in parts.columns:
        ax.plot(parts.index, parts[name].values, marker="o", label=name)
    ax.set(title="Reward parts (evaluation draws)", xlabel="round", ylabel="mean part of the reward")
    _legend(ax)


def draw_steps(ax: Axes, steps: pd.DataFrame, table: pd.DataFrame, ends: pd.Series, marlhf: bool) -> None:
    """Training per logged step on the env-step axis with the round boundaries, and each round's mean."""
    if marlhf:
        series = [("rl/reward_mean", "rl_reward", "RL reward", "tab:red", ax)]
    else:
        acc_ax = ax.twinx()
        acc_ax.set(ylim=(-0.05, 1.05), ylabel="pair accuracy")
        series = [
            ("madpo/loss", "loss", "loss (nats)", "tab:red", ax),
            ("madpo/accuracy", "accuracy", "pair accuracy", "tab:green", acc_ax),
        ]
    start = 0.0
    for r, end in ends.items():
        ax.axvline(end, color="grey", linestyle=":", linewidth=1)
        ax.text(end, 0.99, f"round {r} ", transform=ax.get_xaxis_transform(), ha="right", va="top", fontsize=7)
        for _, col, _, color, target in series:  # the round's mean over all its steps, logged or not
            if col in table and r in table.index and pd.notna(table.loc[r, col]):
                target.hlines(table.loc[r, col], start, end, color=color, alpha=0.35, linewidth=3)
        start = end
    for name, _, label, color, target in series:
        if name in steps:
            logged = steps.dropna(subset=[name])
            target.plot(logged["env_step"], logged[name], marker=".", color=color, label=f"{label}, logged steps")
    if ends.empty and steps.empty:
        _note(ax, "no training step yet")
    ax.set(title="Training per step (thick: round mean)", xlabel="env steps", ylabel=series[0][2])
    _legend(ax, extra=[s[4] for s in series[1:]])


def draw_per_round(ax: Axes, table: pd.DataFrame, run_dir: str | Path, marlhf: bool) -> None:
    """MADPO: the joint margin and each agent's per round; MARLHF: the reward model's accuracies and RL's KL."""
    if marlhf:
        for col, label, color in (
            ("rm_accuracy", "reward model: train pairs", "tab:blue"),
            ("rm_heldout_accuracy", "reward model: held-out pairs", "tab:green"),
        ):
            if col in table and table[col].notna().any():
                ax.plot(table[col].dropna().index, table[col].dropna().values, marker="o", color=color, label=label)
        ax.set(ylim=(-0.05, 1.05), ylabel="pair accuracy")
        if "rl_kl" in table and table["rl_kl"].notna().any():
            _legend(ax, extra=[_right_axis(ax, table["rl_kl"], "RL: KL to reference", "KL (nats)", "tab:red")])
        else:
            _legend(ax)
        ax.set(title="Reward model and RL per round", xlabel="round")
        return
    df = metrics_frame(run_dir)
    agents = df[df["metric"].str.startswith("madpo/margin_agent_")]
    for name, rows in agents.groupby("metric"):
        agent = int(name.rsplit("_", 1)[-1])
        ax.plot(rows["round_index"], rows["value"], marker=".", color=AGENT_COLORS[agent % 6], label=f"agent {agent}")
    if "margin" in table and table["margin"].notna().any():
        margin = table["margin"].dropna()
        ax.plot(margin.index, margin.values, marker="o", color="black", label="joint (sum over agents)")
    if ax.lines:
        ax.axhline(0, color="grey", linewidth=1)
    else:
        _note(ax, "no training round yet")
    ax.set(title="MADPO margin per round", xlabel="round", ylabel="mean margin Δ (nats)")
    _legend(ax)


def draw_critic(ax: Axes, table: pd.DataFrame) -> None:
    """maac / iac: the critic's value loss per round and its explained variance (right axis)."""
    loss = table["critic_loss"].dropna()
    ax.plot(loss.index, loss.values, marker="o", color="tab:brown", label="value loss")
    if "critic_explained_variance" in table:
        ev = table["critic_explained_variance"]
        _legend(ax, extra=[_right_axis(ax, ev, "explained variance", "explained variance", "tab:cyan")])
    else:
        _legend(ax)
    ax.set(title="Critic per round", xlabel="round", ylabel="value loss")


def _right_axis(ax: Axes, series: pd.Series, label: str, ylabel: str, color: str) -> Axes:
    """``series`` (per round, NaN where not measured) as a dashed line on a second y axis at the right of ``ax``."""
    right = ax.twinx()
    values = series.dropna()
    right.plot(values.index, values.values, marker="s", linestyle="--", color=color, label=label)
    right.set(ylabel=ylabel)
    return right


def draw_completions(ax: Axes, stats: pd.DataFrame, max_new_tokens: int | None) -> None:
    """Mean completion length per agent (solid) and the share cut at ``max_new_tokens`` (dashed, right axis)."""
    cut_ax = ax.twinx()
    for agent, rows in stats.groupby("agent"):
        color = AGENT_COLORS[int(agent) % 6]
        ax.plot(rows["round"], rows["tokens"], marker="o", color=color, label=f"agent {agent}: mean tokens")
        cut_ax.plot(rows["round"], rows["cut"], marker="x", linestyle="--", color=color, label=f"agent {agent}: cut")
    if stats.empty:
        _note(ax, "no evaluation yet")
    limit = f" (cut: ran to max_new_tokens = {max_new_tokens})" if max_new_tokens else ""
    ax.set(title="Completions (evaluation draws)", xlabel=f"round{limit}", ylabel="mean completion length (tokens)")
    top = max_new_tokens or (stats["tokens"].max() if not stats.empty else 1)
    ax.set_ylim(0, top * 1.1)  # from 0, so that a few tokens' change does not look like a cliff
    cut_ax.set(ylim=(-0.05, 1.05), ylabel="share cut at max_new_tokens")
    _legend(ax, extra=[cut_ax])


# ------------------------------------------------------------------------------------------------ the figure
def report_figure(run_dir: str | Path, table: pd.DataFrame | None = None) -> Figure:
    """The figure of ``report.png`` (the panels of the module docstring), drawn from the run folder; each panel's
    title says what it shows. Close it with ``matplotlib.pyplot.close``.

    Args:
        run_dir: the run folder (``metrics.parquet`` written, e.g. by
            :func:`~pbrl.reporting.metrics.write_run_metrics`; without it only the evaluation panels are drawn).
        table: the round table, when the caller has it (else read from ``metrics.parquet``).

    Raises:
        ArtifactError: ``metrics.parquet``, a manifest, ``eval.parquet`` or ``items.parquet`` is malformed.
    """
    run_dir = Path(run_dir)
    table = round_table(run_dir) if table is None else table
    config = run_config(run_dir)
    marlhf = config.get("trainer") in MARLHF_TRAINERS if config else "rl_reward" in table
    parts = reward_parts(run_dir, REWARD_PARTS.get(config.get("task") or ""))
    panels: list[Callable[[Axes], None]] = [lambda ax: draw_eval(ax, table), lambda ax: draw_gain(ax, table)]
    if not parts.empty:
        panels.append(lambda ax: draw_parts(ax, parts))
    if RunPaths(run_dir).metrics.is_file():
        steps, ends = train_steps(run_dir), round_ends(run_dir)
        panels += [
            lambda ax: draw_steps(ax, steps, table, ends, marlhf),
            lambda ax: draw_per_round(ax, table, run_dir, marlhf),
        ]
    panels.append(lambda ax: draw_completions(ax, completion_stats(run_dir), config.get("max_new_tokens")))
    if marlhf and "critic_loss" in table and table["critic_loss"].notna().any():
        panels.append(lambda ax: draw_critic(ax, table))
    rows = math.ceil(len(panels) / 3)
    fig, axes = plt.subplots(rows, 3, figsize=(15, 4.6 * rows), layout="constrained", squeeze=False)
    for ax, draw in zip(axes.flat, panels, strict=False):
        draw(ax)
        ax.xaxis.get_major_locator().set_params(integer=True)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    fig.suptitle(title_of(run_dir, config), fontsize=13)
    return fig


def write_report_png(run_dir: str | Path, table: pd.DataFrame | None = None) -> Path:
    """Write :func:`report_figure` as ``<run>/report.png`` (1500 pixels wide).

    Returns:
        ``<run>/report.png``.

    Raises:
        ArtifactError: as :func:`report_figure`.
    """
    fig = report_figure(run_dir, table)
    out = Path(run_dir) / "report.png"
    try:
        fig.savefig(out, dpi=100)
    finally:
        plt.close(fig)
    return out


def _legend(ax: Axes, extra: Sequence[Axes] = ()) -> None:
    """One legend for ``ax`` and its twins, below the plot so that it never covers data; none when nothing is
    labelled (matplotlib warns about an empty legend: a round with no update)."""
    handles, labels = [], []
    for a in (ax, *extra):
        h, lab = a.get_legend_handles_labels()
        handles, labels = handles + h, labels + lab
    if handles:
        ax.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncols=2, fontsize=8, frameon=False)


def _note(ax: Axes, text: str) -> None:
    ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", color="grey", fontsize=9)
