"""The API comparator against hostile servers and configs (issue #29, part 2), on local stub servers.

Each test holds the failing input of one fault as a hostile user found it: an unbounded ``Retry-After``, a server
trickling bytes past the deadline, a key echoed back cut or encoded, credentials in the config, a 4xx printed as
tracebacks, a redirect called "malformed", retries multiplied by the stage's, an answer without a size bound.
Caps and deadlines are made small through :class:`ApiSettings` so that every test takes seconds.
"""

from __future__ import annotations

import datetime
import email.utils
import gzip
import json
import logging
import pickle
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest

from flows.retry import retry_transient
from pbrl.config import parse_job
from pbrl.errors import EXPECTED_ERRORS, ConfigError, TransientError, expected_error
from pbrl.generation.api_client import fetch_answers
from pbrl.generation.api_errors import ApiComparatorError, ApiRetriesSpentError
from pbrl.generation.api_formats import ApiRequest, ApiSettings
from pbrl.generation.api_transport import retry_after_seconds
from pbrl.generation.redaction import Redactor
from pbrl.generation.sampling import SamplingSettings
from pbrl.preference.oracle import is_transient

KEY = "sk-proj-Q7v/Lm2+Zx9_Rt4-Wy6=Hb3Kd8Nf5Pq1Sa0J"  # 44 characters, with '/', '+' and '=' (they encode)
KEY_ENV = "PBRL_TEST_HOSTILE_KEY"
SAMPLING = SamplingSettings(max_new_tokens=8, temperature=1.0, top_p=0.9, top_k=20, batch_size=8)
ASK = ApiRequest("agent 0, item 'q1'", "Say one word.", 0, {"item_id": "q1"}, 2)
LOGGER = "pbrl.generation.api_transport"

Responder = Callable[[BaseHTTPRequestHandler, int, dict[str, Any]], None]


# ------------------------------------------------------------------------------------------------- stub server
@dataclass
class Stub:
    """A threaded HTTP server on 127.0.0.1 whose every POST is answered by ``respond(handler, index, body)``
    (raw control over status, headers and how the body is written). Records each request's headers."""

    respond: Responder
    records: list[dict[str, str]] = field(default_factory=list)
    written: list[int] = field(default_factory=list)  # bytes of body each response managed to write

    def __post_init__(self) -> None:
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
                stub.records.append({k.lower(): v for k, v in self.headers.items()})
                try:
                    stub.respond(self, len(stub.records) - 1, body)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up, as it should
                    pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1/endpoint"
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def __enter__(self) -> Stub:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def send(handler: BaseHTTPRequestHandler, status: int, payload: bytes = b"", **headers: str) -> None:
    handler.send_response(status)
    headers.setdefault("Content-Type", "application/json")
    headers.setdefault("Content_Length", str(len(payload)))
    for name, value in headers.items():
        handler.send_header(name.replace("_", "-"), value)
    handler.end_headers()
    handler.wfile.write(payload)


def answers(n: int, text: str = "fine") -> bytes:
    return json.dumps({"completions": [f"{text} {j}" for j in range(n)]}).encode()


def reply(status: int, payload: bytes = b'{"error": "no"}', **headers: str) -> Responder:
    return lambda handler, index, body: send(handler, status, payload, **headers)


def settings(url: str, fmt: str = "generic", **kw: Any) -> ApiSettings:
    base: dict[str, Any] = {
        "api_format": fmt,
        "url": url,
        "model": "remote",
        "key_env": KEY_ENV,
        "timeout": 2.0,
        "backoff_base": 0.01,
        "backoff_max": 0.02,
    }
    return ApiSettings(**{**base, **kw})


@pytest.fixture(autouse=True)
def key(monkeypatch):
    monkeypatch.setenv(KEY_ENV, KEY)
    return KEY


