"""The API client's settings, one request and one answer, and its four formats
(docs/design/algorithms.md#api-comparators): request bodies, headers, the answers in a response and the tokens
it reports. The client that sends them is :mod:`pbrl.generation.api_transport`. It serves the API comparator and
the API judge (:mod:`pbrl.judging.api_judge`); its messages name the options of the one that asks (:class:`ApiRole`).

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

``comparator_api_extra_body`` is merged last into every body; None values are dropped.

Usage (:func:`usage_tokens`): the tokens a response reports it cost, ``usage.total_tokens`` (openai, openai_responses,
and generic when given) or ``usage.input_tokens + usage.output_tokens`` (anthropic); 0 when absent or not a
non-negative integer.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from pbrl.generation.sampling import SamplingSettings

FORMATS = ("generic", "openai", "anthropic", "openai_responses")
ANTHROPIC_VERSION = "2023-06-01"
RETRY_AFTER_MAX = 60.0  # seconds: the longest server Retry-After waited for; beyond it the request gives up
MAX_RESPONSE_BYTES = 8 * 2**20  # bytes of one answer read at most (after content decoding)


@dataclass(frozen=True)
class ApiRole:
    """Who asks through the API client, as its errors, hints and log lines name it: they name the options its user
    sets, so that the fix they give is one the user can make.

    Attributes:
        name: leads every error and log line ("API comparator", "API judge").
        prefix: of the option of each setting: ``{prefix}_url``, ``{prefix}_key_env``, ``{prefix}_timeout`` ...
        model_option: the option of the model name.
        max_tokens_option: the option of the most tokens of one answer.
        max_n_option: the option of the most answers per request; None when every request asks for one.
        sampling_options: what to check, besides the model and the extra body, when a request is refused.
    """

    name: str = "API comparator"
    prefix: str = "comparator_api"
    model_option: str = "comparator_api_model"
    max_tokens_option: str = "max_new_tokens"
    max_n_option: str | None = "comparator_api_max_n_per_request"
    sampling_options: str = "the sampling options"

    def option(self, setting: str) -> str:
        """The option of ``setting`` (``"url"`` -> ``comparator_api_url``)."""
        return f"{self.prefix}_{setting}"


COMPARATOR_ROLE = ApiRole()


@dataclass(frozen=True)
class ApiSettings:
    """The API client's plain settings (the API comparator's from the ``comparator_api_*`` fields).

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
        role: who asks (:class:`ApiRole`): the options its messages name; the API comparator by default.
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
    role: ApiRole = COMPARATOR_ROLE

    def __post_init__(self) -> None:
        if self.api_format not in FORMATS:
            raise ValueError(f"{self.role.option('format')}: got {self.api_format!r}; allowed: {', '.join(FORMATS)}")
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
    """One answer: its text, why it ended (``"api"``: the server finished it; ``"length"``: cut at the token limit,
    as the format reports it), the tokens its response reported (:func:`usage_tokens`, on the first answer of the
    response and 0 on the others, so that a sum over answers counts each response once) and the wall seconds of the
    request that brought it (send to last byte read, retries and the wait for a free connection not counted)."""

    text: str
    finish_reason: str
    tokens: int = 0
    seconds: float = 0.0


MAX_REPORTED_TOKENS = 10**12  # the most tokens one response may say it cost: more than any bill; fits an int64


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


def usage_tokens(api_format: str, data: Any) -> int:
    """The tokens a response JSON reports it cost: ``usage.input_tokens + usage.output_tokens`` for anthropic,
    ``usage.total_tokens`` for the other formats (generic: optional). A count that is absent, or not a non-negative
    integer, counts 0 (the answer itself is still read: a paid answer is not thrown away for its bill); a count over
    :data:`MAX_REPORTED_TOKENS` (10^12, more than any bill: a server's junk) counts that much, so that a
    round's token budget is spent and nothing overflows a table's integer column."""
    usage = data.get("usage") if isinstance(data, Mapping) else None
    if not isinstance(usage, Mapping):
        return 0
    names = ("input_tokens", "output_tokens") if api_format == "anthropic" else ("total_tokens",)
    counts = [usage.get(name) for name in names]
    if not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in counts):
        return 0
    return min(sum(counts), MAX_REPORTED_TOKENS)


def parse_answers(settings: ApiSettings, data: Any) -> list[ApiAnswer]:
    """The answers in one response JSON, the response's reported tokens (:func:`usage_tokens`) on the first.

    Raises:
        ValueError: the response does not have the format's shape (what is missing is named).
    """
    answers = _texts(settings, data)
    if answers:
        answers[0] = replace(answers[0], tokens=usage_tokens(settings.api_format, data))
    return answers


def _texts(settings: ApiSettings, data: Any) -> list[ApiAnswer]:
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
