"""The cross-field rules of the judge options (:mod:`pbrl.config.judge_fields`, docs/guides/judges.md): a judge where
preferences come from a judge and only there, the options of the judge that is used and no other's, orderings
that a judge can serve, and no credential in the API judge's options."""

from __future__ import annotations

from pbrl.config.credentials import (
    body_credential_problems,
    header_credential_problems,
    key_prefix_problems,
    safe_url,
    url_credential_problems,
)
from pbrl.config.judge_fields import BUILT_IN_JUDGES, HUMAN_JUDGE, IN_PROCESS_JUDGE, _JudgeFields
from pbrl.config.rules import CENTRALIZED, ENV_NAME_PATTERN, HIDDEN, Rule, Values, import_path_problems, only_with, rule
from pbrl.errors import Problem

JUDGE_RULES: list[Rule] = []
# Orderings that need a score per joint response: a judge gives preferences between two, never scores.
SCORE_ORDERINGS = ("reward_gap", "comparator_reward")
_SIMULATOR_FIELDS = {"judge_label_noise": 0.0, "judge_bt_temperature": None}
_API_FIELDS = ("judge_api_url", "judge_api_key_env", "judge_api_max_tokens_per_round")
_LABEL_FIELDS = {"judge_label_batch_size": 5, "judge_label_timeout_hours": None, "judge_label_timeout_policy": "fail"}


@rule(JUDGE_RULES, "preference_source", "judge")
def _judge_with_its_source(v: Values) -> list[Problem]:
    if v["preference_source"] == "judge" and v["judge"] is None:
        return [Problem("judge", None, f"required with preference_source='judge': {', '.join(BUILT_IN_JUDGES)} or "
                        "a Python judge 'pkg.module:function'")]  # fmt: skip
    if v["preference_source"] == "reward" and v["judge"] is not None:
        return [only_with("judge", v["judge"], "preference_source='judge'")]
    return []


@rule(JUDGE_RULES, "judge")
def _judge_name(v: Values) -> list[Problem]:
    judge = v["judge"]
    if judge is None or judge in BUILT_IN_JUDGES or judge == IN_PROCESS_JUDGE:
        return []
    if ":" not in judge:
        allowed = f"allowed: {', '.join(BUILT_IN_JUDGES)}, or an import path 'pkg.module:function'"
        return [Problem("judge", judge, allowed)]
    return import_path_problems("judge", judge)


@rule(JUDGE_RULES, "judge", "judge_label_noise", "judge_bt_temperature")
def _simulator_options(v: Values) -> list[Problem]:
    used = {f: v[f] for f, default in _SIMULATOR_FIELDS.items() if v[f] != default}
    if v["judge"] != "reward_noisy":
        return [only_with(f, value, "judge='reward_noisy'") for f, value in used.items()]
    if len(used) == 2:
        return [Problem("judge_bt_temperature", v["judge_bt_temperature"],
                        "give judge_label_noise (flipped labels) or judge_bt_temperature (Bradley–Terry labels), not "
                        "both")]  # fmt: skip
    return []


@rule(JUDGE_RULES, "judge", "judge_model", "judge_prompt_template", "judge_api_url", "judge_api_key_env",
      "judge_api_max_tokens_per_round")  # fmt: skip
def _judge_kind_options(v: Values) -> list[Problem]:
    judge = v["judge"]
    api_only = [f for f in _API_FIELDS if v[f] is not None and judge != "api"]
    problems = [only_with(f, _shown(f, v[f]), "judge='api'") for f in api_only]
    if judge not in ("api", "local"):
        problems += [only_with(f, v[f], "judge='api' or 'local'") for f in ("judge_model", "judge_prompt_template")
                     if v[f] is not None]  # fmt: skip
    if judge == "api" and v["judge_api_url"] is None:
        problems.append(Problem("judge_api_url", None, "required with judge='api'"))
    if judge == "local" and v["judge_model"] is None:
        problems.append(Problem("judge_model", None, "required with judge='local' (a model folder or packaged alias)"))
    return problems


# The judge options' defaults, read from their fields: an option set to anything else where its judge is not used
# (or no judge is) is refused, since it would have no effect.
_DEFAULTS = {name: field.default for name, field in _JudgeFields.model_fields.items()}
# Every judge_api_* option but those _judge_kind_options checks (they have no default to compare with).
_API_ONLY = [f for f in _DEFAULTS if f.startswith("judge_api_") and f not in _API_FIELDS]
_API_HIDDEN = ("judge_api_headers", "judge_api_extra_body", "judge_api_key_prefix")  # may hold a credential
_ANY_JUDGE = ("judge_max_pairs", "judge_pair_choice", "judge_swap_disagreement", "judge_tie_margin")  # of every judge


