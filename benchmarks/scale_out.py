"""Benchmark: the sharded stages on Ray (``runner: ray``, 1 and 2 Ray workers) against ``runner: local``.

In one process, with an isolated Prefect home, on one prepared run folder: for each sharded stage
(sample-candidates and score-with-oracle of round 1, evaluate of round 0) the stage is run through
``flows.round.call_stage`` (forced: never Cached) with ``runner: local`` and with ``runner: ray`` on a local Ray
of N CPUs (N = 1, then 2; one Ray worker per CPU), interleaved (``benchkit.interleaved``: a warm-up, then
``repeats`` rounds). The Ray side deletes the stage's shard files before each call, so every shard is
computed. Both sides write the same artifact; the script checks that the bytes are equal.

Reported: the median stage time per case, the ratio ray-N / local from the same block (> 1: slower than local),
the driver's peak RSS and the Ray workers' RSS after each block. On a 2-core machine the point is the
overhead (Ray task submission, Prefect task runs for each shard, each shard loading the checkpoint), not a
speed-up: with 2 cores the local side already uses both for its matrix products.

Run: ``.venv/bin/python benchmarks/scale_out.py`` (the tiny model); ``--model smollm2-135m-instruct`` for
SmolLM2 (prepared first with ``pbrl models prepare smollm2-135m-instruct``).
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import tempfile
from pathlib import Path
from typing import Any

from benchkit import REPO_ROOT, check, interleaved, peak_rss_mb, print_checks, ratio, summary, write_result
from orchestration import isolate_prefect

CONFIGS = REPO_ROOT / "flows" / "configs"
# (config, overrides) per model: 8 train items in 2 shards of 4, 4 eval items in 2 shards of 2 (tiny); SmolLM2
# runs the demo config on 4 of its train items with 32 new tokens (2 shards of 2), 4 eval items x 2 draws (2 shards).
MODEL_JOBS: dict[str, tuple[Path, list[str]]] = {
    "tiny-random": (CONFIGS / "tiny-madpo-iter.yaml", ["shard_size=4", "eval_num_samples=4"]),
    "smollm2-135m-instruct": (
        CONFIGS / "demo.yaml",
        ["max_new_tokens=32", "max_train_items=4", "shard_size=2", "eval_num_samples=4"],
    ),
}
STAGES = (("sample-candidates", 1), ("score-with-oracle", 1), ("evaluate", 0))
WORKERS = (1, 2)


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _artifact(run_dir: Path, stage: str, round_index: int) -> Path:
    from pbrl.data.storage import RunPaths

    paths = RunPaths(run_dir)
    return {"sample-candidates": paths.candidates, "score-with-oracle": paths.scores, "evaluate": paths.eval}[stage](
        round_index
    )


def ray_workers_rss_mb() -> float:
    """The summed RSS of this process's Ray worker processes (``ray::`` in their name), in MiB."""
    import psutil

    total = 0
    for proc in psutil.Process().children(recursive=True):
        try:
            if proc.name().startswith("ray::") or "default_worker.py" in " ".join(proc.cmdline()):
                total += proc.memory_info().rss
        except psutil.Error:
            continue
    return round(total / 2**20, 1)


def measure(model: str, repeats: int, overrides: list[str]) -> dict[str, Any]:
    import ray
    from prefect import flow

    from flows.round import call_stage
    from pbrl.config import load_job
    from pbrl.data.items import read_items
    from pbrl.data.storage import RunPaths
    from pbrl.distributed.shards import shard_dir
    from pbrl.run.folder import prepare_run

    config, model_overrides = MODEL_JOBS.get(model, (CONFIGS / "tiny-madpo-iter.yaml", ["shard_size=4"]))
    out = Path(tempfile.mkdtemp(prefix="pbrl-bench-scale-"))
    local = load_job(
        config, [*model_overrides, *overrides, f"agent_model={model}", f"output_dir={out}", "run_name=scale"]
    )
    on_ray = local.model_copy(update={"runner": "ray"})
    run_dir = prepare_run(local, resume=False)
    paths = RunPaths(run_dir)

    @flow(name="bench-scale-out")
    def one_stage(stage: str, round_index: int, job: Any) -> None:
        call_stage(stage, str(run_dir), round_index, job, force=True)

    def local_case(stage: str, round_index: int):
        return lambda: one_stage(stage, round_index, local)

    def ray_case(stage: str, round_index: int):
        def call() -> None:
            shutil.rmtree(shard_dir(paths, round_index, stage), ignore_errors=True)  # every shard computed
            one_stage(stage, round_index, on_ray)

        return call

    for stage, r in STAGES:  # the inputs of every stage (candidates for scoring), once
        one_stage(stage, r, local)
    blocks: dict[str, Any] = {}
    identical = True
    for workers in WORKERS:
        ray.init(address="local", num_cpus=workers, include_dashboard=False)  # never a cluster already running
        try:
            block: dict[str, Any] = {}
            for stage, r in STAGES:
                times = interleaved({"local": local_case(stage, r), "ray": ray_case(stage, r)}, repeats)
                local_case(stage, r)()
                expected = _digest(_artifact(run_dir, stage, r))
                ray_case(stage, r)()
                identical &= _digest(_artifact(run_dir, stage, r)) == expected
                block[stage] = {
                    "local": summary(times["local"]),
                    "ray": summary(times["ray"]),
                    "ray_over_local": ratio(summary(times["ray"])["median_s"], summary(times["local"])["median_s"]),
                }
            block["ray_workers_rss_mb"] = ray_workers_rss_mb()
            blocks[f"ray_{workers}_worker"] = block
        finally:
            ray.shutdown()
    items = {"train": len(read_items(paths, "train")), "eval": local.eval_num_samples, "shard_size": local.shard_size}
    shutil.rmtree(out, ignore_errors=True)
    return {
        "blocks": blocks,
        "artifacts_identical": identical,
        "driver_peak_rss_mb": peak_rss_mb(),
        "items": items,
        "repeats": repeats,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-random", help="packaged alias or model folder")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per case (after one warm-up)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra overrides")
    args = parser.parse_args()
    isolate_prefect()
    result = measure(args.model, args.repeats, args.set)
    checks = [
        check(f"{stage} ray {n} worker(s) / local", result["blocks"][f"ray_{n}_worker"][stage]["ray_over_local"], None)
        for n in WORKERS
        for stage, _ in STAGES
    ]
    checks.append(check("ray artifacts byte-identical to local", float(result["artifacts_identical"]), 1.0))
    path = write_result("scale_out", args.model, {**result, "checks": checks})
    print_checks("scale_out", checks, path)


if __name__ == "__main__":
    main()
