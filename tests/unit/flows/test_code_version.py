"""The code version in every stage cache key hashes the import closure of the stages (flows/code_version.py):
editing a front-end module keeps every stage cache, editing a module a stage can reach invalidates them."""

from __future__ import annotations

import shutil
import textwrap

import stages
from flows.code_version import (
    PACKAGES,
    code_version,
    import_closure,
    imported_names,
    module_label,
    sources_hash,
    stage_sources,
)

STAGE_NAMES = [module.__name__ for module in stages.STAGE_MODULES.values()]


def test_the_closure_holds_what_stages_run_and_not_the_front_end():
    closure = set(stage_sources())
    stage_files = {f"stages/{name.rpartition('.')[2]}.py" for name in STAGE_NAMES}
    assert len(stage_files) == 9 and stage_files <= closure
    assert {"stages/__init__.py", "pbrl/__init__.py", "pbrl/learning/__init__.py", "pbrl/learning/losses.py"} <= closure
    assert "pbrl/run/progress.py" in closure  # stages/score_with_oracle.py imports it (the old hand list left it out)
    front_ends = ("pbrl/cli/commands.py", "pbrl/trainers/trainer.py", "pbrl/reporting/report.py")
    for front_end in (*front_ends, "pbrl/orchestration.py", "pbrl/cli/__init__.py", "pbrl/trainers/__init__.py"):
        assert front_end not in closure
    assert all(label.startswith(("pbrl/", "stages/")) for label in closure)


def test_the_closure_is_sorted_cached_and_stable():
    assert stage_sources() is stage_sources()
    assert list(stage_sources()) == sorted(stage_sources())
    assert import_closure(STAGE_NAMES, PACKAGES) == stage_sources()
    assert code_version() == code_version() and code_version().startswith("0.") and "+" in code_version()


def test_imports_are_found_anywhere_and_relative_ones_resolved():
    source = textwrap.dedent(
        """
        import os, toy.a
        from toy import b
        from . import c
        from .d import thing
        from .. import up

        def later():
            import toy.deferred  # a deferred import counts as well

        if False:
            from toy.e import f
        """
    ).encode()
    found = imported_names(source, "toy.sub.mod", is_package=False)
    assert {"os", "toy.a", "toy", "toy.b", "toy.sub", "toy.sub.c", "toy.sub.d", "toy.sub.d.thing"} <= found
    assert {"toy.deferred", "toy.e", "toy.e.f"} <= found
    assert "toy.up" in found  # `..` from toy.sub.mod is toy
    assert "toy.sub.c" in imported_names(b"from . import c", "toy.sub", is_package=True)


def test_a_toy_closure_worked_by_hand(tmp_path):
    toy = tmp_path / "toy"
    (toy / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "start.py": "from toy.sub import helper\n\ndef f():\n    import toy.late\n",
        "sub/__init__.py": "",
        "sub/helper.py": "from . import leaf\nHELPER = 1\n",
        "sub/leaf.py": "import json\n",
        "late.py": "from toy.sub.helper import HELPER\n",
        "front.py": "import toy.start\n",  # imports the closure but is not in it
    }
    for name, text in files.items():
        (toy / name).write_text(text)
    packages = {"toy": toy}
    assert import_closure(["toy.start"], packages) == (
        "toy/__init__.py",
        "toy/late.py",
        "toy/start.py",
        "toy/sub/__init__.py",
        "toy/sub/helper.py",
        "toy/sub/leaf.py",
    )
    assert module_label("toy.sub.helper.HELPER", packages) is None  # an attribute, not a module
    assert module_label("json", packages) is None


def test_editing_the_front_end_keeps_the_code_version_and_editing_the_closure_changes_it(tmp_path):
    copies = {}
    for name, source in PACKAGES.items():
        copies[name] = tmp_path / name
        shutil.copytree(source, copies[name], ignore=shutil.ignore_patterns("__pycache__"))

    def version() -> str:
        return sources_hash(import_closure(STAGE_NAMES, copies), copies)

    before = version()
    assert before == sources_hash(stage_sources(), PACKAGES)
    for front_end in ("cli/commands.py", "trainers/trainer.py", "reporting/report.py"):
        with (copies["pbrl"] / front_end).open("a") as f:
            f.write("\n# an edit to the front end\n")
    assert version() == before
    with (copies["pbrl"] / "learning" / "losses.py").open("a") as f:
        f.write("\n# an edit to a loss\n")
    assert version() != before
