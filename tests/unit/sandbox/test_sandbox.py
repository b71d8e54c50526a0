"""The sandbox for generated code (docs/design/architecture.md#the-code-sandbox): limits hold, the parent is unharmed,
nothing leaks or lingers,
and the code cannot read or forge the verdict on it (issue #16 item 10)."""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import pytest

from pbrl.sandbox.isolation import WORKDIR
from pbrl.sandbox.process_group import run_in_process_group
from pbrl.sandbox.runner import FILE_SIZE_LIMIT_BYTES, run_python, run_python_pair
from pbrl.tasks.humaneval import load_problems
from pbrl.tasks.humaneval_coop import coop_score, make_coop_reward
from pbrl.tasks.humaneval_coop_harness import MAX_DEPTH, decode_reply, decode_value, encode_value

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox limits are Linux's")

NO_HANG_S = 60.0  # generous bound: proves a call returned, not how fast


def live_group_members(pgid: int, wait_s: float = 10.0) -> list[int]:
    """Pids (not zombies) whose process group is ``pgid``, polled until none are left or ``wait_s`` passed."""
    deadline = time.monotonic() + wait_s
    while True:
        members = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            state, _ppid, group = stat.rsplit(")", 1)[1].split()[:3]
            if int(group) == pgid and state != "Z":
                members.append(int(entry))
        if not members or time.monotonic() > deadline:
            return members
        time.sleep(0.05)


def test_runs_code_and_captures_output() -> None:
    result = run_python('import sys\nprint("hi")\nprint("oops", file=sys.stderr)')
    assert (result.returncode, result.stdout, result.stderr) == (0, "hi\n", "oops\n")
    assert result.ok and not result.timed_out and result.killed_signal is None


def test_standard_library_imports_work() -> None:
    code = (
        "import collections, dataclasses, functools, heapq, itertools, json, math, random, re, string\n"
        "from typing import List\n"
        "P = collections.namedtuple('P', 'a b')\n"
        "@dataclasses.dataclass\nclass D:\n    x: int = 1\n"
        "print(P(1, 2), D(), json.dumps({'a': [1]}))"
    )
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout == 'P(a=1, b=2) D(x=1) {"a": [1]}\n'


def test_infinite_loop_times_out_and_the_call_returns() -> None:
    start = time.monotonic()
    result = run_python("while True:\n    pass", timeout_s=1.0)
    assert time.monotonic() - start < NO_HANG_S
    assert result.timed_out and result.returncode is None and result.killed_signal == signal.SIGKILL


def test_huge_allocation_fails_cleanly_and_the_parent_goes_on() -> None:
    result = run_python("x = bytearray(10**10)\nprint('allocated')", memory_mb=256)
    assert "allocated" not in result.stdout
    assert "MemoryError" in result.stderr or result.killed_signal is not None
    assert run_python("print(2 + 2)").stdout == "4\n"


def test_fork_loop_is_contained_and_leaves_no_process() -> None:
    result = run_python("import os\nprint(os.getpid(), flush=True)\nwhile True:\n    os.fork()", timeout_s=5.0)
    lines = result.stdout.split()
    assert len(lines) == 1  # only the sandbox process itself ever printed
    assert result.returncode == 1 and "os.fork is not allowed" in result.stderr
    assert live_group_members(int(lines[0])) == []


@pytest.mark.parametrize(
    ("code", "message"),
    [
        ("import subprocess\nsubprocess.run(['sleep', '100'])", "importing _posixsubprocess is not allowed"),
        ("import os\nos.system('sleep 100')", "os.system is not allowed"),
        ("import ctypes", "importing ctypes is not allowed"),
        ("import socket\nsocket.socket()", "socket.__new__ is not allowed"),
        ("import os\nos.kill(os.getppid(), 0)", "os.kill is not allowed"),  # signal 0 only probes
        ("import resource\nresource.setrlimit(resource.RLIMIT_AS, (-1, -1))", "resource.setrlimit is not allowed"),
        ("import os\nos.chdir('/')", "os.chdir is not allowed"),
        ("import gc\ngc.get_objects()", "gc.get_objects is not allowed"),  # the way to reach the guard
        ("import sys\ndel sys.modules['_signal']\nimport _signal", "importing _signal is not allowed"),
    ],
)
def test_process_signal_socket_and_limit_changes_are_refused(code: str, message: str) -> None:
    result = run_python(code, timeout_s=5.0)
    assert result.returncode == 1 and message in result.stderr


