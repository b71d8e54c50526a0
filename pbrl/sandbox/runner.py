"""Run untrusted generated Python code (and the judge that tests it) in operating-system isolation.

Each run is a fresh interpreter inside a bubblewrap sandbox (:mod:`pbrl.sandbox.isolation`: its own mount,
PID, network, IPC and UTS namespaces, a read-only system with the standard library only, a private size-capped
tmpfs as the one writable place, no capability, ``nobody`` when pbrl runs as root, a seccomp filter). Around
it, this module adds:

* a wall-clock limit measured by the parent: the sandbox's process group is killed when it is reached and after
  every run (bwrap dies with it, and with bwrap every process of its PID namespace;
  :mod:`pbrl.sandbox.process_group`);
* ``resource`` limits set by the bootstrap (:mod:`pbrl.sandbox.child`) before any untrusted line runs:
  ``RLIMIT_AS`` (memory), ``RLIMIT_CPU``, ``RLIMIT_FSIZE``, ``RLIMIT_NOFILE``, no core files and
  ``RLIMIT_NPROC`` = 0 (no fork, no thread: the bootstrap runs the code as ``nobody``, whose limit the kernel
  enforces), plus a PEP 578 audit hook as defence in depth;
* captured stdout and stderr cut to ``max_output_bytes``.

Verdicts: untrusted code can read or change anything in its own interpreter, so no secret (the tests, their
expected values, a result tag) and no verdict lives in its process. :func:`run_python_pair` runs it beside a
*judge* in another sandbox that never runs it; the two share only two pipes, and the judge's stdout is a
channel only pbrl reads. The judge must treat what comes through the pipe as untrusted data (decode it into
exact built-in types; see :mod:`pbrl.tasks.humaneval_coop_harness`).

Where bubblewrap cannot run (:func:`pbrl.sandbox.isolation.isolation`), :func:`run_python` refuses with an
:class:`~pbrl.errors.IsolationError`, unless the caller asks for ``unisolated=True`` (the
``humaneval_coop`` option ``unsafe_run_untrusted_code_without_isolation``): then the code runs in a plain child
process with the limits and the audit hook only, which does not stop file operations done in C code, reads of
other processes' files or attacks on the interpreter.

Not prevented: burning CPU and memory up to the limits, and answers that are right by luck or memorisation.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from pbrl.errors import IsolationError
from pbrl.sandbox import child as sandbox_child
from pbrl.sandbox.isolation import (
    CODE_PATH,
    WORKDIR,
    Isolation,
    bwrap_argv,
    interpreter,
    isolation,
    sandbox_env,
    seccomp_program,
)
from pbrl.sandbox.process_group import SandboxResult, close_all, leader_exited, run_in_process_group

FILE_SIZE_LIMIT_BYTES = 16 * 2**20
OPEN_FILES_LIMIT = 64
DISK_MB = 64  # the sandbox's writable tmpfs (working folder, HOME, TMPDIR)
MAIN_FILE = "__sandbox_main__.py"
UNSAFE_OPTION = "unsafe_run_untrusted_code_without_isolation"
_END_WAIT_S = 5.0  # how long bwrap gets to reap a killed sandbox before its group is killed


def run_python(
    code: str,
    *,
    timeout_s: float = 10.0,
    memory_mb: int = 512,
    cpu_s: int | None = None,
    max_output_bytes: int = 65536,
    pass_fds: Sequence[int] = (),
    disk_mb: int = DISK_MB,
    unisolated: bool = False,
) -> SandboxResult:
    """Run ``code`` as ``__main__`` in a fresh, isolated interpreter (the layers in the module docstring).

    Args:
        code: Python source. It runs with ``__name__ == "__main__"``; stdin is empty; cwd, ``HOME`` and
            ``TMPDIR`` are the sandbox's private tmpfs.
        timeout_s: wall-clock limit in seconds (> 0).
        memory_mb: address-space limit in MiB (>= 32).
        cpu_s: CPU-time limit in seconds; default ``ceil(timeout_s) + 1``.
        max_output_bytes: bytes kept of stdout and of stderr each (>= 0).
        pass_fds: open descriptors the process inherits (same numbers), given to the code as
            ``sys.argv[1:]`` (decimal strings, in this order). The call takes them over: the parent's copies
            are closed once the process has started (or when it could not start), so that the reader on the
            other end of a pipe sees end-of-file when the process ends.
        disk_mb: size of the sandbox's writable tmpfs in MiB (>= 1).
        unisolated: run without operating-system isolation when bubblewrap is not available (unsafe: the limits
            and the audit hook only). Ignored where isolation is available.

    Returns:
        A :class:`SandboxResult`. Never raises for anything the code does (syntax errors, exceptions,
        ``sys.exit``, infinite loops, huge allocations, fork attempts all come back as a result).

    Raises:
        ValueError: a limit argument is out of range (names the argument).
        IsolationError: bubblewrap cannot isolate the code here and ``unisolated`` is false.
        OSError: the sandbox process could not be started at all (machine out of processes/memory).
    """
    fds = [int(fd) for fd in pass_fds]
    try:
        _check_limits(
            timeout_s=timeout_s, memory_mb=memory_mb, cpu_s=cpu_s, max_output_bytes=max_output_bytes, disk_mb=disk_mb
        )
        state = _isolation_or_refuse(unisolated)
        limits = _limit_args(timeout_s=timeout_s, memory_mb=memory_mb, cpu_s=cpu_s, disk_mb=disk_mb)
        folder = os.path.realpath(tempfile.mkdtemp(prefix="pbrl-sandbox-"))
        try:
            code_file = os.path.join(folder, MAIN_FILE)
            with open(code_file, "w", encoding="utf-8") as f:
                f.write(code)
            if state.available:
                return _run_isolated(code_file, limits, fds, state.as_root, timeout_s, max_output_bytes, disk_mb)
            return _run_unisolated(code_file, limits, fds, timeout_s, max_output_bytes)
        finally:
            _remove_tree(folder)
    finally:
        close_all(fds)  # when the process never started (run_in_process_group empties the list)


def _isolation_or_refuse(unisolated: bool) -> Isolation:
    """This machine's isolation (:func:`pbrl.sandbox.isolation.isolation`).

    Raises:
        IsolationError: bubblewrap cannot isolate the code here and ``unisolated`` is false (names the option).
    """
    state = isolation()
    if not state.available and not unisolated:
        raise IsolationError(
            f"untrusted code needs operating-system isolation, and {state.reason}; install "
            f"bubblewrap, or accept the risk with the task option {UNSAFE_OPTION}: true"
        )
    return state


def _limit_args(*, timeout_s: float, memory_mb: int, cpu_s: int | None, disk_mb: int) -> list[str]:
    """The bootstrap's four limit arguments (:mod:`pbrl.sandbox.child`): address-space bytes, CPU seconds
    (default ``ceil(timeout_s) + 1``), file-size bytes and the open-files limit, as decimal strings."""
    cpu = int(cpu_s) if cpu_s is not None else math.ceil(timeout_s) + 1
    return [
        str(memory_mb * 2**20),
        str(cpu),
        str(min(FILE_SIZE_LIMIT_BYTES, disk_mb * 2**20)),
        str(OPEN_FILES_LIMIT),
    ]


def _run_unisolated(
    code_file: str, limits: list[str], fds: list[int], timeout_s: float, max_output_bytes: int
) -> SandboxResult:
    """One run without bubblewrap (``unisolated=True``): a plain child process in the code file's folder, which is
    its cwd, HOME and TMPDIR; the limits and the audit hook only."""
    folder = os.path.dirname(code_file)
    argv = [
        sys.executable,
        "-s",
        "-S",
        "-B",
        "-P",
        "-c",
        _bootstrap_source(),
        folder,
        code_file,
        *limits,
        "keep-uid",
        *(str(fd) for fd in fds),
    ]
    return run_in_process_group(
        argv,
        cwd=folder,
        env=unisolated_env(folder),
        timeout_s=timeout_s,
        max_output_bytes=max_output_bytes,
        pass_fds=fds,
    )


def _run_isolated(
    code_file: str,
    limits: list[str],
    fds: list[int],
    as_root: bool,
    timeout_s: float,
    max_output_bytes: int,
    disk_mb: int,
) -> SandboxResult:
    """One run in bubblewrap: the bootstrap reads :data:`CODE_PATH` (``code_file`` mounted read-only).

    bwrap exits with the program's status, or 128 + N when a signal N killed it (RLIMIT_CPU's SIGXCPU, the
    memory killer's SIGKILL): such statuses are reported as ``killed_signal`` (a program that calls
    ``sys.exit(128 + N)`` itself looks the same; verdicts never rest on the untrusted program's status)."""
    seccomp = seccomp_program()
    info_read, info_write = os.pipe()  # bwrap reports the sandbox's first process (its PID namespace's init)
    os.set_blocking(info_read, False)
    code_fds = [str(fd) for fd in fds]
    inherited = [*fds, *([] if seccomp is None else [seccomp]), info_write]
    fds.clear()  # run_in_process_group closes them all once the process started
    executable, _ = interpreter()
    argv = [
        *bwrap_argv(disk_mb=disk_mb, code_file=code_file, seccomp_fd=seccomp),
        "--info-fd",
        str(info_write),
        "--",
        executable,
        "-s",
        "-S",
        "-B",
        "-P",
        "-c",
        _bootstrap_source(),
        WORKDIR,
        CODE_PATH,
        *limits,
        "drop-to-nobody" if as_root else "keep-uid",
        *code_fds,
    ]
    try:
        result = run_in_process_group(
            argv,
            cwd="/",
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
            timeout_s=timeout_s,
            max_output_bytes=max_output_bytes,
            pass_fds=inherited,
            before_group_kill=lambda proc: _end_sandbox(proc, info_read),
        )
    finally:
        os.close(info_read)
    status = result.returncode
    if status is not None and 128 < status <= 128 + 64:
        return dataclasses.replace(result, returncode=None, killed_signal=status - 128)
    return result


