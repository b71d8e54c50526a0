"""Labels from people (``judge: human``, docs/guides/label-pairs.md): which pairs of a round wait for a label, the
labels a person submits written into the run's answer store (the UI's forms and ``pbrl label`` alike), the round's
request record (``rounds/<r>/labels.json``: when it first asked, its deadline, where its form is), and the answers the
stage judge-pairs takes from the store.

Nothing is lost or given twice: each submission is written with one flush to disk before anything else is done with
it (:meth:`~pbrl.judging.store.AnswerStore.put_new`, under the store's lock); the first label of a pair stands, so a
second person labelling the same round, or a form ingested twice, writes nothing more; a labelled pair is never
asked again; a submission naming a pair that the round does not ask (a stale or mistyped form) is refused whole.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

from pbrl.config import JobConfig
from pbrl.data.storage import RunPaths, read_json, write_json
from pbrl.errors import LabelError, LabelsNeeded
from pbrl.judging.asking import Asked
from pbrl.judging.human import CHOICES, LATER, NAME, answer_of
from pbrl.judging.verdicts import Answer
from pbrl.run.askings import Asking, round_askings
from pbrl.run.judging import answer_store
from pbrl.run.task import resolve_task

REQUEST_FILE = "labels.json"
NOT_LABELLED = "not labelled within judge_label_timeout_hours (judge_label_timeout_policy: continue)"


def key_of(asking: Asking) -> str:
    """The store key of a person's label of ``asking`` (the question in the order shown)."""
    return asking.comparison.key(NAME)


@dataclass(frozen=True)
class Waiting:
    """A round's labelling: every pair to label (``askings``, in order), those without a label (``missing``), when
    the round first asked for them and until when it waits (None: as long as it takes)."""

    run_dir: Path
    round_index: int
    askings: list[Asking]
    missing: list[Asking]
    requested_at: datetime | None = None
    deadline: datetime | None = None
    form: str | None = field(default=None, compare=False)

    @property
    def total(self) -> int:
        return len(self.askings)

    def expired(self, now: datetime | None = None) -> bool:
        """Whether the round's time to be labelled (``judge_label_timeout_hours``) is over."""
        return self.deadline is not None and (now or datetime.now(UTC)) >= self.deadline


def label_askings(paths: RunPaths, round_index: int, job: JobConfig) -> list[Asking]:
    """Every pair of the round that people label, in order, each in the order it is shown (drawn per pair)."""
    task = resolve_task(job, paths.root)
    return round_askings(paths, round_index, job, task.role_names(job.num_agents))[0]


def request_path(paths: RunPaths, round_index: int) -> Path:
    return paths.round_dir(round_index) / REQUEST_FILE


def read_request(paths: RunPaths, round_index: int) -> dict:
    """The round's request record (empty when it never waited for labels).

    Raises:
        ArtifactError: the file is malformed (named).
    """
    path = request_path(paths, round_index)
    return read_json(path) if path.is_file() else {}


def update_request(paths: RunPaths, round_index: int, **fields: object) -> dict:
    """Merge ``fields`` into the round's request record (written atomically); the new record."""
    record = {**read_request(paths, round_index), **fields}
    write_json(request_path(paths, round_index), record)
    return record


def waiting_for(paths: RunPaths, round_index: int, job: JobConfig, askings: list[Asking] | None = None) -> Waiting:
    """The round's labelling now. The first time pairs are missing, the request record is written: its time, and the
    deadline ``judge_label_timeout_hours`` after it."""
    askings = label_askings(paths, round_index, job) if askings is None else askings
    store = answer_store(paths)
    missing = [a for a in askings if key_of(a) not in store]
    record = read_request(paths, round_index)
    if missing and "requested_at" not in record:
        record = update_request(paths, round_index, requested_at=datetime.now(UTC).isoformat(timespec="seconds"),
                                pairs=len(askings), keys=[key_of(a) for a in askings])  # fmt: skip
    requested = datetime.fromisoformat(record["requested_at"]) if "requested_at" in record else None
    hours = job.judge_label_timeout_hours
    deadline = None if requested is None or hours is None else requested + timedelta(hours=hours)
    return Waiting(paths.root, round_index, askings, missing, requested, deadline, record.get("form"))


