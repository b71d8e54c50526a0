"""How many CPU threads torch uses in a pbrl process: the CPUs the process owns, never more.

torch starts as many intra-op (OpenMP) threads as the machine has cores, and OpenMP threads spin while they wait
for their partners. On a shared machine (other jobs, or several Ray workers per node) that costs several times the
CPU of the work itself: measured here, a SmolLM2 ``generate`` at load ~13 on 2 cores took 4.2x the wall time and
8.8x the CPU with 2 spinning threads against 1 thread (docs/results/benchmarks.md). So pbrl

* gives torch as many threads as the CPUs this process may use: ``num_threads`` when set, else its affinity mask
  (``os.sched_getaffinity``) capped by a cgroup CPU quota (cgroup v2 ``cpu.max``, v1 ``cpu.cfs_quota_us``); a Ray
  shard or actor gets the CPUs Ray reserved for it.

OpenMP's wait policy is not changed: ``OMP_WAIT_POLICY=PASSIVE`` (threads sleep instead of spinning) helps where
other work shares the cores, but on an idle machine it made the demo round 1.35x slower (update-policies 74 ->
110 s, docs/results/benchmarks.md#precision-the-sampling-path-and-threads); set it in the environment for a
machine you share.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch

_CGROUP_V2 = Path("/sys/fs/cgroup/cpu.max")
_CGROUP_V1 = (Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"), Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us"))


def cgroup_cpu_limit() -> float | None:
    """The CPU quota of this process's cgroup in CPUs (e.g. 1.5), or None when unlimited or unknown."""
    try:
        quota, period = _CGROUP_V2.read_text().split()[:2]
        if quota != "max":
            return int(quota) / int(period)
        return None
    except (OSError, ValueError):
        pass
    try:
        quota_us, period_us = (int(p.read_text()) for p in _CGROUP_V1)
    except (OSError, ValueError):
        return None
    return quota_us / period_us if quota_us > 0 and period_us > 0 else None


def available_cpus() -> int:
    """The CPUs this process may use: its affinity mask, capped by the cgroup quota (rounded up), at least 1."""
    try:
        count = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        count = os.cpu_count() or 1
    limit = cgroup_cpu_limit()
    if limit is not None:
        count = min(count, math.ceil(limit))
    return max(1, count)


def configure_threads(num_threads: int | None = None) -> int:
    """Set torch's intra-op threads to ``num_threads`` (the ``num_threads`` option or a Ray reservation), else
    to :func:`available_cpus`; returns the count now in use.

    Raises:
        ValueError: ``num_threads`` below 1.
    """
    if num_threads is not None and num_threads < 1:
        raise ValueError(f"num_threads: got {num_threads}; must be >= 1")
    count = num_threads if num_threads is not None else available_cpus()
    if torch.get_num_threads() != count:
        torch.set_num_threads(count)
    return count
