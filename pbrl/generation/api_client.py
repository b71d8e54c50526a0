"""API comparators over httpx (SPEC §5.3.1): request bodies, headers, response parsing, retries and a bound
on the requests in flight.

Formats (``comparator_api_format``):

=================== ==================================================================== ============ ===========
format              request body                                                         per request  answers at
=================== ==================================================================== ============ ===========
``generic``         ``{prompt, agent_index, task_item, num_candidates, max_new_tokens,   all          list at the
                    temperature, top_p, top_k, model?}``                                              dotted path
``openai``          Chat Completions ``{model, messages, n, max_completion_tokens,       n            ``choices[].
                    temperature, top_p}``                                                             message.content``
``anthropic``       Messages ``{model, max_tokens, messages, temperature}`` (never       1            text blocks,
                    ``top_p``); headers ``x-api-key``, ``anthropic-version``                          joined
``openai_responses`` Responses ``{model, input, max_output_tokens}`` (no ``n``)           1            ``output_text``
                                                                                                      blocks of
                                                                                                      ``message`` items
=================== ==================================================================== ============ ===========

``comparator_api_extra_body`` is merged last into every body; None values are dropped. A server that
returns fewer answers than asked is asked again for the rest (a top-up); more are cut to the number asked.

Retries (exponential backoff with full jitter, ``Retry-After`` honoured as a lower bound) on 429, 5xx,
timeouts and connection errors; any other 4xx is tried once. At most ``max_concurrency`` requests are in
flight (one ``asyncio.Semaphore`` over an ``httpx.AsyncClient``).

The key is read from the environment variable named ``key_env`` at call time, only into the request header;
it is redacted from every error message (a server may echo it back) and never stored or logged.
"""

from __future__ import annotations

import asyncio
import email.utils
import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, stop_after_attempt, wait_random_exponential

from pbrl.errors import TransientError
from pbrl.generation.sampling import SamplingSettings

FORMATS = ("generic", "openai", "anthropic", "openai_responses")
ANTHROPIC_VERSION = "2023-06-01"
_BODY_SHOWN = 300  # characters of a server's error body quoted in an error


class ApiComparatorError(RuntimeError):
    """An API comparator request failed for good. Names the format, the item and the HTTP status (None when
    no response came back); never the key.

    Attributes:
        status: HTTP status code, or None (timeout, connection error, malformed answer).
        api_format: the ``comparator_api_format``.
        item: the item id (and agent) the request was for.
    """

    def __init__(self, message: str, *, status: int | None, api_format: str, item: str):
        self.status, self.api_format, self.item = status, api_format, item
        super().__init__(
            f"API comparator ({api_format}), {item}: {message}" + (f" [HTTP {status}]" if status is not None else "")
        )


class ApiTransientError(ApiComparatorError, TransientError):
    """Retries ran out on a transient failure (429, 5xx, timeout, connection error): worth retrying the stage,
    which resumes from the answers already stored."""


@dataclass(frozen=True)
class ApiSettings:
    """The API comparator's plain settings (from the ``comparator_api_*`` fields).

    Attributes:
        api_format: one of :data:`FORMATS`.
        url: endpoint URL.
        model: model name sent in the body (None: not sent).
        key_env: NAME of the environment variable holding the key (None: no key header).
        key_header / key_prefix: header carrying the key and the text before it ("" = the bare key).
        headers: extra headers of every request.
        extra_body: JSON fields merged last into every body.
        max_n_per_request: openai: most answers asked per request (None = all still missing).
        response_field: generic: dotted path of the answer list in the response JSON.
        timeout: seconds per request.
        max_concurrency: most requests in flight.
        max_attempts: tries per request, ≥ 1 (transient failures only are retried).
        backoff_base / backoff_max: seconds; attempt a waits uniform(0, min(max, base·2^a)), at least Retry-After.
    """

    api_format: str
    url: str
    model: str | None = None
    key_env: str | None = None
    key_header: str = "Authorization"
    key_prefix: str = "Bearer"
    headers: Mapping[str, str] = field(default_factory=dict)
    extra_body: Mapping[str, Any] = field(default_factory=dict)
    max_n_per_request: int | None = None
    response_field: str = "completions"
    timeout: float = 120.0
    max_concurrency: int = 4
    max_attempts: int = 5
    backoff_base: float = 1.0
    backoff_max: float = 60.0

    def __post_init__(self) -> None:
        if self.api_format not in FORMATS:
            raise ValueError(f"comparator_api_format: got {self.api_format!r}; allowed: {', '.join(FORMATS)}")


