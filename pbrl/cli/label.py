"""``pbrl label RUN [--round R]``: label the pairs of a round judged by people (``judge: human``) in the terminal,
one pair at a time (docs/guides/label-pairs.md#in-the-terminal).

Each pair is shown as the Prefect UI's form shows it: the item's task as each agent was asked, then the joint
responses A and B side by side, role by role, code as code. One key answers: ``a``, ``b``, ``t`` (tie), ``s``
(skip: cannot tell), ``u`` (undo: the pair before again, to label anew), ``q`` (quit). Every label is written to the
run's answer store, flushed to disk, before the next pair is shown (:func:`pbrl.run.labelling.write_labels`); a pair
that someone else labels meanwhile (in the UI, another terminal) is passed over. When the round's flow run waits
suspended in Prefect, labelling its last pair here resumes it.
"""

from __future__ import annotations

import os
import sys
import termios
import time
import tty
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.syntax import Syntax
from rich.table import Table
from rich.text import Text

from pbrl.cli.display import _expected_errors, _fail, console
from pbrl.judging.human import segments

KEYS = {"a": "A", "b": "B", "t": "tie", "s": "skip"}
LEGEND = "[a] A is better  [b] B is better  [t] tie  [s] skip (cannot tell)  [u] undo  [q] quit"


def _text(text: str) -> RenderableType:
    """A text as people read it: prose as it is, code (fenced, or a text that is code) highlighted."""
    if not text.strip():
        return Text("(empty)", style="dim italic")
    parts: list[RenderableType] = []
    for kind, part in segments(text):
        parts.append(Syntax(part, "python", word_wrap=True, theme="ansi_dark") if kind == "code" else Text(part))
    return Group(*parts)


def pair_panel(asking, number: int, total: int, left: int, run: str, round_index: int) -> Panel:
    """One pair in the terminal: the task per role, then A and B side by side, one row per role."""
    c = asking.comparison
    task = Table(show_header=True, header_style="bold", expand=True, show_lines=True)
    task.add_column("role", ratio=1, style="bold")
    task.add_column("the task, as the agent was asked", ratio=6)
    for role, prompt in zip(c.roles, c.prompts, strict=True):
        task.add_row(role, _text(prompt))
    answers = Table(show_header=True, header_style="bold", expand=True, show_lines=True)
    answers.add_column("role", ratio=1, style="bold")
    answers.add_column("A", ratio=3)
    answers.add_column("B", ratio=3)
    for role, a, b in zip(c.roles, c.first, c.second, strict=True):
        answers.add_row(role, _text(a), _text(b))
    title = f"{run} · round {round_index} · pair {number} of {total} · item {c.item_id} · {asking.question_id}"
    body = Group(task, Text("Which joint response is better as a whole?", style="bold"), answers, Text(LEGEND))
    return Panel(body, title=title, subtitle=f"{left} left to label", border_style="cyan")


def _key() -> str:
    """One key from the terminal (a line's first letter when the input is not a terminal). The terminal is put in
    cbreak mode without flushing its input, so a key pressed while the pair was still being drawn is kept (click's
    getchar flushes it); Ctrl-C still interrupts."""
    if not sys.stdin.isatty():
        line = sys.stdin.readline()
        return line.strip()[:1].lower() if line else "q"
    fd = sys.stdin.fileno()
    before = termios.tcgetattr(fd)
    try:
        tty.setcbreak(fd, termios.TCSANOW)
        return os.read(fd, 1).decode(errors="replace").lower()
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, before)


def label(
    run: Annotated[Path, typer.Argument(help="Run folder.")],
    round_: Annotated[
        int | None, typer.Option("--round", help="Round to label (default: the first that waits for labels).")
    ] = None,
    name: Annotated[str | None, typer.Option("--name", help="Your name, kept with each label.")] = None,
) -> None:
    """Label the pairs of a round judged by people (judge: human), one at a time: a, b, t (tie), s (skip),
    u (undo), q (quit). Each label is stored at once; a labelled pair is not asked again, here or in the UI.

    Example: pbrl label storage/runs/my-run --name alice
    """
    from pbrl.data.storage import RunPaths
    from pbrl.run.folder import open_job  # deferred: imports torch (seconds)
    from pbrl.run.labelling import waiting_for, waiting_rounds

    paths = RunPaths(run)
    if not paths.run_json.is_file():
        raise _fail(ValueError(f"{run} is not a run folder (no run.json)"))
    with _expected_errors(2):
        job = open_job(run)
        if job.judge != "human":
            raise _fail(ValueError(f"run {paths.root.name} is judged by {job.judge or 'its reward'!r}, not by people "
                                   "(judge: human); nothing to label"))  # fmt: skip
        if round_ is None:
            rounds = waiting_rounds(paths, job)
            if not rounds:
                console.print(f"nothing to label: no round of run {paths.root.name} waits for labels")
                return
            waiting = rounds[0]
        else:
            if round_ < 1:
                why = "round 0 is the baseline evaluation; pairs are labelled from round 1 on"
                raise _fail(ValueError(f"--round: round {round_} of run {paths.root.name}: nothing to label ({why})"))
            if not paths.candidates(round_).is_file():
                raise _fail(ValueError(f"--round: round {round_} of run {paths.root.name} has no candidates yet (the "
                                       f"run has {job.num_iterations} round(s) of training)"))  # fmt: skip
            waiting = waiting_for(paths, round_, job)
    with _expected_errors(1):
        _label_round(paths, waiting, job, name)


