"""Pairwise judges (issue #51, docs/guides/judges.md): the verdicts and their strict reading, the position swap, the
prompt, the answer store, the noisy-label simulator, Python judges, which pairs are asked, and the options' rules.
The stages and flows that use them: tests/unit/judging/test_judge_stages.py."""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

import numpy as np
import pytest

from pbrl.config.loading import load_job
from pbrl.errors import ArtifactError, ConfigError
from pbrl.judging.callable_judge import CallableJudge, read_value
from pbrl.judging.prompt import DEFAULT_TEMPLATE, render, template_problems
from pbrl.judging.simulated import RewardLabelJudge
from pbrl.judging.store import AnswerStore
from pbrl.judging.verdicts import Answer, Comparison, parse_verdict, preference_of
from pbrl.preference.pairs import CandidateRef
from pbrl.preference.questions import (
    Question,
    base_questions,
    cross_questions,
    iterative_questions,
    order_questions,
    within_budget,
)
from tests import judges_ab

ROOT = Path(__file__).resolve().parents[3]
DEMO = ROOT / "flows" / "configs" / "demo.yaml"


def comparison(first=("a short one", "x"), second=("a longer answer", "y"), rewards=None) -> Comparison:
    return Comparison("q1", ("write", "explain"), ("writer", "explainer"), first, second, {"topic": "t"}, rewards)


# ---------------------------------------------------------------------------------------------- verdicts
@pytest.mark.parametrize(
    ("text", "verdict"),
    [
        ("A", "A"),
        ("b", "B"),
        (" tie\n", "tie"),
        ("TIE.", "tie"),
        ("**A**", "A"),
        ('"B".', "B"),
        ("Answer: A", "A"),
        ("answer = b", "B"),
    ],  # fmt: skip
)
def test_a_judges_answer_is_read_when_it_is_exactly_one_verdict(text, verdict):
    assert parse_verdict(text) == (verdict, None)


@pytest.mark.parametrize("text", ["", "A or B", "Response A is better", "AB", "A\nB", "I think A.", "maybe", "1"])
def test_any_other_answer_is_a_drop_with_its_reason_never_a_guess(text):
    verdict, reason = parse_verdict(text)
    assert verdict is None and reason.startswith("unparseable answer:") and "expected exactly A, B or tie" in reason


def test_an_unparseable_answer_is_shown_cut_to_200_characters():
    _, reason = parse_verdict("x" * 1000)
    assert "x" * 200 + "…" in reason and "x" * 201 not in reason


def test_an_answer_without_a_verdict_must_say_why_and_probabilities_are_checked():
    with pytest.raises(ValueError, match="must say why"):
        Answer(None)
    with pytest.raises(ValueError, match="probability"):
        Answer("A", probability=1.5)
    with pytest.raises(ValueError, match="verdict"):
        Answer("C")  # type: ignore[arg-type]


def test_the_two_orders_of_a_pair_combine_by_the_swap_rule():
    a, b, tie = Answer("A"), Answer("B"), Answer("tie")
    lost = Answer(None, reason="unparseable answer: 'hm'")
    # x shown first answered A (x), then y shown first answered B (x): both say x
    assert preference_of([(a, "x"), (b, "y")], "tie") == ("x", None)
    assert preference_of([(b, "x"), (a, "y")], "tie") == ("y", None)
    assert preference_of([(a, "x"), (a, "y")], "tie") == ("tie", None)  # position bias: A both times
    assert preference_of([(a, "x"), (a, "y")], "drop") == (
        None,
        "the two orders disagree (judge_swap_disagreement: drop)",
    )
    assert preference_of([(a, "x"), (tie, "y")], "tie") == ("tie", None)
    assert preference_of([(tie, "x"), (tie, "y")], "drop") == ("tie", None)  # agreeing ties are a tie
    assert preference_of([(b, "y")], "drop") == ("x", None)  # one order only
    assert preference_of([(a, "x"), (lost, "y")], "tie") == (None, "unparseable answer: 'hm'")
    with pytest.raises(ValueError, match="judge_swap_disagreement"):
        preference_of([(a, "x")], "first")