@dataclass(frozen=True)
class ApiRequest:
    """One ask: ``num_candidates`` answers to ``prompt`` for agent ``agent_index`` on ``task_item``."""

    name: str  # names the request in errors, e.g. "agent 0, item 'q1'"
    prompt: str
    agent_index: int
    task_item: Mapping[str, Any]
    num_candidates: int


@dataclass(frozen=True)
class ApiAnswer:
    """One answer: its text and why it ended (``"api"``: the server finished it; ``"length"``: cut at the
    token limit, as the format reports it)."""

    text: str
    finish_reason: str


def build_body(settings: ApiSettings, sampling: SamplingSettings, request: ApiRequest, n: int) -> dict[str, Any]:
    """The JSON body of one request asking ``n`` answers (SPEC §5.3.1); None values dropped, extra_body last."""
    messages = [{"role": "user", "content": request.prompt}]
    if settings.api_format == "generic":
        body: dict[str, Any] = {
            "prompt": request.prompt,
            "agent_index": request.agent_index,
            "task_item": json.loads(json.dumps(dict(request.task_item), default=str)),
            "num_candidates": n,
            "max_new_tokens": sampling.max_new_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k,
            "model": settings.model,
        }
    elif settings.api_format == "openai":
        body = {
            "model": settings.model,
            "messages": messages,
            "n": n,
            "max_completion_tokens": sampling.max_new_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
        }
    elif settings.api_format == "anthropic":
        body = {
            "model": settings.model,
            "max_tokens": sampling.max_new_tokens,
            "messages": messages,
            "temperature": sampling.temperature,
        }
    else:  # openai_responses
        body = {"model": settings.model, "input": request.prompt, "max_output_tokens": sampling.max_new_tokens}
    body = {k: v for k, v in body.items() if v is not None}
    body.update(settings.extra_body)
    return body


def build_headers(settings: ApiSettings, key: str | None) -> dict[str, str]:
    """Request headers: JSON content type, the extra headers, the key header (anthropic: ``x-api-key`` with the
    bare key, plus ``anthropic-version``)."""
    headers = {"Content-Type": "application/json", **settings.headers}
    header, prefix = settings.key_header, settings.key_prefix
    if settings.api_format == "anthropic":
        headers.setdefault("anthropic-version", ANTHROPIC_VERSION)
        if header.lower() == "authorization":
            header, prefix = "x-api-key", ""
    if key is not None:
        headers[header] = f"{prefix} {key}" if prefix else key
    return headers


def answers_per_request(settings: ApiSettings, missing: int) -> int:
    """How many answers the next request asks for when ``missing`` are still needed."""
    if settings.api_format in ("anthropic", "openai_responses"):
        return 1
    if settings.api_format == "openai" and settings.max_n_per_request is not None:
        return min(missing, settings.max_n_per_request)
    return missing


def _dotted(data: Any, path: str) -> Any:
    for part in path.split("."):
        if isinstance(data, Mapping) and part in data:
            data = data[part]
        elif isinstance(data, list) and part.isdigit() and int(part) < len(data):
            data = data[int(part)]
        else:
            raise ValueError(f"no field {path!r} in the response")
    return data


