"""A worker process for user code that may hang (the oracle's ``reward_func`` and ``reward_processor``, a Python
judge: :mod:`pbrl.judging.callable_judge`): a call
past its deadline is stopped for real, by killing the worker's process group, and the next call starts a fresh
worker.

A Python thread cannot be stopped: a reward abandoned in one (as before, issue #53) kept computing and slowed every
later stage of the run. The worker is forked from the calling process (``multiprocessing``'s ``fork`` context), so
it inherits the function itself, closures and attached Python tasks included (nothing is pickled but the arguments
and the answer), and it lives until :meth:`ForkedWorker.close` (a stage opens one and closes it when it ends), so a
reward that caches a model or a client between calls keeps it between the calls of one stage.

What a reward in the worker cannot do: use a CUDA device the calling process has initialised (CUDA does not survive
a fork), or change the calling process's state (its globals, the items it was given: it works on copies). Its log
records reach the worker's stderr, not Prefect's run log.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import pickle
import signal
import sys
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

_PR_SET_PDEATHSIG = 1  # prctl(2): the signal the worker gets when the thread that forked it ends


class CallTimeout(RuntimeError):
    """The call did not return within its deadline; the worker was killed."""


class WorkerDied(RuntimeError):
    """The worker ended without answering (``os._exit``, a crash, the kernel's out-of-memory killer)."""


class RemoteError(RuntimeError):
    """An exception raised in the worker that could not be sent back as itself (it does not pickle, or it is a
    ``BaseException`` such as ``SystemExit`` that must not end the calling process). ``type_name`` is its class."""

    def __init__(self, type_name: str, message: str):
        super().__init__(f"{type_name}: {message}"[:500])
        self.type_name = type_name

    def __reduce__(self) -> tuple[Any, ...]:
        return (RemoteError, (self.type_name, str(self).partition(": ")[2]))


def error_name(exc: BaseException) -> str:
    """The class name of the user's exception, also when it came back as a :class:`RemoteError`."""
    return exc.type_name if isinstance(exc, RemoteError) else type(exc).__name__


class ForkedWorker:
    """``func(*args, **kwargs)`` run in a forked worker process, one call at a time, each within a deadline.

    Args:
        func: the function; the worker is forked from this process, so it may be any callable (a lambda too).
        portable: turns an exception the worker cannot send back (an unpicklable one) into one it can; the
            default gives a :class:`RemoteError` with the class name and message.
        name: the worker process's name (as ``ps`` shows it).

    Use as a context manager, or call :meth:`close`: the worker lives between calls.
    """

    def __init__(
        self,
        func: Callable[..., Any],
        portable: Callable[[BaseException], BaseException] | None = None,
        name: str = "pbrl-reward",
    ):
        self._func = func
        self._name = name
        self._portable = portable or (lambda exc: RemoteError(type(exc).__name__, str(exc)))
        self._proc: Any = None
        self._conn: Connection | None = None

    def call(self, args: tuple[Any, ...], kwargs: dict[str, Any], timeout_s: float) -> Any:
        """The function's return value, computed in the worker (started first when none is running).

        Raises:
            CallTimeout: no answer within ``timeout_s`` seconds; the worker and every process it started are
                killed, and the next call starts a fresh one.
            WorkerDied: the worker ended without answering.
            Exception: what the function raised (or its :class:`RemoteError`), re-raised here.
        """
        conn = self._start()
        try:
            conn.send((args, kwargs))
            answered = conn.poll(timeout_s)
        except OSError as exc:  # the worker died before it read the call
            self.close()
            raise WorkerDied(f"the worker process ended without answering ({exc})") from None
        if not answered:
            self.close()
            raise CallTimeout(f"no answer within {timeout_s:g} s; the worker process was stopped")
        try:
            kind, payload = conn.recv()
        except (EOFError, OSError):
            code = self._exit_code()
            self.close()
            raise WorkerDied(f"the worker process ended without answering (exit status {code})") from None
        if kind == "error":
            raise payload
        return payload

    def close(self) -> None:
        """Kill the worker's process group (the worker and whatever it started) and reap it. Idempotent."""
        proc, conn, self._proc, self._conn = self._proc, self._conn, None, None
        if proc is None:
            return
        for kill in (lambda: os.killpg(proc.pid, signal.SIGKILL), proc.kill):  # the group; the worker itself if
            with contextlib.suppress(ProcessLookupError, PermissionError, ValueError):  # it had no group yet
                kill()
        proc.join()
        proc.close()
        if conn is not None:
            conn.close()

    def __enter__(self) -> ForkedWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _start(self) -> Connection:
        if self._conn is not None:
            return self._conn
        context = multiprocessing.get_context("fork")
        ours, theirs = context.Pipe(duplex=True)
        proc = context.Process(
            target=_serve, args=(self._func, theirs, ours, self._portable), name=self._name, daemon=True
        )
        proc.start()
        theirs.close()
        self._proc, self._conn = proc, ours
        return ours

    def _exit_code(self) -> int | None:
        if self._proc is None:
            return None
        self._proc.join(timeout=1.0)
        return self._proc.exitcode


def _serve(
    func: Callable[..., Any],
    conn: Connection,
    parent_end: Connection,
    portable: Callable[[BaseException], BaseException],
) -> None:
    """The worker: its own process group (killed whole on a timeout), killed with the thread that forked it, then
    one call after another until the caller closes the pipe."""
    parent_end.close()
    os.setsid()
    _die_with_parent()
    while True:
        try:
            args, kwargs = conn.recv()
        except (EOFError, OSError):
            os._exit(0)
        try:
            answer: tuple[str, Any] = ("value", func(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - everything goes back to the caller, SystemExit included
            answer = ("error", _sendable(exc, portable))
        try:
            conn.send(answer)
        except Exception as exc:  # the value does not pickle
            conn.send(("error", RemoteError(type(exc).__name__, f"the answer could not be sent back: {exc}")))
        sys.stdout.flush()
        sys.stderr.flush()


def _sendable(exc: BaseException, portable: Callable[[BaseException], BaseException]) -> BaseException:
    """``exc`` itself when it survives pickling and is an ``Exception``; else what ``portable`` makes of it."""
    if isinstance(exc, Exception):
        try:
            pickle.loads(pickle.dumps(exc))
            return exc
        except Exception:
            pass
    try:
        return portable(exc)
    except Exception:
        return RemoteError(type(exc).__name__, str(exc))


def _die_with_parent() -> None:
    """Ask Linux to kill the worker when the thread that forked it ends (a caller killed with SIGKILL cannot close
    it); elsewhere nothing (the worker still ends when its pipe closes, between calls)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)  # libc's prctl, in the process already
