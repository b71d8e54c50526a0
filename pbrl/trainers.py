"""The public trainer API (docs/guides/python-api.md#the-python-api), with the reference library's names.

    from pbrl.trainers import MADPOIterTrainer, MADPOIterConfig
    trainer = MADPOIterTrainer(MADPOIterConfig(num_iterations=2), agent_model="smollm2-135m-instruct",
                               task="humaneval_docs", run_name="docs-1")
    result = trainer.train()

Each trainer runs the same Prefect flows as ``pbrl train``; the run folder is the same for the same
configuration. Callables (``reward_func``, ``formatters``, ``reward_processor``) may be given directly;
module-level functions are also recorded by import path so that ``pbrl stage`` can rerun a stage later.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from pbrl import orchestration
from pbrl.config import (
    MADPOConfig,
    MADPOIterConfig,
    MARLHFConfig,
    MARLHFIterConfig,
    TrainerConfig,
    make_job,
)
from pbrl.config.dataset_spec import DatasetSpec
from pbrl.reporting.metrics import round_table
from pbrl.run.folder import generated_run_name, prepare_run
from pbrl.run.task import IN_PROCESS_TASK, resolve_task
from pbrl.tasks.base import Task

__all__ = [
    "MADPOConfig",
    "MADPOIterConfig",
    "MARLHFConfig",
    "MARLHFIterConfig",
    "DatasetSpec",
    "MADPOTrainer",
    "MADPOIterTrainer",
    "MARLHFTrainer",
    "MARLHFIterTrainer",
    "TrainResult",
]


@dataclass(frozen=True)
class TrainResult:
    run_dir: Path
    stages: list[dict[str, Any]]
    messages: list[str]  # what people should know: no pairs, skipped updates, dropped candidates
    rounds: pd.DataFrame  # one row per round: pairs, loss, accuracy, eval reward


def _import_path(fn: Callable[..., Any]) -> str | None:
    """``"module:qualname"`` of a module-level function (None for lambdas, closures and __main__)."""
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not module or module == "__main__" or "<" in qualname:
        return None
    return f"{module}:{qualname}"


def _as_config_value(value: Any) -> Any:
    """A config value for ``value`` when it has one (a string, or an importable function), else None."""
    if isinstance(value, (str, Path)):
        return str(value)
    return _import_path(value) if callable(value) else None


def _dataset_config_value(value: Any) -> Any:
    """The config value of a ``train_dataset`` / ``eval_dataset`` argument: a path as text, a dataset spec
    (:class:`~pbrl.config.dataset_spec.DatasetSpec` or a mapping of its fields, validated with the config), else
    None: in-memory items (a list of dicts, a ``datasets.Dataset``) stay in this process."""
    if isinstance(value, (str, Path)):
        return str(value)
    if isinstance(value, Mapping):
        return dict(value)
    return value if isinstance(value, DatasetSpec) else None


def _train(
    trainer: str,
    config: TrainerConfig,
    *,
    agents: Sequence[str] | None = None,
    agent_model: str | None = None,
    task: str | None = None,
    reward_func: Callable[..., Any] | str | None = None,
    reward_processor: Callable[[float], float] | str | None = None,
    formatters: Sequence[Callable[[dict], str] | str] | None = None,
    train_dataset: Any = None,
    eval_dataset: Any = None,
    run_name: str | None = None,
    resume: bool = False,
    **run_options: Any,
) -> TrainResult:

    # What can be written as config values is (so CLI reruns work); callables and in-memory datasets stay
    # in this process as an attached task.
    given = {"reward_func": reward_func, "reward_processor": reward_processor}
    fn_paths = {k: _as_config_value(v) for k, v in given.items() if v is not None}
    formatter_paths = [_as_config_value(f) for f in formatters] if formatters else None
    run = {
        "trainer": trainer,
        "run_name": run_name or generated_run_name(trainer),
        "agents": list(agents) if agents else None,
        "agent_model": agent_model,
        "task": task,
        "train_dataset": _dataset_config_value(train_dataset),
        "eval_dataset": _dataset_config_value(eval_dataset),
        "formatters": formatter_paths if formatter_paths and all(formatter_paths) else None,
        **run_options,
    }
    in_process = any(callable(v) for v in (reward_func, reward_processor, *(formatters or ()))) or (
        train_dataset is not None and run["train_dataset"] is None
    )
    if in_process and task is None and not (run["train_dataset"] and run["formatters"] and fn_paths.get("reward_func")):
        run["task"] = IN_PROCESS_TASK  # a label: the task lives in this process (pbrl.run.task.attach_task)
    job = make_job(run, config.model_copy(update={k: v for k, v in fn_paths.items() if v}))
    attached = None
    if in_process:
        base = resolve_task(job) if task else None
        attached = Task(
            name=task or "python",
            formatters=tuple(formatters)
            if formatters and all(callable(f) for f in formatters)
            else (base.formatters if base else ()),
            reward_func=reward_func if callable(reward_func) else base.reward_func,  # type: ignore[union-attr]
            reward_processor=reward_processor
            if callable(reward_processor)
            else (base.reward_processor if base else None),
            train_items=base.train_items if base else (),
            eval_items=base.eval_items if base else (),
        )
    prepare_run(
        job,
        resume=resume,
        task=attached,
        train_items=train_dataset if run["train_dataset"] is None else None,
        eval_items=eval_dataset if run["eval_dataset"] is None else None,
    )
    out = orchestration.train(job, resume=True)
    run_dir = Path(out["run_dir"])
    return TrainResult(run_dir=run_dir, stages=out["stages"], messages=out["messages"], rounds=round_table(run_dir))


class MADPOTrainer:
    """MADPO, base: one collection among the agents' own candidates, then ``num_train_epochs`` of updates.
    All-tie data returns without updating the policies and says so
    (docs/design/stages.md#when-there-is-nothing-to-learn)."""

    def __init__(self, config: MADPOConfig | None = None, **kwargs: Any):
        self.config, self.kwargs = config or MADPOConfig(), kwargs

    def train(self) -> TrainResult:
        return _train("madpo", self.config, **self.kwargs)


class MADPOIterTrainer:
    """MADPO, iterative: ``num_iterations`` rounds of collect → store → replay → learn against a comparator."""

    def __init__(self, config: MADPOIterConfig | None = None, **kwargs: Any):
        self.config, self.kwargs = config or MADPOIterConfig(), kwargs

    def train(self) -> TrainResult:
        return _train("madpo_iter", self.config, **self.kwargs)


class MARLHFTrainer:
    """MARLHF, base: one collection among the agents' own candidates, a joint reward model fitted on its pairs
    (fit-reward-model, Bradley–Terry), then ``num_train_epochs`` of RL against it (``rl_algorithm``: magrpo,
    mareinforce, marloo or maremax; optional reference KL). Evaluation uses the task reward. All-tie data
    fits no reward model and returns without updating the policies, and says so
    (docs/design/stages.md#when-there-is-nothing-to-learn)."""

    def __init__(self, config: MARLHFConfig | None = None, **kwargs: Any):
        self.config, self.kwargs = config or MARLHFConfig(), kwargs

    def train(self) -> TrainResult:
        return _train("marlhf", self.config, **self.kwargs)


class MARLHFIterTrainer:
    """MARLHF, iterative: ``num_iterations`` rounds of collect → store → replay → fit a fresh reward model →
    RL, against a comparator. With ``preference_scoring_reward='reward_model'`` the newest fitted reward model
    scores new comparisons (the task reward until one exists)."""

    def __init__(self, config: MARLHFIterConfig | None = None, **kwargs: Any):
        self.config, self.kwargs = config or MARLHFIterConfig(), kwargs

    def train(self) -> TrainResult:
        return _train("marlhf_iter", self.config, **self.kwargs)
