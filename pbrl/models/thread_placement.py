"""Each of torch's threads on a CPU of its own while a process runs one thread per CPU it owns (issue #57).

Why. Measured 2026-12-06 on 2 cores of an Intel Xeon with AMX (Linux 6.18): 16 SmolLM2 rows x 24 tokens in
bfloat16 sampled in 2.7 s alone and in 10.5-22 s beside one ``nice -n 10`` busy loop, with 2 threads burning
12-24 CPU seconds. When no CPU is idle (a niced process's CPU is not idle), Linux wakes an OpenMP worker on the CPU of
the thread that woke it, so torch's two threads took turns on one CPU while the niced loop had the other to itself
(90 % of it, by ``ps``), and every parallel region waited for a descheduled partner. With each thread pinned to a CPU
of its own, the scheduler's weights apply on both CPUs (a nice-10 process gets about a tenth of a CPU it shares with
a nice-0 thread): 2.6 s beside the loop (docs/results/benchmarks.md#a-round-beside-other-processes).

How. OpenMP's own binding (``OMP_PROC_BIND``, ``OMP_PLACES``) is read once, when torch loads, and would keep the
process bound where the load follower (:mod:`pbrl.models.threads`) has left it one thread, which must be free to run
on whichever CPU is idle; libgomp has no call that rebinds a running team. So pbrl finds the team's threads in a
parallel region of its own (``GOMP_parallel``, libgomp's entry point for ``#pragma omp parallel``, called from the
thread that runs torch: its regions use that thread's pool of workers) and pins them with ``sched_setaffinity``,
thread k to the k-th CPU owned; below one thread per CPU owned, the threads get every CPU owned back. Threads are
pinned only inside :func:`pinning` (a stage's run, ``flows/cache.py``), and every pin is released when it ends: a
thread passes its CPU mask on to the threads and processes it starts (Ray, the sandbox), which must not inherit one
CPU. Only where torch's OpenMP is GNU's libgomp on Linux (torch's wheels); elsewhere nothing is pinned.
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path

_MAPS = Path("/proc/self/maps")
# calling thread's native id -> (the team's thread ids it pinned, itself first; the CPUs owned, given back on release)
_PINNED: dict[int, tuple[list[int], list[int]]] = {}
_LOCK = threading.Lock()
_ACTIVE: ContextVar[bool] = ContextVar("pbrl_thread_pinning", default=False)  # inside pinning()


@contextmanager
def pinning() -> Iterator[None]:
    """Inside the block, :func:`keep_placed` may pin the calling thread's team; after it, every pin it made is
    released (:func:`release`)."""
    token = _ACTIVE.set(True)
    try:
        yield
    finally:
        _ACTIVE.reset(token)
        release()


@functools.cache
def _libgomp() -> ctypes.CDLL | None:
    """The libgomp loaded in this process (torch's), found once, or None."""
    try:
        path = next((line.split()[-1] for line in _MAPS.read_text().splitlines() if "libgomp" in line), None)
        gomp = ctypes.CDLL(path) if path else None
        if gomp is not None:
            gomp.omp_get_thread_num.restype = ctypes.c_int
        return gomp
    except (OSError, AttributeError):
        return None


_REGION = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


def team_thread_ids(count: int) -> list[int] | None:
    """The native thread ids of the OpenMP team of ``count`` threads that the calling thread's parallel regions run
    on, by thread number (0: the calling thread); None where torch's libgomp cannot be reached."""
    gomp = _libgomp()
    if gomp is None:
        return None
    ids: dict[int, int] = {}

    @_REGION
    def record(_: int | None) -> None:
        ids[gomp.omp_get_thread_num()] = threading.get_native_id()

    gomp.GOMP_parallel(record, None, ctypes.c_uint(count), ctypes.c_uint(0))
    return [ids[k] for k in sorted(ids)] if len(ids) == count else None


def place_threads(count: int, cpus: Collection[int] | None) -> bool:
    """Pin the calling thread's OpenMP team of ``count`` threads, thread k to the k-th of ``cpus`` (the CPUs the
    process owns), when ``count`` equals their number (2 or more); otherwise give the threads this caller pinned
    every CPU back (:func:`release`). Returns whether the team is pinned now. A thread that has exited is skipped."""
    owned = sorted(cpus) if cpus is not None and hasattr(os, "sched_setaffinity") else []
    team = team_thread_ids(count) if count == len(owned) >= 2 else None
    release()
    if team is None:
        return False
    for tid, cpu in zip(team, owned, strict=True):
        _set_affinity(tid, [cpu])
    with _LOCK:
        _PINNED[threading.get_native_id()] = (team, owned)
    return True


def keep_placed(count: int, cpus: Collection[int]) -> None:
    """:func:`place_threads` where the calling thread's team is not yet as it should be for ``count`` threads (a
    dictionary look-up otherwise: called at every safe point of the work). Nothing outside :func:`pinning`."""
    if not _ACTIVE.get():
        return
    pinned = _PINNED.get(threading.get_native_id())
    due = count == len(cpus) >= 2
    if (due and (pinned is None or len(pinned[0]) != count)) or (not due and pinned is not None):
        place_threads(count, cpus)


def release() -> None:
    """Give the threads the calling thread pinned (itself and its team) every CPU the process owns (the end of a
    stage: a thread that goes on to start processes or threads must not pass one CPU on to them)."""
    with _LOCK:
        team, owned = _PINNED.pop(threading.get_native_id(), ((), []))
    for tid in team:
        _set_affinity(tid, owned)


def _set_affinity(tid: int, cpus: list[int]) -> None:
    try:
        os.sched_setaffinity(tid, cpus)
    except OSError:  # the thread has exited, or the mask is not ours to set
        pass
