"""Tasks: items, one prompt formatter per agent, and the oracle's ``reward_func`` (+ ``reward_processor``).

A registered task is a factory ``(**options) -> Task``. Users may also build a :class:`Task` from
import paths (``"pkg.module:function"``) or pass callables through the Python API.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

Formatter = Callable[[dict[str, Any]], str]
RewardFunc = Callable[..., Sequence[float]]
RewardProcessor = Callable[[float], float]


@dataclass(frozen=True)
class Task:
    """A cooperative task for ``len(formatters)`` agents.

    Attributes:
        name: registry name or a user label.
        formatters: one prompt formatter per agent; ``formatters[i](item) -> str`` is agent i's prompt h_i.
        reward_func: the oracle, called on a batch of n joint responses with one list of n completions per
            agent (positional), optionally ``prompts=`` (list of n lists, one prompt per agent) and
            ``batch_items=`` (the n items); returns n numbers.
        reward_processor: optional float -> float applied to every raw reward (identity when None).
        train_items / eval_items: default items (dicts) when the user gives none.
        reward_range: optional (low, high) of the raw reward, for reports.
    """

    name: str
    formatters: tuple[Formatter, ...]
    reward_func: RewardFunc
    reward_processor: RewardProcessor | None = None
    train_items: tuple[dict[str, Any], ...] = ()
    eval_items: tuple[dict[str, Any], ...] = ()
    reward_range: tuple[float, float] | None = None
    metadata: dict[str, Any] = field(default_factory=dict)


_REGISTRY: dict[str, Callable[..., Task]] = {}


def register_task(name: str) -> Callable[[Callable[..., Task]], Callable[..., Task]]:
    """Decorator: register a task factory under ``name``."""

    def wrap(factory: Callable[..., Task]) -> Callable[..., Task]:
        _REGISTRY[name] = factory
        return factory

    return wrap


def _load_builtin_tasks() -> None:
    # Imported for their @register_task side effect; kept lazy so `import pbrl` stays light.
    from pbrl.tasks import humaneval, toy  # noqa: F401


def registered_tasks() -> list[str]:
    """Names of the registered tasks."""
    _load_builtin_tasks()
    return sorted(_REGISTRY)


def get_task(name: str, **options: Any) -> Task:
    """Build the registered task ``name``. Raises KeyError naming the known tasks."""
    _load_builtin_tasks()
    if name not in _REGISTRY:
        raise KeyError(f"task: unknown task {name!r}; registered: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name](**options)


def import_object(path: str) -> Any:
    """Import ``"pkg.module:attr"`` (or ``"pkg.module.attr"``). Raises ImportError naming the path."""
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ImportError(f"{path!r} is not an import path of the form 'pkg.module:function'")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise ImportError(f"cannot import {path!r}: {exc}") from exc
    return obj
