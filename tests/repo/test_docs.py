"""The docs in ``docs/`` (issue #28): they build without warnings, the options reference is generated, every
``docs/<page>.md#<anchor>`` cited anywhere resolves to a real heading, every file path and Parquet column they
name exists, and every runnable block in them is run, as tests/repo/test_readme.py runs the README's.

Blocks are found by their fence language; ``test_every_docs_block_is_covered`` fails when a block appears that
no test runs:

- ``yaml``: written to a file and checked with ``pbrl validate`` (:func:`test_yaml_block_validates`);
- ``python``: a block labelled with a file name (a line ```` `my_task.py`: ```` right above it) is a module,
  written beside the page's other labelled files and run (:func:`test_python_module_block_runs`); any other
  python block trains and has its own ``flow`` test in :data:`PYTHON_TESTS` (tiny model, few tokens);
- ``json``: data; it must be labelled with its file name, which the other blocks of its page use;
- ``bash``: run line by line (:func:`test_fast_shell_block_runs`) when every command is fast (``pbrl validate``,
  ``pbrl models list``, ``--help``); any other bash block has its own test in :data:`SHELL_TESTS`;
- ``text``: an illustration (layouts, outputs), never run; MyST directives (```` ```{toctree} ````) are not code.

Every block of a page runs in one temporary folder holding the page's labelled files, with relative
``flows/configs/`` paths pointing at this checkout's configs.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pytest

from pbrl.config import ALL_FIELDS
from pbrl.config.reference import CHANGED_FROM_REFERENCE, REGENERATE, options_markdown, type_text

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
BIN = Path(sys.executable).parent
PAGES = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md") if "_build" not in p.parts)
LANGUAGES = {"python", "yaml", "bash", "json", "text"}
# Runnable blocks that train or start servers, and the test that runs each: (page, index among the page's blocks
# of that language) -> test name.
PYTHON_TESTS = {("guides/python-api.md", 0): "test_python_api_guide_block_trains"}
SHELL_TESTS = {
    ("guides/rerun-a-stage.md", 0): "test_rerun_a_stage_block_runs_as_written",
    ("guides/prefect-ui.md", 0): "test_prefect_ui_block_registers_the_deployments",
    ("guides/ray.md", 0): "test_ray_guide_block_runs_as_written",
    ("guides/label-pairs.md", 0): "test_label_pairs_guide_block_runs_as_written",
}
# Where code may cite the docs: every `docs/<page>.md#<anchor>` found here must resolve.
CITING = ("pbrl", "stages", "flows", "tests", "benchmarks", "mutate")
CITING_FILES = ("README.md", "Makefile", "pyproject.toml")


# ---------------------------------------------------------------------------------------------- reading pages
@dataclass(frozen=True)
class Block:
    page: str  # relative to docs/
    language: str
    index: int  # among the page's blocks of the same language
    code: str
    label: str | None  # the file name the page gives the block, if any

    @property
    def key(self) -> tuple[str, int]:
        return self.page, self.index

    def __str__(self) -> str:
        return f"{self.page}:{self.language}[{self.index}]"


_FENCE = re.compile(r"^(\s*)(`{3,})(\S*)\s*$")
_LABEL = re.compile(r"^`([\w.-]+\.\w+)`:\s*$")


def page_text(page: str) -> str:
    return (DOCS / page).read_text(encoding="utf-8")


def fenced(text: str) -> list[tuple[str, str, str | None, int]]:
    """Every fenced block of a markdown text: (language, code, label, line number of the fence)."""
    lines, out, i = text.splitlines(), [], 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        indent, ticks, language = match.groups()
        previous = [line for line in lines[:i] if line.strip()][-1:]
        label = _LABEL.match(previous[0].strip()) if previous else None
        body, j = [], i + 1
        while j < len(lines) and lines[j].strip() != ticks:
            body.append(lines[j][len(indent) :] if lines[j].startswith(indent) else lines[j])
            j += 1
        out.append((language, "\n".join(body) + "\n", label.group(1) if label else None, i + 1))
        i = j + 1
    return out


def page_blocks(page: str) -> list[Block]:
    seen: dict[str, int] = {}
    blocks = []
    for language, code, label, _ in fenced(page_text(page)):
        if language.startswith("{"):  # a MyST directive, not code
            continue
        blocks.append(Block(page, language, seen.get(language, 0), code, label))
        seen[language] = seen.get(language, 0) + 1
    return blocks


ALL_BLOCKS = [b for page in PAGES for b in page_blocks(page)]


def blocks(language: str) -> list[Block]:
    return [b for b in ALL_BLOCKS if b.language == language]


# ---------------------------------------------------------------------------------------------- anchors
def github_slug(title: str) -> str:
    """MyST's heading slug (``myst_parser.slugs.github_slugify``, the ``myst_heading_anchors`` default):
    lowercase, spaces to ``-``, every character that is not a word character, ``-`` or a space removed."""
    return re.sub(r"[^\w\u4e00-\u9fff\- ]", "", title.lower().replace(" ", "-"))


def heading_title(markdown: str) -> str:
    """A heading's text as MyST slugs it: the text and inline-code parts only (math and markup dropped)."""
    text = re.sub(r"\$[^$]+\$", "", markdown)  # inline math is not part of the slug
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link counts by its text
    return text.replace("`", "").replace("*", "").replace("\\", "")


