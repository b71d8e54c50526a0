"""``runner: ray`` (docs/guides/ray.md#sharded-stages): the item-parallel stages as shard tasks on prefect-ray's
``RayTaskRunner``.

A sharded stage (:data:`SHARDED_STAGES`) that must run first maps one Prefect task per shard of ``shard_size``
items (:mod:`pbrl.distributed.shards`) over a small subflow, ``pbrl-shards``, whose task runner is
``prefect_ray.RayTaskRunner``; the stage's own task then gathers the shard files into its usual artifact.
Every shard task loads what it needs (the round's checkpoint, the items) from the run folder, so the run
folder must be on storage every Ray node sees (a shared POSIX filesystem).

Failures: a shard whose Ray worker dies is run again by Ray alone (``max_retries``, Ray's own retry of a task
whose process died); a transient error inside a retrying stage (:data:`flows.retry.RETRYING_STAGES`) is retried
by Prefect, in its shard only. A shard already written under the stage's cache key is kept (a resumed or
retried stage recomputes only the shards that are missing).

Ray is started once per training run (:func:`ray_session`) and its workers stay warm across stages; the Ray
workers report their task runs to the same Prefect API as the flow (a running server, or the ephemeral one the
run started, whose URL is handed to them through the serialized settings).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

from prefect import flow, task, unmapped
from prefect.cache_policies import NO_CACHE
from prefect.settings import PREFECT_API_URL, get_current_settings, temporary_settings

from flows.retry import RETRYING_STAGES, TRANSIENT_RETRIES
from pbrl.config import IterativeJob, JobConfig, RewardModelJob
from pbrl.data.schema import CANDIDATES, EVAL, SCORES
from pbrl.data.storage import RunPaths
from pbrl.distributed.shards import (
    Shard,
    ShardSet,
    plan_shards,
    ray_init_kwargs,
    require_ray_extra,
    shard_done,
    write_shard,
)
from pbrl.models.threads import configure_threads
from stages import STAGE_MODULES

log = logging.getLogger("pbrl.flows")

SHARDED_STAGES = ("sample-candidates", "score-with-oracle", "evaluate")
WORKER_RETRIES = 2  # Ray's retries of a shard whose worker process died (system failures only)


def sharded(stage: str, job: JobConfig) -> bool:
    """Whether ``stage`` runs as shards for ``job`` (``runner: ray`` and an item-parallel stage)."""
    return job.runner == "ray" and stage in SHARDED_STAGES


def shard_devices(job: JobConfig) -> list[str | list[str] | None]:
    """The device options a shard may load a model on: ``agent_devices`` (sample-candidates, evaluate),
    ``comparator_devices`` (sample-candidates' comparator copies; iterative trainers) and ``reward_model_device``
    (score-with-oracle's reward model; MARLHF trainers)."""
    specs: list[str | list[str] | None] = [job.agent_devices]
    if isinstance(job, IterativeJob):
        specs.append(job.comparator_devices)
    if isinstance(job, RewardModelJob):
        specs.append(job.reward_model_device)
    return specs


def shard_resources(job: JobConfig) -> dict[str, int]:
    """Ray resources of one shard task: 1 CPU, plus one GPU per distinct ``cuda`` device named in the job's device
    options (:func:`shard_devices`). Ray hides the GPUs a task did not ask for (``CUDA_VISIBLE_DEVICES``), and
    numbers the ones it gives from 0, so ``cuda:0`` / ``cuda:1`` are the shard's first and second GPU. Devices left
    to ``None`` or ``auto`` ask for no GPU."""
    names: set[str] = set()
    for spec in shard_devices(job):
        names.update([spec] if isinstance(spec, str) else (spec or []))
    gpus = len({d for d in names if d == "cuda" or d.startswith("cuda:")})
    return {"num_cpus": 1, **({"num_gpus": gpus} if gpus else {})}


def _schema(stage: str):
    return {"sample-candidates": CANDIDATES, "score-with-oracle": SCORES, "evaluate": EVAL}[stage]


@task(
    name="shard", task_run_name="{stage}-r{round_index}-shard-{shard.index}", cache_policy=NO_CACHE, **TRANSIENT_RETRIES
)
def shard_task(
    stage: str, run_dir: str, round_index: int, job: JobConfig, key: str, shard: Shard, refresh: bool = False
) -> str:
    """Run ``stage``'s per-item code over the shard's items and write its shard file; a shard already done
    under ``key`` is kept (unless ``refresh``). Returns ``"kept"`` or ``"written"``. Transient errors (remote
    judges) are retried by Prefect in retrying stages only; other errors fail the shard."""
    paths = RunPaths(run_dir)
    if not refresh and shard_done(paths, round_index, stage, shard, key):
        return "kept"
    configure_threads(shard_resources(job)["num_cpus"])  # the CPUs Ray reserved for this shard
    module = STAGE_MODULES[stage]
    items = module.items_to_shard(paths, round_index, job)[shard.start : shard.stop]
    rows, counts = module.collect(paths, round_index, job, items)
    write_shard(paths, round_index, stage, shard, key, rows, _schema(stage), counts)
    return "written"


@flow(name="pbrl-shards", flow_run_name="{stage}-r{round_index}-shards")
def shards_flow(
    stage: str, run_dir: str, round_index: int, job: JobConfig, key: str, refresh: bool = False
) -> dict[str, Any]:
    """Map :func:`shard_task` over the stage's shards on this flow's task runner (Ray) and wait for all
    (``refresh``: recompute the shards already done too).

    Returns:
        ``{"shards": [Shard as dict], "states": ["kept" | "written", ...]}`` in shard order.

    Raises:
        the first failed shard's error (after its retries), once every shard has finished.
    """
    from prefect_ray.context import remote_options  # deferred: prefect-ray is an optional extra

    paths = RunPaths(run_dir)
    plan = plan_shards(len(STAGE_MODULES[stage].items_to_shard(paths, round_index, job)), job.shard_size)
    call = shard_task if stage in RETRYING_STAGES else shard_task.with_options(retries=0)
    with remote_options(**shard_resources(job), max_retries=WORKER_RETRIES):
        futures = call.map(
            unmapped(stage),
            unmapped(run_dir),
            unmapped(round_index),
            unmapped(job),
            unmapped(key),
            plan,
            unmapped(refresh),
        )
    futures.wait()
    states = [f.result() for f in futures]  # raises the first failure
    return {"shards": [vars(s) for s in plan], "states": states}


def ray_task_runner(job: JobConfig):
    """prefect-ray's ``RayTaskRunner`` for ``job`` (it reuses a Ray already initialised in this process)."""
    from prefect_ray import RayTaskRunner  # deferred: prefect-ray is an optional extra

    return RayTaskRunner(init_kwargs=ray_init_kwargs(job.ray_address))


def run_shards(
    stage: str, run_dir: str, round_index: int, job: JobConfig, key: str, *, refresh: bool = False
) -> ShardSet:
    """Run the stage's shards on Ray (the ``pbrl-shards`` subflow) and return the set to gather (``refresh``:
    every shard recomputed, as a forced stage run).

    Raises:
        ConfigError: the 'ray' extra is not installed.
    """
    require_ray_extra(job.runner)
    with _api_visible_to_workers():
        result = shards_flow.with_options(task_runner=ray_task_runner(job))(
            stage, run_dir, round_index, job, key, refresh
        )
    written = sum(s == "written" for s in result["states"])
    log.info(
        "%s round %d: %d shard(s), %d written, %d kept",
        stage,
        round_index,
        len(result["states"]),
        written,
        len(result["states"]) - written,
    )
    return ShardSet(key, tuple(Shard(**s) for s in result["shards"]))


def prefect_api_url() -> str:
    """The Prefect API this process talks to: the configured URL, else the ephemeral server's (started if
    needed)."""

    url = get_current_settings().api.url
    if url:
        return url

    # deferred: Prefect's server package takes ~3.6 s to import, and a configured API never needs it
    from prefect.server.api.server import SubprocessASGIServer

    server = SubprocessASGIServer()
    server.start()
    return server.api_url


@contextlib.contextmanager
def _api_visible_to_workers() -> Iterator[None]:
    # Ray workers are other processes: an ephemeral API (no URL in the settings) would make each start its own
    # server. The URL set here travels to them in the serialized settings of every task.

    if get_current_settings().api.url:
        yield
        return
    with temporary_settings(updates={PREFECT_API_URL: prefect_api_url()}):
        yield


@contextlib.contextmanager
def ray_session(job: JobConfig) -> Iterator[None]:
    """Around a whole training run with ``runner: ray``: connect to ``ray_address`` (or start a local Ray)
    once, so that every stage's shards reuse the same warm workers; shut down on exit only what this started.
    A Ray already initialised in this process is used as it is. Nothing happens with ``runner: local``."""
    if job.runner != "ray":
        yield
        return
    require_ray_extra(job.runner)
    import ray  # deferred: ray is an optional extra

    if ray.is_initialized():
        yield
        return
    ray.init(**ray_init_kwargs(job.ray_address), runtime_env={"env_vars": {"PREFECT_API_URL": prefect_api_url()}})
    try:
        yield
    finally:
        ray.shutdown()
