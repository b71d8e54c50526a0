"""Preflight: what a config cannot check on its own, checked before any run folder is touched or Prefect
started (``pbrl validate``, ``pbrl train``, the trainers and every run start)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from pbrl.config import JobConfig, is_centralized, is_iterative
from pbrl.data.items import load_run_items, with_item_ids
from pbrl.errors import ArtifactError, ConfigError, Problem
from pbrl.generation.collaboration import actor_prompts
from pbrl.generation.comparator_factory import preflight_problems as comparator_preflight_problems
from pbrl.models.loading import load_tokenizer, resolve_model_source
from pbrl.models.packaged import PACKAGED_MODELS
from pbrl.models.placement import auto_device_map
from pbrl.models.precision import autocast_problem
from pbrl.reporting.reward_hist import check_reward_range
from pbrl.reporting.tracker_tools import tracker_problems
from pbrl.run.judging import preflight_problems as judge_preflight_problems
from pbrl.run.preflight_env import (
    adapter_problems,
    device_problems,
    folder_problems,
    parameter_size_problems,
    thread_problems,
)
from pbrl.run.preflight_models import agent_model_problems, with_ids
from pbrl.run.settings import centralized_adapter, concrete_precision, policy_source
from pbrl.run.task import resolve_task
from pbrl.tasks.base import Task


# Over 60 lines: a flat list of independent checks whose problems are all collected and reported at once.
def preflight(
    job: JobConfig,
    *,
    task: Task | None = None,
    prepare_models: bool = True,
    train_items: Any = None,
    eval_items: Any = None,
    check_items: bool = True,
) -> Task:
    """Check what a config cannot check on its own, before any run folder is touched or Prefect started:
    the trainer is available, the task and its import paths resolve, the items load and every agent's
    formatter formats every item, every model source exists offline (a packaged model is converted here,
    once, unless ``prepare_models`` is false), ``lora_target_modules`` name modules of the model, the tokenizer fits
    the model's vocabulary and every prompt its context (:mod:`pbrl.run.preflight_models`), the comparator policy is
    available, with centralized collaboration the adapter imports and keeps its contract, and the devices, folders,
    thread count and config size suit this machine and Prefect (:mod:`pbrl.run.preflight_env`).
    ``check_items=False`` skips the items (a resumed run reads its stored ``items.parquet``).

    Returns:
        The resolved task.

    Raises:
        ConfigError: every problem found, at once.
    """

    problems: list[Problem] = []
    if job.trainer in ("marlhf", "marlhf_iter") and job.rl_algorithm in ("maac", "iac"):
        problems += _actor_critic_problems(job)
    if is_iterative(job.trainer):
        problems += comparator_preflight_problems(
            job.comparator_policy,
            model_sources=job.comparator_agents or [job.comparator_model_name or ""],
            model_field="comparator_agents" if job.comparator_agents else "comparator_model_name",
            key_env=job.comparator_api_key_env,
            generation_mode=job.comparator_generation_mode,
            adapter_path=getattr(job, "comparator_centralized_adapter", None),
        )
    if getattr(job, "collaboration_mode", "decentralized") == "centralized":  # the actor's adapter imports
        try:
            centralized_adapter(job)
        except ConfigError as exc:
            problems += exc.problems
    try:
        task = task or resolve_task(job)
    except ConfigError as exc:
        problems += exc.problems
    if getattr(job, "log_reward_distribution", False) and task is not None:
        try:
            check_reward_range(getattr(task.reward_func, "reward_range", None) or task.reward_range, source=task.name)
        except ValueError as exc:
            problems.append(Problem("log_reward_distribution", True, str(exc)))
    items = _item_problems(job, task, train_items, eval_items, check_items, problems)
    models = policy_source(job).models
    if task is not None and items is not None:
        try:
            prompts = with_ids(actor_prompts(task, [item for _, item in items], centralized_adapter(job)), items)
        except ConfigError:
            prompts = None  # the formatters' and the adapter's problems are reported with the items
    else:
        prompts = None
    problems += agent_model_problems(job, models, prompts, prepare=prepare_models)
    problems += _environment_problems(job, task, items, models)
    problems += judge_preflight_problems(job, task, prepare_models=prepare_models)
    problems += _precision_and_placement_problems(job)
    problems += tracker_problems(getattr(job, "report_to", None))
    if problems:
        raise ConfigError(list({str(p): p for p in problems}.values()))  # the same problem once
    return task  # type: ignore[return-value]


def _item_problems(
    job: JobConfig, task: Task | None, train_items: Any, eval_items: Any, check_items: bool, problems: list[Problem]
) -> list[tuple[str, dict[str, Any]]] | None:
    """Load the items (every problem added to ``problems``); the train and eval items with their ids
    (``(item_id, item)``), or None."""
    missing_files = False
    for name in ("train_dataset", "eval_dataset"):
        path = getattr(job, name)
        if isinstance(path, str) and not Path(path).is_file():  # a DatasetSpec is checked when loaded
            problems.append(Problem(name, path, "file not found"))
            missing_files = True
    if task is None or not check_items or missing_files:
        return None
    try:
        train, evals = load_run_items(job, task, train_items, eval_items)
    except ConfigError as exc:
        problems += exc.problems
        return None
    return with_item_ids(train, "item", "train_dataset") + with_item_ids(evals, "eval", "eval_dataset")


def _environment_problems(
    job: JobConfig, task: Task | None, items: list[tuple[str, dict[str, Any]]] | None, models: tuple[str, ...]
) -> list[Problem]:
    """What the job asks of this machine: devices, folders, threads, Prefect's parameter size, and the centralized
    adapter's contract (:mod:`pbrl.run.preflight_env`)."""
    problems = device_problems(job) + thread_problems(job) + parameter_size_problems(job)
    problems += folder_problems(job, packaged_models=any(m in PACKAGED_MODELS for m in models))
    if task is not None and is_centralized(job):
        try:
            adapter = centralized_adapter(job)
        except ConfigError:
            adapter = None  # reported above
        if adapter is not None:
            problems += adapter_problems(adapter, len(task.formatters), items[0][1] if items else None)
    return problems


