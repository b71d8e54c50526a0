"""Credentials in the API comparator's options: the checks that refuse them (URL user info or query keys,
auth-like headers, secret-like body fields, a key as key prefix) and the forms of those options fit to show
(:func:`safe_url`, :func:`api_shown_value`). The iterative trainers' rules (:mod:`pbrl.config.trainer_rules`),
type errors (:mod:`pbrl.config.messages`) and the API client (:mod:`pbrl.generation.api_client`) use them."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import parse_qsl, quote, urlsplit, urlunsplit

from pbrl.config.rules import ENV_NAME_PATTERN, HIDDEN, KEY_HEADERS, secret_message
from pbrl.errors import Problem

# pbrl never takes a credential in the configuration (it would reach run.json, logs, Prefect parameters and
# prefect.db); the API key comes only from the variable named by comparator_api_key_env. These checks run for every
# comparator_policy, on every comparator_api_* option that could hold one, and never echo the secret value.
# pbrl.generation.api_client runs them again before it sends anything (settings built without a config).

# A header or URL query parameter whose lower-cased name contains one of these carries a credential: Authorization,
# Proxy-Authorization, X-Api-Key, Api-Key, X-Goog-Api-Key, Cookie, X-Auth-Token, ?key=, ?api_key=, ?access_token=,
# ?auth=, ?signature=, X-Amz-Credential ...
CREDENTIAL_NAME_PARTS = ("key", "token", "secret", "auth", "cookie", "passw", "credential", "signature")
# Query parameters that carry one under a short name (Azure SAS ``sig``, Azure Functions ``code``).
CREDENTIAL_QUERY_NAMES = frozenset({"sig", "code", "pwd", "pass"})
# Body fields (comparator_api_extra_body, at any depth) are matched by words, not substrings, so that ordinary
# options pass (max_tokens, budget_tokens, prompt_cache_key, stop_token_ids): a field is refused when its whole
# name is one of _BODY_SECRET_NAMES, when one of its words is in _BODY_SECRET_WORDS, or when it ends in "key" or
# "token" after one of _BODY_SECRET_QUALIFIERS (api_key, access_token, client_secret, x-api-key, apiKey ...).
_BODY_SECRET_NAMES = frozenset({"key", "token", "auth", "signature", "sig", "apikey", "bearer", "pwd"})
_BODY_SECRET_WORDS = frozenset(
    {"secret", "secrets", "password", "passwd", "passphrase", "credential", "credentials", "cookie", "authorization"}
)
_BODY_SECRET_QUALIFIERS = frozenset(
    {
        "api",
        "access",
        "secret",
        "private",
        "auth",
        "bearer",
        "session",
        "refresh",
        "id",
        "oauth",
        "client",
        "subscription",
        "account",
        "signing",
        "security",
        "service",
        "user",
        "personal",
        "x",
    }
)
KEY_PREFIX_PATTERN = re.compile(r"^([A-Za-z][A-Za-z-]{0,23})?$")  # 'Bearer', 'Token', 'Basic', 'Api-Key', ''


def _credential_name(name: str) -> bool:
    low = name.strip().lower()
    return any(part in low for part in CREDENTIAL_NAME_PARTS)


def _query_credentials(part: str) -> list[str]:
    return [
        name
        for name, _ in parse_qsl(part, keep_blank_values=True)
        if _credential_name(name) or name.strip().lower() in CREDENTIAL_QUERY_NAMES
    ]


def safe_url(url: str) -> str:
    """``url`` fit to show: any user name or password before the host, and the value of every query (or
    fragment) parameter that carries a credential, replaced by ``<hidden>``; the URL itself when it has none."""
    try:
        parts = urlsplit(url)
    except ValueError:  # e.g. an unclosed IPv6 bracket: nothing can be said about its parts
        return HIDDEN if "@" in url or "?" in url else url
    netloc = parts.netloc
    if "@" in netloc:
        netloc = f"{HIDDEN}@{netloc.rpartition('@')[2]}"

    def clean(part: str) -> str:
        if not _query_credentials(part):
            return part
        pairs = parse_qsl(part, keep_blank_values=True)
        return "&".join(
            f"{quote(n)}={HIDDEN if (_credential_name(n) or n.strip().lower() in CREDENTIAL_QUERY_NAMES) else quote(v)}"
            for n, v in pairs
        )

    cleaned = urlunsplit((parts.scheme, netloc, parts.path, clean(parts.query), clean(parts.fragment)))
    return url if cleaned == urlunsplit(parts) and netloc == parts.netloc else cleaned


API_PREFIXES = ("comparator_api", "judge_api")  # the option families of an API client: the comparator's, the judge's


def _prefix(field: str) -> str:
    """The option family of ``field`` (``judge_api_url`` -> ``judge_api``); the comparator's for any other."""
    return next((p for p in API_PREFIXES if field.startswith(p + "_")), "comparator_api")


def _secret(field: str) -> str:
    return secret_message(f"{_prefix(field)}_key_env")


