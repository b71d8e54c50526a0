"""API comparators (and the API judge, :mod:`pbrl.judging.api_judge`) over httpx
(docs/design/algorithms.md#api-comparators): :func:`fetch_answers` asks a remote model for every request's answers,
with a bound on the requests in flight. The formats (request bodies, headers, response parsing, reported usage) are
in :mod:`pbrl.generation.api_formats`; one request, its deadline, size cap and retries in
:mod:`pbrl.generation.api_transport`; the errors in :mod:`pbrl.generation.api_errors`; the redaction of the key in
:mod:`pbrl.generation.redaction`. Messages name the options of who asks (``ApiSettings.role``).

A server that returns fewer answers than asked is asked again for the rest (a top-up); more are cut to the number
asked. The answers already received are stored by the stage, so ``pbrl train --resume`` later asks only for the
rest.

**Errors.** Every failure is an :class:`~pbrl.generation.api_errors.ApiComparatorError` — an expected error
(:data:`pbrl.errors.EXPECTED_ERRORS`), shown by the CLI as one ``error:`` line — naming the format, the item,
the HTTP status, the URL (without credentials) and what to change.

**The key** is read from the environment variable named ``key_env`` at call time, only into the request header;
it is never stored or logged. Credentials in the settings themselves (URL user info or query keys, auth-like
headers, secret-like body fields) are refused before anything is sent (:mod:`pbrl.config.credentials`). Every
text that leaves the client — exception messages, log lines, quoted server bodies, ``Location`` headers and the
answers themselves — goes through :class:`~pbrl.generation.redaction.Redactor`, which replaces any piece of at
least :data:`~pbrl.generation.redaction.REDACT_MIN_CHARS` characters of the key (the whole key when shorter), as
sent or percent-, JSON- or base64-encoded, whatever its position or cut.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from pbrl.config.credentials import api_credential_problems, safe_url
from pbrl.errors import ConfigError
from pbrl.generation.api_errors import ApiComparatorError
from pbrl.generation.api_formats import ApiAnswer, ApiRequest, ApiSettings
from pbrl.generation.api_transport import ApiClient
from pbrl.generation.sampling import SamplingSettings


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
    problems = api_credential_problems(
        settings.url, settings.headers, settings.extra_body, settings.key_prefix, settings.role.prefix
    )
    if problems:
        raise ConfigError(problems)
    key = None
    if settings.key_env is not None:
        key = os.environ.get(settings.key_env)
        if not key:
            raise ApiComparatorError(
                f"the environment variable {settings.key_env} ({settings.role.option('key_env')}) is not set; export "
                "the API key in it",
                status=None,
                api_format=settings.api_format,
                item="every item",
                url=safe_url(settings.url),
                role=settings.role.name,
            )
    fetcher = ApiClient(settings, sampling, key)

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
