"""API comparators over httpx (docs/design/algorithms.md#api-comparators): request bodies, headers, response
parsing, retries, a deadline and a size cap per request, and a bound on the requests in flight.

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

**One request.** ``comparator_api_timeout`` (``ApiSettings.timeout``, seconds) is the *total* deadline of one
request: connect, send and every read of the answer, however slowly a server trickles it. At most
``max_response_bytes`` (:data:`MAX_RESPONSE_BYTES`, 8 MiB, after content decoding) of an answer are read; the
body is streamed and reading stops beyond the cap. Redirects are never followed (the request carries the key,
which must not go to another address): a 3xx is reported as a redirect, with its ``Location``. At most
``max_concurrency`` requests are in flight (one ``asyncio.Semaphore`` over an ``httpx.AsyncClient``).

**Retries: one budget.** The client owns the only retry budget of a request: ``max_attempts`` requests sent
(5 by default), on 408, 429, 5xx, a missed deadline and connection errors, with exponential backoff and full
jitter (tenacity) and at least the server's ``Retry-After`` (delta-seconds or an HTTP date). Every wait is
logged (logger ``pbrl.generation.api_client``, WARNING) with its length, its reason and the attempt. A
``Retry-After`` beyond ``retry_after_max`` (:data:`RETRY_AFTER_MAX`, 60 s) is not waited for: the request
gives up at once, naming the server's value. When the budget is spent the client raises
:class:`ApiRetriesSpentError`, which is *not* a :class:`~pbrl.errors.TransientError`, so Prefect's stage
retries (:mod:`flows.retry`) never resend API requests and its message counts the requests really sent. The
answers already received are stored by the stage, so ``pbrl train --resume`` later asks only for the rest.
Any other 4xx, a redirect, a malformed or oversized answer is tried once.

**Errors.** Every failure is an :class:`ApiComparatorError` — an expected error
(:data:`pbrl.errors.EXPECTED_ERRORS`), shown by the CLI as one ``error:`` line — naming the format, the item,
the HTTP status, the URL (without credentials) and what to change.

**The key** is read from the environment variable named ``key_env`` at call time, only into the request header;
it is never stored or logged. Credentials in the settings themselves (URL user info or query keys, auth-like
headers, secret-like body fields) are refused before anything is sent (:mod:`pbrl.config.trainer_rules`). Every
text that leaves the client — exception messages, log lines, quoted server bodies, ``Location`` headers and the
answers themselves — goes through :class:`Redactor`, which replaces any piece of at least
:data:`REDACT_MIN_CHARS` characters of the key (the whole key when shorter), as sent or percent-, JSON- or
base64-encoded, whatever its position or cut.
"""

from __future__ import annotations

import asyncio
import base64
import datetime
import email.utils
import json
import logging
import math
import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote, quote_plus

import httpx
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, stop_after_attempt, wait_random_exponential

from pbrl.config.trainer_rules import api_credential_problems, safe_url
from pbrl.errors import ConfigError, RemoteServiceError
from pbrl.generation.sampling import SamplingSettings

log = logging.getLogger(__name__)

FORMATS = ("generic", "openai", "anthropic", "openai_responses")
ANTHROPIC_VERSION = "2023-06-01"
RETRY_AFTER_MAX = 60.0  # seconds: the longest server Retry-After waited for; beyond it the request gives up
MAX_RESPONSE_BYTES = 8 * 2**20  # bytes of one answer read at most (after content decoding)
ERROR_BODY_BYTES = 64 * 2**10  # bytes of a non-2xx body read at most: only its start is quoted
REDACT_MIN_CHARS = 8  # any piece of the key this long (the whole key when shorter) is redacted
HIDDEN = "<hidden>"
_BODY_SHOWN = 300  # characters of a server's body quoted in an error
_RETRIED_STATUSES = frozenset({408, 429})  # and every 5xx


