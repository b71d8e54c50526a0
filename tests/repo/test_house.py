"""The shape of the house (issue #28, docs/design/architecture.md): modules a newcomer can read, long functions
that say why they are long, and a design the code cites from ``docs/``, not from outside the repository.

The layer contracts themselves are import-linter's (``lint-imports`` in ``make test``); these checks cover what it
cannot see.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("pbrl", "stages", "flows")
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60
WHY = "# Over 60 lines"  # the comment right above a long function (or its decorators) that says why
OUTSIDE = ("SPEC §", "../shared", "notes/reference-library.md", "notes/prefect.md", "notes/models-and-torch.md")


def sources() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py"))


def long_functions(source: str) -> list[tuple[str, int, bool]]:
    """``(name, lines, explained)`` of every function over MAX_FUNCTION_LINES lines (def line to its end,
    docstring included); explained when one of the 3 lines above its first decorator (or def) starts with WHY."""
    lines = source.splitlines()
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        length = node.end_lineno - node.lineno + 1
        if length <= MAX_FUNCTION_LINES:
            continue
        top = min([node.lineno, *(d.lineno for d in node.decorator_list)])
        above = lines[max(0, top - 4) : top - 1]
        found.append((node.name, length, any(line.strip().startswith(WHY) for line in above)))
    return found


def test_the_checker_sees_a_long_function_and_its_comment():
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    bare = f"def f():\n{body}\n"
    explained = f"{WHY}: one recipe.\n@staticmethod\ndef g():\n{body}\n"
    short = "def h():\n    return 1\n"
    assert long_functions(bare) == [("f", MAX_FUNCTION_LINES + 1, False)]
    assert long_functions(explained) == [("g", MAX_FUNCTION_LINES + 1, True)]
    assert long_functions(short) == []


@pytest.mark.parametrize("path", sources(), ids=lambda p: p.relative_to(REPO).as_posix())
def test_module_is_readable(path: Path):
    source = path.read_text()
    count = len(source.splitlines())
    assert count <= MAX_MODULE_LINES, f"{path.relative_to(REPO)}: {count} lines; split it along a seam"
    bare = [f"{name} ({n} lines)" for name, n, explained in long_functions(source) if not explained]
    assert not bare, f"{path.relative_to(REPO)}: long functions without a '{WHY}: why' comment: {bare}"
    outside = [cite for cite in OUTSIDE if cite in source]
    assert not outside, f"{path.relative_to(REPO)} cites {outside}, outside the repository; cite docs/ instead"
