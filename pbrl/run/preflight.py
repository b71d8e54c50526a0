"""Preflight: what a config cannot check on its own, checked before any run folder is touched or Prefect
started (``pbrl validate``, ``pbrl train``, the trainers and every run start)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pbrl.config import IterativeJob, JobConfig, RewardModelJob, is_centralized
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

    The checks are :data:`CHECKS`, run in order on the job with its task and items resolved (:class:`Subject`).

    Returns:
        The resolved task.

    Raises:
        ConfigError: every problem found, at once.
    """
    subject = _subject(job, task, prepare_models, train_items, eval_items, check_items)
    problems = [problem for check in CHECKS for problem in check(subject)]
    if problems:
        raise ConfigError(list({str(p): p for p in problems}.values()))  # the same problem once
    return subject.task  # type: ignore[return-value]


@dataclass(frozen=True)
class Subject:
    """What the checks read: the job; its task and items as resolved (None where they failed, or the items were
    not checked), with the problems that resolving them found; the agents' model sources; and whether packaged
    models may be converted."""

    job: JobConfig
    task: Task | None
    task_problems: list[Problem]
    items: list[tuple[str, dict[str, Any]]] | None
    item_problems: list[Problem]
    models: tuple[str, ...]
    prepare_models: bool


def _subject(
    job: JobConfig, task: Task | None, prepare_models: bool, train_items: Any, eval_items: Any, check_items: bool
) -> Subject:
    """The job with its task resolved (unless given) and its items loaded (unless ``check_items`` is off)."""
    task_problems: list[Problem] = []
    try:
        task = task or resolve_task(job)
    except ConfigError as exc:
        task_problems += exc.problems
    items, item_problems = _loaded_items(job, task, train_items, eval_items, check_items)
    return Subject(job, task, task_problems, items, item_problems, policy_source(job).models, prepare_models)


def _comparator_check(s: Subject) -> list[Problem]:
    """The iterative trainers' comparator policy is available (:mod:`pbrl.generation.comparator_factory`)."""
    job = s.job
    if not isinstance(job, IterativeJob):
        return []
    return comparator_preflight_problems(
        job.comparator_policy,
        model_sources=job.comparator_agents or [job.comparator_model_name or ""],
        model_field="comparator_agents" if job.comparator_agents else "comparator_model_name",
        key_env=job.comparator_api_key_env,
        generation_mode=job.comparator_generation_mode,
        adapter_path=job.comparator_centralized_adapter,
    )


def _adapter_import_check(s: Subject) -> list[Problem]:
    """With ``collaboration_mode: centralized``, the actor's adapter imports."""
    if not is_centralized(s.job):
        return []
    try:
        centralized_adapter(s.job)
    except ConfigError as exc:
        return exc.problems
    return []


def _reward_range_check(s: Subject) -> list[Problem]:
    """``log_reward_distribution`` (iterative trainers) needs a task whose rewards have a range."""
    job, task = s.job, s.task
    if not (isinstance(job, IterativeJob) and job.log_reward_distribution) or task is None:
        return []
    try:
        check_reward_range(getattr(task.reward_func, "reward_range", None) or task.reward_range, source=task.name)
    except ValueError as exc:
        return [Problem("log_reward_distribution", True, str(exc))]
    return []


def _agent_model_check(s: Subject) -> list[Problem]:
    """The agents' models, with each agent's prompts where the task and items resolved
    (:func:`pbrl.run.preflight_models.agent_model_problems`)."""
    prompts = None
    if s.task is not None and s.items is not None:
        try:
            prompts = with_ids(
                actor_prompts(s.task, [item for _, item in s.items], centralized_adapter(s.job)), s.items
            )
        except ConfigError:
            prompts = None  # the formatters' and the adapter's problems are reported with the items
    return agent_model_problems(s.job, s.models, prompts, prepare=s.prepare_models)


def _loaded_items(
    job: JobConfig, task: Task | None, train_items: Any, eval_items: Any, check_items: bool
) -> tuple[list[tuple[str, dict[str, Any]]] | None, list[Problem]]:
    """The train and eval items with their ids (``(item_id, item)``; None when they were not loaded, or failed to
    load), and every problem found loading them."""
    problems: list[Problem] = []
    missing_files = False
    for name, path in (("train_dataset", job.train_dataset), ("eval_dataset", job.eval_dataset)):
        if isinstance(path, str) and not Path(path).is_file():  # a DatasetSpec is checked when loaded
            problems.append(Problem(name, path, "file not found"))
            missing_files = True
    if task is None or not check_items or missing_files:
        return None, problems
    try:
        train, evals = load_run_items(job, task, train_items, eval_items)
    except ConfigError as exc:
        return None, problems + exc.problems
    return with_item_ids(train, "item", "train_dataset") + with_item_ids(evals, "eval", "eval_dataset"), problems


def _environment_check(s: Subject) -> list[Problem]:
    """What the job asks of this machine: devices, folders, threads, Prefect's parameter size, and the centralized
    adapter's contract (:mod:`pbrl.run.preflight_env`)."""
    job = s.job
    problems = device_problems(job) + thread_problems(job) + parameter_size_problems(job)
    problems += folder_problems(job, packaged_models=any(m in PACKAGED_MODELS for m in s.models))
    if s.task is not None and is_centralized(job):
        try:
            adapter = centralized_adapter(job)
        except ConfigError:
            adapter = None  # reported above
        if adapter is not None:
            problems += adapter_problems(adapter, len(s.task.formatters), s.items[0][1] if s.items else None)
    return problems


def _precision_and_placement_check(s: Subject) -> list[Problem]:
    """``mixed_precision`` autocast available on every agent device type; ``agent_devices: auto`` without
    LoRA fits ``max_memory`` without offloading trainable weights (accelerate's device map, no weights read)."""
    job, _ = concrete_precision(s.job)  # auto resolves to what the device runs natively: checked like the rest
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


def _actor_critic_check(s: Subject) -> list[Problem]:
    """A ``maac``/``iac`` critic backbone (:mod:`pbrl.learning.critics`) resolves offline and shares the agents'
    vocabulary (the critic reads the agents' token ids). The critic layout is checked with the config
    (:mod:`pbrl.config.rules`)."""
    job = s.job
    if not (isinstance(job, RewardModelJob) and job.rl_algorithm in ("maac", "iac")):
        return []
    problems = []
    head_only = job.rl_algorithm == "iac" and not job.use_separate_critic
    if job.critic_model_name and not head_only:
        try:
            critic = load_tokenizer(resolve_model_source(job.critic_model_name, field="critic_model_name"))
            if any(load_tokenizer(resolve_model_source(m)).get_vocab() != critic.get_vocab() for m in set(s.models)):
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


# The checks in the order their problems are reported: each reads the subject and returns its problems.
CHECKS: tuple[Callable[[Subject], list[Problem]], ...] = (
    _actor_critic_check,
    _comparator_check,
    _adapter_import_check,
    lambda s: s.task_problems,
    _reward_range_check,
    lambda s: s.item_problems,
    _agent_model_check,
    _environment_check,
    lambda s: judge_preflight_problems(s.job, s.task, prepare_models=s.prepare_models),
    _precision_and_placement_check,
    lambda s: tracker_problems(s.job.report_to),
)
