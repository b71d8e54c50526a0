"""The cross-field rules of each trainer's options: every trainer's, the iterative trainers' (comparators,
API comparators, replay) and MARLHF's (RL backends, critics, reward model). The replay rules are in
:mod:`pbrl.config.replay_rules`; the API options' credential checks in :mod:`pbrl.config.credentials`."""

from __future__ import annotations

from functools import partial

from pbrl.config.credentials import (
    body_credential_problems,
    header_credential_problems,
    key_prefix_problems,
    safe_url,
    url_credential_problems,
)
from pbrl.config.judge_rules import JUDGE_ITER_RULES, JUDGE_RULES
from pbrl.config.replay_rules import REPLAY_RULES
from pbrl.config.rules import (
    ACTOR_CRITIC,
    CENTRALIZED,
    ENV_NAME_PATTERN,
    GROUP_BASELINE,
    HIDDEN,
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


SEGMENTS_ONLY = ("reward_head_components", "reward_prompt_overlap", "reward_length_products", "reward_joint_overlap")


def _segments_only(name: str, v: Values) -> list[Problem]:
    """``name`` set (not None, not False) needs ``reward_pooling='segments'``."""
    if v[name] is not None and v[name] is not False and v["reward_pooling"] != "segments":
        return [only_with(name, v[name], "reward_pooling='segments'")]
    return []


for _name in SEGMENTS_ONLY:  # one rule per option: an invalid one does not hide another's problem
    rule(MARLHF_RULES, _name, "reward_pooling")(partial(_segments_only, _name))


@rule(MARLHF_RULES, "reward_model_device")
def _reward_model_device(v: Values) -> list[Problem]:
    device = v["reward_model_device"]
    return [] if device is None else device_problems("reward_model_device", device, None)


TRAINER_RULES: dict[str, tuple[Rule, ...]] = {
    "madpo": tuple(COMMON_RULES + JUDGE_RULES),
    "marlhf": tuple(COMMON_RULES + JUDGE_RULES + MARLHF_RULES),
    "madpo_iter": tuple(COMMON_RULES + JUDGE_RULES + ITERATIVE_RULES + REPLAY_RULES),
    "marlhf_iter": tuple(COMMON_RULES + JUDGE_RULES + ITERATIVE_RULES + REPLAY_RULES + MARLHF_RULES + JUDGE_ITER_RULES),
}
