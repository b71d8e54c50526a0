"""``pbrl deploy --pool`` + ``prefect worker start --pool``: a flow run end to end on a Prefect work pool.

A real ``prefect server start`` on a free port (its own PREFECT_HOME), the deployments registered against a new
process pool, one worker polling it (``--run-once``, from another folder), and a run of
``pbrl-train/config-file`` triggered through the API: the worker picks it up and the run folder is complete.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
POOL = "pbrl-test-pool"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=wait)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


@pytest.mark.flow
def test_deploy_to_a_pool_and_a_worker_runs_the_flow(tmp_path, tiny_model_dir):
    import httpx

    port = _free_port()
    url = f"http://127.0.0.1:{port}/api"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env.update(
        PREFECT_HOME=str(tmp_path / "prefect-home"),
        PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}",
        PREFECT_WORKER_QUERY_SECONDS="1",
    )
    procs: list[subprocess.Popen] = []
    try:
        procs.append(
            subprocess.Popen(
                [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                cwd=tmp_path,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
        )
        env["PREFECT_API_URL"] = url
        deadline = time.monotonic() + 180
        while not _healthy(httpx, url):
            assert time.monotonic() < deadline, "prefect server did not start"
            time.sleep(1)

        out = subprocess.run(
            [
                str(BIN / "pbrl"),
                "deploy",
                "--pool",
                POOL,
                "--nightly-run",
                "nightly-1",
                "--output-dir",
                str(tmp_path / "runs"),
            ],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert out.returncode == 0, out.stdout + out.stderr
        deployments = {d["name"]: d for d in httpx.post(f"{url}/deployments/filter", json={}, timeout=10).json()}
        assert {"train", "config-file", "madpo-iter", "nightly"} <= deployments.keys()
        assert {d["work_pool_name"] for d in deployments.values()} == {POOL}
        assert deployments["nightly"]["schedules"][0]["schedule"]["cron"] == "0 2 * * *"
        assert httpx.get(f"{url}/work_pools/{POOL}", timeout=10).json()["type"] == "process"

        worker_dir = tmp_path / "worker"  # not the checkout: the flows load by module path
        worker_dir.mkdir()
        procs.append(
            subprocess.Popen(
                [str(BIN / "prefect"), "worker", "start", "--pool", POOL, "--run-once"],
                cwd=worker_dir,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
        )
        params = {
            "config": str(ROOT / "flows/configs/tiny-madpo-iter.yaml"),
            "run_name": "pooled",
            "overrides": [
                f"output_dir={tmp_path / 'runs'}",
                f"agent_model={tiny_model_dir}",
                "num_iterations=1",
                "eval_num_samples=2",
                "max_new_tokens=6",
            ],
        }
        run = httpx.post(
            f"{url}/deployments/{deployments['config-file']['id']}/create_flow_run",
            json={"parameters": params},
            timeout=10,
        ).json()
        state = None
        deadline = time.monotonic() + 400
        while state not in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
            assert time.monotonic() < deadline, f"the flow run did not finish (state {state})"
            time.sleep(2)
            state = httpx.get(f"{url}/flow_runs/{run['id']}", timeout=10).json()["state"]["type"]
        assert state == "COMPLETED"
        run_dir = tmp_path / "runs" / "pooled"
        assert (run_dir / "rounds/0001/update-policies.manifest.json").is_file()
        assert (run_dir / "rounds/0001/evaluate.manifest.json").is_file()
        assert procs[-1].wait(timeout=60) == 0  # --run-once: the worker ran this one run and stopped
    finally:
        for proc in reversed(procs):
            _stop(proc)


def _healthy(httpx, url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
