"""The cross-field rules of each trainer's options: every trainer's, the iterative trainers' (comparators,
API comparators, replay) and MARLHF's (RL backends, critics, reward model)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import parse_qsl, quote, urlsplit, urlunsplit

from pbrl.config.rules import (
    ACTOR_CRITIC,
    CENTRALIZED,
    ENV_NAME_PATTERN,
    GROUP_BASELINE,
    HIDDEN,
    KEY_HEADERS,
    SECRET_MESSAGE,
    SEPARATE_COMPARATORS,
    Rule,
    Values,
    actors,
    device_problems,
    import_path_problems,
    only_with,
    rule,
    same_model_problems,
)
from pbrl.errors import Problem

# --------------------------------------------------------------------------- rules of every trainer
COMMON_RULES: list[Rule] = []


@rule(COMMON_RULES, "num_turns")
def _num_turns(v: Values) -> list[Problem]:
    if v["num_turns"] == 1:
        return []
    return [Problem("num_turns", v["num_turns"], "must be 1 (pbrl, like the reference, trains single-turn only)")]


@rule(COMMON_RULES, "pair_selection", "preference_pairs_per_sample")
def _pairs_per_sample(v: Values) -> list[Problem]:
    if v["pair_selection"] == "all" and v["preference_pairs_per_sample"] is not None:
        return [
            Problem(
                "preference_pairs_per_sample",
                v["preference_pairs_per_sample"],
                "must be None when pair_selection='all' (every pair is kept)",
            )
        ]
    return []


CROSS = "cross"  # joint_mode: every combination of the agents' candidates (pbrl.preference.pairs.CrossGrid)
MAX_COMBINATIONS = 2**31  # a combination's number is stored as an int32 candidate_index (scores.parquet)


@rule(COMMON_RULES, "joint_mode", "collaboration_mode", "pair_selection")
def _joint_mode(v: Values) -> list[Problem]:
    if v["joint_mode"] != CROSS:
        if v["pair_selection"] == "counterfactual":
            return [
                Problem(
                    "pair_selection",
                    "counterfactual",
                    "needs joint_mode='cross' (aligned joint responses differ in every agent's candidate)",
                )
            ]
        return []
    if v["collaboration_mode"] == CENTRALIZED:
        return [
            Problem(
                "joint_mode",
                CROSS,
                "needs collaboration_mode='decentralized' (with 'centralized' one actor writes every role of a "
                "joint response, so there are no agents' candidates to combine)",
            )
        ]
    return []


@rule(COMMON_RULES, "joint_mode", "num_agents", "preference_num_candidates")
def _cross_size(v: Values) -> list[Problem]:
    if v["joint_mode"] != CROSS:
        return []
    # Per agent: the target candidates, plus the comparator ones in iterative trainers (None = as many).
    per_agent = v["preference_num_candidates"]
    if "comparator_num_candidates" in v:
        per_agent += v["comparator_num_candidates"] or v["preference_num_candidates"]
    if per_agent ** v["num_agents"] < MAX_COMBINATIONS:
        return []
    return [
        Problem(
            "joint_mode",
            CROSS,
            f"{per_agent} candidates per agent and {v['num_agents']} agents give {per_agent ** v['num_agents']} "
            f"combinations per item, more than cross joint responses can number (< 2**31); sample fewer candidates",
        )
    ]


@rule(COMMON_RULES, "reward_func", "reward_processor")
def _reward_paths(v: Values) -> list[Problem]:
    return import_path_problems("reward_func", v["reward_func"]) + import_path_problems(
        "reward_processor", v["reward_processor"]
    )


@rule(COMMON_RULES, "reference_devices", "num_agents", "reference_kl_enabled", "collaboration_mode")
def _reference_devices(v: Values) -> list[Problem]:
    # As in the reference (validate_reference_kl_config): the devices matter only when the KL is on; one per
    # actor (1 when centralized).
    if not v["reference_kl_enabled"]:
        return []
    return device_problems("reference_devices", v["reference_devices"], actors(v))


# --------------------------------------------------------------------------- iterative trainers
ITERATIVE_RULES: list[Rule] = []


@rule(ITERATIVE_RULES, "comparator_policy", "comparator_history_k")
def _history_k(v: Values) -> list[Problem]:
    if v["comparator_policy"] != "history" and v["comparator_history_k"] is not None:
        return [only_with("comparator_history_k", v["comparator_history_k"], "comparator_policy='history'")]
    return []


@rule(ITERATIVE_RULES, "comparator_policy", "comparator_model_name", "comparator_agents")
def _comparator_models(v: Values) -> list[Problem]:
    name, agents = v["comparator_model_name"], v["comparator_agents"]
    if v["comparator_policy"] != "model":
        return [
            only_with(f, v[f], "comparator_policy='model'")
            for f in ("comparator_model_name", "comparator_agents")
            if v[f] is not None
        ]
    if name is None and agents is None:
        return [
            Problem(
                "comparator_model_name",
                None,
                "comparator_policy='model' needs comparator_model_name "
                "(one model for all agents) or comparator_agents (one per agent)",
            )
        ]
    return same_model_problems("comparator_agents", agents, "comparator_model_name", name)


@rule(ITERATIVE_RULES, "comparator_policy", "comparator_agents", "num_agents", "collaboration_mode")
def _comparator_agent_count(v: Values) -> list[Problem]:
    agents = v["comparator_agents"]
    if v["comparator_policy"] != "model" or agents is None or len(agents) == actors(v):
        return []
    if v["collaboration_mode"] == CENTRALIZED:
        return [
            Problem(
                "comparator_agents",
                agents,
                "must name exactly one model with collaboration_mode="
                "'centralized' (one actor writes every role); or give comparator_model_name",
            )
        ]
    return [Problem("comparator_agents", agents, f"must name one model per agent (num_agents={v['num_agents']})")]


@rule(
    ITERATIVE_RULES,
    "comparator_centralized_agent_index",
    "num_agents",
    "comparator_generation_mode",
    "collaboration_mode",
)
def _centralized_index(v: Values) -> list[Problem]:
    # As in the reference: the index is read (and checked) only in centralized comparator generation.
    index, n = v["comparator_centralized_agent_index"], v["num_agents"]
    if v["collaboration_mode"] == CENTRALIZED:
        if index == 0:
            return []
        return [
            Problem(
                "comparator_centralized_agent_index",
                index,
                "must be 0 with collaboration_mode='centralized': one actor (index 0) writes every role",
            )
        ]
    if v["comparator_generation_mode"] != "centralized" or 0 <= index < n:
        return []
    return [Problem("comparator_centralized_agent_index", index, f"must be in [0, num_agents) = [0, {n})")]


@rule(ITERATIVE_RULES, "collaboration_mode", "comparator_generation_mode")
def _centralized_generation(v: Values) -> list[Problem]:
    # The configuration sets it (pbrl.config.notices.derive_values, as the reference's __post_init__); this
    # holds for a mapping validated without that step.
    if v["collaboration_mode"] != CENTRALIZED or v["comparator_generation_mode"] == "centralized":
        return []
    return [
        Problem(
            "comparator_generation_mode",
            v["comparator_generation_mode"],
            "must be 'centralized' with "
            "collaboration_mode='centralized' (the comparator is one actor writing every role too)",
        )
    ]


@rule(ITERATIVE_RULES, "comparator_policy", "comparator_api_url", "comparator_api_model", "comparator_api_key_env")
def _api_fields(v: Values) -> list[Problem]:
    fields = ("comparator_api_url", "comparator_api_model", "comparator_api_key_env")
    shown = {"comparator_api_key_env": HIDDEN, "comparator_api_url": safe_url(v["comparator_api_url"] or "")}
    if v["comparator_policy"] != "api":
        return [only_with(f, shown.get(f, v[f]), "comparator_policy='api'") for f in fields if v[f] is not None]
    if v["comparator_api_url"] is None:
        return [Problem("comparator_api_url", None, "required with comparator_policy='api'")]
    return []


@rule(ITERATIVE_RULES, "comparator_api_url")
def _api_url(v: Values) -> list[Problem]:
    url = v["comparator_api_url"]
    if url is None:
        return []
    scheme = (
        []
        if url.startswith(("http://", "https://"))
        else [Problem("comparator_api_url", safe_url(url), "must be an http:// or https:// URL")]
    )
    return scheme + url_credential_problems(url)


@rule(ITERATIVE_RULES, "comparator_api_key_env")
def _api_key_env(v: Values) -> list[Problem]:
    name = v["comparator_api_key_env"]
    if name is None or ENV_NAME_PATTERN.match(name):
        return []
    # The value may be a pasted key: never echo it.
    return [
        Problem(
            "comparator_api_key_env",
            HIDDEN,
            "must be the NAME of an environment variable "
            "(letters, digits and '_', e.g. OPENAI_API_KEY), not the key itself",
        )
    ]


@rule(ITERATIVE_RULES, "comparator_devices", "num_agents", "comparator_policy", "collaboration_mode")
def _comparator_devices(v: Values) -> list[Problem]:
    # Read only where a separate comparator policy is loaded ('current' samples the live agents).
    if v["comparator_policy"] not in SEPARATE_COMPARATORS:
        return []
    return device_problems("comparator_devices", v["comparator_devices"], actors(v))


@rule(ITERATIVE_RULES, "comparator_api_headers")
def _api_headers(v: Values) -> list[Problem]:
    return header_credential_problems(v["comparator_api_headers"] or {})


@rule(ITERATIVE_RULES, "comparator_api_extra_body")
def _api_extra_body(v: Values) -> list[Problem]:
    return body_credential_problems(v["comparator_api_extra_body"] or {})


@rule(ITERATIVE_RULES, "comparator_api_key_prefix")
def _api_key_prefix(v: Values) -> list[Problem]:
    return key_prefix_problems(v["comparator_api_key_prefix"])


# --------------------------------------------------------------------------- credentials in the API options
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


def url_credential_problems(url: str, field: str = "comparator_api_url") -> list[Problem]:
    """Credentials in an endpoint URL: a user name or password before the host (httpx would send them as Basic
    authentication, in place of the key from comparator_api_key_env) or a query/fragment parameter that carries
    one (``?key=``, ``api_key=``, ``token=``, ``access_token=``, ``auth=``, ``signature=``, ``sig=``, ``code=``)."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 (read for its check: a port that is not a number raises)
    except ValueError:
        userinfo = "; a user name or password before the host is refused too: " + SECRET_MESSAGE if "@" in url else ""
        return [Problem(field, safe_url(url), "is not a valid URL (its host or port cannot be read)" + userinfo)]
    problems = []
    if "@" in parts.netloc:
        problems.append(
            Problem(
                field,
                safe_url(url),
                "holds a user name or password before the host ('user:password@host'), which would be sent in "
                "place of the API key; " + SECRET_MESSAGE,
            )
        )
    names = _query_credentials(parts.query) + _query_credentials(parts.fragment)
    if names:
        problems.append(
            Problem(
                field,
                safe_url(url),
                f"query parameter(s) {', '.join(dict.fromkeys(names))} would put a credential in the configuration; "
                "send the key in a header instead (comparator_api_key_header, e.g. x-goog-api-key, with "
                "comparator_api_key_prefix ''); " + SECRET_MESSAGE,
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
        Problem(field, HIDDEN, f"header(s) {', '.join(keyed)} would put {what} in the configuration; " + SECRET_MESSAGE)
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
            "configuration; " + SECRET_MESSAGE,
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
            "goes before the key, never the key itself; " + SECRET_MESSAGE,
        )
    ]


