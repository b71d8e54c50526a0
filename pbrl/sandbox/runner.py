"""Run untrusted generated Python code in a separate, limited process (SPEC §9).

What :func:`run_python` gives, layer by layer:

Kernel level (hold whatever the code does):
    * a separate process in its own session and process group; on timeout, and after every run, the
      whole group gets SIGKILL before the leader is reaped (so the group id cannot have been reused);
    * a wall-clock timeout measured by the parent;
    * ``resource`` limits set by the child interpreter itself before any untrusted line runs (not in a
      ``preexec_fn``, which can deadlock when the parent has threads): ``RLIMIT_AS`` (memory),
      ``RLIMIT_CPU`` (SIGXCPU/SIGKILL), ``RLIMIT_FSIZE`` (largest file it may write; Python ignores
      SIGXFSZ, so writes beyond it fail with ``OSError`` EFBIG), ``RLIMIT_NOFILE``,
      ``RLIMIT_CORE`` = 0 and ``RLIMIT_NPROC`` = 0. Linux ignores ``RLIMIT_NPROC`` for the root user, so
      under root it does **not** stop forks; the guard below does;
    * a fresh temporary working folder (cwd, ``HOME`` and ``TMPDIR``), removed afterwards;
    * an environment built from scratch (``PATH``, ``LANG``, ``HOME``, ``TMPDIR``, ``PYTHONHASHSEED=0``,
      ``PYTHONIOENCODING``): nothing of the parent's environment (API keys, tokens) is inherited;
    * the interpreter runs with ``-s -S -B -P``: no user or site packages, no bytecode writes, nothing
      prepended to ``sys.path``; only the standard library can be imported. (``-I`` would also ignore
      ``PYTHONHASHSEED``; the environment is ours, so ``-E`` is not needed, and the fixed hash seed makes
      set/dict orders, hence rewards, reproducible.)

Interpreter level (defence in depth, a PEP 578 audit hook installed by the child bootstrap,
:mod:`pbrl.sandbox.child`, before the code runs; audit hooks cannot be removed from Python code, but PEP 578
itself says they are not a security boundary):
    * no process creation (``os.fork``/``exec``/``spawn``/``system``/``posix_spawn``,
      ``subprocess``), no signals to other processes (``os.kill``/``killpg``; ``pidfd`` calls are
      removed), no ``ctypes``, no sockets, no ``resource.setrlimit``, no ``chdir``/``chroot``;
    * file writes, renames, deletions and permission changes only inside the working folder (and
      ``/dev/null``); no symlinks or hard links;
    * file reads only inside the working folder and the interpreter's standard-library folders (plus
      ``/dev/null`` and ``/dev/urandom``); no other device file, even one created in the folder;
    * no ``gc`` object walks (the one way to reach the hook function itself).

Verdicts (reward hacking): untrusted code can read or change anything in its own interpreter. Frames are
reachable (``sys._getframe``, and ``frame.f_back`` raises no audit event), so are builtins, modules and
stdout, and it may exit at any moment. Hence no secret (a nonce, a result tag, the expected values) and no
verdict may live in the process that runs the untrusted code. :func:`run_python_pair` runs the untrusted
code next to a second, *judge* process that never runs it; they talk only through two pipes, and the judge's
stdout is a channel the untrusted code cannot reach. The judge must treat whatever comes through the pipe as
untrusted data (decode it into exact built-in types; see :mod:`pbrl.tasks.humaneval_coop_harness`).

Not prevented: listing directories, reading file metadata, burning CPU or memory up to the limits,
a wrong answer that is right by luck or by memorising the benchmark, and a deliberate attack on the
interpreter itself (for example a crash bug that escapes the audit hook; then only the kernel limits above
hold, and code running as the judge's user could signal or trace the judge). The code runs as the parent's
user (dropping to ``nobody`` fails where the interpreter lives under a private home). For hostile models,
run the trainer as an unprivileged user (then ``RLIMIT_NPROC`` = 0 holds in the kernel) or in a container.
"""

from __future__ import annotations

import functools
import math
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pbrl.sandbox import child as sandbox_child

FILE_SIZE_LIMIT_BYTES = 16 * 2**20
OPEN_FILES_LIMIT = 64
MAIN_FILE = "__sandbox_main__.py"
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


