"""One cache record per stage run (issue #16, item 3): the stage manifest holds the key, Prefect's cache
follows it, and no state of Prefect's own files in ``<run>/.prefect/`` blocks, hangs or fails a resume.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow.parquet as pq
import pytest

import pbrl.run.task
import tests.rewards_ab as rewards_ab
from flows.cache import ExpiringFileLocks, settle_lock
from flows.round import round_flow
from pbrl.data.storage import RunPaths, read_manifest
from pbrl.errors import ArtifactError
from tests.helpers import new_run

ROUND_STAGES = (
    "sample-candidates",
    "score-with-oracle",
    "build-pairs",
    "store-round",
    "replay-select",
    "update-policies",
    "evaluate",
)


def executed(states: list[dict]) -> set[str]:
    return {s["stage"] for s in states if s["state"] != "Cached"}


@contextlib.contextmanager
def within(seconds: int) -> Iterator[None]:
    """Fail (instead of hanging the suite) when the block takes longer than ``seconds``."""

    def expire(signum, frame):
        raise TimeoutError(f"still running after {seconds} s: a lock blocked the resume")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def manifests(run_dir: Path) -> dict[str, dict]:
    return {s: json.loads(RunPaths(run_dir).manifest(1, s).read_text()) for s in ROUND_STAGES}


def prefect_result(run_dir: Path, key: str) -> dict:
    """The result Prefect stored for ``key`` (a JSON record: metadata, and the result as a JSON string)."""
    return json.loads(json.loads((run_dir / ".prefect" / "results" / key).read_text())["result"])


@pytest.fixture(scope="module")
def finished_round(tiny_model_dir, tmp_path_factory, prefect_api) -> tuple[Path, object]:
    run_dir, job = new_run(tiny_model_dir, tmp_path_factory.mktemp("template"))
    round_flow(str(run_dir), "run", 1, job)
    return run_dir, job


@pytest.fixture
def run_copy(finished_round, tmp_path) -> tuple[Path, object]:
    """A copy of the finished round, elsewhere: the same run (same id), so every stage is still valid."""
    src, job = finished_round
    shutil.copytree(src, tmp_path / "elsewhere")
    return tmp_path / "elsewhere", job


# ---------------------------------------------------------------------------------------------- A -> B -> A
@pytest.mark.flow
@pytest.mark.usefixtures("prefect_api")
def test_reward_a_then_b_then_a_leaves_scores_manifest_and_state_of_a(tiny_model_dir, tmp_path, monkeypatch):
    """Before the fix the third run came back Cached with A's stored manifest while scores.parquet held B's
    scores (and later stages built on B)."""
    run_dir, job = new_run(tiny_model_dir, tmp_path, reward_func="tests.rewards_ab:reward")
    paths = RunPaths(run_dir)

    def train_round(reward: Callable) -> dict[str, dict]:
        monkeypatch.setattr(rewards_ab, "reward", reward)  # the user edits the function behind the path
        monkeypatch.setattr(pbrl.run.task, "_ATTACHED_TASKS", {})  # a new process: the task is imported afresh
        return {s["stage"]: s for s in round_flow(str(run_dir), "run", 1, job)}

    def agent0_lengths() -> dict[tuple, float]:
        rows = pq.read_table(paths.candidates(1)).to_pylist()
        return {
            (r["item_id"], r["side"], r["candidate_index"]): float(len(r["completion"]))
            for r in rows
            if r["agent_index"] == 0
        }

    def raw_scores() -> dict[tuple, float]:
        return {
            (r["item_id"], r["side"], r["candidate_index"]): r["raw_reward"]
            for r in pq.read_table(paths.scores(1)).to_pylist()
        }

    first = train_round(rewards_ab.reward_a)
    lengths = agent0_lengths()  # reward A of a joint response = characters of agent 0's completion
    assert raw_scores() == lengths
    second = train_round(rewards_ab.reward_b)
    assert second["score-with-oracle"]["state"] == "Completed"
    assert raw_scores() == {k: -v for k, v in lengths.items()}
    third = train_round(rewards_ab.reward_a)

    # The task's fingerprint is in every stage's key: each stage's record is A's again.
    assert {s: third[s]["manifest"]["cache_key"] for s in ROUND_STAGES} == {
        s: first[s]["manifest"]["cache_key"] for s in ROUND_STAGES
    }
    score = third["score-with-oracle"]
    assert score["state"] == "Completed"  # B's scores were on disk: A's are computed again
    assert raw_scores() == lengths
    on_disk = read_manifest(paths, 1, "score-with-oracle")
    assert score["manifest"] == on_disk.model_dump(mode="json")
    assert on_disk.cache_key == first["score-with-oracle"]["manifest"]["cache_key"]
    assert prefect_result(run_dir, on_disk.cache_key) == score["manifest"]  # Prefect's cache follows
    # Later stages were rebuilt on A's scores, not left on B's.
    pairs = read_manifest(paths, 1, "build-pairs")
    assert pairs.inputs[paths.rel(paths.scores(1))] == on_disk.outputs[paths.rel(paths.scores(1))]
    assert third["build-pairs"]["state"] == "Completed"
    # And A once more: everything is the record of A, nothing runs.
    assert executed(list(train_round(rewards_ab.reward_a).values())) == set()


# ---------------------------------------------------------------------------------------------- Prefect's files
def _dead_locks(locks: list[Path]) -> None:
    # A process took these locks for an hour (recording itself as their owner first), then was killed. One process
    # for all of them: each start imports flows.cache (Prefect, torch), ~8 s on 2 cores.
    code = (
        "import sys; from pathlib import Path; from flows.cache import ExpiringFileLocks; "
        "locks = ExpiringFileLocks(Path(sys.argv[1]), hold_timeout=3600, acquire_timeout=0.1); "
        "assert all(locks.acquire_lock(key, 'tx-killed') for key in sys.argv[2:])"
    )
    subprocess.run([sys.executable, "-c", code, str(locks[0].parent), *(lock.stem for lock in locks)], check=True)
    assert json.loads((locks[0].parent / "tx-killed.owner").read_text())["pid"] > 0


def _lock_without_owner(lock: Path) -> None:
    # Valid for an hour, but its holder never recorded its process (died in between, or not pbrl's lock).
    expiry = datetime.now(UTC) + timedelta(hours=1)
    lock.write_text(json.dumps({"holder": "tx-unknown", "expiration": str(expiry)}))


def _truncate(f: Path) -> None:
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


BAD_STATES: dict[str, Callable[[Path, Path], None] | None] = {
    "result missing": lambda result, lock: result.unlink(),
    "result empty": lambda result, lock: result.write_bytes(b""),
    "result truncated": lambda result, lock: _truncate(result),
    "lock holding only a holder": lambda result, lock: lock.write_text('{"holder": "tx-1"}'),
    "lock with expiry null": lambda result, lock: lock.write_text('{"holder": "tx-1", "expiration": null}'),
    "lock empty": lambda result, lock: lock.write_bytes(b""),
    "lock truncated": lambda result, lock: lock.write_text('{"holder": "tx-1", "expir'),
    "lock of a dead process": None,  # all the stages' locks at once: _dead_locks
    "lock without a recorded owner": lambda result, lock: _lock_without_owner(lock),
}


def _spoil(bad_state: str, run_dir: Path, keys: list[str]) -> None:
    """Puts the Prefect record and lock of each cache key in `bad_state`."""
    locks = run_dir / ".prefect" / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    spoil = BAD_STATES[bad_state]
    if spoil is None:
        _dead_locks([locks / f"{key}.lock" for key in keys])
        return
    for key in keys:
        spoil(run_dir / ".prefect" / "results" / key, locks / f"{key}.lock")


@pytest.mark.flow
@pytest.mark.usefixtures("prefect_api")
@pytest.mark.parametrize("bad_state", list(BAD_STATES))
def test_bad_prefect_files_never_block_an_intact_resume(run_copy, bad_state):
    run_dir, job = run_copy
    before = manifests(run_dir)
    keys = [before[stage]["cache_key"] for stage in ROUND_STAGES]
    _spoil(bad_state, run_dir, keys)
    with within(120):
        out = round_flow(str(run_dir), "run", 1, job)
    assert executed(out) == set()
    assert manifests(run_dir) == before  # nothing recomputed or rewritten
    for s in out:
        assert s["manifest"] == before[s["stage"]]  # the flow reports the record
        assert prefect_result(run_dir, before[s["stage"]]["cache_key"]) == before[s["stage"]]


@pytest.mark.flow
@pytest.mark.usefixtures("prefect_api")
def test_prefect_cache_that_disagrees_or_is_gone_follows_the_manifests(run_copy):
    run_dir, job = run_copy
    before = manifests(run_dir)
    results = run_dir / ".prefect" / "results"
    # score-with-oracle's Prefect record now holds sample-candidates' manifest: the manifest wins.
    keys = {stage: m["cache_key"] for stage, m in before.items()}
    shutil.copyfile(results / keys["sample-candidates"], results / keys["score-with-oracle"])
    out = round_flow(str(run_dir), "run", 1, job)
    assert executed(out) == set()
    assert {s["stage"]: s["manifest"] for s in out} == before
    shutil.rmtree(run_dir / ".prefect")
    out = round_flow(str(run_dir), "run", 1, job)
    assert executed(out) == set() and {s["stage"]: s["manifest"] for s in out} == before


@pytest.mark.flow
@pytest.mark.usefixtures("prefect_api")
def test_a_round_recorded_under_another_code_version_resumes_and_runs_every_stage_once(run_copy, monkeypatch):
    """A run made before a change to the sources stages run (flows/code_version.py) is not refused: its stage
    keys no longer match, so every stage runs again, once, and writes the same outputs."""
    run_dir, job = run_copy
    before = manifests(run_dir)
    monkeypatch.setattr("flows.cache.code_version", lambda: "0.1.0+another")
    out = round_flow(str(run_dir), "run", 1, job)
    assert executed(out) == set(ROUND_STAGES)
    after = manifests(run_dir)
    for stage in ROUND_STAGES:
        assert after[stage]["code_version"] == "0.1.0+another"
        assert after[stage]["cache_key"] != before[stage]["cache_key"]
        assert after[stage]["outputs"] == before[stage]["outputs"]
    assert executed(round_flow(str(run_dir), "run", 1, job)) == set()


@pytest.mark.flow
@pytest.mark.usefixtures("prefect_api")
@pytest.mark.parametrize(
    "bad_state",
    ["lock holding only a holder", "lock truncated", "lock of a dead process", "lock without a recorded owner"],
)
def test_bad_lock_of_a_stage_that_must_run_neither_hangs_nor_fails(run_copy, bad_state, monkeypatch):
    monkeypatch.setattr("flows.cache.LOCK_WAIT_SECONDS", 1.0)
    run_dir, job = run_copy
    paths = RunPaths(run_dir)
    key = read_manifest(paths, 1, "build-pairs").cache_key
    pairs_before = paths.pairs(1).read_bytes()
    paths.pairs(1).unlink()  # the stage must run again
    _spoil(bad_state, run_dir, [key])
    with within(120):
        out = round_flow(str(run_dir), "run", 1, job)
    assert executed(out) == {"build-pairs"}
    assert paths.pairs(1).read_bytes() == pairs_before
    assert read_manifest(paths, 1, "build-pairs").cache_key == key


# ---------------------------------------------------------------------------------------------- locks
def test_every_lock_expires_after_its_hold_timeout(tmp_path):
    """Prefect's transactions take locks with no timeouts; ours expire, so a killed holder frees its key."""
    first = ExpiringFileLocks(tmp_path, hold_timeout=1.0, acquire_timeout=0.1)
    assert first.acquire_lock("k", "tx-1")
    info = json.loads((tmp_path / "k.lock").read_text())
    assert info["holder"] == "tx-1" and info["expiration"] is not None
    locks = ExpiringFileLocks(tmp_path, hold_timeout=1.0, acquire_timeout=0.1)
    assert not locks.acquire_lock("k", "tx-2")  # still held: the wait is bounded (0.1 s), not forever
    time.sleep(1.1)
    assert locks.acquire_lock("k", "tx-2")  # expired: taken
    assert locks.is_lock_holder("k", "tx-2")


