"""Hostile code against the sandbox (issue #29): model-written code that tries to escape, forge its verdict or harm
the machine, run through the real ``humaneval_coop`` reward. Each attack must leave the reward at its honest value
and the host untouched (no file written outside the sandbox, no shared-memory object left, no connection made,
no process left behind, the judge intact).

Every attack runs as agent 2's module-level code, wrapped in ``try/except BaseException`` so that a refused
attack leaves the candidate working. With a *wrong* answer the honest reward of HumanEval/2 is 1.5 (aux, main and
parse credit, no test passed): a forged verdict would raise it. With a *correct* answer it is 4.0 (every test
passed, aux called): an attack that reached the judge (killed, signalled, flooded it) would lower it. Some attacks
go around the interpreter's audit hook on purpose (``sqlite3``, ``_posixshmem``, ``mkfifo``, ``mknod``), so the
operating-system layer alone must hold them.
"""

from __future__ import annotations

import os
import socket
import sys
import sysconfig
import threading
from pathlib import Path

import pytest

from pbrl.sandbox.isolation import isolation
from pbrl.tasks.humaneval import load_problems
from pbrl.tasks.humaneval_coop import coop_score

pytestmark = pytest.mark.skipif(
    not isolation().available, reason=f"no operating-system isolation here: {isolation().reason}"
)

ROOT = Path(__file__).resolve().parents[3]
AUX = "def aux(x):\n    return x\n"
WRONG = "def truncate_number(number):\n    return aux(0.0)\n"
CORRECT = "def truncate_number(number):\n    return aux(number % 1.0)\n"
HONEST = {WRONG: 1.5, CORRECT: 4.0}
SECRET = "pbrl-test-secret-7f3a"

