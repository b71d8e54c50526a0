"""The oracle: batched calls, per-response failures with reasons, transient errors propagate."""

from __future__ import annotations

import math

import httpx
import pytest

from pbrl.errors import OracleError, TransientError
from pbrl.preference.oracle import RewardContractError, call_reward_func, score_batch
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
    import time

    release = threading.Event()

    def stuck(a, b):
        release.wait(60)
        return [1.0] * len(a)

    start = time.monotonic()
    scores = score_batch(stuck, None, [["a", "b"], ["c", "d"]], timeout_s=0.5)
    release.set()
    assert time.monotonic() - start < 30  # returned at the limit, not after the function
    assert [s.failure for s in scores] == [
        "reward_func test_a_reward_that_never_returns_is_a_counted_failure_within_"
        "reward_timeout.<locals>.stuck did not return within reward_timeout=0.5 s"
    ] * 2
    assert score_batch(lambda a, b: [2.0] * len(a), None, [["a"], ["b"]], timeout_s=5)[0].raw == 2.0
