"""``humaneval_coop``: agent 1 writes a helper function ``aux``, agent 2 the problem's entry-point function,
which may call ``aux``. The joint code is tested in the sandbox (:mod:`pbrl.sandbox.runner`), by a judge process
that never runs it (:func:`run_tests`), so the code cannot read or forge the verdict.

Reward in [0, 4] with partial credit for structure (:func:`coop_score`); the task itself (items, split)
is registered in :mod:`pbrl.tasks.humaneval`. ``pbrl.tasks.humaneval_coop:coop_reward`` is the reward with
the default limits, for users who build their own task. Source of the scheme: the reference's coding reward
(``execution_reward_aux`` in OpenMLRL/LLM_Collab_Code_Generation), with the tests run out of process.
"""

from __future__ import annotations

import ast
import functools
import os
import re
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pbrl.errors import ConfigError, Problem
from pbrl.sandbox.isolation import isolation
from pbrl.sandbox.runner import UNSAFE_OPTION, run_python_pair
from pbrl.tasks import humaneval_coop_harness
from pbrl.tasks.base import RewardFunc, Task
from pbrl.tasks.humaneval import check_two_agent_batch, item_field, split_problems
from pbrl.tasks.humaneval_coop_harness import RESULT_TAG

AUX_NAME = "aux"
REWARD_RANGE = (0.0, 4.0)
STRUCTURE_CREDIT = 0.5
TESTS_CREDIT = 2.0
_FENCE = re.compile(r"```[^\n`]*\n(.*?)(?:```|\Z)", re.DOTALL)


def aux_prompt(item: dict[str, Any]) -> str:
    """Agent 1's prompt: write only a helper function named ``aux`` useful for the problem."""
    return (
        f"Write a helper function named `{AUX_NAME}` in Python that would be useful for implementing the "
        f"function `{item_field(item, 'entry_point')}` described below. Output only the code of "
        f"`{AUX_NAME}` (with the imports it needs); no tests, no explanation.\n\n"
        f"```python\n{item_field(item, 'prompt')}```\n"
    )


def main_prompt(item: dict[str, Any]) -> str:
    """Agent 2's prompt: implement the entry-point function, which may call the teammate's ``aux``."""
    entry_point = item_field(item, "entry_point")
    return (
        f"Implement the Python function `{entry_point}` described below. A teammate writes a helper "
        f"function `{AUX_NAME}` for this problem; you may call it. Output only the complete code of "
        f"`{entry_point}` (signature and body); do not define `{AUX_NAME}`, no tests, no explanation.\n\n"
        f"```python\n{item_field(item, 'prompt')}```\n"
    )


def strip_fences(text: str) -> str:
    """The code inside Markdown fences: all fenced blocks joined by a newline (an unclosed fence runs to
    the end, as in a cut-off generation); the text itself when it has no fence."""
    blocks = _FENCE.findall(text)
    return "\n".join(blocks) if blocks else text


def problem_preamble(item: dict[str, Any]) -> str:
    """``item["prompt"]`` without the entry-point function: its imports and the helper functions some
    problems define (``poly`` in HumanEval/32), which the joint code and the tests need.

    Raises:
        ValueError: the prompt does not parse (names the item).
    """
    prompt = item_field(item, "prompt")
    entry_point = item_field(item, "entry_point")
    try:
        module = ast.parse(prompt)
    except SyntaxError as exc:
        raise ValueError(f"item {item.get('item_id')!r}: field 'prompt' does not parse: {exc}") from exc
    lines = prompt.splitlines(keepends=True)
    for node in module.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == entry_point:
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)]) - 1
            del lines[first : node.end_lineno]
    return "".join(lines)


def code_parses(code: str) -> bool:
    """True when ``code`` is valid Python source."""
    try:
        ast.parse(code)
    except (SyntaxError, ValueError):  # ValueError: source with NUL bytes
        return False
    return True


def find_function(code: str, name: str) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    """The top-level function ``name`` of ``code``; None when the code does not parse or lacks it."""
    try:
        module = ast.parse(code)
    except (SyntaxError, ValueError):  # ValueError: source with NUL bytes
        return None
    found = None
    for node in module.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name:
            found = node  # the last definition is the one that counts at run time
    return found