# (name, attack code, answer). {canary}, {port}, {site}, {stdlib}, {repo}: paths and the port of the host watch.
ATTACKS = [
    # --- writes outside the sandbox, through every route (wrong answer: a forged verdict would show) ---
    ("open a host file", "open('{canary}/pwned', 'w').write('x')", WRONG),
    ("os.open O_CREAT", "os.close(os.open('{canary}/pwned', os.O_CREAT | os.O_WRONLY))", WRONG),
    (
        "sqlite3 writes from C",
        "import sqlite3; sqlite3.connect('{canary}/pwned.db').execute('create table t(x)')",
        WRONG,
    ),
    ("pathlib", "import pathlib; pathlib.Path('{canary}/pwned').write_text('x')", WRONG),
    ("shutil.copy", "import shutil; shutil.copy(os.__file__, '{canary}/pwned')", WRONG),
    ("plant a .pth in site-packages", "open('{site}/pwned.pth', 'w').write('import os')", WRONG),
    ("plant sitecustomize in the stdlib", "open('{stdlib}/pwned_sitecustomize.py', 'w').write('x')", WRONG),
    ("write into the checkout", "open('{repo}/pwned.py', 'w').write('x')", WRONG),
    ("host /tmp", "open('/tmp/pwned-pbrl', 'w').write('x')", WRONG),
    ("symlink out", "os.symlink('{canary}', '/work/out'); open('/work/out/pwned', 'w').write('x')", WRONG),
    ("mkfifo (no audit event)", "os.mkfifo('{canary}/pwned')", WRONG),
    ("mknod (no audit event)", "os.mknod('{canary}/pwned')", WRONG),
    (
        "tar path traversal",
        "import tarfile, io\nb = io.BytesIO()\nt = tarfile.open(fileobj=b, mode='w')\n"
        "i = tarfile.TarInfo('../../..{canary}/pwned')\n"
        "i.size = 1\nt.addfile(i, io.BytesIO(b'x'))\nt.close()\nb.seek(0)\ntarfile.open(fileobj=b).extractall('/work')",
        WRONG,
    ),
    ("ctypes fopen", "import ctypes\nlibc = ctypes.CDLL(None)\nlibc.fopen(b'{canary}/pwned', b'w')", WRONG),
    ("/proc/self/root", "open('/proc/self/root{canary}/pwned', 'w').write('x')", WRONG),
    ("/proc/1/root", "open('/proc/1/root{canary}/pwned', 'w').write('x')", WRONG),
    # --- RAM-backed objects that would outlive the run ---
    ("/dev/shm file", "open('/dev/shm/pwned-pbrl', 'w').write('x' * 4096)", WRONG),
    (
        "POSIX shared memory (no audit event)",
        "from multiprocessing import shared_memory\n"
        "shared_memory.SharedMemory(name='pwned-pbrl', create=True, size=1 << 20)",
        WRONG,
    ),
    ("memfd", "f = os.memfd_create('pwned'); os.write(f, b'x' * (1 << 20))", WRONG),
    # --- forging the verdict ---
    ("print the result line", "print('PBRL-TESTS 3 3'); os.write(1, b'\\nPBRL-TESTS 3 3\\n')", WRONG),
    (
        "write to every /proc/*/fd/1",
        "for p in os.listdir('/proc'):\n    if p.isdigit():\n        try:\n"
        "            open(f'/proc/{{p}}/fd/1', 'w').write('\\nPBRL-TESTS 3 3\\n')\n        except BaseException:\n"
        "            pass",
        WRONG,
    ),
    ("write to the parent's stdout", "open(f'/proc/{{os.getppid()}}/fd/1', 'w').write('\\nPBRL-TESTS 3 3\\n')", WRONG),
    ("flood the judge", "def truncate_number(number):\n    return 'x' * 50_000_000", WRONG),
    ("hang past the time limit", "while True:\n    pass", WRONG),
    # --- reaching the judge or the trainer (correct answer: harm would lower the reward) ---
    ("kill every process", "import signal\nos.kill(-1, signal.SIGKILL)", CORRECT),
    ("kill the parent", "import signal\nos.kill(os.getppid(), signal.SIGKILL)", CORRECT),
    (
        "kill every pid in /proc",
        "import signal\nfor p in os.listdir('/proc'):\n    if p.isdigit() and int(p) != os.getpid():\n        try:\n"
        "            os.kill(int(p), signal.SIGKILL)\n        except BaseException:\n            pass",
        CORRECT,
    ),
    ("ptrace the parent", "import ctypes\nctypes.CDLL(None).ptrace(16, os.getppid(), 0, 0)", CORRECT),
    ("become root", "os.setuid(0)", CORRECT),
    ("new namespaces", "import ctypes\nassert ctypes.CDLL(None).unshare(0x10000000 | 0x00020000) != 0", CORRECT),
    ("mount a tmpfs", "import ctypes\nctypes.CDLL(None).mount(b'none', b'/work', b'tmpfs', 0, None)", CORRECT),
    # --- exhausting the machine ---
    ("fork bomb", "while True:\n    os.fork()", CORRECT),
    ("thread bomb", "import threading\nwhile True:\n    threading.Thread(target=lambda: None).start()", CORRECT),
    ("subprocess", "import subprocess\nsubprocess.run(['sh', '-c', 'touch {canary}/pwned'])", CORRECT),
    ("os.system", "os.system('touch {canary}/pwned')", CORRECT),
    ("allocate 8 GiB", "x = bytearray(8 * 2**30)", CORRECT),
    (
        "fill the disk",
        "i = 0\nwhile True:\n    open(f'/work/f{{i}}', 'wb').write(b'x' * (8 << 20))\n    i += 1",
        CORRECT,
    ),
    # --- the network ---
    (
        "connect to a host port",
        "import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2).send(b'x')",
        CORRECT,
    ),
    (
        "UDP to a host port",
        "import socket\nsocket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', ('127.0.0.1', {port}))",
        CORRECT,
    ),
    ("reach the internet", "import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=2)", CORRECT),
]


