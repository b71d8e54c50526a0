"""What a task is: items, one prompt formatter per agent, and the oracle's ``reward_func`` (+ ``reward_processor``).

Users build a :class:`Task` from import paths (``"pkg.module:function"``), pass callables through the Python
API, or name a registered task (:mod:`pbrl.tasks.registry`).
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
            ``batch_items=`` (the n items); returns n numbers. None: a task judged only by a pairwise judge
            (``preference_source: judge``; docs/guides/judges.md), with no score to order pairs or evaluate by.
        reward_processor: optional float -> float applied to every raw reward (identity when None).
        train_items / eval_items: default items (dicts) when the user gives none.
        reward_range: optional (low, high) of the raw reward, for reports.
        roles: each agent's role name, as a judge is shown the joint responses; empty = "agent 1", "agent 2", ...
    """

    name: str
    formatters: tuple[Formatter, ...]
    reward_func: RewardFunc | None
    reward_processor: RewardProcessor | None = None
    train_items: tuple[dict[str, Any], ...] = ()
    eval_items: tuple[dict[str, Any], ...] = ()
    reward_range: tuple[float, float] | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    roles: tuple[str, ...] = ()

    def role_names(self, num_agents: int) -> tuple[str, ...]:
        """The agents' role names: :attr:`roles` when it names every agent, else "agent 1", "agent 2", ..."""
        if len(self.roles) == num_agents:
            return tuple(self.roles)
        return tuple(f"agent {i + 1}" for i in range(num_agents))


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