def run_python(
    code: str,
    *,
    timeout_s: float = 10.0,
    memory_mb: int = 512,
    cpu_s: int | None = None,
    max_output_bytes: int = 65536,
    pass_fds: Sequence[int] = (),
) -> SandboxResult:
    """Run ``code`` as ``__main__`` in a fresh sandboxed interpreter (the layers in the module docstring).

    Args:
        code: Python source. It runs with ``__name__ == "__main__"``; stdin is empty.
        timeout_s: wall-clock limit in seconds (> 0).
        memory_mb: address-space limit in MiB (>= 32).
        cpu_s: CPU-time limit in seconds; default ``ceil(timeout_s) + 1``.
        max_output_bytes: bytes kept of stdout and of stderr each (>= 0).
        pass_fds: open descriptors the process inherits (same numbers), given to the code as
            ``sys.argv[1:]`` (decimal strings, in this order). The call takes them over: the parent's copies
            are closed once the process has started (or when it could not start), so that the reader on the
            other end of a pipe sees end-of-file when the process ends.

    Returns:
        A :class:`SandboxResult`. Never raises for anything the code does (syntax errors, exceptions,
        ``sys.exit``, infinite loops, huge allocations, fork attempts all come back as a result).

    Raises:
        ValueError: a limit argument is out of range (names the argument).
        OSError: the sandbox process could not be started at all (machine out of processes/memory).
    """
    fds = [int(fd) for fd in pass_fds]
    try:
        _check_limits(timeout_s=timeout_s, memory_mb=memory_mb, cpu_s=cpu_s, max_output_bytes=max_output_bytes)
        cpu = int(cpu_s) if cpu_s is not None else math.ceil(timeout_s) + 1
        workdir = os.path.realpath(tempfile.mkdtemp(prefix="pbrl-sandbox-"))
        try:
            with open(os.path.join(workdir, MAIN_FILE), "w", encoding="utf-8") as f:
                f.write(code)
            argv = [
                sys.executable, "-s", "-S", "-B", "-P", "-c", _bootstrap_source(),
                workdir, MAIN_FILE, str(memory_mb * 2**20), str(cpu), str(FILE_SIZE_LIMIT_BYTES),
                str(OPEN_FILES_LIMIT), *(str(fd) for fd in fds),
            ]  # fmt: skip
            return run_in_process_group(
                argv, cwd=workdir, env=sandbox_env(workdir), timeout_s=timeout_s,
                max_output_bytes=max_output_bytes, pass_fds=fds,
            )  # fmt: skip
        finally:
            _remove_tree(workdir)
    finally:
        _close_all(fds)  # when the process never started (run_in_process_group empties the list)


def run_python_pair(
    judge_code: str,
    untrusted_code: str,
    *,
    timeout_s: float = 10.0,
    memory_mb: int = 512,
    cpu_s: int | None = None,
    max_output_bytes: int = 65536,
) -> tuple[SandboxResult, SandboxResult]:
    """Run a judge and the untrusted code at once, each in its own sandbox, joined only by two pipes.

    Each process gets ``sys.argv[1]`` = the descriptor it reads the other's messages from and
    ``sys.argv[2]`` = the one it writes to the other. When one process ends, the other reads end-of-file.
    The untrusted code cannot reach the judge's memory, stdout or exit status, so the judge's result is a
    verdict channel it cannot forge (see "Verdicts" in the module docstring); it can only send bytes, which
    the judge must decode as untrusted data. Arguments as in :func:`run_python`, applied to each process;
    the call returns when both have ended (each within ``timeout_s``).

    Returns:
        (judge's result, untrusted code's result).

    Raises:
        ValueError / OSError: as :func:`run_python`.
    """
    to_untrusted_r, to_untrusted_w = os.pipe()
    to_judge_r, to_judge_w = os.pipe()
    run = functools.partial(
        run_python, timeout_s=timeout_s, memory_mb=memory_mb, cpu_s=cpu_s, max_output_bytes=max_output_bytes
    )
    results: dict[str, SandboxResult] = {}
    errors: list[BaseException] = []

    def run_untrusted() -> None:
        try:
            results["untrusted"] = run(untrusted_code, pass_fds=(to_untrusted_r, to_judge_w))
        except BaseException as exc:  # re-raised in the caller's thread below
            errors.append(exc)

    worker = threading.Thread(target=run_untrusted, name="pbrl-sandbox-untrusted", daemon=True)
    try:
        worker.start()
    except BaseException:
        _close_all([to_untrusted_r, to_judge_w, to_judge_r, to_untrusted_w])
        raise
    try:
        judge = run(judge_code, pass_fds=(to_judge_r, to_untrusted_w))
    finally:
        worker.join()
    if errors:
        raise errors[0]
    return judge, results["untrusted"]


