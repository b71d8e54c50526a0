"""``pbrl report``: the round table and a PNG of eval reward and the training loss per round (MADPO, or
MARLHF's reward model)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from pbrl.reporting.metrics import round_table  # noqa: E402


def draw_interval(ax, table: pd.DataFrame, low: str, high: str, color: str, label: str) -> None:
    """Shade ``table[low]..table[high]`` per round (rounds without both ends are skipped)."""
    if low not in table or high not in table:
        return
    band = table[[low, high]].dropna()
    if not band.empty:
        ax.fill_between(band.index, band[low].values, band[high].values, color=color, alpha=0.2, label=label)
        ax.vlines(band.index, band[low].values, band[high].values, color=color, alpha=0.6)


def write_report_png(run_dir: str | Path, table: pd.DataFrame | None = None) -> Path:
    """Plot eval reward with its 95 % interval, the round-0 baseline plus the paired gain and its interval,
    and training loss / accuracy per round.

    Returns:
        ``<run>/report.png``.
    """
    run_dir = Path(run_dir)
    table = round_table(run_dir) if table is None else table
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ev = table["eval_reward"].dropna()
    ax1.plot(ev.index, ev.values, marker="o", label="eval reward (task reward)")
    draw_interval(ax1, table, "eval_lo", "eval_hi", "tab:blue", "95 % interval")
    if 0 in ev.index:
        ax1.axhline(ev.loc[0], color="grey", linestyle="--", label="round 0 baseline")
        paired = table.get("paired")
        if paired is not None and paired.notna().any():  # the paired gain, on the reward scale
            gain = ev.loc[0] + paired.dropna()
            ax1.plot(
                gain.index, gain.values, marker="D", color="tab:purple", linestyle=":", label="round 0 + paired gain"
            )
            lo, hi = table["paired_lo"] + ev.loc[0], table["paired_hi"] + ev.loc[0]
            draw_interval(
                ax1, pd.DataFrame({"lo": lo, "hi": hi}), "lo", "hi", "tab:purple", "paired gain 95 % interval"
            )
    # MADPO: its loss and pair accuracy; MARLHF: the reward model's Bradley–Terry loss and held-out accuracy.
    loss_col, acc_col, loss_label, acc_label = "loss", "accuracy", "MADPO loss", "accuracy"
    if "rm_loss" in table and table["rm_loss"].notna().any() and not table["loss"].notna().any():
        loss_col, acc_col = "rm_loss", "rm_heldout_accuracy"
        loss_label, acc_label = "reward-model loss", "reward-model held-out accuracy"
    tr = table.get(loss_col)
    ax1.set(title="Evaluation reward per round", xlabel="round", ylabel="mean reward")
    _legend(ax1, loc="best")
    if tr is not None and tr.notna().any():
        ax2.plot(tr.dropna().index, tr.dropna().values, marker="o", color="tab:red", label=loss_label)
        ax2.set(ylabel="loss (nats)")
    acc = table.get(acc_col)
    if acc is not None and acc.notna().any():
        ax3 = ax2.twinx()
        ax3.plot(acc.dropna().index, acc.dropna().values, marker="s", color="tab:green", label=acc_label)
        ax3.set(ylabel="pair accuracy", ylim=(0, 1))
        _legend(ax3, loc="lower right")
    ax2.set(title="Training per round", xlabel="round")
    _legend(ax2, loc="upper right")
    for ax in (ax1, ax2):
        ax.xaxis.get_major_locator().set_params(integer=True)
    fig.suptitle(run_dir.name)
    fig.tight_layout()
    out = run_dir / "report.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def _legend(ax, **kwargs) -> None:  # type: ignore[no-untyped-def]
    """A legend only where something is labelled (matplotlib warns about an empty one: a round with no update)."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(**kwargs)