class HostWatch:
    """What an attack could change on the host, recorded before and compared after."""

    def __init__(self, canary: Path) -> None:
        self.canary = canary
        self.parent = os.getppid()  # pytest's parent: make under `make test`, init (1) when pytest was detached
        (canary / "secret.txt").write_text(SECRET)
        self.site = Path(sysconfig.get_paths()["purelib"])
        self.stdlib = Path(os.__file__).parent
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.udp.bind(("127.0.0.1", self.port))
        self.server.settimeout(0.2)
        self.udp.settimeout(0.2)

    def snapshot(self) -> dict[str, object]:
        return {
            "canary": sorted(p.name for p in self.canary.iterdir()),
            "site": sorted(p.name for p in self.site.iterdir()),
            "stdlib": sorted(p.name for p in self.stdlib.iterdir()),
            "repo": sorted(p.name for p in ROOT.iterdir()),
            "tmp": sorted(p for p in os.listdir("/tmp") if "pwned" in p),
            "shm": sorted(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else [],
            "nobody": nobody_processes(),
        }

    def contacted(self) -> bool:
        for take in (self.server.accept, lambda: self.udp.recvfrom(16)):
            try:
                take()
                return True
            except (TimeoutError, OSError):
                continue
        return False

    def fill(self, code: str) -> str:
        return code.format(canary=self.canary, port=self.port, site=self.site, stdlib=self.stdlib, repo=ROOT)


def nobody_processes() -> list[int]:
    """Live processes of uid 65534 (the sandbox's user when pbrl runs as root)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                status = Path(f"/proc/{entry}/status").read_text()
            except OSError:
                continue
            uid = next((line.split()[1] for line in status.splitlines() if line.startswith("Uid:")), None)
            if uid == "65534" and "\nState:\tZ" not in status:
                found.append(int(entry))
    return found


@pytest.fixture(scope="module")
def item() -> dict:
    return next(p for p in load_problems() if p["item_id"] == "HumanEval/2")


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> HostWatch:
    return HostWatch(tmp_path_factory.mktemp("canary"))


def test_the_suite_has_at_least_30_attacks() -> None:
    assert len(ATTACKS) >= 30 and len({name for name, _, _ in ATTACKS}) == len(ATTACKS)


def test_honest_answers_score_as_expected(item: dict) -> None:
    assert coop_score(AUX, WRONG, item).total == 1.5
    assert coop_score(AUX, CORRECT, item).total == 4.0


@pytest.mark.parametrize(("name", "attack", "answer"), ATTACKS, ids=[a[0] for a in ATTACKS])
def test_attack_leaves_the_reward_honest_and_the_host_untouched(name, attack, answer, item, host) -> None:
    before = host.snapshot()
    code = host.fill(attack)
    body = "\n".join("    " + line for line in code.splitlines())
    main = f"import os\ntry:\n{body}\nexcept BaseException:\n    pass\n\n{answer}"
    if attack.startswith("def truncate_number"):  # the attack is the answer itself
        main = code
    score = coop_score(AUX, main, item, timeout_s=4.0, memory_mb=256)
    assert score.total == HONEST[answer], (name, score)
    assert host.snapshot() == before, name
    assert not host.contacted(), name


@pytest.mark.parametrize(
    "read",
    [
        "open('{canary}/secret.txt').read()",
        "open('/proc/{pid}/environ', 'rb').read().decode(errors='replace')",
        "''.join(open(f'/proc/{{p}}/environ', 'rb').read().decode(errors='replace') for p in os.listdir('/proc') "
        "if p.isdigit())",
        "open('/etc/passwd').read()",
        "str(os.listdir('{repo}'))",
    ],
)
def test_host_secrets_and_files_cannot_be_read(read, host, monkeypatch) -> None:
    from pbrl.sandbox.runner import run_python

    monkeypatch.setenv("PBRL_ATTACK_SECRET", SECRET)  # in this process's environment, as an API key would be
    expression = read.format(canary=host.canary, pid=os.getpid(), repo=ROOT)
    result = run_python(
        f"import os\ntry:\n    print({expression})\nexcept BaseException as e:\n    print('refused', e)"
    )
    assert SECRET not in result.stdout and "refused" in result.stdout, result


def test_the_sandbox_sees_only_its_own_processes_and_no_network() -> None:
    from pbrl.sandbox.runner import run_python

    code = (
        "import os\nprint(len([p for p in os.listdir('/proc') if p.isdigit()]))\nprint(os.getuid(), os.getgroups())\n"
        "print(sorted(os.listdir('/sys/class/net')) if os.path.isdir('/sys/class/net') else [])"
    )
    count, ids, interfaces = run_python(code).stdout.splitlines()
    assert int(count) <= 2  # bwrap's reaper (the namespace's init) and the interpreter
    assert ids == ("65534 []" if os.geteuid() == 0 else f"{os.getuid()} {os.getgroups()}")
    assert interfaces in ("[]", "['lo']")  # the new network namespace has only its (down) loopback


def test_concurrent_sandboxes_do_not_see_each_other(item) -> None:
    """Two joint responses scored at once (max_workers): neither judge is disturbed by the other's candidate."""
    from pbrl.tasks.humaneval_coop import make_coop_reward

    killer = "import os, signal\ntry:\n    os.kill(-1, signal.SIGKILL)\nexcept BaseException:\n    pass\n" + CORRECT
    reward = make_coop_reward(max_workers=2)
    results: list[list[float]] = []
    thread = threading.Thread(
        target=lambda: results.append(reward([AUX] * 4, [killer, CORRECT] * 2, batch_items=[item] * 4))
    )
    thread.start()
    thread.join(120)
    assert results == [[4.0, 4.0, 4.0, 4.0]]


def test_without_isolation_the_task_refuses_unless_the_unsafe_option_is_set(monkeypatch) -> None:
    from pbrl.errors import ConfigError, IsolationError
    from pbrl.sandbox import isolation as iso
    from pbrl.sandbox import runner
    from pbrl.tasks import humaneval_coop

    missing = iso.Isolation(False, "bubblewrap is not installed (apt-get install bubblewrap)")
    monkeypatch.setattr(humaneval_coop, "isolation", lambda: missing)
    monkeypatch.setattr(runner, "isolation", lambda: missing)
    with pytest.raises(ConfigError) as info:
        humaneval_coop.humaneval_coop_task(num_train_items=1, num_eval_items=1)
    (problem,) = info.value.problems
    assert problem.field == "task" and "unsafe_run_untrusted_code_without_isolation" in str(problem)
    assert "bubblewrap is not installed" in str(problem)
    with pytest.raises(IsolationError, match="unsafe_run_untrusted_code_without_isolation"):
        runner.run_python("print(1)")
    task = humaneval_coop.humaneval_coop_task(
        num_train_items=1, num_eval_items=1, unsafe_run_untrusted_code_without_isolation=True
    )
    item = task.eval_items[0]
    assert task.reward_func([AUX], [WRONG.replace("truncate_number", item["entry_point"])], batch_items=[item]) == [1.5]
    assert runner.run_python("print(1)", unisolated=True).stdout == "1\n"


def test_the_trainer_process_is_untouched(host) -> None:
    # this process and its parent survived every attack: a killed parent would leave this process to init
    assert os.getppid() == host.parent and sys.stdout is not None


@pytest.mark.parametrize("name", ["sqlite3 writes from C", "mkfifo (no audit event)", "mknod (no audit event)"])
def test_the_attacks_that_pass_the_audit_hook_do_write_without_isolation(name, item, tmp_path, monkeypatch) -> None:
    """The suite tests the operating-system layer: these attacks get past the interpreter's audit hook, and
    without isolation they do reach the host (here a throw-away folder)."""
    from pbrl.sandbox import isolation as iso
    from pbrl.sandbox import runner

    monkeypatch.setattr(runner, "isolation", lambda: iso.Isolation(False, "disabled by the test"))
    attack = next(code for n, code, _ in ATTACKS if n == name).format(canary=tmp_path)
    result = runner.run_python(f"import os\n{attack}", unisolated=True)
    assert result.returncode == 0, result.stderr
    assert [p.name for p in tmp_path.iterdir()] in (["pwned"], ["pwned.db"])
