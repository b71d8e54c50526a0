"""Every code block of README.md that a user can run is run here, on the same code path (issue #16.1: the
README's own Python API example failed with ``unknown task 'python'``).

Blocks are found by their fence language; ``test_every_readme_block_is_covered`` fails when a block appears
that no test below runs, so a new example cannot go untested:
- ``python``: run as a script (``python -c``, so its functions live in ``__main__`` exactly as for a user) with
  the tiny model and fewer tokens;
- ``yaml``: written to a file and checked with ``pbrl validate``;
- ``bash``: the set-up block (``make demo`` / ``make test``) is what CI itself runs (``.ci/run``); the server
  block is run for real: ``prefect server start`` on a free port, ``pbrl serve``, and the deployment it names
  must appear on the server.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
BIN = Path(sys.executable).parent


def blocks(language: str) -> list[str]:
    return re.findall(rf"^ *```{language}\n(.*?)^ *```", README, flags=re.S | re.M)


def _strip(block: str) -> list[str]:
    """The command lines of a shell block, comments removed, leading indentation removed."""
    lines = [line.split("#", 1)[0].strip() for line in block.splitlines()]
    return [line for line in lines if line]


def test_every_readme_block_is_covered():
    fenced = re.findall(r"^ *```(\w*)\n", README, flags=re.M)
    assert set(fenced) <= {"", "python", "yaml", "bash"}, fenced
    assert len(blocks("python")) == 1 and len(blocks("yaml")) == 1
    shells = [_strip(b) for b in blocks("bash")]
    assert shells[0] == ["make demo", "make test"]
    assert [line.split()[0] for line in shells[1]] == ["prefect", "export", "pbrl"]
    assert len(shells) == 2


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env.update(PREFECT_HOME=str(tmp_path / "prefect-home"), PBRL_STORAGE=str(tmp_path / "storage"),
               PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}", PYTHONPATH=str(ROOT))
    return env


@pytest.mark.flow
def test_python_api_block_runs_as_written(tmp_path):
    code = blocks("python")[0]
    small = (code.replace('agent_model="smollm2-135m-instruct"', 'agent_model="tiny-random"')
             .replace("max_new_tokens=48", "max_new_tokens=6"))
    assert small != code and "tiny-random" in small
    out = subprocess.run([sys.executable, "-c", small], cwd=tmp_path, env=_env(tmp_path), capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    run_dir = tmp_path / "storage" / "runs" / "my-task"
    assert (run_dir / "rounds" / "0002" / "update-policies.manifest.json").is_file()
    # result.rounds printed one row per round (0 = baseline, 1, 2)
    assert re.search(r"^\s*2\s", out.stdout, flags=re.M), out.stdout


def test_yaml_block_validates(tmp_path):
    config = tmp_path / "readme.yaml"
    config.write_text(blocks("yaml")[0])
    out = subprocess.run([str(BIN / "pbrl"), "validate", str(config)], cwd=ROOT, env=_env(tmp_path),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.startswith("OK:"), out.stdout + out.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.flow
def test_server_block_registers_the_deployment(tmp_path):
    import httpx

    start, export, serve = _strip(blocks("bash")[1])
    port = _free_port()
    env = _env(tmp_path)
    url = export.split("=", 1)[1].replace("4200", str(port))
    procs = []
    try:
        procs.append(subprocess.Popen([*start.split(), "--port", str(port)], cwd=tmp_path, env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True))
        env["PREFECT_API_URL"] = url
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        else:
            pytest.fail("prefect server did not start")
        procs.append(subprocess.Popen(serve.split(), cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL, start_new_session=True))
        names: set[str] = set()
        while time.monotonic() < deadline and "train" not in names:
            rows = httpx.post(f"{url}/deployments/filter", json={}, timeout=5).json()
            names = {row["name"] for row in rows}
            time.sleep(1)
        mentioned = re.findall(r"pbrl-train/(\w[\w-]*)", README)
        assert mentioned and set(mentioned) <= names, (mentioned, names)
    finally:
        for proc in reversed(procs):
            with_group(proc, signal.SIGTERM)
        for proc in reversed(procs):
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                with_group(proc, signal.SIGKILL)


def with_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass
