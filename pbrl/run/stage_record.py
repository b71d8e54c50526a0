"""What every stage does around its work: resolve the run, and write the manifest last.

The code version and cache key of the run are added to the manifest by whoever ran the stage under a key
(``flows.cache.run_recorded``): the code version is computed where the stages are known.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import math
import resource
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pbrl.config import JobConfig, stage_config_hash
from pbrl.data.folders import working_in
from pbrl.data.storage import RunPaths, StageManifest, hash_files, write_manifest
from pbrl.models.threads import mkl_mode_note, thread_usage
from pbrl.run.progress import Event, Progress, publish
from pbrl.run.settings import agent_device, float32_job

log = logging.getLogger("pbrl.stages")
PEAK_RSS_METRIC = "resource/peak_rss_mb"
THREADS_METRIC = "resource/num_threads"  # torch's intra-op threads of the stage's process, time-weighted mean
THREADS_MIN_METRIC = "resource/num_threads_min"  # the fewest it ran with (the load follower, pbrl/models/threads.py)


def peak_rss_mb() -> float:
    """Peak resident set size of this process so far, in MiB (``getrusage(RUSAGE_SELF).ru_maxrss``: KiB on
    Linux, bytes on macOS). It is a high-water mark over the process's whole lifetime, never reset, so a stage's
    value is the peak of every earlier stage of the same process too; children are not counted."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024


@functools.cache
def _malloc_trim() -> Any:
    """glibc's ``malloc_trim``, or None (not Linux, or a C library without it)."""
    libc = ctypes.util.find_library("c") if sys.platform.startswith("linux") else None
    return getattr(ctypes.CDLL(libc), "malloc_trim", None) if libc else None


def release_free_memory() -> None:
    """Hand the C heap's free pages back to the operating system (glibc ``malloc_trim(0)``; nothing elsewhere).

    The stages of a round run one after another in one process, and torch's CPU tensors come from the C heap:
    what a stage freed (a training step's activations, a model copy) stays resident, fragmented between live
    blocks, and the next stage's allocations do not always fit in it. Measured on the demo round
    (docs/results/benchmarks.md#precision-the-sampling-path-and-threads), the round-1 evaluation peaked ~800 MiB
    above the update before it. No library wraps ``malloc_trim``; it is one call through ctypes.
    """
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


class StageRecord:
    """Collects a stage's counts, metrics and messages, then writes its manifest (always last). Creating one
    first releases the free memory the previous stage of this process left (:func:`release_free_memory`)."""

    def __init__(self, stage: str, run_dir: str | Path, round_index: int, job: JobConfig):
        release_free_memory()
        self.stage, self.round_index, self.job = stage, round_index, job
        self.paths = RunPaths(run_dir)
        working_in(run_dir)  # a write after the folder moved fails naming it, leaving no phantom folder behind
        self.started = time.perf_counter()
        self._thread_clock = time.monotonic()  # the load follower's clock (pbrl/models/threads.py)
        self.counts: dict[str, int] = {}
        self.metrics: dict[str, float] = {}
        self.details: dict[str, Any] = {}
        self.messages: list[str] = []

    def progress(self, total: int | None, unit: str, every: int = 1) -> Progress:
        """A progress counter of this stage's work (``total`` units of ``unit``), published as it advances
        (:mod:`pbrl.run.progress`)."""
        return Progress(str(self.paths.root), self.round_index, self.stage, total, unit, every)

    def log(self, step: int, metrics: dict[str, float], env_step: int | None = None) -> None:
        """Publish one training step's metrics (a ``log`` event: the CLI, the Prefect run log, callbacks and
        trackers show them)."""
        publish(
            Event(
                "log",
                str(self.paths.root),
                self.round_index,
                self.stage,
                step=step,
                env_step=env_step,
                metrics=dict(metrics),
            )
        )

    def say(self, message: str) -> None:
        """A message for people: logged now and kept in the manifest."""
        log.info("[%s round %d] %s", self.stage, self.round_index, message)
        self.messages.append(message)

    def finish(self, inputs: Iterable[Path], outputs: Iterable[Path]) -> StageManifest:
        """Write the manifest; adds ``resource/peak_rss_mb`` (:func:`peak_rss_mb` when the stage ends), the thread
        counts, and a message when a float32 job's CPU matrix products ran outside MKL's strict mode
        (:func:`pbrl.models.threads.mkl_mode_note`)."""
        self.metrics.setdefault(PEAK_RSS_METRIC, peak_rss_mb())
        mean, lowest, changes = thread_usage(self._thread_clock)
        self.metrics.setdefault(THREADS_METRIC, round(mean, 2))
        self.metrics.setdefault(THREADS_MIN_METRIC, float(lowest))
        if changes:
            self.say(
                f"torch's threads followed the other processes' load: {changes} change(s), {mean:.2f} on average, "
                f"{lowest} at the fewest (num_threads fixes the count)"
            )
        if float32_job(self.job) and agent_device(self.job).startswith("cpu") and (note := mkl_mode_note()):
            self.say(note)
        undefined = sorted(k for k, v in self.metrics.items() if not math.isfinite(v))
        if undefined:
            self.say(f"metrics without a finite value (left out): {', '.join(undefined)}")
        manifest = StageManifest(
            stage=self.stage,
            round_index=self.round_index,
            config_hash=stage_config_hash(self.job),
            inputs=hash_files(self.paths, list(inputs)),
            outputs=hash_files(self.paths, list(outputs)),
            counts=self.counts,
            metrics={k: v for k, v in self.metrics.items() if math.isfinite(v)},
            details=self.details,
            messages=self.messages,
            seconds=round(time.perf_counter() - self.started, 3),
        )
        return write_manifest(self.paths, manifest)