def api_shown_value(field: str, value: Any) -> Any:
    """``value`` as a problem of ``field`` may show it (for type errors, :mod:`pbrl.config.messages`): the URL
    with its credentials hidden; ``<hidden>`` for a key variable that is not a variable name, headers or body
    options that name a credential or are not a mapping of names, and a key prefix that is not a scheme word;
    any other value as given."""
    if field == "comparator_api_url" and isinstance(value, str):
        return safe_url(value)
    if field == "comparator_api_key_env":
        return value if value is None or (isinstance(value, str) and ENV_NAME_PATTERN.match(value)) else HIDDEN
    if field in ("comparator_api_headers", "comparator_api_extra_body") and value is not None:
        if not isinstance(value, Mapping):
            return HIDDEN
        named = {str(k): v for k, v in value.items()}
        found = header_credential_problems(named) if field == "comparator_api_headers" else []
        return HIDDEN if found or body_credential_problems(named) else value
    if field == "comparator_api_key_prefix" and not (isinstance(value, str) and KEY_PREFIX_PATTERN.match(value)):
        return HIDDEN
    return value


def api_credential_problems(
    url: str, headers: Mapping[str, Any], extra_body: Mapping[str, Any], key_prefix: str
) -> list[Problem]:
    """Every credential in the API comparator's options at once (URL, headers, body options, key prefix)."""
    return [
        *url_credential_problems(url),
        *header_credential_problems(headers),
        *body_credential_problems(extra_body),
        *key_prefix_problems(key_prefix),
    ]