def test_a_comparison_is_keyed_by_its_content_and_order():
    c = comparison()
    assert c.key("j") == comparison().key("j") and len(c.key("j")) == 64
    assert c.swapped().key("j") != c.key("j") and c.swapped().swapped() == c
    assert c.key("another judge") != c.key("j")
    assert Comparison("q1", c.prompts, c.roles, c.first, c.second, {"other": "item"}).key("j") == c.key("j")
    with pytest.raises(ValueError, match="one entry per agent"):
        Comparison("q1", ("p",), ("r", "s"), ("a",), ("b",))


# ---------------------------------------------------------------------------------------------- prompt
def test_the_prompt_shows_every_role_with_its_prompt_and_both_joint_responses_fenced():
    c = comparison(first=("def f():\n    return 1", "it returns ```one```"), second=("f", "g"))
    text = render(DEFAULT_TEMPLATE, c)
    assert "team of 2 agents" in text and text.count("## writer") == 3 and text.count("## explainer") == 3
    a, b = text.index("# Joint response A"), text.index("# Joint response B")
    assert a < text.index("def f():\n    return 1") < b  # the first joint response under A
    assert "````\nit returns ```one```\n````" in text  # a fence longer than the text's own backticks
    assert text.rstrip().endswith("Answer with exactly one word: A, B, or tie.")


def test_a_template_names_only_known_fields_and_both_responses():
    assert template_problems(DEFAULT_TEMPLATE) == []
    assert template_problems("{task} {response_a}") == ["lacks {response_b}"]
    assert template_problems("{response_a} {response_b} {answer}") == [
        "unknown field {answer}; allowed: num_agents, task, response_a, response_b"
    ]
    assert template_problems("{response_a} {response_b} {")[0].startswith("not a format string")
    with pytest.raises(ValueError, match="judge_prompt_template: lacks"):
        render("{response_a}", comparison())


# ---------------------------------------------------------------------------------------------- store
def test_the_store_keeps_every_answer_across_readers_and_a_later_answer_wins(tmp_path):
    path = tmp_path / "judge" / "answers.jsonl"
    store = AnswerStore(path)
    store.put("k1", Answer("A", raw="A", tokens=12, seconds=0.5), judge="j")
    store.put_many([("k2", Answer(None, raw="??", reason="unparseable answer: '??'"), {"judge": "j"})])
    again = AnswerStore(path)
    assert again.get("k1") == Answer("A", raw="A", tokens=12, seconds=0.5) and again.extra("k1") == {"judge": "j"}
    assert again.get("k2").reason == "unparseable answer: '??'" and len(again) == 2 and "k3" not in again
    again.put("k1", Answer("B"))
    assert AnswerStore(path).get("k1") == Answer("B")


def test_a_line_cut_off_by_a_crash_is_ignored_and_removed_before_the_next_answer(tmp_path):
    path = tmp_path / "answers.jsonl"
    AnswerStore(path).put("k1", Answer("A"))
    with open(path, "a") as f:
        f.write('{"key": "k2", "verdict": "B", "probab')  # a kill -9 in the middle of a write
    store = AnswerStore(path)
    assert "k2" not in store and store.get("k1") == Answer("A")
    store.put("k3", Answer("tie"))
    assert AnswerStore(path).get("k3") == Answer("tie") and len(AnswerStore(path)) == 2
    assert path.read_text().count("\n") == 2


def test_a_damaged_line_inside_the_store_is_named(tmp_path):
    path = tmp_path / "answers.jsonl"
    AnswerStore(path).put("k1", Answer("A"))
    path.write_text("not json\n" + path.read_text())
    with pytest.raises(ArtifactError, match="answers.jsonl: line 1 is not a judge's answer .*delete that line"):
        AnswerStore(path)