def heading_anchors(text: str, max_level: int = 3) -> list[str]:
    """The anchors of a page's headings down to ``max_level`` (``myst_heading_anchors``), made unique in page
    order (``x``, ``x-1``, ``x-2`` …); lines inside fenced blocks are not headings."""
    anchors: list[str] = []
    fence = None  # the backticks of the open fence
    for line in text.splitlines():
        match = _FENCE.match(line)
        if fence is None and match:
            fence = match.group(2)
            continue
        if fence is not None:
            fence = None if line.strip() == fence else fence
            continue
        heading = re.match(r"^(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if heading and len(heading.group(1)) <= max_level:
            slug = base = github_slug(heading_title(heading.group(2)))
            k = 1
            while slug in anchors:
                slug, k = f"{base}-{k}", k + 1
            anchors.append(slug)
    return anchors


def anchors_of(page: str) -> set[str]:
    return set(heading_anchors(page_text(page)))


def test_heading_anchors_follow_myst():
    text = (
        "# Title\n\n## `preference_replay_lambda`\n\n```text\n# not a heading\n```\n\n"
        "## The coding task: humaneval_coop\n\n### Loss and gradient\n\n#### Too deep\n\n## Title\n"
    )
    assert heading_anchors(text) == [
        "title",
        "preference_replay_lambda",
        "the-coding-task-humaneval_coop",
        "loss-and-gradient",
        "title-1",
    ]


# ---------------------------------------------------------------------------------------------- the options page
def test_options_reference_is_generated():
    committed = (DOCS / "reference" / "options.md").read_text(encoding="utf-8")
    assert committed == options_markdown(), (
        f"docs/reference/options.md is stale (the option fields changed): regenerate it with `{REGENERATE}` "
        "and commit the result"
    )


def test_every_option_has_one_section():
    text = options_markdown()
    for name in ALL_FIELDS:
        assert text.count(f"\n### `{name}`\n") == 1, name
    assert set(heading_anchors(text)) >= set(ALL_FIELDS)


def test_options_marked_as_changed_are_listed_among_the_deliberate_changes():
    text = page_text("design/algorithms.md")
    section = text.split("## Deliberate changes from the reference", 1)[1].split("\n## ", 1)[0]
    for name in CHANGED_FROM_REFERENCE:
        assert re.search(rf"`{name}\b", section), name


def test_option_types_read_like_the_yaml_users_write():
    fields = dict(ALL_FIELDS)
    assert type_text(fields["top_k"].annotation) == "int | None"
    assert (
        type_text(fields["preference_replay_mode"].annotation)
        == "'current' | 'nearest_k' | 'all_history' | 'lambda_decay'"
    )
    assert type_text(fields["agent_devices"].annotation) == "str | list[str] | None"
    assert type_text(fields["task_options"].annotation) == "dict[str, Any]"


# ---------------------------------------------------------------------------------------------- references
_CITATION = re.compile(r"(?<!\w)docs/([\w./-]+?\.md)(?:#([\w-]+))?")


def _citing_files() -> list[Path]:
    files = [ROOT / name for name in CITING_FILES]
    for folder in CITING:
        files += [
            p
            for p in (ROOT / folder).rglob("*")
            if p.suffix in (".py", ".md", ".yaml", ".json", ".txt") and p.is_file() and "__pycache__" not in p.parts
        ]
    return files


def test_docs_references_resolve_to_a_page_and_a_heading():
    """Every ``docs/<page>.md#<anchor>`` in the code, tests, README and configs names a page of docs/ and one of
    its heading anchors (levels 1-3, MyST's slugs: see :func:`heading_anchors`)."""
    broken = []
    for path in _citing_files():
        for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), start=1):
            for page, anchor in _CITATION.findall(line):
                where = f"{path.relative_to(ROOT)}:{n}: docs/{page}" + (f"#{anchor}" if anchor else "")
                if page not in PAGES:
                    broken.append(f"{where}: no such page")
                elif anchor and anchor not in anchors_of(page):
                    broken.append(f"{where}: no such heading; anchors: {', '.join(sorted(anchors_of(page)))}")
    assert not broken, "\n".join(broken)


