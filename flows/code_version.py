"""The code version in every stage's cache key: pbrl's version and a hash of the sources that stages run
(docs/design/architecture.md#caching-and-resume).

The sources are the import closure of the stage modules (``stages.STAGE_MODULES``): every module of ``pbrl/``
and ``stages/`` that a stage imports, transitively, imports inside functions (deferred ones) included, and the
``__init__.py`` of every package on the way (Python runs them on import). A front-end module (the CLI, the
trainer API, the Prefect bridge, the report) is outside that closure, so editing it keeps every stage cache; a
module that a stage can reach is inside it, with no list to keep up by hand.

The walk is a small ``ast`` pass over our own sources rather than grimp (which builds the same graph for
import-linter): grimp is a dev-only dependency, and this needs nothing but the standard library, reads only the
files it reaches, and follows the same rule import-linter checks (every ``import`` statement, wherever it sits).
"""

from __future__ import annotations

import ast
import functools
import hashlib
from collections.abc import Iterable, Mapping
from pathlib import Path

import pbrl
import stages

# The packages whose sources can change what a stage writes, by import name. flows/ is not one: stages never
# import it (the layers contract in pyproject.toml).
PACKAGES: dict[str, Path] = {"pbrl": Path(pbrl.__file__).parent, "stages": Path(stages.__file__).parent}


def module_label(name: str, packages: Mapping[str, Path]) -> str | None:
    """The source file of module ``name`` as ``"<package>/<path>.py"`` (``pbrl.learning.losses`` ->
    ``"pbrl/learning/losses.py"``, ``pbrl.learning`` -> ``"pbrl/learning/__init__.py"``), or None when ``name``
    is not a module of ``packages`` (another library, or an attribute imported with ``from ... import``)."""
    root, *rest = name.split(".")
    if root not in packages:
        return None
    candidates = [f"{'/'.join(rest)}.py"] if rest else []
    candidates.append("/".join([*rest, "__init__.py"]))
    for relative in candidates:
        if (packages[root] / relative).is_file():
            return f"{root}/{relative}"
    return None


def imported_names(source: bytes, name: str, is_package: bool) -> set[str]:
    """Every module name that module ``name`` (its ``source``) may import, anywhere in the file.

    ``import a.b`` gives ``a.b``; ``from a import b`` gives ``a`` and ``a.b`` (``b`` may be a submodule or an
    attribute: :func:`module_label` keeps only files); relative imports are resolved against ``name``.
    """
    package = name if is_package else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return found


def import_closure(start: Iterable[str], packages: Mapping[str, Path]) -> tuple[str, ...]:
    """The sorted labels (``"pbrl/learning/losses.py"``) of the modules of ``packages`` that the modules named in
    ``start`` import, transitively, with the ``__init__.py`` of every package that holds one of them."""
    todo, seen, labels = list(start), set(), set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        label = module_label(name, packages)
        if label is None:
            continue
        labels.add(label)
        parts = name.split(".")
        todo.extend(".".join(parts[:i]) for i in range(1, len(parts)))  # the packages that hold it
        root, _, relative = label.partition("/")
        source = (packages[root] / relative).read_bytes()
        todo.extend(imported_names(source, name, label.endswith("/__init__.py")))
    return tuple(sorted(labels))


def sources_hash(labels: Iterable[str], packages: Mapping[str, Path]) -> str:
    """A SHA-256 (hex) of each labelled file's label and bytes, in the order given."""
    h = hashlib.sha256()
    for label in labels:
        root, _, relative = label.partition("/")
        h.update(label.encode() + (packages[root] / relative).read_bytes())
    return h.hexdigest()


@functools.cache
def stage_sources() -> tuple[str, ...]:
    """The labels of the sources that stages run: the import closure of ``stages.STAGE_MODULES``."""
    return import_closure([module.__name__ for module in stages.STAGE_MODULES.values()], PACKAGES)


@functools.cache
def code_version() -> str:
    """Package version + a hash of the sources that stages run (Prefect's TASK_SOURCE sees only a task's own
    function, not the helpers it calls), e.g. ``"0.1.0+3f2a9c0d1e4b"``."""
    return f"{pbrl.__version__}+{sources_hash(stage_sources(), PACKAGES)[:12]}"