# ---------------------------------------------------------------------------------------------- the simulator
def test_without_noise_the_simulator_prefers_the_higher_reward_in_either_order():
    judge = RewardLabelJudge(label_noise=0.0, tie_tolerance=0.01)
    c = comparison(rewards=(2.0, 1.0))
    assert [a.verdict for a in judge.answer([c, c.swapped()])] == ["A", "B"]
    assert judge.answer([comparison(rewards=(1.0, 1.005))])[0].verdict == "tie"  # within tie_tolerance
    missing = judge.answer([comparison(rewards=None)])[0]
    assert missing.verdict is None and "no task reward" in missing.reason


def test_noisy_labels_flip_their_share_and_a_pairs_error_does_not_depend_on_the_order():
    judge = RewardLabelJudge(label_noise=0.25, seed=3)
    pairs = [comparison(first=(f"a{i}", "x"), second=(f"b{i}", "y"), rewards=(1.0, 0.0)) for i in range(2000)]
    answers = judge.answer(pairs)
    flipped = sum(a.verdict == "B" for a in answers) / len(answers)
    assert abs(flipped - 0.25) < 0.03  # 2000 draws: the binomial's standard deviation is about 0.01
    assert all(a.probability == 0.75 for a in answers)  # P(A) of the better-rewarded A
    swapped = judge.answer([c.swapped() for c in pairs])
    assert all({a.verdict, s.verdict} == {"A", "B"} for a, s in zip(answers, swapped, strict=True))  # mirrored
    assert judge.answer(pairs) == answers  # seeded: asked again, the same answers
    assert RewardLabelJudge(label_noise=0.25, seed=4).answer(pairs) != answers


def test_bradley_terry_labels_follow_the_sigmoid_of_the_reward_gap():
    judge = RewardLabelJudge(temperature=0.5, seed=1)
    pairs = [comparison(first=(f"a{i}", ""), second=(f"b{i}", ""), rewards=(1.0, 0.5)) for i in range(4000)]
    answers = judge.answer(pairs)
    p = 1 / (1 + math.exp(-(1.0 - 0.5) / 0.5))  # σ(1) = 0.7311
    assert all(a.probability == pytest.approx(p, abs=1e-12) for a in answers)
    assert abs(sum(a.verdict == "A" for a in answers) / len(answers) - p) < 0.025
    assert "bt_temperature=0.5" in judge.name and "noise" not in judge.name


# ---------------------------------------------------------------------------------------------- Python judges
@pytest.mark.parametrize(
    ("value", "verdict", "probability"),
    [
        ("A", "A", None),
        ("tie", "tie", None),
        (0.8, "A", 0.8),
        (0.2, "B", 0.2),
        (0.5, "tie", 0.5),
        (1, "A", 1.0),
        (("B", 0.3), "B", 0.3),
    ],  # fmt: skip
)
def test_a_python_judge_may_return_a_verdict_a_probability_or_both(value, verdict, probability):
    answer = read_value(value, tie_margin=0.0)
    assert (answer.verdict, answer.probability) == (verdict, probability)


def test_a_probability_within_the_tie_margin_is_a_tie():
    assert read_value(0.55, tie_margin=0.1).verdict == "tie" and read_value(0.65, tie_margin=0.1).verdict == "A"


@pytest.mark.parametrize("value", [None, True, float("nan"), 1.5, -0.1, {"winner": "A"}, ("A",), ("C", 0.5), b"A"])
def test_junk_from_a_python_judge_is_a_drop_naming_the_value(value):
    answer = read_value(value, tie_margin=0.0)
    assert answer.verdict is None and f"the judge returned {value!r}"[:40] in answer.reason


def test_a_python_judge_that_raises_drops_that_comparison_only():
    judge = CallableJudge(judges_ab.raising, "tests.judges_ab:raising")
    (answer,) = judge.answer([comparison()])
    assert answer.verdict is None and answer.reason == "the judge raised RuntimeError: the judge's server said no"
    (ok,) = CallableJudge(judges_ab.longer_first_agent, "x").answer([comparison()])
    assert ok.verdict == "B" and ok.raw == "B"  # the second joint response's first agent wrote more


