"""Faults found by hostile testing of the judges (2026-12-06), each with the input that found it: a judge's failure
kept as its answer, a prompt template outside the run folder, answers that take quadratic time to read, token counts
and time limits too large to store or wait for, options of another judge silently ignored, credential messages that
named the comparator's options, and a judge's value whose repr raises or whose text has no end."""

from __future__ import annotations

import json

import pytest

from flows.cache import stage_key
from pbrl.config.loading import load_job
from pbrl.errors import ArtifactError, ConfigError, OracleError
from pbrl.generation.api_formats import MAX_REPORTED_TOKENS, usage_tokens
from pbrl.judging import verdicts
from pbrl.judging.asking import ask
from pbrl.judging.callable_judge import read_value
from pbrl.judging.human import looks_like_code, segments
from pbrl.judging.store import AnswerStore
from pbrl.judging.verdicts import JUDGE_FAILED, RAW_CHARS, Answer, parse_verdict
from stages import STAGE_MODULES
from tests.unit.judging.test_judge_stages import JUDGED, run_round, start
from tests.unit.judging.test_judges import DEMO, comparison


# ---------------------------------------------------------------------------------------------- failures re-asked
class _Flaky:
    """A judge that raises until ``fixed``; counts what it is asked."""

    name = "flaky"

    def __init__(self) -> None:
        self.fixed, self.asked = False, 0

    def answer(self, comparisons):
        self.asked += len(comparisons)
        if not self.fixed:
            return [Answer(None, reason="the judge raised RuntimeError: nope") for _ in comparisons]
        return [Answer("A", raw="A") for _ in comparisons]


def test_a_judge_that_raised_timed_out_or_died_is_asked_again_and_its_failure_never_stored(tmp_path):
    store, judge = AnswerStore(tmp_path / "answers.jsonl"), _Flaky()
    questions = [comparison(first=(f"a{i}", "x")) for i in range(3)]
    assert [a.answer.verdict for a in ask(judge, questions, store)] == [None] * 3
    assert len(store) == 0 and not (tmp_path / "answers.jsonl").exists()  # no failure kept as an answer
    judge.fixed = True
    asked = ask(judge, questions, store)
    assert [a.answer.verdict for a in asked] == ["A"] * 3 and judge.asked == 6 and len(store) == 3
    # a failure stored by an earlier version is not reused either
    old = AnswerStore(tmp_path / "old.jsonl")
    old.put(questions[0].key("flaky"), Answer(None, reason=f"{JUDGE_FAILED}: no answer within 3 s (judge_timeout)"))
    assert ask(judge, questions[:1], old)[0].stored is False and judge.asked == 7


def test_a_fixed_python_judge_answers_on_the_resume_of_the_round_its_exceptions_stopped(
    tiny_model_dir, tmp_path, monkeypatch
):
    monkeypatch.setenv("PBRL_TEST_JUDGE_BROKEN", "1")
    run_dir, job = start(tiny_model_dir, tmp_path, judge="tests.judges_ab:broken_until_fixed", **JUDGED)
    with pytest.raises(OracleError, match="the judge raised or failed"):
        run_round(run_dir, job, 1, until="judge-pairs")
    monkeypatch.delenv("PBRL_TEST_JUDGE_BROKEN")  # the user fixed the judge
    manifest = STAGE_MODULES["judge-pairs"].run(run_dir, 1, job)  # the resume (or `pbrl stage ... --force`)
    assert manifest.counts["answers_asked"] == manifest.counts["askings"] > 0
    assert manifest.counts["no_verdict"] == 0


# ---------------------------------------------------------------------------------------------- the template
def test_a_prompt_template_outside_the_run_folder_is_an_input_named_by_its_file_name(tiny_model_dir, tmp_path):
    template = tmp_path / "elsewhere" / "judge.txt"
    template.parent.mkdir()
    template.write_text("A: {response_a}\nB: {response_b}\nAnswer A, B or tie.\n")
    run_dir, job = start(tiny_model_dir, tmp_path / "run", judge="local", judge_model=str(tiny_model_dir),
                         judge_prompt_template=str(template), judge_max_pairs=2, **JUDGED)  # fmt: skip
    manifest = run_round(run_dir, job, 1, until="judge-pairs")["judge-pairs"]  # failed: "not in the subpath"
    assert "outside:judge.txt" in manifest.inputs and str(tmp_path) not in json.dumps(manifest.inputs)
    key = stage_key("judge-pairs", run_dir, 1, job)
    template.write_text("Which is better?\nA: {response_a}\nB: {response_b}\nAnswer A, B or tie.\n")
    assert stage_key("judge-pairs", run_dir, 1, job) != key  # its content is part of the key


