"""Callbacks of a run (docs/guides/python-api.md#callbacks), in the spirit of ``transformers.TrainerCallback``: an
object with any of the hooks below hears the run's events (:class:`pbrl.run.progress.Event`) as they happen.

=================  ==================================================================================================
hook               when, and what the event carries
=================  ==================================================================================================
``on_run_start``   the run folder is ready, before round 0 (``run_dir``)
``on_round_start`` a round begins (``round``; 0 = the evaluation of the initial policies)
``on_stage_start`` a stage begins (``round``, ``stage``)
``on_progress``    units of a stage's work done (``done``, ``total``, ``unit``: rows, joint responses, steps)
``on_log``         a training step's metrics on the ``logging_steps`` gate (``step``, ``env_step``, ``metrics``:
                   ``madpo/loss``, ``rm/loss``, ...)
``on_stage_end``   a stage ended (``state``: Completed, Cached, Failed or Cancelled; the manifest's ``counts``,
                   ``metrics``, ``messages``; ``seconds``)
``on_round_end``   a round ended (``metrics``: its row of the round table, ``eval_reward``, ``eval_lo``/``eval_hi``,
                   ``paired``, ``loss`` ...; ``seconds``)
``on_run_end``     the run ended (``state``: Completed, Failed or Cancelled; ``seconds``)
=================  ==================================================================================================

Subclass :class:`TrainerCallback` (its hooks do nothing) or give any object with some of these methods. Callbacks
observe: they cannot stop or steer training, and one that raises is logged and skipped (the run and the other
callbacks go on). They hear the events of their own run only, in the thread that runs the stages; stages that run in
other processes (``runner: ray`` shards) are heard at their start and end. The trackers of ``report_to``
(:class:`pbrl.reporting.trackers.RunTracker`) are callbacks too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# The dispatch of events to hooks lives with the events (pbrl/run/progress.py), so that the training flow, a layer
# below this module, attaches a run's trackers the same way; the names are pbrl.trainers.callbacks' public API.
from pbrl.run.progress import HOOKS, CallbackHandler, Event, listening

__all__ = ["HOOKS", "CallbackHandler", "Event", "TrainerCallback", "check_callbacks", "listening"]


class TrainerCallback:
    """A callback whose hooks do nothing: override the ones you need. Each hook takes the
    :class:`~pbrl.run.progress.Event` (see the module docstring for what each kind carries)."""

    def on_run_start(self, event: Event) -> None:
        """The run folder is ready; round 0 comes next."""

    def on_round_start(self, event: Event) -> None:
        """Round ``event.round`` begins."""

    def on_stage_start(self, event: Event) -> None:
        """Stage ``event.stage`` of round ``event.round`` begins."""

    def on_progress(self, event: Event) -> None:
        """``event.done`` of ``event.total`` ``event.unit`` of a stage are done."""

    def on_log(self, event: Event) -> None:
        """A training step's metrics (``event.metrics``), every ``logging_steps`` on the env-step axis."""

    def on_stage_end(self, event: Event) -> None:
        """A stage ended: ``event.state``, the manifest's ``event.counts`` / ``event.metrics`` / ``event.messages``."""

    def on_round_end(self, event: Event) -> None:
        """A round ended: ``event.metrics`` is its row of the round table."""

    def on_run_end(self, event: Event) -> None:
        """The run ended: ``event.state`` is Completed or Failed."""


def check_callbacks(callbacks: Sequence[Any] | None) -> list[Any]:
    """The ``callbacks`` argument as callback objects: a class is instantiated without arguments (as
    transformers does).

    Raises:
        TypeError: naming ``callbacks[i]`` when an entry has none of the hooks (:data:`HOOKS`), or when
            ``callbacks`` is not a list.
    """
    if callbacks is None:
        return []
    if isinstance(callbacks, (str, bytes)) or not isinstance(callbacks, Sequence):
        raise TypeError(f"callbacks: got a {type(callbacks).__name__}; give a list of callbacks (TrainerCallback)")
    out = []
    for i, callback in enumerate(callbacks):
        if isinstance(callback, type):
            callback = callback()
        if not any(callable(getattr(callback, hook, None)) for hook in HOOKS.values()):
            raise TypeError(
                f"callbacks[{i}]: {type(callback).__name__} has none of the hooks {', '.join(HOOKS.values())}; "
                "subclass pbrl.trainers.TrainerCallback"
            )
        out.append(callback)
    return out
