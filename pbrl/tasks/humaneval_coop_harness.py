"""The two programs that test ``humaneval_coop`` joint code, and the value codec between them.

This file is sent whole as the source of two sandboxed processes (:func:`pbrl.sandbox.runner.run_python_pair`),
with one call line appended, so it uses only the standard library. :mod:`pbrl.tasks.humaneval_coop` also
imports it to build those sources; the codec is tested in the parent.

* The **candidate** process (:func:`serve_candidate`) runs the untrusted joint code and then answers calls:
  it reads ``["call", args, kwargs]`` lines, calls the entry-point function, and writes
  ``["return", value]`` or ``["raise", exception name]``. It never sees the tests, their expected values
  or any secret, so there is nothing in it to read or forge: whatever it writes is only a claim of what
  the function returned.
* The **judge** process (:func:`run_judge`) never runs candidate code. It runs the problem's preamble and
  tests with ``candidate`` bound to a proxy that sends each call's arguments through the pipe and decodes
  the answer with :func:`decode_value` into *exact* built-in types (no subclass, no user class), so every
  comparison, ``abs``, ``len`` and ``==`` in the tests runs built-in code. A unit counts as passed only when
  its statement ran to its end. The judge's last stdout line is ``PBRL-TESTS <passed> <ran>``; stdout is a
  channel only the judge and the trusted parent hold.

The codec: a value is a JSON list ``[tag, ...]``: ``["None"]``, ``["bool", 0|1]``, ``["int", hex]`` (hex
avoids the 4300-digit limit of decimal ``int`` parsing), ``["float", float.hex()]`` (exact, inf and nan
included), ``["complex", re_hex, im_hex]``, ``["str", s]``, ``["bytes", hex]``, ``["list"|"tuple"|"set"|
"frozenset", [items]]``, ``["dict", [[key, value], ...]]``. The candidate side encodes leniently (a
``Counter`` or ``namedtuple`` becomes its plain ``dict``/``tuple`` contents, read with the base type's own
methods so an overridden ``__iter__`` or ``__eq__`` plays no part); the judge side decodes strictly.

What this does not defend against: answers that are right without working code (memorised, or guessed
where a problem's tests are weak, e.g. a constant ``True`` passes HumanEval/0's four ``== True`` asserts);
answers that depend on state kept between calls (allowed, as in one-process testing); slow answers (the
judge times out and the score is 0); escapes from the interpreter itself (see :mod:`pbrl.sandbox.runner`).
"""

from __future__ import annotations

import builtins
import json
import os
import re
import sys
from typing import Any

RESULT_TAG = "PBRL-TESTS"
MAX_DEPTH = 100  # nesting levels a value may have (deeper: not a test answer, and it bounds recursion)
_HEX_INT = re.compile(r"-?0x[0-9a-f]+")
_CONTAINERS: dict[str, type] = {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset}


def encode_value(value: Any, depth: int = 0) -> list[Any]:
    """``value`` as a JSON-able tagged list (module docstring); subclasses of built-in types become their
    base type's contents.

    Raises:
        TypeError: a value of another type (a generator, a user class, a function) or nesting beyond
            ``MAX_DEPTH``.
    """
    if depth > MAX_DEPTH:
        raise TypeError(f"value nested deeper than {MAX_DEPTH} levels")
    if value is None:
        return ["None"]
    if isinstance(value, bool):
        return ["bool", 1 if value is True else 0]
    if isinstance(value, int):
        return ["int", hex(int.__int__(value))]
    if isinstance(value, float):
        return ["float", float.hex(float.__float__(value))]
    if isinstance(value, complex):
        return ["complex", float.hex(complex.real.__get__(value)), float.hex(complex.imag.__get__(value))]
    if isinstance(value, str):
        return ["str", str.__str__(value)]
    if isinstance(value, bytes | bytearray):
        return ["bytes", bytes.hex(bytes(memoryview(value)))]
    if isinstance(value, dict):
        return ["dict", [[encode_value(k, depth + 1), encode_value(v, depth + 1)] for k, v in dict.items(value)]]
    for tag, kind in _CONTAINERS.items():
        if isinstance(value, kind):
            return [tag, [encode_value(item, depth + 1) for item in kind.__iter__(value)]]
    raise TypeError(f"a value of type {type(value).__name__} cannot be sent to the judge")