def _label_round(paths, waiting, job, name: str | None) -> None:
    """The loop of one round: show, read a key, store; then say what is left and how to go on."""
    from pbrl.run.judging import answer_store
    from pbrl.run.labelling import key_of, new_session, relabel, waiting_for, write_labels

    session, done, history = new_session(), 0, []
    numbers = {a.question_id: i for i, a in enumerate(waiting.askings, start=1)}
    queue = list(waiting.missing)
    redo = None
    while queue or redo is not None:
        store = answer_store(paths)  # read again: someone else may be labelling this round too
        asking = redo if redo is not None else queue[0]
        if redo is None and key_of(asking) in store:
            queue.pop(0)
            via = store.extra(key_of(asking)).get("via")
            console.print(f"pair {asking.question_id} was labelled meanwhile ({via})")
            continue
        left = sum(key_of(a) not in store for a in queue)
        console.print(pair_panel(asking, numbers[asking.question_id], waiting.total, left, paths.root.name,
                                 waiting.round_index))  # fmt: skip
        shown_at = time.monotonic()
        key = _key()
        while key not in (*KEYS, "u", "q"):
            key = _key()
        if key == "q":
            break
        if key == "u":
            if not history:
                console.print("nothing to undo in this session")
                continue
            redo = history.pop()  # the pair shown now stays first in the queue
            continue
        choice = KEYS[key]
        if redo is not None:
            relabel(waiting, redo.question_id, choice, labeller=name, via="terminal", session=session)
            console.print(f"{redo.question_id}: {choice} (relabelled)")
            history.append(redo)
            redo = None
            continue
        seconds = {asking.question_id: time.monotonic() - shown_at}
        got = write_labels(waiting, {asking.question_id: choice}, labeller=name, via="terminal", seconds=seconds,
                           session=session)  # fmt: skip
        queue.pop(0)
        if got.written:
            done += 1
            history.append(asking)
            console.print(f"{asking.question_id}: {choice} (stored)")
        else:
            console.print(f"{asking.question_id}: already labelled by someone else; their label stands")
    after = waiting_for(paths, waiting.round_index, job)
    _say_what_next(paths, after, done)


def _say_what_next(paths, waiting, done: int) -> None:
    """How many were labelled and are left, and how the run goes on (resuming its flow run when it waits in
    Prefect and nothing is left)."""
    from pbrl.run.labelling import read_request

    left = len(waiting.missing)
    console.print(f"labelled {done} pair(s) in this session; {left} of {waiting.total} left in round "
                  f"{waiting.round_index}")  # fmt: skip
    flow_run = read_request(paths, waiting.round_index).get("flow_run")
    if flow_run and not left and _resume_flow_run(flow_run):
        console.print(f"resumed flow run {flow_run}: the round goes on with these labels")
        return
    if not left and paths.manifest(waiting.round_index, "judge-pairs").is_file():
        console.print(f"round {waiting.round_index} has taken its labels in already: nothing to go on with")
    elif not left:
        console.print(f"go on: `pbrl train --run {paths.root} --resume` (or Resume the flow run in the Prefect UI)")


def _resume_flow_run(flow_run_id: str) -> bool:
    """Resume the round's suspended flow run with an empty form (its labels are in the store); False when there is
    no Prefect API to reach or the flow run does not wait."""
    import os
    from uuid import UUID

    if not os.environ.get("PREFECT_API_URL"):
        return False
    from prefect.client.orchestration import get_client  # deferred: Prefect reads its settings at import

    try:
        with get_client(sync_client=True) as client:
            run = client.read_flow_run(UUID(flow_run_id))
            if run.state is None or not run.state.is_paused():
                return False
            result = client.resume_flow_run(UUID(flow_run_id), run_input={})
            return result.status.value == "ACCEPT"
    except Exception as exc:  # the labels are stored; the flow run can be resumed in the UI
        console.print(f"could not resume flow run {flow_run_id} ({exc}); Resume it in the Prefect UI")
        return False
