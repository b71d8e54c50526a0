"""``benchmarks/judged_learning.py``'s results page (issue #51): the table of docs/results/judged-learning.md is the
rendering of the committed result file, and the rendering of a hand-built result is worked out here by hand."""

from __future__ import annotations

import json

import pytest

from tests.helpers import BENCHMARKS, benchmark_script


@pytest.fixture(scope="module")
def judged():
    with benchmark_script("judged_learning") as module:
        yield module


def _seed(gain: float, low: float, high: float, judge: list[dict] | None = None) -> dict:
    last = {"round": 2, "paired_gain": gain, "paired_ci": [low, high], "excludes_0": low > 0}
    return {"rounds": [{"round": 0}, {"round": 1}, last], "judge": judge or []}


def test_a_row_per_setting_in_the_benchmarks_order_with_each_seeds_gain(judged):
    judge = [{"round": 1, "questions_asked": 9, "reward_agreement": 0.5},
             {"round": 2, "questions_asked": 16, "reward_agreement": 0.875}]  # fmt: skip
    results = {  # written in another order than SETTINGS; seed 10 sorts after seed 2
        "judge, noise 0, budget 1/2": {"10": _seed(0.1, -0.2, 0.4, judge), "2": _seed(0.3, 0.05, 0.55, judge)},
        "reward": {"0": _seed(0.62, 0.4, 0.82)},
        "judge, noise 0.25": {},
    }
    lines = judged.table(results).splitlines()
    assert lines[2] == "| reward-ordered pairs (no judge) | seed 0: +0.62 [+0.40, +0.82] | +0.62 | 1 of 1 | — | — |"
    assert lines[3] == (  # mean (0.3 + 0.1) / 2 = +0.20; one of the two intervals lies above 0
        "| judge, no noise, half the pairs | seed 2: +0.30 [+0.05, +0.55]; seed 10: +0.10 [−0.20, +0.40] | +0.20 "
        "| 1 of 2 | 16 / 16 | 88% / 88% |"
    )
    assert len(lines) == 4  # a setting without a seed is left out


def test_the_committed_page_shows_the_committed_result(judged):
    result = json.loads((BENCHMARKS / "results" / "judged-learning-smollm2-135m-instruct.json").read_text())
    page = judged.PAGE.read_text(encoding="utf-8")
    shown = page.split(judged.TABLE_START + "\n", 1)[1].split("\n" + judged.TABLE_END, 1)[0]
    assert shown == judged.table(result["results"]), "rerun `python benchmarks/judged_learning.py --page`"