# ---------------------------------------------------------------------------------------------- reading answers
class _Spans:
    """Records the length of every span :data:`pbrl.judging.verdicts._ANSWER` is matched on."""

    def __init__(self, pattern) -> None:
        self.pattern, self.lengths = pattern, []

    def fullmatch(self, text, begin, end):
        self.lengths.append(end - begin)
        return self.pattern.fullmatch(text, begin, end)


@pytest.mark.parametrize(
    "text", ["-" * 20_000 + "x", "-" * 1_000_000 + "A" + "-" * 1_000_000, "answer:" + " " * 20_000]
)
def test_a_long_answer_is_read_in_linear_time_the_pattern_never_sees_more_than_a_short_line(text, monkeypatch):
    """Found: '-' * 20,000 + 'x' took 7.5 s to read (the pattern backtracked quadratically), 1 MB would take hours."""
    spans = _Spans(verdicts._ANSWER)
    monkeypatch.setattr(verdicts, "_ANSWER", spans)
    verdict, reason = parse_verdict(text)
    assert all(n <= 100 for n in spans.lengths)
    assert (verdict, reason is None) == (("A", True) if "A" in text else (None, False))


def test_a_person_sees_code_and_fences_found_line_by_line_in_any_text():
    """Found: 20,000 blank lines took 3 s to classify, and 4,000 opening fences without a close 0.8 s (quadratic)."""
    assert looks_like_code("\n" * 20_000 + "x") is False and looks_like_code("x = 1\n\n    def f():\n  pass")
    assert segments("```a\n" * 4000) == [("text", ("```a\n" * 4000).strip("\n"))]  # no fence ever closes
    assert segments("a\n```py\nx = 1\n```\nb") == [("text", "a"), ("code", "x = 1"), ("text", "b")]
    assert segments("say\n```py\nunclosed") == [("text", "say\n```py\nunclosed")]
    assert segments("```\n```\n```") == [("code", ""), ("text", "```")]


