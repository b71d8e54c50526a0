"""The registered tasks: name -> factory ``(**options) -> Task``.

The table is written out here (no registration by import side effect), so the registry imports the task
modules and no task module imports the registry.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pbrl.tasks.base import Task
from pbrl.tasks.humaneval_coop import humaneval_coop_task
from pbrl.tasks.humaneval_docs import humaneval_docs_task
from pbrl.tasks.toy import toy_task

TASKS: dict[str, Callable[..., Task]] = {
    "toy": toy_task,
    "humaneval_docs": humaneval_docs_task,
    "humaneval_coop": humaneval_coop_task,
}


def task_names() -> list[str]:
    """Names of the registered tasks, sorted (the choices of ``task`` in the CLI help and the Prefect form)."""
    return sorted(TASKS)


def get_task(name: str, **options: Any) -> Task:
    """Build the registered task ``name``. Raises KeyError naming the known tasks."""
    if name not in TASKS:
        raise KeyError(f"unknown task {name!r}; registered: {', '.join(task_names())}")
    return TASKS[name](**options)
