"""Benchmark: Prefect's overhead on one round, server start-up, and a cached rerun of a finished round.

In one process, with an isolated Prefect home (a temporary folder set before Prefect is imported) and
telemetry off, on fresh run folders of one small job:

1. start-up: the first API call starts the ephemeral Prefect server (a subprocess, SQLite migrations);
   then a warm-up round through ``flows.round.round_flow`` on its own run folder (the same job on one
   item with few tokens) pays the first-use costs (imports, first flow and task runs, first model
   loads). Both are reported separately and left out of the per-round numbers.
2. ``repeats`` times, alternating: one round through ``round_flow`` on a fresh run folder, and the same
   stage functions (``stages.<name>.run``) called directly in the same order on another fresh folder.
   Prefect overhead per round = (flow wall time - the stages' own seconds in that flow, from their
   manifests) - (direct wall time - the stages' own seconds there). Subtracting each run's own stage
   seconds removes the stage-work noise between the two runs; what remains is everything the flow
   adds: flow and task runs on the API, cache keys (content hashes of input files), result files,
   state records, artifacts and the flow heartbeat thread's join.
3. ``round_flow`` again on an already finished round folder: its time, and every stage's state (all
   must be Cached: nothing recomputed).

Run: ``.venv/bin/python benchmarks/orchestration.py --model tiny-random``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchkit import REPO_ROOT, check, print_checks, ratio, sizes_for, summary, write_result

from pbrl.config import JobConfig, load_job
from pbrl.run.folder import prepare_run

TARGET_OVERHEAD_SHARE = 0.05  # docs/results/benchmarks.md#performance-targets: on the SmolLM2 demo
ROUND = 1
CONFIGS = REPO_ROOT / "flows" / "configs"
# (config, overrides) per model. The tiny model runs the tiny config as it is. SmolLM2 runs the demo
# config (docs/results/benchmarks.md#performance-targets sets the target on the SmolLM2 demo) on 2 of its 4 train
# items with 32 of its 64 new
# tokens, so that a round takes about a minute on 2 cores instead of about four. The per-round overhead
# is a roughly fixed number of seconds, so the smaller round gives an upper bound of the demo's share;
# ``--set max_new_tokens=64 --set max_train_items=4`` runs the exact demo round.
MODEL_JOBS: dict[str, tuple[Path, list[str]]] = {
    "tiny-random": (CONFIGS / "tiny-madpo-iter.yaml", []),
    "smollm2-135m-instruct": (CONFIGS / "demo.yaml", ["max_new_tokens=32", "max_train_items=2"]),
}
OTHER_MODEL_JOB = (CONFIGS / "tiny-madpo-iter.yaml", ["lora_r=8", "max_train_items=2", "max_new_tokens=16"])
# The warm-up round only has to start things up (server, imports, first flow/task runs, first model
# loads): the same job on one item with few tokens.
WARMUP_OVERRIDES = ["max_train_items=1", "preference_num_candidates=2", "max_new_tokens=4", "eval_num_samples=1"]


def isolate_prefect() -> Path:
    """A temporary PREFECT_HOME and telemetry off. Prefect reads its settings when first imported, so this
    must run before anything imports it (pbrl and this script import it lazily, inside functions)."""
    if "prefect" in sys.modules:
        raise RuntimeError("prefect was imported before its settings were isolated")
    home = Path(tempfile.mkdtemp(prefix="pbrl-bench-prefect-"))
    for key in ("PREFECT_API_URL", "PREFECT_API_KEY", "PREFECT_PROFILE"):
        os.environ.pop(key, None)
    os.environ.update(
        {
            "PREFECT_HOME": str(home),
            "DO_NOT_TRACK": "1",
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "90",
        }
    )
    os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "pbrl")  # as the CLI does (pbrl.orchestration)
    return home


def round_stages(job: JobConfig) -> list[str]:
    """The stages round_flow runs for round ROUND, in its order."""
    from flows.round import evaluation_due

    names = ["sample-candidates", "score-with-oracle", "build-pairs", "store-round", "replay-select", "update-policies"]
    return names + (["evaluate"] if evaluation_due(job, ROUND) else [])


def fresh_run(job: JobConfig, out: Path, name: str) -> tuple[str, JobConfig]:
    job = job.model_copy(update={"run_name": name, "output_dir": str(out)})
    return str(prepare_run(job, resume=False)), job


def flow_round(job: JobConfig, out: Path, name: str) -> dict[str, Any]:
    """A round through round_flow on a fresh run folder: wall time, stage seconds, states."""
    from flows.round import round_flow

    run_dir, job = fresh_run(job, out, name)
    start = time.perf_counter()
    done = round_flow(run_dir, name, ROUND, job)
    wall = time.perf_counter() - start
    stage_s = {d["stage"]: d["manifest"]["seconds"] for d in done}
    return {
        "run_dir": run_dir,
        "job": job,
        "wall_s": wall,
        "stage_s": stage_s,
        "gap_s": wall - sum(stage_s.values()),
        "states": {d["stage"]: d["state"] for d in done},
    }


def direct_round(job: JobConfig, out: Path, name: str) -> dict[str, Any]:
    """The same stage functions called one after the other, no Prefect: wall time and stage seconds."""
    from stages import STAGE_MODULES

    run_dir, job = fresh_run(job, out, name)
    stage_s, call_s = {}, {}
    start = time.perf_counter()
    for stage in round_stages(job):
        t0 = time.perf_counter()
        stage_s[stage] = STAGE_MODULES[stage].run(run_dir, ROUND, job).seconds
        call_s[stage] = round(time.perf_counter() - t0, 3)
    wall = time.perf_counter() - start
    return {"wall_s": wall, "stage_s": stage_s, "call_s": call_s, "gap_s": wall - sum(stage_s.values())}


def cached_round(run_dir: str, job: JobConfig) -> dict[str, Any]:
    """round_flow on a finished round: wall time and each stage's state."""
    from flows.round import round_flow

    start = time.perf_counter()
    done = round_flow(run_dir, job.run_name, ROUND, job)
    return {"wall_s": time.perf_counter() - start, "states": {d["stage"]: d["state"] for d in done}}


