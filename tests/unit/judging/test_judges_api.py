"""The API judge (pbrl.judging.api_judge, issue #51) against stub judge servers on 127.0.0.1, no network.

A well-behaved stub judge prefers the joint response whose texts say "good" (a tie when both or neither do), in each
of the four formats, and reports its usage; hostile ones answer garbage, always tie, answer slower than the deadline
or beyond the size cap, refuse (4xx), redirect, or echo the API key back. Expected bodies and token counts are
written out by hand from docs/design/algorithms.md#api-comparators and each format's usage fields. The stub server
and its helpers are the API comparator's (tests/unit/generation/test_api_client_faults.py,
tests/unit/generation/test_comparators_api.py).
"""

from __future__ import annotations

import hashlib
import json
import logging
import pickle
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler
from typing import Any

import pytest

from flows.retry import retry_transient
from pbrl.errors import ConfigError, TransientError, expected_error
from pbrl.generation.api_errors import ApiComparatorError, ApiRetriesSpentError
from pbrl.generation.api_formats import ApiAnswer, ApiSettings, parse_answers, usage_tokens
from pbrl.judging.api_judge import JUDGE_ROLE, RAW_CHARS, ApiJudge, ApiJudgeUnavailableError, read_answer
from pbrl.judging.factory import api_judge_from_options, read_template
from pbrl.judging.prompt import DEFAULT_TEMPLATE, render
from pbrl.judging.verdicts import Answer, Comparison
from pbrl.preference.oracle import is_transient
from tests.unit.generation.test_api_client_faults import (
    FailedState,
    Responder,
    Stub,
    failure_of,
    key_pieces,
    reply,
    send,
    within,
)
from tests.unit.generation.test_comparators_api import request_prompt, shape

KEY = "sk-judge-Xq4/Mv8+Tz2_Lp6-Rw9=Nc5Hd1Ks7Bf3"
KEY_ENV = "PBRL_TEST_JUDGE_KEY"
SECRET = "sk-live-4e7d1c9b2a8f5e3d6c0b"  # a credential written into the settings (URL-safe, as users paste them)
LOGGER = "pbrl.generation.api_transport"
FORMATS = ("generic", "openai", "anthropic", "openai_responses")

GOOD = Comparison("q1", ("Plan the work.", "Check the plan."), ("planner", "checker"),
                  ("a good plan", "looks right"), ("a plan", "looks right"))  # fmt: skip
NEITHER = Comparison("q2", ("Plan the work.", "Check the plan."), ("planner", "checker"),
                     ("plan one", "fine"), ("plan two", "fine"))  # fmt: skip
COMPARISONS = [GOOD, GOOD.swapped(), NEITHER]
EXPECTED_VERDICTS = ["A", "B", "tie"]

# The usage each format reports, and the tokens pbrl reads from it (by hand: openai and openai_responses
# total_tokens; anthropic input_tokens + output_tokens; generic total_tokens when given).
USAGE = {
    "generic": ({"total_tokens": 57}, 57),
    "openai": ({"prompt_tokens": 300, "completion_tokens": 1, "total_tokens": 301}, 301),
    "anthropic": ({"input_tokens": 320, "output_tokens": 2, "cache_read_input_tokens": 5}, 322),
    "openai_responses": ({"input_tokens": 310, "output_tokens": 3, "total_tokens": 313}, 313),
}


@pytest.fixture(autouse=True)
def key(monkeypatch):
    monkeypatch.setenv(KEY_ENV, KEY)
    return KEY


def settings(url: str, fmt: str = "openai", **kw: Any) -> ApiSettings:
    base: dict[str, Any] = {"api_format": fmt, "url": url, "model": "judge-1", "key_env": KEY_ENV, "timeout": 2.0,
                            "backoff_base": 0.01, "backoff_max": 0.02}  # fmt: skip
    return ApiSettings(**{**base, **kw})


def judge(url: str, fmt: str = "openai", template: str = DEFAULT_TEMPLATE, max_tokens: int = 16, **kw: Any) -> ApiJudge:
    return ApiJudge(settings(url, fmt, **kw), template, max_tokens)


def prefers_good(prompt: str) -> str:
    """The stub judge's decision on a prompt of the default template: the response that says "good"."""
    a = prompt.split("# Joint response A")[1].split("# Joint response B")[0]
    b = prompt.split("# Joint response B")[1].split("# Your judgement")[0]
    return "tie" if ("good" in a) == ("good" in b) else ("A" if "good" in a else "B")


