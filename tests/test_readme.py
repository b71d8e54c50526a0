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
    assert [line.split()[0] for line in shells[2]] == ["ray", "prefect", "export", "pbrl", "prefect", "pbrl"]
    assert len(shells) == 3


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


@pytest.mark.flow
def test_more_than_one_machine_block_runs_as_written(tmp_path):
    """The "More than one machine" block on one machine: a Ray head, a Prefect server, the deployments on a work
    pool, a worker polling it, and a run with ``--runner ray`` on that Ray head (its shards are on disk)."""
    import httpx

    lines = _strip(blocks("bash")[2])
    ray_port, api_port = _free_port(), _free_port()
    env = _env(tmp_path)
    procs: list[subprocess.Popen] = []
    try:
        for line in lines:
            line = (line.replace("6379", str(ray_port)).replace("4200", str(api_port))
                    .replace("flows/configs/", f"{ROOT}/flows/configs/"))
            if line.startswith("export "):
                key, value = line.split(None, 1)[1].split("=", 1)
                env[key] = value
                continue
            if line.endswith("&"):
                procs.append(subprocess.Popen(line[:-1].split(), cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                                              stderr=subprocess.DEVNULL, start_new_session=True))
                if line.startswith("prefect server"):
                    _wait_healthy(httpx, f"http://127.0.0.1:{api_port}/api")
                continue
            out = subprocess.run(line.split(), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
            assert out.returncode == 0, (line, out.stdout[-3000:], out.stderr[-3000:])
        run_dir = tmp_path / "storage" / "runs" / "tiny-madpo-iter"
        assert (run_dir / "rounds/0002/evaluate.manifest.json").is_file()
        assert (run_dir / "rounds/0002/shards/sample-candidates/0000-of-0001.parquet").is_file()  # ran on Ray
        url = env["PREFECT_API_URL"]
        pools = httpx.post(f"{url}/work_pools/filter", json={}, timeout=10).json()
        assert [p["name"] for p in pools if p["type"] == "process"] == ["pbrl-pool"]
        deployments = httpx.post(f"{url}/deployments/filter", json={}, timeout=10).json()
        assert {d["work_pool_name"] for d in deployments} == {"pbrl-pool"}
    finally:
        for proc in reversed(procs):
            with_group(proc, signal.SIGTERM)
        for proc in reversed(procs):
            try:
                proc.wait(timeout=60)  # `ray start --block` stops its Ray processes first (up to ~40 s here)
            except subprocess.TimeoutExpired:
                with_group(proc, signal.SIGKILL)


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
