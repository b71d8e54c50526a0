"""The run's task: an attached Python task, else the registered task and/or the import paths of its config,
and the fingerprint of its code that keys stage caches."""

from __future__ import annotations

import hashlib
import inspect
from pathlib import Path
from typing import Any

from pbrl.config import JobConfig
from pbrl.errors import ConfigError, Problem
from pbrl.tasks.base import Task, import_object
from pbrl.tasks.registry import TASKS, get_task

# Tasks given as Python objects through the trainer API, keyed by resolved run folder. Stages run in the
# same process as the trainer (Prefect's default thread runner), so they find them here.
_ATTACHED_TASKS: dict[str, Task] = {}


# The ``task`` label of a job whose task exists only as Python objects in the process that started it.
IN_PROCESS_TASK = "python"


def attach_task(run_dir: Path, task: Task) -> None:
    """Make a Python-object task (callables) available to the stages of the run in this process."""
    _ATTACHED_TASKS[str(Path(run_dir).resolve())] = task


def attached_task(run_dir: Path) -> Task | None:
    """The task attached to ``run_dir`` in this process, if any."""
    return _ATTACHED_TASKS.get(str(Path(run_dir).resolve()))


def resolve_task(job: JobConfig, run_dir: Path | None = None) -> Task:
    """The run's task: an attached Python task, else the registered task and/or import paths in the config.

    Raises:
        ConfigError: an import path cannot be imported, or the formatter count differs from num_agents.
    """
    if run_dir is not None and (task := attached_task(run_dir)):
        return task
    if job.task == IN_PROCESS_TASK:
        raise ConfigError(
            [
                Problem(
                    "task",
                    job.task,
                    "this run's task was given as Python objects (callables or "
                    "in-memory items) to the trainer API and lives only in that process; give "
                    "module-level functions and dataset files (recorded by import path and file "
                    "name) to run its stages from the CLI or the UI",
                )
            ]
        )
    problems: list[Problem] = []
    base = _registered_task(job.task, job.task_options, problems) if job.task else None
    formatters = tuple(_import("formatters", p, problems) for p in job.formatters) if job.formatters else None
    reward_func = _import("reward_func", job.reward_func, problems) if job.reward_func else None
    processor = _import("reward_processor", job.reward_processor, problems) if job.reward_processor else None
    if problems:
        raise ConfigError(problems)
    task = Task(
        name=job.task or "custom",
        formatters=formatters or (base.formatters if base else ()),
        reward_func=reward_func or (base.reward_func if base else None),  # type: ignore[arg-type]
        reward_processor=processor or (base.reward_processor if base else None),
        train_items=base.train_items if base else (),
        eval_items=base.eval_items if base else (),
        reward_range=base.reward_range if base else None,
    )
    if len(task.formatters) != job.num_agents:
        raise ConfigError(
            [Problem("formatters", len(task.formatters), f"need one formatter per agent ({job.num_agents})")]
        )
    return task


def _registered_task(name: str, options: dict[str, Any], problems: list[Problem]) -> Task | None:
    """The registered task ``name`` built with ``options`` (``task_options``), or None with its problem added to
    ``problems``."""
    try:
        return get_task(name, **options)
    except ConfigError as exc:  # the factory's own checks, each naming its option
        problems += exc.problems
    except KeyError as exc:  # an unknown task: the message is the KeyError's argument (str() would quote it)
        problems.append(Problem("task", name, str(exc.args[0]) if exc.args else "unknown task"))
    except (TypeError, ValueError) as exc:
        problems.append(_task_options_problem(name, options, exc))
    return None


def _import(field: str, path: str, problems: list[Problem]) -> Any:
    """The object at import path ``path`` (option ``field``), or None with its problem added to ``problems``."""
    try:
        return import_object(path)
    except ImportError as exc:
        problems.append(Problem(field, path, str(exc)))
        return None


def task_fingerprint(task: Task) -> str:
    """A hash of the task's code identity (qualified names and sources) for cache keys."""
    h = hashlib.sha256()
    for fn in (*task.formatters, task.reward_func, task.reward_processor):
        if fn is None:
            continue
        h.update(f"{getattr(fn, '__module__', '')}:{getattr(fn, '__qualname__', repr(fn))}".encode())
        try:
            h.update(inspect.getsource(fn).encode())
        except (OSError, TypeError):
            pass
    return h.hexdigest()


def _task_options_problem(task: str, options: dict[str, Any], exc: Exception) -> Problem:
    """The problem of ``task_options`` that a task factory refused: unknown names are listed with the task's
    options; anything else keeps the factory's message whole."""
    try:
        accepted = list(inspect.signature(TASKS[task]).parameters)
    except (KeyError, TypeError, ValueError):
        accepted = []
    unknown = [name for name in options if accepted and name not in accepted]
    if unknown:
        return Problem(
            "task_options",
            options,
            f"unknown option(s) {', '.join(repr(n) for n in unknown)} of task "
            f"{task!r}; its options: {', '.join(accepted)}",
        )
    return Problem("task_options", options, f"task {task!r} refused them: {exc}")