def labels_needed(waiting: Waiting) -> LabelsNeeded:
    """The error that stops a run whose round waits for labels, saying how to label them and go on."""
    run = waiting.run_dir
    n = len(waiting.missing)
    message = (
        f"run {run.name} round {waiting.round_index}: waiting for {n} label{'s' * (n != 1)} (of {waiting.total} "
        f"pairs): label in the UI (the deployment pbrl-train/continue with run_name {run.name}) or with "
        f"`pbrl label {run}`, then resume (`pbrl train --run {run} --resume`)"
    )
    return LabelsNeeded(message, run=run.name, round_index=waiting.round_index, missing=n)


def timed_out(waiting: Waiting, job: JobConfig) -> LabelError:
    """The error of a round whose labelling time ran out under ``judge_label_timeout_policy: fail``."""
    run = waiting.run_dir
    return LabelError(
        f"run {run.name} round {waiting.round_index}: {len(waiting.missing)} of {waiting.total} pairs still "
        f"unlabelled after judge_label_timeout_hours={job.judge_label_timeout_hours} (asked since "
        f"{waiting.requested_at:%Y-%m-%d %H:%M} UTC; judge_label_timeout_policy: fail); label them with "
        f"`pbrl label {run}` and resume, or resume with --set judge_label_timeout_policy=continue to train on the "
        "pairs labelled so far"
    )


def labelled_answers(paths: RunPaths, round_index: int, job: JobConfig, askings: list[Asking]) -> list[Asked]:
    """The stored label of every asking (the stage judge-pairs with ``judge: human``), with who gave it.

    Raises:
        LabelsNeeded: some pairs have no label and the round still waits for them.
        LabelError: some have none, the round's time ran out and ``judge_label_timeout_policy`` is ``fail``.
    """
    waiting = waiting_for(paths, round_index, job, askings)
    if waiting.missing and not waiting.expired():
        raise labels_needed(waiting)
    if waiting.missing and job.judge_label_timeout_policy == "fail":
        raise timed_out(waiting, job)
    store = answer_store(paths)
    out = []
    for asking in askings:
        key = key_of(asking)
        stored = store.get(key)
        by = store.extra(key).get("labeller") if stored is not None else None
        out.append(Asked(key, stored or Answer(None, reason=NOT_LABELLED), stored is not None, by))
    return out


@dataclass(frozen=True)
class Written:
    """What became of a submission: the pairs whose label was written, those another label had already decided
    (kept: the first label stands), and those left for later."""

    written: list[str]
    already: list[str]
    later: list[str]


def check_submission(
    waiting: Waiting, labels: Mapping[str, str], shown_keys: Mapping[str, str] | None = None
) -> list[Asking]:
    """The askings that ``labels`` (question id: choice) label, in order, after checking the whole submission.

    Raises:
        LabelError: a question id that the round does not ask, one whose pair changed since the form was made
            (``shown_keys``: question id: the key of what the form showed), or a choice that is none of
            A, B, tie, skip, later; every one named, and nothing of the submission taken.
    """
    by_id = {a.question_id: a for a in waiting.askings}
    unknown = [q for q in labels if q not in by_id]
    changed = [q for q, k in (shown_keys or {}).items() if q in by_id and q in labels and key_of(by_id[q]) != k]
    bad = {q: c for q, c in labels.items() if c not in (*CHOICES, LATER)}
    problems = []
    where = f"round {waiting.round_index} of run {waiting.run_dir.name}"
    if unknown:
        problems.append(f"pairs {', '.join(sorted(unknown))} are not asked in {where}")
    if changed:
        problems.append(f"pairs {', '.join(sorted(changed))} changed in {where} since the form was made")
    if bad:
        problems.append("choices " + ", ".join(f"{q}={c!r}" for q, c in sorted(bad.items())) +
                        f" are none of {', '.join((*CHOICES, LATER))}")  # fmt: skip
    if problems:
        raise LabelError(
            "refused a stale or wrong submission of labels (nothing of it was stored): " + "; ".join(problems) +
            f". Open the round's current form (the flow run's Resume) or run `pbrl label {waiting.run_dir}`"
        )  # fmt: skip
    return [by_id[q] for q in labels]


