"""Every code block of README.md that a user can run is run here, on the same code path (issue #16.1: the
README's own Python API example failed with ``unknown task 'python'``).

Blocks are found by their fence language; ``test_every_readme_block_is_covered`` fails when a block appears
that no test below runs, so a new example cannot go untested:
- ``python``: run as a script (``python -c``, so its functions live in ``__main__`` exactly as for a user) with
  the tiny model and fewer tokens;
- ``yaml``: written to a file and checked with ``pbrl validate``;
- ``bash``: the set-up block (``make demo`` / ``make test``) is what CI itself runs (``.ci/run``); the command-line
  quick start is run line by line in a fresh folder;
- ``text``: illustrations (the stage chain, the run folder), never run.

The blocks of the docs pages (the Prefect server and Ray blocks that used to be here included) are run by
tests/repo/test_docs.py. The README stays short (issue #28: at most 150 lines) and points a newcomer at the module of
every stage, the MADPO loss, the Parquet schema of pairs and every option's description.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.repo.test_docs import fenced, run_commands

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
BIN = Path(sys.executable).parent


def blocks(language: str) -> list[str]:
    return re.findall(rf"^ *```{language}\n(.*?)^ *```", README, flags=re.S | re.M)


def _strip(block: str) -> list[str]:
    """The command lines of a shell block, comments removed, leading indentation removed."""
    lines = [line.split("#", 1)[0].strip() for line in block.splitlines()]
    return [line for line in lines if line]


def test_every_readme_block_is_covered():
    languages = [language for language, *_ in fenced(README)]
    assert set(languages) <= {"text", "python", "yaml", "bash"}, languages
    assert len(blocks("python")) == 1 and len(blocks("yaml")) == 1
    shells = [_strip(b) for b in blocks("bash")]
    assert shells[0] == ["make demo", "make test"]
    assert [line.split()[:2] for line in shells[1]] == [
        ["pbrl", "validate"],
        ["pbrl", "train"],
        ["pbrl", "train"],
        ["pbrl", "status"],
    ]
    assert len(shells) == 2


def test_readme_is_short_and_points_at_the_design():
    """At most 150 lines (issue #28), with a way to each thing a newcomer must find within ten minutes; that each
    link resolves to a real page and heading is checked by tests/repo/test_docs.py."""
    assert len(README.splitlines()) <= 150
    for target in (
        "docs/design/architecture.md#where-to-find-it",
        "docs/design/algorithms.md#madpo",
        "docs/design/file-formats.md#pairs",
        "docs/reference/options.md#preference_replay_lambda",
    ):
        assert f"]({target})" in README, target


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env.update(
        PREFECT_HOME=str(tmp_path / "prefect-home"),
        PBRL_STORAGE=str(tmp_path / "storage"),
        PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}",
        PYTHONPATH=str(ROOT),
    )
    return env


@pytest.mark.flow
def test_python_api_block_runs_as_written(tmp_path):
    code = blocks("python")[0]
    small = code.replace('agent_model="smollm2-135m-instruct"', 'agent_model="tiny-random"').replace(
        "max_new_tokens=48", "max_new_tokens=6"
    )
    assert small != code and "tiny-random" in small
    # A user's environment: no quieting variables, Prefect at its default level, every warning shown.
    env = {
        k: v
        for k, v in _env(tmp_path).items()
        if k not in ("HF_HUB_DISABLE_PROGRESS_BARS", "PYTHONWARNINGS", "TQDM_DISABLE")
    }
    env |= {"PREFECT_LOGGING_LEVEL": "INFO"}
    out = subprocess.run(
        [sys.executable, "-W", "default", "-c", small],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    run_dir = tmp_path / "storage" / "runs" / "my-task"
    assert (run_dir / "rounds" / "0002" / "update-policies.manifest.json").is_file()
    # result.rounds printed one row per round (0 = baseline, 1, 2)
    assert re.search(r"^\s*2\s", out.stdout, flags=re.M), out.stdout
    # It printed 15 ConfigNotices about defaults the user never set (5 per round) and transformers' FutureWarning.
    assert "warning" not in out.stderr.lower(), out.stderr
    assert "dedicated Prefect server" not in out.stderr


def test_yaml_block_validates(tmp_path):
    config = tmp_path / "readme.yaml"
    config.write_text(blocks("yaml")[0])
    out = subprocess.run(
        [str(BIN / "pbrl"), "validate", str(config)],
        cwd=ROOT,
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0 and out.stdout.startswith("OK:"), out.stdout + out.stderr


@pytest.mark.flow
def test_cli_quick_start_block_runs_as_written(tmp_path):
    """Validate, train, resume (every stage Cached) and status, in a fresh folder as a user would."""
    commands = [shlex.split(line) for line in _strip(blocks("bash")[1])]
    *_, status = run_commands(commands, tmp_path, _env(tmp_path))
    assert "cached" in status.stdout and not re.search(r"\bfailed\b(?!=)", status.stdout), status.stdout
    assert (tmp_path / "storage" / "runs" / "tiny-madpo-iter" / "rounds" / "0002" / "evaluate.manifest.json").is_file()
