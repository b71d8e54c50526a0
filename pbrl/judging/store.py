"""Every answer a judge gave in a run, kept by the content of its question, so that no question is asked twice:
judges cost money (an API) or time (a person), and a rerun, a resume, a cached round or ``pbrl stage judge-pairs
--force`` must reuse what was answered.

The store is one JSON Lines file, ``<run>/judge/answers.jsonl``: one line per answer, appended and flushed to disk
(``fsync``) before the next question is asked, under an exclusive ``flock`` so that two writers (a flow and a
labeller) never interleave. A line cut off by a crash is the last one and is ignored when read (that question is
asked again); any other line that is not an answer is damage, reported with its line number. A later line for the
same key wins (a person who changed a label). Answers that failed for a passing reason (a judge that could not be
reached, raised, timed out or died) are not stored (:mod:`pbrl.judging.asking`); an answer that was given but not
understood is (asking again would cost the same).
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

from pbrl.errors import ArtifactError
from pbrl.judging.verdicts import Answer

FIELDS = ("verdict", "probability", "raw", "tokens", "seconds", "reason")


class AnswerStore:
    """The answers of one run (``path``: ``<run>/judge/answers.jsonl``), read once and appended to."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._answers: dict[str, Answer] = {}
        self._extra: dict[str, dict] = {}
        self.reload()

    def reload(self) -> None:
        """Read the file again (another process may have appended).

        Raises:
            ArtifactError: a line other than the last is not an answer (its number named).
        """
        self._answers.clear()
        self._extra.clear()
        if not self.path.is_file():
            return
        lines = self.path.read_text(encoding="utf-8").split("\n")
        complete = lines[:-1]  # the text after the last newline is a line still being (or never finished) written
        for number, line in enumerate(complete, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                answer = Answer(**{k: record[k] for k in FIELDS})
                key = record["key"]
            except (ValueError, KeyError, TypeError) as exc:
                raise ArtifactError(
                    f"{self.path}: line {number} is not a judge's answer ({exc}); delete that line and the question is "
                    "asked again"
                ) from exc
            self._answers[key] = answer
            self._extra[key] = {k: v for k, v in record.items() if k not in FIELDS and k != "key"}

    def get(self, key: str) -> Answer | None:
        """The stored answer to the question of ``key``, or None."""
        return self._answers.get(key)

    def extra(self, key: str) -> dict:
        """What was stored beside the answer of ``key`` (the judge's name, a labeller's name)."""
        return dict(self._extra.get(key, {}))

    def __contains__(self, key: str) -> bool:
        return key in self._answers

    def __len__(self) -> int:
        return len(self._answers)

    def put(self, key: str, answer: Answer, **extra: str | int | float | None) -> None:
        """Append ``answer`` to the question of ``key`` (with ``extra`` fields, e.g. ``judge=``), durably, before
        returning."""
        self.put_many([(key, answer, extra)])

    def put_many(self, entries: list[tuple[str, Answer, dict]]) -> None:
        """Append every (key, answer, extra fields) with one flush to disk, before returning."""
        if not entries:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with _locked(self.path) as f:
            self._append(f, entries)

    def put_new(self, entries: list[tuple[str, Answer, dict]]) -> list[str]:
        """Append the entries whose question has no answer yet, with one flush to disk, before returning: the first
        answer stands (two people labelling one round never overwrite each other). The file is read again under
        the lock, so an answer another process stored a moment ago counts. Of entries with one key, the first.

        Returns:
            the keys written, in order.
        """
        if not entries:
            return []
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with _locked(self.path) as f:
            self.reload()
            fresh: dict[str, tuple[str, Answer, dict]] = {}
            for key, answer, extra in entries:
                if key not in self._answers and key not in fresh:
                    fresh[key] = (key, answer, extra)
            self._append(f, list(fresh.values()))
        return list(fresh)

    def _append(self, f: _Text, entries: list[tuple[str, Answer, dict]]) -> None:
        if not entries:
            return
        lines = "".join(
            json.dumps({"key": key, **asdict(answer), **extra}, ensure_ascii=False) + "\n"
            for key, answer, extra in entries
        )
        f.write(lines)
        f.flush()
        os.fsync(f.fileno())
        for key, answer, extra in entries:
            self._answers[key] = answer
            self._extra[key] = dict(extra)


@contextmanager
def _locked(path: Path) -> Iterator[_Text]:
    """``path`` open for appending under an exclusive lock, a line cut off by a crash removed first (it was never an
    answer: its question is asked again)."""
    with open(path, "a+b") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            end = f.seek(0, os.SEEK_END)
            if end:
                f.seek(end - 1)
                if f.read(1) != b"\n":
                    f.truncate(_after_last_newline(f, end))
            yield _Text(f)
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _after_last_newline(f, end: int, chunk: int = 65536) -> int:
    """The offset just after the last newline before ``end`` (0 when there is none), read backwards in chunks."""
    position = end
    while position > 0:
        start = max(0, position - chunk)
        f.seek(start)
        found = f.read(position - start).rfind(b"\n")
        if found >= 0:
            return start + found + 1
        position = start
    return 0


class _Text:
    """The text side of a binary file open for appending (``flock`` needs the one descriptor)."""

    def __init__(self, f) -> None:
        self._f = f

    def write(self, text: str) -> None:
        self._f.write(text.encode("utf-8"))

    def flush(self) -> None:
        self._f.flush()

    def fileno(self) -> int:
        return self._f.fileno()