def write_labels(
    waiting: Waiting,
    labels: Mapping[str, str],
    *,
    labeller: str | None,
    via: str,
    shown_keys: Mapping[str, str] | None = None,
    seconds: Mapping[str, float] | None = None,
    session: str | None = None,
) -> Written:
    """Write a person's ``labels`` (question id: A, B, tie, skip or later) of the round ``waiting`` describes into
    the run's answer store, with one flush to disk, before returning. A pair already labelled keeps its label; a
    pair left ``later`` is not written. ``via`` says where (``ui``, ``terminal``); ``session``, the labelling session
    whose undo may replace these labels (:func:`relabel`).

    Raises:
        LabelError: the submission is stale or wrong (:func:`check_submission`); nothing was written.
    """
    askings = check_submission(waiting, labels, shown_keys)
    at = datetime.now(UTC).isoformat(timespec="seconds")
    entries, later = [], []
    for asking in askings:
        choice = labels[asking.question_id]
        if choice == LATER:
            later.append(asking.question_id)
            continue
        extra = {"judge": NAME, "labeller": labeller or None, "via": via, "at": at,
                 "round": waiting.round_index, "question_id": asking.question_id}  # fmt: skip
        if session is not None:
            extra["session"] = session
        spent = float((seconds or {}).get(asking.question_id, 0.0))
        entries.append((key_of(asking), answer_of(choice, spent), extra))
    keys = set(answer_store(paths_of(waiting)).put_new(entries))
    written = [e[2]["question_id"] for e in entries if e[0] in keys]
    already = [e[2]["question_id"] for e in entries if e[0] not in keys]
    return Written(written, already, later)


def relabel(waiting: Waiting, question_id: str, choice: str, *, labeller: str | None, via: str, session: str) -> None:
    """Replace this ``session``'s own label of a pair (the terminal's undo, then a new choice): a later line of the
    store wins. A label that another person or session gave is kept.

    Raises:
        LabelError: the pair is not asked in the round, or its label is another's.
    """
    (asking,) = check_submission(waiting, {question_id: choice})
    store = answer_store(paths_of(waiting))
    key = key_of(asking)
    if key in store and store.extra(key).get("session") != session:
        raise LabelError(f"pair {question_id} was labelled by {store.extra(key).get('labeller') or 'someone else'}; "
                         "their label stands")  # fmt: skip
    extra = {"judge": NAME, "labeller": labeller or None, "via": via, "session": session,
             "at": datetime.now(UTC).isoformat(timespec="seconds"), "round": waiting.round_index,
             "question_id": question_id}  # fmt: skip
    store.put(key, answer_of(choice), **extra)


def new_session() -> str:
    """An id for one labelling session (its undo may replace its own labels only)."""
    return uuid.uuid4().hex[:12]


def paths_of(waiting: Waiting) -> RunPaths:
    return RunPaths(waiting.run_dir)


def label_status(paths: RunPaths) -> list[tuple[int, int, int, str | None]]:
    """(round, labels missing, pairs, the form's link or None) of every round that asked for labels and misses some,
    from the request records and the store alone (fast: ``pbrl status``, the round table)."""
    out = []
    store = None
    for folder in sorted((paths.root / "rounds").glob("*")):
        if not (folder / REQUEST_FILE).is_file():
            continue
        record = read_json(folder / REQUEST_FILE)
        store = store or answer_store(paths)
        missing = sum(key not in store for key in record.get("keys", []))
        if missing:
            out.append((int(folder.name), missing, len(record.get("keys", [])), record.get("form")))
    return out


def waiting_words(paths: RunPaths) -> list[str]:
    """One line per round that waits for labels: ``round 2: waiting for 7 labels (of 12 pairs): <form>``."""
    lines = []
    for r, missing, total, form in label_status(paths):
        where = f"label them in the UI ({form}) or with `pbrl label {paths.root}`" if form else (
            f"label them with `pbrl label {paths.root}` or in the UI")  # fmt: skip
        lines.append(f"round {r}: waiting for {missing} label{'s' * (missing != 1)} (of {total} pairs): {where}")
    return lines


def waiting_rounds(paths: RunPaths, job: JobConfig) -> list[Waiting]:
    """The rounds of the run that asked for labels and still miss some (``pbrl status``, ``pbrl label``)."""
    out = []
    for folder in sorted((paths.root / "rounds").glob("*")):
        if not (folder / REQUEST_FILE).is_file():
            continue
        waiting = waiting_for(paths, int(folder.name), job)
        if waiting.missing:
            out.append(waiting)
    return out