def test_a_python_judge_gets_the_keywords_it_accepts():
    def judge(prompts, first, second, *, item, roles):  # runs in the worker: what it saw comes back as its answer
        seen = item == {"topic": "t"} and roles == ["writer", "explainer"] and prompts == ["write", "explain"]
        item["topic"] = "changed"  # a copy: the next comparison sees the item as it was
        return "A" if seen else "B"

    answers = CallableJudge(judge, "j").answer([comparison(), comparison()])
    assert [a.verdict for a in answers] == ["A", "A"]


def test_a_python_judge_that_hangs_is_stopped_and_fails_only_that_comparison():
    """Issue #53's kind (user code that can hang runs where it can be stopped), for a Python judge: the worker is
    killed at judge_timeout, that comparison has no verdict, the next one gets a fresh worker."""
    short, long = comparison(first=("ab", "x")), comparison(first=("abcd", "x"))
    started = time.monotonic()
    answers = CallableJudge(judges_ab.hangs_on_short, "h", timeout_s=1.0).answer([short, long, short])
    assert time.monotonic() - started < 30
    assert [a.verdict for a in answers] == [None, "B", None]
    assert answers[0].reason == "the judge failed: no answer within 1 s (judge_timeout); its process was stopped"


def test_a_python_judge_that_exits_or_dies_fails_only_its_comparison():
    (exited,) = CallableJudge(judges_ab.exits, "e").answer([comparison()])
    assert exited.verdict is None and exited.reason == "the judge raised SystemExit: 3"

    def dies(prompts, first, second):
        os._exit(7)

    (died,) = CallableJudge(dies, "d").answer([comparison()])
    assert died.verdict is None and died.reason.startswith("the judge failed: its process ended without answering")


# ---------------------------------------------------------------------------------------------- the questions
def test_the_questions_are_the_pairs_the_scores_would_have_decided():
    t, c = "target", "comparator"
    assert [(q.x.index, q.y.index) for q in base_questions([2, 0, 1])] == [(0, 1), (0, 2), (1, 2)]
    assert [(q.x.side, q.x.index, q.y.side) for q in iterative_questions([0, 1, 2], [1, 2, 3])] == [
        (t, 1, c), (t, 2, c)
    ]  # fmt: skip
    refs = [CandidateRef(t, 0, ((t, 0), (t, 0))), CandidateRef(t, 1, ((t, 0), (t, 1))),
            CandidateRef(c, 2, ((t, 0), (c, 0))), CandidateRef(c, 3, ((c, 0), (c, 0)))]  # fmt: skip
    iterative = cross_questions(refs, iterative=True)
    # a target combination against itself with some agents' candidates replaced by comparator ones
    assert [(q.x.index, q.y.index) for q in iterative] == [(0, 2), (0, 3), (1, 2), (1, 3)]
    assert len(cross_questions(refs, iterative=False)) == 6  # any two of four
    assert [q.changed_agents for q in iterative] == [(1,), (0, 1), (1,), (0, 1)]


def test_counterfactual_questions_come_first_agent_by_agent():
    t = "target"

    def ref(n, a, b):
        return CandidateRef(t, n, ((t, a), (t, b)))

    refs = [ref(0, 0, 0), ref(1, 0, 1), ref(2, 1, 0), ref(3, 1, 1)]
    ordered = order_questions(cross_questions(refs, iterative=False), "counterfactual", np.random.default_rng(0))
    changed = [q.changed_agents for q in ordered]
    assert changed[:4] in ([(0,), (1,), (0,), (1,)], [(1,), (0,), (1,), (0,)]) or sorted(changed[:4]) == [
        (0,), (0,), (1,), (1,)
    ]  # fmt: skip
    assert [len(c) for c in changed[:4]] == [1, 1, 1, 1] and [len(c) for c in changed[4:]] == [2, 2]
    assert changed[0] != changed[1]  # the agents take turns
    with pytest.raises(ValueError, match="a judge gives no scores"):
        order_questions([Question(ref(0, 0, 0), ref(1, 0, 1))], "reward_gap", np.random.default_rng(0))