def test_device_files_are_refused() -> None:
    outside = run_python("print(open('/dev/zero', 'rb').read(4))")
    assert outside.returncode == 1 and "opening the device /dev/zero is not allowed" in outside.stderr
    # Root may create a device node in the working folder; opening it is still refused.
    inside = run_python("import os, stat\nos.mknod('disk', stat.S_IFCHR | 0o600, os.makedev(1, 5))\nopen('disk')")
    assert inside.returncode == 1 and "PermissionError" in inside.stderr


def test_cpu_limit_kills_and_file_size_limit_stops_writes() -> None:
    spin = run_python("while True:\n    pass", timeout_s=30.0, cpu_s=1)
    assert not spin.timed_out and spin.killed_signal in (signal.SIGXCPU, signal.SIGKILL)
    # Python ignores SIGXFSZ, so the kernel cuts the file at the limit and the write fails with EFBIG.
    code = (
        "import errno, os\ntry:\n"
        f"    with open('big', 'wb') as f:\n        f.write(b'x' * {FILE_SIZE_LIMIT_BYTES + 1})\n"
        "except OSError as exc:\n    print(errno.errorcode[exc.errno])\n"
        "print(os.path.getsize('big'))"
    )
    assert run_python(code).stdout == f"EFBIG\n{FILE_SIZE_LIMIT_BYTES}\n"


def test_process_group_is_killed_on_timeout_and_after_exit() -> None:
    env = {"PATH": "/usr/bin:/bin"}
    waited = run_in_process_group(
        ["/bin/sh", "-c", "echo $$; sleep 100 & sleep 100 & wait"], cwd="/", env=env, timeout_s=1.0,
        max_output_bytes=100,
    )  # fmt: skip
    assert waited.timed_out
    assert live_group_members(int(waited.stdout.split()[0])) == []
    # The leader exits at once; its background child (holding stdout open) must not outlive the call.
    start = time.monotonic()
    left = run_in_process_group(
        ["/bin/sh", "-c", "echo $$; sleep 100 & echo started"], cwd="/", env=env, timeout_s=30.0,
        max_output_bytes=100,
    )  # fmt: skip
    assert time.monotonic() - start < NO_HANG_S
    assert (left.returncode, left.timed_out, left.stdout.split()[1]) == (0, False, "started")
    assert live_group_members(int(left.stdout.split()[0])) == []


