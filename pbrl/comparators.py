"""Comparators (SPEC §5.3): which policy samples the other side of each iterative comparison.

A comparator is a function ``(paths, round_index, job) -> SamplingSide`` registered by its
``comparator_policy`` name. Policies that sample stored checkpoints are implemented here; ``model`` and
``api`` sources are not available yet and are refused with a clear error at stage start.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pbrl.config import JobConfig
from pbrl.errors import ConfigError, Problem
from pbrl.policies import policy_checkpoint
from pbrl.storage import RunPaths


@dataclass(frozen=True)
class SamplingSide:
    """One side of a round's collection: who samples (a checkpoint), on which seed stream, how many."""

    side: str  # "target" | "comparator"; also the seed-stream name
    checkpoint: Path
    num_candidates: int
    devices: str | list[str] | None


def target_side(paths: RunPaths, round_index: int, job: JobConfig) -> SamplingSide:
    """The current agents: the policy after round ``round_index - 1``."""
    return SamplingSide("target", policy_checkpoint(paths, round_index - 1), job.preference_num_candidates,
                        job.agent_devices)


def _num(job: JobConfig) -> int:
    return job.comparator_num_candidates or job.preference_num_candidates


def _current(paths: RunPaths, round_index: int, job: JobConfig) -> SamplingSide:
    # The live weights on the comparator's own seed stream.
    return SamplingSide("comparator", policy_checkpoint(paths, round_index - 1), _num(job), job.agent_devices)


def _current_copy(paths: RunPaths, round_index: int, job: JobConfig) -> SamplingSide:
    # The same weights, loaded as a separate frozen copy on comparator_devices.
    devices = job.comparator_devices if job.comparator_devices is not None else job.agent_devices
    return SamplingSide("comparator", policy_checkpoint(paths, round_index - 1), _num(job), devices)


def _history(paths: RunPaths, round_index: int, job: JobConfig) -> SamplingSide:
    # C_max(0, r-1-k): the policy k updates older than the current one, the initial policy until it exists.
    k = job.comparator_history_k or 1
    devices = job.comparator_devices if job.comparator_devices is not None else job.agent_devices
    return SamplingSide("comparator", policy_checkpoint(paths, max(0, round_index - 1 - k)), _num(job), devices)


COMPARATORS: dict[str, Callable[[RunPaths, int, JobConfig], SamplingSide]] = {
    "current": _current,
    "current_copy": _current_copy,
    "history": _history,
}


def comparator_side(paths: RunPaths, round_index: int, job: JobConfig) -> SamplingSide:
    """The comparator side of round ``round_index``.

    Raises:
        ConfigError: the comparator policy is not available in this version (``model``, ``api``).
    """
    fn = COMPARATORS.get(job.comparator_policy)
    if fn is None:
        raise ConfigError([Problem("comparator_policy", job.comparator_policy,
                                   f"not available in this version; available: {', '.join(COMPARATORS)}")])
    return fn(paths, round_index, job)
