"""The API client's transport (the API comparator's and the API judge's; docs/design/algorithms.md#api-comparators):
:class:`ApiClient` sends one request over httpx within a deadline and a size cap, retries it within one budget, and
asks again for missing answers (top-ups); :func:`pbrl.generation.api_client.fetch_answers` runs it for every request.
Its messages name the options of who asks (:class:`~pbrl.generation.api_formats.ApiRole`), the comparator's below.

**One request.** ``comparator_api_timeout`` (``ApiSettings.timeout``, seconds) is the *total* deadline of one
request: connect, send and every read of the answer, however slowly a server trickles it. At most
``max_response_bytes`` (:data:`~pbrl.generation.api_formats.MAX_RESPONSE_BYTES`, 8 MiB, after content decoding)
of an answer are read; the body is streamed and reading stops beyond the cap. Redirects are never followed (the
request carries the key, which must not go to another address): a 3xx is reported as a redirect, with its
``Location``. At most ``max_concurrency`` requests are in flight (one ``asyncio.Semaphore`` over an
``httpx.AsyncClient``).

**Retries: one budget.** The client owns the only retry budget of a request: ``max_attempts`` requests sent
(5 by default), on 408, 429, 5xx, a missed deadline and connection errors, with exponential backoff and full
jitter (tenacity) and at least the server's ``Retry-After`` (delta-seconds or an HTTP date). Every wait is
logged (logger ``pbrl.generation.api_transport``, WARNING) with its length, its reason and the attempt. A
``Retry-After`` beyond ``retry_after_max`` (:data:`~pbrl.generation.api_formats.RETRY_AFTER_MAX`, 60 s) is not
waited for: the request gives up at once, naming the server's value. When the budget is spent the client raises
:class:`~pbrl.generation.api_errors.ApiRetriesSpentError`, which is *not* a :class:`~pbrl.errors.TransientError`,
so Prefect's stage retries (:mod:`flows.retry`) never resend API requests and its message counts the requests
really sent. The answers already received are stored by the stage, so ``pbrl train --resume`` later asks only for
the rest. Any other 4xx, a redirect, a malformed or oversized answer is tried once.
"""

from __future__ import annotations

import asyncio
import datetime
import email.utils
import json
import logging
import math
import re
import time
from collections.abc import Mapping
from typing import Any

import httpx
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, stop_after_attempt, wait_random_exponential

from pbrl.config.credentials import safe_url
from pbrl.generation.api_errors import ApiComparatorError, ApiRetriesSpentError, malformed_hint, refusal_hint
from pbrl.generation.api_formats import (
    ApiAnswer,
    ApiRequest,
    ApiSettings,
    answers_per_request,
    build_body,
    build_headers,
    parse_answers,
)
from pbrl.generation.redaction import Redactor
from pbrl.generation.sampling import SamplingSettings

log = logging.getLogger(__name__)

ERROR_BODY_BYTES = 64 * 2**10  # bytes of a non-2xx body read at most: only its start is quoted
_BODY_SHOWN = 300  # characters of a server's body quoted in an error
_RETRIED_STATUSES = frozenset({408, 429})  # and every 5xx


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


