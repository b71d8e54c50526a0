"""Preflight: what a config cannot check on its own, checked before any run folder is touched or Prefect
started (``pbrl validate``, ``pbrl train``, the trainers and every run start)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig

from pbrl.config import JobConfig, is_iterative
from pbrl.data.items import load_run_items
from pbrl.errors import ArtifactError, ConfigError, Problem
from pbrl.generation.comparator_factory import preflight_problems as comparator_preflight_problems
from pbrl.models.loading import check_lora_target_modules, load_tokenizer, resolve_model_source
from pbrl.models.packaged import PACKAGED_MODELS, locate_packaged_file
from pbrl.models.placement import auto_device_map
from pbrl.models.precision import autocast_problem
from pbrl.reporting.reward_hist import check_reward_range
from pbrl.reporting.tracker_tools import tracker_problems
from pbrl.run.judging import preflight_problems as judge_preflight_problems
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
    once), ``lora_target_modules`` name modules of the model, the comparator policy is available, and with
    centralized collaboration the adapter imports.
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
    missing_files = False
    for name in ("train_dataset", "eval_dataset"):
        path = getattr(job, name)
        if isinstance(path, str) and not Path(path).is_file():  # a DatasetSpec is checked when loaded
            problems.append(Problem(name, path, "file not found"))
            missing_files = True
    if task is not None and check_items and not missing_files:
        try:
            load_run_items(job, task, train_items, eval_items)
        except ConfigError as exc:
            problems += exc.problems
    field = "agents" if job.agents else "agent_model"
    for source in dict.fromkeys(policy_source(job).models):
        try:
            if not prepare_models and source in PACKAGED_MODELS:
                locate_packaged_file(source)  # the packaged file is there; conversion waits for training
            else:
                resolved = resolve_model_source(source, field=field)
                problems += _lora_target_problems(job, resolved)
        except ConfigError as exc:
            problems += exc.problems
        except ArtifactError as exc:
            problems.append(Problem(field, source, str(exc)))
    problems += _reward_layers_problems(job, prepare_models)
    problems += judge_preflight_problems(job, task, prepare_models=prepare_models)
    problems += _precision_and_placement_problems(job)
    problems += tracker_problems(getattr(job, "report_to", None))
    if problems:
        raise ConfigError(list({str(p): p for p in problems}.values()))  # the same problem once
    return task  # type: ignore[return-value]


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


def _reward_layers_problems(job: JobConfig, prepare_models: bool) -> list[Problem]:
    """``reward_backbone_layers`` beyond the reward model backbone's layers (read from its config; a packaged
    model not converted yet is checked when the reward model is built)."""
    layers = getattr(job, "reward_backbone_layers", None)
    if layers is None:
        return []
    source = job.reward_model_name or policy_source(job).models[0]
    if not prepare_models and source in PACKAGED_MODELS:
        return []
    try:
        total = AutoConfig.from_pretrained(resolve_model_source(source, field="reward_model_name")).num_hidden_layers
    except (ConfigError, ArtifactError, OSError, ValueError):
        return []  # an unusable source is reported by the model checks
    if layers <= total:
        return []
    return [Problem("reward_backbone_layers", layers, f"the reward model backbone {source} has {total} layers")]


def _lora_target_problems(job: JobConfig, resolved: Any) -> list[Problem]:
    """``lora_target_modules`` entries that name no module of the model (LoRA only)."""
    if job.lora_r is None or not job.lora_target_modules:
        return []

    unknown = check_lora_target_modules(resolved, list(job.lora_target_modules))
    if not unknown:
        return []
    return [
        Problem(
            "lora_target_modules",
            unknown,
            f"no module of {resolved} is named so; check the model's "
            "module names (e.g. q_proj, k_proj, v_proj, o_proj for Llama-style models)",
        )
    ]
