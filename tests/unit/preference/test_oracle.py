"""The oracle: batched calls, per-response failures with reasons, transient errors propagate."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from pbrl.data.storage import RunPaths
from pbrl.errors import OracleError, TransientError
from pbrl.preference.oracle import (
    MAX_TIMEOUTS_PER_ITEM,
    Oracle,
    RewardContractError,
    call_reward_func,
    score_batch,
)
from stages import STAGE_MODULES
from tests.helpers import new_run


def test_called_once_per_batch_with_optional_keywords():
    calls = []

    def reward(a, b, *, prompts=None, batch_items=None):
        calls.append((list(a), list(b), prompts, batch_items))
        return [len(x) + len(y) for x, y in zip(a, b, strict=True)]

    out = score_batch(
        reward,
        lambda r: r / 2,
        [["x", "yy"], ["zzz", ""]],
        prompts=[["p1", "q1"], ["p2", "q2"]],
        batch_items=[{"i": 1}, {"i": 2}],
    )
    assert [(s.raw, s.reward) for s in out] == [(4.0, 2.0), (2.0, 1.0)]
    assert len(calls) == 1 and calls[0][2] == [["p1", "q1"], ["p2", "q2"]] and calls[0][3] == [{"i": 1}, {"i": 2}]


def test_keywords_only_passed_when_accepted():
    assert call_reward_func(lambda a, b: [1.0] * len(a), [["x"], ["y"]], prompts=[["p", "q"]]) == [1.0]


def test_bad_values_drop_only_their_response_with_a_reason():
    def reward(a, b):
        table = {"nan": math.nan, "none": None, "str": "high", "inf": math.inf, "ok": 0.5, "bool": True}
        return [table[x] for x in a]

    out = score_batch(reward, None, [["ok", "nan", "none", "str", "inf", "bool"], [""] * 6])
    assert out[0].ok and out[0].reward == 0.5
    assert [s.ok for s in out[1:]] == [False] * 5
    assert "not finite" in out[1].failure and "not a real number" in out[2].failure
    assert "is a bool (True)" in out[5].failure


def test_every_real_number_type_is_a_reward():
    """numpy scalars, 0-d arrays/tensors and Python numbers are rewards (issue #16.2: np.float32 was dropped)."""
    import numpy as np
    import torch

    values = [np.float32(0.5), np.int64(1), np.array(2.25), torch.tensor(-1.5), 3, 0.125, np.float16(0.75)]
    out = score_batch(lambda a, b: values, None, [["x"] * 7, ["y"] * 7])
    assert [s.failure for s in out] == [None] * 7
    assert [s.raw for s in out] == [0.5, 1.0, 2.25, -1.5, 3.0, 0.125, 0.75]
    assert all(type(s.raw) is float and type(s.reward) is float for s in out)


def test_reward_func_returning_a_numpy_array_is_unpacked():
    import numpy as np

    out = score_batch(lambda a, b: np.array([0.5, 1.0], dtype=np.float32), None, [["x", "y"], ["z", "w"]])
    assert [s.raw for s in out] == [0.5, 1.0]


def test_processor_may_return_numpy_numbers_but_not_bools_or_arrays():
    import numpy as np

    out = score_batch(
        lambda a, b: [1.0, 2.0, 3.0], lambda r: np.float32(r / 4) if r < 3 else np.bool_(True), [["x"] * 3, ["y"] * 3]
    )
    assert [(s.raw, s.reward) for s in out[:2]] == [(1.0, 0.25), (2.0, 0.5)]
    assert not out[2].ok and "is a bool" in out[2].failure and out[2].raw == 3.0
    bad = score_batch(lambda a, b: [np.array([1.0, 2.0])], None, [["x"], ["y"]])
    assert not bad[0].ok and "not a real number" in bad[0].failure


def test_a_raising_batch_is_split_to_find_the_failing_response():
    def reward(a, b):
        if "boom" in a:
            raise KeyError("missing field")
        return [1.0] * len(a)

    out = score_batch(reward, None, [["a", "boom", "c"], ["", "", ""]])
    assert [s.ok for s in out] == [True, False, True]
    assert "KeyError" in out[1].failure


@pytest.mark.parametrize(
    "exc",
    [
        TransientError("rate limited"),
        httpx.ReadTimeout("slow judge"),
        httpx.HTTPStatusError("503", request=httpx.Request("POST", "http://x"), response=httpx.Response(503)),
    ],
)
def test_transient_errors_propagate_for_retry(exc):
    def reward(a, b):
        raise exc

    with pytest.raises(type(exc)):
        score_batch(reward, None, [["a"], ["b"]])


def test_wrong_number_of_values_is_a_contract_error():
    with pytest.raises(RewardContractError, match="returned 1 values for 2"):
        score_batch(lambda a, b: [1.0], None, [["a", "b"], ["c", "d"]])


def _attach_failing_task(run_dir):
    from pbrl.run.task import attach_task
    from pbrl.tasks.base import Task
    from pbrl.tasks.registry import get_task

    toy = get_task("toy", num_items=4)

    def failing(*completions, batch_items=None):
        return [math.nan if item["item_id"] == "toy-001" else 1.0 for item in batch_items]

    attach_task(run_dir, Task(name="toy", formatters=toy.formatters, reward_func=failing))


def test_round_stops_past_the_failure_share_naming_items(tiny_model_dir, tmp_path):
    run_dir, job = new_run(tiny_model_dir, tmp_path, oracle_max_failure_share=0.2)
    STAGE_MODULES["sample-candidates"].run(run_dir, 1, job)
    _attach_failing_task(run_dir)
    # toy-001's 6 joint responses (3 target + 3 comparator) of 24 fail: 25 % > 20 %.
    with pytest.raises(OracleError, match=r"6 of 24 .*toy-001 \(6\)"):
        STAGE_MODULES["score-with-oracle"].run(run_dir, 1, job)


def test_failures_under_the_share_are_dropped_and_counted(tiny_model_dir, tmp_path):
    run_dir, job = new_run(tiny_model_dir, tmp_path, oracle_max_failure_share=0.3)
    STAGE_MODULES["sample-candidates"].run(run_dir, 1, job)
    _attach_failing_task(run_dir)
    manifest = STAGE_MODULES["score-with-oracle"].run(run_dir, 1, job)
    assert manifest.counts == {"joint_responses": 24, "failed": 6}
    assert any("6 joint response(s) dropped: reward is not finite" in m for m in manifest.messages)
    pairs = STAGE_MODULES["build-pairs"].run(run_dir, 1, job)
    assert pairs.counts["items_without_pairs"] >= 1  # toy-001 has no scored candidates left


def test_each_joint_response_gets_its_own_copy_of_its_item():
    """Issue #29: every joint response of an item received the same dict, so a reward that changes it scored
    identical logic 1, 2 on one side and 3, 4 on the other."""

    def counting_reward(a, b, batch_items=None):
        out = []
        for item in batch_items:
            item["calls"] = item.get("calls", 0) + 1
            out.append(float(item["calls"]))
        return out

    item = {"item_id": "x"}
    scores = score_batch(counting_reward, None, [["a"] * 4, ["b"] * 4], batch_items=[item] * 4)
    assert [s.raw for s in scores] == [1.0, 1.0, 1.0, 1.0] and item == {"item_id": "x"}


def test_a_reward_that_never_returns_is_a_counted_failure_within_reward_timeout():
    """Issue #29: a reward function that never returned hung the run without a word."""
    import threading

    release = threading.Event()

    def stuck(a, b):
        release.wait(60)
        return [1.0] * len(a)

    scores = score_batch(stuck, None, [["a"], ["c"]], timeout_s=0.5)
    assert [s.failure for s in scores] == [
        "reward_func test_a_reward_that_never_returns_is_a_counted_failure_within_"
        "reward_timeout.<locals>.stuck did not return within reward_timeout=0.5 s (its worker process was stopped)"
    ]
    assert score_batch(lambda a, b: [2.0] * len(a), None, [["a"], ["b"]], timeout_s=5)[0].raw == 2.0


def _looping_reward(pid_file: Path):
    """A reward that writes its process id, then loops forever on a completion that says "loop"."""

    def reward(a, b):
        with open(pid_file, "a") as f:
            f.write(f"{os.getpid()}\n")
        if "loop" in a:
            while True:
                pass
        return [float(len(x)) for x in a]

    return reward


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_timed_out_reward_is_stopped_and_fails_only_what_timed_out(tmp_path):
    """Issue #53.1: a timed-out reward kept computing in an abandoned thread (3 tiny rounds: 209 s instead of 44 s),
    and one looping joint response failed every correct one of its call."""
    pid_file = tmp_path / "pids"
    scores = score_batch(_looping_reward(pid_file), None, [["a", "loop", "ccc"], ["", "", ""]], timeout_s=0.5)
    assert [s.raw for s in scores] == [1.0, None, 3.0]
    assert "did not return within reward_timeout=0.5 s" in scores[1].failure
    pids = {int(line) for line in pid_file.read_text().split()}
    assert os.getpid() not in pids  # the reward ran in a worker process ...
    assert not any(_alive(pid) for pid in pids)  # ... and no worker is left computing


def test_the_processes_a_timed_out_reward_started_are_stopped_too(tmp_path):
    pid_file = tmp_path / "child"

    def reward(a, b):
        child = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        pid_file.write_text(str(child.pid))
        child.wait()
        return [1.0]

    (score,) = score_batch(reward, None, [["a"], ["b"]], timeout_s=1.0)
    assert "did not return" in score.failure
    pid = int(pid_file.read_text())
    for _ in range(100):  # the killed grandchild is reaped by init, not by us: wait until it is gone
        if not _alive(pid) or _is_zombie(pid):
            break
        threading.Event().wait(0.05)
    assert not _alive(pid) or _is_zombie(pid)


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_an_item_on_which_the_reward_hangs_is_given_up_after_two_timeouts_and_no_other_item_is(tmp_path):
    """Bounded cost: the batch call and MAX_TIMEOUTS_PER_ITEM single calls of the hanging item, not one limit per
    joint response; the items after it are still scored."""
    pid_file = tmp_path / "pids"
    items = [{"item_id": "a"}] * 4 + [{"item_id": "b"}] * 2
    texts = ["loop"] * 4 + ["x", "yy"]
    scores = score_batch(_looping_reward(pid_file), None, [texts, [""] * 6], batch_items=items, timeout_s=0.3)
    assert ["did not return" in (s.failure or "") for s in scores] == [True, True, False, False, False, False]
    assert ["not called: 2 joint responses of item 'a'" in (s.failure or "") for s in scores[2:4]] == [True, True]
    assert [s.raw for s in scores[4:]] == [1.0, 2.0]
    assert len(pid_file.read_text().split()) == 1 + MAX_TIMEOUTS_PER_ITEM + 2


def test_past_the_failure_budget_the_oracle_stops_at_once(tmp_path):
    pid_file = tmp_path / "pids"
    items = [{"item_id": str(i)} for i in range(6)]
    with Oracle(_looping_reward(pid_file), None, timeout_s=0.3, max_failures=2) as oracle:
        with pytest.raises(OracleError, match="3 joint responses could not be scored, more than .* allows \\(2\\)"):
            oracle.score([["loop"] * 6, [""] * 6], batch_items=items)
    assert len(pid_file.read_text().split()) == 1 + 3  # the batch, then three single calls: no more


def test_one_worker_serves_every_call_of_an_oracle_and_a_fresh_one_follows_a_timeout(tmp_path):
    pid_file = tmp_path / "pids"
    with Oracle(_looping_reward(pid_file), None, timeout_s=2.0) as oracle:
        oracle.score([["a"], [""]])
        oracle.score([["bb"], [""]])
        first = pid_file.read_text().split()
        assert len(set(first)) == 1  # a reward's state (a loaded model, a client) lives as long as the stage
        oracle.timeout_s = 0.3
        oracle.score([["loop"], [""]])
        oracle.score([["c"], [""]])
    pids = pid_file.read_text().split()
    assert pids[2] == first[0] and pids[3] != first[0]


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ("sys.exit(0)", "reward_func raised SystemExit"),
        ("os._exit(3)", "worker process ended without answering (exit status 3)"),
        ("raise Unpicklable()", "reward_func raised Unpicklable"),
    ],
)
def test_a_reward_that_exits_or_raises_the_unsendable_fails_its_response_not_the_run(body, expected):
    class Unpicklable(Exception):
        def __reduce__(self):
            raise TypeError("no pickling")

    def reward(a, b):
        if "bad" in a:
            exec(body, {"sys": sys, "os": os, "Unpicklable": Unpicklable})
        return [1.0] * len(a)

    scores = score_batch(reward, None, [["ok", "bad"], ["", ""]], timeout_s=30)
    assert scores[0].raw == 1.0 and expected in scores[1].failure


