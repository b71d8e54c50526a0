"""Operating-system isolation of untrusted code with bubblewrap (``bwrap``, the sandbox of Flatpak).

Every process that runs model-written code (and the judge that tests it) starts through :func:`bwrap_argv`:

* **namespaces**: new mount, PID, network, IPC, UTS and cgroup namespaces (``--unshare-all``); a user namespace
  as well when pbrl does not run as root. The process sees only its own processes (``/proc`` is the new PID
  namespace's), has no network (a loopback that is down), and its System V and POSIX IPC objects vanish with
  its IPC namespace;
* **a read-only system**: only ``/usr`` (with the usual ``/bin``, ``/lib``, ``/lib64`` links) and the Python
  installation that runs the code (``sys.base_prefix``; no virtual environment, no site-packages, no home
  folder) are mounted, read-only. ``/dev`` holds ``null``, ``zero``, ``random``, ``urandom`` and friends only,
  and is remounted read-only (no writable ``/dev/shm``);
* **one writable place**: ``/work``, a private tmpfs of at most ``disk_mb`` MiB (the working folder, ``HOME`` and
  ``TMPDIR``), gone when the sandbox ends;
* **no way back**: run as root, pbrl's bootstrap (:mod:`pbrl.sandbox.child`) sets the resource limits and then
  drops to ``nobody`` (uid and gid 65534, no groups) before any untrusted line runs, so the kernel enforces
  ``RLIMIT_NPROC`` = 0 (no fork, no thread) and no capability is left; every other capability is dropped by
  bwrap before the bootstrap starts. Without root, the user namespace maps the caller's own uid and forbids
  nested user namespaces (``--disable-userns``);
* **a seccomp filter** (where libseccomp is installed, through ``pyseccomp``): ``unshare``, ``setns``, ``mount``,
  ``pivot_root``, ``chroot``, ``ptrace``, ``bpf``, ``perf_event_open``, ``userfaultfd``, ``keyctl``,
  ``io_uring`` and namespace flags of ``clone`` fail with EPERM (``clone3`` with ENOSYS, so libc falls back);
* ``--die-with-parent`` and ``--new-session``: the sandbox dies with the process that started it and cannot
  reach a terminal.

The judge of a task runs in a sandbox of its own: two sandboxes share nothing but the pipes pbrl gives them, so
the untrusted code cannot see, signal or write to the judge or its verdict channel (its stdout, read by pbrl).

Why bubblewrap: it is the maintained, setuid-free tool that Flatpak uses for the same job, packaged by every
distribution (``apt-get install bubblewrap``); an audit hook inside the interpreter cannot stop file operations
done in C code or attacks on the interpreter itself. HumanEval's own harness tells its users to run generated
code in such a sandbox.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

NOBODY = 65534
WORKDIR = "/work"
CODE_PATH = "/code.py"  # the program to run, mounted read-only outside the working folder
# Errno values returned by the seccomp filter.
_EPERM, _ENOSYS = 1, 38
# Syscalls the untrusted code never needs; the ones that could reach the kernel's attack surface or leave the
# namespaces. Names unknown to this libseccomp or architecture are skipped.
DENIED_SYSCALLS = (
    "unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "ptrace", "process_vm_readv",
    "process_vm_writev", "bpf", "perf_event_open", "userfaultfd", "keyctl", "add_key", "request_key",
    "io_uring_setup", "io_uring_enter", "io_uring_register", "kexec_load", "kexec_file_load", "init_module",
    "finit_module", "delete_module", "open_by_handle_at", "name_to_handle_at", "fanotify_init", "acct",
    "swapon", "swapoff", "reboot", "syslog", "personality", "fsopen", "fsmount", "fsconfig", "move_mount",
    "open_tree", "mount_setattr",
)  # fmt: skip
_CLONE_NAMESPACES = 0x7E020000  # CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET


@dataclass(frozen=True)
class Isolation:
    """Whether untrusted code can be isolated here, and how.

    Attributes:
        available: bubblewrap started a sandboxed interpreter on this machine.
        reason: why not, when not available (the probe's error); else a one-line description.
        as_root: pbrl runs as root (the bootstrap drops to ``nobody``); else a user namespace maps the caller.
        seccomp: a seccomp filter is applied (libseccomp found).
    """

    available: bool
    reason: str
    as_root: bool = False
    seccomp: bool = False


def bwrap_path() -> str | None:
    """The ``bwrap`` executable on PATH, or None."""
    return shutil.which("bwrap")


def interpreter() -> tuple[str, str]:
    """(the real path of the Python interpreter, its installation prefix): what the sandbox mounts and runs."""
    return os.path.realpath(sys.executable), os.path.realpath(sys.base_prefix)


def bwrap_argv(*, disk_mb: int, code_file: str, seccomp_fd: int | None) -> list[str]:
    """The bubblewrap command line that runs a program in the sandbox described in the module docstring.

    ``code_file`` (a host file) appears read-only at :data:`CODE_PATH`; the command to run follows ``--``
    (append it). bwrap also sets ``PWD`` (to ``/work``) in the environment. ``seccomp_fd``: a descriptor holding
    a BPF program (:func:`seccomp_program`), or None.

    Raises:
        FileNotFoundError: bwrap is not installed.
    """
    bwrap = bwrap_path()
    if bwrap is None:
        raise FileNotFoundError("bwrap (bubblewrap) is not installed")
    _, prefix = interpreter()
    # A mount namespace always; PID, network, IPC, UTS and cgroup ones here (not --unshare-all, which adds a user
    # namespace even for root, where nobody could then not be mapped).
    argv = [
        bwrap,
        "--unshare-pid",
        "--unshare-net",
        "--unshare-ipc",
        "--unshare-uts",
        "--unshare-cgroup-try",
        "--die-with-parent",
        "--new-session",
        "--clearenv",
    ]
    if os.geteuid() == 0:
        # No user namespace: the bootstrap drops to nobody itself, so RLIMIT_NPROC holds (root is exempt).
        argv += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        argv += ["--unshare-user", "--disable-userns"]
    argv += ["--ro-bind", "/usr", "/usr"]
    for link in ("bin", "lib", "lib64", "sbin"):
        host = Path("/") / link
        if host.is_symlink():
            argv += ["--symlink", os.readlink(host), f"/{link}"]
        elif host.is_dir():
            argv += ["--ro-bind", str(host), f"/{link}"]
    if not prefix.startswith("/usr/"):
        # Parents of the installation are created world-readable (bwrap would copy a private home's 0700).
        parts = Path(prefix).parts[1:-1]
        for i in range(1, len(parts) + 1):
            argv += ["--perms", "0755", "--dir", "/" + "/".join(parts[:i])]
        argv += ["--ro-bind", prefix, prefix]
    argv += ["--dev", "/dev", "--remount-ro", "/dev", "--proc", "/proc"]
    argv += ["--perms", "0777", "--size", str(disk_mb * 2**20), "--tmpfs", WORKDIR]
    argv += ["--ro-bind", code_file, CODE_PATH, "--remount-ro", "/"]
    argv += ["--chdir", WORKDIR]
    for key, value in sandbox_env().items():
        argv += ["--setenv", key, value]
    if seccomp_fd is not None:
        argv += ["--seccomp", str(seccomp_fd)]
    return argv


def sandbox_env() -> dict[str, str]:
    """The whole environment inside the sandbox: an allowlist, nothing inherited from pbrl's process (no API
    key, no token). ``PYTHONHASHSEED=0`` makes set and dict orders, hence rewards, reproducible."""
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "HOME": WORKDIR,
        "TMPDIR": WORKDIR,
        "PYTHONHASHSEED": "0",
        "PYTHONIOENCODING": "utf-8",
    }


@functools.cache
def _seccomp_bpf() -> bytes | None:
    """The seccomp filter as a BPF program (module docstring), or None without libseccomp."""
    try:
        # Justified dependency: pyseccomp is a thin ctypes binding of libseccomp (the library that systemd, Docker
        # and Flatpak compile their filters with); the distribution's own binding cannot be pip-installed.
        import pyseccomp as seccomp  # deferred: loads libseccomp.so.2, which may be missing
    except Exception:  # ImportError, or OSError from ctypes when libseccomp is not installed
        return None
    try:
        program = seccomp.SyscallFilter(seccomp.ALLOW)
        for name in DENIED_SYSCALLS:
            try:
                program.add_rule(seccomp.ERRNO(_EPERM), name)
            except (ValueError, OSError):  # not a syscall of this architecture
                continue
        program.add_rule(seccomp.ERRNO(_ENOSYS), "clone3")  # its flags live in memory, unfilterable: libc retries
        for bit in range(32):  # a clone with any namespace flag (libseccomp compares one masked value per rule)
            flag = 1 << bit
            if _CLONE_NAMESPACES & flag:
                program.add_rule(seccomp.ERRNO(_EPERM), "clone", seccomp.Arg(0, seccomp.MASKED_EQ, flag, flag))
        with tempfile.TemporaryFile() as f:
            program.export_bpf(f)
            f.seek(0)
            return f.read()
    except Exception:  # a libseccomp too old for a rule: no filter rather than a broken one
        return None


def seccomp_program() -> int | None:
    """A readable descriptor holding the seccomp BPF program, for ``bwrap --seccomp FD`` (the caller passes it to
    the process and closes it), or None when libseccomp is not available."""
    program = _seccomp_bpf()
    if program is None:
        return None
    read_end, write_end = os.pipe()
    try:
        os.write(write_end, program)  # a few hundred bytes: far below a pipe's buffer
    finally:
        os.close(write_end)
    return read_end


@functools.cache
def isolation() -> Isolation:
    """Probe once per process whether bubblewrap can start the sandboxed interpreter here (a real run of the
    sandbox configuration with a trivial program)."""
    if not sys.platform.startswith("linux"):
        return Isolation(False, f"OS isolation needs Linux (this is {sys.platform})")
    if bwrap_path() is None:
        return Isolation(False, "bubblewrap is not installed (apt-get install bubblewrap)")
    executable, _ = interpreter()
    folder = tempfile.mkdtemp(prefix="pbrl-probe-")
    code = os.path.join(folder, "probe.py")
    Path(code).write_text("print('ok')\n")
    fd = seccomp_program()
    try:
        argv = [*bwrap_argv(disk_mb=1, code_file=code, seccomp_fd=fd), "--", executable, "-I", "-S", CODE_PATH]
        out = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=60,
            pass_fds=() if fd is None else (fd,),
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return Isolation(False, f"bubblewrap could not start a sandbox: {exc}")
    finally:
        if fd is not None:
            os.close(fd)
        shutil.rmtree(folder, ignore_errors=True)
    if out.returncode != 0 or out.stdout.strip() != "ok":
        why = (out.stderr.strip().splitlines() or [f"exit status {out.returncode}"])[-1]
        return Isolation(False, f"bubblewrap could not start a sandbox here: {why}")
    as_root, seccomp = os.geteuid() == 0, fd is not None
    how = "as root, dropping to nobody" if as_root else "in a user namespace"
    return Isolation(True, f"bubblewrap {how}{', seccomp filter' if seccomp else ''}", as_root, seccomp)
