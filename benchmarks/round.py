"""Benchmark: one demo round, stage by stage, with the process's peak RSS after each stage.

The demo's configuration (``flows/configs/demo.yaml``: 2 agents, LoRA r=8, ``humaneval_docs``, 16 training
problems seen once, 16 x 2 evaluation draws, 3 candidates, 48 new tokens) with one iteration, run as plain
stage calls in this one process (no Prefect, so the times are the stages' own): round 0's baseline
evaluation, then round 1's stages in the flow's order. For each stage: wall seconds and the peak RSS of the
process so far (``ru_maxrss``, a lifetime high-water mark in MiB, the number ``pbrl train`` reports in its
round table). Targets (issue #14): round 1 in <= 180 s wall on the 2-core machine when otherwise idle, peak
RSS <= 2.5 GiB. ``--model`` replaces the demo's agent model (``tiny-random`` checks the script in seconds;
its targets are information only).

Run: ``.venv/bin/python benchmarks/round.py --model smollm2-135m-instruct``.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from benchkit import REPO_ROOT, check, peak_rss_mb, print_checks, write_result

from pbrl.config import load_job
from pbrl.run.folder import prepare_run
from stages import STAGE_MODULES

DEMO = REPO_ROOT / "flows" / "configs" / "demo.yaml"
ROUND_STAGES = (
    "sample-candidates",
    "score-with-oracle",
    "build-pairs",
    "store-round",
    "replay-select",
    "update-policies",
    "evaluate",
)
TARGET_ROUND_S = 180.0
TARGET_PEAK_GB = 2.5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="packaged alias or model folder")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a demo option (repeatable), e.g. --set num_train_epochs=2",
    )
    args = parser.parse_args()
    # The targets are the demo's, on SmolLM2: a run with other options is information only.
    applies = args.model == "smollm2-135m-instruct" and not args.overrides
    stages: list[dict] = []
    with tempfile.TemporaryDirectory() as out:
        # The user's options first: the folder, the single round and --model are the benchmark's own.
        job = load_job(
            DEMO,
            [
                *args.overrides,
                f"output_dir={out}",
                "run_name=bench-round",
                "num_iterations=1",
                f"agent_model={args.model}",
            ],
        )
        start = time.perf_counter()
        run_dir = prepare_run(job, resume=False)
        stages.append(
            {
                "round": 0,
                "stage": "prepare-run",
                "seconds": round(time.perf_counter() - start, 3),
                "peak_rss_mb": peak_rss_mb(),
            }
        )
        for round_index, names in ((0, ("evaluate",)), (1, ROUND_STAGES)):
            for name in names:
                start = time.perf_counter()
                manifest = STAGE_MODULES[name].run(run_dir, round_index, job)
                stages.append(
                    {
                        "round": round_index,
                        "stage": name,
                        "seconds": round(time.perf_counter() - start, 3),
                        "peak_rss_mb": peak_rss_mb(),
                        "counts": manifest.counts,
                    }
                )
                print(
                    f"[round] round {round_index} {name:18s} {stages[-1]['seconds']:8.2f} s  "
                    f"peak RSS {stages[-1]['peak_rss_mb']:8.1f} MiB",
                    flush=True,
                )
    round_s = sum(s["seconds"] for s in stages if s["round"] == 1)
    peak_gb = max(s["peak_rss_mb"] for s in stages) / 1024
    checks = [
        {
            **check("round: demo round 1 wall seconds", round(round_s, 1), TARGET_ROUND_S, higher_is_better=False),
            "applies": applies,
        },
        {
            **check("round: peak RSS of the process (GiB)", round(peak_gb, 3), TARGET_PEAK_GB, higher_is_better=False),
            "applies": applies,
        },
    ]
    # A run with overrides is written beside the demo's result, never over it.
    path = write_result(
        "round-overrides" if args.overrides else "round",
        args.model,
        {
            "workload": {
                "config": str(DEMO.relative_to(REPO_ROOT)),
                "overrides": ["num_iterations=1", *args.overrides],
                "agent_model": args.model,
                "threads": os.environ.get("OMP_NUM_THREADS", "default"),
            },
            "stages": stages,
            "round_1_seconds": round(round_s, 3),
            "peak_rss_gb": round(peak_gb, 3),
            "method": "One run; stages called directly in one process (no Prefect, no cache); peak RSS is the "
            "process's ru_maxrss after each stage (a lifetime high-water mark).",
            "checks": checks,
        },
    )
    print_checks("round", checks, Path(path))


if __name__ == "__main__":
    main()
