"""Benchmark: how much of a demo round is matrix products and attention, the floor of its time on this device.

The demo's round 0 evaluation and round 1 (``flows/configs/demo.yaml``, one iteration, stages called in this one
process as ``benchmarks/round.py`` calls them), each stage under ``torch.profiler``: its wall seconds, the CPU seconds
of every operator, and those of the kernels that do the arithmetic: matrix products (``aten::mm``, ``bmm``,
``addmm``) and attention (torch's CPU flash attention, forward and backward). The kernels' seconds are the time the
round would take if everything else (Python, the small elementwise operators, the sampler, I/O) took none, at the
speed these kernels run on this machine: a floor that no change short of fewer operations or faster kernels goes
under. Issue #33 asks for a demo round of at most 120 s; on a CPU without bfloat16 arithmetic, the float32 kernels
alone decide whether that is reachable. The profiler adds time per operator, so the walls here are longer than
``benchmarks/round.py``'s; the kernel seconds are the kernels' own.

Round 1 trains on ``--train-items`` of the demo's 16 training problems (default 4): summarising the profile of a
whole 16-problem sampling stage took more than 18 GiB. The stages whose work is per training problem (all of round 1
but its evaluation) are scaled to the demo's count; the evaluations run at the demo's size. Sampling is linear in
the problems: unprofiled, 4 problems took 21 s and 16 took 85 s on the same machine. ``--set`` changes the round
accounted for (its ``task_options`` too); ``--train-items`` only how much of round 1 is profiled. The floor holds for
these batch shapes (the job's ``generation_batch_size``, one pair per training forward) and this thread count: other
shapes run the kernels at other speeds.

Run: ``.venv/bin/python benchmarks/round_kernels.py --model smollm2-135m-instruct`` (about 5 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from benchkit import REPO_ROOT, check, print_checks, write_result
from torch.profiler import ProfilerActivity, profile

from pbrl.config import JobConfig, load_job
from pbrl.run.folder import open_job, prepare_run
from pbrl.run.judging import round_stages
from pbrl.run.settings import configure_job_threads
from stages import STAGE_MODULES

DEMO = REPO_ROOT / "flows" / "configs" / "demo.yaml"
TARGET_ROUND_S = 120.0  # issue #33
PRODUCTS = ("aten::mm", "aten::bmm", "aten::addmm")
ATTENTION = (
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
)


def profiled_stage(name: str, run_dir: Path, round_index: int, job: JobConfig) -> dict:
    """Run one stage under the profiler: wall seconds, every operator's CPU seconds, the kernels' seconds."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()  # inside: the profiler's own start and stop are not the stage's
        STAGE_MODULES[name].run(run_dir, round_index, job)
        wall = time.perf_counter() - start
    events = prof.key_averages()
    own = {e.key: e.self_cpu_time_total / 1e6 for e in events}
    products = sum(own.get(k, 0.0) for k in PRODUCTS)
    attention = sum(own.get(k, 0.0) for k in ATTENTION)
    return {
        "round": round_index,
        "stage": name,
        "wall_s": round(wall, 4),
        "operators_s": round(sum(own.values()), 4),
        "products_s": round(products, 4),
        "attention_s": round(attention, 4),
        "attention_backward_s": round(own.get(ATTENTION[1], 0.0), 4),  # part of attention_s
        "kernels_share_of_wall": round((products + attention) / wall, 3) if wall else 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="packaged alias or model folder")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--train-items", type=int, default=4, help="training problems profiled (scaled to the demo's)")
    parser.add_argument("--result", default="round-kernels", help="result file name")
    args = parser.parse_args()
    demo = load_job(DEMO, args.overrides).task_options  # the round to account for, the user's overrides included
    items = f"task_options={{num_train_items: {args.train_items}, num_eval_items: {demo['num_eval_items']}}}"
    with tempfile.TemporaryDirectory() as out:
        job = load_job(
            DEMO,
            [*args.overrides, items, f"output_dir={out}", "run_name=kernels", "num_iterations=1",
             f"agent_model={args.model}"],
        )  # fmt: skip
        profiled = job.task_options["num_train_items"]
        scale = demo["num_train_items"] / profiled
        run_dir = prepare_run(job, resume=False)
        job = open_job(run_dir)  # 'auto' precision made concrete for this machine
        configure_job_threads(job)
        stages = []
        for round_index, names in ((0, ("evaluate",)), (1, round_stages(job, run_dir))):
            for name in names:
                stage = profiled_stage(name, run_dir, round_index, job)
                stage["scale"] = scale if round_index == 1 and name != "evaluate" else 1.0
                stages.append(stage)
                print(f"[round-kernels] {stage}", flush=True)
    round_1 = [s for s in stages if s["round"] == 1]
    floor = sum((s["products_s"] + s["attention_s"]) * s["scale"] for s in round_1)
    applies = args.model == "smollm2-135m-instruct" and not args.overrides
    checks = [
        {
            **check("round kernels: round 1 in products and attention, s", round(floor, 1), TARGET_ROUND_S, False),
            "applies": applies,
        }
    ]
    path = write_result(
        args.result,
        args.model,
        {
            "workload": {"config": "flows/configs/demo.yaml", "overrides": ["num_iterations=1", *args.overrides, items],
                         "torch_dtype": job.torch_dtype, "mixed_precision": job.mixed_precision},
            "stages": stages,
            "round_1_kernels_s": round(floor, 1),
            "round_1_profiled_wall_s": round(sum(s["wall_s"] * s["scale"] for s in round_1), 1),
            "train_items": {"profiled": profiled, "demo": demo["num_train_items"]},
            "method": "One run; each stage under torch.profiler (CPU); operators' self CPU seconds on the calling "
            "thread (an intra-op parallel kernel counts its wall time there, not its threads' sum); round 1's stages "
            "but its evaluation are multiplied by 'scale', the demo's training problems over those profiled.",
            "checks": checks,
        },
    )  # fmt: skip
    print_checks("round-kernels", checks, Path(path))


if __name__ == "__main__":
    main()
