"""GPU check (issue #33): one command, a few minutes on one GPU — what pbrl does on ``cuda`` in bfloat16.

1. For the tiny model and SmolLM2, one demo round of MADPO-iterative (``flows/configs/demo.yaml``) and of
   MARLHF-iterative (``flows/configs/marlhf-docs.yaml``) on the device, ``auto`` precision (bfloat16 weights and
   bf16 autocast on a GPU that has bfloat16), stages called directly: seconds per stage, sampled tokens per second
   (sample-candidates and evaluate), trained pairs per second (update-policies, MADPO), peak GPU memory.
2. MADPO's update-policies with ``runner: ray``: each agent a Ray actor placed on the GPU (skipped without Ray).
3. A killed-and-resumed run of the tiny model (2 rounds through the Prefect flow, the run stopped after round 1
   and resumed) against an uninterrupted one: every stored file equal, byte for byte.

Writes ``benchmarks/results/gpu-check-<device>.json``. Run: ``.venv/bin/python benchmarks/gpu_check.py`` on a machine
with a GPU; ``--device cpu --models tiny-random`` checks the script itself without one (information only).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq
import torch
from benchkit import REPO_ROOT, peak_rss_mb, write_result

from pbrl.config import load_job
from pbrl.run.folder import open_job, prepare_run
from pbrl.run.settings import configure_job_threads
from stages import STAGE_MODULES

CONFIGS = {"madpo_iter": "demo.yaml", "marlhf_iter": "marlhf-docs.yaml"}
SMALL = [  # a short round: the check is about running on the device, not about learning
    "num_iterations=1", "task_options={num_train_items: 8, num_eval_items: 4}", "preference_num_candidates=2",
    "max_new_tokens=32", "eval_num_samples=4",
]  # fmt: skip


def one_round(model: str, trainer: str, device: str, out: Path, extra: list[str]) -> dict:
    """Round 0's evaluation and round 1 of ``trainer``'s config on ``device``; per-stage seconds and rates."""
    job = load_job(
        REPO_ROOT / "flows" / "configs" / CONFIGS[trainer],
        [*SMALL, *extra, f"agent_model={model}", f"agent_devices={device}", f"output_dir={out}",
         f"run_name={trainer}-{Path(model).name}"],
    )  # fmt: skip
    run_dir = prepare_run(job, resume=False)
    job = open_job(run_dir)
    configure_job_threads(job)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    stages = []
    for round_index, names in ((0, ["evaluate"]), (1, [s for s in STAGE_MODULES if s != "evaluate"] + ["evaluate"])):
        for name in names:
            if name == "fit-reward-model" and trainer != "marlhf_iter":
                continue
            start = time.perf_counter()
            manifest = STAGE_MODULES[name].run(run_dir, round_index, job)
            seconds = time.perf_counter() - start
            row = {"round": round_index, "stage": name, "seconds": round(seconds, 2), "counts": manifest.counts}
            if name in ("sample-candidates", "evaluate"):
                row["tokens_per_s"] = round(_sampled_tokens(run_dir, round_index, name) / seconds, 1)
            if name == "update-policies" and manifest.counts.get("pairs"):
                row["pairs_per_s"] = round(manifest.counts["pairs"] * job.num_train_epochs / seconds, 2)
            stages.append(row)
            print(
                f"[gpu-check] {trainer} {Path(model).name} round {round_index} {name:18s} {seconds:7.2f} s", flush=True
            )
    result = {
        "model": model, "trainer": trainer, "torch_dtype": job.torch_dtype,
        "mixed_precision": job.mixed_precision, "stages": stages, "peak_rss_gb": round(peak_rss_mb() / 1024, 2),
    }  # fmt: skip
    if device.startswith("cuda"):
        result["peak_gpu_memory_gb"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    return result


def _sampled_tokens(run_dir: Path, round_index: int, stage: str) -> int:
    paths = {"sample-candidates": "candidates.parquet", "evaluate": "eval.parquet"}
    table = pq.read_table(Path(run_dir) / "rounds" / f"{round_index:04d}" / paths[stage]).to_pylist()
    if stage == "evaluate":
        return sum(len(ids) for row in table for ids in row["completion_ids"])
    return sum(len(row["completion_ids"]) for row in table)


def ray_actors(device: str, out: Path) -> dict:
    """MADPO's update-policies of the tiny model with each agent a Ray actor on ``device``."""
    if importlib.util.find_spec("ray") is None:
        return {"skipped": "the 'ray' extra is not installed"}
    start = time.perf_counter()
    result = one_round("tiny-random", "madpo_iter", device, out, ["runner=ray"])
    return {"seconds": round(time.perf_counter() - start, 2), "round": result}


def resume_is_bitwise(device: str, out: Path) -> dict:
    """Two rounds uninterrupted against two rounds killed after round 1 and resumed: equal stored files."""
    from flows.training import train_flow

    base = ["num_iterations=2", "max_new_tokens=8", f"agent_devices={device}", f"output_dir={out}"]
    config = REPO_ROOT / "flows" / "configs" / "tiny-madpo-iter.yaml"
    whole = train_flow(load_job(config, [*base, "run_name=whole"]))["run_dir"]
    train_flow(load_job(config, [*base, "run_name=resumed", "num_iterations=1"]))  # "killed" after round 1
    resumed = train_flow(load_job(config, [*base, "run_name=resumed"]), resume=True)["run_dir"]
    differ = [
        f.relative_to(whole).as_posix()
        for f in sorted(Path(whole).rglob("*"))
        if f.is_file() and f.suffix in (".parquet", ".safetensors", ".pt") and ".prefect" not in f.parts
        and _digest(f) != _digest(Path(resumed) / f.relative_to(whole))
    ]  # fmt: skip
    compared = "parquet (metrics without time/), safetensors, pt"
    return {"files_compared": compared, "differing": differ, "bitwise": not differ}


def _digest(path: Path) -> str | None:
    """The file's sha256; for ``metrics.parquet`` that of its rows without the ``time/`` metrics (wall clock)."""
    if not path.is_file():
        return None
    if path.name == "metrics.parquet":
        table = pq.read_table(path).to_pandas()
        table = table[~table["metric"].str.startswith("time/")]
        return hashlib.sha256(table.to_csv(index=False).encode()).hexdigest()
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--models", nargs="*", default=["tiny-random", "smollm2-135m-instruct"])
    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device here; run it on a machine with a GPU (or --device cpu to "
                         "check the script)")  # fmt: skip
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        rounds = [one_round(m, t, args.device, out, []) for m in args.models for t in CONFIGS]
        actors = ray_actors(args.device, out / "ray")
        resume = resume_is_bitwise(args.device, out / "resume")
    result = {"device": args.device, "rounds": rounds, "ray_actors": actors, "resume": resume,
              "total_seconds": round(time.perf_counter() - started, 1)}  # fmt: skip
    if args.device.startswith("cuda"):
        result["gpu"] = torch.cuda.get_device_name(0)
    path = write_result("gpu-check", args.device.replace(":", ""), result)
    print(f"[gpu-check] resume bitwise: {resume['bitwise']}; total {result['total_seconds']} s; result: {path}")


if __name__ == "__main__":
    main()
