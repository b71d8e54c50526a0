"""Benchmark: does one setting learn differently from another? The gap in paired gain between two sets of runs.

Issue #33 asks whether the bfloat16 defaults learn as float32 does: each bfloat16 seed's round-2 paired gain should lie
within the float32 run's interval of the same seed. The two precisions sample other tokens from round 0 on, so each
seed's two gains are two draws of a noisy quantity, and a point outside the other's interval can be chance. This
script measures the gap itself, with its interval, from run folders kept by ``benchmarks/learning.py --keep`` (one
folder per seed and setting; the same job but for the setting, so the same held-out items and sample seeds).

For a seed and a round r >= 1, over the held-out draws (item, sample) that the four evaluations all scored (A at
rounds r and 0, B at rounds r and 0):

    gap = mean over the draws of (A_r - A_0) - (B_r - B_0)

with the item-level percentile bootstrap interval of ``pbrl.reporting.stats`` (per item the mean over its draws,
then 10,000 resamples of the items). The round-0 terms take each run's own starting point out, as the paired gain
does. Pooled over seeds, each item's mean runs over all seeds' draws, and the bootstrap resamples the items: the
seeds share the held-out items. An interval that holds 0 says that these runs cannot tell the two settings apart;
one that excludes 0 says that A gains more (or less) than B at these sizes.

Per seed it also gives each run's paired gain with its interval (from the evaluate stage's manifest) and whether A's
gain lies within B's interval, the issue's literal criterion. The item-level interval covers the evaluation's noise,
not the training's: two runs that sample other tokens train on other pairs. ``--across-seeds`` pairs runs of
different seeds, so that one setting against itself (A = seeds 0..n-1, B = seeds 1..n-1, 0) shows how far two
trainings of the same setting lie apart (the pooled gap of such a cyclic pairing is 0 by construction).

Run: ``.venv/bin/python benchmarks/learning_gap.py --a BF16_SEED0 BF16_SEED1 ... --b F32_SEED0 F32_SEED1 ...
--names bfloat16 float32 --result learning-gap-bfloat16-float32`` (folders paired by seed). Writes
``benchmarks/results/<result>-<task>.json``.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from benchkit import write_result

from pbrl.data.schema import EVAL
from pbrl.data.storage import RunPaths, read_manifest
from pbrl.data.tables import read_rows
from pbrl.reporting.stats import Interval, SampleKey, mean_interval
from pbrl.run.folder import open_job
from stages.evaluate import rewards_by_draw

BASELINE = 0
GAP_SEED = 33  # the bootstrap's seed (issue #33); the same seed gives the same interval


def gain_gap(
    a_now: Mapping[SampleKey, float],
    a_base: Mapping[SampleKey, float],
    b_now: Mapping[SampleKey, float],
    b_base: Mapping[SampleKey, float],
    *,
    seed: int = GAP_SEED,
) -> Interval:
    """Mean of ``(a_now - a_base) - (b_now - b_base)`` over the draws all four hold, with the item-level interval.

    Args:
        a_now, a_base, b_now, b_base: ``{(item_id, sample): reward}`` of four evaluations of the same items and
            sample seeds (rewards in the task's units; a failed draw is simply absent).
        seed: the bootstrap's seed.

    Returns:
        The gap in the rewards' units; ``n`` is the number of items with a shared draw.

    Raises:
        ValueError: the four share no draw (naming how many each holds).
    """
    shared = [key for key in a_now if key in a_base and key in b_now and key in b_base]
    if not shared:
        sizes = ", ".join(str(len(x)) for x in (a_now, a_base, b_now, b_base))
        raise ValueError(f"gain_gap: the four evaluations share no (item, sample) draw (they hold {sizes})")
    gaps = {key: (a_now[key] - a_base[key]) - (b_now[key] - b_base[key]) for key in shared}
    return mean_interval(gaps, seed=seed)


def eval_rewards(run_dir: Path, round_index: int) -> dict[SampleKey, float]:
    """``{(item_id, sample): reward}`` of a run's round evaluation.

    Raises:
        FileNotFoundError: naming the round's eval table, when that round was not evaluated.
    """
    path = RunPaths(run_dir).eval(round_index)
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir}: round {round_index} was not evaluated ({path} is missing)")
    return rewards_by_draw(read_rows(path, EVAL))


def evaluated_gains(run_dir: Path, num_iterations: int) -> dict[int, dict[str, float]]:
    """``{round: paired gain over round 0}`` of the rounds from 1 on whose evaluation finished (its manifest
    written), as the evaluate stage recorded them, each manifest read once."""
    paths = RunPaths(run_dir)
    manifests = {r: read_manifest(paths, r, "evaluate") for r in range(1, num_iterations + 1)}
    return {
        r: {k: m.metrics[f"eval/paired_diff_{k}"] for k in ("mean", "ci_low", "ci_high")}
        for r, m in manifests.items()
        if m is not None
    }


def interval_dict(x: Interval) -> dict[str, float]:
    return {"mean": x.mean, "ci_low": x.low, "ci_high": x.high, "items": x.n}


def compare(a_dirs: list[Path], b_dirs: list[Path], *, across_seeds: bool = False) -> dict[str, Any]:
    """Per seed and round, the gap of A's gain over B's, each run's gain and whether A's lies within B's interval;
    per round, the gap pooled over the pairs of folders (draw keys ``pair:sample`` within an item, so that two pairs
    of one seed count twice rather than overwrite each other).

    ``across_seeds``: pair runs of different seeds (one setting against itself, seed 0 against seed 1 and so on):
    the spread of the gap between two trainings that sample other tokens, the yardstick for a gap between settings.

    Raises:
        ValueError: the lists differ in length, or (without ``across_seeds``) a pair of folders holds different
            seeds, naming both.
    """
    if len(a_dirs) != len(b_dirs):
        raise ValueError(f"--a has {len(a_dirs)} run folders and --b {len(b_dirs)}: give one of each per seed")
    seeds, pooled = [], {}
    for index, (a, b) in enumerate(zip(a_dirs, b_dirs, strict=True)):
        job_a, job_b = open_job(a), open_job(b)
        seed_a, seed_b = job_a.seed, job_b.seed
        if seed_a != seed_b and not across_seeds:
            raise ValueError(f"{a} has seed {seed_a} and {b} seed {seed_b}: pair the folders by seed")
        a0, b0 = eval_rewards(a, BASELINE), eval_rewards(b, BASELINE)
        gains_a, gains_b = evaluated_gains(a, job_a.num_iterations), evaluated_gains(b, job_b.num_iterations)
        rounds = []
        for r in sorted(gains_a.keys() & gains_b.keys()):
            ar, br = eval_rewards(a, r), eval_rewards(b, r)
            gain_a, gain_b = gains_a[r], gains_b[r]
            rounds.append(
                {
                    "round": r,
                    "gap": interval_dict(gain_gap(ar, a0, br, b0)),
                    "gain_a": gain_a,
                    "gain_b": gain_b,
                    "a_within_b_interval": gain_b["ci_low"] <= gain_a["mean"] <= gain_b["ci_high"],
                }
            )
            for name, values in (("a_now", ar), ("a_base", a0), ("b_now", br), ("b_base", b0)):
                side = pooled.setdefault(r, {}).setdefault(name, {})
                side.update({(item, f"{index}:{s}"): v for (item, s), v in values.items()})
        seeds.append({"seed": seed_a, "seed_b": seed_b, "a": str(a), "b": str(b), "rounds": rounds})
    together = [{"round": r, "gap": interval_dict(gain_gap(**sides))} for r, sides in sorted(pooled.items())]
    return {"seeds": seeds, "pooled": together}


def print_report(result: dict[str, Any], names: tuple[str, str]) -> None:
    a, b = names
    print(f"seed | round | gain {a} [95 % CI] | gain {b} [95 % CI] | {a} within {b}'s | gap {a} - {b} [95 % CI]")
    for row in result["seeds"]:
        for x in row["rounds"]:
            ga, gb, gap = x["gain_a"], x["gain_b"], x["gap"]
            seed = row["seed"] if row["seed"] == row["seed_b"] else f"{row['seed']}/{row['seed_b']}"
            print(
                f"  {seed} | {x['round']} | {ga['mean']:+.2f} [{ga['ci_low']:+.2f}, {ga['ci_high']:+.2f}] | "
                f"{gb['mean']:+.2f} [{gb['ci_low']:+.2f}, {gb['ci_high']:+.2f}] | "
                f"{'yes' if x['a_within_b_interval'] else 'no'} | "
                f"{gap['mean']:+.2f} [{gap['ci_low']:+.2f}, {gap['ci_high']:+.2f}]"
            )
    for x in result["pooled"]:
        gap = x["gap"]
        print(
            f"  pooled | {x['round']} | | | | {gap['mean']:+.2f} [{gap['ci_low']:+.2f}, {gap['ci_high']:+.2f}] "
            f"over {gap['items']} items"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--a", nargs="+", type=Path, required=True, help="setting A's run folders, one per seed")
    parser.add_argument("--b", nargs="+", type=Path, required=True, help="setting B's run folders, the same seeds")
    parser.add_argument("--names", nargs=2, default=("a", "b"), metavar=("A", "B"), help="the settings' names")
    parser.add_argument("--result", default="learning-gap", help="result name")
    parser.add_argument(
        "--across-seeds", action="store_true", help="pair folders of different seeds (a setting against itself)"
    )
    args = parser.parse_args()
    result = compare(args.a, args.b, across_seeds=args.across_seeds)
    print_report(result, tuple(args.names))
    task = open_job(args.a[0]).task or "task"
    path = write_result(
        args.result,
        task,
        {"names": {"a": args.names[0], "b": args.names[1]}, **result, "method": __doc__.split("\n\n", 1)[1]},
    )
    print(f"result: {path}")


if __name__ == "__main__":
    main()
