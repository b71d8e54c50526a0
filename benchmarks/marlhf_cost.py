"""Benchmark: what a MARLHF round costs beside a MADPO demo round on the same machine, items and sizes.

Runs ``benchmarks/round.py`` (one round, stages called in one process, each stage's wall seconds and the process's
peak RSS) for the demo (``flows/configs/demo.yaml``, MADPO-iterative) and for ``flows/configs/marlhf-docs.yaml``
(MARLHF-iterative at the demo's sizes: 16 training problems, 16 x 2 evaluation draws, 3 candidates, 48 new tokens),
one after the other in fresh processes, alternating for ``--repeats`` (so a slow period of the machine hits both).
Reports per trainer the median round-1 seconds and each stage's, the ratio MARLHF / MADPO (issue #30: <= 2), and
evaluate's round-1 / round-0 seconds (an RL round must not make evaluation slower).

Writes ``benchmarks/results/marlhf-cost-<model>.json``. Run: ``python benchmarks/marlhf_cost.py`` (about 15 min per
repeat on 2 idle CPU cores).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from benchkit import REPO_ROOT, RESULTS_DIR, check, print_checks, write_result

CONFIGS = {"madpo_iter": "flows/configs/demo.yaml", "marlhf_iter": "flows/configs/marlhf-docs.yaml"}
TARGET_RATIO = 2.0


def one_round(trainer: str, model: str, repeat: int) -> dict:
    name = f"marlhf-cost-{trainer}-{repeat}"
    subprocess.run(
        [sys.executable, str(REPO_ROOT / "benchmarks" / "round.py"), "--model", model, "--config",
         str(REPO_ROOT / CONFIGS[trainer]), "--result", name],
        check=True,
    )  # fmt: skip
    path = RESULTS_DIR / f"{name}-{Path(model).name}.json"
    result = json.loads(path.read_text())
    path.unlink()  # the summary below keeps what matters
    return result


def stage_seconds(result: dict) -> dict[str, float]:
    return {f"{s['round']}/{s['stage']}": s["seconds"] for s in result["stages"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {t: [] for t in CONFIGS}
    for repeat in range(args.repeats):
        order = list(CONFIGS) if repeat % 2 == 0 else list(reversed(CONFIGS))
        for trainer in order:
            runs[trainer].append(one_round(trainer, args.model, repeat))
    summary = {}
    for trainer, results in runs.items():
        per_stage = [stage_seconds(r) for r in results]
        summary[trainer] = {
            "config": CONFIGS[trainer],
            "round_1_seconds": statistics.median(r["round_1_seconds"] for r in results),
            "peak_rss_gb": max(r["peak_rss_gb"] for r in results),
            "stages": {k: statistics.median(p[k] for p in per_stage) for k in per_stage[0]},
            "samples_round_1_seconds": [r["round_1_seconds"] for r in results],
            "workload": results[0]["workload"],
        }
    ratio = summary["marlhf_iter"]["round_1_seconds"] / summary["madpo_iter"]["round_1_seconds"]
    evaluate = {
        t: round(s["stages"]["1/evaluate"] / s["stages"]["0/evaluate"], 3) for t, s in summary.items()
    }  # round-1 evaluate / round-0 evaluate
    checks = [
        {
            **check("marlhf-cost: MARLHF / MADPO round-1 s", round(ratio, 3), TARGET_RATIO, higher_is_better=False),
            "applies": args.model == "smollm2-135m-instruct",
        }
    ]
    for trainer, s in summary.items():
        print(f"{trainer}: round 1 {s['round_1_seconds']:.0f} s, peak RSS {s['peak_rss_gb']:.2f} GiB")
        for stage, seconds in s["stages"].items():
            print(f"  {stage:22s} {seconds:8.1f} s")
    print(f"evaluate round 1 / round 0: {evaluate}")
    path = write_result(
        "marlhf-cost",
        Path(args.model).name,
        {
            "repeats": args.repeats,
            "summary": summary,
            "marlhf_over_madpo": round(ratio, 3),
            "evaluate_round1_over_round0": evaluate,
            "method": __doc__.split("\n\n", 1)[1].split("\n\nWrites")[0],
            "checks": checks,
        },
    )
    print_checks("marlhf-cost", checks, Path(path))


if __name__ == "__main__":
    main()