def test_links_between_docs_pages_resolve():
    """Relative links between pages (``[x](../design/stages.md#evaluate)``), also without Sphinx installed."""
    broken = []
    for page in PAGES:
        for target, anchor in re.findall(r"\]\(([\w./-]*\.md)?(?:#([\w-]+))?\)", page_text(page)):
            resolved = (Path(page).parent / target).as_posix() if target else page
            resolved = os.path.normpath(resolved)
            if resolved not in PAGES:
                broken.append(f"{page}: ({target}#{anchor}): no such page")
            elif anchor and anchor not in anchors_of(resolved):
                broken.append(f"{page}: ({target}#{anchor}): no such heading")
    assert not broken, "\n".join(broken)


def test_paths_named_in_the_docs_exist():
    """A file or folder of the repository named in backticks (```pbrl/learning/losses.py```) exists, so the docs
    follow the code when modules move."""
    pattern = re.compile(r"`((?:pbrl|stages|flows|tests|benchmarks|mutate)/[\w./-]+)`")
    # The changelog names old paths on purpose.
    texts = {page: page_text(page) for page in PAGES if page != "changelog.md"}
    texts["../README.md"] = (ROOT / "README.md").read_text(encoding="utf-8")
    missing = [
        f"{page}: {path}"
        for page, text in texts.items()
        for path in pattern.findall(text)
        if not (ROOT / path).exists()
    ]
    assert not missing, "\n".join(missing)


def _schemas() -> dict[str, pa.Schema]:
    from pbrl.data import schema
    from pbrl.generation.collaboration import ROLES

    found = {name: value for name, value in vars(schema).items() if isinstance(value, pa.Schema) and name.isupper()}
    return found | {"ROLES": ROLES}


def test_every_parquet_column_is_described():
    """Each schema of pbrl/data/schema.py (and ``ROLES``) has a section in file-formats.md, found by
    ``schema `NAME```, whose table lists exactly its columns."""
    text = page_text("design/file-formats.md")
    sections = re.split(r"\n(?=#{2,3} )", text)
    problems = []
    for name, schema in _schemas().items():
        section = next((s for s in sections if f"schema `{name}`" in s), None)
        if section is None:
            problems.append(f"{name}: no section says `schema `{name}``")
            continue
        listed = re.findall(r"^\| `(\w+)` \|", section, flags=re.M)
        if listed != schema.names:
            problems.append(f"{name}: documented {listed}, declared {schema.names}")
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------------------------------------- runnable blocks
def _commands(block: Block) -> list[list[str]]:
    """The block's commands as argument lists (comments dropped)."""
    return [words for line in block.code.splitlines() if (words := shlex.split(line, comments=True))]


def _program(words: list[str]) -> list[str]:
    """``words`` without leading ``NAME=value`` environment assignments."""
    i = 0
    while i < len(words) and re.match(r"^[A-Za-z_]\w*=", words[i]):
        i += 1
    return words[i:]


def is_fast(words: list[str]) -> bool:
    cmd = _program(words)
    return cmd[:2] == ["pbrl", "validate"] or cmd[:3] == ["pbrl", "models", "list"] or cmd[-1:] == ["--help"]


def test_every_docs_block_is_covered():
    problems = []
    for b in ALL_BLOCKS:
        if b.language not in LANGUAGES:
            problems.append(f"{b}: unknown fence language; use one of {sorted(LANGUAGES)} (text: not run)")
        elif b.language == "json" and b.label is None:
            problems.append(f"{b}: a json block is data: label it with its file name, or fence it as text")
        elif b.language == "python" and b.label is None and b.key not in PYTHON_TESTS:
            problems.append(f"{b}: a python block that no test runs: label it as a module or add it to PYTHON_TESTS")
        elif b.language == "bash" and not all(map(is_fast, _commands(b))) and b.key not in SHELL_TESTS:
            problems.append(f"{b}: a slow bash block that no test runs: add its test to SHELL_TESTS")
    for language, table in (("python", PYTHON_TESTS), ("bash", SHELL_TESTS)):
        for key, test in table.items():
            if not any(b.key == key for b in blocks(language)):
                problems.append(f"{language} block {key}: listed for {test} but not in the docs")
            if not callable(globals().get(test)):
                problems.append(f"{test}: named for {language} block {key} but not defined here")
    assert not problems, "\n".join(problems)


