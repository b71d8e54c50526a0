"""The API client's errors (docs/design/algorithms.md#api-comparators) and the hints they give, in the options of
who asks (:class:`~pbrl.generation.api_formats.ApiRole`: the API comparator or the API judge).

Every failure is an :class:`ApiComparatorError` — an expected error (:data:`pbrl.errors.EXPECTED_ERRORS`), shown by
the CLI as one ``error:`` line — naming the format, the item, the HTTP status, the URL (without credentials) and
what to change (:func:`refusal_hint`, :func:`malformed_hint`). A spent retry budget is an
:class:`ApiRetriesSpentError`, which is *not* a :class:`~pbrl.errors.TransientError`, so Prefect's stage retries
(:mod:`flows.retry`) never resend API requests.
"""

from __future__ import annotations

from typing import Any

from pbrl.errors import RemoteServiceError
from pbrl.generation.api_formats import ApiSettings


class ApiComparatorError(RemoteServiceError):
    """An API request (of the API comparator or judge, named first) failed for good: refused (4xx), redirected,
    answered malformed or too large, or its retry budget was spent. An expected error
    (:class:`~pbrl.errors.RemoteServiceError`): the CLI prints its message as one ``error:`` line, and it is never
    retried by the stage. The message names the format, the URL (without credentials), the item, the HTTP status and
    what to change; never the key.

    Attributes:
        status: HTTP status code, or None (timeout, connection error, no response).
        api_format: the ``comparator_api_format`` (or ``judge_api_format``).
        item: the item id (and agent) the request was for.
        url: the endpoint, credentials hidden (None when no request was made).

    ``role`` (who asked, :attr:`ApiRole.name <pbrl.generation.api_formats.ApiRole>`) leads the message.
    """

    def __init__(
        self,
        message: str,
        *,
        status: int | None,
        api_format: str,
        item: str,
        url: str | None = None,
        role: str = "API comparator",
    ):
        self.status, self.api_format, self.item, self.url = status, api_format, item, url
        where = f" at {url}" if url else ""
        super().__init__(f"{role} ({api_format}){where}, {item}: {message}")

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


def refusal_hint(status: int, settings: ApiSettings) -> str:
    """What to change after a 4xx refusal (other than 408 and 429, which are retried), in the asker's options."""
    r = settings.role
    key = (
        f"the key in the environment variable {settings.key_env} ({r.option('key_env')})"
        if settings.key_env
        else f"that a key is sent: set {r.option('key_env')} to the NAME of the variable holding it"
    )
    if status == 401:
        return f"the server did not accept the key: check {key}, {r.option('key_header')} and {r.option('key_prefix')}"
    if status == 403:
        return f"the key may not use this endpoint or model: check {key} and {r.model_option}"
    if status == 404:
        return f"nothing at this address: check {r.option('url')} (the full endpoint path) and {r.model_option}"
    if status == 405:
        return f"this address does not take POST requests: check {r.option('url')} (the full endpoint path)"
    if status == 413:
        limits = " / ".join(o for o in (r.max_tokens_option, r.max_n_option) if o)
        return f"the request is too large: shorten the prompts or lower {limits}"
    return (
        f"the server refused the request: check {r.model_option}, {r.option('extra_body')} and {r.sampling_options} "
        f"against {r.option('format')} ('{settings.api_format}')"
    )


def malformed_hint(settings: ApiSettings) -> str:
    """What to change after an answer without the format's shape (or with no answer at all)."""
    r = settings.role
    field_hint = f" and {r.option('response_field')}" if settings.api_format == "generic" else ""
    return (
        f"the answer is not a '{settings.api_format}' response: check {r.option('format')}{field_hint} and "
        f"{r.option('url')}"
    )
