"""Cross-field rules of the pbrl configuration (SPEC §2).

Each rule is a plain function over a mapping of field values that returns a list of :class:`Problem`.
A :class:`Rule` also names the fields it reads, so that a rule is skipped when one of its inputs already
failed type validation (one mistake gives one problem, not a cascade). Range and type checks of single
fields live on the pydantic fields (:mod:`pbrl.config.fields`: ``Field(ge=...)``, ``Literal``), where the
Prefect UI form sees them; :mod:`pbrl.config.messages` gives their errors the same ``Problem`` wording.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from pbrl.errors import Problem

Values = Mapping[str, Any]

HIDDEN = "<hidden>"
SECRET_MESSAGE = (
    "pbrl never takes an API key in the configuration (it would end up in run.json, logs and Prefect "
    "parameters); put the key in an environment variable and give that variable's name in "
    "comparator_api_key_env"
)

_IMPORT_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
_DEVICE = re.compile(r"^(cpu|cuda|mps|xpu)(:\d+)?$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_RUN_NAME = re.compile(r"^[A-Za-z0-9._-]+$")
_MEMORY_SIZE = re.compile(r"^\d+(\.\d+)?(GiB|MiB|KiB|GB|MB|KB)$", re.IGNORECASE)  # accelerate's sizes
_MEMORY_DEVICES = ("cpu", "mps", "disk")
AUTO = "auto"
CENTRALIZED = "centralized"  # collaboration_mode: one actor writes every role (pbrl.generation.collaboration)
# Device options that may be 'auto', by trainer field set (each is read only where that trainer has it).
_AUTO_FIELDS = ("agent_devices", "comparator_devices", "reference_devices", "reward_model_device")
_GROUP_BASELINE = ("magrpo", "mareinforce", "marloo", "maremax")
_ACTOR_CRITIC = ("maac", "iac")
# Comparator policies that load a separate copy of some policy on comparator_devices.
_SEPARATE_COMPARATORS = ("current_copy", "model", "history")
# Headers that carry an API key: never a config value (the key comes from comparator_api_key_env).
_KEY_HEADERS = frozenset({"authorization", "x-api-key", "api-key", "proxy-authorization"})


@dataclass(frozen=True)
class Rule:
    """A cross-field rule: ``check(values)`` lists the problems; ``fields`` are the values it reads."""

    fields: tuple[str, ...]
    check: Callable[[Values], list[Problem]]


def run_rules(rules: Iterable[Rule], values: Values, invalid: frozenset[str] = frozenset()) -> list[Problem]:
    """All problems of ``rules`` over ``values``, skipping rules that read a field listed in ``invalid``."""
    problems: list[Problem] = []
    for rule in rules:
        if not invalid.intersection(rule.fields):
            problems.extend(rule.check(values))
    return problems


def _rule(registry: list[Rule], *fields: str) -> Callable[[Callable[[Values], list[Problem]]], Rule]:
    def wrap(check: Callable[[Values], list[Problem]]) -> Rule:
        registry.append(Rule(fields, check))
        return registry[-1]

    return wrap


def _actors(v: Values) -> int:
    """The number of policies: 1 with collaboration_mode='centralized' (one actor writes every role), else
    num_agents (pbrl.config.num_actors over a mapping of values)."""
    return 1 if v["collaboration_mode"] == CENTRALIZED else v["num_agents"]


def _only_with(field: str, value: Any, condition: str) -> Problem:
    return Problem(field, value, f"allowed only with {condition}; set it to None")


def import_path_problems(field: str, value: str | list[str] | None) -> list[Problem]:
    """Problems of an import path ``"pkg.module:function"`` (or a list of them)."""
    if value is None:
        return []
    paths = [value] if isinstance(value, str) else list(value)
    bad = [(i, p) for i, p in enumerate(paths) if not _IMPORT_PATH.match(p)]
    if not bad:
        return []
    if isinstance(value, str):
        return [Problem(field, value, "must be an import path like 'pkg.module:function'")]
    where = ", ".join(f"item {i} ({p!r})" for i, p in bad)
    return [Problem(field, value, f"{where}: each item must be an import path like 'pkg.module:function'")]


def device_problems(field: str, spec: str | list[str] | None, num_agents: int | None) -> list[Problem]:
    """Problems of a device spec: None, one device for all agents, ``'auto'`` (accelerate's device map, given
    alone), or a list of 1 or ``num_agents`` devices."""
    if spec is None or spec == AUTO:
        return []
    devices = [spec] if isinstance(spec, str) else list(spec)
    if AUTO in devices:
        return [Problem(field, spec, "'auto' places every model with accelerate's device map: give it alone "
                        f"({field}: auto), not in a list")]
    problems = []
    if any(not _DEVICE.match(d) for d in devices):
        problems.append(Problem(field, spec, "devices look like 'cpu', 'cuda', 'cuda:1' or 'mps'"))
    if num_agents is not None and not isinstance(spec, str) and len(devices) not in (1, num_agents):
        problems.append(Problem(field, spec, f"must list 1 device or one per agent (num_agents={num_agents})"))
    return problems


# --------------------------------------------------------------------------- rules of every trainer
COMMON_RULES: list[Rule] = []


@_rule(COMMON_RULES, "num_turns")
def _num_turns(v: Values) -> list[Problem]:
    if v["num_turns"] == 1:
        return []
    return [Problem("num_turns", v["num_turns"], "must be 1 (pbrl, like the reference, trains single-turn only)")]


@_rule(COMMON_RULES, "pair_selection", "preference_pairs_per_sample")
def _pairs_per_sample(v: Values) -> list[Problem]:
    if v["pair_selection"] == "all" and v["preference_pairs_per_sample"] is not None:
        return [Problem("preference_pairs_per_sample", v["preference_pairs_per_sample"],
                        "must be None when pair_selection='all' (every pair is kept)")]
    return []


@_rule(COMMON_RULES, "reward_func", "reward_processor")
def _reward_paths(v: Values) -> list[Problem]:
    return import_path_problems("reward_func", v["reward_func"]) + import_path_problems(
        "reward_processor", v["reward_processor"])


@_rule(COMMON_RULES, "reference_devices", "num_agents", "reference_kl_enabled", "collaboration_mode")
def _reference_devices(v: Values) -> list[Problem]:
    # As in the reference (validate_reference_kl_config): the devices matter only when the KL is on; one per
    # actor (1 when centralized).
    if not v["reference_kl_enabled"]:
        return []
    return device_problems("reference_devices", v["reference_devices"], _actors(v))


# --------------------------------------------------------------------------- iterative trainers
ITERATIVE_RULES: list[Rule] = []


@_rule(ITERATIVE_RULES, "comparator_policy", "comparator_history_k")
def _history_k(v: Values) -> list[Problem]:
    if v["comparator_policy"] != "history" and v["comparator_history_k"] is not None:
        return [_only_with("comparator_history_k", v["comparator_history_k"], "comparator_policy='history'")]
    return []


@_rule(ITERATIVE_RULES, "comparator_policy", "comparator_model_name", "comparator_agents")
def _comparator_models(v: Values) -> list[Problem]:
    name, agents = v["comparator_model_name"], v["comparator_agents"]
    if v["comparator_policy"] != "model":
        return [_only_with(f, v[f], "comparator_policy='model'")
                for f in ("comparator_model_name", "comparator_agents") if v[f] is not None]
    if name is None and agents is None:
        return [Problem("comparator_model_name", None, "comparator_policy='model' needs comparator_model_name "
                        "(one model for all agents) or comparator_agents (one per agent)")]
    return same_model_problems("comparator_agents", agents, "comparator_model_name", name)


def same_model_problems(list_field: str, models: list[str] | None, one_field: str, one: str | None) -> list[Problem]:
    """Both a one-for-all model and a per-agent list may be given only when the list repeats that model (the
    reference's ``resolve_model_sources``): ``agents: [m, m]`` with ``agent_model: m`` is fine, ``[m, n]`` not."""
    if models is None or one is None:
        return []
    others = sorted({m for m in models if m != one})
    if not others:
        return []
    return [Problem(list_field, models, f"conflicts with {one_field}={one!r} (also names "
                    f"{', '.join(repr(m) for m in others)}); give {one_field} or {list_field}, or list "
                    f"{one_field} once per agent")]


@_rule(ITERATIVE_RULES, "comparator_policy", "comparator_agents", "num_agents", "collaboration_mode")
def _comparator_agent_count(v: Values) -> list[Problem]:
    agents = v["comparator_agents"]
    if v["comparator_policy"] != "model" or agents is None or len(agents) == _actors(v):
        return []
    if v["collaboration_mode"] == CENTRALIZED:
        return [Problem("comparator_agents", agents, "must name exactly one model with collaboration_mode="
                        "'centralized' (one actor writes every role); or give comparator_model_name")]
    return [Problem("comparator_agents", agents, f"must name one model per agent (num_agents={v['num_agents']})")]


@_rule(ITERATIVE_RULES, "comparator_centralized_agent_index", "num_agents", "comparator_generation_mode",
       "collaboration_mode")
def _centralized_index(v: Values) -> list[Problem]:
    # As in the reference: the index is read (and checked) only in centralized comparator generation.
    index, n = v["comparator_centralized_agent_index"], v["num_agents"]
    if v["collaboration_mode"] == CENTRALIZED:
        if index == 0:
            return []
        return [Problem("comparator_centralized_agent_index", index, "must be 0 with collaboration_mode="
                        "'centralized': one actor (index 0) writes every role")]
    if v["comparator_generation_mode"] != "centralized" or 0 <= index < n:
        return []
    return [Problem("comparator_centralized_agent_index", index, f"must be in [0, num_agents) = [0, {n})")]


@_rule(ITERATIVE_RULES, "collaboration_mode", "comparator_generation_mode")
def _centralized_generation(v: Values) -> list[Problem]:
    # The configuration sets it (pbrl.config.notices.derive_values, as the reference's __post_init__); this
    # holds for a mapping validated without that step.
    if v["collaboration_mode"] != CENTRALIZED or v["comparator_generation_mode"] == "centralized":
        return []
    return [Problem("comparator_generation_mode", v["comparator_generation_mode"], "must be 'centralized' with "
                    "collaboration_mode='centralized' (the comparator is one actor writing every role too)")]


@_rule(ITERATIVE_RULES, "comparator_policy", "comparator_api_url", "comparator_api_model", "comparator_api_key_env")
def _api_fields(v: Values) -> list[Problem]:
    fields = ("comparator_api_url", "comparator_api_model", "comparator_api_key_env")
    if v["comparator_policy"] != "api":
        return [_only_with(f, HIDDEN if f == "comparator_api_key_env" else v[f], "comparator_policy='api'")
                for f in fields if v[f] is not None]
    if v["comparator_api_url"] is None:
        return [Problem("comparator_api_url", None, "required with comparator_policy='api'")]
    return []


@_rule(ITERATIVE_RULES, "comparator_api_url")
def _api_url(v: Values) -> list[Problem]:
    url = v["comparator_api_url"]
    if url is None or url.startswith(("http://", "https://")):
        return []
    return [Problem("comparator_api_url", url, "must be an http:// or https:// URL")]


@_rule(ITERATIVE_RULES, "comparator_api_key_env")
def _api_key_env(v: Values) -> list[Problem]:
    name = v["comparator_api_key_env"]
    if name is None or _ENV_NAME.match(name):
        return []
    # The value may be a pasted key: never echo it.
    return [Problem("comparator_api_key_env", HIDDEN, "must be the NAME of an environment variable "
                    "(letters, digits and '_', e.g. OPENAI_API_KEY), not the key itself")]


@_rule(ITERATIVE_RULES, "comparator_devices", "num_agents", "comparator_policy", "collaboration_mode")
def _comparator_devices(v: Values) -> list[Problem]:
    # Read only where a separate comparator policy is loaded ('current' samples the live agents).
    if v["comparator_policy"] not in _SEPARATE_COMPARATORS:
        return []
    return device_problems("comparator_devices", v["comparator_devices"], _actors(v))


@_rule(ITERATIVE_RULES, "comparator_api_headers")
def _api_headers(v: Values) -> list[Problem]:
    headers = v["comparator_api_headers"] or {}
    keyed = sorted(h for h in headers if h.strip().lower() in _KEY_HEADERS)
    if not keyed:
        return []
    # The value would be the key: never echo it.
    return [Problem("comparator_api_headers", HIDDEN, f"header(s) {', '.join(keyed)} would put an API key in the "
                    "configuration; " + SECRET_MESSAGE)]


@_rule(ITERATIVE_RULES, "preference_replay_mode", "preference_replay_k")
def _replay_k(v: Values) -> list[Problem]:
    mode, k = v["preference_replay_mode"], v["preference_replay_k"]
    if mode == "nearest_k" and k is None:
        return [Problem("preference_replay_k", k, "required (>= 1) with preference_replay_mode='nearest_k'")]
    if mode == "current" and k not in (None, 1):
        return [Problem("preference_replay_k", k, "must be None or 1 with preference_replay_mode='current'")]
    if mode in ("all_history", "lambda_decay") and k is not None:
        return [Problem("preference_replay_k", k, f"must be None with preference_replay_mode='{mode}'")]
    return []


@_rule(ITERATIVE_RULES, "preference_replay_mode", "preference_replay_lambda")
def _replay_lambda(v: Values) -> list[Problem]:
    mode, lam = v["preference_replay_mode"], v["preference_replay_lambda"]
    if mode == "lambda_decay" and lam is None:
        return [Problem("preference_replay_lambda", lam,
                        "required, in [0, 1], with preference_replay_mode='lambda_decay'")]
    if mode != "lambda_decay" and lam is not None:
        return [_only_with("preference_replay_lambda", lam, "preference_replay_mode='lambda_decay'")]
    return []


@_rule(ITERATIVE_RULES, "preference_replay_mode", "preference_replay_sample_size")
def _replay_sample_size(v: Values) -> list[Problem]:
    if v["preference_replay_mode"] == "current" and v["preference_replay_sample_size"] is not None:
        return [Problem("preference_replay_sample_size", v["preference_replay_sample_size"],
                        "must be None with preference_replay_mode='current' (the round's pairs are used as "
                        "they are)")]
    return []


# --------------------------------------------------------------------------- MARLHF trainers
MARLHF_RULES: list[Rule] = []


@_rule(MARLHF_RULES, "rl_algorithm", "num_generations")
def _num_generations(v: Values) -> list[Problem]:
    algorithm, n = v["rl_algorithm"], v["num_generations"]
    if algorithm in _GROUP_BASELINE and n < 2:
        return [Problem("num_generations", n, f"must be >= 2 with rl_algorithm='{algorithm}' (its baseline "
                        "compares the samples of a group)")]
    return []


@_rule(MARLHF_RULES, "rl_algorithm", "critic_model_name", "critic_learning_rate")
def _critic_fields(v: Values) -> list[Problem]:
    if v["rl_algorithm"] in _ACTOR_CRITIC:
        return []
    return [_only_with(f, v[f], "rl_algorithm='maac' or 'iac'")
            for f in ("critic_model_name", "critic_learning_rate") if v[f] is not None]


@_rule(MARLHF_RULES, "rl_algorithm", "critic_devices", "num_agents")
def _critic_devices(v: Values) -> list[Problem]:
    if v["rl_algorithm"] not in _ACTOR_CRITIC:
        return []
    return device_problems("critic_devices", v["critic_devices"], v["num_agents"])


@_rule(MARLHF_RULES, "rl_algorithm", "use_separate_critic", "critic_model_name", "critic_devices",
       "critic_value_head_hidden_dim", "value_head_hidden_dim")
def _critic_layout(v: Values) -> list[Problem]:
    # pbrl.learning.critics: maac's centralized critic reads every agent and is always a separate model; a value head on
    # the policy (iac, use_separate_critic: false) has no critic model, device or separate-critic head.
    problems = []
    head_only = v["rl_algorithm"] == "iac" and not v["use_separate_critic"]
    if v["rl_algorithm"] == "maac" and not v["use_separate_critic"]:
        problems.append(Problem("use_separate_critic", False, "maac's centralized critic reads every agent and is "
                                "always a separate model; set it to true, or use rl_algorithm: iac for value heads"))
    if head_only:
        problems += [Problem(f, v[f], "use_separate_critic: false puts a value head on each agent's policy, so "
                             "there is no separate critic for this setting; leave it null")
                     for f in ("critic_model_name", "critic_devices", "critic_value_head_hidden_dim")
                     if v[f] is not None]
    elif v["rl_algorithm"] in _ACTOR_CRITIC and v["value_head_hidden_dim"] is not None:
        problems.append(Problem("value_head_hidden_dim", v["value_head_hidden_dim"], "sizes the value head on the "
                                "policy (rl_algorithm: iac with use_separate_critic: false); use "
                                "critic_value_head_hidden_dim for a separate critic"))
    return problems


@_rule(MARLHF_RULES, "collaboration_mode")
def _marlhf_collaboration(v: Values) -> list[Problem]:
    if v["collaboration_mode"] != CENTRALIZED:
        return []
    return [Problem("collaboration_mode", v["collaboration_mode"], "not available with trainer 'marlhf' or "
                    "'marlhf_iter' in this version (the joint reward model and RL backends train one policy per "
                    "agent); use trainer 'madpo' or 'madpo_iter', or collaboration_mode 'decentralized'")]


@_rule(MARLHF_RULES, "reward_model_device")
def _reward_model_device(v: Values) -> list[Problem]:
    device = v["reward_model_device"]
    return [] if device is None else device_problems("reward_model_device", device, None)


TRAINER_RULES: dict[str, tuple[Rule, ...]] = {
    "madpo": tuple(COMMON_RULES),
    "marlhf": tuple(COMMON_RULES + MARLHF_RULES),
    "madpo_iter": tuple(COMMON_RULES + ITERATIVE_RULES),
    "marlhf_iter": tuple(COMMON_RULES + ITERATIVE_RULES + MARLHF_RULES),
}


# --------------------------------------------------------------------------- run-level fields
RUN_RULES: list[Rule] = []


@_rule(RUN_RULES, "run_name")
def _run_name(v: Values) -> list[Problem]:
    name = v["run_name"]
    if name is None or (_RUN_NAME.match(name) and set(name) != {"."}):
        return []
    return [Problem("run_name", name, "allowed characters: letters, digits, '-', '_', '.' (and not only dots)")]


@_rule(RUN_RULES, "runner", "ray_address")
def _runner_fields(v: Values) -> list[Problem]:
    # Whether the 'ray' extra is installed is checked where a run starts (pbrl.distributed.shards.require_ray_extra), not
    # here: a stored Ray run must stay readable (status, report) on a machine without Ray.
    if v["runner"] == "local" and v["ray_address"] is not None:
        return [_only_with("ray_address", v["ray_address"], "runner='ray'")]
    return []


@_rule(RUN_RULES, "runner", "agent_devices")
def _ray_devices(v: Values) -> list[Problem]:
    # On Ray a shard task or an agent actor reserves its GPUs from the devices named here (flows/ray_runner.py,
    # pbrl/distributed/ray_agents.py); 'auto' names none, so the work would silently land on a CPU.
    devices = v["agent_devices"]
    named = devices if isinstance(devices, list) else [devices]
    if v["runner"] != "ray" or "auto" not in named:
        return []
    return [Problem("agent_devices", devices, "'auto' cannot be reserved on Ray (runner='ray'); name the devices "
                    "('cpu', 'cuda:0' or one per agent) so that each shard and agent actor asks Ray for its GPU")]


@_rule(RUN_RULES, "agent_model", "agents")
def _agent_source(v: Values) -> list[Problem]:
    if v["agent_model"] is None and v["agents"] is None:
        return [Problem("agent_model", None, "missing; give agent_model (one model for all agents) or agents "
                        "(one per agent)")]
    return same_model_problems("agents", v["agents"], "agent_model", v["agent_model"])


@_rule(RUN_RULES, "formatters")
def _formatter_paths(v: Values) -> list[Problem]:
    return import_path_problems("formatters", v["formatters"])


@_rule(RUN_RULES, "agent_devices")
def _agent_devices(v: Values) -> list[Problem]:
    return device_problems("agent_devices", v["agent_devices"], None)


@_rule(RUN_RULES, "max_memory")
def _max_memory(v: Values) -> list[Problem]:
    memory = v["max_memory"]
    if memory is None:
        return []
    bad_keys = [k for k in memory if not (isinstance(k, int) and k >= 0) and k not in _MEMORY_DEVICES]
    bad_sizes = [k for k, size in memory.items()
                 if (isinstance(size, int) and size <= 0) or (isinstance(size, str) and not _MEMORY_SIZE.match(size))]
    problems = []
    if bad_keys:
        problems.append(Problem("max_memory", memory, f"key(s) {', '.join(repr(k) for k in bad_keys)}: keys are a "
                                "GPU index (0, 1, ...), 'cpu', 'mps' or 'disk' (accelerate's max_memory)"))
    if bad_sizes:
        problems.append(Problem("max_memory", memory, f"size(s) of {', '.join(repr(k) for k in bad_sizes)}: sizes "
                                "are bytes > 0 or a number with a unit: GiB, MiB, KiB, GB, MB, KB (e.g. '2GiB')"))
    return problems


@_rule(RUN_RULES, "lora_r", "lora_target_modules")
def _lora_modules(v: Values) -> list[Problem]:
    if v["lora_r"] is None and v["lora_target_modules"] is not None:
        return [_only_with("lora_target_modules", v["lora_target_modules"], "lora_r set (LoRA on)")]
    return []


@_rule(RUN_RULES, "train_dataset", "eval_dataset")
def _dataset_suffix(v: Values) -> list[Problem]:
    return [Problem(f, v[f], "must be a .jsonl or .parquet file") for f in ("train_dataset", "eval_dataset")
            if isinstance(v[f], str) and not v[f].lower().endswith((".jsonl", ".parquet"))]


@_rule(RUN_RULES, "task", "task_options")
def _task_options(v: Values) -> list[Problem]:
    if v["task"] is None and v["task_options"]:
        return [Problem("task_options", v["task_options"], "allowed only with task (they go to its factory)")]
    return []


# --------------------------------------------------------------------------- a whole job (run + trainer)
JOB_RULES: list[Rule] = []


@_rule(JOB_RULES, "agents", "num_agents", "collaboration_mode")
def _agent_count(v: Values) -> list[Problem]:
    if v["agents"] is None or len(v["agents"]) == _actors(v):
        return []
    if v["collaboration_mode"] == CENTRALIZED:
        return [Problem("agents", v["agents"], "must name exactly one model with collaboration_mode='centralized' "
                        "(one actor writes every role; num_agents counts the roles); or give agent_model")]
    return [Problem("agents", v["agents"], f"must name one model per agent (num_agents={v['num_agents']})")]


@_rule(JOB_RULES, "formatters", "num_agents")
def _formatter_count(v: Values) -> list[Problem]:
    if v["formatters"] is not None and len(v["formatters"]) != v["num_agents"]:
        return [Problem("formatters", v["formatters"], f"must give one formatter per agent "
                        f"(num_agents={v['num_agents']})")]
    return []


@_rule(JOB_RULES, "agent_devices", "num_agents", "collaboration_mode")
def _agent_device_count(v: Values) -> list[Problem]:
    spec = v["agent_devices"]
    if not isinstance(spec, list) or len(spec) in (1, _actors(v)):
        return []
    if v["collaboration_mode"] == CENTRALIZED:
        return [Problem("agent_devices", spec, "must list 1 device with collaboration_mode='centralized' (one "
                        "actor)")]
    return [Problem("agent_devices", spec, f"must list 1 device or one per agent (num_agents={v['num_agents']})")]


@_rule(JOB_RULES, "parallel_training", "agent_devices")
def _parallel_devices(v: Values) -> list[Problem]:
    if v["parallel_training"] == "mp" and v["agent_devices"] is None:
        return [Problem("agent_devices", None, "required with parallel_training='mp' (agent i runs on device i); "
                        "give one device per agent")]
    return []


@_rule(JOB_RULES, "max_memory", "agent_devices")
def _max_memory_needs_auto(v: Values) -> list[Problem]:
    # max_memory only bounds accelerate's device map: without an 'auto' device option it would change nothing.
    if v["max_memory"] is None or any(v.get(f) == AUTO for f in _AUTO_FIELDS):
        return []
    return [_only_with("max_memory", v["max_memory"], "a device option set to 'auto' (agent_devices, "
                       "comparator_devices, reference_devices or reward_model_device)")]


@_rule(JOB_RULES, "task", "train_dataset", "formatters", "reward_func")
def _task_source(v: Values) -> list[Problem]:
    if v["task"] is not None:
        return []
    parts = ("train_dataset", "formatters", "reward_func")
    missing = [f for f in parts if v[f] is None]
    if len(missing) == len(parts):
        return [Problem("task", None, "missing; give task (a registered task name), or train_dataset + "
                        "formatters + reward_func together")]
    return [Problem(f, None, "required when task is not given (train_dataset + formatters + reward_func "
                    "together)") for f in missing]


def job_rules(trainer: str) -> tuple[Rule, ...]:
    """Every rule of a flat job of ``trainer``: the trainer's, the run's and the ones that join them."""
    return TRAINER_RULES[trainer] + tuple(RUN_RULES) + tuple(JOB_RULES)
