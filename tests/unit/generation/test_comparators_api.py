"""The API comparator against a real HTTP server on 127.0.0.1 (started by the tests, stopped by itself).

:class:`LoopbackServer` serves the four formats of docs/design/algorithms.md#api-comparators, answering from the tiny
model (or from a responder function), records every request's body and headers and the most requests in flight, and
can be told to answer the next requests with 429 + Retry-After, 500, a reply slower than the timeout, 400, or fewer
choices than ``n``. Expected bodies below are written out by hand from the table in
docs/design/algorithms.md#api-comparators. Hostile servers and configs: tests/unit/generation/test_api_client_faults.py.
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from pbrl.errors import TransientError
from pbrl.generation.api_client import fetch_answers
from pbrl.generation.api_errors import ApiComparatorError, ApiRetriesSpentError
from pbrl.generation.api_formats import ApiRequest, ApiSettings
from pbrl.generation.sampling import SamplingSettings

KEY = "sk-loopback-7f3a9c1e5b"  # a distinctive value: scanned for in artifacts and messages
KEY_ENV = "PBRL_TEST_COMPARATOR_KEY"
SAMPLING = SamplingSettings(max_new_tokens=8, temperature=1.0, top_p=0.9, top_k=20, batch_size=8)


def request_prompt(body: dict[str, Any]) -> str:
    """The prompt of a request in any of the four formats."""
    if "messages" in body:
        return body["messages"][0]["content"]
    return body["input"] if "input" in body else body["prompt"]


def request_n(body: dict[str, Any]) -> int:
    return int(body.get("n", body.get("num_candidates", 1)))


def shape(fmt: str, texts: list[str]) -> dict[str, Any]:
    """A response in format ``fmt`` holding ``texts`` (anthropic/openai_responses: exactly one)."""
    if fmt == "generic":
        return {"completions": texts}
    if fmt == "openai":
        return {
            "choices": [
                {"index": i, "message": {"role": "assistant", "content": t}, "finish_reason": "stop"}
                for i, t in enumerate(texts)
            ]
        }
    if fmt == "anthropic":
        (text,) = texts
        half = len(text) // 2  # two text blocks (and a non-text one) that the client must join
        return {
            "content": [
                {"type": "text", "text": text[:half]},
                {"type": "thinking", "thinking": "x"},
                {"type": "text", "text": text[half:]},
            ],
            "stop_reason": "end_turn",
        }
    (text,) = texts
    return {
        "status": "completed",
        "output": [
            {"type": "reasoning", "content": []},
            {"type": "message", "content": [{"type": "output_text", "text": text}]},
        ],
    }


class TinyModelWriter:
    """Texts from the tiny model: answer j to a prompt is sampled with seed hash(prompt, j, call count)."""

    def __init__(self, model_dir: Path):
        from pbrl.models.loading import load_model, load_tokenizer

        self.model, self.tokenizer = load_model(model_dir), load_tokenizer(model_dir)
        self.lock = threading.Lock()
        self.calls = 0

    def __call__(self, fmt: str, body: dict[str, Any], n: int) -> list[str]:
        from pbrl.data.seeds import derive_seed
        from pbrl.generation.sampling import encode_prompt, generate

        with self.lock:
            self.calls += 1
            prompt = request_prompt(body)
            ids = encode_prompt(self.tokenizer, prompt)
            seeds = [
                derive_seed(0, round_index=0, stage="server", item=prompt, index=self.calls * 100 + j) for j in range(n)
            ]
            gens = generate(self.model, self.tokenizer, [ids] * n, seeds, SAMPLING)
        return [g.text or "empty" for g in gens]


@dataclass
class Recorded:
    path: str
    headers: dict[str, str]  # lower-cased names
    body: dict[str, Any]


class LoopbackServer:
    """A threaded HTTP server on 127.0.0.1 (free port) in a daemon thread; stops on ``close`` or after
    ``max_requests`` requests. ``script`` holds actions for the next requests, in arrival order:
    ``("429", retry_after)``, ``("500",)``, ``("slow", seconds)``, ``("400",)``, ``("short", k)``."""

    def __init__(
        self,
        fmt: str,
        writer: Callable[[str, dict[str, Any], int], list[str]],
        *,
        delay: float = 0.0,
        max_requests: int = 2000,
    ):
        self.fmt, self.writer, self.delay, self.max_requests = fmt, writer, delay, max_requests
        self.records: list[Recorded] = []
        self.sent: dict[str, list[str]] = {}  # prompt -> every answer text served for it, in order
        self.script: deque[tuple[Any, ...]] = deque()
        self.lock = threading.Lock()
        self.in_flight = self.max_in_flight = 0
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # keep test output quiet
                pass

            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server.lock:
                    server.records.append(Recorded(self.path, {k.lower(): v for k, v in self.headers.items()}, body))
                    action = server.script.popleft() if server.script else ("ok",)
                    server.in_flight += 1
                    server.max_in_flight = max(server.max_in_flight, server.in_flight)
                    done = len(server.records) >= server.max_requests
                try:
                    time.sleep(server.delay)  # the request's work, counted in flight
                finally:
                    # Counted out before the reply is written: once the client has its answer it may send the
                    # next request at once, which must not be counted as overlapping this one.
                    with server.lock:
                        server.in_flight -= 1
                server.answer(self, action, body)
                if done:
                    threading.Thread(target=server.httpd.shutdown, daemon=True).start()

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1/endpoint"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def answer(self, handler: BaseHTTPRequestHandler, action: tuple[Any, ...], body: dict[str, Any]) -> None:
        kind = action[0]
        if kind == "slow":
            time.sleep(action[1])
        if kind in ("429", "500", "400"):
            payload = json.dumps({"error": f"scripted {kind}"}).encode()
            handler.send_response(int(kind))
            if kind == "429":
                handler.send_header("Retry-After", str(action[1]))
        else:
            n = request_n(body) if kind != "short" else action[1]
            texts = self.writer(self.fmt, body, n)
            with self.lock:
                self.sent.setdefault(request_prompt(body), []).extend(texts)
            payload = json.dumps(shape(self.fmt, texts)).encode()
            handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(payload)))
        handler.end_headers()
        try:
            handler.wfile.write(payload)
        except (BrokenPipeError, ConnectionResetError):  # the client gave up (timeout test)
            pass

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def __enter__(self) -> LoopbackServer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


@pytest.fixture(scope="module")
def writer(tiny_model_dir):
    return TinyModelWriter(tiny_model_dir)


@pytest.fixture
def key(monkeypatch):
    monkeypatch.setenv(KEY_ENV, KEY)
    return KEY


def settings(fmt: str, url: str, **kw: Any) -> ApiSettings:
    base: dict[str, Any] = {
        "api_format": fmt,
        "url": url,
        "model": "tiny-remote",
        "key_env": KEY_ENV,
        "timeout": 5.0,
        "backoff_base": 0.01,
        "backoff_max": 0.05,
    }
    base.update(kw)
    return ApiSettings(**base)


ITEM = {"item_id": "q1", "topic": "reward"}
ASK = ApiRequest("agent 1, item 'q1'", "Say one word about reward.", 1, ITEM, 3)
MESSAGES = [{"role": "user", "content": "Say one word about reward."}]
# The exact bodies of docs/design/algorithms.md#api-comparators for ASK (3 answers) under SAMPLING, one entry per
# request sent.
EXPECTED_BODIES = {
    "generic": [
        {
            "prompt": "Say one word about reward.",
            "agent_index": 1,
            "task_item": ITEM,
            "num_candidates": 3,
            "max_new_tokens": 8,
            "temperature": 1.0,
            "top_p": 0.9,
            "top_k": 20,
            "model": "tiny-remote",
        }
    ],
    "openai": [
        {
            "model": "tiny-remote",
            "messages": MESSAGES,
            "n": 3,
            "max_completion_tokens": 8,
            "temperature": 1.0,
            "top_p": 0.9,
        }
    ],
    "anthropic": [{"model": "tiny-remote", "max_tokens": 8, "messages": MESSAGES, "temperature": 1.0}] * 3,
    "openai_responses": [{"model": "tiny-remote", "input": "Say one word about reward.", "max_output_tokens": 8}] * 3,
}


@pytest.mark.parametrize("fmt", ["generic", "openai", "anthropic", "openai_responses"])
def test_each_format_sends_the_spec_body_and_headers_and_gets_exactly_n_answers(fmt, writer, key):
    with LoopbackServer(fmt, writer) as server:
        (answers,) = fetch_answers([ASK], settings(fmt, server.url), SAMPLING)
    assert [r.body for r in server.records] == EXPECTED_BODIES[fmt]
    assert len(answers) == 3 and all(a.text and a.finish_reason == "api" for a in answers)
    for r in server.records:
        assert r.path == "/v1/endpoint" and r.headers["content-type"] == "application/json"
        if fmt == "anthropic":
            assert r.headers["x-api-key"] == KEY and r.headers["anthropic-version"] == "2023-06-01"
            assert "authorization" not in r.headers
        else:
            assert r.headers["authorization"] == f"Bearer {KEY}" and "x-api-key" not in r.headers


def test_extra_body_is_merged_last_and_custom_key_header_prefix(writer, key):
    with LoopbackServer("openai", writer) as server:
        fetch_answers(
            [ASK],
            settings(
                "openai",
                server.url,
                extra_body={"temperature": 0.5, "seed": 7},
                key_header="api-key",
                key_prefix="",
                headers={"X-Team": "a"},
            ),
            SAMPLING,
        )
    (r,) = server.records
    assert r.body["temperature"] == 0.5 and r.body["seed"] == 7
    assert r.headers["api-key"] == KEY and r.headers["x-team"] == "a" and "authorization" not in r.headers


def test_429_waits_at_least_retry_after_then_succeeds(writer, key):
    with LoopbackServer("generic", writer) as server:
        server.script.append(("429", 1))
        start = time.monotonic()
        (answers,) = fetch_answers([ASK], settings("generic", server.url), SAMPLING)
        elapsed = time.monotonic() - start
    assert len(server.records) == 2 and len(answers) == 3
    assert elapsed >= 1.0  # backoff alone is at most 0.05 s


def quick_writer(fmt: str, body: dict[str, Any], n: int) -> list[str]:
    """Answers at once (the tiny model may take seconds on a loaded machine: too slow for deadline tests)."""
    return [f"answer {j}" for j in range(n)]


def test_500_and_a_reply_past_the_timeout_are_retried(key):
    with LoopbackServer("openai", quick_writer) as server:
        server.script.extend([("500",), ("slow", 1.5)])
        (answers,) = fetch_answers([ASK], settings("openai", server.url, timeout=0.5), SAMPLING)
    assert len(server.records) == 3 and len(answers) == 3
    assert [r.body for r in server.records] == EXPECTED_BODIES["openai"] * 3


def test_a_400_is_tried_exactly_once_and_raises_a_typed_error_without_the_key(writer, key):
    with LoopbackServer("anthropic", writer) as server:
        server.script.append(("400",))
        with pytest.raises(ApiComparatorError) as info:
            fetch_answers([ASK], settings("anthropic", server.url), SAMPLING)
    assert len(server.records) == 1
    err = info.value
    assert not isinstance(err, TransientError)
    assert (err.status, err.api_format, err.item) == (400, "anthropic", "agent 1, item 'q1'")
    assert "scripted 400" in str(err) and KEY not in str(err) and KEY not in repr(err.args)


def test_a_server_echoing_the_key_is_redacted_in_the_error(key):
    def echo(fmt, body, n):
        return ["x"] * n

    with LoopbackServer("generic", echo) as server:
        server.answer = lambda handler, action, body: _echo_key(handler)  # type: ignore[method-assign]
        with pytest.raises(ApiComparatorError) as info:
            fetch_answers([ASK], settings("generic", server.url), SAMPLING)
    assert KEY not in str(info.value) and "<hidden>" in str(info.value)


def _echo_key(handler: BaseHTTPRequestHandler) -> None:
    payload = json.dumps({"error": f"bad key {handler.headers['Authorization']}"}).encode()
    handler.send_response(401)
    handler.send_header("Content-Length", str(len(payload)))
    handler.end_headers()
    handler.wfile.write(payload)


def test_retries_run_out_with_a_typed_error_that_counts_the_requests_sent(writer, key):
    with LoopbackServer("generic", writer) as server:
        server.script.extend([("500",)] * 3)
        with pytest.raises(ApiRetriesSpentError) as info:
            fetch_answers([ASK], settings("generic", server.url, max_attempts=3), SAMPLING)
    assert len(server.records) == 3
    err = info.value
    assert err.status == 500 and (err.attempts, err.sent) == (3, 3)
    assert "after 3 attempt(s)" in str(err) and "3 request(s) sent" in str(err)
    # The client spent the one retry budget: not a TransientError, so Prefect's stage retries never resend.
    assert not isinstance(err, TransientError)


@pytest.mark.parametrize(
    "fmt,max_n,asked", [("openai", None, [4, 3]), ("openai", 2, [2, 2, 1]), ("generic", None, [4, 3])]
)
def test_fewer_answers_than_asked_are_topped_up(fmt, max_n, asked, writer, key):
    with LoopbackServer(fmt, writer) as server:
        server.script.append(("short", 1))
        (answers,) = fetch_answers(
            [ApiRequest("r", "Say a word.", 0, ITEM, 4)], settings(fmt, server.url, max_n_per_request=max_n), SAMPLING
        )
    assert [request_n(r.body) for r in server.records] == asked
    assert len(answers) == 4


def test_requests_in_flight_never_exceed_max_concurrency(writer, key):
    asks = [ApiRequest(f"r{i}", f"Say word {i}.", 0, ITEM, 1) for i in range(9)]
    with LoopbackServer("generic", writer, delay=0.2) as server:
        results = fetch_answers(asks, settings("generic", server.url, max_concurrency=3), SAMPLING)
    assert len(server.records) == 9 and [len(r) for r in results] == [1] * 9
    assert server.max_in_flight == 3


def test_an_unset_key_variable_is_named_and_nothing_is_sent(monkeypatch, writer):
    monkeypatch.delenv(KEY_ENV, raising=False)
    with LoopbackServer("generic", writer) as server:
        with pytest.raises(ApiComparatorError, match=KEY_ENV):
            fetch_answers([ASK], settings("generic", server.url), SAMPLING)
    assert server.records == []


# ----------------------------------------------------------------------------------- through the stage
def api_job_fields(url: str, fmt: str = "openai", **kw: Any) -> dict[str, Any]:
    return {
        "comparator_policy": "api",
        "comparator_api_format": fmt,
        "comparator_api_url": url,
        "comparator_api_model": "tiny-remote",
        "comparator_api_key_env": KEY_ENV,
        "comparator_api_timeout": 10.0,
        **kw,
    }


def test_stage_stores_answers_in_each_target_vocabulary_and_a_rerun_resumes(tiny_model_dir, tmp_path, writer, key):
    from pbrl.data.schema import CANDIDATES
    from pbrl.data.storage import RunPaths
    from pbrl.data.tables import read_rows
    from pbrl.models.loading import load_tokenizer
    from stages import sample_candidates
    from tests.helpers import new_run

    tokenizer = load_tokenizer(tiny_model_dir)
    with LoopbackServer("openai", writer) as server:
        run_dir, job = new_run(tiny_model_dir, tmp_path, **api_job_fields(server.url, comparator_api_max_concurrency=1))
        server.script.extend([("ok",), ("ok",), ("400",)])  # the third (agent, item) request is refused
        with pytest.raises(ApiComparatorError) as info:
            sample_candidates.run(run_dir, 1, job)
        assert info.value.status == 400
        assert len(server.records) == 8  # 2 agents x 4 items, one request each (n = 3); the others finished
        sample_candidates.run(run_dir, 1, job)
        assert len(server.records) == 9  # only the refused request is asked again
        rows = read_rows(RunPaths(run_dir).candidates(1), CANDIDATES)
        sample_candidates.run(run_dir, 1, job)
        assert len(server.records) == 9  # every answer is stored: nothing is requested again
    comparator = [r for r in rows if r["side"] == "comparator"]
    assert len(comparator) == 2 * 4 * 3
    assert {r["ids_source"] for r in rows if r["side"] == "target"} == {"generated"}
    for r in comparator:
        assert r["ids_source"] == "encoded_from_text" and r["finish_reason"] == "api" and r["seed"] is None
        # Encoded once with the target agent's tokenizer, its EOS (id 3) appended as the answer ended.
        assert r["completion_ids"] == tokenizer(r["completion"], add_special_tokens=False).input_ids + [3]
        assert r["completion"] in server.sent[r["prompt"]]
    assert KEY not in "".join(str(r) for r in rows)


@pytest.mark.flow
@pytest.mark.usefixtures("prefect_api")
def test_tiny_api_config_trains_two_rounds_and_the_key_appears_nowhere(
    tmp_path, writer, key, monkeypatch, caplog, capfd
):
    """`pbrl train` of flows/configs/tiny-comparator-api.yaml against the loopback server; then the run folder,
    the Prefect API's stored flow-run parameters and every captured log line are scanned for the key."""
    import logging

    from prefect.client.orchestration import get_client
    from typer.testing import CliRunner

    from pbrl.cli.commands import app

    monkeypatch.setenv("PBRL_COMPARATOR_API_KEY", KEY)
    config = Path(__file__).resolve().parents[3] / "flows" / "configs" / "tiny-comparator-api.yaml"
    caplog.set_level(logging.DEBUG)
    with LoopbackServer("openai", writer) as server:
        result = CliRunner().invoke(
            app, ["train", str(config), "--set", f"output_dir={tmp_path}", "--set", f"comparator_api_url={server.url}"]
        )
    assert result.exit_code == 0, result.output
    run_dir = tmp_path / "tiny-comparator-api"
    assert (run_dir / "rounds" / "0002" / "candidates.parquet").is_file()
    from pbrl.data.items import read_items
    from pbrl.data.storage import RunPaths

    num_items = len(read_items(RunPaths(run_dir), "train"))
    assert len(server.records) == 2 * 2 * num_items  # rounds x agents x items, n = 4 answers per request
    assert {request_n(r.body) for r in server.records} == {4}
    assert all(r.headers["authorization"] == f"Bearer {KEY}" for r in server.records)  # the key was used

    needle = KEY.encode()
    leaks = [p for p in run_dir.rglob("*") if p.is_file() and needle in p.read_bytes()]
    assert leaks == []
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs()
        task_runs = client.read_task_runs()
        api_logs = client.read_logs()
    assert runs and all(KEY not in json.dumps(r.parameters, default=str) for r in runs)
    assert task_runs and all(KEY not in json.dumps(r.model_dump(mode="json"), default=str) for r in task_runs)
    assert all(KEY not in log.message for log in api_logs)
    out, err = capfd.readouterr()
    logged = result.output + out + err + "\n".join(r.getMessage() for r in caplog.records)
    assert "report:" in result.output  # the CLI output was captured (it names the report)
    assert KEY not in logged


