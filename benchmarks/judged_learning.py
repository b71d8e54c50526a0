"""Benchmark: what judged preferences buy, and what noise and a labelling budget cost (issue #51).

The learning benchmark (``benchmarks/learning.py``: the demo's job, SmolLM2 agents on ``humaneval_docs``, its
``standard`` sizes and seeds, 2 rounds) once per setting and seed, with preferences

* ``reward``: ordered by the task reward, as today (counterfactual pairs first, largest gap first);
* ``judge, noise ε``: from the noisy-label simulator (``judge: reward_noisy``, ``judge_label_noise: ε``, both orders
  asked), which prefers the better-rewarded joint response and flips a share ε of its preferences; the pairs to
  ask are the same construction with no scores to order them (counterfactual pairs first, agents in turn, in a
  seeded order);
* ``judge, noise 0, budget b``: at most b pairs judged per round (``judge_max_pairs``), drawn at random from the
  ones kept: half and a quarter of the round's 16 items x 2 pairs;
* ``judge, noise 0.1, budget 1/4, random`` / ``least sure`` (issue #52): a labeller who errs on 10 % of the pairs and
  labels a quarter of them, chosen at random or where the current policies are least sure
  (``judge_pair_choice: uncertain``; round 1 draws at random either way, since the policies are still the reference).

Every setting is evaluated the same way, by the task reward on the 16 held-out problems (the judge decides pairs
only): the paired gain of round r over round 0 on the same draws, with its 95 % item-level interval, and whether
it excludes 0. A setting *learns* on a seed when its round-2 interval lies above 0.

Each (setting, seed) is written to the result as soon as it is done, and a rerun skips the ones its result file
already holds (a killed benchmark continues). Writes ``benchmarks/results/judged-learning-<model>.json``.

Run: ``nice -n 10 .venv/bin/python benchmarks/judged_learning.py`` (6 settings x 3 seeds of ~10 minutes on 2 idle
cores: about 3 hours); ``--settings`` and ``--seeds`` to run fewer.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchkit import RESULTS_DIR, write_result
from learning import CONFIG, SCALES, run_seed, seed_result

from pbrl.config import load_job

PAIRS_PER_ROUND = 16 * 2  # the standard scale's 16 training items x 2 pairs per item
JUDGE = ["preference_source=judge", "judge=reward_noisy"]
SETTINGS: dict[str, list[str]] = {
    "reward": [],
    "judge, noise 0": [*JUDGE, "judge_label_noise=0.0"],
    "judge, noise 0.1": [*JUDGE, "judge_label_noise=0.1"],
    "judge, noise 0.25": [*JUDGE, "judge_label_noise=0.25"],
    "judge, noise 0, budget 1/2": [*JUDGE, f"judge_max_pairs={PAIRS_PER_ROUND // 2}"],
    "judge, noise 0, budget 1/4": [*JUDGE, f"judge_max_pairs={PAIRS_PER_ROUND // 4}"],
    # issue #52: which pairs a label budget asks, with a person who errs (the simulator with noise 0.1)
    "judge, noise 0.1, budget 1/4, random": [
        *JUDGE,
        "judge_label_noise=0.1",
        f"judge_max_pairs={PAIRS_PER_ROUND // 4}",
    ],
    "judge, noise 0.1, budget 1/4, least sure": [
        *JUDGE,
        "judge_label_noise=0.1",
        f"judge_max_pairs={PAIRS_PER_ROUND // 4}",
        "judge_pair_choice=uncertain",
    ],
}


def round_summary(rec: dict[str, Any]) -> dict[str, Any]:
    """One round of a seed's result: the paired gain with its interval and whether it excludes 0."""
    low = rec.get("eval/paired_diff_ci_low")
    return {
        "round": rec["round"],
        "eval_reward": rec.get("eval/reward_mean"),
        "paired_gain": rec.get("eval/paired_diff_mean"),
        "paired_ci": [low, rec.get("eval/paired_diff_ci_high")],
        "excludes_0": None if low is None else low > 0,
        "heldout_pair_accuracy": rec.get("heldout_pair_accuracy"),
        "round_seconds": rec.get("round_seconds"),
    }


def judge_counts(run_dir: Path, rounds: int) -> list[dict[str, Any]]:
    """Per round, the judge-pairs manifest's counts and its agreement with the task reward (judged runs)."""
    from pbrl.data.storage import RunPaths, read_manifest

    out = []
    for r in range(1, rounds + 1):
        m = read_manifest(RunPaths(run_dir), r, "judge-pairs")
        if m is not None:
            out.append({"round": r, **m.counts, "reward_agreement": m.metrics.get("judge/reward_agreement")})
    return out