def _rounded(d: dict[str, Any]) -> dict[str, Any]:
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in d.items() if k not in ("job", "run_dir")}


def start_server() -> float:
    """Seconds of the first API call, which starts the ephemeral server (SQLite migrations included)."""
    from prefect.client.orchestration import get_client

    start = time.perf_counter()
    with get_client(sync_client=True) as client:
        client.hello().raise_for_status()
    return time.perf_counter() - start


def measure(job: JobConfig, warmup_job: JobConfig, out: Path, repeats: int, cached_repeats: int) -> dict[str, Any]:
    server_s = start_server()
    warm = flow_round(warmup_job, out, "warmup")
    flows, directs = [], []
    for r in range(repeats):  # alternate which goes first
        pair = [("flow", flow_round), ("direct", direct_round)]
        for kind, fn in pair if r % 2 == 0 else pair[::-1]:
            (flows if kind == "flow" else directs).append(fn(job, out, f"{kind}-{r}"))
    cached = [cached_round(flows[0]["run_dir"], flows[0]["job"]) for _ in range(cached_repeats)]

    overheads = [f["gap_s"] - d["gap_s"] for f, d in zip(flows, directs, strict=False)]
    overhead = statistics.median(overheads)
    flow_wall = statistics.median(f["wall_s"] for f in flows)
    direct_wall = statistics.median(d["wall_s"] for d in directs)
    # First-flow costs (first flow and task runs, imports on first use) beyond a warm round's overhead.
    first_flow_extra = warm["gap_s"] - overhead
    all_cached = all(s == "Cached" for c in cached for s in c["states"].values())
    return {
        "server_startup_s": round(server_s, 3),
        "warmup_round": {**_rounded(warm), "first_flow_extra_overhead_s": round(first_flow_extra, 3)},
        "flow_rounds": [_rounded(f) for f in flows],
        "direct_rounds": [_rounded(d) for d in directs],
        "cached_reruns": [_rounded(c) for c in cached],
        "per_round": {
            "flow_wall": summary([f["wall_s"] for f in flows]),
            "direct_wall": summary([d["wall_s"] for d in directs]),
            "prefect_overhead": summary(overheads),
            "prefect_overhead_share": ratio(overhead, flow_wall),
            "wall_difference_share": ratio(flow_wall - direct_wall, flow_wall),
            "cached_rerun": summary([c["wall_s"] for c in cached]),
            "cached_rerun_vs_fresh_flow_round": ratio(statistics.median(c["wall_s"] for c in cached), flow_wall),
        },
        "all_stages_cached_on_rerun": all_cached,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-random", help="packaged alias or model folder")
    parser.add_argument("--config", help="job YAML (default: per model, see MODEL_JOBS)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra overrides")
    parser.add_argument("--keep", action="store_true", help="keep the run folders and the Prefect home")
    args = parser.parse_args()
    size = sizes_for(args.model)
    config, model_overrides = MODEL_JOBS.get(args.model, OTHER_MODEL_JOB)
    config = Path(args.config) if args.config else config
    overrides = [f"agent_model={args.model}", *model_overrides, *args.set]
    job = load_job(config, overrides)
    warmup_job = load_job(config, [*overrides, *WARMUP_OVERRIDES])
    prefect_home = isolate_prefect()
    out = Path(tempfile.mkdtemp(prefix="pbrl-bench-runs-"))
    try:
        started = time.perf_counter()
        result = measure(job, warmup_job, out, size.round_repeats, size.cached_repeats)
        total = time.perf_counter() - started
    finally:
        if not args.keep:
            shutil.rmtree(out, ignore_errors=True)
            shutil.rmtree(prefect_home, ignore_errors=True)
    per_round = result["per_round"]
    share = per_round["prefect_overhead_share"]
    cached = result["cached_reruns"]
    n_cached = sum(s == "Cached" for c in cached for s in c["states"].values())
    n_states = sum(len(c["states"]) for c in cached)
    checks = [
        {
            **check(
                "orchestration: Prefect overhead share of a round", share, TARGET_OVERHEAD_SHARE, higher_is_better=False
            ),
            "applies": args.model == "smollm2-135m-instruct",
            "note": "the target (docs/results/benchmarks.md#performance-targets) is for the SmolLM2 demo; on the tiny "
            "model stage work is ~1-3 s, so the fixed per-round cost dominates (informational there)",
        },
        {
            "name": "orchestration: cached rerun states Cached",
            "value": f"{n_cached}/{n_states}",
            "target": "all",
            "direction": "=",
            "met": result["all_stages_cached_on_rerun"],
            "applies": True,
        },
        check("orchestration: cached rerun seconds", per_round["cached_rerun"]["median_s"], None),
        check("orchestration: Prefect overhead seconds per round", per_round["prefect_overhead"]["median_s"], None),
        check("orchestration: ephemeral server start-up seconds", result["server_startup_s"], None),
    ]
    path = write_result(
        "orchestration",
        args.model,
        {
            "job": {
                "config": str(config.relative_to(REPO_ROOT) if config.is_relative_to(REPO_ROOT) else config),
                "overrides": overrides,
                "warmup_overrides": WARMUP_OVERRIDES,
                "round": ROUND,
                "stages": round_stages(job),
            },
            "repeats": size.round_repeats,
            "cached_repeats": size.cached_repeats,
            "warmup_rounds": 1,
            "timer": "time.perf_counter, median of repeats",
            "total_s": round(total, 3),
            "prefect": {
                "home": "temporary folder, removed afterwards",
                "DO_NOT_TRACK": "1",
                "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                "heartbeat": "default (on)",
            },
            **result,
            "checks": checks,
            "method": __doc__.split("\n\n", 1)[1].split("\n\nRun:")[0],
        },
    )
    print(
        f"[orchestration] ephemeral server start-up {result['server_startup_s']:.2f} s; warm-up round "
        f"{result['warmup_round']['wall_s']:.2f} s, of which first-flow extra overhead "
        f"{result['warmup_round']['first_flow_extra_overhead_s']:.2f} s "
        "(both left out of the per-round numbers)"
    )
    print(
        f"[orchestration] round: flow {per_round['flow_wall']['median_s']:.2f} s, direct "
        f"{per_round['direct_wall']['median_s']:.2f} s, Prefect overhead "
        f"{per_round['prefect_overhead']['median_s']:.2f} s = {share:.1%} of the flow round"
    )
    print(f"[orchestration] cached rerun: {per_round['cached_rerun']['median_s']:.2f} s, states {cached[0]['states']}")
    print_checks("orchestration", checks, path)


if __name__ == "__main__":
    main()