def decode_value(data: Any, depth: int = 0) -> Any:  # noqa: C901 (one flat branch per encoded type)
    """The value that :func:`encode_value` encoded, built only from exact built-in types.

    Raises:
        ValueError: ``data`` is not a well-formed encoding (unknown tag, wrong field type, too deep).
        TypeError: a set element or dict key is unhashable (a list).
    """
    if depth > MAX_DEPTH:
        raise ValueError(f"value nested deeper than {MAX_DEPTH} levels")
    if type(data) is not list or not data or type(data[0]) is not str:
        raise ValueError(f"not an encoded value: {data!r:.80}")
    tag, fields = data[0], data[1:]
    if tag == "None" and not fields:
        return None
    if tag == "bool" and len(fields) == 1 and type(fields[0]) is int and fields[0] in (0, 1):
        return fields[0] == 1
    if tag == "int" and len(fields) == 1 and type(fields[0]) is str and _HEX_INT.fullmatch(fields[0]):
        return int(fields[0], 16)
    if tag == "float" and len(fields) == 1 and type(fields[0]) is str:
        return float.fromhex(fields[0])
    if tag == "complex" and len(fields) == 2 and all(type(f) is str for f in fields):
        return complex(float.fromhex(fields[0]), float.fromhex(fields[1]))
    if tag == "str" and len(fields) == 1 and type(fields[0]) is str:
        return fields[0]
    if tag == "bytes" and len(fields) == 1 and type(fields[0]) is str:
        return bytes.fromhex(fields[0])
    if tag in _CONTAINERS and len(fields) == 1 and type(fields[0]) is list:
        return _CONTAINERS[tag](decode_value(item, depth + 1) for item in fields[0])
    if tag == "dict" and len(fields) == 1 and type(fields[0]) is list:
        pairs = fields[0]
        if not all(type(pair) is list and len(pair) == 2 for pair in pairs):
            raise ValueError("dict: every entry must be a [key, value] pair")
        return {decode_value(k, depth + 1): decode_value(v, depth + 1) for k, v in pairs}
    raise ValueError(f"not an encoded value: {data!r:.80}")


def decode_reply(line: str) -> Any:
    """The candidate's answer to one call: the returned value, or the exception it raised, raised here.

    An exception is re-raised as the built-in ``Exception`` subclass of that name (``ValueError``), any
    other name as ``RuntimeError``; an empty line (the candidate process ended) or a malformed one raises
    ``RuntimeError``/``ValueError``.
    """
    if not line:
        raise RuntimeError("the candidate process ended before answering")
    reply = json.loads(line)
    if type(reply) is list and len(reply) == 2 and reply[0] == "return":
        return decode_value(reply[1])
    if type(reply) is list and len(reply) == 2 and reply[0] == "raise" and type(reply[1]) is str:
        kind = getattr(builtins, reply[1], None)
        if isinstance(kind, type) and issubclass(kind, Exception):
            raise kind("raised by the candidate")
        raise RuntimeError(f"the candidate raised {reply[1]:.80}")
    raise ValueError(f"not a reply: {line:.80}")


def serve_candidate(program: str, entry_point: str) -> None:  # pragma: no cover - runs in the sandbox
    """Candidate process: run ``program`` (untrusted), then answer calls of ``entry_point`` until end-of-file.

    ``sys.argv[1]`` / ``sys.argv[2]``: descriptors to read calls from / write answers to. The program's
    prints are discarded; it runs with ``__name__ == "candidate"``.
    """
    reader = os.fdopen(int(sys.argv[1]), "r", encoding="utf-8", newline="\n")
    writer = os.fdopen(int(sys.argv[2]), "w", encoding="utf-8", newline="\n")
    sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the process
    namespace = {"__name__": "candidate", "__builtins__": builtins}
    exec(compile(program, "<joint code>", "exec"), namespace)  # noqa: S102 - running it is the point
    function = namespace[entry_point]
    for line in reader:
        _, args, kwargs = json.loads(line)
        try:
            reply = ["return", encode_value(function(*decode_value(args), **decode_value(kwargs)))]
        except Exception as exc:  # the candidate's own error is its answer; anything else ends the process
            reply = ["raise", type(exc).__name__]
        writer.write(json.dumps(reply) + "\n")
        writer.flush()


def run_judge(  # pragma: no cover - runs in the sandbox
    preamble: str, tests: str, units: list[tuple[str, bool]], entry_point: str
) -> None:
    """Judge process: run the trusted ``preamble`` and ``tests``, then each unit with the proxy bound to
    ``candidate`` and to ``entry_point`` (HumanEval/33's tests call the function by its own name).

    ``sys.argv[1]`` / ``sys.argv[2]``: descriptors to read answers from / write calls to. Prints
    ``PBRL-TESTS <passed> <ran>`` last; ``passed`` counts the units that count as tests and ran to their end
    without an exception, ``ran`` the units that ended, passed or failed (all of them, unless the process died).
    """
    reader = os.fdopen(int(sys.argv[1]), "r", encoding="utf-8", newline="\n")
    writer = os.fdopen(int(sys.argv[2]), "w", encoding="utf-8", newline="\n")

    def candidate(*args: Any, **kwargs: Any) -> Any:
        writer.write(json.dumps(["call", encode_value(args), encode_value(kwargs)]) + "\n")
        writer.flush()
        return decode_reply(reader.readline())

    stdout, sys.stdout = sys.stdout, open(os.devnull, "w")  # noqa: SIM115 - the tests' prints are dropped
    namespace: dict[str, Any] = {"__name__": "tests", "__builtins__": builtins}
    exec(compile(preamble, "<preamble>", "exec"), namespace)  # noqa: S102 - the problem's own code
    exec(compile(tests, "<tests>", "exec"), namespace)  # noqa: S102
    namespace["candidate"] = namespace[entry_point] = candidate
    passed = ran = 0
    for source, counts in units:
        try:
            exec(compile(source, "<test>", "exec"), namespace)  # noqa: S102
            passed += bool(counts)
        except Exception:
            pass
        ran += 1
    try:
        writer.close()  # the candidate process reads end-of-file and ends
    except OSError:
        pass
    stdout.write(f"\n{RESULT_TAG} {passed} {ran}\n")
    stdout.flush()