class ApiClient:
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
            role=self.settings.role.name,
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
        tries["attempts"] += 1
        tries["sent"] += 1
        try:
            async with self.semaphore:
                started = time.monotonic()
                status, headers, raw = await self._exchange(client, body)
                seconds = time.monotonic() - started
        except (TimeoutError, httpx.HTTPError, httpx.InvalidURL, _TooLarge) as exc:
            raise self._transport_failure(exc, request, tries) from None
        return self._answers(status, headers, raw, request, n, seconds)

    def _transport_failure(self, exc: Exception, request: ApiRequest, tries: dict[str, int]) -> Exception:
        """What a POST that got no answer raises: _Retryable for a missed deadline or a connection error, else an
        ApiComparatorError naming the fix. A request that never left (it could not connect, or be built) is taken
        off ``tries["sent"]``."""
        s, r = self.settings, self.settings.role
        if isinstance(exc, TimeoutError | httpx.TimeoutException):
            if isinstance(exc, httpx.ConnectTimeout):
                tries["sent"] -= 1
            return _Retryable(
                f"no complete answer within the {s.timeout:g} s deadline of one request "
                f"({r.option('timeout')}: connect, send and every read together)",
                None,
            )
        if isinstance(exc, httpx.LocalProtocolError):
            tries["sent"] -= 1
            var = s.key_env or r.option("key_env")
            return self.error(
                ApiComparatorError,
                f"the request could not be sent ({type(exc).__name__}: {exc}): check that {var} holds only the key "
                f"(no spaces or line breaks), {r.option('key_header')} and {r.option('headers')}",
                None,
                request,
            )
        if isinstance(exc, httpx.TransportError):
            if isinstance(exc, httpx.ConnectError):
                tries["sent"] -= 1
            return _Retryable(f"connection error ({type(exc).__name__}: {exc})", None)
        if isinstance(exc, httpx.InvalidURL):  # settings built without the config's checks
            return self.error(ApiComparatorError, f"{r.option('url')} is not a valid URL ({exc})", None, request)
        if isinstance(exc, httpx.HTTPError):  # e.g. a body that does not decode (gzip): malformed, not worth retrying
            return self.error(
                ApiComparatorError, f"the answer could not be read ({type(exc).__name__}: {exc})", None, request
            )
        assert isinstance(exc, _TooLarge)
        size = f"{exc.declared} bytes declared" if exc.declared is not None else "more, reading stopped there"
        fewer = f"fewer answers per request ({r.max_n_option}) or " if r.max_n_option else ""
        return self.error(
            ApiComparatorError,
            f"HTTP {exc.status}, answer larger than the cap of {s.max_response_bytes} bytes per response "
            f"({size}; pbrl.generation.api_formats.MAX_RESPONSE_BYTES): ask for {fewer}fewer tokens "
            f"({r.max_tokens_option}), or check {r.option('url')}",
            exc.status,
            request,
        )

    def _answers(
        self, status: int, headers: httpx.Headers, raw: bytes, request: ApiRequest, n: int, seconds: float
    ) -> list[ApiAnswer]:
        """The answers of a 2xx response (at most ``n``, redacted, each with the request's ``seconds``). Raises
        _Retryable on 408, 429 and 5xx; ApiComparatorError on a malformed answer, a redirect or any other status."""
        s, r = self.settings, self.settings.role
        if 200 <= status < 300:
            try:
                answers = parse_answers(s, json.loads(raw))[:n]
            except (ValueError, KeyError, TypeError, AttributeError, IndexError, RecursionError) as exc:
                reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
                raise self.error(
                    ApiComparatorError,
                    f"HTTP {status}, malformed response ({reason}): {self.quoted(raw)}; {malformed_hint(s)}",
                    status,
                    request,
                ) from None
            return [ApiAnswer(self.redact(a.text), a.finish_reason, a.tokens, seconds) for a in answers]
        if 300 <= status < 400:
            location = headers.get("location")
            where = f"redirect to {safe_url(location)!r}" if location else "redirect (no Location given)"
            raise self.error(
                ApiComparatorError,
                f"HTTP {status} {where}: pbrl does not follow redirects (the request carries the key, which must "
                f"not go to another address); set {r.option('url')} to the address that answers",
                status,
                request,
            )
        if status in _RETRIED_STATUSES or status >= 500:
            raw_after = headers.get("retry-after")
            raise _Retryable(f"HTTP {status}: {self.quoted(raw)}", status, retry_after_seconds(headers), raw_after)
        raise self.error(
            ApiComparatorError,
            f"HTTP {status}, refused: {self.quoted(raw)}; {refusal_hint(status, s)}",
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
                f"than pbrl waits ({s.retry_after_max:g} s, pbrl.generation.api_formats.RETRY_AFTER_MAX), so gave up"
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
                    f"{s.role.name} ({s.api_format}) at {self.url}, {request.name}: attempt {k} of {s.max_attempts} "
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
                    + malformed_hint(self.settings),
                    None,
                    request,
                )
            answers += got[:missing]
        return answers