def parse_answers(settings: ApiSettings, data: Any) -> list[ApiAnswer]:
    """The answers in one response JSON.

    Raises:
        ValueError: the response does not have the format's shape (what is missing is named).
    """
    fmt = settings.api_format
    if fmt == "generic":
        found = _dotted(data, settings.response_field)
        if not isinstance(found, list):
            raise ValueError(f"{settings.response_field!r} is not a list")
        out = []
        for entry in found:
            text = entry.get("text") if isinstance(entry, Mapping) else entry
            if not isinstance(text, str):
                raise ValueError(f"an entry of {settings.response_field!r} is neither a string nor {{'text': str}}")
            out.append(ApiAnswer(text, "api"))
        return out
    if fmt == "openai":
        out = []
        for choice in _dotted(data, "choices"):
            text = _dotted(choice, "message.content")
            if not isinstance(text, str):
                raise ValueError("choices[].message.content is not a string")
            out.append(ApiAnswer(text, "length" if choice.get("finish_reason") == "length" else "api"))
        return out
    if fmt == "anthropic":
        blocks = _dotted(data, "content")
        text = "".join(b["text"] for b in blocks if isinstance(b, Mapping) and b.get("type") == "text")
        return [ApiAnswer(text, "length" if data.get("stop_reason") == "max_tokens" else "api")]
    messages = [item for item in _dotted(data, "output") if isinstance(item, Mapping) and item.get("type") == "message"]
    parts = [
        c["text"]
        for item in messages
        for c in item.get("content", [])
        if isinstance(c, Mapping) and c.get("type") == "output_text"
    ]
    if not parts:
        raise ValueError("no output[] message with output_text content")
    incomplete = data.get("status") == "incomplete"
    return [ApiAnswer("".join(parts), "length" if incomplete else "api")]


def retry_after_seconds(response: httpx.Response) -> float:
    """The ``Retry-After`` header in seconds (delta-seconds or an HTTP date); 0 when absent or unreadable."""
    value = response.headers.get("retry-after")
    if value is None:
        return 0.0
    try:
        return max(0.0, float(value))
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return 0.0
        return max(0.0, when.timestamp() - time.time())


def _redact(text: str, key: str | None) -> str:
    return text.replace(key, "<hidden>") if key else text


class _Retryable(Exception):
    """A failure worth another attempt: the message, the HTTP status (None without a response) and the
    server's ``Retry-After`` in seconds (the lower bound of the next wait)."""

    def __init__(self, failure: str, status: int | None, wait_at_least: float):
        super().__init__(failure)
        self.failure, self.status, self.wait_at_least = failure, status, wait_at_least


