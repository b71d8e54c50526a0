"""The CPUs a process owns and how busy they are: its affinity mask capped by a cgroup CPU quota, and the CPU
seconds that every process competing for them has used (``/proc/stat``, or the cgroup's usage under a quota). What
pbrl's thread count and its load follower (:mod:`pbrl.models.threads`) read."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

_CGROUP_V2 = Path("/sys/fs/cgroup/cpu.max")
_CGROUP_V1 = (Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"), Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us"))
_CGROUP_V2_USAGE = Path("/sys/fs/cgroup/cpu.stat")  # usage_usec: CPU microseconds of the cgroup's processes
_CGROUP_V1_USAGE = Path("/sys/fs/cgroup/cpuacct/cpuacct.usage")  # CPU nanoseconds of the cgroup's processes
_PROC_STAT = Path("/proc/stat")


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


def affinity() -> set[int] | None:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return None


def available_cpus() -> int:
    """The CPUs this process may use: its affinity mask, capped by the cgroup quota (rounded up), at least 1."""
    mask = affinity()
    count = len(mask) if mask is not None else os.cpu_count() or 1
    limit = cgroup_cpu_limit()
    if limit is not None:
        count = min(count, math.ceil(limit))
    return max(1, count)


def busy_cpu_seconds(cpus: Collection[int], stat: str | None = None, *, count_nice: bool = True) -> float | None:
    """CPU seconds the CPUs ``cpus`` were busy since boot, by every process: ``/proc/stat``'s user, system, irq and
    softirq, and nice (processes of a lower priority) when ``count_nice``; idle, iowait and steal (a virtual CPU's
    time the host gave to another machine, which no thread count of ours changes) are not counted. ``stat`` is the
    file's text (read when None). None where there is no ``/proc/stat`` or no line of these CPUs."""
    if stat is None:
        try:
            stat = _PROC_STAT.read_text()
        except OSError:
            return None
    wanted = {f"cpu{c}" for c in cpus}
    ticks, found = 0, False
    for line in stat.splitlines():
        name, *fields = line.split()
        if name in wanted and len(fields) >= 7:
            user, nice, system, _idle, _iowait, irq, softirq = (int(f) for f in fields[:7])
            ticks += user + system + irq + softirq + (nice if count_nice else 0)
            found = True
    return ticks / os.sysconf("SC_CLK_TCK") if found else None


def cgroup_cpu_seconds() -> float | None:
    """CPU seconds used by every process of this process's cgroup (v2 ``cpu.stat`` ``usage_usec``, v1
    ``cpuacct.usage``), or None when neither can be read."""
    try:
        for line in _CGROUP_V2_USAGE.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "usage_usec":
                return int(value) / 1e6
    except (OSError, ValueError):
        pass
    try:
        return int(_CGROUP_V1_USAGE.read_text()) / 1e9
    except (OSError, ValueError):
        return None


@dataclass(frozen=True)
class LoadMeter:
    """What the follower measures: ``busy()``, CPU seconds used so far by every process that competes for
    ``capacity`` CPUs (this one included)."""

    capacity: float
    busy: Callable[[], float | None]


def load_meter(cpus: Collection[int]) -> LoadMeter | None:
    """The meter of a process whose affinity mask is ``cpus``: under a cgroup CPU quota, the cgroup's usage against
    the quota (the host's other load does not take our quota); else ``/proc/stat``'s busy time of the CPUs of the
    mask that it lists, against their number. Processes of a lower priority (``nice``) yield to this one, so their
    time is not counted unless this process is niced too. None where nothing can be read, or fewer than 2 CPUs."""
    limit = cgroup_cpu_limit()
    if limit is not None:
        meter = LoadMeter(min(float(len(cpus)), limit), cgroup_cpu_seconds)
    else:
        try:
            stat = _PROC_STAT.read_text()
        except OSError:
            return None
        listed = [c for c in cpus if busy_cpu_seconds([c], stat) is not None]
        niced = os.getpriority(os.PRIO_PROCESS, 0) > 0
        meter = LoadMeter(float(len(listed)), lambda: busy_cpu_seconds(listed, count_nice=niced))
    return meter if meter.capacity >= 2 and meter.busy() is not None else None
