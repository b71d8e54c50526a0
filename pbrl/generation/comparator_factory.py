"""Which comparator a round uses (``comparator_policy`` → a :class:`~pbrl.generation.comparators.Comparator`),
and what each kind needs before a run starts."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path

from pbrl.errors import ConfigError, Problem
from pbrl.generation.centralized import load_adapter
from pbrl.generation.comparators import (
    ApiComparator,
    CheckpointComparator,
    Comparator,
    ComparatorSettings,
    Devices,
    LoadedModel,
    LocalModelComparator,
    SamplingSide,
)
from pbrl.models.loading import load_model, load_tokenizer, resolve_devices, resolve_model_source

CHECKPOINT_KINDS = ("current", "current_copy", "history")  # the kinds that sample a policy checkpoint of the run


def compared_round(policy: str, round_index: int, history_k: int) -> int | None:
    """The round after which the policy a checkpoint comparator samples in round ``round_index`` was stored
    (``current``, ``current_copy``: the previous round's, as the target's; ``history``: C_max(0, r-1-k), the policy
    ``history_k`` updates older than the current one, the initial one until it exists); None for the kinds that
    sample no checkpoint of the run (``model``, ``api``)."""
    if policy not in CHECKPOINT_KINDS:
        return None
    return round_index - 1 if policy != "history" else max(0, round_index - 1 - history_k)


def _checkpoint(settings: ComparatorSettings) -> tuple[Path, Devices]:
    if settings.checkpoint is None:
        raise ValueError(f"comparator_policy={settings.policy!r} needs the compared policy's checkpoint")
    if settings.policy == "current":
        return settings.checkpoint, settings.agent_devices  # live weights, own seed stream
    return settings.checkpoint, settings.copy_devices  # a frozen copy (current_copy, history)


def _checkpoint_kind(
    settings: ComparatorSettings, load_checkpoint: Callable[[int, Path, Devices], LoadedModel]
) -> Comparator:
    checkpoint, devices = _checkpoint(settings)
    if settings.centralized_adapter is None:
        return CheckpointComparator(SamplingSide("comparator", checkpoint, settings.num_candidates, devices))
    return LocalModelComparator(
        lambda agent: load_checkpoint(agent, checkpoint, devices),
        settings.num_candidates,
        settings.centralized_adapter,
        settings.centralized_index,
        (checkpoint,),
    )


def _model_kind(
    settings: ComparatorSettings, load_checkpoint: Callable[[int, Path, Devices], LoadedModel]
) -> Comparator:
    loaded: dict[tuple[str, str], LoadedModel] = {}  # agents that share a model and device share one copy

    def load(agent: int) -> LoadedModel:
        field_name = "comparator_agents" if len(set(settings.model_sources)) > 1 else "comparator_model_name"
        source = resolve_model_source(settings.model_sources[agent], field=field_name)
        device = resolve_devices(settings.copy_devices, len(settings.model_sources), field="comparator_devices")[agent]
        if (str(source), device) not in loaded:
            loaded[(str(source), device)] = (
                load_model(source, device=device, dtype=settings.dtype),
                load_tokenizer(source),
            )
        return loaded[(str(source), device)]

    return LocalModelComparator(load, settings.num_candidates, settings.centralized_adapter, settings.centralized_index)


def _api_kind(settings: ComparatorSettings, load_checkpoint: Callable[[int, Path, Devices], LoadedModel]) -> Comparator:
    if settings.api is None or settings.store_dir is None:
        raise ValueError("comparator_policy='api' needs ApiSettings and a store_dir")
    return ApiComparator(
        settings.api,
        settings.num_candidates,
        settings.store_dir,
        settings.centralized_adapter,
        settings.centralized_index,
    )


# comparator_policy -> builder(settings, load_checkpoint(agent, checkpoint, devices)).
COMPARATORS: dict[str, Callable[..., Comparator]] = {
    "current": _checkpoint_kind,
    "current_copy": _checkpoint_kind,
    "history": _checkpoint_kind,
    "model": _model_kind,
    "api": _api_kind,
}


def build_comparator(
    settings: ComparatorSettings, load_checkpoint: Callable[[int, Path, Devices], LoadedModel]
) -> Comparator:
    """The comparator of a round (a checkpoint kind samples ``settings.checkpoint``, the policy after round
    :func:`compared_round`); ``load_checkpoint(agent, checkpoint, devices)`` loads an agent's policy from a
    checkpoint (centralized generation by a checkpoint kind).

    Raises:
        ConfigError: an unknown ``comparator_policy``.
        ValueError: a checkpoint kind without ``settings.checkpoint``, ``api`` without its settings.
    """
    builder = COMPARATORS.get(settings.policy)
    if builder is None:
        raise ConfigError([Problem("comparator_policy", settings.policy, f"allowed: {', '.join(COMPARATORS)}")])
    return builder(settings, load_checkpoint)


def preflight_problems(
    policy: str,
    *,
    model_sources: Sequence[str] = (),
    model_field: str = "comparator_model_name",
    key_env: str | None = None,
    generation_mode: str = "decentralized",
    adapter_path: str | None = None,
) -> list[Problem]:
    """What a comparator needs before a run starts, every problem at once: a known policy; with ``model``,
    every source exists offline; with ``api``, the key variable ``key_env`` is set (named, its value never
    read into the message); with centralized generation, the adapter imports."""
    problems: list[Problem] = []
    if policy not in COMPARATORS:
        problems.append(Problem("comparator_policy", policy, f"allowed: {', '.join(COMPARATORS)}"))
    if policy == "model":
        for source in dict.fromkeys(model_sources):
            try:
                resolve_model_source(source, field=model_field)
            except ConfigError as exc:
                problems += exc.problems
    if policy == "api" and key_env is not None and not os.environ.get(key_env):
        problems.append(
            Problem(
                "comparator_api_key_env",
                key_env,
                "this environment variable is not set (or empty); export the API key in it before starting the run",
            )
        )
    if generation_mode == "centralized":
        try:
            load_adapter(adapter_path)
        except ConfigError as exc:
            problems += exc.problems
    return problems