class ApiComparatorError(RemoteServiceError):
    """An API comparator request failed for good: refused (4xx), redirected, answered malformed or too large,
    or its retry budget was spent. An expected error (:class:`~pbrl.errors.RemoteServiceError`): the CLI prints its
    message as one ``error:`` line, and it is never retried by the stage. The message names the format, the URL
    (without credentials), the
    item, the HTTP status and what to change; never the key.

    Attributes:
        status: HTTP status code, or None (timeout, connection error, no response).
        api_format: the ``comparator_api_format``.
        item: the item id (and agent) the request was for.
        url: the endpoint, credentials hidden (None when no request was made).
    """

    def __init__(self, message: str, *, status: int | None, api_format: str, item: str, url: str | None = None):
        self.status, self.api_format, self.item, self.url = status, api_format, item, url
        where = f" at {url}" if url else ""
        super().__init__(f"API comparator ({api_format}){where}, {item}: {message}")

    def __reduce__(self) -> tuple[Any, ...]:
        # Keyword-only arguments do not survive pickle's default (Prefect stores a failed task's exception).
        return _rebuild_error, (type(self), self.args, dict(self.__dict__))


def _rebuild_error(cls: type[ApiComparatorError], args: tuple[Any, ...], state: dict[str, Any]) -> ApiComparatorError:
    error = cls.__new__(cls)
    error.args = args
    error.__dict__.update(state)
    return error


class ApiRetriesSpentError(ApiComparatorError):
    """A request's one retry budget is spent on transient failures (408, 429, 5xx, a missed deadline,
    connection errors), or the server asked to wait longer than ``retry_after_max``. Deliberately not a
    :class:`~pbrl.errors.TransientError`: the client already retried, and stage retries would multiply its
    requests (see the module docstring). Try again later; the answers received so far are kept.

    Attributes:
        attempts: requests tried for this answer (the message counts them).
        sent: of those, requests that reached the server (the others could not connect).
        retry_after: the server's last ``Retry-After`` in seconds, or None.
    """

    def __init__(self, message: str, *, attempts: int = 0, sent: int = 0, retry_after: float | None = None, **kw: Any):
        super().__init__(message, **kw)
        self.attempts, self.sent, self.retry_after = attempts, sent, retry_after


