"""How many CPU threads torch uses in a pbrl process: the CPUs the process owns, fewer while other work takes them.

torch starts as many intra-op (OpenMP) threads as the machine has cores, and OpenMP threads spin while they wait
for their partners. On a shared machine (other jobs, or several Ray workers per node) that costs several times the
CPU of the work itself: two pbrl processes of 2 threads each on 2 cores took 5-6x the wall time and 2-3x the CPU
of one alone (docs/results/benchmarks.md#two-stage-processes-on-2-cores). So pbrl

* gives torch as many threads as the CPUs this process may use: ``num_threads`` when set, else its affinity mask
  (``os.sched_getaffinity``) capped by a cgroup CPU quota (cgroup v2 ``cpu.max``, v1 ``cpu.cfs_quota_us``); a Ray
  shard or actor gets the CPUs Ray reserved for it;
* with ``num_threads`` unset, **follows the load** (:class:`LoadFollower`). At most once a second, at the safe points of
  the work (calls of :func:`follow_load`: each sampled token, each forward block, i.e. ``eval_mode`` and
  ``training_forward`` of ``pbrl/models/forward.py``, each optimizer step), it measures how much of its CPUs other
  processes used since the last look (:func:`pbrl.models.cpus.load_meter`: ``/proc/stat``, or the cgroup's usage under a
  CPU quota, less this process's own CPU time) and uses only the CPUs left free, at least 1. It takes a CPU back once
  others use under a fifth of it for two looks in a row. Alone, nothing changes; beside another busy process, each
  runs with one thread per free CPU instead of spinning against the other;
* inside a stage, while it runs one thread per CPU owned, puts each thread on a CPU of its own
  (:mod:`pbrl.models.thread_placement`: beside a niced busy loop, Linux stacked both threads on one CPU and a round
  took 8.7x its time alone).

OpenMP's wait policy is not changed: ``OMP_WAIT_POLICY=PASSIVE`` (threads sleep instead of spinning) also removes
the spinning, but on an idle machine it made training 1.35-1.85x slower (docs/results/benchmarks.md); it is read
once when torch loads, so it cannot follow the load.

A fixed ``num_threads`` pins the count. Following the load must not change a result, and the thread count can: Intel
oneMKL (torch's BLAS on x86) splits a float32 matrix product of 5-7 or 9-11 rows differently between 1 and 2
threads, and a decode step of a sampling batch of that many rows gave other bits (found 2026-12-04; batches of 4, 8,
or 12 rows and more happened to agree). ``import pbrl`` therefore puts MKL in its strict conditional numerical
reproducibility mode (``MKL_CBWR=AUTO,STRICT``, unless the environment sets ``MKL_CBWR``), where a product's bits do
not depend on the thread count, and the follower runs only where :func:`gemm_independent_of_threads` confirms that
mode (not when MKL was first used before ``import pbrl``, nor without MKL). A job that computes in bfloat16 or
float16 goes through oneDNN, which MKL's mode does not govern: its follower is *pinned*, following the load only
inside row-invariant forwards (sampling, evaluation; :func:`results_independent_of_threads`), whose bits do not
depend on the count, and using the CPUs it owns for training (issue #57: before, such a job never followed, and
its sampling beside one busy process took 3.3x its time alone). In float32 the demo round with 1 and 2 threads was
bitwise the same (docs/results/benchmarks.md); ``tests/unit/models/test_threads.py`` checks the tiny model's tokens,
log-probs and gradients at batches of 1 to 12 rows. Elsewhere torch does not promise it: a sum or mean of more than
32,768 numbers into one is split between the threads (pbrl's losses reduce far fewer), and LAPACK's float64 SVD
differs in its last bits, which is why the reward head's SVD runs on one thread (:func:`one_thread`).

No library does this: torch, accelerate and Ray set a thread count once, at start.
"""

from __future__ import annotations

import ctypes
import functools
import math
import os
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pbrl import STRICT_MKL_CBWR  # the value `import pbrl` sets when the environment sets none
from pbrl.models import cpus, thread_placement

_INTERVAL_S = 1.0  # how often the follower looks at the load, at most
_RAISE_AFTER = 2  # looks in a row with more CPUs free before the follower takes them back
# a CPU others use more than a third of counts as taken; under a fifth, as free again (a dead band). Not half: with
# torch's threads on a CPU each (pbrl.models.thread_placement), a neighbour of equal priority gets half of the CPU
# it shares with one of them, and that thread holds up every parallel region of the other
_TAKEN, _FREE = 0.35, 0.2