def test_a_budget_keeps_that_many_questions_drawn_at_random():
    per_item = [[1, 2, 3], [4], [5, 6]]
    assert within_budget(per_item, None, np.random.default_rng(0)) == [True] * 6
    kept = within_budget(per_item, 4, np.random.default_rng(0))
    assert sum(kept) == 4 and kept == within_budget(per_item, 4, np.random.default_rng(0))
    assert within_budget(per_item, 10, np.random.default_rng(0)) == [True] * 6


# ---------------------------------------------------------------------------------------------- options
def test_the_demo_runs_with_a_simulated_judge_from_one_line_of_options():
    job = load_job(DEMO, ["preference_source=judge", "judge=reward_noisy", "judge_label_noise=0.1"])
    assert (job.preference_source, job.judge, job.judge_label_noise, job.pair_selection) == (
        "judge", "reward_noisy", 0.1, "counterfactual"
    )  # fmt: skip


def test_every_problem_of_the_judge_options_is_reported_at_once():
    with pytest.raises(ConfigError) as err:
        load_job(DEMO, ["preference_source=judge", "judge_bt_temperature=1.0", "pair_selection=reward_gap",
                        "judge_api_url=https://user:pw@example.com/v1", "judge_model=m"])  # fmt: skip
    problems = {(p.field, p.value) for p in err.value.problems}
    assert ("judge", None) in problems and ("pair_selection", "reward_gap") in problems
    assert ("judge_bt_temperature", 1.0) in problems and ("judge_model", "m") in problems
    assert any(f == "judge_api_url" for f, _ in problems) and "pw" not in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_job(DEMO, ["judge=reward_noisy"])  # a judge, but preferences from the reward
    assert [(p.field, p.value) for p in err.value.problems] == [("judge", "reward_noisy")]
    with pytest.raises(ConfigError) as err:
        load_job(DEMO, ["preference_source=judge", "judge=api", "judge_api_key_env=sk-abc123"])
    fields = {p.field for p in err.value.problems}
    assert fields == {"judge_api_url", "judge_api_key_env"} and "sk-abc123" not in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_job(DEMO, ["preference_source=judge", "judge=tests.judges_ab"])
    assert "import path 'pkg.module:function'" in str(err.value)


# ---------------------------------------------------------------------------------------------- asking
class _PaidJudge:
    """A judge whose every answer costs 30 tokens, counting what it is asked."""

    name = "paid"

    def __init__(self) -> None:
        self.asked = 0

    def answer(self, comparisons):
        self.asked += len(comparisons)
        return [Answer("A", raw="A", tokens=30) for _ in comparisons]


def test_a_token_budget_stops_asking_once_spent_and_stored_answers_cost_nothing(tmp_path):
    from pbrl.judging.asking import OVER_BUDGET, ask

    store, judge = AnswerStore(tmp_path / "answers.jsonl"), _PaidJudge()
    questions = [comparison(first=(f"a{i}", "x")) for i in range(10)]
    asked = ask(judge, questions, store, batch_size=2, token_budget=100)
    # batches of 2 cost 60 tokens each: after two batches (120 >= 100) the rest is not asked
    assert judge.asked == 4 and [a.answer.verdict for a in asked] == ["A"] * 4 + [None] * 6
    assert all(a.answer.reason == OVER_BUDGET for a in asked[4:]) and len(store) == 4
    again = ask(judge, questions, store, batch_size=2, token_budget=100)
    assert [a.stored for a in again[:4]] == [True] * 4 and judge.asked == 8  # the stored four cost nothing