@dataclass(frozen=True)
class ApiSettings:
    """The API comparator's plain settings (from the ``comparator_api_*`` fields).

    Attributes:
        api_format: one of :data:`FORMATS`.
        url: endpoint URL (no credentials: refused before sending).
        model: model name sent in the body (None: not sent).
        key_env: NAME of the environment variable holding the key (None: no key header).
        key_header / key_prefix: header carrying the key and the text before it ("" = the bare key).
        headers: extra headers of every request.
        extra_body: JSON fields merged last into every body.
        max_n_per_request: openai: most answers asked per request (None = all still missing).
        response_field: generic: dotted path of the answer list in the response JSON.
        timeout: seconds, the total deadline of one request (connect, send and every read).
        max_concurrency: most requests in flight.
        max_attempts: ≥ 1, times one request (or one top-up) is sent at most: the whole retry budget, the stage
            never retries it (transient failures only are retried).
        backoff_base / backoff_max: seconds; attempt a waits uniform(0, min(max, base·2^a)), at least Retry-After.
        retry_after_max: seconds; a longer server Retry-After gives the request up instead of waiting.
        max_response_bytes: bytes of one response read at most (after content decoding); more is an error.
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
    retry_after_max: float = RETRY_AFTER_MAX
    max_response_bytes: int = MAX_RESPONSE_BYTES

    def __post_init__(self) -> None:
        if self.api_format not in FORMATS:
            raise ValueError(f"comparator_api_format: got {self.api_format!r}; allowed: {', '.join(FORMATS)}")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts: got {self.max_attempts}; must be >= 1")


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
    """The JSON body of one request asking ``n`` answers (docs/design/algorithms.md#api-comparators); None values
    dropped, extra_body last."""
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


_DELTA_SECONDS = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*$")  # digits only: never "inf" or "nan"


def retry_after_seconds(response: httpx.Response | Mapping[str, str]) -> float | None:
    """The server's ``Retry-After`` (of a response, or its headers) in seconds from now: delta-seconds or an
    HTTP date (a past date gives 0). None when absent or unreadable. Unbounded: the caller compares it with its
    cap (a date in 2099 is about 2.3e9 s)."""
    value = (response.headers if isinstance(response, httpx.Response) else response).get("retry-after")
    if value is None:
        return None
    number = _DELTA_SECONDS.match(value)
    if number:
        return float(number.group(1))
    try:
        when = email.utils.parsedate_to_datetime(value.strip())
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if when.tzinfo is None:  # "-0000": RFC 9110 dates are GMT
        when = when.replace(tzinfo=datetime.UTC)
    seconds = when.timestamp() - time.time()
    return max(0.0, seconds) if math.isfinite(seconds) else None


_ASCII_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")  # keeps every length


def _encodings(secret: str) -> set[str]:
    """The forms in which a server may echo ``secret``: as sent, percent-encoded (path, query or form style),
    JSON-escaped (with or without ``\\/``), Python-repr-escaped, base64 on its own."""
    as_json = json.dumps(secret)[1:-1]
    raw = secret.encode("utf-8", errors="replace")
    forms = {
        secret,
        quote(secret, safe=""),
        quote(secret),
        quote_plus(secret, safe=""),
        as_json,
        as_json.replace("/", "\\/"),
        json.dumps(secret, ensure_ascii=False)[1:-1],
        repr(secret)[1:-1],
        base64.b64encode(raw).decode().rstrip("="),
        base64.urlsafe_b64encode(raw).decode().rstrip("="),
    }
    return {form for form in forms if form}


class Redactor:
    """Hides a secret in any text: every stretch that shares at least ``min_chars`` consecutive characters with
    the secret (the whole secret when it is shorter) — in any form of :func:`_encodings`, ASCII case ignored —
    becomes ``<hidden>``, whatever its position or where a truncation cut it. Text without it comes back as is.

    Written here rather than taken from a library: log-scrubbing libraries replace whole known values (or
    patterns of known key formats), not every long-enough piece of one value, which is what a server echoing a
    truncated key leaves behind. Cost: a few ``str.find`` calls (C) per text, however long.
    """

    def __init__(self, secret: str | None, min_chars: int = REDACT_MIN_CHARS):
        self._windows: dict[int, set[str]] = {}  # length n -> every n-character piece of every form
        self._anchors: set[tuple[str, int]] = set()  # (aligned block of a form, n)
        if not secret:
            return
        for form in _encodings(secret):
            low = form.translate(_ASCII_LOWER)
            n = min(min_chars, len(low))
            self._windows.setdefault(n, set()).update(low[i : i + n] for i in range(len(low) - n + 1))
            # Every n-character piece of the form contains one of its blocks of h = ceil(n/2) characters that start
            # at a multiple of h, so finding those few blocks finds every piece.
            h = (n + 1) // 2
            self._anchors.update((low[k : k + h], n) for k in range(0, len(low) - h + 1, h))

    def __call__(self, text: str) -> str:
        """``text`` with every piece of the secret replaced by ``<hidden>``."""
        if not self._anchors or not text:
            return text
        low = text.translate(_ASCII_LOWER)
        spans: list[tuple[int, int]] = []
        for block, n in self._anchors:
            windows = self._windows[n]
            at = low.find(block)
            while at != -1:
                spans += [(s, s + n) for s in range(max(0, at - n + len(block)), at + 1) if low[s : s + n] in windows]
                at = low.find(block, at + 1)
        if not spans:
            return text
        merged: list[list[int]] = []
        for start, end in sorted(spans):
            if merged and start <= merged[-1][1]:  # overlapping or touching pieces: one <hidden>
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        out, pos = [], 0
        for start, end in merged:
            out += [text[pos:start], HIDDEN]
            pos = end
        return "".join(out) + text[pos:]


class _Retryable(Exception):
    """A failure worth another attempt: what happened, the HTTP status (None without a response), the server's
    ``Retry-After`` in seconds (None: not given or unreadable) and as written."""

    def __init__(self, failure: str, status: int | None, retry_after: float | None = None, raw: str | None = None):
        super().__init__(failure)
        self.failure, self.status, self.retry_after, self.raw_retry_after = failure, status, retry_after, raw


class _TooLarge(Exception):
    def __init__(self, status: int, declared: int | None):
        super().__init__(status, declared)
        self.status, self.declared = status, declared


def _refusal_hint(status: int, settings: ApiSettings) -> str:
    """What to change after a 4xx refusal (other than 408 and 429, which are retried)."""
    key = (
        f"the key in the environment variable {settings.key_env} (comparator_api_key_env)"
        if settings.key_env
        else "that a key is sent: set comparator_api_key_env to the NAME of the variable holding it"
    )
    if status == 401:
        return (
            f"the server did not accept the key: check {key}, comparator_api_key_header and comparator_api_key_prefix"
        )
    if status == 403:
        return f"the key may not use this endpoint or model: check {key} and comparator_api_model"
    if status == 404:
        return "nothing at this address: check comparator_api_url (the full endpoint path) and comparator_api_model"
    if status == 405:
        return "this address does not take POST requests: check comparator_api_url (the full endpoint path)"
    if status == 413:
        return (
            "the request is too large: shorten the prompts or lower max_new_tokens / comparator_api_max_n_per_request"
        )
    return (
        "the server refused the request: check comparator_api_model, comparator_api_extra_body and the sampling "
        f"options against comparator_api_format ('{settings.api_format}')"
    )


def _malformed_hint(settings: ApiSettings) -> str:
    field_hint = " and comparator_api_response_field" if settings.api_format == "generic" else ""
    return (
        f"the answer is not a '{settings.api_format}' response: check comparator_api_format{field_hint} and "
        "comparator_api_url"
    )


class _Client:
    """One fetch: the async client, the semaphore and the key (held in memory only, redacted everywhere)."""

    def __init__(self, settings: ApiSettings, sampling: SamplingSettings, key: str | None):
        self.settings, self.sampling = settings, sampling
        self.redact = Redactor(key)
        self.headers = build_headers(settings, key)
        self.semaphore = asyncio.Semaphore(settings.max_concurrency)
        self.url = self.redact(safe_url(settings.url))

    def error(
        self, cls: type[ApiComparatorError], message: str, status: int | None, request: ApiRequest, **kw: Any
    ) -> ApiComparatorError:
        return cls(
            self.redact(message),
            status=status,
            api_format=self.settings.api_format,
            item=self.redact(request.name),
            url=self.url,
            **kw,
        )

    def quoted(self, raw: bytes) -> str:
        """The start of a server's body, fit to show: redacted whole (a key across the cut is hidden too), cut,
        then quoted on one line."""
        return repr(self.redact(raw.decode("utf-8", errors="replace"))[:_BODY_SHOWN])

    async def _exchange(self, client: httpx.AsyncClient, body: dict[str, Any]) -> tuple[int, httpx.Headers, bytes]:
        """One POST and its answer, read as a stream within the deadline and the size cap.

        Raises:
            TimeoutError / httpx.TimeoutException: the deadline passed. httpx.HTTPError: the request failed.
            _TooLarge: a 2xx answer beyond ``max_response_bytes`` (reading stopped there).
        """
        s = self.settings
        # httpx's timeouts bound each phase (connect, each read or write, the pool), never the whole request, so
        # a server trickling bytes could hold one request indefinitely; the stdlib's asyncio.timeout around the
        # whole exchange is the total deadline (httpx's own timeout stays as the per-phase bound).
        async with asyncio.timeout(s.timeout):
            async with client.stream(
                "POST", s.url, json=body, headers=self.headers, timeout=s.timeout, follow_redirects=False
            ) as response:
                ok = response.is_success
                limit = s.max_response_bytes if ok else min(s.max_response_bytes, ERROR_BODY_BYTES)
                declared = response.headers.get("content-length", "").strip()
                if ok and declared.isdigit() and int(declared) > limit:
                    raise _TooLarge(response.status_code, int(declared))
                data = bytearray()
                async for chunk in response.aiter_bytes():  # decoded (gzip ...): the cap holds after decoding
                    data += chunk
                    if len(data) > limit:
                        if ok:
                            raise _TooLarge(response.status_code, None)
                        del data[limit:]  # an error body: only its start is ever shown
                        break
                return response.status_code, response.headers, bytes(data)

    async def _attempt(
        self, client: httpx.AsyncClient, request: ApiRequest, body: dict[str, Any], n: int, tries: dict[str, int]
    ) -> list[ApiAnswer]:
        """One POST. Raises _Retryable on 408, 429, 5xx, a missed deadline and connection errors;
        ApiComparatorError on any other refusal, a redirect, a malformed or oversized answer (never retried)."""
        s = self.settings
        tries["attempts"] += 1
        tries["sent"] += 1
        try:
            async with self.semaphore:
                status, headers, raw = await self._exchange(client, body)
        except (TimeoutError, httpx.TimeoutException) as exc:
            if isinstance(exc, httpx.ConnectTimeout):
                tries["sent"] -= 1
            raise _Retryable(
                f"no complete answer within the {s.timeout:g} s deadline of one request "
                "(comparator_api_timeout: connect, send and every read together)",
                None,
            ) from None
        except httpx.LocalProtocolError as exc:
            tries["sent"] -= 1
            var = s.key_env or "comparator_api_key_env"
            raise self.error(
                ApiComparatorError,
                f"the request could not be sent ({type(exc).__name__}: {exc}): check that {var} holds only the key "
                "(no spaces or line breaks), comparator_api_key_header and comparator_api_headers",
                None,
                request,
            ) from None
        except httpx.TransportError as exc:
            if isinstance(exc, httpx.ConnectError):
                tries["sent"] -= 1
            raise _Retryable(f"connection error ({type(exc).__name__}: {exc})", None) from None
        except httpx.InvalidURL as exc:  # settings built without the config's checks
            raise self.error(
                ApiComparatorError, f"comparator_api_url is not a valid URL ({exc})", None, request
            ) from None
        except httpx.HTTPError as exc:  # e.g. a body that does not decode (gzip): malformed, not worth retrying
            raise self.error(
                ApiComparatorError, f"the answer could not be read ({type(exc).__name__}: {exc})", None, request
            ) from None
        except _TooLarge as exc:
            size = f"{exc.declared} bytes declared" if exc.declared is not None else "more, reading stopped there"
            raise self.error(
                ApiComparatorError,
                f"HTTP {exc.status}, answer larger than the cap of {s.max_response_bytes} bytes per response "
                f"({size}; pbrl.generation.api_client.MAX_RESPONSE_BYTES): ask for fewer answers per request "
                "(comparator_api_max_n_per_request) or fewer tokens (max_new_tokens), or check comparator_api_url",
                exc.status,
                request,
            ) from None
        if 200 <= status < 300:
            try:
                answers = parse_answers(s, json.loads(raw))[:n]
            except (ValueError, KeyError, TypeError, AttributeError, IndexError, RecursionError) as exc:
                reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
                raise self.error(
                    ApiComparatorError,
                    f"HTTP {status}, malformed response ({reason}): {self.quoted(raw)}; {_malformed_hint(s)}",
                    status,
                    request,
                ) from None
            return [ApiAnswer(self.redact(a.text), a.finish_reason) for a in answers]
        if 300 <= status < 400:
            location = headers.get("location")
            where = f"redirect to {safe_url(location)!r}" if location else "redirect (no Location given)"
            raise self.error(
                ApiComparatorError,
                f"HTTP {status} {where}: pbrl does not follow redirects (the request carries the key, which must "
                "not go to another address); set comparator_api_url to the address that answers",
                status,
                request,
            )
        if status in _RETRIED_STATUSES or status >= 500:
            raw_after = headers.get("retry-after")
            raise _Retryable(f"HTTP {status}: {self.quoted(raw)}", status, retry_after_seconds(headers), raw_after)
        raise self.error(
            ApiComparatorError,
            f"HTTP {status}, refused: {self.quoted(raw)}; {_refusal_hint(status, s)}",
            status,
            request,
        )

    def _spent(self, exc: _Retryable, request: ApiRequest, tries: dict[str, int], elapsed: float) -> ApiComparatorError:
        """The error once a request's retry budget is spent (or its Retry-After is beyond the cap)."""
        s = self.settings
        attempts, sent = tries["attempts"], tries["sent"]
        if exc.retry_after is not None and exc.retry_after > s.retry_after_max:
            why = (
                f"the server asked to wait (Retry-After: {exc.raw_retry_after!r}, {exc.retry_after:.0f} s), longer "
                f"than pbrl waits ({s.retry_after_max:g} s, pbrl.generation.api_client.RETRY_AFTER_MAX), so gave up"
            )
        else:
            why = "gave up, the retry budget spent"
        unsent = f", {attempts - sent} could not connect" if sent < attempts else ""
        return self.error(
            ApiRetriesSpentError,
            f"{exc.failure}; {why} after {attempts} attempt(s) in {elapsed:.1f} s ({sent} request(s) sent{unsent}; "
            f"at most {s.max_attempts} per request, and the stage does not retry them). Try again later: the answers "
            "received so far are kept, and `pbrl train --run RUN --resume` asks only for the rest",
            exc.status,
            request,
            attempts=attempts,
            sent=sent,
            retry_after=exc.retry_after,
        )

    async def post(self, client: httpx.AsyncClient, request: ApiRequest, n: int) -> list[ApiAnswer]:
        """One request with retries (tenacity: exponential backoff with full jitter, at least Retry-After, a log
        line per wait); its answers (possibly fewer than ``n``).

        Raises:
            ApiRetriesSpentError: the retry budget is spent, or Retry-After is beyond ``retry_after_max``.
            ApiComparatorError: refused, redirected, malformed or oversized (not retried).
        """
        s = self.settings
        body = build_body(s, self.sampling, request, n)
        backoff = wait_random_exponential(multiplier=s.backoff_base, max=s.backoff_max)
        tries = {"attempts": 0, "sent": 0}
        started = time.monotonic()

        def failed(state: RetryCallState) -> _Retryable:
            exc = state.outcome.exception() if state.outcome else None
            return exc if isinstance(exc, _Retryable) else _Retryable("", None)

        def wait(state: RetryCallState) -> float:
            return max(failed(state).retry_after or 0.0, backoff(state))

        def beyond_cap(state: RetryCallState) -> bool:
            after = failed(state).retry_after
            return after is not None and after > s.retry_after_max

        def announce(state: RetryCallState) -> None:
            exc, sleep = failed(state), state.next_action.sleep if state.next_action else 0.0
            if exc.raw_retry_after is None:
                reason = ""
            elif exc.retry_after is None:
                reason = f", Retry-After {exc.raw_retry_after!r} unreadable, ignored"
            else:
                reason = f", at least the server's Retry-After: {exc.raw_retry_after!r}"
            k = state.attempt_number
            log.warning(
                "%s",
                self.redact(
                    f"API comparator ({s.api_format}) at {self.url}, {request.name}: attempt {k} of {s.max_attempts} "
                    f"failed ({exc.failure}); waiting {sleep:.2f} s{reason} before attempt {k + 1}"
                ),
            )

        try:
            async for attempt in AsyncRetrying(
                stop=stop_after_attempt(s.max_attempts) | beyond_cap,
                wait=wait,
                retry=retry_if_exception_type(_Retryable),
                before_sleep=announce,
                reraise=True,
            ):
                with attempt:
                    return await self._attempt(client, request, body, n, tries)
        except _Retryable as exc:
            raise self._spent(exc, request, tries, time.monotonic() - started) from None
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
                    f"the server returned no answer ({len(answers)} of {request.num_candidates} collected); "
                    + _malformed_hint(self.settings),
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
    ``settings.max_concurrency`` requests in flight, each within ``settings.timeout`` seconds in all and
    ``settings.max_response_bytes`` bytes.

    ``on_answers`` is called as each request completes (the stage stores them, so a rerun asks only for the
    rest); every request runs to its end even when another fails, then the first failure is raised.

    Raises:
        ConfigError: the settings hold a credential (URL user info or query key, auth-like header, secret-like
            body field, a key as key prefix); nothing is sent.
        ApiComparatorError: the key variable is not set; a request was refused (4xx other than 408/429),
            redirected, answered malformed or beyond the size cap; a server returned no answer to a top-up.
        ApiRetriesSpentError: the retry budget of a request was spent on 408, 429, 5xx, missed deadlines or
            connection errors, or the server's Retry-After was beyond ``settings.retry_after_max``.
    """
    problems = api_credential_problems(settings.url, settings.headers, settings.extra_body, settings.key_prefix)
    if problems:
        raise ConfigError(problems)
    key = None
    if settings.key_env is not None:
        key = os.environ.get(settings.key_env)
        if not key:
            raise ApiComparatorError(
                f"the environment variable {settings.key_env} (comparator_api_key_env) is not set; export the API "
                "key in it",
                status=None,
                api_format=settings.api_format,
                item="every item",
                url=safe_url(settings.url),
            )
    fetcher = _Client(settings, sampling, key)

    async def one(client: httpx.AsyncClient, request: ApiRequest) -> list[ApiAnswer]:
        answers = await fetcher.fetch(client, request)
        if on_answers is not None:
            on_answers(request, answers)
        return answers

    async def run() -> list[Any]:
        limits = httpx.Limits(max_connections=settings.max_concurrency)
        async with httpx.AsyncClient(limits=limits, timeout=settings.timeout, follow_redirects=False) as client:
            return await asyncio.gather(*(one(client, r) for r in requests), return_exceptions=True)

    results = _run_coroutine(run)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results