def _precision_and_placement_problems(job: JobConfig) -> list[Problem]:
    """``mixed_precision`` autocast available on every agent device type; ``agent_devices: auto`` without
    LoRA fits ``max_memory`` without offloading trainable weights (accelerate's device map, no weights read)."""

    job, _ = concrete_precision(job)  # auto resolves to what the device runs natively: checked like the rest
    source = policy_source(job)
    devices = source.devices if isinstance(source.devices, tuple) else (source.devices,)
    default = "cuda" if torch.cuda.is_available() else "cpu"
    types = {default if d in (None, "auto") else str(d).split(":")[0] for d in devices}
    problems = [
        Problem("mixed_precision", job.mixed_precision, why)
        for t in sorted(types)
        if (why := autocast_problem(job.mixed_precision, t))
    ]
    if source.devices == "auto" and job.lora_r is None:
        for model in dict.fromkeys(source.models):
            try:
                auto_device_map(
                    Path(str(resolve_model_source(model))),
                    dtype=torch.float32,
                    max_memory=job.max_memory,
                    trainable=True,
                    lora_targets=None,
                )
            except ConfigError as exc:
                problems += exc.problems
    return problems


def _actor_critic_problems(job: JobConfig) -> list[Problem]:
    """A ``maac``/``iac`` critic backbone (:mod:`pbrl.learning.critics`) resolves offline and shares the agents'
    vocabulary (the critic reads the agents' token ids). The critic layout is checked with the config
    (:mod:`pbrl.config.rules`)."""

    problems = []
    head_only = job.rl_algorithm == "iac" and not job.use_separate_critic
    if job.critic_model_name and not head_only:
        try:
            critic = load_tokenizer(resolve_model_source(job.critic_model_name, field="critic_model_name"))
            agents = policy_source(job).models
            if any(load_tokenizer(resolve_model_source(m)).get_vocab() != critic.get_vocab() for m in set(agents)):
                problems.append(
                    Problem(
                        "critic_model_name",
                        job.critic_model_name,
                        "has another vocabulary than "
                        "the agents' models; a critic reads the agents' token ids, so give a "
                        "backbone with the agents' tokenizer",
                    )
                )
        except ConfigError as exc:
            problems += exc.problems
        except ArtifactError as exc:
            problems.append(Problem("critic_model_name", job.critic_model_name, str(exc)))
    return problems