def url_credential_problems(url: str, field: str = "comparator_api_url") -> list[Problem]:
    """Credentials in an endpoint URL: a user name or password before the host (httpx would send them as Basic
    authentication, in place of the key from comparator_api_key_env) or a query/fragment parameter that carries
    one (``?key=``, ``api_key=``, ``token=``, ``access_token=``, ``auth=``, ``signature=``, ``sig=``, ``code=``)."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 (read for its check: a port that is not a number raises)
    except ValueError:
        userinfo = "; a user name or password before the host is refused too: " + _secret(field) if "@" in url else ""
        return [Problem(field, safe_url(url), "is not a valid URL (its host or port cannot be read)" + userinfo)]
    problems = []
    if "@" in parts.netloc:
        problems.append(
            Problem(
                field,
                safe_url(url),
                "holds a user name or password before the host ('user:password@host'), which would be sent in "
                "place of the API key; " + _secret(field),
            )
        )
    names = _query_credentials(parts.query) + _query_credentials(parts.fragment)
    if names:
        problems.append(
            Problem(
                field,
                safe_url(url),
                f"query parameter(s) {', '.join(dict.fromkeys(names))} would put a credential in the configuration; "
                f"send the key in a header instead ({_prefix(field)}_key_header, e.g. x-goog-api-key, with "
                f"{_prefix(field)}_key_prefix ''); " + _secret(field),
            )
        )
    return problems


def header_credential_problems(headers: Mapping[str, Any], field: str = "comparator_api_headers") -> list[Problem]:
    """Headers that carry a credential (see :data:`CREDENTIAL_NAME_PARTS`), by name; the values never shown."""
    keyed = sorted(h for h in headers if h.strip().lower() in KEY_HEADERS or _credential_name(h))
    if not keyed:
        return []
    what = "an API key" if all(h.strip().lower() in KEY_HEADERS for h in keyed) else "a credential"
    # The value would be the key: never echo it.
    return [
        Problem(field, HIDDEN, f"header(s) {', '.join(keyed)} would put {what} in the configuration; " + _secret(field))
    ]


def _body_secret_name(name: str) -> bool:
    words = [w for w in re.split(r"[^a-z0-9]+", re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name).lower()) if w]
    if not words:
        return False
    if "".join(words) in _BODY_SECRET_NAMES or any(w in _BODY_SECRET_WORDS for w in words):
        return True
    last = words[-1]
    if last in ("apikey", "accesskey", "secretkey", "privatekey"):
        return True
    return len(words) >= 2 and last in ("key", "token") and words[-2] in _BODY_SECRET_QUALIFIERS


def _body_secret_paths(value: Any, path: str) -> list[str]:
    if isinstance(value, Mapping):
        found = []
        for name, inner in value.items():
            where = f"{path}.{name}" if path else str(name)
            found += [where] if _body_secret_name(str(name)) else _body_secret_paths(inner, where)
        return found
    if isinstance(value, list | tuple):
        return [p for i, inner in enumerate(value) for p in _body_secret_paths(inner, f"{path}[{i}]")]
    return []


def body_credential_problems(body: Mapping[str, Any], field: str = "comparator_api_extra_body") -> list[Problem]:
    """Fields of the request body options, at any depth, named like a credential (``api_key``, ``key``,
    ``token``, ``access_token``, ``secret``, ``password``, ``client_secret`` ...); the values never shown."""
    paths = _body_secret_paths(body, "")
    if not paths:
        return []
    return [
        Problem(
            field,
            HIDDEN,
            f"field(s) {', '.join(paths)} would put a credential (key, token, secret or password) in the "
            "configuration; " + _secret(field),
        )
    ]


def key_prefix_problems(prefix: str, field: str = "comparator_api_key_prefix") -> list[Problem]:
    """The text before the key in its header is a scheme word ('Bearer', 'Token', 'Basic', ''), never a key."""
    if KEY_PREFIX_PATTERN.match(prefix):
        return []
    return [
        Problem(
            field,
            HIDDEN,
            "must be a scheme word such as 'Bearer', 'Token' or '' (letters and '-', at most 24 characters) that "
            "goes before the key, never the key itself; " + _secret(field),
        )
    ]


def api_shown_value(field: str, value: Any) -> Any:
    """``value`` as a problem of ``field`` may show it (for type errors, :mod:`pbrl.config.messages`), for the options
    of either API client (``comparator_api_*``, ``judge_api_*``): the URL with its credentials hidden; ``<hidden>``
    for a key variable that is not a variable name, headers or body options that name a credential or are not a
    mapping of names, and a key prefix that is not a scheme word; any other value as given."""
    prefix = _prefix(field)
    if not field.startswith(prefix + "_"):
        return value
    option = field.removeprefix(prefix + "_")
    if option == "url" and isinstance(value, str):
        return safe_url(value)
    if option == "key_env":
        return value if value is None or (isinstance(value, str) and ENV_NAME_PATTERN.match(value)) else HIDDEN
    if option in ("headers", "extra_body") and value is not None:
        if not isinstance(value, Mapping):
            return HIDDEN
        named = {str(k): v for k, v in value.items()}
        found = header_credential_problems(named, field) if option == "headers" else []
        return HIDDEN if found or body_credential_problems(named, field) else value
    if option == "key_prefix" and not (isinstance(value, str) and KEY_PREFIX_PATTERN.match(value)):
        return HIDDEN
    return value


def api_credential_problems(
    url: str,
    headers: Mapping[str, Any],
    extra_body: Mapping[str, Any],
    key_prefix: str,
    prefix: str = "comparator_api",
) -> list[Problem]:
    """Every credential in an API client's options at once (URL, headers, body options, key prefix), each named as
    the option ``{prefix}_url``, ``{prefix}_headers`` ... (the API comparator's by default, ``judge_api`` for the
    API judge)."""
    return [
        *url_credential_problems(url, f"{prefix}_url"),
        *header_credential_problems(headers, f"{prefix}_headers"),
        *body_credential_problems(extra_body, f"{prefix}_extra_body"),
        *key_prefix_problems(key_prefix, f"{prefix}_key_prefix"),
    ]
