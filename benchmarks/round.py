"""Benchmark: one demo round, stage by stage, with the process's peak RSS after each stage.

The demo's configuration (``flows/configs/demo.yaml``: 2 agents, LoRA r=8, ``humaneval_docs``, 16 training
problems seen once, 16 x 2 evaluation draws, 3 candidates, 48 new tokens) with one iteration, run as plain
stage calls in this one process (no Prefect, so the times are the stages' own): round 0's baseline
evaluation, then round 1's stages in the flow's order. For each stage: wall seconds and the peak RSS of the
process so far (``ru_maxrss``, a lifetime high-water mark in MiB, the number ``pbrl train`` reports in its
round table). Targets (issue #14): round 1 in <= 180 s wall on the 2-core machine when otherwise idle, peak
RSS <= 2.5 GiB; issue #33: <= 120 s with the new defaults. ``--model`` replaces the demo's agent model
(``tiny-random`` checks the script in seconds; its targets are information only). ``--dynamic-cache`` samples with
transformers' own KV cache instead of pbrl's preallocated one (the lever of issue #33, for
``benchmarks/round_levers.py``, which runs this script once per lever setting, interleaved);
``--full-vocab-sampler`` warps and draws over the whole vocabulary as before the top-k path
(``pbrl.generation.seeded_sampler``); ``--every-phase-one`` asks every MADPO agent that is not idle for its detached
margins, as before ``pbrl.learning.madpo.phase_one_agents`` (which asks only those another agent's gradient needs);
``--strided-head`` hands the LM head transformers' strided last-position view, as before ``pbrl.models.head_input``;
``--batched-rows`` samples bfloat16 rows in padded batches whose bits depend on the batch, as before
``pbrl.models.row_invariance`` (issue #50); ``--pinned-threads`` keeps a bfloat16 job's thread count at the CPUs it
owns throughout, as before its row-invariant sampling and evaluation followed the load (issue #57).
``--config`` times another job's round with its trainer's stages (``benchmarks/marlhf_cost.py`` times MARLHF's beside
MADPO's).

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
from pbrl.models import thread_placement
from pbrl.run.folder import open_job, prepare_run
from pbrl.run.judging import round_stages
from pbrl.run.settings import configure_job_threads
from stages import STAGE_MODULES

DEMO = REPO_ROOT / "flows" / "configs" / "demo.yaml"
TARGET_ROUND_S = 120.0  # issue #33 (issue #14 asked for 180 s)
TARGET_PEAK_GB = 2.5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="packaged alias or model folder")
    parser.add_argument("--config", type=Path, default=DEMO, help="the job (default the demo's); its trainer's stages")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a demo option (repeatable), e.g. --set num_train_epochs=2",
    )
    parser.add_argument("--dynamic-cache", action="store_true", help="transformers' KV cache (issue #33's baseline)")
    parser.add_argument(
        "--full-vocab-sampler", action="store_true", help="the seeded sampler over the whole vocabulary (issue #33)"
    )
    parser.add_argument(
        "--every-phase-one", action="store_true", help="detached margins from every MADPO agent that is not idle"
    )
    parser.add_argument(
        "--strided-head", action="store_true", help="the LM head as transformers calls it (pbrl.models.head_input off)"
    )
    parser.add_argument(
        "--batched-rows",
        action="store_true",
        help="bfloat16 rows sampled in padded batches, as before row-invariant forwards (issue #50)",
    )
    parser.add_argument(
        "--pinned-threads",
        action="store_true",
        help="a bfloat16/float16 job keeps the owned thread count throughout, as before issue #57",
    )
    parser.add_argument("--result", default=None, help="result file name (default round / round-overrides)")
    args = parser.parse_args()
    if args.full_vocab_sampler:  # the sampler before its top-k path: transformers' warpers over every id
        import functools

        from pbrl.generation import sampling
        from pbrl.generation.seeded_sampler import SeededSampler

        sampling.SeededSampler = functools.partial(SeededSampler, subset=False)
    if args.dynamic_cache:  # the sampling path before issue #33: a cache that copies itself at every token
        from transformers import DynamicCache

        from pbrl.generation import sampling

        sampling.preallocated_cache = lambda model, capacity: DynamicCache(config=model.config)
    if args.every_phase_one:  # phase 1 before it was pruned: every agent with a pair whose sides differ
        from pbrl.learning import madpo

        madpo.phase_one_agents = lambda differs: [any(row) for row in differs]
    if args.strided_head:  # before 2026-12-05: a bfloat16 head copied once per row on a strided input
        from pbrl.models import loading

        loading.contiguous_head_input = lambda model: model
    if args.batched_rows:  # before 2026-12-06: low-precision rows batched, their bits depending on the batch
        from pbrl.models import row_invariance

        row_invariance.applies = lambda model: False
    # The targets are the demo's, on SmolLM2: a run with other options is information only.
    levers_off = (
        args.dynamic_cache
        or args.full_vocab_sampler
        or args.every_phase_one
        or args.strided_head
        or args.batched_rows
        or args.pinned_threads
    )
    applies = args.model == "smollm2-135m-instruct" and not args.overrides and not levers_off and args.config == DEMO
    stages: list[dict] = []
    with tempfile.TemporaryDirectory() as out:
        # The user's options first: the folder, the single round and --model are the benchmark's own.
        job = load_job(
            args.config,
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
        job = open_job(run_dir)  # as the flow runs it: 'auto' precision made concrete for this machine
        configure_job_threads(job)
        if args.pinned_threads:  # before issue #57: no follower where the job computes in low precision
            from pbrl.models import threads

            if threads._follower is not None and threads._follower.pinned:
                threads._follower = None
        stages.append(
            {
                "round": 0,
                "stage": "prepare-run",
                "seconds": round(time.perf_counter() - start, 3),
                "peak_rss_mb": peak_rss_mb(),
            }
        )
        for round_index, names in ((0, ("evaluate",)), (1, round_stages(job, run_dir))):
            for name in names:
                start = time.perf_counter()
                with thread_placement.pinning():  # as flows/cache.py runs a stage
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
        args.result or ("round-overrides" if args.overrides or levers_off or args.config != DEMO else "round"),
        args.model,
        {
            "workload": {
                "config": str(args.config.resolve().relative_to(REPO_ROOT)),
                "trainer": job.trainer,
                "overrides": ["num_iterations=1", *args.overrides],
                "agent_model": args.model,
                "threads": os.environ.get("OMP_NUM_THREADS", "default"),
                "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
                "torch_threads": __import__("torch").get_num_threads(),
                "kv_cache": "transformers DynamicCache" if args.dynamic_cache else "pbrl preallocated",
                "sampler": "full vocabulary" if args.full_vocab_sampler else "top-k subset",
                "madpo_phase_one": "every agent not idle" if args.every_phase_one else "agents others need",
                "lm_head_input": "strided (transformers' own)" if args.strided_head else "contiguous in bf16/fp16",
                "low_precision_threads": "owned count (before)" if args.pinned_threads else "follow the load",
                "torch_dtype": job.torch_dtype,
                "mixed_precision": job.mixed_precision,
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
