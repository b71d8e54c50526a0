"""GPU check (issue #33): one command, a few minutes on one GPU — what pbrl does on ``cuda`` in bfloat16.

1. For the tiny model and SmolLM2, one demo round of MADPO-iterative (``flows/configs/demo.yaml``) and of
   MARLHF-iterative (``flows/configs/marlhf-docs.yaml``) on the device, ``auto`` precision (bfloat16 weights and
   bf16 autocast on a GPU that has bfloat16), stages called directly: seconds per stage, sampled tokens per second
   (sample-candidates and evaluate), what the training stages train on per second (MADPO's update: pairs times
   epochs; MARLHF's: joint responses, its rollouts; the reward model's fit: its training pairs times epochs), peak GPU
   memory. A ``reward_backbone_layers`` beyond a smaller model's layers is dropped (:func:`fitted_job`).
2. MADPO's update-policies with ``runner: ray``: each agent a Ray actor placed on the GPU (skipped without Ray).
3. A killed-and-resumed run of the tiny model (2 rounds through the Prefect flow, the run stopped after round 1
   and resumed) against an uninterrupted one: every stored result equal, byte for byte (:func:`differing_files`).

Writes ``benchmarks/results/gpu-check-<device>.json`` and exits 1 when the resumed run differs or no file was
compared. Run:
``.venv/bin/python benchmarks/gpu_check.py`` on a machine with a GPU; ``--device cpu --models tiny-random`` checks
the script itself without one (information only; ``tests/unit/benchmarks/test_gpu_check.py`` runs it so).
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
from transformers import AutoConfig

from pbrl.config import JobConfig, load_job
from pbrl.models.loading import resolve_model_source
from pbrl.run.folder import open_job, prepare_run
from pbrl.run.judging import round_stages
from pbrl.run.settings import configure_job_threads, policy_source
from stages import STAGE_MODULES

RESULT_SUFFIXES = (".parquet", ".safetensors", ".pt")  # what the resume check compares
MEASUREMENTS = ("time/", "resource/")  # metrics that measure the machine, not the run
CONFIGS = {"madpo_iter": "demo.yaml", "marlhf_iter": "marlhf-docs.yaml"}
SMALL = [  # a short round: the check is about running on the device, not about learning
    "num_iterations=1", "task_options={num_train_items: 8, num_eval_items: 4}", "preference_num_candidates=2",
    "max_new_tokens=32", "eval_num_samples=4",
]  # fmt: skip


def fitted_job(config: Path, overrides: list[str]) -> JobConfig:
    """``config`` with ``overrides``, its ``reward_backbone_layers`` set to None (all of them) where it reaches beyond
    the reward backbone (``reward_model_name``, else the agents' model): the MARLHF config reads layer 10 of
    SmolLM2's 30, and the tiny model has 2."""
    job = load_job(config, overrides)
    layers = getattr(job, "reward_backbone_layers", None)
    if layers is None:
        return job
    backbone = job.reward_model_name or policy_source(job).models[0]
    if layers <= AutoConfig.from_pretrained(resolve_model_source(backbone)).num_hidden_layers:
        return job
    return load_job(config, [*overrides, "reward_backbone_layers=null"])


def trained_per_second(trainer: str, stage: str, counts: dict[str, int], job: JobConfig, seconds: float) -> dict:
    """What a training stage trained on per second, from its manifest ``counts``: MADPO's update its pairs times the
    epochs, MARLHF's its joint responses (every epoch's rollouts, as counted), the reward model's fit its training
    pairs times its epochs; ``{}`` for other stages."""
    if stage == "update-policies" and trainer == "madpo_iter":
        name, amount = "pairs_per_s", counts.get("pairs", 0) * job.num_train_epochs
    elif stage == "update-policies" and trainer == "marlhf_iter":
        name, amount = "joint_responses_per_s", counts.get("joint_responses", 0)
    elif stage == "fit-reward-model":
        name, amount = "train_pairs_per_s", counts.get("train_pairs", 0) * job.reward_num_train_epochs
    else:
        return {}
    return {name: round(amount / seconds, 2)}


def one_round(model: str, trainer: str, device: str, out: Path, extra: list[str]) -> dict:
    """Round 0's evaluation and round 1 of ``trainer``'s config on ``device``; per-stage seconds and rates."""
    job = fitted_job(
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
    for round_index, names in ((0, ["evaluate"]), (1, round_stages(job, run_dir))):  # the trainer's own stages
        for name in names:
            start = time.perf_counter()
            manifest = STAGE_MODULES[name].run(run_dir, round_index, job)
            seconds = time.perf_counter() - start
            row = {"round": round_index, "stage": name, "seconds": round(seconds, 2), "counts": manifest.counts}
            if name in ("sample-candidates", "evaluate"):
                row["tokens_per_s"] = round(_sampled_tokens(run_dir, round_index, name) / seconds, 1)
            row |= trained_per_second(trainer, name, manifest.counts, job, seconds)
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


def resume_is_bitwise(device: str, out: Path, extra: tuple[str, ...] = ()) -> dict:
    """Two rounds uninterrupted against two rounds killed after round 1 and resumed: equal stored files. ``extra``:
    config overrides of both runs (e.g. the demo's LoRA and cross pairs)."""
    from flows.training import train_flow

    base = ["num_iterations=2", "max_new_tokens=8", f"agent_devices={device}", f"output_dir={out}", *extra]
    config = REPO_ROOT / "flows" / "configs" / "tiny-madpo-iter.yaml"
    whole = train_flow(load_job(config, [*base, "run_name=whole"]))["run_dir"]
    train_flow(load_job(config, [*base, "run_name=resumed", "num_iterations=1"]))  # "killed" after round 1
    resumed = train_flow(load_job(config, [*base, "run_name=resumed"]), resume=True)["run_dir"]
    return compare_runs(Path(whole), Path(resumed))


def compare_runs(whole: Path, resumed: Path) -> dict:
    """The resume verdict: how many stored results the uninterrupted run holds, those that differ, and ``bitwise``,
    true only when some were compared and none differs."""
    differ, compared = differing_files(whole, resumed), len(stored_results(whole))
    kinds = ", ".join(s.lstrip(".") for s in RESULT_SUFFIXES).replace(
        "parquet", f"parquet (metrics without {', '.join(MEASUREMENTS)})"
    )
    return {"files_compared": compared, "kinds": kinds, "differing": differ, "bitwise": compared > 0 and not differ}


def stored_results(run: Path) -> set[str]:
    """The run folder's stored results: its parquet, safetensors and pt files (Prefect's own folder inside it left
    out), as paths relative to it."""
    return {
        f.relative_to(run).as_posix()
        for f in run.rglob("*")
        if f.is_file() and f.suffix in RESULT_SUFFIXES and ".prefect" not in f.relative_to(run).parts
    }


def differing_files(whole: Path, resumed: Path) -> list[str]:
    """The stored results (:func:`stored_results`) that differ between two run folders, or that only one holds."""
    names = stored_results(whole) | stored_results(resumed)
    return sorted(name for name in names if _digest(whole / name) != _digest(resumed / name))


def _digest(path: Path) -> str | None:
    """The file's sha256; for ``metrics.parquet`` that of its rows without the measurements of the machine: ``time/``
    (wall clock) and ``resource/`` (peak RSS, which a resumed process reaches from another start, and the thread
    count, which follows the load)."""
    if not path.is_file():
        return None
    if path.name == "metrics.parquet":
        table = pq.read_table(path).to_pandas()
        table = table[~table["metric"].str.startswith(MEASUREMENTS)]
        return hashlib.sha256(table.to_csv(index=False).encode()).hexdigest()
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main() -> int:
    """Run the check; 0 when the resumed run equals the uninterrupted one, else 1."""
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
    if not resume["bitwise"]:
        print(f"[gpu-check] the resumed run differs from the uninterrupted one in: {', '.join(resume['differing'])} "
              f"({resume['files_compared']} files compared)")  # fmt: skip
    return 0 if resume["bitwise"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
