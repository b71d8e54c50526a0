"""Ctrl-C during ``pbrl train``: a real process, a real SIGINT to its whole process group (as a terminal sends
it), a clean stop within seconds, no Prefect server left behind, and a resume that finishes the run."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pbrl.data.storage import RunPaths, read_manifest
from tests.unit.front_doors.test_cli import NOISE, ROOT, TINY, pbrl_env, run_pbrl

pytestmark = pytest.mark.flow


def _servers_on(port: str) -> list[int]:
    """PIDs of Prefect API servers listening on ``port`` (Linux /proc)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            args = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:  # not a process, or it ended meanwhile
            continue
        if b"prefect.server.api.server:create_app" in args and port.encode() in args:
            found.append(int(proc.name))
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process groups and /proc")
def test_ctrl_c_stops_within_seconds_and_resume_completes(tmp_path):
    run_dir = tmp_path / "ctrl-c"
    cmd = [
        str(Path(sys.executable).with_name("pbrl")),
        "train",
        str(TINY),
        "--set",
        f"output_dir={tmp_path}",
        "--run-name",
        "ctrl-c",
        "--set",
        "num_iterations=3",
    ]
    # Own session: the SIGINT below reaches every process of this group, exactly as a terminal's Ctrl-C does
    # (before the fix, that included Prefect's ephemeral server, and the client then retried it for minutes).
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=pbrl_env(), start_new_session=True, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        deadline = time.monotonic() + 300
        while not (run_dir / "rounds").is_dir():  # a stage has begun writing
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no stage began within 300 s"
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGINT)
        sent = time.monotonic()
        stdout, stderr = proc.communicate(timeout=60)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 130, stderr
    assert took < 20, f"took {took:.1f} s to stop"
    assert f"stopped; resume with `pbrl train --run {run_dir} --resume`" in stderr
    assert "Traceback" not in stderr, stderr
    port = re.search(r"Starting temporary server on http://127\.0\.0\.1:(\d+)", stderr).group(1)
    assert _servers_on(port) == []  # the ephemeral server was torn down, not orphaned

    out = run_pbrl("train", "--run", str(run_dir), "--resume")
    assert out.returncode == 0, out.stderr
    paths = RunPaths(run_dir)
    for r in (1, 2, 3):
        assert read_manifest(paths, r, "update-policies") is not None, r
    assert read_manifest(paths, 3, "evaluate") is not None
    for noise in NOISE:  # full-weight agents: checkpoints are written and loaded again, all without bars
        assert noise not in out.stderr, (noise, out.stderr)


_LAUNCH = """
import json, sys
from pbrl import orchestration
orchestration.prepare_prefect()
from prefect.server.api.server import SubprocessASGIServer
server = SubprocessASGIServer()
early = server._early
print(json.dumps({"pid": early.pid, "port": server.port, "waited": server.running}), flush=True)
if sys.argv[1] == "use":
    from prefect.client.orchestration import get_client
    with get_client(sync_client=True) as client:  # Prefect's own first use of the API waits for the server
        client.hello()
    print(json.dumps({"process_kept": server.server_process is early}), flush=True)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")
@pytest.mark.parametrize("then", ["use", "exit at once"])
def test_the_temporary_server_is_launched_without_waiting_and_never_outlives_pbrl(tmp_path, then):
    """``prepare_prefect`` only starts the server's process (the imports that follow overlap its start); the first
    use of the API waits for that same process; a pbrl that ends before any use (a config error) leaves none."""
    env = pbrl_env() | {"PREFECT_HOME": str(tmp_path / "prefect-home")}
    env.pop("PREFECT_API_URL", None)
    out = subprocess.run(
        [sys.executable, "-c", _LAUNCH, then], cwd=ROOT, env=env, capture_output=True, text=True, timeout=180
    )
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert lines[0]["waited"] is False  # launched, not awaited
    if then == "use":
        assert lines[1] == {"process_kept": True}  # the launched process answered; no second server
    deadline = time.monotonic() + 15
    while _servers_on(str(lines[0]["port"])) and time.monotonic() < deadline:  # Prefect's exit hook stops it
        time.sleep(0.2)
    assert _servers_on(str(lines[0]["port"])) == []


def test_a_server_object_prefect_made_first_is_left_to_prefects_start():
    """Prefect's client makes a plain ``SubprocessASGIServer`` on its first use of the API (Python code that used
    Prefect before pbrl): launching must leave it alone (it has no ``launch``), and start it only when awaited."""
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from pbrl import orchestration

    before = SubprocessASGIServer._instances.pop(None, None)
    try:
        with temporary_settings(restore_defaults={PREFECT_API_URL}):
            plain = SubprocessASGIServer()
            assert orchestration._ephemeral_server() is plain  # the path below is the one under test
            orchestration._launch_ephemeral_api()
        assert plain.server_process is None and not plain.running
    finally:
        SubprocessASGIServer._instances.pop(None, None)
        if before is not None:
            SubprocessASGIServer._instances[None] = before
