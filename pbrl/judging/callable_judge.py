"""A Python function as a judge: ``judge: my_pkg.judges:prefer_shorter`` in YAML, or the function (or an object with
the :class:`~pbrl.judging.verdicts.PairwiseJudge` method ``answer``) in the Python API.

The function is called once per comparison with three lists of one entry per agent, ``prompts``, ``first`` (the
joint response shown as A) and ``second`` (shown as B), and, where its signature accepts them, ``roles=``,
``item_id=`` and ``item=`` (a deep copy of the task item). It returns

- ``"A"``, ``"B"`` or ``"tie"`` (read as an LLM judge's text is: :func:`~pbrl.judging.verdicts.parse_verdict`);
- a number in [0, 1], the probability that A is better (a tie within ``judge_tie_margin`` of 1/2);
- or a pair ``(verdict, probability)``.

Anything else, or an exception, is that comparison's answer without a verdict, with the reason (the value shown, or
the exception's type and message); the stage counts it, and too many stop the round
(``oracle_max_failure_share``). A :class:`~pbrl.errors.TransientError` is not an answer: it fails the stage so that
Prefect retries it.

The function runs in a worker process forked for the stage (:class:`~pbrl.preference.reward_worker.ForkedWorker`,
as the reward does), one comparison at a time within ``judge_timeout`` seconds: a judge that hangs on one pair (a
regular expression that backtracks forever, a server that never answers) is killed, that comparison alone has no
verdict, and the next one starts a fresh worker. ``sys.exit`` or a crash in the judge fails only its comparison.
The function works on copies (its changes to globals stay in the worker) and cannot use a CUDA device that the
stage's process has initialised; a judge object (with ``answer``) runs in the stage's process instead.
"""

from __future__ import annotations

import copy
import inspect
import math
import numbers
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from pbrl.errors import TransientError
from pbrl.judging.verdicts import (
    JUDGE_FAILED,
    JUDGE_RAISED,
    RAW_CHARS,
    Answer,
    Comparison,
    cut,
    parse_verdict,
    verdict_of_probability,
)
from pbrl.preference.reward_worker import CallTimeout, ForkedWorker, RemoteError, WorkerDied

_SHOWN = 200  # characters of a junk value or an exception message kept in the reason
KEYWORDS = ("roles", "item_id", "item")


def _accepted(func: Callable[..., Any]) -> set[str]:
    try:
        params = inspect.signature(func).parameters
    except (TypeError, ValueError):
        return set()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return set(KEYWORDS)
    return {k for k in KEYWORDS if k in params}


def _shown(value: Any) -> str:
    """``repr(value)`` cut to 200 characters; a value whose ``repr`` raises is named by its type."""
    try:
        return cut(repr(value), _SHOWN)
    except Exception as exc:  # the judge's own object: its repr may raise anything
        return f"a {type(value).__name__} whose repr() raised {type(exc).__name__}"


def read_value(value: Any, tie_margin: float) -> Answer:
    """A Python judge's return value as an :class:`Answer` (see the module docstring); its text kept as ``raw`` up to
    :data:`~pbrl.judging.verdicts.RAW_CHARS` characters, as an API judge's."""
    if isinstance(value, str):
        verdict, reason = parse_verdict(value)
        return Answer(verdict, raw=cut(value, RAW_CHARS), reason=reason)
    raw = _shown(value)
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], str):
        verdict, reason = parse_verdict(value[0])
        probability = value[1]
        if verdict is None or not _probability(probability):
            why = f"the judge returned {raw}; expected (A|B|tie, a probability in [0, 1])"
            return Answer(None, raw=raw, reason=why)
        if verdict != verdict_of_probability(float(probability), 0.0) and verdict != "tie" and probability != 0.5:
            why = f"the judge returned {raw}: a verdict and a probability of A being better that disagree"
            return Answer(None, raw=raw, reason=why)
        return Answer(verdict, probability=float(probability), raw=raw)
    if _probability(value):
        return Answer(verdict_of_probability(float(value), tie_margin), probability=float(value), raw=raw)
    return Answer(None, raw=raw, reason=f"the judge returned {raw}; expected A, B, tie or a probability in [0, 1]")


def _message(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception:  # an exception whose str() raises
        return "(its message could not be read)"


def _probability(value: Any) -> bool:
    return (
        isinstance(value, numbers.Real)
        and not isinstance(value, bool)
        and math.isfinite(float(value))
        and 0 <= float(value) <= 1
    )


@dataclass(frozen=True)
class CallableJudge:
    """``func`` (see the module docstring) as a :class:`~pbrl.judging.verdicts.PairwiseJudge` named ``name`` (its
    import path; the key of its stored answers); ``timeout_s``: ``judge_timeout``, seconds per comparison."""

    func: Callable[..., Any]
    name: str
    tie_margin: float = 0.0
    timeout_s: float = 600.0

    def answer(
        self, comparisons: Sequence[Comparison], *, on_answer: Callable[[int, Answer], None] | None = None
    ) -> list[Answer]:
        """One answer per comparison, in order; ``on_answer(index, answer)`` as each is given (the stage stores it
        before the function is called again).

        Raises:
            TransientError: the function raised one (the stage fails and Prefect retries it).
        """
        accepted = _accepted(self.func)
        answers: list[Answer] = []
        with ForkedWorker(self.func, name="pbrl-judge") as worker:
            for c in comparisons:
                extra = {"roles": list(c.roles), "item_id": c.item_id, "item": copy.deepcopy(dict(c.item))}
                args = (list(c.prompts), list(c.first), list(c.second))
                started = time.monotonic()
                try:
                    value = worker.call(args, {k: v for k, v in extra.items() if k in accepted}, self.timeout_s)
                except TransientError:
                    raise
                except CallTimeout:
                    why = f"no answer within {self.timeout_s:g} s (judge_timeout); its process was stopped"
                    answer = Answer(None, reason=f"{JUDGE_FAILED}: {why}")
                except WorkerDied as exc:
                    why = str(exc).removeprefix("the worker process ")
                    answer = Answer(None, reason=cut(f"{JUDGE_FAILED}: its process {why}", _SHOWN))
                except RemoteError as exc:  # SystemExit, or an exception that could not be sent back as itself
                    answer = Answer(None, reason=cut(f"{JUDGE_RAISED} {exc}", _SHOWN))
                except Exception as exc:  # the judge's own fault: this comparison has no verdict, the round goes on
                    answer = Answer(None, reason=cut(f"{JUDGE_RAISED} {type(exc).__name__}: {_message(exc)}", _SHOWN))
                else:
                    answer = replace(read_value(value, self.tie_margin), seconds=round(time.monotonic() - started, 6))
                answers.append(answer)
                if on_answer is not None:
                    on_answer(len(answers) - 1, answer)
        return answers
