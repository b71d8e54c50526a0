"""Python judges named by import path in the judge tests (``judge: tests.judges_ab:longer_first_agent``).

Where ``PBRL_TEST_JUDGE_LOG`` is set, :func:`counted` appends one line per comparison it is asked (the tests count
what a rerun asks again); where ``PBRL_TEST_JUDGE_KILL_AFTER`` is set to n, it kills the stage's process (the
parent of the judge's worker) after answering n comparisons in that worker (a crash in the middle of judging).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Sequence

_answered = 0


def longer_first_agent(prompts: Sequence[str], first: Sequence[str], second: Sequence[str]) -> str:
    """Prefers the joint response whose first agent wrote more characters; a tie when equal."""
    a, b = len(first[0]), len(second[0])
    return "A" if a > b else ("B" if b > a else "tie")


def counted(prompts: Sequence[str], first: Sequence[str], second: Sequence[str], *, item_id: str) -> str:
    """:func:`longer_first_agent`, logging every call and dying on demand (see the module docstring)."""
    global _answered
    if log := os.environ.get("PBRL_TEST_JUDGE_LOG"):
        with open(log, "a") as f:
            f.write(f"{item_id}\t{first[0]!r}\t{second[0]!r}\n")
    _answered += 1
    limit = os.environ.get("PBRL_TEST_JUDGE_KILL_AFTER")
    if limit and _answered > int(limit):  # the judge runs in a worker forked from the stage's process: kill both
        os.kill(os.getppid(), signal.SIGKILL)  # as a kill -9 of the stage would: no cleanup, no flush
        os._exit(9)
    return longer_first_agent(prompts, first, second)


def always_tie(prompts: Sequence[str], first: Sequence[str], second: Sequence[str]) -> str:
    return "tie"


def raising(prompts: Sequence[str], first: Sequence[str], second: Sequence[str]) -> str:
    raise RuntimeError("the judge's server said no")


def junk(prompts: Sequence[str], first: Sequence[str], second: Sequence[str]) -> object:
    return {"winner": "A"}


def hangs_on_short(prompts: Sequence[str], first: Sequence[str], second: Sequence[str]) -> str:
    """Loops forever when the first joint response's first agent wrote under 3 characters; else
    :func:`longer_first_agent`."""
    while len(first[0]) < 3:
        time.sleep(0.01)
    return longer_first_agent(prompts, first, second)


def exits(prompts: Sequence[str], first: Sequence[str], second: Sequence[str]) -> str:
    sys.exit(3)


def broken_until_fixed(prompts: Sequence[str], first: Sequence[str], second: Sequence[str]) -> str:
    """Raises while ``PBRL_TEST_JUDGE_BROKEN`` is set (a judge with a bug), else :func:`longer_first_agent` (fixed)."""
    if os.environ.get("PBRL_TEST_JUDGE_BROKEN"):
        raise RuntimeError("nope")
    return longer_first_agent(prompts, first, second)
