"""The public trainer API (SPEC §7), with the reference library's names.

    from pbrl.trainers import MADPOIterTrainer, MADPOIterConfig
    trainer = MADPOIterTrainer(MADPOIterConfig(num_iterations=2), agent_model="smollm2-135m-instruct",
                               task="humaneval_docs", run_name="docs-1")
    result = trainer.train()

Each trainer runs the same Prefect flows as ``pbrl train``; the run folder is the same for the same
configuration. Callables (``reward_func``, ``formatters``, ``reward_processor``) may be given directly;
module-level functions are also recorded by import path so that ``pbrl stage`` can rerun a stage later.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pandas as pd

from pbrl.config import (
    MADPOConfig,
    MADPOIterConfig,
    MARLHFConfig,
    MARLHFIterConfig,
    TrainerConfig,
    make_job,
)
from pbrl.tasks import Task

__all__ = [
    "MADPOConfig", "MADPOIterConfig", "MARLHFConfig", "MARLHFIterConfig",
    "MADPOTrainer", "MADPOIterTrainer", "MARLHFTrainer", "MARLHFIterTrainer", "TrainResult",
]


@dataclass(frozen=True)
class TrainResult:
    run_dir: Path
    stages: list[dict[str, Any]]
    rounds: pd.DataFrame  # one row per round: pairs, loss, accuracy, eval reward


def _import_path(fn: Callable[..., Any]) -> str | None:
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not module or module == "__main__" or "<" in qualname:
        return None
    return f"{module}:{qualname}"


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
    from pbrl import orchestration
    from pbrl.metrics import round_table
    from pbrl.run import prepare_run, resolve_task

    callables = [f for f in (reward_func, reward_processor, *(formatters or ())) if f is not None and callable(f)]
    paths = {
        "reward_func": reward_func if isinstance(reward_func, str) else (_import_path(reward_func) if reward_func else None),
        "reward_processor": reward_processor if isinstance(reward_processor, str)
        else (_import_path(reward_processor) if reward_processor else None),
    }
    formatter_paths = [f if isinstance(f, str) else _import_path(f) for f in formatters] if formatters else None
    run = {
        "trainer": trainer,
        "run_name": run_name or f"{trainer}-{datetime.now(UTC):%Y%m%d-%H%M%S}",
        "agents": list(agents) if agents else None,
        "agent_model": agent_model,
        "task": task,
        "train_dataset": train_dataset if isinstance(train_dataset, str) else None,
        "eval_dataset": eval_dataset if isinstance(eval_dataset, str) else None,
        "formatters": formatter_paths if formatter_paths and all(formatter_paths) else None,
        **run_options,
    }
    if task is None and run["train_dataset"] is None and train_dataset is not None:
        run["task"] = "python"  # items and callables come from this process (see pbrl.run.attach_task)
    fields = dict(paths) if all(paths[k] or not f for k, f in (("reward_func", reward_func),
                                                                 ("reward_processor", reward_processor))) else {}
    job = make_job(run, config.model_copy(update={k: v for k, v in fields.items() if v}))
    python_task = None
    if callables or (train_dataset is not None and not isinstance(train_dataset, str)):
        base = resolve_task(job.model_copy(update={"task": task}), None) if task else None
        python_task = Task(
            name=task or "python",
            formatters=tuple(f if callable(f) else None for f in formatters) if formatters else base.formatters,
            reward_func=reward_func if callable(reward_func) else (base.reward_func if base else None),
            reward_processor=reward_processor if callable(reward_processor) else (base.reward_processor if base else None),
            train_items=base.train_items if base else (),
            eval_items=base.eval_items if base else (),
        )
    prepare_run(job, resume=resume, task=python_task,
                train_items=None if isinstance(train_dataset, str) else train_dataset,
                eval_items=None if isinstance(eval_dataset, str) else eval_dataset)
    out = orchestration.train(job, resume=True)
    run_dir = Path(out["run_dir"])
    return TrainResult(run_dir=run_dir, stages=out["stages"], rounds=round_table(run_dir))


class MADPOTrainer:
    """MADPO, base: one collection among the agents' own candidates, then ``num_train_epochs`` of updates.
    All-tie data returns without updating the policies and says so (SPEC §4)."""

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
    """MARLHF, base. Configuration and data collection are available; reward-model fitting and RL policy
    learning are not in this version, so ``train`` stops at update-policies with a clear error."""

    def __init__(self, config: MARLHFConfig | None = None, **kwargs: Any):
        self.config, self.kwargs = config or MARLHFConfig(), kwargs

    def train(self) -> TrainResult:
        return _train("marlhf", self.config, **self.kwargs)


class MARLHFIterTrainer:
    """MARLHF, iterative. Same availability as :class:`MARLHFTrainer`."""

    def __init__(self, config: MARLHFIterConfig | None = None, **kwargs: Any):
        self.config, self.kwargs = config or MARLHFIterConfig(), kwargs

    def train(self) -> TrainResult:
        return _train("marlhf_iter", self.config, **self.kwargs)