@rule(JUDGE_RULES, "judge", *_API_ONLY, "judge_batch_size", "judge_timeout", *_ANY_JUDGE, "judge_position_swap")
def _options_of_another_judge(v: Values) -> list[Problem]:
    judge = v["judge"]
    changed = [f for f in v if f in _DEFAULTS and v[f] != _DEFAULTS[f]]
    problems = [_unused(f, HIDDEN if f in _API_HIDDEN else v[f], "judge='api'")
                for f in changed if f in _API_ONLY and judge != "api"]  # fmt: skip
    if judge != "local" and "judge_batch_size" in changed:
        problems.append(_unused("judge_batch_size", v["judge_batch_size"], "judge='local'"))
    if (judge is None or judge in BUILT_IN_JUDGES) and "judge_timeout" in changed:
        problems.append(_unused("judge_timeout", v["judge_timeout"], "a Python judge (judge='pkg.module:function')"))
    if judge is None:
        problems += [_unused(f, v[f], "a judge (preference_source='judge')") for f in _ANY_JUDGE if f in changed]
        if v["judge_position_swap"]:
            problems.append(_unused("judge_position_swap", True, "a judge (preference_source='judge')"))
    return problems


def _unused(field: str, value: object, condition: str) -> Problem:
    return Problem(field, value, f"allowed only with {condition}; leave it out (it would have no effect)")


def _shown(field: str, value: object) -> object:
    if field == "judge_api_key_env":
        return HIDDEN
    return safe_url(str(value)) if field == "judge_api_url" else value


@rule(JUDGE_RULES, "judge", *_LABEL_FIELDS, "judge_position_swap")
def _labelling_options(v: Values) -> list[Problem]:
    human = v["judge"] == HUMAN_JUDGE
    problems = [Problem(f, v[f], "allowed only with judge='human' (people label the pairs); leave it out")
                for f, default in _LABEL_FIELDS.items() if not human and v[f] != default]  # fmt: skip
    if human and v["judge_position_swap"]:
        why = "a person labels each pair once, in an order drawn per pair and recorded; leave it unset (or false)"
        problems.append(Problem("judge_position_swap", True, why))
    if human and v["judge_label_timeout_policy"] != "fail" and v["judge_label_timeout_hours"] is None:
        problems.append(Problem("judge_label_timeout_policy", v["judge_label_timeout_policy"],
                                "applies after judge_label_timeout_hours; set that too"))  # fmt: skip
    return problems


@rule(JUDGE_RULES, "judge_pair_choice", "judge_max_pairs")
def _pair_choice_with_a_budget(v: Values) -> list[Problem]:
    if v["judge_pair_choice"] != "random" and v["judge_max_pairs"] is None:
        return [Problem("judge_pair_choice", v["judge_pair_choice"], "chooses which pairs fit the label budget; set "
                        "judge_max_pairs (every pair is asked without one)")]  # fmt: skip
    return []


@rule(JUDGE_RULES, "preference_source", "pair_selection")
def _orderings_a_judge_serves(v: Values) -> list[Problem]:
    if v["preference_source"] != "judge" or v["pair_selection"] not in SCORE_ORDERINGS:
        return []
    return [Problem("pair_selection", v["pair_selection"],
                    "orders pairs by their scores, and a judge gives no scores; with preference_source='judge' use "
                    "random, all or counterfactual (joint_mode='cross')")]  # fmt: skip


@rule(JUDGE_RULES, "preference_source", "collaboration_mode")
def _decentralized(v: Values) -> list[Problem]:
    if v["preference_source"] == "judge" and v["collaboration_mode"] == CENTRALIZED:
        return [Problem("collaboration_mode", CENTRALIZED,
                        "a judge compares the agents' texts role by role; preference_source='judge' needs "
                        "collaboration_mode='decentralized'")]  # fmt: skip
    return []


@rule(JUDGE_RULES, "judge_api_url")
def _judge_api_url(v: Values) -> list[Problem]:
    url = v["judge_api_url"]
    if url is None:
        return []
    scheme = [] if url.startswith(("http://", "https://")) else [
        Problem("judge_api_url", safe_url(url), "must be an http:// or https:// URL")
    ]  # fmt: skip
    return scheme + url_credential_problems(url, "judge_api_url")


@rule(JUDGE_RULES, "judge_api_key_env")
def _judge_api_key_env(v: Values) -> list[Problem]:
    name = v["judge_api_key_env"]
    if name is None or ENV_NAME_PATTERN.match(name):
        return []
    return [Problem("judge_api_key_env", HIDDEN, "must be the NAME of an environment variable (letters, digits and "
                    "'_', e.g. OPENAI_API_KEY), not the key itself")]  # fmt: skip


@rule(JUDGE_RULES, "judge_api_headers", "judge_api_extra_body", "judge_api_key_prefix")
def _judge_api_credentials(v: Values) -> list[Problem]:
    return (
        header_credential_problems(v["judge_api_headers"] or {}, "judge_api_headers")
        + body_credential_problems(v["judge_api_extra_body"] or {}, "judge_api_extra_body")
        + key_prefix_problems(v["judge_api_key_prefix"], "judge_api_key_prefix")
    )


# --------------------------------------------------------------------------- MARLHF-iterative only
JUDGE_ITER_RULES: list[Rule] = []


@rule(JUDGE_ITER_RULES, "preference_source", "preference_scoring_reward")
def _scores_or_judge(v: Values) -> list[Problem]:
    if v["preference_source"] == "judge" and v["preference_scoring_reward"] == "reward_model":
        return [Problem("preference_scoring_reward", "reward_model",
                        "scores new comparisons, and with preference_source='judge' the judge compares them; use "
                        "'task'")]  # fmt: skip
    return []