def judge_server(fmt: str, decide: Callable[[str], str] = prefers_good, usage: bool = True) -> Responder:
    """Answers each request in format ``fmt`` with ``decide(prompt)``, reporting the format's usage."""

    def respond(handler: BaseHTTPRequestHandler, index: int, body: dict[str, Any]) -> None:
        payload = shape(fmt, [decide(request_prompt(body))])
        if usage:
            payload["usage"] = USAGE[fmt][0]
        send(handler, 200, json.dumps(payload).encode())

    return respond


# ---------------------------------------------------------------------------------- asking, reading, tokens
EXPECTED_BODY = {  # of one comparison (prompt P) under the judge's sampling: temperature 0, one answer
    "generic": lambda p: {"prompt": p, "agent_index": 0, "task_item": {"item_id": "q1"}, "num_candidates": 1,
                          "max_new_tokens": 16, "temperature": 0.0, "top_p": 1.0, "model": "judge-1"},
    "openai": lambda p: {"model": "judge-1", "messages": [{"role": "user", "content": p}], "n": 1,
                         "max_completion_tokens": 16, "temperature": 0.0, "top_p": 1.0},
    "anthropic": lambda p: {"model": "judge-1", "max_tokens": 16, "messages": [{"role": "user", "content": p}],
                            "temperature": 0.0},
    "openai_responses": lambda p: {"model": "judge-1", "input": p, "max_output_tokens": 16},
}  # fmt: skip


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_format_asks_once_per_comparison_at_temperature_0_and_reads_verdicts_and_tokens(fmt):
    seen: list[dict[str, Any]] = []
    server = judge_server(fmt)

    def respond(handler: BaseHTTPRequestHandler, index: int, body: dict[str, Any]) -> None:
        seen.append(body)
        server(handler, index, body)

    with Stub(respond) as stub:
        answers = within(20, lambda: judge(stub.url, fmt, max_concurrency=1).answer(COMPARISONS))
    assert [a.verdict for a in answers] == EXPECTED_VERDICTS
    assert [a.raw for a in answers] == EXPECTED_VERDICTS and all(a.reason is None for a in answers)
    assert [a.tokens for a in answers] == [USAGE[fmt][1]] * 3
    assert all(a.probability is None and a.seconds > 0 for a in answers)
    prompts = [render(DEFAULT_TEMPLATE, c) for c in COMPARISONS]
    assert sorted(map(request_prompt, seen)) == sorted(prompts)  # one request per comparison
    first = next(b for b in seen if request_prompt(b) == prompts[0])
    assert first == EXPECTED_BODY[fmt](prompts[0])
    assert all(r["content-type"] == "application/json" for r in stub.records)


def test_a_generic_server_without_usage_costs_zero_tokens():
    with Stub(judge_server("generic", usage=False)) as stub:
        answers = within(20, lambda: judge(stub.url, "generic").answer([GOOD]))
    assert answers == [Answer("A", raw="A", tokens=0, seconds=answers[0].seconds)]


def test_usage_is_read_per_format_and_counted_once_per_response():
    assert [usage_tokens(fmt, {"usage": USAGE[fmt][0]}) for fmt in FORMATS] == [57, 301, 322, 313]
    for junk in ({}, {"usage": None}, {"usage": {"total_tokens": "12"}}, {"usage": {"total_tokens": -1}},
                 {"usage": {"total_tokens": True}}, {"usage": {"total_tokens": 1.5}}, []):  # fmt: skip
        assert usage_tokens("openai", junk) == 0, junk
    assert usage_tokens("anthropic", {"usage": {"input_tokens": 9}}) == 0  # half a bill is no bill
    two = {**shape("openai", ["A", "B"]), "usage": {"total_tokens": 40}}
    assert [a.tokens for a in parse_answers(settings("http://h/x"), two)] == [40, 0]  # the sum is the bill


PARSED = [
    ("A", "A"), ("b", "B"), ("TIE", "tie"), ("**A**", "A"), ("Answer: B", "B"), ('"tie".', "tie"), (" B\n", "B"),
]  # fmt: skip
UNPARSED = ["I think A", "A or B", "A\nB", "", "Both are fine.", "C"]


@pytest.mark.parametrize(("text", "verdict"), PARSED)
def test_a_clear_answer_is_read_as_its_verdict(text, verdict):
    answer = read_answer(ApiAnswer(text, "api", 12, 0.25))
    assert answer == Answer(verdict, raw=text, tokens=12, seconds=0.25)


