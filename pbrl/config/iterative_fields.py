"""The fields of the iterative trainers (``madpo_iter``, ``marlhf_iter``; docs/reference/options.md#options-reference):
the rounds, the comparator side (a model, a checkpoint of the run or a remote API), preference replay, reward
histograms and per-round policy exports. Types, defaults, single-field ranges and descriptions; nothing here has
behaviour.

Option names and defaults are the reference library's (CoMLRL ``comlrl.trainers.preference``) except the ★
changes of docs/reference/options.md#options-reference. The trainer field classes that combine these are in
:mod:`pbrl.config.fields`; cross-field rules are in :mod:`pbrl.config.rules`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from pbrl.config.field_types import (
    MAX_TIMEOUT_S,
    DeviceSpec,
    NameList,
    NonEmptyStr,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    _Fields,
)


class _IterativeFields(_Fields):
    num_iterations: StrictInt = Field(6, ge=1, description="Rounds of collect -> store -> replay -> learn.")
    preference_num_candidates: StrictInt = Field(
        20,
        ge=1,
        description="Target candidates sampled per agent per item "
        "in each round; 1 is enough, since pairs are target j vs comparator "
        "j (the reference asks for >= 2).",
    )
    pair_selection: Literal["comparator_reward", "reward_gap", "all", "random", "counterfactual"] = Field(
        "comparator_reward",
        description="Order of an item's target/comparator pairs: "
        "'comparator_reward' (comparator score, then gap, largest first), 'reward_gap', 'all', 'random' or "
        "'counterfactual' (joint_mode='cross' only: pairs that differ in one agent's candidate first, the agents "
        "in turn, each by largest gap; then the others).",
    )
    preference_pairs_per_sample: StrictInt | None = Field(
        4, ge=1, description="Pairs kept per item after ordering; must be None with pair_selection='all'."
    )
    comparator_policy: Literal["current", "current_copy", "model", "history", "api"] = Field(
        "current",
        description="Source of the comparator side: 'current' (live weights, own seed stream), "
        "'current_copy' (frozen copy on comparator_devices), 'model' (explicit models), 'history' (an older "
        "checkpoint of this run) or 'api' (a remote model).",
    )
    comparator_history_k: StrictInt | None = Field(
        None,
        ge=1,
        description="With 'history': compare against the policy "
        "k updates older (None = 1). Only with comparator_policy='history'.",
    )
    comparator_model_name: NonEmptyStr | None = Field(
        None,
        description="With 'model': one comparator model for all agents (folder, hub id on disk or packaged alias).",
    )
    comparator_agents: NameList | None = Field(
        None,
        description="With 'model': one comparator model per agent "
        "(length num_agents). Give this or comparator_model_name.",
    )
    comparator_devices: DeviceSpec = Field(
        None,
        description="Device(s) of comparator models: one device, or a "
        "list of 1 or num_agents; 'auto' = accelerate's device map within "
        "max_memory; None = the agents' devices.",
    )
    comparator_num_candidates: StrictInt | None = Field(
        None,
        ge=1,
        description="Comparator candidates per item; "
        "None = preference_num_candidates. Only matching indices are "
        "paired.",
    )
    comparator_generation_mode: Literal["decentralized", "centralized"] = Field(
        "decentralized",
        description="'decentralized': each agent's comparator answers its own prompt; "
        "'centralized': one comparator writes every role in one response, parsed into roles.",
    )
    comparator_centralized_agent_index: StrictInt = Field(
        0,
        description="With 'centralized': which agent's "
        "comparator writes the joint response; in [0, num_agents) "
        "(checked only in centralized mode).",
    )
    comparator_api_format: Literal["generic", "openai", "anthropic", "openai_responses"] = Field(
        "generic", description="Request/response format of the API comparator."
    )
    comparator_api_url: NonEmptyStr | None = Field(
        None, description="Endpoint URL of the API comparator; required with comparator_policy='api'."
    )
    comparator_api_model: NonEmptyStr | None = Field(None, description="Model name sent to the API comparator.")
    comparator_api_key_env: NonEmptyStr | None = Field(
        None, description="NAME of the environment variable holding the API key; the key itself is never configured."
    )
    comparator_api_key_header: NonEmptyStr = Field(
        "Authorization", description="Header that carries the API key (anthropic: 'Authorization' becomes 'x-api-key')."
    )
    comparator_api_key_prefix: StrictStr = Field(
        "Bearer",
        description="Text before the key in its header "
        "('Bearer' gives 'Bearer <key>'; '' the bare key; anthropic: none).",
    )
    comparator_api_headers: dict[NonEmptyStr, StrictStr] | None = Field(
        None,
        description="Extra HTTP headers of every API request; a header named like a credential (Authorization, "
        "Cookie, anything with key, token, secret, auth, password) is refused: the key comes from "
        "comparator_api_key_env.",
    )
    comparator_api_extra_body: dict[NonEmptyStr, Any] | None = Field(
        None, description="JSON fields merged last into every API request body."
    )
    comparator_api_max_n_per_request: StrictInt | None = Field(
        None, ge=1, description="openai format: most candidates asked per request (n); None = all."
    )
    comparator_api_response_field: NonEmptyStr = Field(
        "completions", description="Generic format: dotted path of the list of completions in the JSON response."
    )
    comparator_api_timeout: StrictFloat = Field(
        120.0,
        gt=0,
        le=MAX_TIMEOUT_S,
        description="Total deadline of one API request (connect, send and every read of the answer), in seconds.",
    )
    comparator_api_max_concurrency: StrictInt = Field(4, ge=1, description="Most API requests in flight at once.")
    preference_replay_mode: Literal["current", "nearest_k", "all_history", "lambda_decay"] = Field(
        "current",
        description="Which stored rounds' pairs train a round: 'current' (this round's only), "
        "'nearest_k' (last k non-empty rounds), 'all_history', or 'lambda_decay' (weights λ^age).",
    )
    preference_replay_k: StrictInt | None = Field(
        None,
        ge=1,
        description="'nearest_k': number of recent non-empty rounds (required); 'current': None or 1; otherwise None.",
    )
    preference_replay_lambda: StrictFloat | None = Field(
        None, ge=0, le=1, description="'lambda_decay': decay λ in [0, 1] (required); forbidden with the other modes."
    )
    preference_replay_sample_size: StrictInt | None = Field(
        None,
        ge=1,
        description="Pairs drawn per round in the "
        "historical modes; None = this round's pair count. "
        "Forbidden with 'current'.",
    )
    preference_replay_dir: NonEmptyStr | None = Field(
        None, description="Folder of the round pair files; None = <run>/replay."
    )
    log_reward_distribution: StrictBool = Field(
        False,
        description="Record per-round histograms (16 bins over the "
        "task's declared reward range) of the raw rewards of target, "
        "comparator and selected-pair candidates, as metrics and plots. Needs "
        "a task/reward_func with a reward_range.",
    )
    policy_checkpoint_dir: NonEmptyStr | None = Field(
        None,
        description="Also export the policy of every round "
        "here, in the reference's layout: initial/agent_<i>/ and "
        "iteration_<nnnn>/agent_<i>/ (0-based: iteration_0000 = after "
        "round 1). None = the run's checkpoints/ only.",
    )