_MKL_CBWR_ALL, _MKL_CBWR_STRICT = -1, 0x10000  # oneMKL's mkl_service.h: every setting; the strict-mode bit


@functools.cache
def _mkl_cbwr_get() -> Any:
    """oneMKL's ``mkl_serv_cbwr_get`` in torch's own library, found once (a directory listing and a library lookup:
    about 0.15 ms, and row-invariant forwards ask for the mode at every float32 layer), or None."""
    lib = Path(torch.__file__).parent / "lib"
    for library in sorted([*lib.glob("libtorch_cpu.*"), *lib.glob("torch_cpu.dll")]):
        try:
            get = ctypes.CDLL(str(library)).mkl_serv_cbwr_get
        except (OSError, AttributeError):
            continue
        get.argtypes, get.restype = [ctypes.c_int], ctypes.c_int
        return get
    return None


def mkl_cbwr_mode() -> int | None:
    """The conditional numerical reproducibility mode of the oneMKL linked into torch's own library
    (``mkl_serv_cbwr_get``, through ctypes: the ``mkl-service`` package would load a second MKL runtime, not the one
    whose mode matters), or None where it cannot be asked (no MKL in torch, or the symbol not exported)."""
    get = _mkl_cbwr_get()
    return None if get is None else int(get(_MKL_CBWR_ALL))


def gemm_independent_of_threads() -> bool:
    """Whether torch's float32 matrix products give the same bits whatever the thread count: oneMKL in its strict
    conditional numerical reproducibility mode (Intel's oneMKL guide, "Obtaining Numerically Reproducible Results":
    strict CNR makes ?gemm's results independent of the number of threads). The mode is fixed when MKL first runs;
    ``import pbrl`` asks for it through ``MKL_CBWR``. False without MKL in torch, where its mode cannot be asked
    (:func:`mkl_cbwr_mode`), or when another mode is in effect."""
    mode = mkl_cbwr_mode()
    return mode is not None and bool(mode & _MKL_CBWR_STRICT)


def mkl_mode_note() -> str | None:
    """What a run's float32 results owe to a mode other than MKL's strict one, for its stage records; None when the mode
    is strict (:func:`gemm_independent_of_threads`) or torch has no oneMKL. Outside strict mode MKL picks its kernels by
    CPU and thread count, so the bits differ from a run in strict mode on the same inputs. The note names the cause:
    the mode could not be read, ``MKL_CBWR`` is unset or the user's own, or (pbrl's value set) MKL had already
    started when pbrl was imported."""
    mode = mkl_cbwr_mode()  # read once: gemm_independent_of_threads would read it again
    if not torch.backends.mkl.is_available() or (mode is not None and mode & _MKL_CBWR_STRICT):
        return None
    setting = os.environ.get("MKL_CBWR")
    if mode is None:
        cause = "pbrl could not read the mode of torch's MKL"
    elif setting == STRICT_MKL_CBWR:
        cause = "MKL ran before pbrl was imported"
    elif not setting:
        cause = "MKL_CBWR is unset"
    else:
        cause = f"the environment sets MKL_CBWR={setting}"
    return (
        f"float32 matrix products ran outside oneMKL's strict reproducibility mode ({cause}): their last bits can "
        "differ from a run in strict mode and with the thread count"
    )