def run_python_pair(
    judge_code: str,
    untrusted_code: str,
    *,
    timeout_s: float = 10.0,
    memory_mb: int = 512,
    cpu_s: int | None = None,
    max_output_bytes: int = 65536,
    unisolated: bool = False,
) -> tuple[SandboxResult, SandboxResult]:
    """Run a judge and the untrusted code at once, each in its own sandbox, joined only by two pipes.

    Each process gets ``sys.argv[1]`` = the descriptor it reads the other's messages from and
    ``sys.argv[2]`` = the one it writes to the other. When one process ends, the other reads end-of-file.
    Each runs in its own sandbox, so the untrusted code cannot see or reach the judge's process, memory, stdout
    or exit status: the judge's result is a verdict channel it cannot forge (see "Verdicts" in the module
    docstring); it can only send bytes, which the judge must decode as untrusted data. Arguments as in
    :func:`run_python`, applied to each process; the call returns when both have ended (each within
    ``timeout_s``).

    Returns:
        (judge's result, untrusted code's result).

    Raises:
        ValueError / IsolationError / OSError: as :func:`run_python`.
    """
    to_untrusted_r, to_untrusted_w = os.pipe()
    to_judge_r, to_judge_w = os.pipe()
    run = functools.partial(
        run_python,
        timeout_s=timeout_s,
        memory_mb=memory_mb,
        cpu_s=cpu_s,
        max_output_bytes=max_output_bytes,
        unisolated=unisolated,
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
        close_all([to_untrusted_r, to_judge_w, to_judge_r, to_untrusted_w])
        raise
    try:
        judge = run(judge_code, pass_fds=(to_judge_r, to_untrusted_w))
    finally:
        worker.join()
    if errors:
        raise errors[0]
    return judge, results["untrusted"]


def unisolated_env(workdir: str) -> dict[str, str]:
    """The whole environment of an unisolated run: the sandbox's allowlist with ``workdir`` as HOME and TMPDIR."""
    return {**sandbox_env(), "HOME": workdir, "TMPDIR": workdir}


def _end_sandbox(bwrap: subprocess.Popen[bytes], info_read: int) -> None:
    """End every process of a sandbox before its bwrap is killed: SIGKILL its PID namespace's init (the kernel
    then kills the whole namespace and waits for it), then let bwrap reap it and exit (bounded). Killing only
    bwrap would leave the namespace to die a moment after this call returned."""
    try:
        info = json.loads(os.read(info_read, 4096) or b"{}")
    except (OSError, ValueError):  # bwrap failed before it started the sandbox
        info = {}
    child = info.get("child-pid")
    if isinstance(child, int) and child > 1:
        try:
            os.kill(child, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + _END_WAIT_S
    while not leader_exited(bwrap) and time.monotonic() < deadline:
        time.sleep(0.01)


def _check_limits(*, timeout_s: float, memory_mb: int, cpu_s: int | None, max_output_bytes: int, disk_mb: int) -> None:
    problems = []
    if not (isinstance(timeout_s, int | float) and math.isfinite(timeout_s) and timeout_s > 0):
        problems.append(f"timeout_s: got {timeout_s!r}; must be a finite number > 0")
    if not (isinstance(memory_mb, int) and memory_mb >= 32):
        problems.append(f"memory_mb: got {memory_mb!r}; must be an int >= 32")
    if cpu_s is not None and not (isinstance(cpu_s, int) and cpu_s >= 1):
        problems.append(f"cpu_s: got {cpu_s!r}; must be None or an int >= 1")
    if not (isinstance(max_output_bytes, int) and max_output_bytes >= 0):
        problems.append(f"max_output_bytes: got {max_output_bytes!r}; must be an int >= 0")
    if not (isinstance(disk_mb, int) and disk_mb >= 1):
        problems.append(f"disk_mb: got {disk_mb!r}; must be an int >= 1")
    if problems:
        raise ValueError("run_python: " + "; ".join(problems))


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
