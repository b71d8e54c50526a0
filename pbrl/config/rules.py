"""Cross-field rules of the pbrl configuration: what a rule is, and the checks several rules share.

The rules themselves are in :mod:`pbrl.config.trainer_rules` (per trainer; the replay options' in
:mod:`pbrl.config.replay_rules`) and :mod:`pbrl.config.run_rules` (run-level fields and whole jobs).

Each rule is a plain function over a mapping of field values that returns a list of :class:`Problem`.
A :class:`Rule` also names the fields it reads, so that a rule is skipped when one of its inputs already
failed type validation (one mistake gives one problem, not a cascade). Range and type checks of single
fields live on the pydantic fields (:mod:`pbrl.config.fields`: ``Field(ge=...)``, ``Literal``), where the
Prefect UI form sees them; :mod:`pbrl.config.messages` gives their errors the same ``Problem`` wording.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from pbrl.errors import Problem

Values = Mapping[str, Any]

HIDDEN = "<hidden>"


def secret_message(key_env: str = "comparator_api_key_env (judge_api_key_env for the judge)") -> str:
    """Why a credential in the configuration is refused, and the option ``key_env`` that names its variable."""
    return (
        "pbrl never takes an API key in the configuration (it would end up in run.json, logs and Prefect "
        f"parameters); put the key in an environment variable and give that variable's name in {key_env}"
    )


SECRET_MESSAGE = secret_message()

IMPORT_PATH_PATTERN = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
DEVICE_PATTERN = re.compile(r"^(cpu|cuda|mps|xpu)(:\d+)?$")
ENV_NAME_PATTERN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
RUN_NAME_PATTERN = re.compile(r"^[A-Za-z0-9._-]+$")
MEMORY_SIZE_PATTERN = re.compile(r"^\d+(\.\d+)?(GiB|MiB|KiB|GB|MB|KB)$", re.IGNORECASE)  # accelerate's sizes
MEMORY_DEVICES = ("cpu", "mps", "disk")
AUTO = "auto"
CENTRALIZED = "centralized"  # collaboration_mode: one actor writes every role (pbrl.generation.collaboration)
# Device options that may be 'auto', by trainer field set (each is read only where that trainer has it).
AUTO_FIELDS = ("agent_devices", "comparator_devices", "reference_devices", "reward_model_device")
GROUP_BASELINE = ("magrpo", "mareinforce", "marloo", "maremax")
ACTOR_CRITIC = ("maac", "iac")
# Comparator policies that load a separate copy of some policy on comparator_devices.
SEPARATE_COMPARATORS = ("current_copy", "model", "history")
# Headers that carry an API key: never a config value (the key comes from comparator_api_key_env).
KEY_HEADERS = frozenset({"authorization", "x-api-key", "api-key", "proxy-authorization"})


@dataclass(frozen=True)
class Rule:
    """A cross-field rule: ``check(values)`` lists the problems; ``fields`` are the values it reads."""

    fields: tuple[str, ...]
    check: Callable[[Values], list[Problem]]


def run_rules(rules: Iterable[Rule], values: Values, invalid: frozenset[str] = frozenset()) -> list[Problem]:
    """All problems of ``rules`` over ``values``, skipping rules that read a field listed in ``invalid``."""
    problems: list[Problem] = []
    for rule in rules:
        if not invalid.intersection(rule.fields):
            problems.extend(rule.check(values))
    return problems


def rule(registry: list[Rule], *fields: str) -> Callable[[Callable[[Values], list[Problem]]], Rule]:
    def wrap(check: Callable[[Values], list[Problem]]) -> Rule:
        registry.append(Rule(fields, check))
        return registry[-1]

    return wrap


def actors(v: Values) -> int:
    """The number of policies: 1 with collaboration_mode='centralized' (one actor writes every role), else
    num_agents (pbrl.config.num_actors over a mapping of values)."""
    return 1 if v["collaboration_mode"] == CENTRALIZED else v["num_agents"]


def only_with(field: str, value: Any, condition: str) -> Problem:
    return Problem(field, value, f"allowed only with {condition}; set it to None")


def import_path_problems(field: str, value: str | list[str] | None) -> list[Problem]:
    """Problems of an import path ``"pkg.module:function"`` (or a list of them)."""
    if value is None:
        return []
    paths = [value] if isinstance(value, str) else list(value)
    bad = [(i, p) for i, p in enumerate(paths) if not IMPORT_PATH_PATTERN.match(p)]
    if not bad:
        return []
    if isinstance(value, str):
        return [Problem(field, value, "must be an import path like 'pkg.module:function'")]
    where = ", ".join(f"item {i} ({p!r})" for i, p in bad)
    return [Problem(field, value, f"{where}: each item must be an import path like 'pkg.module:function'")]


def device_problems(field: str, spec: str | list[str] | None, num_agents: int | None) -> list[Problem]:
    """Problems of a device spec: None, one device for all agents, ``'auto'`` (accelerate's device map, given
    alone), or a list of 1 or ``num_agents`` devices."""
    if spec is None or spec == AUTO:
        return []
    devices = [spec] if isinstance(spec, str) else list(spec)
    if AUTO in devices:
        return [
            Problem(
                field,
                spec,
                f"'auto' places every model with accelerate's device map: give it alone ({field}: auto), not in a list",
            )
        ]
    problems = []
    if any(not DEVICE_PATTERN.match(d) for d in devices):
        problems.append(Problem(field, spec, "devices look like 'cpu', 'cuda', 'cuda:1' or 'mps'"))
    if num_agents is not None and not isinstance(spec, str) and len(devices) not in (1, num_agents):
        problems.append(Problem(field, spec, f"must list 1 device or one per agent (num_agents={num_agents})"))
    return problems


def same_model_problems(list_field: str, models: list[str] | None, one_field: str, one: str | None) -> list[Problem]:
    """Both a one-for-all model and a per-agent list may be given only when the list repeats that model (the
    reference's ``resolve_model_sources``): ``agents: [m, m]`` with ``agent_model: m`` is fine, ``[m, n]`` not."""
    if models is None or one is None:
        return []
    others = sorted({m for m in models if m != one})
    if not others:
        return []
    return [
        Problem(
            list_field,
            models,
            f"conflicts with {one_field}={one!r} (also names "
            f"{', '.join(repr(m) for m in others)}); give {one_field} or {list_field}, or list "
            f"{one_field} once per agent",
        )
    ]