@pytest.mark.parametrize("text", UNPARSED)
def test_an_unclear_answer_is_no_verdict_with_its_reason_never_a_guess(text):
    answer = read_answer(ApiAnswer(text, "api", 7, 0.5))
    assert answer.verdict is None and answer.raw == text and answer.tokens == 7
    assert answer.reason.startswith("unparseable answer") and "expected exactly A, B or tie" in answer.reason


def test_an_answer_cut_at_the_token_limit_says_so_and_a_long_one_is_kept_cut():
    cut = read_answer(ApiAnswer("Let me compare the two", "length", 16, 0.1))
    assert cut.verdict is None and "cut at judge_api_max_tokens" in cut.reason
    long = read_answer(ApiAnswer("x" * (RAW_CHARS + 10), "api", 0, 0.0))
    assert long.raw == "x" * RAW_CHARS + "…" and len(long.reason) < 300


# --------------------------------------------------------------------------------------- hostile judge servers
def test_a_garbage_answer_is_a_drop_with_its_reason_and_a_garbage_response_an_error():
    with Stub(judge_server("openai", lambda p: "As an AI, I cannot choose.")) as stub:
        answers = within(20, lambda: judge(stub.url).answer(COMPARISONS))
    assert all(a.verdict is None and "As an AI" in a.reason and a.tokens == 301 for a in answers)
    with Stub(reply(200, b"<html>judge busy</html>")) as stub:
        err = failure_of(lambda: judge(stub.url).answer([GOOD]))
    assert isinstance(err, ApiComparatorError) and not isinstance(err, TransientError)
    message = str(err)
    assert message.startswith(f"API judge (openai) at {stub.url}, item 'q1': HTTP 200, malformed response")
    assert "judge_api_format" in message and "judge_api_url" in message and "comparator" not in message


def test_an_always_tie_server_gives_ties():
    with Stub(judge_server("anthropic", lambda p: "tie")) as stub:
        answers = within(20, lambda: judge(stub.url, "anthropic").answer(COMPARISONS))
    assert [a.verdict for a in answers] == ["tie"] * 3


def slow(handler: BaseHTTPRequestHandler, index: int, body: dict[str, Any]) -> None:
    """Headers at once, then the answer a byte every 0.1 s: each read is quick, the whole is slow."""
    payload = json.dumps(shape("openai", ["A"])).encode()
    handler.send_response(200)
    handler.send_header("Content-Length", str(len(payload)))
    handler.end_headers()
    for i in range(len(payload)):
        handler.wfile.write(payload[i : i + 1])
        handler.wfile.flush()
        time.sleep(0.1)


def test_a_judge_slower_than_the_deadline_is_a_transient_failure_within_one_retry_budget():
    with Stub(slow) as stub:
        err = failure_of(lambda: judge(stub.url, timeout=0.3, max_attempts=2).answer([GOOD]))
    assert isinstance(err, ApiJudgeUnavailableError) and isinstance(err, ApiRetriesSpentError)
    assert isinstance(err, TransientError) and is_transient(err) and expected_error(err) is err
    # Prefect's stage retries do not multiply the client's budget (flows/retry.py), transient or not.
    assert retry_transient(None, None, FailedState(err)) is False
    message = str(err)
    assert message.startswith("API judge (openai)") and "0.3 s deadline" in message and "judge_api_timeout" in message
    assert "after 2 attempt(s)" in message and len(stub.records) == 2 == err.attempts
    again = pickle.loads(pickle.dumps(err))  # Prefect stores a failed task's exception
    assert type(again) is ApiJudgeUnavailableError and str(again) == message and again.attempts == 2


def test_a_huge_answer_stops_at_the_size_cap_naming_the_judges_options():
    with Stub(reply(200, json.dumps(shape("openai", ["A" * 5000])).encode())) as stub:
        err = failure_of(lambda: judge(stub.url, max_response_bytes=1024).answer([GOOD]))
    assert isinstance(err, ApiComparatorError) and not isinstance(err, TransientError)
    message = str(err)
    assert "larger than the cap of 1024 bytes" in message and "fewer tokens (judge_api_max_tokens)" in message
    assert "judge_api_url" in message and "comparator" not in message and "answers per request" not in message


REFUSALS = {
    400: ["judge_model", "judge_api_extra_body", "judge_api_max_tokens (the judge asks at temperature 0)",
          "judge_api_format ('openai')"],
    401: [f"{KEY_ENV} (judge_api_key_env)", "judge_api_key_header", "judge_api_key_prefix"],
    403: [f"{KEY_ENV} (judge_api_key_env)", "judge_model"],
    404: ["judge_api_url (the full endpoint path)", "judge_model"],
    405: ["judge_api_url"],
    413: ["lower judge_api_max_tokens"],
}  # fmt: skip


