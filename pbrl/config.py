"""Configuration models of pbrl (SPEC §2): one frozen pydantic model per trainer, the run-level fields, and
flat job models (run fields + one trainer's fields) that YAML files and the Prefect flow parameter use.

Option names and defaults are the reference library's (CoMLRL ``comlrl.trainers.preference``) except the
★ changes of SPEC §2. There are no aliases and no normalisation: ``'td-lambda'`` is an error, not
``'lambda_decay'``. :func:`parse_job` and :func:`load_job` report *every* problem at once in one
:class:`~pbrl.errors.ConfigError`; the rules themselves are in :mod:`pbrl.config_rules`.

Field definitions are shared through field-only mixins (``_CommonFields`` ...); the only behaviour is in
``_Checked``, which runs the rules of the concrete class after pydantic's field validation.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import warnings
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, TypeVar

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    model_validator,
)

from pbrl.config_rules import (
    HIDDEN,
    RUN_RULES,
    SECRET_MESSAGE,
    TRAINER_RULES,
    Notice,
    Rule,
    field_problems,
    job_rules,
    madpo_kl_notice,
    run_rules,
)
from pbrl.errors import ConfigError, Problem

NonEmptyStr = Annotated[str, Field(min_length=1)]
DeviceSpec = NonEmptyStr | Annotated[list[NonEmptyStr], Field(min_length=1)] | None
NameList = Annotated[list[NonEmptyStr], Field(min_length=1)]

_Model = TypeVar("_Model", bound=BaseModel)
_SECRET_KEY = "comparator_api_key"
_MODE = "pbrl_validation"  # validation context: "full" (rules + warnings), "quiet" (rules), "fields" (types only)


class _Fields(BaseModel):
    # hide_input_in_errors: a raw pydantic error must never print a value that may be a secret.
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False, coerce_numbers_to_str=True,
                              hide_input_in_errors=True)


class _CommonFields(_Fields):
    num_agents: int = Field(2, ge=1, description="Number of cooperating agents (policies). Must equal the number "
                            "of formatters and of `agents` when those are given.")
    num_turns: int = Field(1, description="Turns per episode. Must be 1: pbrl trains single-turn joint responses.")
    joint_mode: Literal["aligned"] = Field("aligned", description="How candidates form joint responses: "
                                           "'aligned' joins the agents' candidates with the same index (only value).")
    dpo_beta: float = Field(0.1, gt=0, description="MADPO inverse temperature η in the loss -log σ(η Δ) on the "
                            "joint log-prob margin Δ. Accepted but unused by MARLHF, as in the reference.")
    agent_learning_rate: float = Field(5e-6, gt=0, description="AdamW learning rate of every agent's policy.")
    train_batch_size: int = Field(2, ge=1, description="Preference pairs per policy update step.")
    max_new_tokens: int = Field(256, gt=0, description="Most tokens generated per completion.")
    temperature: float = Field(0.6, gt=0, description="Sampling temperature (generation always samples).")
    top_p: float = Field(0.6, gt=0, le=1, description="Nucleus sampling: keep the smallest token set whose "
                         "probability reaches top_p.")
    top_k: int | None = Field(50, ge=1, description="Sample among the k most likely tokens; None = no top-k cut.")
    eval_interval: int = Field(1, ge=0, description="Evaluate every eval_interval rounds and once before the first "
                               "update (round 0 baseline); 0 disables evaluation.")
    eval_num_samples: int = Field(4, ge=0, description="Evaluation items per evaluation (one sampled completion "
                                  "per agent each), scored with the task reward.")
    max_grad_norm: float | None = Field(1.0, gt=0, description="Clip each agent's gradient norm to this value "
                                        "before a step; None = no clipping (the reference has none).")
    reward_func: NonEmptyStr | None = Field(None, description="Oracle reward as an import path "
                                            "'pkg.module:function'; None = the task's reward. The Python API "
                                            "passes callables separately.")
    reward_processor: NonEmptyStr | None = Field(None, description="Import path 'pkg.module:function' of a float "
                                                 "-> float map applied to every raw reward; None = the task's "
                                                 "(identity if it has none).")
    reference_kl_enabled: bool = Field(False, description="Subtract reference_kl_coef times a sampled KL to a "
                                       "frozen copy of the initial policy from the reward (MARLHF policy "
                                       "learning only; MADPO accepts it, ignores it and warns).")
    reference_kl_coef: float = Field(0.1, ge=0, description="Weight of the reference KL penalty.")
    reference_devices: DeviceSpec = Field(None, description="Device(s) of the reference models: one device, or a "
                                          "list of 1 or num_agents; None = the agents' devices.")


class _SingleRoundFields(_Fields):
    preference_num_candidates: int = Field(80, ge=2, description="Candidates sampled per agent per item; pairs "
                                           "are formed among the joint candidates of each item.")
    pair_selection: Literal["reward_gap", "all", "random"] = Field(
        "reward_gap", description="Which pairs of an item to keep: 'reward_gap' (largest score gap first), 'all', "
        "or 'random' (seeded shuffle).")
    preference_pairs_per_sample: int | None = Field(16, ge=1, description="Pairs kept per item after ordering; "
                                                    "must be None with pair_selection='all'.")


class _IterativeFields(_Fields):
    num_iterations: int = Field(6, ge=1, description="Rounds of collect -> store -> replay -> learn.")
    preference_num_candidates: int = Field(20, ge=1, description="Target candidates sampled per agent per item "
                                           "in each round.")
    pair_selection: Literal["comparator_reward", "reward_gap", "all", "random"] = Field(
        "comparator_reward", description="Order of an item's index-matched target/comparator pairs: "
        "'comparator_reward' (comparator score, then gap, largest first), 'reward_gap', 'all' or 'random'.")
    preference_pairs_per_sample: int | None = Field(4, ge=1, description="Pairs kept per item after ordering; "
                                                    "must be None with pair_selection='all'.")
    comparator_policy: Literal["current", "current_copy", "model", "history", "api"] = Field(
        "current", description="Source of the comparator side: 'current' (live weights, own seed stream), "
        "'current_copy' (frozen copy on comparator_devices), 'model' (explicit models), 'history' (an older "
        "checkpoint of this run) or 'api' (a remote model).")
    comparator_history_k: int | None = Field(None, ge=1, description="With 'history': compare against the policy "
                                             "k updates older (None = 1). Only with comparator_policy='history'.")
    comparator_model_name: NonEmptyStr | None = Field(None, description="With 'model': one comparator model for "
                                                      "all agents (folder, hub id on disk or packaged alias).")
    comparator_agents: NameList | None = Field(None, description="With 'model': one comparator model per agent "
                                               "(length num_agents). Give this or comparator_model_name.")
    comparator_devices: DeviceSpec = Field(None, description="Device(s) of comparator models: one device, or a "
                                           "list of 1 or num_agents; None = the agents' devices.")
    comparator_num_candidates: int | None = Field(None, ge=1, description="Comparator candidates per item; None "
                                                  "= preference_num_candidates. Only matching indices are paired.")
    comparator_generation_mode: Literal["decentralized", "centralized"] = Field(
        "decentralized", description="'decentralized': each agent's comparator answers its own prompt; "
        "'centralized': one comparator writes every role in one response, parsed into roles.")
    comparator_centralized_agent_index: int = Field(0, ge=0, description="With 'centralized': which agent's "
                                                    "comparator writes the joint response; in [0, num_agents).")
    comparator_api_format: Literal["generic", "openai", "anthropic", "openai_responses"] = Field(
        "generic", description="Request/response format of the API comparator.")
    comparator_api_url: NonEmptyStr | None = Field(None, description="Endpoint URL of the API comparator; "
                                                   "required with comparator_policy='api'.")
    comparator_api_model: NonEmptyStr | None = Field(None, description="Model name sent to the API comparator.")
    comparator_api_key_env: NonEmptyStr | None = Field(None, description="NAME of the environment variable "
                                                       "holding the API key; the key itself is never configured.")
    comparator_api_response_field: NonEmptyStr = Field("completions", description="Generic format: dotted path "
                                                       "of the list of completions in the JSON response.")
    comparator_api_timeout: float = Field(120.0, gt=0, description="Timeout of one API request, in seconds.")
    comparator_api_max_concurrency: int = Field(4, ge=1, description="Most API requests in flight at once.")
    preference_replay_mode: Literal["current", "nearest_k", "all_history", "lambda_decay"] = Field(
        "current", description="Which stored rounds' pairs train a round: 'current' (this round's only), "
        "'nearest_k' (last k non-empty rounds), 'all_history', or 'lambda_decay' (weights λ^age).")
    preference_replay_k: int | None = Field(None, ge=1, description="'nearest_k': number of recent non-empty "
                                            "rounds (required); 'current': None or 1; otherwise None.")
    preference_replay_lambda: float | None = Field(None, ge=0, le=1, description="'lambda_decay': decay λ in "
                                                   "[0, 1] (required); forbidden with the other modes.")
    preference_replay_sample_size: int | None = Field(None, ge=1, description="Pairs drawn per round in the "
                                                      "historical modes; None = this round's pair count. "
                                                      "Forbidden with 'current'.")
    preference_replay_dir: NonEmptyStr | None = Field(None, description="Folder of the round pair files; None = "
                                                      "<run>/replay.")


class _RewardModelFields(_Fields):
    reward_model_name: NonEmptyStr | None = Field(None, description="Backbone of the joint reward model; None = "
                                                  "the agents' model.")
    reward_learning_rate: float = Field(1e-5, gt=0, description="AdamW learning rate of the reward model.")
    reward_num_train_epochs: int = Field(1, ge=1, description="Epochs of reward-model fitting per round.")
    reward_train_batch_size: int = Field(1, ge=1, description="Preference pairs per reward-model step.")
    reward_max_length: int | None = Field(None, ge=1, description="Most tokens of a joint text for the reward "
                                          "model; None = the tokenizer's limit.")
    reward_freeze_backbone: bool = Field(False, description="Train only the reward model's scalar head.")
    rl_algorithm: Literal["magrpo", "mareinforce", "marloo", "maremax", "maac", "iac"] = Field(
        "magrpo", description="RL backend against the learned reward: 'magrpo' (group-mean baseline), "
        "'mareinforce' (no baseline), 'marloo' (leave-one-out), 'maremax' (group max), 'maac' (centralized "
        "critic), 'iac' (independent critics).")
    num_generations: int = Field(4, ge=1, description="RL samples per item per agent; >= 2 for magrpo, "
                                 "mareinforce, marloo and maremax.")
    critic_model_name: NonEmptyStr | None = Field(None, description="Critic backbone for 'maac'/'iac'; None = "
                                                  "the agents' model.")
    critic_learning_rate: float | None = Field(None, gt=0, description="Critic learning rate for 'maac'/'iac'; "
                                               "None = agent_learning_rate.")
    value_loss_coef: float = Field(0.6, gt=0, description="Weight of the value loss ('maac'/'iac').")
    value_clip_range: float | None = Field(0.2, gt=0, description="Value clipping range ('maac'/'iac'); None = "
                                           "no clipping.")


def _epochs(default: int) -> Any:
    return Field(default, ge=1, description="Passes over the selected pairs per round (MADPO) or RL epochs per "
                 "round (MARLHF).")


class _MADPOFields(_SingleRoundFields, _CommonFields):
    num_train_epochs: int = _epochs(20)


class _MADPOIterFields(_IterativeFields, _CommonFields):
    num_train_epochs: int = _epochs(1)


class _MARLHFFields(_RewardModelFields, _SingleRoundFields, _CommonFields):
    num_train_epochs: int = _epochs(1)


class _MARLHFIterFields(_RewardModelFields, _IterativeFields, _CommonFields):
    num_train_epochs: int = _epochs(2)
    reward_num_train_epochs: int = Field(2, ge=1, description="Epochs of reward-model fitting per round.")
    preference_scoring_reward: Literal["task", "reward_model"] = Field(
        "task", description="Scores of new comparisons: 'task' (the oracle) or 'reward_model' (the latest fitted "
        "reward model; the task reward until one exists).")


class _RunFields(_Fields):
    trainer: Literal["madpo", "marlhf", "madpo_iter", "marlhf_iter"] = Field(
        description="Trainer: 'madpo', 'marlhf' (one collection) or 'madpo_iter', 'marlhf_iter' (rounds).")
    seed: int = Field(0, ge=0, description="Run seed; every random stream derives from it.")
    run_name: NonEmptyStr | None = Field(None, description="Run folder name (letters, digits, '-', '_', '.'); "
                                         "None = generated.")
    output_dir: NonEmptyStr = Field("storage/runs", description="Folder that holds run folders.")
    task: NonEmptyStr | None = Field(None, description="Registered task name (e.g. 'humaneval_coop'); or give "
                                     "train_dataset + formatters + reward_func.")
    task_options: dict[str, Any] = Field(default_factory=dict, description="Keyword options for the task factory.")
    train_dataset: NonEmptyStr | None = Field(None, description="Training items: a .jsonl or .parquet file; None "
                                              "= the task's items.")
    eval_dataset: NonEmptyStr | None = Field(None, description="Evaluation items: a .jsonl or .parquet file; "
                                             "None = the task's.")
    formatters: NameList | None = Field(None, description="One prompt formatter import path "
                                        "'pkg.module:function' per agent; None = the task's.")
    max_train_items: int | None = Field(None, ge=1, description="Use at most this many training items; None = all.")
    agent_model: NonEmptyStr | None = Field(None, description="One model for all agents: a local folder, a hub id "
                                            "already on disk, or a packaged alias like 'smollm2-135m-instruct'.")
    agents: NameList | None = Field(None, description="One model per agent (same forms as agent_model). Give "
                                    "this or agent_model.")
    lora_r: int | None = Field(None, ge=1, description="LoRA rank; None = full fine-tuning (LoRA off).")
    lora_alpha: int = Field(16, ge=1, description="LoRA scaling alpha.")
    lora_dropout: float = Field(0.0, ge=0, lt=1, description="LoRA dropout probability.")
    lora_target_modules: NameList | None = Field(None, description="Modules that get LoRA adapters; None = "
                                                 "q_proj, k_proj, v_proj, o_proj.")
    agent_devices: DeviceSpec = Field(None, description="Agent device(s): one device for all, or a list of 1 or "
                                      "num_agents; None = the first GPU, else CPU.")
    tie_tolerance: float = Field(1e-9, ge=0, description="Scores within this absolute distance are a tie (no pair).")
    oracle_max_failure_share: float = Field(0.5, ge=0, le=1, description="Share of joint responses whose reward "
                                            "may fail (dropped and counted) before the round stops.")
    generation_batch_size: int = Field(64, ge=1, description="Rows (prompt x candidate) per generate call.")
    torch_dtype: Literal["float32", "bfloat16"] = Field("float32", description="Dtype of loaded model weights.")


class _Checked(_Fields):
    """Runs the cross-field rules of the concrete class after pydantic's field validation.

    Direct construction (``MADPOIterConfig(dpo_beta=0)``) or ``model_validate`` (Prefect) raise pydantic's
    ValidationError; a broken rule arrives in it as a value error wrapping a ConfigError. Use
    :func:`parse_config` / :func:`parse_job` to get one ConfigError listing type and rule problems together.
    """

    _rules: ClassVar[tuple[Rule, ...]] = ()
    _notices: ClassVar[tuple[Notice, ...]] = ()

    @model_validator(mode="before")
    @classmethod
    def _refuse_secret(cls, data: Any) -> Any:
        # Before pydantic echoes the value in an "extra field" error.
        if isinstance(data, Mapping) and _SECRET_KEY in data:
            raise ConfigError([Problem(_SECRET_KEY, HIDDEN, SECRET_MESSAGE)])
        return data

    @model_validator(mode="after")
    def _check_rules(self, info: ValidationInfo) -> _Checked:
        mode = (info.context or {}).get(_MODE, "full")
        if mode == "fields":
            return self
        values = dict(self)
        problems = run_rules(self._rules, values)
        if problems:
            raise ConfigError(problems)
        if mode == "full":
            for notice in self._notices:
                for text in notice(values):
                    warnings.warn(text, UserWarning, stacklevel=2)
        return self


class MADPOConfig(_MADPOFields, _Checked):
    """MADPO (one collection, then training) trainer options."""

    _rules = TRAINER_RULES["madpo"]
    _notices = (madpo_kl_notice,)


class MARLHFConfig(_MARLHFFields, _Checked):
    """MARLHF (one collection, reward model, RL) trainer options."""

    _rules = TRAINER_RULES["marlhf"]


class MADPOIterConfig(_MADPOIterFields, _Checked):
    """Iterative MADPO (rounds against a comparator, with replay) trainer options."""

    _rules = TRAINER_RULES["madpo_iter"]
    _notices = (madpo_kl_notice,)


class MARLHFIterConfig(_MARLHFIterFields, _Checked):
    """Iterative MARLHF trainer options."""

    _rules = TRAINER_RULES["marlhf_iter"]


class RunConfig(_RunFields, _Checked):
    """Run-level options: trainer, seed, where the run lives, task, agents, LoRA, devices, oracle limits."""

    _rules = tuple(RUN_RULES)


class MADPOJob(_MADPOFields, _RunFields, _Checked):
    """A MADPO job: run-level and trainer options side by side (YAML files, Prefect flow parameter)."""

    trainer: Literal["madpo"] = Field("madpo", description="Trainer: 'madpo'.")
    _rules = job_rules("madpo")
    _notices = (madpo_kl_notice,)


class MARLHFJob(_MARLHFFields, _RunFields, _Checked):
    """A MARLHF job: run-level and trainer options side by side."""

    trainer: Literal["marlhf"] = Field("marlhf", description="Trainer: 'marlhf'.")
    _rules = job_rules("marlhf")


class MADPOIterJob(_MADPOIterFields, _RunFields, _Checked):
    """An iterative MADPO job: run-level and trainer options side by side."""

    trainer: Literal["madpo_iter"] = Field("madpo_iter", description="Trainer: 'madpo_iter'.")
    _rules = job_rules("madpo_iter")
    _notices = (madpo_kl_notice,)


class MARLHFIterJob(_MARLHFIterFields, _RunFields, _Checked):
    """An iterative MARLHF job: run-level and trainer options side by side."""

    trainer: Literal["marlhf_iter"] = Field("marlhf_iter", description="Trainer: 'marlhf_iter'.")
    _rules = job_rules("marlhf_iter")


TrainerConfig = MADPOConfig | MARLHFConfig | MADPOIterConfig | MARLHFIterConfig
JobConfig = Annotated[MADPOJob | MARLHFJob | MADPOIterJob | MARLHFIterJob, Field(discriminator="trainer")]
job_adapter: TypeAdapter[Any] = TypeAdapter(JobConfig)

TRAINER_CONFIGS: dict[str, type] = {
    "madpo": MADPOConfig, "marlhf": MARLHFConfig, "madpo_iter": MADPOIterConfig, "marlhf_iter": MARLHFIterConfig,
}
JOB_CLASSES: dict[str, type] = {
    "madpo": MADPOJob, "marlhf": MARLHFJob, "madpo_iter": MADPOIterJob, "marlhf_iter": MARLHFIterJob,
}
RUN_FIELDS: frozenset[str] = frozenset(RunConfig.model_fields)
_ALL_FIELDS: frozenset[str] = frozenset().union(*(c.model_fields for c in JOB_CLASSES.values()))
_TRAINERS = ", ".join(JOB_CLASSES)
_HASH_EXCLUDED = frozenset({"run_name", "output_dir"})


def is_iterative(trainer: str) -> bool:
    """True for the round-based trainers ('madpo_iter', 'marlhf_iter'). Raises ConfigError for unknown names."""
    if trainer not in JOB_CLASSES:
        raise ConfigError([Problem("trainer", trainer, f"allowed: {_TRAINERS}")])
    return trainer.endswith("_iter")


def parse_job(data: Mapping[str, Any]) -> JobConfig:
    """Validate a flat mapping of options into the job model named by its ``trainer`` key.

    Raises:
        ConfigError: listing every problem at once: a missing/unknown ``trainer`` (alone, since it decides
            the options), unknown options (with a suggestion), type and range errors, and the cross-field
            rules of SPEC §2 — the rules are checked on the given values that passed type validation plus
            the trainer's defaults, and rules that read an invalid option are skipped.
    """
    return _parse_job(data, warn=True)


def _parse_job(data: Mapping[str, Any], *, warn: bool) -> Any:
    if not isinstance(data, Mapping):
        raise ConfigError([Problem("config", type(data).__name__, "must be a mapping of option: value")])
    trainer = data.get("trainer")
    if not isinstance(trainer, str) or trainer not in JOB_CLASSES:
        message = f"allowed: {_TRAINERS}" if "trainer" in data else f"missing; allowed: {_TRAINERS}"
        raise ConfigError([Problem("trainer", trainer, message)])
    return _parse(JOB_CLASSES[trainer], data, warn=warn)


def parse_config(cls: type[_Model], data: Mapping[str, Any]) -> _Model:
    """Validate ``data`` as ``cls`` (a trainer config, RunConfig or a job class).

    Raises:
        ConfigError: every problem at once (see :func:`collect_problems`).
    """
    return _parse(cls, data, warn=True)


def _parse(cls: type[_Model], data: Mapping[str, Any], *, warn: bool) -> _Model:
    problems = collect_problems(cls, data)
    if problems:
        raise ConfigError(problems)
    return cls.model_validate(dict(data), context={_MODE: "full" if warn else "quiet"})


def collect_problems(cls: type[BaseModel], data: Mapping[str, Any]) -> list[Problem]:
    """Every problem of ``data`` as options of ``cls`` (a config, RunConfig or job class).

    Pydantic's type/range errors (one per option), the rules of ``cls`` run on a best-effort set of values
    (the valid given ones plus defaults; a rule reading an invalid option is skipped, so one mistake gives
    one problem), and unknown options. Sorted by field order, unknown options last.
    """
    known = {k: v for k, v in data.items() if k in cls.model_fields}
    values, invalid, problems = _validate_fields(cls, known)
    problems += run_rules(cls._rules, values, invalid) + _unknown_problems(data, cls)
    order = {name: i for i, name in enumerate(cls.model_fields)}
    return sorted(problems, key=lambda p: order.get(p.field, len(order)))


def _unknown_problems(data: Mapping[str, Any], cls: type[BaseModel]) -> list[Problem]:
    problems = []
    jobs = {c: f"trainer '{t}'" for t, c in JOB_CLASSES.items()}
    for key, value in data.items():
        if key in cls.model_fields:
            continue
        owners = [t for t, c in TRAINER_CONFIGS.items() if key in c.model_fields]
        if key == _SECRET_KEY:
            problems.append(Problem(key, HIDDEN, SECRET_MESSAGE))
        elif key in RUN_FIELDS:
            problems.append(Problem(key, value, f"a run-level option (RunConfig), not an option of {cls.__name__}"))
        elif owners:
            problems.append(Problem(key, value, f"not an option of {jobs.get(cls, cls.__name__)}; it belongs to "
                                    "trainer(s) " + ", ".join(owners)))
        else:
            problems.append(Problem(str(key), value, "unknown option" + _suggest(str(key), cls.model_fields)))
    return problems


def _suggest(key: str, names: Iterable[str]) -> str:
    close = difflib.get_close_matches(key, sorted(names), n=3)
    return "; did you mean " + " or ".join(repr(c) for c in close) + "?" if close else ""


def _validate_fields(cls: type[BaseModel], known: dict[str, Any]) -> tuple[dict[str, Any], frozenset[str], list]:
    """(validated values with defaults for the invalid options, the invalid options, their problems)."""
    fields_only = {_MODE: "fields"}
    try:
        return dict(cls.model_validate(known, context=fields_only)), frozenset(), []
    except ValidationError as err:
        problems = field_problems(err, cls.model_fields, known)
    invalid = frozenset(p.field for p in problems)
    try:
        rest = {k: v for k, v in known.items() if k not in invalid}
        return dict(cls.model_validate(rest, context=fields_only)), invalid, problems
    except ValidationError:  # e.g. a required option is missing: no best-effort values, so no rule can run
        return {}, frozenset(cls.model_fields), problems


def parse_override(text: str) -> tuple[str, Any]:
    """Split a ``"key=value"`` override; the value is read with ``yaml.safe_load`` (``key=`` gives None).

    Raises:
        ConfigError: when there is no '=' or no key, or when the value is not valid YAML.
    """
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError([Problem("override", text, "must look like key=value (e.g. dpo_beta=0.2)")])
    try:
        return key, yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        raise ConfigError([Problem(key, raw, f"override value is not valid YAML ({_yaml_reason(exc)})")]) from None


def load_job(path: str | Path, overrides: Sequence[str] = ()) -> JobConfig:
    """Read a flat YAML job file, apply ``"key=value"`` overrides in order, and validate (see parse_job).

    Raises:
        ConfigError: naming the file when it cannot be read, is not valid YAML or is not a mapping; else
            every problem of the overrides and of the merged options at once.
    """
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError([Problem("config file", str(path), f"cannot be read ({exc.strerror or exc})")]) from None
    except yaml.YAMLError as exc:
        raise ConfigError([Problem("config file", str(path), f"is not valid YAML ({_yaml_reason(exc)})")]) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError([Problem("config file", str(path),
                                   f"must hold a mapping of option: value, not a {type(data).__name__}")])
    problems: list[Problem] = []
    for text in overrides:
        try:
            key, value = parse_override(text)
        except ConfigError as exc:
            problems += exc.problems
            continue
        if key in _ALL_FIELDS or key == _SECRET_KEY:
            data[key] = value
        else:
            problems.append(Problem(key, value, "unknown option in an override" + _suggest(key, _ALL_FIELDS)))
    try:
        job = parse_job(data)
    except ConfigError as exc:
        raise ConfigError(problems + exc.problems) from None
    if problems:
        raise ConfigError(problems)
    return job


def _yaml_reason(exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return where + str(getattr(exc, "problem", None) or exc)


def make_job(run: RunConfig | Mapping[str, Any], trainer: TrainerConfig) -> JobConfig:
    """Combine run-level options and a trainer config into the flat job model.

    Raises:
        ConfigError: when ``run`` names another trainer or holds non-run options, or when the combination
            breaks a rule that joins run and trainer options (e.g. ``len(agents) != num_agents``).
    """
    names = {cls: name for name, cls in TRAINER_CONFIGS.items()}
    if type(trainer) not in names:
        raise ConfigError([Problem("trainer", type(trainer).__name__, "must be one of the trainer configs: "
                                   + ", ".join(c.__name__ for c in names))])
    name = names[type(trainer)]
    run_values = dict(run)
    problems = [Problem(k, v, "not a run-level option; set it on the trainer config")
                for k, v in run_values.items() if k not in RUN_FIELDS]
    if run_values.get("trainer", name) != name:
        problems.append(Problem("trainer", run_values["trainer"],
                                f"does not match the trainer config {type(trainer).__name__} ('{name}')"))
    if problems:
        raise ConfigError(problems)
    return _parse_job({**run_values, **dict(trainer), "trainer": name}, warn=False)


def split_job(job: Any) -> tuple[RunConfig, TrainerConfig]:
    """The run-level options and the trainer config of a flat job (inverse of make_job)."""
    trainer_cls = TRAINER_CONFIGS[job.trainer]
    quiet = {_MODE: "quiet"}
    run = RunConfig.model_validate({k: getattr(job, k) for k in RUN_FIELDS}, context=quiet)
    trainer = trainer_cls.model_validate({k: getattr(job, k) for k in trainer_cls.model_fields}, context=quiet)
    return run, trainer


def config_hash(job: BaseModel) -> str:
    """sha256 hex of the canonical JSON (sorted keys) of ``job.model_dump(mode="json")``.

    ``run_name`` and ``output_dir`` are left out: where a run lives must not change its cache keys.
    """
    data = {k: v for k, v in job.model_dump(mode="json").items() if k not in _HASH_EXCLUDED}
    text = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()
