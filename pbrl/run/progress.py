"""What happens in a run, as events for the front ends: the CLI's progress display and log lines, the Prefect run
logger, trainer callbacks and experiment trackers all listen to the same events.

A stage (or the flow around it) :func:`publish` es an :class:`Event`; every listener added with :func:`subscribe`
hears it, in the publishing thread. Listeners must be quick and must not raise (an exception in one is logged and
the others still hear the event). Events of stages that run in other processes (Ray shards) stay there: their
front ends hear the start and the end of the stage, not its rows.

Kinds, in the order a run produces them::

    run_start → (round_start → (stage_start → progress* → log* → stage_end)* → round_end)* → run_end
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal

log = logging.getLogger(__name__)

Kind = Literal["run_start", "run_end", "round_start", "round_end", "stage_start", "stage_end", "progress", "log"]


@dataclass(frozen=True)
class Event:
    """One thing that happened in a run.

    Attributes:
        kind: see the module docstring.
        run_dir: the run folder.
        round: the round (0 = the baseline evaluation); None for run events.
        stage: the stage name (``sample-candidates`` …); None for run and round events.
        done / total / unit: ``progress``: units done so far out of ``total`` (``rows``, ``joint responses``,
            ``steps``); total may be None when unknown.
        step: ``log``: the optimizer step within the stage (1-based); ``env_step`` the reference's x-axis.
        metrics: ``log``: the step's metrics (``madpo/loss`` …); ``stage_end``: the manifest's metrics;
            ``round_end``: the round's row of the round table (``eval_reward``, ``paired`` …).
        counts: ``stage_end``: the manifest's counts.
        seconds: ``stage_end`` / ``round_end`` / ``run_end``: wall time.
        state: ``stage_end``: Prefect's state (``Completed``, ``Cached``, ``Failed``, or ``Cancelled`` when a person
            cancelled the flow run); ``run_end``: ``Completed``, ``Failed`` or ``Cancelled``.
        messages: ``stage_end``: the manifest's messages.
    """

    kind: Kind
    run_dir: str | None = None
    round: int | None = None
    stage: str | None = None
    done: int | None = None
    total: int | None = None
    unit: str | None = None
    step: int | None = None
    env_step: int | None = None
    metrics: Mapping[str, float] = field(default_factory=dict)
    counts: Mapping[str, int] = field(default_factory=dict)
    seconds: float | None = None
    state: str | None = None
    messages: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        # Read-only for every listener: a callback that changed the metrics changed what the trackers logged and
        # what the next callback saw (issue #53.2). The mappings are copies behind read-only views.
        object.__setattr__(self, "metrics", MappingProxyType(dict(self.metrics)))
        object.__setattr__(self, "counts", MappingProxyType(dict(self.counts)))
        object.__setattr__(self, "messages", tuple(self.messages))


Listener = Callable[[Event], None]
_listeners: list[Listener] = []
_lock = threading.Lock()


def subscribe(listener: Listener) -> Callable[[], None]:
    """Call ``listener(event)`` for every event from now on; returns a function that unsubscribes it."""
    with _lock:
        _listeners.append(listener)

    def unsubscribe() -> None:
        with _lock:
            if listener in _listeners:
                _listeners.remove(listener)

    return unsubscribe


def publish(event: Event) -> None:
    """Hand ``event`` to every listener (a listener that raises is logged and skipped)."""
    with _lock:
        listeners = list(_listeners)
    for listener in listeners:
        try:
            listener(event)
        except Exception:  # a broken front end must not stop training
            log.exception("progress listener %r failed on a %s event", listener, event.kind)


# Event kind -> the hook that hears it.
HOOKS: dict[str, str] = {
    "run_start": "on_run_start",
    "round_start": "on_round_start",
    "stage_start": "on_stage_start",
    "progress": "on_progress",
    "log": "on_log",
    "stage_end": "on_stage_end",
    "round_end": "on_round_end",
    "run_end": "on_run_end",
}


class CallbackHandler:
    """A listener of run events (:func:`pbrl.run.progress.subscribe`) that calls each callback's hook for the events
    of the run in ``run_dir``.

    A hook that raises (``sys.exit`` included: a callback cannot end the run, nor make it look finished) is reported
    once, by callback and hook, with its error; its later failures are counted and summed up at ``run_end``. The
    training and the other callbacks go on. ``KeyboardInterrupt`` (Ctrl-C) is not caught.
    """

    def __init__(self, run_dir: str | Path, callbacks: Sequence[Any]) -> None:
        self.run_dir = str(Path(run_dir).resolve())
        self.callbacks = list(callbacks)
        self._same: dict[str, bool] = {}
        self.failures: dict[str, int] = {}  # "Callback.hook" -> failed calls

    def _ours(self, run_dir: str | None) -> bool:
        if run_dir is None:
            return False
        if run_dir not in self._same:
            self._same[run_dir] = str(Path(run_dir).resolve()) == self.run_dir
        return self._same[run_dir]

    def __call__(self, event: Event) -> None:
        if not self._ours(event.run_dir):
            return
        name = HOOKS.get(event.kind)
        for callback in self.callbacks:
            hook = getattr(callback, name, None) if name else None
            if hook is None:
                continue
            try:
                hook(event)
            except (Exception, SystemExit) as exc:  # a broken callback must not stop training or the other callbacks
                self._failed(f"{type(callback).__name__}.{name}", event, exc)
        if event.kind == "run_end":
            for where, count in self.failures.items():
                if count > 1:
                    log.error("callback %s failed on %d events in this run (the first is reported above)", where, count)

    def _failed(self, where: str, event: Event, exc: BaseException) -> None:
        self.failures[where] = self.failures.get(where, 0) + 1
        if self.failures[where] > 1:
            return
        if isinstance(exc, SystemExit):  # a callback cannot end the run (it ended with exit status 0 before)
            what = f"called sys.exit({exc.code!r})"
        else:
            what = f"raised {type(exc).__name__}: {str(exc)[:300] or '(no message)'}"
        log.error(
            "callback %s %s on a %s event; the run goes on, and its later failures are counted, not shown",
            where,
            what,
            event.kind,
        )


@contextlib.contextmanager
def listening(run_dir: str | Path, callbacks: Sequence[Any]) -> Iterator[CallbackHandler]:
    """Call the hooks of ``callbacks`` for the events of the run in ``run_dir`` while the block runs."""
    handler = CallbackHandler(run_dir, callbacks)
    unsubscribe = subscribe(handler)
    try:
        yield handler
    finally:
        unsubscribe()


class Progress:
    """The progress of one unit of work inside a stage (rows sampled, joint responses scored, steps trained):
    :meth:`advance` publishes a ``progress`` event at most every ``every`` units and always at the end."""

    def __init__(self, run_dir: str, round_index: int, stage: str, total: int | None, unit: str, every: int = 1):
        self.run_dir, self.round, self.stage, self.total, self.unit = run_dir, round_index, stage, total, unit
        self.every, self.done, self._shown = max(1, every), 0, 0

    def advance(self, n: int = 1) -> None:
        """``n`` more units done."""
        self.done += n
        if self.done - self._shown >= self.every or (self.total is not None and self.done >= self.total):
            self._shown = self.done
            publish(
                Event(
                    "progress", self.run_dir, self.round, self.stage, done=self.done, total=self.total, unit=self.unit
                )
            )


# How a run that waits for people's labels ended, in words (the others: their state's name in lower case).
RUN_ENDS = {"Suspended": "suspended (waiting for labels)", "AwaitingLabels": "stopped (waiting for labels)"}


def describe(event: Event) -> str | None:
    """The one line a person reads for ``event`` (the CLI's redirected output and the Prefect run log show the
    same lines); None for events that have no line of their own."""
    where = f"round {event.round} {event.stage}" if event.stage else f"round {event.round}"
    if event.kind == "stage_start":
        return f"{where}: started"
    if event.kind == "stage_end":
        if event.state == "AwaitingLabels":
            missing, pairs = event.counts.get("labels_missing"), event.counts.get("pairs")
            return f"{where}: waiting for {missing} labels (of {pairs} pairs)"
        if event.state in ("Failed", "Cancelled"):
            return f"{where}: {event.state.lower()} after {event.seconds or 0:.1f} s"
        counts = ", ".join(f"{k} {v}" for k, v in event.counts.items())
        how = "cached" if event.state == "Cached" else f"done in {event.seconds or 0:.1f} s"
        return f"{where}: {how}" + (f" ({counts})" if counts else "")
    if event.kind == "progress":
        of = f"/{event.total}" if event.total is not None else ""
        return f"{where}: {event.done}{of} {event.unit}"
    if event.kind == "log":
        shown = "  ".join(f"{k} {v:.4g}" for k, v in event.metrics.items())
        return f"{where} step {event.step}: {shown}"
    if event.kind == "round_end":
        m = event.metrics
        parts = []
        if "eval_reward" in m:
            parts.append(f"eval {m['eval_reward']:.3g}" + _interval(m.get("eval_lo"), m.get("eval_hi")))
        if "paired" in m:
            parts.append(f"paired gain {m['paired']:+.3g}" + _interval(m.get("paired_lo"), m.get("paired_hi"), "+"))
        return f"round {event.round}: done in {event.seconds or 0:.0f} s" + (f" — {', '.join(parts)}" if parts else "")
    if event.kind == "run_start":
        return f"run {event.run_dir}: started"
    if event.kind == "run_end":
        ended = RUN_ENDS.get(event.state or "", (event.state or "ended").lower())
        return f"run {event.run_dir}: {ended} after {event.seconds or 0:.0f} s"
    return None


def _interval(low: float | None, high: float | None, sign: str = "") -> str:
    if low is None or high is None:
        return ""
    return f" [{low:{sign}.3g}, {high:{sign}.3g}]"