def _env(tmp_path: Path, *extra_paths: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env.update(
        PREFECT_HOME=str(tmp_path / "prefect-home"),
        PBRL_STORAGE=str(tmp_path / "storage"),
        PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}",
        PYTHONPATH=os.pathsep.join(str(p) for p in (ROOT, *extra_paths)),
    )
    return env


def workdir(page: str, tmp_path: Path) -> Path:
    """A folder holding the page's labelled files (modules, items, configs), where its blocks run."""
    folder = tmp_path / "work"
    folder.mkdir(exist_ok=True)
    for b in page_blocks(page):
        if b.label:
            (folder / b.label).write_text(b.code, encoding="utf-8")
    return folder


def run_commands(
    commands: list[list[str]], cwd: Path, env: dict[str, str], timeout: float = 600
) -> list[subprocess.CompletedProcess]:
    """Run each command as a user would from ``cwd`` (``flows/configs/`` is this checkout's), failing on the
    first non-zero exit; leading ``NAME=value`` words set the command's environment."""
    done = []
    for words in commands:
        words = [w.replace("flows/configs/", f"{ROOT}/flows/configs/") for w in words]
        program = _program(words)
        command_env = env | dict(w.split("=", 1) for w in words[: len(words) - len(program)])
        out = subprocess.run(program, cwd=cwd, env=command_env, capture_output=True, text=True, timeout=timeout)
        assert out.returncode == 0, (" ".join(words), out.stdout[-3000:], out.stderr[-3000:])
        done.append(out)
    return done