@pytest.mark.parametrize("status", REFUSALS)
def test_a_refusal_is_tried_once_and_names_the_judges_options(status):
    with Stub(reply(status, b'{"error": "no"}')) as stub:
        err = failure_of(lambda: judge(stub.url).answer([GOOD]))
    assert isinstance(err, ApiComparatorError) and not isinstance(err, TransientError) and err.status == status
    message = str(err)
    assert message.startswith(f"API judge (openai) at {stub.url}, item 'q1': HTTP {status}, refused")
    assert all(words in message for words in REFUSALS[status]), message
    assert "comparator" not in message and len(stub.records) == 1


@pytest.mark.parametrize("status", [301, 302, 307, 308])
def test_a_redirect_is_not_followed_and_names_the_judges_url(status):
    with Stub(reply(200, json.dumps(shape("openai", ["A"])).encode())) as elsewhere:
        with Stub(reply(status, b"", Location=elsewhere.url)) as stub:
            err = failure_of(lambda: judge(stub.url).answer([GOOD]))
    assert isinstance(err, ApiComparatorError) and err.status == status
    assert f"HTTP {status} redirect to" in str(err) and "set judge_api_url to the address" in str(err)
    assert elsewhere.records == []  # the key never went to the other address


def echo_key(status: int, where: str) -> Responder:
    """Echoes the request's key header back: in the answer's text (200), or in an error body."""

    def respond(handler: BaseHTTPRequestHandler, index: int, body: dict[str, Any]) -> None:
        sent = handler.headers["Authorization"]
        if where == "answer":
            payload = {**shape("openai", [f"A, and your key is {sent}"]), "usage": {"total_tokens": 5}}
        else:
            payload = {"error": f"invalid key {sent} ({sent[12:30]})"}
        send(handler, status, json.dumps(payload).encode())

    return respond


@pytest.mark.parametrize(("status", "where"), [(200, "answer"), (401, "error"), (500, "error"), (200, "error")],
                         ids=["in-the-answer", "refused", "failing", "malformed"])  # fmt: skip
def test_a_key_echoed_back_appears_nowhere(status, where, caplog):
    caplog.set_level(logging.DEBUG)
    got: list[Answer] = []
    err: ApiComparatorError | None = None
    with Stub(echo_key(status, where)) as stub:
        the_judge = judge(stub.url, max_attempts=2)
        try:
            got = within(20, lambda: the_judge.answer([GOOD]))
        except ApiComparatorError as exc:
            err = exc
    assert stub.records[0]["authorization"] == f"Bearer {KEY}"  # the key was sent, as it should be
    texts = [caplog.text, the_judge.name]
    texts += [json.dumps(a.__dict__, ensure_ascii=False) for a in got]
    if err is not None:
        texts += [str(err), repr(err), repr(err.args), pickle.dumps(err).decode("latin-1")]
    assert [key_pieces(t, KEY) for t in texts] == [[]] * len(texts)
    if where == "answer":
        assert got[0].verdict is None and "<hidden>" in got[0].raw and "<hidden>" in got[0].reason
    else:
        assert err is not None and "<hidden>" in str(err)


def test_answers_that_arrived_reach_on_answer_before_another_requests_failure():
    def respond(handler: BaseHTTPRequestHandler, index: int, body: dict[str, Any]) -> None:
        if "good" in request_prompt(body).split("# Joint response A")[1].split("# Joint response B")[0]:
            send(handler, 400, b'{"error": "refused"}')  # GOOD, shown first: refused
        else:
            judge_server("openai")(handler, index, body)

    seen: dict[int, Answer] = {}
    with Stub(respond) as stub:
        err = failure_of(lambda: judge(stub.url, max_concurrency=1).answer(COMPARISONS, on_answer=seen.__setitem__))
    assert isinstance(err, ApiComparatorError) and err.status == 400
    assert {i: a.verdict for i, a in seen.items()} == {1: "B", 2: "tie"}


def test_an_unset_key_variable_or_a_credential_in_the_settings_sends_nothing(monkeypatch):
    with Stub(judge_server("openai")) as stub:
        monkeypatch.delenv(KEY_ENV)
        err = failure_of(lambda: judge(stub.url).answer([GOOD]))
        monkeypatch.setenv(KEY_ENV, KEY)
        host = stub.url.removeprefix("http://")
        with pytest.raises(ConfigError) as info:
            judge(f"http://user:{SECRET}@{host}", headers={"X-Api-Key": SECRET}).answer([GOOD])
    assert stub.records == []
    assert isinstance(err, ApiComparatorError) and f"{KEY_ENV} (judge_api_key_env) is not set" in str(err)
    assert str(err).startswith("API judge (openai)")
    assert [p.field for p in info.value.problems] == ["judge_api_url", "judge_api_headers"]
    assert key_pieces(str(info.value), SECRET) == []