def test_a_transient_error_that_does_not_pickle_stays_transient_through_the_worker():
    def reward(a, b):
        raise httpx.HTTPStatusError("503", request=httpx.Request("POST", "http://x"), response=httpx.Response(503))

    with pytest.raises(TransientError, match="HTTPStatusError"):
        score_batch(reward, None, [["a"], ["b"]], timeout_s=30)


def test_a_looping_processor_is_stopped_like_a_looping_reward():
    def processor(r):
        while r > 1:
            pass
        return r

    scores = score_batch(lambda a, b: [float(len(x)) for x in a], processor, [["a", "bb"], ["", ""]], timeout_s=0.5)
    assert scores[0].reward == 1.0 and "did not return" in scores[1].failure


def _attach_reward(run_dir, reward):
    from pbrl.run.task import attach_task
    from pbrl.tasks.base import Task
    from pbrl.tasks.registry import get_task

    toy = get_task("toy", num_items=4)
    attach_task(run_dir, Task(name="toy", formatters=toy.formatters, reward_func=reward))


def test_an_evaluation_that_measured_nothing_stops_the_round_naming_why(tiny_model_dir, tmp_path):
    """Issue #53.1: every evaluation draw failed, and the run ended "successfully" with an empty eval column."""
    run_dir, job = new_run(tiny_model_dir, tmp_path, reward_timeout=0.5, oracle_max_failure_share=1.0)

    def looping(*completions, batch_items=None):
        while True:
            pass

    _attach_reward(run_dir, looping)
    with pytest.raises(OracleError, match=r"evaluate round 0 .* the reward failed on every draw \(2 of 2 failed\)"):
        STAGE_MODULES["evaluate"].run(run_dir, 0, job)
    assert not RunPaths(run_dir).manifest(0, "evaluate").exists()  # not done: a resume evaluates again
    # with the default share (0.5) it stops as soon as the second draw failed, naming the stage and the items
    job = job.model_copy(update={"oracle_max_failure_share": 0.5})
    with pytest.raises(OracleError, match=r"^evaluate round 0: 2 joint responses .* items: toy-000 \(1\), toy-001"):
        STAGE_MODULES["evaluate"].run(run_dir, 0, job)


def test_an_evaluation_with_one_failed_draw_says_so_and_measures_the_rest(tiny_model_dir, tmp_path):
    run_dir, job = new_run(tiny_model_dir, tmp_path, eval_samples_per_item=2, reward_timeout=5.0)

    def one_fails(*completions, batch_items=None):
        return [math.nan if i == 0 else 1.0 for i, _ in enumerate(batch_items)]

    _attach_reward(run_dir, one_fails)
    manifest = STAGE_MODULES["evaluate"].run(run_dir, 0, job)
    assert manifest.counts["failed"] == 1 and manifest.metrics["eval/reward_mean"] == 1.0
    assert "1 of 4 evaluation draw(s) could not be scored: {'reward is not finite': 1}" in manifest.messages