def within(seconds: float, call: Callable[[], Any]) -> Any:
    """``call()`` in a daemon thread; fails the test when it has not returned after ``seconds`` (a wait
    without bound would otherwise hang the suite)."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = call()
        except BaseException as exc:  # handed to the test thread
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        pytest.fail(f"still waiting after {seconds} s")
    if "error" in box:
        raise box["error"]
    return box["value"]


def failure_of(call: Callable[[], Any], seconds: float = 20.0) -> BaseException:
    try:
        within(seconds, call)
    except BaseException as exc:
        return exc
    pytest.fail("no error raised")


def key_pieces(text: str, key: str = KEY, n: int = 8) -> list[str]:
    """Pieces of ``n`` characters of the key (as sent, percent- or JSON-escaped; case ignored) found in ``text``."""
    forms = {key, quote(key, safe=""), quote(key), json.dumps(key)[1:-1].replace("/", "\\/")}
    low = text.lower()
    return sorted({f[i : i + n] for f in forms for i in range(len(f) - n + 1) if f[i : i + n].lower() in low})


# ------------------------------------------------------------------------------------- 1. Retry-After has a cap
FAR_DATE = email.utils.format_datetime(datetime.datetime(2099, 1, 1, tzinfo=datetime.UTC), usegmt=True)


@pytest.mark.parametrize(
    ("retry_after", "cap"),
    [("3600", 60.0), (FAR_DATE, 60.0), ("99999999999999999999", 60.0), ("2", 0.5)],
    ids=["3600s", "date-2099", "huge", "above-a-small-cap"],
)
def test_a_retry_after_beyond_the_cap_gives_up_at_once_naming_it(retry_after, cap):
    with Stub(reply(429, Retry_After=retry_after)) as stub:
        start = time.monotonic()
        options = {} if cap == 60.0 else {"retry_after_max": cap}  # 60 s: the default, RETRY_AFTER_MAX
        err = failure_of(lambda: fetch_answers([ASK], settings(stub.url, **options), SAMPLING))
        elapsed = time.monotonic() - start
    assert isinstance(err, ApiRetriesSpentError), err
    assert elapsed < 5 and len(stub.records) == 1
    assert f"Retry-After: {retry_after!r}" in str(err) and f"({cap:g} s" in str(err)
    assert err.status == 429 and err.attempts == err.sent == 1 and err.retry_after > cap


def test_a_retry_after_within_the_cap_is_waited_and_every_wait_is_logged(caplog):
    script: list[Responder] = [reply(429, Retry_After="1"), reply(503), reply(200, answers(2))]
    caplog.set_level(logging.INFO, logger=LOGGER)
    with Stub(lambda handler, index, body: script[index](handler, index, body)) as stub:
        start = time.monotonic()
        (got,) = within(20, lambda: fetch_answers([ASK], settings(stub.url), SAMPLING))
        elapsed = time.monotonic() - start
    assert len(got) == 2 and len(stub.records) == 3 and elapsed >= 1.0
    waits = [r for r in caplog.records if r.name == LOGGER and r.levelno >= logging.INFO]
    assert len(waits) == 2
    first, second = (r.getMessage() for r in waits)
    assert "HTTP 429" in first and "attempt 1 of 5 failed" in first and "before attempt 2" in first
    assert "waiting 1.0" in first and "Retry-After: '1'" in first
    assert "HTTP 503" in second and "attempt 2 of 5 failed" in second and "before attempt 3" in second


def test_retry_after_values_are_read_as_rfc_9110_says():
    def seconds(value: str) -> float | None:
        return retry_after_seconds({"retry-after": value})

    assert seconds("120") == 120.0 and seconds("1.5") == 1.5
    assert seconds(FAR_DATE) > 2e9 and seconds("Thu, 01 Jan 1970 00:00:00 GMT") == 0.0
    assert [seconds(v) for v in ("inf", "nan", "-5", "soon", "")] == [None] * 5
    assert retry_after_seconds({}) is None and seconds("9" * 400) > 1e300  # beyond any cap: gives up


def test_a_type_error_of_an_api_option_never_shows_a_credential():
    """The values pbrl.config.messages may show for a type error (api_shown_value): nothing secret-shaped."""
    from pbrl.config.credentials import api_shown_value

    assert api_shown_value("comparator_api_headers", {"X-Api-Key": [SECRET]}) == "<hidden>"
    assert api_shown_value("comparator_api_headers", {"X-Trace": 1}) == {"X-Trace": 1}
    assert api_shown_value("comparator_api_extra_body", [SECRET]) == "<hidden>"
    assert api_shown_value("comparator_api_extra_body", {"auth": {"token": 1}}) == "<hidden>"
    assert api_shown_value("comparator_api_key_prefix", 12345678901234) == "<hidden>"
    assert api_shown_value("comparator_api_key_env", SECRET) == "<hidden>"
    assert SECRET not in str(api_shown_value("comparator_api_url", f"ftp://u:{SECRET}@h/x?token={SECRET}"))
    assert api_shown_value("num_agents", 3) == 3
    with pytest.raises(ValueError, match="max_attempts"):
        ApiSettings(api_format="generic", url="http://h/x", max_attempts=0)


# ------------------------------------------------------------------------------ 2. timeout = total deadline
def trickle(where: str, seconds: float = 3.0) -> Responder:
    """A valid answer, written one byte every 50 ms (each read is quick, the whole takes ``seconds``)."""

    def respond(handler: BaseHTTPRequestHandler, index: int, body: dict[str, Any]) -> None:
        payload = answers(2)
        head = f"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n".encode()
        slow = head if where == "headers" else payload
        if where == "body":
            handler.wfile.write(head)
        step = max(1, len(slow) // int(seconds / 0.05))
        for i in range(0, len(slow), step):
            handler.wfile.write(slow[i : i + step])
            handler.wfile.flush()
            time.sleep(0.05)
        if where == "headers":
            handler.wfile.write(payload)

    return respond


@pytest.mark.parametrize("where", ["body", "headers"])
def test_a_server_trickling_bytes_is_cut_at_the_total_deadline(where):
    with Stub(trickle(where)) as stub:
        start = time.monotonic()
        err = failure_of(lambda: fetch_answers([ASK], settings(stub.url, timeout=0.5, max_attempts=2), SAMPLING))
        elapsed = time.monotonic() - start
    assert isinstance(err, ApiRetriesSpentError), err
    assert "0.5 s deadline" in str(err) and "after 2 attempt(s)" in str(err)
    assert len(stub.records) == 2 and elapsed < 2.5  # 2 x 0.5 s, not 2 x 3 s


# ------------------------------------------------------------------------------- 3. the key, whatever its cut
ECHOES = {
    "whole": KEY,
    "cut-both-ends": KEY[5:-5],
    "across-the-quote-boundary": "x" * 279 + KEY,  # the first 10 characters fall inside the quoted 300
    "url-encoded": quote(KEY, safe=""),
    "json-escaped": json.dumps({"detail": f"Bearer {KEY}"}).replace("/", "\\/"),
    "split-in-two": f"{KEY[:20]} ... {KEY[20:]}",
    "upper-case": KEY.upper(),
}


def assert_hidden(err: BaseException, *more: str) -> None:
    texts = [str(err), repr(err), repr(err.args), pickle.dumps(err).decode("latin-1"), *more]
    leaks = [key_pieces(t) for t in texts]
    assert leaks == [[]] * len(texts)


@pytest.mark.parametrize("echo", ECHOES.values(), ids=ECHOES.keys())
@pytest.mark.parametrize("status", [401, 500, 200])
def test_a_key_echoed_back_is_hidden_whatever_its_cut(echo, status, caplog):
    """Refused (401), failing (500: quoted in each wait's log line too) or malformed (200 without the field)."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    payload = '{"error": "' + echo + '"}'  # the echo starts at character 11 of the body
    with Stub(reply(status, payload.encode())) as stub:
        err = failure_of(lambda: fetch_answers([ASK], settings(stub.url, max_attempts=2), SAMPLING))
    assert isinstance(err, ApiComparatorError) and err.status == status
    assert_hidden(err, caplog.text)
    assert "<hidden>" in str(err)
    if status == 500:
        assert "<hidden>" in caplog.text


def test_a_key_in_answers_location_and_retry_after_is_hidden(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    with Stub(reply(200, json.dumps({"completions": [f"the key is {KEY}", KEY[3:30]]}).encode())) as stub:
        (got,) = fetch_answers([ASK], settings(stub.url), SAMPLING)
    assert [a.text for a in got] == ["the key is <hidden>", "<hidden>"]

    with Stub(reply(302, Location=f"https://elsewhere.example/cb?note={quote(KEY, safe='')}")) as stub:
        err = failure_of(lambda: fetch_answers([ASK], settings(stub.url), SAMPLING))
    assert_hidden(err)
    assert "elsewhere.example" in str(err)

    with Stub(reply(503, Retry_After=KEY[2:40])) as stub:
        err = failure_of(lambda: fetch_answers([ASK], settings(stub.url, max_attempts=2), SAMPLING))
    assert_hidden(err, caplog.text)
    assert "unreadable, ignored" in caplog.text


def test_the_redactor_hides_every_piece_of_eight_or_more_and_short_keys_whole():
    hide = Redactor(KEY)
    for i in range(len(KEY) - 8 + 1):
        piece = KEY[i : i + 8]
        assert hide(f"[{piece}]") == "[<hidden>]", piece
    assert hide(KEY[:7]) == KEY[:7]  # 7 characters alone say little of a 44-character key
    assert hide("no secret here " * 1000) == "no secret here " * 1000
    assert Redactor("abc123")("x abc123 y abc12") == "x <hidden> y abc12"  # shorter than 8: the whole key
    assert Redactor(None)("anything") == Redactor("")("anything") == "anything"


# --------------------------------------------------------------------------------- 4. credentials in the config
SECRET = "sk-live-9f8e7d6c5b4a3f2e1d0c"
API = {
    "trainer": "madpo_iter",
    "task": "toy",
    "agent_model": "some/path",
    "comparator_policy": "api",
    "comparator_api_url": "https://api.example/v1/chat",
    "comparator_api_key_env": "MY_KEY",
}
CREDENTIALS = [
    ("url-userinfo", {"comparator_api_url": f"https://user:{SECRET}@api.example/v1"}, "comparator_api_url"),
    ("url-user-only", {"comparator_api_url": f"https://{SECRET}@api.example/v1"}, "comparator_api_url"),
    ("url-unparsable", {"comparator_api_url": f"https://user:{SECRET}@[::1/v1"}, "comparator_api_url"),
    *[
        (f"query-{name}", {"comparator_api_url": f"https://api.example/v1?x=1&{name}={SECRET}"}, "comparator_api_url")
        for name in ("key", "api_key", "token", "access_token", "auth", "signature", "sig", "code", "X-Goog-Api-Key")
    ],
    ("fragment-token", {"comparator_api_url": f"https://api.example/v1#access_token={SECRET}"}, "comparator_api_url"),
    *[
        (f"header-{name}", {"comparator_api_headers": {"X-Trace": "1", name: SECRET}}, "comparator_api_headers")
        for name in (
            "Authorization",
            "Proxy-Authorization",
            "X-Api-Key",
            "Api-Key",
            "X-Goog-Api-Key",
            "Cookie",
            "X-Auth-Token",
            "x-my-secret",
            "X-Password",
            "OCP-APIM-SUBSCRIPTION-KEY",
        )
    ],
    *[
        (f"body-{name}", {"comparator_api_extra_body": {"seed": 1, name: SECRET}}, "comparator_api_extra_body")
        for name in ("api_key", "key", "token", "secret", "password", "apiKey", "access_token", "client_secret")
    ],
    ("body-nested", {"comparator_api_extra_body": {"a": {"b": {"api_key": SECRET}}}}, "comparator_api_extra_body"),
    (
        "body-in-list",
        {"comparator_api_extra_body": {"tools": [{"auth": {"token": SECRET}}]}},
        "comparator_api_extra_body",
    ),
    ("key-prefix", {"comparator_api_key_prefix": f"Bearer {SECRET}"}, "comparator_api_key_prefix"),
    ("not-api-policy", {"comparator_policy": "current", "comparator_api_url": f"https://u:{SECRET}@h/x"}, None),
]


@pytest.mark.parametrize(("overrides", "field_name"), [c[1:] for c in CREDENTIALS], ids=[c[0] for c in CREDENTIALS])
def test_credentials_in_the_config_are_refused_with_the_field_named_and_never_echoed(overrides, field_name):
    data = {**API, **overrides}
    if field_name is None:  # another policy: the api options are refused too, without the secret
        data.pop("comparator_api_key_env")
        field_name = "comparator_api_url"
    with pytest.raises(ConfigError) as info:
        parse_job(data)
    fields = [p.field for p in info.value.problems]
    assert field_name in fields
    shown = str(info.value)
    assert key_pieces(shown, SECRET) == [] and "<hidden>" in shown
    assert any("environment variable" in p.message for p in info.value.problems if p.field == field_name)


def test_ordinary_api_options_are_still_accepted():
    job = parse_job(
        {
            **API,
            "comparator_api_url": "https://x.openai.azure.com/openai/deployments/d/chat?api-version=2024-06-01",
            "comparator_api_headers": {"X-Trace": "1", "anthropic-beta": "b", "OpenAI-Organization": "org"},
            "comparator_api_extra_body": {
                "max_tokens": 8,
                "thinking": {"budget_tokens": 64},
                "prompt_cache_key": "k",
                "stop_token_ids": [2],
                "eos_token": "</s>",
                "logit_bias": {"50256": -100},
            },
            "comparator_api_key_header": "x-goog-api-key",
            "comparator_api_key_prefix": "",
        }
    )
    assert job.comparator_api_extra_body["thinking"] == {"budget_tokens": 64}
    for prefix in ("Bearer", "Token", "Api-Key"):
        assert parse_job({**API, "comparator_api_key_prefix": prefix}).comparator_api_key_prefix == prefix


def test_url_user_info_never_replaces_the_key_nothing_is_sent():
    with Stub(reply(200, answers(2))) as stub:
        host = stub.url.removeprefix("http://")
        with pytest.raises(ConfigError) as info:
            fetch_answers([ASK], settings(f"http://user:{SECRET}@{host}"), SAMPLING)
        with pytest.raises(ConfigError) as info_headers:
            fetch_answers([ASK], settings(stub.url, headers={"Cookie": SECRET}), SAMPLING)
    assert stub.records == []  # before: sent, with Basic user:secret in place of the key
    assert [p.field for p in info.value.problems] == ["comparator_api_url"]
    assert [p.field for p in info_headers.value.problems] == ["comparator_api_headers"]
    assert SECRET not in str(info.value) + str(info_headers.value)


# ------------------------------------------------------------------- 5. every failure: one expected error line
def one_error_line(err: BaseException, capsys) -> str:
    """What the CLI prints for ``err``: one ``error:`` line and exit 1 (pbrl.cli's wrapper, used by every
    command); and Prefect's console records of it are dropped (no tracebacks)."""
    import typer

    from pbrl.cli.commands import _expected_errors
    from pbrl.orchestration import QuietExpectedErrors

    capsys.readouterr()
    with pytest.raises(typer.Exit) as exit_info, _expected_errors(1):
        raise err
    assert exit_info.value.exit_code == 1
    printed = capsys.readouterr().err.strip()
    record = logging.LogRecord("prefect.task_runs", logging.ERROR, __file__, 1, "failed", None, (type(err), err, None))
    assert QuietExpectedErrors().filter(record) is False
    assert printed.startswith("error:") and "Traceback" not in printed
    return printed


REFUSALS = {400: "comparator_api_extra_body", 401: KEY_ENV, 403: KEY_ENV, 404: "comparator_api_url", 405: "POST"}
REFUSALS |= {413: "max_new_tokens", 422: "comparator_api_model", 451: "comparator_api_format"}


@pytest.mark.parametrize("status", REFUSALS)
def test_a_refusal_is_one_expected_error_naming_status_format_url_and_fix(status, capsys):
    with Stub(reply(status, b'{"error": {"message": "nope"}}')) as stub:
        err = failure_of(lambda: fetch_answers([ASK], settings(stub.url, "openai"), SAMPLING))
    assert isinstance(err, ApiComparatorError) and err.status == status and len(stub.records) == 1
    assert isinstance(err, EXPECTED_ERRORS) and expected_error(err) is err and not is_transient(err)
    message = str(err)
    assert f"HTTP {status}" in message and "(openai)" in message and stub.url in message
    assert REFUSALS[status] in message and "nope" in message and "\n" not in message
    assert one_error_line(err, capsys) == f"error: {message}"


def _deep(handler: BaseHTTPRequestHandler, index: int, body: dict[str, Any]) -> None:
    send(handler, 200, b"[" * 200_000)


def _bad_gzip(handler: BaseHTTPRequestHandler, index: int, body: dict[str, Any]) -> None:
    send(handler, 200, b"not gzip at all", Content_Encoding="gzip")


FAILURES: dict[str, tuple[Responder, dict[str, Any], str]] = {
    "wrong-shape": (reply(200, b'{"choices": "none"}'), {}, "malformed response"),
    "not-json": (reply(200, b"<html>busy</html>"), {}, "malformed response"),
    "nested-too-deep": (_deep, {}, "nested too deeply"),
    "bad-gzip": (_bad_gzip, {}, "could not be read"),
    "empty-answer": (reply(200, b'{"completions": []}'), {}, "returned no answer"),
    "redirect": (reply(302, Location="https://other.example/v1"), {}, "redirect"),
    "too-large": (reply(200, answers(2, "x" * 5000)), {"max_response_bytes": 1024}, "larger than the cap"),
    "retries-spent": (reply(502), {"max_attempts": 2}, "after 2 attempt(s)"),
    "retry-after-beyond-cap": (reply(429, Retry_After="3600"), {}, "Retry-After: '3600'"),
    "deadline": (trickle("body", 1.0), {"timeout": 0.3, "max_attempts": 1}, "deadline"),
}


@pytest.mark.parametrize("kind", FAILURES)
def test_every_failed_answer_is_one_expected_error_line_that_survives_pickle(kind, capsys):
    respond, options, words = FAILURES[kind]
    with Stub(respond) as stub:
        err = failure_of(lambda: fetch_answers([ASK], settings(stub.url, **options), SAMPLING))
    assert isinstance(err, ApiComparatorError), err
    assert expected_error(err) is err and not isinstance(err, TransientError)
    assert words in str(err) and stub.url in str(err) and "(generic)" in str(err)
    one_error_line(err, capsys)
    again = pickle.loads(pickle.dumps(err))  # Prefect stores a failed task's exception
    assert type(again) is type(err) and str(again) == str(err) and again.status == err.status


# ---------------------------------------------------------------------------- 6. redirects are named, not followed
@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
def test_a_redirect_is_reported_as_a_redirect_and_not_followed(status):
    with Stub(reply(200, answers(2))) as elsewhere:
        target = elsewhere.url.replace("http://", f"http://user:{SECRET}@") + f"?key={SECRET}&x=1"
        with Stub(reply(status, b"", Location=target)) as stub:
            err = failure_of(lambda: fetch_answers([ASK], settings(stub.url), SAMPLING))
    assert isinstance(err, ApiComparatorError) and err.status == status
    message = str(err)
    assert f"HTTP {status} redirect to" in message and "does not follow redirects" in message
    assert elsewhere.url.removeprefix("http://").split("/")[0] in message and "comparator_api_url" in message
    assert SECRET not in message and "malformed" not in message
    assert len(stub.records) == 1 and elsewhere.records == []  # the key never went to the other address


# ------------------------------------------------------------------------------------ 7. one retry budget
class FailedState:
    """What Prefect's retry condition receives: a state whose ``result()`` raises the task's exception."""

    def __init__(self, exc: BaseException):
        self.exc = exc

    def result(self) -> Any:
        raise self.exc


@pytest.mark.parametrize("respond", [reply(500), reply(429, Retry_After="0"), reply(408)], ids=["500", "429", "408"])
def test_the_client_owns_the_one_retry_budget_and_counts_real_sends(respond):
    with Stub(respond) as stub:
        err = failure_of(lambda: fetch_answers([ASK], settings(stub.url, max_attempts=3), SAMPLING))
    assert isinstance(err, ApiRetriesSpentError)
    assert len(stub.records) == 3 == err.attempts == err.sent
    assert "after 3 attempt(s)" in str(err) and "3 request(s) sent" in str(err)
    # Prefect's stage retries decline it (before: a TransientError, retried 3 more times: 4 x the sends).
    assert not is_transient(err) and retry_transient(None, None, FailedState(err)) is False
    assert retry_transient(None, None, FailedState(TransientError("judge timed out"))) is True


# ------------------------------------------------------------------------------------- 8. a size cap per answer
def _streamed(total: int) -> Responder:
    """A valid answer of ``total`` bytes with no Content-Length (the end is the connection's close)."""

    def respond(handler: BaseHTTPRequestHandler, index: int, body: dict[str, Any]) -> None:
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.end_headers()
        stub_written = 0
        chunk = b"x" * 65536
        handler.wfile.write(b'{"completions": ["')
        try:
            while stub_written < total:
                handler.wfile.write(chunk)
                stub_written += len(chunk)
            handler.wfile.write(b'"]}')
        finally:
            STREAMED.append(stub_written)

    return respond


STREAMED: list[int] = []


def _gzipped(handler: BaseHTTPRequestHandler, index: int, body: dict[str, Any]) -> None:
    payload = gzip.compress(answers(1, "x" * 16 * 2**20))  # about 16 kB on the wire, 16 MiB decoded
    send(handler, 200, payload, Content_Encoding="gzip")


@pytest.mark.parametrize(
    "respond",
    [reply(200, answers(1, "x" * 9 * 2**20)), _streamed(48 * 2**20), _gzipped],
    ids=["content-length", "streamed", "gzip-bomb"],
)
def test_an_answer_beyond_the_size_cap_stops_reading_with_a_clear_error(respond):
    """The default cap, MAX_RESPONSE_BYTES = 8 MiB: declared beyond it, streamed beyond it, or decoded beyond it."""
    STREAMED.clear()
    with Stub(respond) as stub:
        start = time.monotonic()
        err = failure_of(lambda: fetch_answers([ASK], settings(stub.url), SAMPLING))
        elapsed = time.monotonic() - start
    assert isinstance(err, ApiComparatorError) and not isinstance(err, ApiRetriesSpentError)
    assert f"larger than the cap of {8 * 2**20} bytes" in str(err) and err.status == 200
    assert len(stub.records) == 1 and elapsed < 10
    assert all(n < 32 * 2**20 for n in STREAMED)  # the 48 MiB answer was not read to its end


def test_a_large_error_body_is_read_only_in_part_and_quoted_briefly():
    with Stub(reply(400, json.dumps({"error": "y" * 2_000_000}).encode())) as stub:
        err = failure_of(lambda: fetch_answers([ASK], settings(stub.url), SAMPLING))
    assert isinstance(err, ApiComparatorError) and err.status == 400 and "larger than" not in str(err)
    assert len(str(err)) < 1000


# ---------------------------------------------------------------------------------- through the CLI (flow tier)
@pytest.mark.flow
@pytest.mark.usefixtures("prefect_api")
@pytest.mark.parametrize("status", [401, 500])
def test_cli_train_against_a_failing_server_prints_one_error_line_and_sends_within_one_budget(
    status, tmp_path, monkeypatch
):
    """`pbrl train` of tiny-comparator-api.yaml against a server that refuses (401) or keeps failing (500):
    exit 1 with one ``error:`` line and no traceback; a 500 is sent ``max_attempts`` (5) times per request,
    never multiplied by the stage's retries."""
    import dataclasses

    from typer.testing import CliRunner

    from pbrl.cli.commands import app
    from stages import sample_candidates

    real = sample_candidates.api_settings
    monkeypatch.setattr(  # fast backoff: the budget, not the waits, is under test
        sample_candidates,
        "api_settings",
        lambda job: dataclasses.replace(real(job), backoff_base=0.01, backoff_max=0.02),
    )
    monkeypatch.setenv("PBRL_COMPARATOR_API_KEY", KEY)
    config = Path(__file__).resolve().parents[3] / "flows" / "configs" / "tiny-comparator-api.yaml"
    with Stub(reply(status, json.dumps({"error": f"no, {KEY[4:30]}"}).encode())) as stub:
        result = CliRunner().invoke(
            app, ["train", str(config), "--set", f"output_dir={tmp_path}", "--set", f"comparator_api_url={stub.url}"]
        )
    output = result.output
    assert result.exit_code == 1, output
    assert output.count("error:") == 1 and "Traceback" not in output, output
    assert f"HTTP {status}" in output and key_pieces(output) == []
    from pbrl.data.items import read_items
    from pbrl.data.storage import RunPaths

    asks = 2 * len(read_items(RunPaths(tmp_path / "tiny-comparator-api"), "train"))  # agents x items, round 1
    if status == 401:
        assert "PBRL_COMPARATOR_API_KEY" in output and len(stub.records) == asks
    else:  # before: 5 sends x 4 stage attempts per request, and "gave up after 5 attempts"
        assert "after 5 attempt(s)" in output and len(stub.records) == 5 * asks