def returns_value(function: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """True when the function body has a ``return <value>``."""
    return any(isinstance(n, ast.Return) and n.value is not None for n in ast.walk(function))


def calls_name(function: ast.FunctionDef | ast.AsyncFunctionDef, name: str) -> bool:
    """True when the function body calls ``name(...)`` (a plain name, nested functions included)."""
    return any(
        isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == name for n in ast.walk(function)
    )


def check_units(test_source: str) -> list[tuple[str, bool]]:
    """The statements of ``check(candidate)`` in ``test_source``, each as (source, counts_as_test).

    A statement counts as a test when it contains an ``assert`` and uses ``candidate`` (``assert True``
    does not); the other statements (imports, setup assignments) run in order but score nothing.

    Raises:
        ValueError: the source does not parse or has no top-level ``check`` function.
    """
    check = find_function(test_source, "check")
    if check is None:
        raise ValueError("test: the source does not parse or defines no function 'check'")
    units = []
    for statement in check.body:
        nodes = list(ast.walk(statement))
        is_test = any(isinstance(n, ast.Assert) for n in nodes) and any(
            isinstance(n, ast.Name) and n.id == "candidate" for n in nodes
        )
        units.append((ast.unparse(statement), is_test))
    return units


@dataclass(frozen=True)
class CoopScore:
    """The parts of one joint response's ``humaneval_coop`` reward (see :func:`coop_score`)."""

    aux_defined: bool
    main_defined: bool
    parses: bool
    tests_passed: int
    tests_total: int
    calls_aux: bool

    @property
    def total(self) -> float:
        """0.5 aux + 0.5 main + 0.5 parses + 2.0 * passed/total + 0.5 (calls aux and >= 1 test passed)."""
        share = self.tests_passed / self.tests_total if self.tests_total else 0.0
        structure = sum((self.aux_defined, self.main_defined, self.parses)) * STRUCTURE_CREDIT
        cooperation = STRUCTURE_CREDIT if self.calls_aux and self.tests_passed > 0 else 0.0
        return structure + TESTS_CREDIT * share + cooperation


def coop_score(
    aux_completion: str, main_completion: str, item: dict[str, Any], *, timeout_s: float = 10.0,
    memory_mb: int = 512, unisolated: bool = False,
) -> CoopScore:  # fmt: skip
    """Score one joint response of ``humaneval_coop`` (both completions are fence-stripped first).

    Parts (reward = ``CoopScore.total``, in [0, 4]):
        +0.5 agent 1's code defines a top-level ``aux`` with a ``return <value>``;
        +0.5 agent 2's code defines a top-level ``item["entry_point"]`` function;
        +0.5 the joint code (problem preamble + agent 1 + agent 2) parses;
        +2.0 x share of the problem's tests passed (:func:`run_tests`, two sandboxed processes); only when
             the joint code parses and agent 2 defined the function; a timeout, or a judge that never
             reports, gives 0;
        +0.5 agent 2's function calls ``aux``, agent 2 does not define its own ``aux``, and >= 1 test passed.

    The joint code runs with ``__name__ != "__main__"`` (so example blocks under that guard are skipped)
    and its prints are discarded. ``unisolated``: see :func:`pbrl.sandbox.runner.run_python`.
    """
    aux_code, main_code = strip_fences(aux_completion), strip_fences(main_completion)
    entry_point = item_field(item, "entry_point")
    aux = find_function(aux_code, AUX_NAME)
    main = find_function(main_code, entry_point)
    joint = "\n\n".join((problem_preamble(item), aux_code, main_code))
    parses = code_parses(joint)
    test_source = item_field(item, "test")
    units = check_units(test_source)
    total = sum(is_test for _, is_test in units)
    passed = 0
    if parses and main is not None:
        passed = run_tests(
            joint,
            problem_preamble(item),
            test_source,
            units,
            entry_point,
            timeout_s=timeout_s,
            memory_mb=memory_mb,
            unisolated=unisolated,
        )
    return CoopScore(
        aux_defined=aux is not None and returns_value(aux),
        main_defined=main is not None,
        parses=parses,
        tests_passed=min(passed, total),
        tests_total=total,
        calls_aux=main is not None and calls_name(main, AUX_NAME) and find_function(main_code, AUX_NAME) is None,
    )


def run_tests(
    program: str, preamble: str, test_source: str, units: Sequence[tuple[str, bool]], entry_point: str, *,
    timeout_s: float, memory_mb: int, unisolated: bool = False,
) -> int:  # fmt: skip
    """Run the test units against ``program``'s ``entry_point``; return the number of test units passed.

    Two sandboxed processes (:func:`pbrl.sandbox.runner.run_python_pair`, :mod:`pbrl.tasks.humaneval_coop_harness`):
    the candidate process runs ``program`` and answers calls; the judge process runs ``preamble``, the
    tests and each unit, calling the candidate through a pipe and comparing exact built-in values. The
    candidate process never holds a secret, the tests or the verdict, so it cannot read or forge the result
    (printing a result line, exiting, patching builtins, ``__eq__`` tricks all fail their units). The count
    is the judge's only when the judge exited with status 0 within the time limit and its last line reports
    every unit as ended; otherwise (timeout, crash): 0.
    """
    judge, _candidate = run_python_pair(
        judge_source(preamble, test_source, units, entry_point), candidate_source(program, entry_point),
        timeout_s=timeout_s, memory_mb=memory_mb, unisolated=unisolated,
    )  # fmt: skip
    if judge.timed_out or judge.returncode != 0:
        return 0
    lines = judge.stdout.splitlines()
    fields = lines[-1].split(" ") if lines else []
    if len(fields) != 3 or fields[0] != RESULT_TAG or not all(f.isdigit() for f in fields[1:]):
        return 0
    passed, ended = int(fields[1]), int(fields[2])
    return passed if ended == len(units) else 0


def judge_source(preamble: str, test_source: str, units: Sequence[tuple[str, bool]], entry_point: str) -> str:
    """The judge process's Python source (trusted code only; all inputs embedded as literals)."""
    call = f"run_judge({preamble!r}, {test_source!r}, {[(s, bool(t)) for s, t in units]!r}, {entry_point!r})"
    return f"{_harness_text()}\n\n{call}\n"


def candidate_source(program: str, entry_point: str) -> str:
    """The candidate process's Python source: the harness, then ``serve_candidate`` on the joint code."""
    return f"{_harness_text()}\n\nserve_candidate({program!r}, {entry_point!r})\n"


@functools.cache
def _harness_text() -> str:
    return Path(humaneval_coop_harness.__file__).read_text(encoding="utf-8")


def make_coop_reward(
    *, timeout_s: float = 10.0, memory_mb: int = 512, max_workers: int = 1, unisolated: bool = False
) -> RewardFunc:
    """A ``humaneval_coop`` reward function with these sandbox limits, running ``max_workers`` at once.

    The function: ``(aux_completions, main_completions, *, prompts=None, batch_items) -> list[float]``,
    one :func:`coop_score` total per joint response. Raises ValueError when ``batch_items`` is missing
    or the lists differ in length.
    """

    def coop_reward(
        aux_completions: Sequence[str],
        main_completions: Sequence[str],
        *,
        prompts: Sequence[Sequence[str]] | None = None,
        batch_items: Sequence[dict[str, Any]] | None = None,
    ) -> list[float]:
        items = check_two_agent_batch(aux_completions, main_completions, batch_items)

        def score(j: int) -> float:
            return coop_score(
                aux_completions[j],
                main_completions[j],
                items[j],
                timeout_s=timeout_s,
                memory_mb=memory_mb,
                unisolated=unisolated,
            ).total

        if max_workers <= 1 or len(items) <= 1:
            return [score(j) for j in range(len(items))]
        with ThreadPoolExecutor(max_workers=max_workers) as pool:
            return list(pool.map(score, range(len(items))))

    return coop_reward


coop_reward = make_coop_reward()


def humaneval_coop_task(
    num_train_items: int | None = None,
    num_eval_items: int | None = None,
    timeout_s: float = 10.0,
    memory_mb: int = 512,
    max_workers: int | None = None,
    unsafe_run_untrusted_code_without_isolation: bool = False,
) -> Task:
    """Agent 1 writes a helper ``aux``, agent 2 the entry-point function; reward in [0, 4] from structure
    and the problem's tests run in the sandbox (:func:`pbrl.tasks.humaneval_coop.coop_score`).

    ``timeout_s`` / ``memory_mb`` limit each joint response's sandboxed test run; ``max_workers`` runs
    that many sandboxes at once (default ``min(4, cpu count)``). The tests run model-written code, which needs
    operating-system isolation (bubblewrap, :mod:`pbrl.sandbox.isolation`): where it is not available the task
    refuses to start, unless ``unsafe_run_untrusted_code_without_isolation`` is true (then the code runs in a
    plain limited process: only for trusted models on a throw-away machine).

    Raises:
        ConfigError: an option is out of range, or isolation is unavailable and the unsafe option is not set.
    """
    problems = []
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or not timeout_s > 0:
        problems.append(Problem("timeout_s", timeout_s, "must be a number of seconds > 0"))
    if isinstance(memory_mb, bool) or not isinstance(memory_mb, int) or memory_mb < 32:
        problems.append(Problem("memory_mb", memory_mb, "must be an int >= 32 (MiB)"))
    if max_workers is not None and (isinstance(max_workers, bool) or not isinstance(max_workers, int)
                                    or max_workers < 1):  # fmt: skip
        problems.append(Problem("max_workers", max_workers, "must be None or an int >= 1"))
    unsafe = unsafe_run_untrusted_code_without_isolation
    if not isinstance(unsafe, bool):
        problems.append(Problem(UNSAFE_OPTION, unsafe, "must be true or false"))
    elif not unsafe and not (state := isolation()).available:
        problems.append(
            Problem(
                "task",
                "humaneval_coop",
                f"runs model-written code, which needs operating-system "
                f"isolation, and {state.reason}; install bubblewrap, or set task_options: "
                f"{{{UNSAFE_OPTION}: true}} to run it without isolation (unsafe)",
            )
        )
    try:
        train, evaluation = split_problems(num_train_items, num_eval_items)
    except ConfigError as exc:
        problems = exc.problems + problems
    if problems:
        raise ConfigError(problems)
    workers = max_workers if max_workers is not None else min(4, os.cpu_count() or 1)
    return Task(
        name="humaneval_coop",
        formatters=(aux_prompt, main_prompt),
        reward_func=make_coop_reward(
            timeout_s=float(timeout_s), memory_mb=memory_mb, max_workers=workers, unisolated=unsafe is True
        ),
        train_items=train,
        eval_items=evaluation,
        reward_range=REWARD_RANGE,
    )