class _Client:
    """One fetch: the async client, the semaphore and the key (held in memory only)."""

    def __init__(self, settings: ApiSettings, sampling: SamplingSettings, key: str | None):
        self.settings, self.sampling, self.key = settings, sampling, key
        self.headers = build_headers(settings, key)
        self.semaphore = asyncio.Semaphore(settings.max_concurrency)

    def error(self, cls: type[ApiComparatorError], message: str, status: int | None, request: ApiRequest):
        return cls(_redact(message, self.key), status=status, api_format=self.settings.api_format, item=request.name)

    async def _attempt(
        self, client: httpx.AsyncClient, request: ApiRequest, body: dict[str, Any], n: int
    ) -> list[ApiAnswer]:
        """One POST. Raises _Retryable on 429, 5xx, timeouts and connection errors; ApiComparatorError on
        any other refusal or a malformed answer (never retried)."""
        s = self.settings
        try:
            async with self.semaphore:
                response = await client.post(s.url, json=body, headers=self.headers, timeout=s.timeout)
        except httpx.TimeoutException:
            raise _Retryable(f"timed out after {s.timeout} s", None, 0.0) from None
        except httpx.TransportError as exc:
            raise _Retryable(f"connection error ({type(exc).__name__}: {exc})", None, 0.0) from None
        status = response.status_code
        if status < 400:
            try:
                return parse_answers(s, response.json())[:n]
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                raise self.error(
                    ApiComparatorError, f"malformed response ({exc}): {response.text[:_BODY_SHOWN]!r}", status, request
                ) from None
        if status != 429 and status < 500:
            raise self.error(ApiComparatorError, f"refused: {response.text[:_BODY_SHOWN]!r}", status, request)
        raise _Retryable(f"transient failure: {response.text[:_BODY_SHOWN]!r}", status, retry_after_seconds(response))

    async def post(self, client: httpx.AsyncClient, request: ApiRequest, n: int) -> list[ApiAnswer]:
        """One request with retries (tenacity: exponential backoff with full jitter, at least Retry-After);
        its answers (possibly fewer than ``n``)."""
        s = self.settings
        body = build_body(s, self.sampling, request, n)
        backoff = wait_random_exponential(multiplier=s.backoff_base, max=s.backoff_max)

        def wait(state: RetryCallState) -> float:
            failed = state.outcome.exception() if state.outcome else None
            return max(getattr(failed, "wait_at_least", 0.0), backoff(state))

        try:
            async for attempt in AsyncRetrying(
                stop=stop_after_attempt(s.max_attempts),
                wait=wait,
                retry=retry_if_exception_type(_Retryable),
                reraise=True,
            ):
                with attempt:
                    return await self._attempt(client, request, body, n)
        except _Retryable as exc:
            raise self.error(
                ApiTransientError, f"{exc.failure}; gave up after {s.max_attempts} attempts", exc.status, request
            ) from None
        raise AssertionError("unreachable: tenacity either returns, retries or re-raises")

    async def fetch(self, client: httpx.AsyncClient, request: ApiRequest) -> list[ApiAnswer]:
        """Exactly ``request.num_candidates`` answers: requests, then top-ups while a server returns fewer."""
        answers: list[ApiAnswer] = []
        while len(answers) < request.num_candidates:
            missing = request.num_candidates - len(answers)
            got = await self.post(client, request, answers_per_request(self.settings, missing))
            if not got:
                raise self.error(
                    ApiComparatorError,
                    f"the server returned no answer ({len(answers)} of {request.num_candidates} collected)",
                    None,
                    request,
                )
            answers += got[:missing]
        return answers


def _run_coroutine(make: Callable[[], Any]) -> Any:
    """``asyncio.run(make())``, in a helper thread when this thread already runs an event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(make())
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(lambda: asyncio.run(make())).result()


def fetch_answers(
    requests: Sequence[ApiRequest],
    settings: ApiSettings,
    sampling: SamplingSettings,
    *,
    on_answers: Callable[[ApiRequest, list[ApiAnswer]], None] | None = None,
) -> list[list[ApiAnswer]]:
    """Exactly ``num_candidates`` answers for every request, in request order, with at most
    ``settings.max_concurrency`` requests in flight.

    ``on_answers`` is called as each request completes (the stage stores them, so a rerun asks only for the
    rest); every request runs to its end even when another fails, then the first failure is raised.

    Raises:
        ApiComparatorError: the key variable is not set, a request was refused (4xx other than 429) or
            answered malformed, or a server returned no answer to a top-up.
        ApiTransientError: retries ran out on 429, 5xx, timeouts or connection errors.
    """
    key = None
    if settings.key_env is not None:
        key = os.environ.get(settings.key_env)
        if not key:
            raise ApiComparatorError(
                f"the environment variable {settings.key_env} (comparator_api_key_env) is not set",
                status=None,
                api_format=settings.api_format,
                item="every item",
            )
    fetcher = _Client(settings, sampling, key)

    async def one(client: httpx.AsyncClient, request: ApiRequest) -> list[ApiAnswer]:
        answers = await fetcher.fetch(client, request)
        if on_answers is not None:
            on_answers(request, answers)
        return answers

    async def run() -> list[Any]:
        limits = httpx.Limits(max_connections=settings.max_concurrency)
        async with httpx.AsyncClient(limits=limits, timeout=settings.timeout) as client:
            return await asyncio.gather(*(one(client, r) for r in requests), return_exceptions=True)

    results = _run_coroutine(run)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results