@pytest.mark.parametrize("block", blocks("yaml"), ids=str)
def test_yaml_block_validates(block, tmp_path):
    folder = workdir(block.page, tmp_path)
    config = folder / (block.label or f"block-{block.index}.yaml")
    config.write_text(block.code, encoding="utf-8")
    out = subprocess.run(
        [str(BIN / "pbrl"), "validate", config.name],
        cwd=folder,
        env=_env(tmp_path, folder),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0 and out.stdout.startswith("OK:"), out.stdout + out.stderr


@pytest.mark.parametrize("block", [b for b in blocks("bash") if all(map(is_fast, _commands(b)))], ids=str)
def test_fast_shell_block_runs(block, tmp_path):
    folder = workdir(block.page, tmp_path)
    run_commands(_commands(block), folder, _env(tmp_path, folder), timeout=300)


@pytest.mark.parametrize("block", [b for b in blocks("python") if b.label], ids=str)
def test_python_module_block_runs(block, tmp_path):
    folder = workdir(block.page, tmp_path)
    out = subprocess.run(
        [sys.executable, block.label],
        cwd=folder,
        env=_env(tmp_path, folder),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]


def test_your_own_task_module_keeps_the_reward_contract(tmp_path):
    """The guide's reward takes one list per agent and ``batch_items=``, and returns one finite number per joint
    response within its declared range; its formatters read the guide's items."""
    import json
    import math

    folder = workdir("guides/your-own-task.md", tmp_path)
    spec = importlib.util.spec_from_file_location("my_task_from_docs", folder / "my_task.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    items = [json.loads(line) for line in (folder / "items.jsonl").read_text().splitlines()]
    facts = [module.fact_prompt(item) for item in items]
    explanations = [module.explain_prompt(item) for item in items]
    scores = module.reward(facts, explanations, batch_items=items)
    low, high = module.reward.reward_range
    assert len(scores) == len(items) and all(math.isfinite(s) and low <= s <= high for s in scores), scores


# ---------------------------------------------------------------------------------------------- the build
def test_docs_build_without_warnings(tmp_path):
    """``make docs`` in a temporary folder: Sphinx with warnings as errors (broken links and anchors, bad
    markup, a page outside every toctree), and every heading anchor this module computes is an id of the
    built page (MyST emits each heading's slug as an HTML id)."""
    for module in ("sphinx", "myst_parser"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed: pip install -e '.[docs]' (part of the dev extra)")
    html = tmp_path / "html"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "sphinx",
            "-W",
            "--keep-going",
            "-q",
            "-b",
            "html",
            "-d",
            str(tmp_path / "doctrees"),
            str(DOCS),
            str(html),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    for page in PAGES:
        ids = set(re.findall(r'\bid="([^"]+)"', (html / page).with_suffix(".html").read_text(encoding="utf-8")))
        missing = sorted(anchors_of(page) - ids)
        assert not missing, f"{page}: anchors without an HTML id: {missing}"


# ---------------------------------------------------------------------------------------------- flow tests
def _block(page: str, language: str, index: int = 0) -> Block:
    return next(b for b in page_blocks(page) if b.language == language and b.index == index)


@pytest.mark.flow
def test_python_api_guide_block_trains(tmp_path):
    code = _block("guides/python-api.md", "python").code
    small = code.replace('"smollm2-135m-instruct"', '"tiny-random"').replace("max_new_tokens=32", "max_new_tokens=6")
    assert small != code and "tiny-random" in small and "max_new_tokens=6" in small
    out = subprocess.run(
        [sys.executable, "-c", small], cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True, timeout=900
    )
    assert out.returncode == 0, out.stderr[-3000:]
    run_dir = tmp_path / "storage" / "runs" / "api-marlhf"
    assert (run_dir / "rounds" / "0002" / "update-policies.manifest.json").is_file()
    assert str(Path("storage/runs/api-marlhf")) in out.stdout, out.stdout


@pytest.mark.flow
def test_rerun_a_stage_block_runs_as_written(tmp_path):
    """Train, rerun a stage (cached, then forced), resume (nothing downstream changes), status and report."""
    commands = _commands(_block("guides/rerun-a-stage.md", "bash"))
    assert [c[:2] for c in commands] == [
        ["pbrl", "train"],
        ["pbrl", "stage"],
        ["pbrl", "stage"],
        ["pbrl", "train"],
        ["pbrl", "status"],
        ["pbrl", "report"],
    ]
    # One round of the guide's two: every command still has its round 1 to work on.
    commands = [[*c, "--set", "num_iterations=1"] if c[:2] == ["pbrl", "train"] else c for c in commands]
    train, cached, forced, resume, status, report = run_commands(commands, tmp_path, _env(tmp_path))
    assert "Cached" in cached.stdout and "Completed" in forced.stdout, (cached.stdout, forced.stdout)
    assert "cached" in status.stdout and not re.search(r"\bfailed\b(?!=)", status.stdout), status.stdout
    assert (tmp_path / "storage" / "runs" / "tiny-madpo-iter" / "report.png").is_file()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def with_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def _wait_healthy(httpx, url: str) -> None:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    pytest.fail("prefect server did not start")


def _stop(procs: list[subprocess.Popen], wait: float) -> None:
    for proc in reversed(procs):
        with_group(proc, signal.SIGTERM)
    for proc in reversed(procs):
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            with_group(proc, signal.SIGKILL)


@pytest.mark.flow
def test_prefect_ui_block_registers_the_deployments(tmp_path):
    """The server block run for real: ``prefect server start`` on a free port, ``pbrl serve``, and every
    ``pbrl-train/<name>`` deployment the page names appears on the server."""
    import httpx

    start, export, serve = [" ".join(words) for words in _commands(_block("guides/prefect-ui.md", "bash"))]
    port = _free_port()
    env = _env(tmp_path)
    url = export.split("=", 1)[1].replace("4200", str(port))
    procs = []
    try:
        procs.append(
            subprocess.Popen(
                [*start.split(), "--port", str(port)],
                cwd=tmp_path,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
        )
        env["PREFECT_API_URL"] = url
        _wait_healthy(httpx, url)
        procs.append(
            subprocess.Popen(
                serve.split(),
                cwd=tmp_path,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
        )
        names: set[str] = set()
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and "train" not in names:
            rows = httpx.post(f"{url}/deployments/filter", json={}, timeout=5).json()
            names = {row["name"] for row in rows}
            time.sleep(1)
        mentioned = re.findall(r"pbrl-train/(\w[\w-]*)", page_text("guides/prefect-ui.md"))
        assert mentioned and set(mentioned) <= names, (mentioned, names)
    finally:
        _stop(procs, wait=30)


@pytest.mark.flow
def test_ray_guide_block_runs_as_written(tmp_path):
    """The set-up block of the Ray guide on one machine: a Ray head, a Prefect server, the deployments on a work
    pool, a worker polling it, and a run with ``--runner ray`` on that Ray head (its shards are on disk)."""
    import httpx

    lines = [line.split("#", 1)[0].strip() for line in _block("guides/ray.md", "bash").code.splitlines()]
    lines = [line for line in lines if line]
    assert [line.split()[0] for line in lines] == ["ray", "prefect", "export", "pbrl", "prefect", "pbrl"]
    ray_port, api_port = _free_port(), _free_port()
    env = _env(tmp_path)
    procs: list[subprocess.Popen] = []
    try:
        for line in lines:
            line = (
                line.replace("6379", str(ray_port))
                .replace("4200", str(api_port))
                .replace("flows/configs/", f"{ROOT}/flows/configs/")
            )
            if line.startswith("pbrl train"):
                line += " --set num_iterations=1"  # the set-up is what is shown; one round of it is enough here
            if line.startswith("export "):
                key, value = line.split(None, 1)[1].split("=", 1)
                env[key] = value
                continue
            if line.endswith("&"):
                procs.append(
                    subprocess.Popen(
                        line[:-1].split(),
                        cwd=tmp_path,
                        env=env,
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL,
                        start_new_session=True,
                    )
                )
                if line.startswith("prefect server"):
                    _wait_healthy(httpx, f"http://127.0.0.1:{api_port}/api")
                continue
            out = subprocess.run(line.split(), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
            assert out.returncode == 0, (line, out.stdout[-3000:], out.stderr[-3000:])
        run_dir = tmp_path / "storage" / "runs" / "tiny-madpo-iter"
        assert (run_dir / "rounds/0001/evaluate.manifest.json").is_file()
        assert (run_dir / "rounds/0001/shards/sample-candidates/0000-of-0001.parquet").is_file()  # ran on Ray
        url = env["PREFECT_API_URL"]
        pools = httpx.post(f"{url}/work_pools/filter", json={}, timeout=10).json()
        assert [p["name"] for p in pools if p["type"] == "process"] == ["pbrl-pool"]
        deployments = httpx.post(f"{url}/deployments/filter", json={}, timeout=10).json()
        assert {d["work_pool_name"] for d in deployments} == {"pbrl-pool"}
    finally:
        _stop(procs, wait=60)  # `ray start --block` stops its Ray processes first (up to ~40 s here)


@pytest.mark.flow
def test_label_pairs_guide_block_runs_as_written(tmp_path):
    """The guide's commands as written: train stops for labels (exit 3, "waiting:"), status says how many and how,
    ``pbrl label`` takes one key per pair (here from its input, a line per key), and the resume trains round 1 on
    exactly those labels, then stops for round 2's."""
    import pyarrow.parquet as pq

    page = "guides/label-pairs.md"
    folder = workdir(page, tmp_path)
    env = {**_env(tmp_path, folder), "PBRL_STORAGE": str(folder / "storage")}
    train, status, label, resume = _commands(_block(page, "bash"))
    assert [train[:2], status[:2], label[:2], resume[:2]] == [["pbrl", "train"], ["pbrl", "status"]] + [
        ["pbrl", "label"],
        ["pbrl", "train"],
    ]

    def run(words: list[str], keys: str | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(words, cwd=folder, env=env, input=keys, capture_output=True, text=True, timeout=900)

    out = run(train)
    assert out.returncode == 3 and "waiting for 8 labels (of 8 pairs)" in out.stderr, (out.stdout, out.stderr)
    out = run(status)
    assert "round 1: waiting for 8 labels (of 8 pairs)" in out.stdout and "waiting for labels" in out.stdout, out.stdout
    keys = ["a", "b", "t", "s", "a", "b", "a", "b"]
    out = run(label, "\n".join(keys) + "\n")
    assert out.returncode == 0 and "0 of 8 left in round 1" in out.stdout, (out.stdout, out.stderr)
    out = run(resume)
    assert out.returncode == 3 and "round 2: waiting for 8 labels" in out.stderr, (out.stdout, out.stderr)
    round_1 = folder / "storage" / "runs" / "labelled" / "rounds" / "0001"
    verdicts = pq.read_table(round_1 / "verdicts.parquet").to_pylist()
    chosen = {"a": "A", "b": "B", "t": "tie", "s": None}
    assert [(v["verdict"], v["labeller"]) for v in verdicts] == [(chosen[k], "ada") for k in keys]
    assert pq.read_table(round_1 / "pairs.parquet").num_rows == 6  # every A and B; the tie and the skip give none