# ------------------------------------------------------------------------------------------ name and factory
def test_the_name_changes_with_everything_that_changes_answers_and_never_shows_a_credential():
    base = judge("https://api.example/v1/chat?api-version=1")
    options = '{"extra_body": {}, "headers": {}, "response_field": null}'  # no extra body or headers; not generic
    assert base.name == (
        "api(format=openai, url=https://api.example/v1/chat?api-version=1, model=judge-1, "
        f"template=sha256:{hashlib.sha256(DEFAULT_TEMPLATE.encode()).hexdigest()[:16]}, "
        f"max_tokens=16, options=sha256:{hashlib.sha256(options.encode()).hexdigest()[:16]})"
    )
    changed = [
        judge("https://api.example/v1/other?api-version=1"),
        judge("https://api.example/v1/chat?api-version=1", "anthropic"),
        judge("https://api.example/v1/chat?api-version=1", model="judge-2"),
        judge("https://api.example/v1/chat?api-version=1", template=DEFAULT_TEMPLATE + "Be brief.\n"),
        judge("https://api.example/v1/chat?api-version=1", max_tokens=8),
        judge("https://api.example/v1/chat?api-version=1", extra_body={"seed": 1}),
        judge("https://api.example/v1/chat?api-version=1", headers={"anthropic-beta": "b"}),
    ]
    assert len({base.name, *(j.name for j in changed)}) == len(changed) + 1
    same = [judge("https://api.example/v1/chat?api-version=1", key_env="OTHER", timeout=9.0, max_concurrency=1)]
    assert {j.name for j in same} == {base.name}
    hidden = judge(f"https://user:{SECRET}@api.example/v1?token={SECRET}").name
    assert key_pieces(hidden, SECRET) == [] and "<hidden>" in hidden


def test_the_judge_and_its_factory_refuse_bad_values_naming_the_option(tmp_path):
    with pytest.raises(ValueError, match="judge_prompt_template: lacks {response_b}"):
        judge("http://h/x", template="{response_a} only")
    with pytest.raises(ValueError, match="judge_api_max_tokens: got 0"):
        judge("http://h/x", max_tokens=0)
    with pytest.raises(ValueError, match="judge_api_format: got 'soap'"):
        api_judge_from_options(ApiSettings(api_format="soap", url="http://h/x", model="m", role=JUDGE_ROLE))
    bad = tmp_path / "bad.txt"
    bad.write_text("{response_a} {oops}")
    with pytest.raises(ConfigError) as info:
        read_template(bad)
    assert [p.field for p in info.value.problems] == ["judge_prompt_template"] * 2
    with pytest.raises(ConfigError, match="judge_prompt_template.*cannot be read"):
        read_template(tmp_path / "missing.txt")


def test_the_factory_builds_the_judge_from_plain_option_values(tmp_path):
    template = tmp_path / "judge.txt"
    template.write_text("Which is better?\nA:\n{response_a}\nB:\n{response_b}\nSay A, B or tie.\n")
    settings = ApiSettings(
        api_format="anthropic", url="https://api.example/v1/messages", model="claude-x", key_env=KEY_ENV,
        extra_body={"metadata": {"run": "r1"}}, timeout=30.0, max_concurrency=2,
    )  # fmt: skip
    built = api_judge_from_options(settings, max_tokens=4, prompt_template=template)
    assert built.template == template.read_text() and built.max_tokens == 4
    s = built.settings
    assert (s.api_format, s.model, s.key_env, s.timeout, s.max_concurrency) == ("anthropic", "claude-x", KEY_ENV, 30, 2)
    assert s.role == JUDGE_ROLE and dict(s.extra_body) == {"metadata": {"run": "r1"}}
    assert api_judge_from_options(ApiSettings(api_format="openai", url="http://h/x")).template == (DEFAULT_TEMPLATE)
    # Settings built for the comparator still speak as the judge once they are a judge's.
    comparators = ApiSettings(api_format="openai", url="http://h/x")
    assert ApiJudge(comparators, DEFAULT_TEMPLATE, 16).settings.role == JUDGE_ROLE
