"""Run a command in its own session and process group, with a wall-clock limit measured by the parent: the
process plumbing under :mod:`pbrl.sandbox.runner`.

The group is killed when the limit is reached and after every run (with a sandbox's bwrap, every process of its
PID namespace dies too); stdout and stderr are read while the process runs and cut to ``max_output_bytes``.
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

_POLL_S = 0.05
_READ_CHUNK = 65536


@dataclass(frozen=True)
class SandboxResult:
    """What a sandboxed run did.

    Attributes:
        returncode: exit status when the process exited by itself (``sys.exit(3)`` gives 3, an uncaught
            exception 1); None when it was killed by a signal (including the timeout kill).
        stdout / stderr: decoded as UTF-8 (invalid bytes replaced), each cut to ``max_output_bytes``
            bytes (the first bytes are kept).
        timed_out: the wall-clock limit was reached and the process group was killed.
        killed_signal: the signal that ended the process (SIGKILL after a timeout, SIGXCPU for the CPU
            limit, SIGSEGV for a crash), else None.
    """

    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool
    killed_signal: int | None

    @property
    def ok(self) -> bool:
        """True when the process exited with status 0 within the time limit."""
        return self.returncode == 0 and not self.timed_out


def run_in_process_group(
    argv: Sequence[str],
    *,
    cwd: str,
    env: dict[str, str],
    timeout_s: float,
    max_output_bytes: int,
    pass_fds: list[int] | None = None,
    before_group_kill: Callable[[subprocess.Popen[bytes]], None] | None = None,
) -> SandboxResult:
    """Run ``argv`` in a new session/process group with a wall-clock limit; kill the whole group after.

    The group gets SIGKILL when the time is up and also after a normal exit of the leader (so background
    children die too), always while the leader is still unreaped, so its id cannot name another group.
    stdout/stderr are read while the process runs (no pipe deadlock) and cut to ``max_output_bytes``.
    ``pass_fds`` are inherited by the process; the parent's copies are closed once it started (or failed to
    start) and the list is emptied, so the caller cannot close them twice. ``before_group_kill(proc)`` runs
    first when the run ends (a sandbox ends its own processes there, see :func:`pbrl.sandbox.runner._end_sandbox`).

    Returns:
        A :class:`SandboxResult` (see its fields for how exits and signals are reported).
    """
    inherited = pass_fds if pass_fds is not None else []
    try:
        proc = subprocess.Popen(
            list(argv), cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, start_new_session=True, close_fds=True, pass_fds=tuple(inherited),
        )  # fmt: skip
    finally:
        close_all(inherited)
    assert proc.stdout is not None and proc.stderr is not None
    out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
    captured = {out_fd: bytearray(), err_fd: bytearray()}
    selector = selectors.DefaultSelector()
    timed_out = False
    try:
        timed_out = _read_until_exit(proc, selector, captured, timeout_s, max_output_bytes)
    finally:
        if before_group_kill is not None:
            before_group_kill(proc)
        _kill_group(proc.pid)
        proc.wait()
        for fd, buf in captured.items():
            _read_available(fd, buf, max_output_bytes)
        selector.close()
        proc.stdout.close()
        proc.stderr.close()
    return _result(proc.returncode, timed_out, captured[out_fd], captured[err_fd])


def _read_until_exit(
    proc: subprocess.Popen[bytes],
    selector: selectors.BaseSelector,
    captured: dict[int, bytearray],
    timeout_s: float,
    max_output_bytes: int,
) -> bool:
    """Read the pipes ``captured`` holds (made non-blocking, registered with ``selector``) into their buffers until
    the leader exits or ``timeout_s`` seconds pass; True when the time ran out. The leader is never reaped here."""
    for fd in captured:
        os.set_blocking(fd, False)
        selector.register(fd, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout_s
    while not leader_exited(proc):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return True
        if selector.get_map():
            for key, _ in selector.select(min(remaining, _POLL_S)):
                if not _read_available(key.fd, captured[key.fd], max_output_bytes):
                    selector.unregister(key.fd)
        else:  # both pipes closed by the code, process still running
            time.sleep(min(remaining, _POLL_S))
    return False


def _result(status: int, timed_out: bool, stdout: bytearray, stderr: bytearray) -> SandboxResult:
    """The result of a reaped run: its exit ``status`` (``Popen.returncode``: -N when signal N killed it), read as
    :class:`SandboxResult` describes."""
    if timed_out:
        returncode, killed = None, int(signal.SIGKILL)
    elif status < 0:
        returncode, killed = None, -status
    else:
        returncode, killed = status, None
    return SandboxResult(
        returncode=returncode,
        stdout=_decode(stdout),
        stderr=_decode(stderr),
        timed_out=timed_out,
        killed_signal=killed,
    )


def close_all(fds: list[int]) -> None:
    """Close each descriptor once and empty the list (a number closed twice could be another thread's)."""
    while fds:
        try:
            os.close(fds.pop())
        except OSError:
            pass


def leader_exited(proc: subprocess.Popen[bytes]) -> bool:
    """True once the leader has exited, without reaping it (WNOWAIT keeps its pid and group id taken)."""
    if not hasattr(os, "waitid"):  # macOS: poll() reaps; the group kill after it is best effort
        return proc.poll() is not None
    try:
        return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _read_available(fd: int, buf: bytearray, limit: int) -> bool:
    """Read what the pipe holds now into ``buf`` (kept up to ``limit`` bytes). False at end of file."""
    while True:
        try:
            chunk = os.read(fd, _READ_CHUNK)
        except BlockingIOError:
            return True
        except OSError:
            return False
        if not chunk:
            return False
        if len(buf) < limit:
            buf.extend(chunk[: limit - len(buf)])


def _decode(data: bytearray) -> str:
    return bytes(data).decode("utf-8", errors="replace")