@contextmanager
def one_thread() -> Iterator[None]:
    """torch on one thread inside the block, its count restored after: for an operation whose result depends on the
    thread count (LAPACK's float64 SVD differed by 2e-16 between 1 and 2 threads), so that the follower's changes
    cannot reach it."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@dataclass(frozen=True)
class FollowerHooks:
    """What a :class:`LoadFollower` reads and calls, replaced by fakes in tests: ``own()`` this process's CPU seconds,
    ``clock()`` seconds, ``set_threads(n)`` torch's intra-op thread count, ``free()`` whether the work in progress
    gives the same bits whatever the thread count (inside :func:`results_independent_of_threads`)."""

    own: Callable[[], float] = time.process_time
    clock: Callable[[], float] = time.monotonic
    set_threads: Callable[[int], None] = torch.set_num_threads
    free: Callable[[], bool] = lambda: _INDEPENDENT.get()


class LoadFollower:
    """Fits torch's intra-op threads to the CPUs other processes leave free (see the module docstring).

    ``tick()`` is cheap (a clock read) except once per ``interval_s``, when it reads ``busy()`` (CPU seconds of every
    process competing for the ``capacity`` CPUs, :func:`pbrl.models.cpus.load_meter`) and this process's CPU seconds
    (``time.process_time``, every thread's). Others' use over the interval, in CPUs, is ``(busy - own) / wall``; of the
    ``capacity - others`` free CPUs, a CPU counts as taken when others use more than a third of it (the count is lowered
    at once: spinning against another process costs several times the work) and as free again when they use under a
    fifth of it, for ``_RAISE_AFTER`` looks in a row. The count stays between 1 and ``owned``.
    ``tick()`` must be called from the thread that runs the work: an OpenMP thread count is the calling thread's
    own. The clock, the readers and the thread setter are parameters for tests (:class:`FollowerHooks`).

    A ``pinned`` follower (a job that computes in bfloat16 or float16, whose oneDNN products may change with the
    thread count) follows the load only where ``free()`` says the results cannot depend on the count (inside
    :func:`results_independent_of_threads`: row-invariant sampling, evaluation and scoring); elsewhere (training)
    ``owned`` threads are in use while it goes on looking, so that the next such work starts from the count the load
    leaves (:attr:`followed`).
    """

    def __init__(
        self,
        owned: int,
        capacity: float,
        busy: Callable[[], float | None],
        *,
        interval_s: float = _INTERVAL_S,
        pinned: bool = False,
        hooks: FollowerHooks = FollowerHooks(),
    ) -> None:
        self.owned, self.capacity, self.interval_s, self.pinned = owned, capacity, interval_s, pinned
        self._busy = busy
        self._own, self._clock, self._set, self._free = hooks.own, hooks.clock, hooks.set_threads, hooks.free
        self._set(owned)
        self._applied = {threading.get_ident()}  # threads whose OpenMP count is self.threads
        self._votes = 0
        self.followed = owned  # the count the load leaves: in use wherever the follower may change the count
        self._last = (self._clock(), self._busy(), self._own())
        self.changes: list[tuple[float, int]] = [(self._last[0], owned)]  # (clock, threads from then on)

    @property
    def threads(self) -> int:
        """The thread count in use now."""
        return self.changes[-1][1]

    def apply(self) -> None:
        """Put the count due here in use in the calling thread: :attr:`followed`, or ``owned`` where the follower is
        ``pinned`` and the work is outside :func:`results_independent_of_threads`."""
        due = self.followed if not self.pinned or self._free() else self.owned
        if due != self.threads:
            self._set(due)
            self._applied = {threading.get_ident()}
            self.changes.append((self._clock(), due))
        elif threading.get_ident() not in self._applied:  # work in a thread that ran torch before the last change
            self._set(due)
            self._applied.add(threading.get_ident())

    def tick(self) -> None:
        """Look at the load if ``interval_s`` has passed since the last look, and change the threads if due."""
        self.apply()
        now = self._clock()
        wall = now - self._last[0]
        if wall < self.interval_s or wall <= 0:
            return
        busy, own = self._busy(), self._own()
        last_busy, last_own = self._last[1], self._last[2]
        self._last = (now, busy, own)
        if busy is None or last_busy is None:
            return
        free = self.capacity - max(0.0, (busy - last_busy) - (own - last_own)) / wall
        lower = min(self.owned, max(1, math.floor(free + _TAKEN)))
        higher = min(self.owned, max(1, math.floor(free + _FREE)))
        target = self.followed
        if lower < self.followed:
            target, self._votes = lower, 0
        elif higher > self.followed:
            self._votes += 1
            if self._votes < _RAISE_AFTER:
                return
            target, self._votes = higher, 0
        else:
            self._votes = 0
        if target != self.followed:
            self.followed = target
            self.apply()

    def usage_since(self, start: float) -> tuple[float, int]:
        """The time-weighted mean thread count since clock time ``start`` (until now), and the lowest count."""
        now = self._clock()
        start = max(start, self.changes[0][0])  # nothing was followed before the follower existed
        total, lowest = 0.0, None
        for i, (t, count) in enumerate(self.changes):
            until = self.changes[i + 1][0] if i + 1 < len(self.changes) else now
            begin = max(t, start)
            if until > begin:
                total += (until - begin) * count
                lowest = count if lowest is None else min(lowest, count)
        if lowest is None:  # no time since start
            return float(self.threads), self.threads
        return total / (now - start), lowest


_follower: LoadFollower | None = None
_spread_over: tuple[int, ...] | None = None  # the CPUs owned (2 or more): torch's threads on one each while it uses all
# True inside results_independent_of_threads: the work's results do not depend on torch's thread count
_INDEPENDENT: ContextVar[bool] = ContextVar("pbrl_results_independent_of_threads", default=False)


@contextmanager
def results_independent_of_threads() -> Iterator[None]:
    """Declare that the work inside the block gives the same bits whatever torch's thread count (row-invariant
    forwards, :func:`pbrl.models.row_invariance.row_invariant`): a pinned follower (bfloat16 and float16 jobs)
    follows the load here and puts the owned count back after the block."""
    token = _INDEPENDENT.set(True)
    if _follower is not None:
        _follower.apply()
    try:
        yield
    finally:
        _INDEPENDENT.reset(token)
        if _follower is not None:
            _follower.apply()


def configure_threads(num_threads: int | None = None, *, float32: bool = True) -> int:
    """Set torch's intra-op threads to ``num_threads`` (the ``num_threads`` option or a Ray reservation: fixed), else to
    :func:`pbrl.models.cpus.available_cpus`, following the load from then on (:class:`LoadFollower`, where the process
    owns more than one CPU, :func:`pbrl.models.cpus.load_meter` can measure and :func:`gemm_independent_of_threads` says
    the count cannot change a float32 result; otherwise the count stays, with a warning when MKL's mode is the reason);
    returns the count now in use. ``float32``: false when the process computes in bfloat16 or float16 (``torch_dtype``,
    ``mixed_precision``), whose CPU products go through oneDNN, which MKL's strict mode does not govern: the follower is
    then pinned, following the load only inside :func:`results_independent_of_threads`. Call it from the thread that
    runs the stages. The affinity mask and the quota are read when it is called; later changes to them are not followed.

    Raises:
        ValueError: ``num_threads`` below 1.
    """
    global _follower, _spread_over
    if num_threads is not None and num_threads < 1:
        raise ValueError(f"num_threads: got {num_threads}; must be >= 1")
    _follower = None
    count = num_threads if num_threads is not None else cpus.available_cpus()
    owned = cpus.affinity()
    thread_placement.release()
    _spread_over = tuple(sorted(owned)) if owned and len(owned) >= 2 else None
    meter = cpus.load_meter(owned) if num_threads is None and count > 1 and owned else None
    if meter is not None and not gemm_independent_of_threads():
        why = (
            "MKL's strict reproducibility mode (MKL_CBWR=AUTO,STRICT) is not in effect: MKL ran before pbrl was "
            "imported, or MKL_CBWR says otherwise"
            if torch.backends.mkl.is_available()
            else "this torch has no oneMKL, whose strict reproducibility mode pbrl relies on"
        )
        warnings.warn(
            f"torch's thread count stays at {count}, the CPUs this process owns: its matrix products may change with "
            f"the thread count ({why}), so following the load could change results",
            stacklevel=2,
        )
        meter = None
    if meter is not None:
        _follower = LoadFollower(count, meter.capacity, meter.busy, pinned=not float32)
    elif torch.get_num_threads() != count:
        torch.set_num_threads(count)
    return count


def follow_load() -> None:
    """A safe point of the work: the load follower (if :func:`configure_threads` started one) may change torch's
    threads here, and a thread count of one per CPU owned is spread over the CPUs, a thread on each
    (:mod:`pbrl.models.thread_placement`). Costs a clock read and a dictionary look-up between looks."""
    if _follower is not None:
        _follower.tick()
    if _spread_over is not None:
        thread_placement.keep_placed(torch.get_num_threads(), _spread_over)


def thread_usage(start: float) -> tuple[float, int, int]:
    """Torch's threads since ``time.monotonic()`` was ``start``: the time-weighted mean, the lowest count, and
    how many times the follower changed the count (0 without a follower: the mean and lowest are today's)."""
    if _follower is None:
        count = torch.get_num_threads()
        return float(count), count, 0
    mean, lowest = _follower.usage_since(start)
    return mean, lowest, sum(1 for t, _ in _follower.changes[1:] if t >= start)