def sandbox_env(workdir: str) -> dict[str, str]:
    """The whole environment of a sandboxed process: an allowlist, nothing inherited from the parent."""
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "HOME": workdir,
        "TMPDIR": workdir,
        "PYTHONHASHSEED": "0",
        "PYTHONIOENCODING": "utf-8",
    }


def run_in_process_group(
    argv: Sequence[str],
    *,
    cwd: str,
    env: dict[str, str],
    timeout_s: float,
    max_output_bytes: int,
    pass_fds: list[int] | None = None,
) -> SandboxResult:
    """Run ``argv`` in a new session/process group with a wall-clock limit; kill the whole group after.

    The group gets SIGKILL when the time is up and also after a normal exit of the leader (so background
    children die too), always while the leader is still unreaped, so its id cannot name another group.
    stdout/stderr are read while the process runs (no pipe deadlock) and cut to ``max_output_bytes``.
    ``pass_fds`` are inherited by the process; the parent's copies are closed once it started (or failed to
    start) and the list is emptied, so the caller cannot close them twice.

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
        _close_all(inherited)
    assert proc.stdout is not None and proc.stderr is not None
    out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
    captured = {out_fd: bytearray(), err_fd: bytearray()}
    selector = selectors.DefaultSelector()
    timed_out = False
    try:
        for fd in captured:
            os.set_blocking(fd, False)
            selector.register(fd, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout_s
        while not _leader_exited(proc):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                break
            if selector.get_map():
                for key, _ in selector.select(min(remaining, _POLL_S)):
                    if not _read_available(key.fd, captured[key.fd], max_output_bytes):
                        selector.unregister(key.fd)
            else:  # both pipes closed by the code, process still running
                time.sleep(min(remaining, _POLL_S))
    finally:
        _kill_group(proc.pid)
        proc.wait()
        for fd, buf in captured.items():
            _read_available(fd, buf, max_output_bytes)
        selector.close()
        proc.stdout.close()
        proc.stderr.close()
    status = proc.returncode
    if timed_out:
        returncode, killed = None, int(signal.SIGKILL)
    elif status < 0:
        returncode, killed = None, -status
    else:
        returncode, killed = status, None
    return SandboxResult(
        returncode=returncode,
        stdout=_decode(captured[out_fd]),
        stderr=_decode(captured[err_fd]),
        timed_out=timed_out,
        killed_signal=killed,
    )


def _check_limits(*, timeout_s: float, memory_mb: int, cpu_s: int | None, max_output_bytes: int) -> None:
    problems = []
    if not (isinstance(timeout_s, int | float) and math.isfinite(timeout_s) and timeout_s > 0):
        problems.append(f"timeout_s: got {timeout_s!r}; must be a finite number > 0")
    if not (isinstance(memory_mb, int) and memory_mb >= 32):
        problems.append(f"memory_mb: got {memory_mb!r}; must be an int >= 32")
    if cpu_s is not None and not (isinstance(cpu_s, int) and cpu_s >= 1):
        problems.append(f"cpu_s: got {cpu_s!r}; must be None or an int >= 1")
    if not (isinstance(max_output_bytes, int) and max_output_bytes >= 0):
        problems.append(f"max_output_bytes: got {max_output_bytes!r}; must be an int >= 0")
    if problems:
        raise ValueError("run_python: " + "; ".join(problems))


def _close_all(fds: list[int]) -> None:
    """Close each descriptor once and empty the list (a number closed twice could be another thread's)."""
    while fds:
        try:
            os.close(fds.pop())
        except OSError:
            pass


def _leader_exited(proc: subprocess.Popen[bytes]) -> bool:
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


def _remove_tree(path: str) -> None:
    """Remove the working folder even if the code made parts of it read-only."""

    def make_writable_and_retry(func, target, _error):  # type: ignore[no-untyped-def]
        try:
            os.chmod(os.path.dirname(target), 0o700)
            os.chmod(target, 0o700)
            func(target)
        except OSError:
            pass

    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=make_writable_and_retry)
    else:
        shutil.rmtree(path, onerror=make_writable_and_retry)


@functools.cache
def _bootstrap_source() -> str:
    """The child bootstrap (:mod:`pbrl.sandbox.child`) as text, for ``python -c``."""
    return Path(sandbox_child.__file__).read_text(encoding="utf-8")
