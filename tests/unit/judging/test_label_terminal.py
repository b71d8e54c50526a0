"""``pbrl label`` in a real terminal (issue #52): a pseudo-terminal runs the command as a person would, one key per
pair (a, b, t, s, u, q), and the labels are in the run's answer store as pressed, undo included; the screen shows the
task and the two joint responses role by role. A screenshot-like text of the first pair is written to
``tests/artifacts/terminal/label-pair.txt`` (docs/guides/label-pairs.md shows it)."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import struct
import sys
import termios
import time
from pathlib import Path

from pbrl.data.storage import RunPaths
from pbrl.run.judging import answer_store
from pbrl.run.labelling import key_of, waiting_for
from tests.unit.judging.test_labels import labelled_round

ROOT = Path(__file__).resolve().parents[3]
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07|\r")
ARTIFACTS = ROOT / "tests" / "artifacts" / "terminal"


class Terminal:
    """A command in a pseudo-terminal of 140 x 60: what it printed (colours removed) and keys to press."""

    def __init__(self, argv: list[str], cwd: Path) -> None:
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: the command, with this repository on its path
            os.chdir(cwd)
            os.environ.update(PYTHONPATH=str(ROOT), COLUMNS="140", LINES="60", TERM="xterm-256color")
            os.environ.pop("PREFECT_API_URL", None)
            os.execv(argv[0], argv)
        fcntl.ioctl(self.fd, termios.TIOCSWINSZ, struct.pack("HHHH", 60, 140, 0, 0))
        self.seen = ""

    def expect(self, text: str, timeout: float = 180) -> str:
        """Read until ``text`` was printed after the last expect; what was printed up to it."""
        deadline = time.monotonic() + timeout
        while text not in self.seen:
            assert time.monotonic() < deadline, f"never printed {text!r}; printed:\n{self.seen[-3000:]}"
            ready, _, _ = select.select([self.fd], [], [], 1)
            if ready:
                try:
                    self.seen += ANSI.sub("", os.read(self.fd, 65536).decode(errors="replace"))
                except OSError:  # the command ended
                    break
        assert text in self.seen, f"never printed {text!r}; printed:\n{self.seen[-3000:]}"
        before, _, self.seen = self.seen.partition(text)
        return before + text

    def press(self, key: str) -> None:
        os.write(self.fd, key.encode())

    def exit_code(self, timeout: float = 60) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                return os.waitstatus_to_exitcode(status)
            try:  # keep reading so that the command never blocks on a full terminal
                if select.select([self.fd], [], [], 0.5)[0]:
                    self.seen += ANSI.sub("", os.read(self.fd, 65536).decode(errors="replace"))
            except OSError:
                pass
        raise AssertionError("pbrl label did not end")


def test_pbrl_label_in_a_terminal_stores_each_key_undo_included(tiny_model_dir, tmp_path):
    run_dir, job, waiting = labelled_round(tiny_model_dir, tmp_path)
    first, second, third = waiting.askings[:3]
    term = Terminal([str(Path(sys.executable).parent / "pbrl"), "label", str(run_dir), "--name", "ada"], tmp_path)
    screen = term.expect("left to label")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    (ARTIFACTS / "label-pair.txt").write_text(screen[screen.index("╭") :] + term.expect("╯") + "\n")
    assert f"pair 1 of {waiting.total}" in screen and first.question_id in screen and "[q] quit" in screen
    assert "the task, as the agent was asked" in screen and "agent 1" in screen and "agent 2" in screen
    term.press("a")
    term.expect(f"{first.question_id}: A (stored)")
    term.press("t")
    term.expect(f"{second.question_id}: tie (stored)")
    term.press("s")
    term.expect(f"{third.question_id}: skip (stored)")
    term.press("u")  # the skip again: label it anew
    term.expect(f"pair 3 of {waiting.total}")
    term.press("x")  # not a key: asked again, nothing stored
    term.press("b")
    term.expect(f"{third.question_id}: B (relabelled)")
    term.press("q")
    term.expect(f"labelled 3 pair(s) in this session; {waiting.total - 3} of {waiting.total} left in round 1")
    assert term.exit_code() == 0
    store = answer_store(RunPaths(run_dir))
    got = [(store.get(key_of(a)).verdict, store.extra(key_of(a))["labeller"]) for a in (first, second, third)]
    assert got == [("A", "ada"), ("tie", "ada"), ("B", "ada")]
    assert {store.extra(key_of(a))["via"] for a in (first, second, third)} == {"terminal"}
    assert [a.question_id for a in waiting_for(RunPaths(run_dir), 1, job).missing] == [
        a.question_id for a in waiting.askings[3:]
    ]
    # a second session starts at the first pair left, not one labelled before
    again = Terminal([str(Path(sys.executable).parent / "pbrl"), "label", str(run_dir), "--round", "1"], tmp_path)
    assert waiting.askings[3].question_id in again.expect("left to label")
    again.press("q")
    assert again.exit_code() == 0