# The replay options' rules, one function each: the config rules below and the replay buffer itself
# (pbrl.preference.replay.select_replay, for callers that pass raw values) both use them.
REPLAY_MODES: tuple[str, ...] = ("current", "nearest_k", "all_history", "lambda_decay")


def _int_at_least_one(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def replay_k_problems(mode: str, k: Any) -> list[Problem]:
    """``preference_replay_k``: required (>= 1) with ``nearest_k``; None or 1 with ``current``; None otherwise."""
    if mode == "nearest_k" and not _int_at_least_one(k):
        return [Problem("preference_replay_k", k, "required (>= 1) with preference_replay_mode='nearest_k'")]
    if mode == "current" and not (k is None or (_int_at_least_one(k) and k == 1)):
        return [Problem("preference_replay_k", k, "must be None or 1 with preference_replay_mode='current'")]
    if mode in ("all_history", "lambda_decay") and k is not None:
        return [Problem("preference_replay_k", k, f"must be None with preference_replay_mode='{mode}'")]
    return []


def replay_lambda_problems(mode: str, lam: Any) -> list[Problem]:
    """``preference_replay_lambda``: required in [0, 1] with ``lambda_decay``, None otherwise."""
    number = isinstance(lam, int | float) and not isinstance(lam, bool)
    if mode == "lambda_decay" and not (number and 0.0 <= lam <= 1.0):
        return [
            Problem("preference_replay_lambda", lam, "required, in [0, 1], with preference_replay_mode='lambda_decay'")
        ]
    if mode != "lambda_decay" and lam is not None:
        return [only_with("preference_replay_lambda", lam, "preference_replay_mode='lambda_decay'")]
    return []


def replay_sample_size_problems(mode: str, sample_size: Any) -> list[Problem]:
    """``preference_replay_sample_size``: None with ``current`` (no sampling), else None or an int >= 1."""
    if mode == "current" and sample_size is not None:
        return [
            Problem(
                "preference_replay_sample_size",
                sample_size,
                "must be None with preference_replay_mode='current' (the round's pairs are used as they are)",
            )
        ]
    if sample_size is not None and not _int_at_least_one(sample_size):
        return [Problem("preference_replay_sample_size", sample_size, "must be an integer >= 1 or None")]
    return []


def replay_problems(mode: str, k: Any, lam: Any, sample_size: Any) -> list[Problem]:
    """Every problem of the four replay options at once (an unknown mode is reported alone)."""
    if mode not in REPLAY_MODES:
        return [Problem("preference_replay_mode", mode, f"allowed: {', '.join(REPLAY_MODES)}")]
    return [
        *replay_k_problems(mode, k),
        *replay_lambda_problems(mode, lam),
        *replay_sample_size_problems(mode, sample_size),
    ]


@rule(ITERATIVE_RULES, "preference_replay_mode", "preference_replay_k")
def _replay_k(v: Values) -> list[Problem]:
    return replay_k_problems(v["preference_replay_mode"], v["preference_replay_k"])


@rule(ITERATIVE_RULES, "preference_replay_mode", "preference_replay_lambda")
def _replay_lambda(v: Values) -> list[Problem]:
    return replay_lambda_problems(v["preference_replay_mode"], v["preference_replay_lambda"])


@rule(ITERATIVE_RULES, "preference_replay_mode", "preference_replay_sample_size")
def _replay_sample_size(v: Values) -> list[Problem]:
    return replay_sample_size_problems(v["preference_replay_mode"], v["preference_replay_sample_size"])


# --------------------------------------------------------------------------- MARLHF trainers
MARLHF_RULES: list[Rule] = []


@rule(MARLHF_RULES, "rl_algorithm", "num_generations")
def _num_generations(v: Values) -> list[Problem]:
    algorithm, n = v["rl_algorithm"], v["num_generations"]
    if algorithm in GROUP_BASELINE and n < 2:
        return [
            Problem(
                "num_generations",
                n,
                f"must be >= 2 with rl_algorithm='{algorithm}' (its baseline compares the samples of a group)",
            )
        ]
    return []


@rule(MARLHF_RULES, "rl_algorithm", "critic_model_name", "critic_learning_rate")
def _critic_fields(v: Values) -> list[Problem]:
    if v["rl_algorithm"] in ACTOR_CRITIC:
        return []
    return [
        only_with(f, v[f], "rl_algorithm='maac' or 'iac'")
        for f in ("critic_model_name", "critic_learning_rate")
        if v[f] is not None
    ]


@rule(MARLHF_RULES, "rl_algorithm", "critic_devices", "num_agents")
def _critic_devices(v: Values) -> list[Problem]:
    if v["rl_algorithm"] not in ACTOR_CRITIC:
        return []
    return device_problems("critic_devices", v["critic_devices"], v["num_agents"])


@rule(
    MARLHF_RULES,
    "rl_algorithm",
    "use_separate_critic",
    "critic_model_name",
    "critic_devices",
    "critic_value_head_hidden_dim",
    "value_head_hidden_dim",
)
def _critic_layout(v: Values) -> list[Problem]:
    # pbrl.learning.critics: maac's centralized critic reads every agent and is always a separate model; a value head on
    # the policy (iac, use_separate_critic: false) has no critic model, device or separate-critic head.
    problems = []
    head_only = v["rl_algorithm"] == "iac" and not v["use_separate_critic"]
    if v["rl_algorithm"] == "maac" and not v["use_separate_critic"]:
        problems.append(
            Problem(
                "use_separate_critic",
                False,
                "maac's centralized critic reads every agent and is "
                "always a separate model; set it to true, or use rl_algorithm: iac for value heads",
            )
        )
    if head_only:
        problems += [
            Problem(
                f,
                v[f],
                "use_separate_critic: false puts a value head on each agent's policy, so "
                "there is no separate critic for this setting; leave it null",
            )
            for f in ("critic_model_name", "critic_devices", "critic_value_head_hidden_dim")
            if v[f] is not None
        ]
    elif v["rl_algorithm"] in ACTOR_CRITIC and v["value_head_hidden_dim"] is not None:
        problems.append(
            Problem(
                "value_head_hidden_dim",
                v["value_head_hidden_dim"],
                "sizes the value head on the "
                "policy (rl_algorithm: iac with use_separate_critic: false); use "
                "critic_value_head_hidden_dim for a separate critic",
            )
        )
    return problems


@rule(MARLHF_RULES, "collaboration_mode")
def _marlhf_collaboration(v: Values) -> list[Problem]:
    if v["collaboration_mode"] != CENTRALIZED:
        return []
    return [
        Problem(
            "collaboration_mode",
            v["collaboration_mode"],
            "not available with trainer 'marlhf' or "
            "'marlhf_iter' in this version (the joint reward model and RL backends train one policy per "
            "agent); use trainer 'madpo' or 'madpo_iter', or collaboration_mode 'decentralized'",
        )
    ]


@rule(MARLHF_RULES, "reward_model_device")
def _reward_model_device(v: Values) -> list[Problem]:
    device = v["reward_model_device"]
    return [] if device is None else device_problems("reward_model_device", device, None)


TRAINER_RULES: dict[str, tuple[Rule, ...]] = {
    "madpo": tuple(COMMON_RULES),
    "marlhf": tuple(COMMON_RULES + MARLHF_RULES),
    "madpo_iter": tuple(COMMON_RULES + ITERATIVE_RULES),
    "marlhf_iter": tuple(COMMON_RULES + ITERATIVE_RULES + MARLHF_RULES),
}