def test_working_folder_is_fresh_and_removed_afterwards(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the run's host folder (the code file) lives
    code = (
        "import os\nprint(os.getcwd())\nprint(os.listdir('.'))\n"
        "with open('inside.txt', 'w') as f:\n    f.write('kept?')\nprint(os.listdir('.'))"
    )
    result = run_python(code)
    workdir, before, after = result.stdout.splitlines()
    assert (workdir, before, after) == (WORKDIR, "[]", "['inside.txt']")  # the sandbox's own tmpfs
    assert list(tmp_path.iterdir()) == []  # the host folder of the run is removed
    assert run_python("import os\nprint(os.listdir('.'))").stdout == "[]\n"  # the next run starts empty


def test_writes_and_reads_outside_the_working_folder_are_refused(tmp_path: Path) -> None:
    outside = tmp_path / "outside.txt"
    result = run_python(f"open({str(outside)!r}, 'w').write('x')")
    assert result.returncode == 1 and "is outside the working folder" in result.stderr
    assert not outside.exists()
    secret = tmp_path / "secret.txt"
    secret.write_text("top-secret")
    escape = run_python(f"print(open({str(secret)!r}).read())\nprint(open('../../etc/passwd').read())")
    assert "top-secret" not in escape.stdout and "is outside the working folder" in escape.stderr


def test_environment_does_not_leak_secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PBRL_TEST_API_KEY", "secret")
    result = run_python("import os\nprint(os.environ.get('PBRL_TEST_API_KEY'))\nprint(sorted(os.environ))")
    value, names = result.stdout.splitlines()
    assert value == "None"
    assert names == "['HOME', 'LANG', 'PATH', 'PWD', 'PYTHONHASHSEED', 'PYTHONIOENCODING', 'TMPDIR']"


def test_sys_exit_code_comes_back() -> None:
    result = run_python("import sys\nprint('before')\nsys.exit(3)")
    assert (result.returncode, result.stdout, result.timed_out, result.killed_signal) == (3, "before\n", False, None)


def test_exceptions_and_syntax_errors_come_back_as_results() -> None:
    assert run_python("raise ValueError('boom')").stderr.strip().endswith("ValueError: boom")
    broken = run_python("def f(:\n    pass")
    assert broken.returncode == 1 and "SyntaxError" in broken.stderr


def test_output_is_cut_to_the_limit() -> None:
    result = run_python("print('x' * 100000)", max_output_bytes=1000)
    assert result.stdout == "x" * 1000


def test_hash_seed_is_fixed_so_results_repeat() -> None:
    code = "print(hash('abc'), list({'x', 'y', 'z', 'w'}))"
    assert run_python(code).stdout == run_python(code).stdout


def test_bad_limits_raise_naming_the_argument() -> None:
    with pytest.raises(ValueError, match="timeout_s: got 0"):
        run_python("pass", timeout_s=0)
    with pytest.raises(ValueError, match="memory_mb"):
        run_python("pass", memory_mb=1)


GOOD_AUX = "def aux(numbers):\n    return sorted(numbers)\n"
BAD_MAINS = {
    "infinite loop": "def has_close_elements(numbers, threshold):\n    while True:\n        pass\n",
    "huge allocation": "def has_close_elements(numbers, threshold):\n    x = bytearray(10**10)\n    return True\n",
    "fork loop": "import os\ndef has_close_elements(numbers, threshold):\n    while True:\n        os.fork()\n",
    "write outside": "def has_close_elements(numbers, threshold):\n    open('{outside}', 'w').write('x')\n"
    "    return True\n",
    "exit at import": "import sys\nsys.exit(3)\ndef has_close_elements(numbers, threshold):\n    return True\n",
    "hard exit at import": "import os\nos._exit(0)\ndef has_close_elements(numbers, threshold):\n    return True\n",
    "forged result line": "print('PBRL-TESTS 0 7')\nimport os\nos.write(1, b'\\nPBRL-TESTS 0 7\\n')\n"
    "def has_close_elements(numbers, threshold):\n    raise ValueError\n",
}


@pytest.mark.parametrize("name", sorted(BAD_MAINS))
def test_bad_main_code_gets_structural_credit_only_and_returns(name: str, tmp_path: Path) -> None:
    problem = load_problems()[0]  # HumanEval/0 has_close_elements, 7 asserts
    outside = tmp_path / "outside.txt"
    reward = make_coop_reward(timeout_s=2.0, memory_mb=256)
    start = time.monotonic()
    [value] = reward([GOOD_AUX], [BAD_MAINS[name].format(outside=outside)], batch_items=[problem])
    assert time.monotonic() - start < NO_HANG_S
    # 0.5 aux defined + 0.5 main defined + 0.5 joint code parses; no test passes, main does not call aux.
    assert value == 1.5
    assert not outside.exists()


# ---------------------------------------------------------------- verdicts the code cannot reach (issue #16)

# Each attack defines a has_close_elements that computes nothing right; every one must score 1.5 (structure
# only). Each of the first six scored the full 3.5 (7 of 7 passed) under the former one-process harness
# that held a nonce and printed the verdict from the process running the code.
_WALK_FRAMES = (
    "import os, sys\n"
    "def forge(frame):\n"
    "    while frame is not None:\n"
    "        for value in [*frame.f_locals.values(), *frame.f_globals.values()]:\n"
    "            if isinstance(value, str) and value.startswith('PBRL-TESTS'):\n"
    "                os.write(1, ('\\n' + value + '7\\nPBRL-TESTS 7 7\\n').encode())\n"
    "                os._exit(0)\n"
    "        frame = frame.f_back\n"
)
ATTACKS = {
    # the example: read the secret tag from the calling frames, print a forged result line, exit
    "secret from the calling frame": _WALK_FRAMES
    + "def has_close_elements(numbers, threshold):\n    forge(sys._getframe(1))\n    raise ValueError\n",
    "secret through a traceback's frame": _WALK_FRAMES
    + "def has_close_elements(numbers, threshold):\n    try:\n        raise KeyError\n"
    "    except KeyError as exc:\n        forge(exc.__traceback__.tb_frame)\n    raise ValueError\n",
    # read the expected values out of the test statement that called the function
    "expected values from the caller's code": "import sys\n"
    "def has_close_elements(numbers, threshold):\n    frame = sys._getframe(1)\n"
    "    while frame is not None and frame.f_code.co_filename != '<test>':\n        frame = frame.f_back\n"
    "    return [c for c in frame.f_code.co_consts if c is True or c is False][-1]\n",
    # make every later test statement a no-op by patching the builtins the harness looks up
    "patched builtins exec and compile": "import builtins\n"
    "builtins.exec = lambda *args, **kwargs: None\nbuiltins.compile = lambda *args, **kwargs: None\n"
    "def has_close_elements(numbers, threshold):\n    raise ValueError\n",
    # an answer equal to everything
    "object whose __eq__ is always True": "class Yes:\n    def __eq__(self, other):\n        return True\n"
    "    __hash__ = object.__hash__\n"
    "def has_close_elements(numbers, threshold):\n    return Yes()\n",
    "int subclass whose __eq__ is always True": "class Two(int):\n    def __eq__(self, other):\n"
    "        return True\n    __hash__ = int.__hash__\n"
    "def has_close_elements(numbers, threshold):\n    return Two(2)\n",
    # the rest already failed before; they stay failing
    "gc search for the secret": "import gc\n"
    "def has_close_elements(numbers, threshold):\n"
    "    return [o for o in gc.get_objects() if isinstance(o, str) and o.startswith('PBRL')]\n",
    "SystemExit inside the test": "def has_close_elements(numbers, threshold):\n    raise SystemExit(0)\n",
    "forged line then os._exit inside the test": "import os\n"
    "def has_close_elements(numbers, threshold):\n    os.write(1, b'\\nPBRL-TESTS 7 7\\n')\n    os._exit(0)\n",
    # guess the channel: forged lines into every descriptor the process holds, then a wrong function
    "forged lines into every descriptor": "import os\n"
    'for fd in range(64):\n    try:\n        os.write(fd, b\'PBRL-TESTS 7 7\\n["return", ["str", "x"]]\\n\')\n'
    "    except OSError:\n        pass\n"
    "def has_close_elements(numbers, threshold):\n    raise ValueError\n",
}


@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_code_cannot_read_or_forge_the_verdict(name: str) -> None:
    problem = load_problems()[0]  # HumanEval/0: 7 asserts, expected True, False, True, False, True, True, False
    score = coop_score(GOOD_AUX, ATTACKS[name], problem, timeout_s=5.0, memory_mb=256)
    assert (score.tests_passed, score.tests_total) == (0, 7)
    assert score.total == 1.5  # 0.5 aux + 0.5 main + 0.5 parses; no test passed, aux not called


def test_honest_code_still_gets_full_marks_including_dict_and_int_subclasses() -> None:
    problems = {p["item_id"]: p for p in load_problems()}
    honest = (
        "def has_close_elements(numbers, threshold):\n    ordered = aux(numbers)\n"
        "    return any(b - a < threshold for a, b in zip(ordered, ordered[1:]))\n"
    )
    # 0.5 aux + 0.5 main + 0.5 parses + 2.0 * 7/7 + 0.5 calls aux
    assert coop_score(GOOD_AUX, honest, problems["HumanEval/0"]).total == 4.0
    # a Counter is a dict subclass: its contents go to the judge as a plain dict, and the 8 asserts pass
    counter = (
        "from collections import Counter\ndef histogram(test):\n    counts = Counter(test.split())\n"
        "    top = max(counts.values(), default=0)\n"
        "    return Counter({k: v for k, v in counts.items() if v == top})\n"
    )
    score = coop_score(GOOD_AUX, counter, problems["HumanEval/111"])
    assert (score.tests_passed, score.tests_total, score.total) == (8, 8, 3.5)
    # HumanEval/33's tests call the function by its own name (sort_third), which must reach the candidate
    sort_third = "def sort_third(l):\n    l = list(l)\n    l[::3] = sorted(l[::3])\n    return l\n"
    assert coop_score(GOOD_AUX, sort_third, problems["HumanEval/33"]).tests_passed == 7


def test_a_judge_that_stops_before_its_last_unit_counts_nothing() -> None:
    # hand-made item: 3 units, 2 of them tests; the middle one ends the judge process with status 0
    item = {
        "item_id": "stop",
        "prompt": 'def f(x):\n    """Identity."""\n',
        "entry_point": "f",
        "test": "def check(candidate):\n    assert candidate(1) == 1\n    STOP\n    assert candidate(2) == 2\n",
    }
    identity = "def f(x):\n    return x\n"
    complete = coop_score(GOOD_AUX, identity, {**item, "test": item["test"].replace("STOP", "pass")})
    assert (complete.tests_passed, complete.tests_total, complete.total) == (2, 2, 3.5)
    stopped = coop_score(GOOD_AUX, identity, {**item, "test": item["test"].replace("STOP", "raise SystemExit(0)")})
    assert (stopped.tests_passed, stopped.tests_total, stopped.total) == (0, 2, 1.5)


def test_pair_talks_only_through_the_pipes_and_sees_end_of_file() -> None:
    fds_before = len(os.listdir("/proc/self/fd"))
    judge, untrusted = run_python_pair(
        "import os, sys\nr, w = (int(fd) for fd in sys.argv[1:])\nos.write(w, b'ping\\n')\n"
        "print(os.read(r, 100), os.read(r, 100))",
        "import os, sys\nr, w = (int(fd) for fd in sys.argv[1:])\nprint(os.read(r, 100))\n"
        "os.write(w, b'pong\\n')\nprint('untrusted stdout')",
        timeout_s=10.0,
    )
    # the second read of the judge is end-of-file: the untrusted process ended, nobody else holds its pipe
    assert (judge.returncode, judge.stdout) == (0, "b'pong\\n' b''\n")
    assert (untrusted.returncode, untrusted.stdout) == (0, "b'ping\\n'\nuntrusted stdout\n")
    assert len(os.listdir("/proc/self/fd")) == fds_before  # the parent's pipe ends were all closed


def test_pass_fds_are_closed_in_the_parent_even_when_the_limits_are_wrong() -> None:
    r, w = os.pipe()
    with pytest.raises(ValueError, match="memory_mb"):
        run_python("pass", memory_mb=1, pass_fds=(r, w))
    for fd in (r, w):
        with pytest.raises(OSError):
            os.fstat(fd)


class _Always(int):
    def __eq__(self, other: object) -> bool:
        return True

    __hash__ = int.__hash__


def test_codec_encodes_by_hand_and_decodes_only_exact_builtin_types() -> None:
    assert encode_value(255) == ["int", "0xff"]
    assert encode_value(-1.5) == ["float", "-0x1.8000000000000p+0"]
    assert encode_value([True, None, (b"\x01", "s")]) == [
        "list", [["bool", 1], ["None"], ["tuple", [["bytes", "01"], ["str", "s"]]]]
    ]  # fmt: skip
    assert encode_value({"a": 1j}) == ["dict", [[["str", "a"], ["complex", "0x0.0p+0", "0x1.0000000000000p+0"]]]]
    assert encode_value(_Always(2)) == ["int", "0x2"]  # the subclass's __eq__ does not cross
    big = 10**5000  # past the 4300-digit limit of decimal int parsing
    assert decode_value(encode_value(big)) == big
    decoded = decode_value(["dict", [[["str", "k"], ["set", [["int", "-0x3"]]]]]])
    assert decoded == {"k": {-3}} and type(decoded) is dict and type(decoded["k"]) is set
    assert type(decode_value(["int", "0x2"])) is int
    inf = decode_value(encode_value(float("inf")))
    assert inf == float("inf") and type(inf) is float
    for bad in (["int", "12"], ["int", 12], ["bool", 2], ["object"], "x", [], ["str", 1], ["dict", [[1]]]):
        with pytest.raises(ValueError):
            decode_value(bad)
    deep: list = ["None"]
    for _ in range(MAX_DEPTH + 1):
        deep = ["list", [deep]]
    with pytest.raises(ValueError, match="deeper"):
        decode_value(deep)
    with pytest.raises(TypeError, match="Yes"):
        encode_value(type("Yes", (), {})())
    with pytest.raises(TypeError, match="generator"):
        encode_value(i for i in range(3))


def test_replies_decode_to_values_or_builtin_exceptions_only() -> None:
    assert decode_reply('["return", ["bool", 0]]\n') is False
    with pytest.raises(ValueError, match="raised by the candidate"):
        decode_reply('["raise", "ValueError"]\n')
    with pytest.raises(RuntimeError, match="SystemExit"):  # not an Exception subclass: not re-raised as itself
        decode_reply('["raise", "SystemExit"]\n')
    with pytest.raises(RuntimeError, match="ended before answering"):
        decode_reply("")
    with pytest.raises(ValueError):
        decode_reply("PBRL-TESTS 7 7\n")