def summary(done: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per setting, over its seeds: the mean round-2 gain, the seeds whose round-2 interval excludes 0."""
    out = {}
    for name, by_seed in done.items():
        last = [s["rounds"][-1] for s in by_seed.values() if s["rounds"] and s["rounds"][-1]["paired_gain"] is not None]
        out[name] = {
            "seeds": len(by_seed),
            "round_2_gain_mean": statistics.fmean(x["paired_gain"] for x in last) if last else None,
            "round_2_gains": [x["paired_gain"] for x in last],
            "seeds_learning": sum(bool(x["excludes_0"]) for x in last),
        }
    return out


PAGE = Path(__file__).resolve().parent.parent / "docs" / "results" / "judged-learning.md"
TABLE_START = "<!-- table: generated by `python benchmarks/judged_learning.py --page` from the result file -->"
TABLE_END = "<!-- end of the generated table -->"
LABELS = {  # the table's names of the settings
    "reward": "reward-ordered pairs (no judge)",
    "judge, noise 0": "judge, no noise, every pair",
    "judge, noise 0.1": "judge, 10 % noise, every pair",
    "judge, noise 0.25": "judge, 25 % noise, every pair",
    "judge, noise 0, budget 1/2": "judge, no noise, half the pairs",
    "judge, noise 0, budget 1/4": "judge, no noise, a quarter of the pairs",
    "judge, noise 0.1, budget 1/4, random": "judge, 10 % noise, a quarter, at random",
    "judge, noise 0.1, budget 1/4, least sure": "judge, 10 % noise, a quarter, least sure",
}


def _signed(x: float) -> str:
    return f"{x:+.2f}".replace("-", "−")


def table(results: dict[str, dict[str, Any]]) -> str:
    """The results page's table: one row per setting (in :data:`SETTINGS`' order) with its round-2 paired gain per
    seed and 95 % interval, their mean, the seeds whose interval lies above 0, the labels asked in round 2 and the
    judge's agreement with the task reward there. Settings without a seed yet are left out."""
    lines = [
        "| preferences | round-2 paired gain per seed [95 % interval] | mean | seeds learning | labels asked, "
        "round 2 | judge agrees with the reward |",
        "|---|---|---|---|---|---|",
    ]
    for name in SETTINGS:
        by_seed = results.get(name)
        if not by_seed:
            continue
        seeds = sorted(by_seed, key=int)
        last = [by_seed[s]["rounds"][-1] for s in seeds]
        gains = "; ".join(
            f"seed {s}: {_signed(x['paired_gain'])} [{_signed(x['paired_ci'][0])}, {_signed(x['paired_ci'][1])}]"
            for s, x in zip(seeds, last, strict=True)
        )
        mean = _signed(statistics.fmean(x["paired_gain"] for x in last))
        learning = f"{sum(bool(x['excludes_0']) for x in last)} of {len(last)}"
        judged = [j for s in seeds for j in by_seed[s].get("judge", []) if j["round"] == 2]
        asked = "—" if not judged else " / ".join(str(j["questions_asked"]) for j in judged)
        agree = [j["reward_agreement"] for j in judged if j.get("reward_agreement") is not None]
        agreement = "—" if not agree else " / ".join(f"{a:.0%}" for a in agree)
        lines.append(f"| {LABELS[name]} | {gains} | {mean} | {learning} | {asked} | {agreement} |")
    return "\n".join(lines)


def write_page(results: dict[str, dict[str, Any]], page: Path = PAGE) -> None:
    """Replace the generated table of ``page`` (between :data:`TABLE_START` and :data:`TABLE_END`).

    Raises:
        ValueError: the page lacks the markers.
    """
    text = page.read_text(encoding="utf-8")
    head, start, rest = text.partition(TABLE_START)
    _, end, tail = rest.partition(TABLE_END)
    if not (start and end):
        raise ValueError(f"{page}: no generated table ({TABLE_START} ... {TABLE_END})")
    page.write_text(f"{head}{TABLE_START}\n{table(results)}\n{TABLE_END}{tail}", encoding="utf-8")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--settings", nargs="+", choices=SETTINGS, default=list(SETTINGS))
    parser.add_argument("--seeds", type=int, nargs="+", default=list(SCALES["standard"].seeds))
    parser.add_argument("--page", action="store_true", help=f"only rewrite the table of {PAGE.name} from the result")
    args = parser.parse_args()
    scale = SCALES["standard"]
    path = RESULTS_DIR / f"judged-learning-{Path(args.model).name}.json"
    done: dict[str, dict[str, Any]] = json.loads(path.read_text())["results"] if path.is_file() else {}
    if args.page:
        write_page(done)
        print(f"table written: {PAGE}")
        return 0
    started = time.perf_counter()
    for name in args.settings:
        for seed in args.seeds:
            if str(seed) in done.get(name, {}):
                continue  # measured by an earlier run of this script
            out = Path(tempfile.mkdtemp(prefix="pbrl-judged-"))
            try:
                options = [f"agent_model={args.model}", *scale.overrides("humaneval_docs"), *SETTINGS[name]]
                job = load_job(CONFIG, [*options, f"seed={seed}", "run_name=judged", f"output_dir={out}"])
                print(f"=== {name}, seed {seed}", flush=True)
                run_dir = run_seed(job)
                res = seed_result(run_dir, job)
                done.setdefault(name, {})[str(seed)] = {
                    "rounds": [round_summary(r) for r in res["rounds"]],
                    "judge": judge_counts(run_dir, job.num_iterations),
                }
                last = done[name][str(seed)]["rounds"][-1]
                print(f"    round 2 gain {last['paired_gain']:+.3f} {last['paired_ci']}", flush=True)
            finally:
                shutil.rmtree(out, ignore_errors=True)
            write_result("judged-learning", args.model, {
                "config": str(CONFIG.name), "scale": "standard", "settings": SETTINGS, "results": done,
                "summary": summary(done), "method": __doc__.split("\n\n", 1)[1].split("\n\nRun:")[0],
                "seconds_this_invocation": round(time.perf_counter() - started, 1),
            })  # fmt: skip
    for name, row in summary(done).items():
        print(
            f"{name:28s} round-2 gain {row['round_2_gain_mean']}  learning seeds {row['seeds_learning']}/{row['seeds']}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