def test_a_live_holder_is_waited_for_then_named(tmp_path, monkeypatch):
    monkeypatch.setattr("flows.cache.LOCK_WAIT_SECONDS", 0.4)
    locks = ExpiringFileLocks(tmp_path / ".prefect" / "locks", hold_timeout=60, acquire_timeout=0.1)
    assert locks.acquire_lock("k1", "tx-live")  # held by this (live) process
    with pytest.raises(ArtifactError, match=rf"build-pairs round 2 is being run by process {os.getpid()}"):
        settle_lock(tmp_path, "k1", "build-pairs", 2)
    locks.release_lock("k1", "tx-live")
    assert not (tmp_path / ".prefect" / "locks" / "tx-live.owner").exists()
    settle_lock(tmp_path, "k1", "build-pairs", 2)  # free: returns at once


def test_a_stage_that_outlives_its_lock_still_releases_cleanly(tmp_path):
    """Prefect raises when a transaction releases a lock that expired; that must not fail a finished stage."""
    locks = ExpiringFileLocks(tmp_path, hold_timeout=0.2, acquire_timeout=0.1)
    assert locks.acquire_lock("k", "tx-slow")
    time.sleep(0.3)
    locks.release_lock("k", "tx-slow")  # no error
    assert not (tmp_path / "tx-slow.owner").exists() and not locks.is_locked("k")