# ---------------------------------------------------------------------------------------------- numbers
def test_a_token_count_beyond_any_bill_is_capped_and_an_answer_holds_only_storable_numbers(tmp_path):
    """Found: an API that reported 10**30 tokens crashed writing verdicts.parquet, and every retry after it."""
    assert usage_tokens("openai", {"usage": {"total_tokens": 10**30}}) == MAX_REPORTED_TOKENS == verdicts.MAX_TOKENS
    assert usage_tokens("anthropic", {"usage": {"input_tokens": 10**12, "output_tokens": 5}}) == 10**12
    for bad in ({"tokens": 10**30}, {"tokens": -1}, {"tokens": 1.5}, {"seconds": float("inf")}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            Answer("A", **bad)
    path = tmp_path / "answers.jsonl"
    line = {
        "key": "k",
        "verdict": "A",
        "probability": None,
        "raw": "A",
        "tokens": 10**30,
        "seconds": 0.1,
        "reason": None,
    }
    path.write_text(json.dumps(line) + "\n")  # written by a version before the cap
    with pytest.raises(ArtifactError, match="line 1 is not a judge's answer"):
        AnswerStore(path)


def test_time_limits_are_at_most_a_week_and_label_waits_at_most_a_year():
    """Found: judge_timeout 1e10 passed validation, then failed every comparison ("timestamp too large")."""
    with pytest.raises(ConfigError) as err:
        load_job(DEMO, ["preference_source=judge", "judge=tests.judges_ab:counted", "judge_timeout=1e10",
                        "reward_timeout=1e300", "comparator_api_timeout=604801"])  # fmt: skip
    assert {(p.field, p.message) for p in err.value.problems} == {
        ("judge_timeout", "must be in (0, 604800]"),
        ("reward_timeout", "must be in (0, 604800]"),
        ("comparator_api_timeout", "must be in (0, 604800]"),
    }
    with pytest.raises(ConfigError, match=r"judge_label_timeout_hours: got 1000000.0; must be in \(0, 8760\] or None"):
        load_job(DEMO, ["preference_source=judge", "judge=human", "judge_label_timeout_hours=1e6"])


# ---------------------------------------------------------------------------------------------- options
def test_options_of_another_judge_or_of_no_judge_are_refused_all_at_once():
    """Found: these passed validation without a judge and were silently ignored (others of the kind were refused)."""
    with pytest.raises(ConfigError) as err:
        load_job(DEMO, ["judge_max_pairs=3", "judge_swap_disagreement=drop", "judge_tie_margin=0.2",
                        "judge_api_format=anthropic", "judge_batch_size=7", "judge_timeout=5",
                        "judge_pair_choice=uncertain", "judge_position_swap=true",
                        "judge_api_headers={X-Team: a}"])  # fmt: skip
    assert {p.field for p in err.value.problems} == {
        "judge_max_pairs", "judge_swap_disagreement", "judge_tie_margin", "judge_api_format", "judge_batch_size",
        "judge_timeout", "judge_pair_choice", "judge_position_swap", "judge_api_headers",
    }  # fmt: skip
    assert all("leave it out" in p.message for p in err.value.problems if p.field != "judge_pair_choice")
    with pytest.raises(ConfigError) as err:
        load_job(DEMO, ["preference_source=judge", "judge=reward_noisy", "judge_api_timeout=5", "judge_timeout=5"])
    assert {(p.field, p.message.split(";")[0]) for p in err.value.problems} == {
        ("judge_api_timeout", "allowed only with judge='api'"),
        ("judge_timeout", "allowed only with a Python judge (judge='pkg.module:function')"),
    }


def test_the_judges_credential_problems_name_the_judges_options_and_never_show_the_key():
    """Found: they named comparator_api_key_env; and a header string holding a key was shown back."""
    with pytest.raises(ConfigError) as err:
        load_job(DEMO, ["preference_source=judge", "judge=api", "judge_model=m",
                        "judge_api_url=http://127.0.0.1:1/v1?api_key=sk-secret1234567",
                        'judge_api_headers="Authorization: Bearer sk-abcdefSECRET"'])  # fmt: skip
    text = str(err.value)
    assert "judge_api_key_env" in text and "judge_api_key_header" in text and "comparator_api" not in text
    assert "sk-secret1234567" not in text and "sk-abcdefSECRET" not in text


# ---------------------------------------------------------------------------------------------- a judge's values
class _Unprintable:
    def __repr__(self) -> str:
        raise ZeroDivisionError("no")


def test_a_value_whose_repr_raises_or_a_text_without_end_is_an_answer_like_any_other():
    """Found: the first stopped the run with a traceback; the second was stored whole (2,000,000 characters)."""
    answer = read_value(_Unprintable(), 0.0)
    assert answer.verdict is None and "a _Unprintable whose repr() raised ZeroDivisionError" in answer.reason
    answer = read_value("A" * 2_000_000, 0.0)
    assert answer.verdict is None and len(answer.raw) == RAW_CHARS + 1 and len(answer.reason) < 300


@pytest.mark.parametrize("value", [("A", 0.05), ("B", 0.9)])
def test_a_verdict_and_a_probability_that_disagree_are_a_drop(value):
    answer = read_value(value, 0.0)
    assert answer.verdict is None and "disagree" in answer.reason
    assert read_value(("A", 0.9), 0.0).verdict == "A" and read_value(("tie", 0.9), 0.0).verdict == "tie"
    assert read_value(("B", 0.5), 0.0).verdict == "B"  # an uninformative probability does not contradict


# ---------------------------------------------------------------------------------------------- pbrl label
def test_pbrl_label_says_why_a_round_has_nothing_to_label(tiny_model_dir, tmp_path):
    """Found: round 0 and a round past the run's last said only 'has no candidates yet'."""
    from typer.testing import CliRunner

    from pbrl.cli.commands import app
    from tests.unit.judging.test_labels import labelled_round

    run_dir, _, _ = labelled_round(tiny_model_dir, tmp_path)
    runner = CliRunner()
    out = runner.invoke(app, ["label", str(run_dir), "--round", "0"])
    assert out.exit_code == 2 and "round 0 is the baseline evaluation" in out.output
    out = runner.invoke(app, ["label", str(run_dir), "--round", "9"])
    assert out.exit_code == 2 and "has no candidates yet (the run has 1 round(s) of training)" in out.output