def test_no_answer_to_a_top_up_and_a_malformed_reply_are_typed_errors(writer, key):
    with LoopbackServer("openai", writer) as server:
        server.script.extend([("short", 1), ("short", 0)])
        with pytest.raises(ApiComparatorError, match="returned no answer") as info:
            fetch_answers([ASK], settings("openai", server.url), SAMPLING)
    assert [request_n(r.body) for r in server.records] == [3, 2] and info.value.status is None

    with LoopbackServer("openai", writer) as server:
        server.fmt = "generic"  # answers {"completions": [...]} where choices[] is expected
        with pytest.raises(ApiComparatorError, match="malformed response") as info:
            fetch_answers([ASK], settings("openai", server.url), SAMPLING)
    assert len(server.records) == 1 and info.value.status == 200


def test_connection_errors_are_retried_then_raise_a_typed_error_counting_them(key):
    import socket

    with socket.socket() as s:  # a port with nothing listening on it
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ApiRetriesSpentError, match="connection error") as info:
        fetch_answers([ASK], settings("generic", f"http://127.0.0.1:{port}/x", max_attempts=2), SAMPLING)
    assert info.value.status is None and KEY not in str(info.value)
    assert (info.value.attempts, info.value.sent) == (2, 0) and "2 could not connect" in str(info.value)
