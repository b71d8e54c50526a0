"""The Prefect UI form of a trainer (:mod:`flows.ui` serves it): where each option goes, and the JSON schema of each
parameter, so that a person reads the form in one screen.

Both of Prefect's UIs (V2 and the earlier V1) render a deployment's run form from the flow's parameter schema, one
field per top-level parameter, an object with properties as a group of fields, an ``anyOf`` as tabs. A trainer's
form (:func:`form_schema`) is

* first, the options every run needs, marked required: ``task`` and ``agent_model`` (the registered tasks and the
  packaged models as choices, another value typed in a second tab), ``num_iterations`` (iterative trainers) and
  the trainer's main options, the last prefilled with their defaults (the deployment's parameters);
* then one parameter per section of :data:`SECTIONS`, its description listing every default, each two tabs:
  ``defaults`` (nothing to fill in), selected, and ``change`` (the section's options as fields). The API
  comparator's options are a section of their own.

Only options that have an effect for the trainer are in its form: :func:`hidden_options` lists the others and why
(an option that must keep its one value, or that pbrl accepts for reference configs and ignores). Every field
is typed, ranged and described from :mod:`pbrl.config.fields`; nothing is copied here but where an option goes.
"""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import Field, WithJsonSchema

from pbrl.config import JOB_CLASSES, is_marlhf
from pbrl.models.packaged import PACKAGED_MODELS
from pbrl.tasks.registry import task_names

# The options every run of a trainer needs, first in its form and required (those a trainer lacks are skipped).
MAIN = tuple(
    "task agent_model num_iterations preference_num_candidates max_new_tokens num_train_epochs agent_learning_rate "
    "dpo_beta rl_algorithm".split()
)


@dataclass(frozen=True)
class Section:
    """One group of a form: a parameter named ``name`` whose ``change`` tab holds ``options`` (those the trainer has
    and does not hide); ``about`` is the first sentence of its description."""

    name: str
    about: str
    options: tuple[str, ...]

    @classmethod
    def of(cls, name: str, about: str, options: str) -> Section:
        """A section whose options are named in one space-separated string."""
        return cls(name, about, tuple(options.split()))


SECTIONS: tuple[Section, ...] = (
    Section.of(
        "run",
        "Seed, the task's options, where the run folder lives (<output_dir>/<Run Name>) and where stages run.",
        "seed task_options max_train_items output_dir runner ray_address shard_size",
    ),
    Section.of(
        "own_items",
        "Your own items, prompts or reward instead of the task's, and how reward failures count.",
        "train_dataset eval_dataset formatters reward_func reward_processor reward_timeout oracle_max_failure_share",
    ),
    Section.of(
        "agents",
        "Number of agents, LoRA, and one actor writing every role.",
        "num_agents lora_r lora_alpha lora_dropout lora_target_modules collaboration_mode "
        "comparator_centralized_adapter",
    ),
    Section.of(
        "devices",
        "Devices, memory and precision.",
        "agent_devices parallel_training max_memory torch_dtype mixed_precision gradient_checkpointing "
        "gradient_accumulation_steps generation_batch_size num_threads",
    ),
    Section.of(
        "collection",
        "Sampling, how candidates form joint responses, and which pairs are kept.",
        "temperature top_p top_k joint_mode max_joint_responses_per_item pair_selection preference_pairs_per_sample "
        "tie_tolerance preference_scoring_reward",
    ),
    Section.of(
        "judge",
        "Where preferences come from: the task's reward, or a judge (a model, a Python function, or people who label "
        "the pairs in this UI: judge 'human'), and which pairs it is asked.",
        "preference_source judge judge_label_noise judge_bt_temperature judge_position_swap judge_swap_disagreement "
        "judge_tie_margin judge_timeout judge_max_pairs judge_pair_choice judge_label_batch_size "
        "judge_label_timeout_hours judge_label_timeout_policy judge_model judge_prompt_template judge_batch_size "
        "judge_api_format judge_api_url "
        "judge_api_key_env judge_api_key_header judge_api_key_prefix judge_api_headers judge_api_extra_body "
        "judge_api_response_field judge_api_max_tokens judge_api_timeout judge_api_max_concurrency "
        "judge_api_max_tokens_per_round",
    ),
    Section.of(
        "comparator",
        "What the agents are compared with in each round.",
        "comparator_policy comparator_history_k comparator_model_name comparator_agents comparator_devices "
        "comparator_num_candidates comparator_generation_mode comparator_centralized_agent_index",
    ),
    Section.of(
        "api_comparator",
        "The remote model of comparator_policy 'api' (OpenAI, Anthropic or generic HTTP); unused otherwise.",
        "comparator_api_format comparator_api_url comparator_api_model comparator_api_key_env "
        "comparator_api_key_header comparator_api_key_prefix comparator_api_headers comparator_api_extra_body "
        "comparator_api_max_n_per_request comparator_api_response_field comparator_api_timeout "
        "comparator_api_max_concurrency",
    ),
    Section.of(
        "replay",
        "Which stored rounds' pairs train each round.",
        "preference_replay_mode preference_replay_k preference_replay_lambda preference_replay_sample_size "
        "preference_replay_dir",
    ),
    Section.of(
        "training",
        "Update steps, clipping, the metrics' logging, experiment trackers and checkpoint export.",
        "train_batch_size max_grad_norm logging_steps report_to use_environment_step environment_steps_per_pair "
        "log_reward_distribution policy_checkpoint_dir",
    ),
    Section.of(
        "reward_model",
        "The joint reward model fitted from the pairs.",
        "reward_model_name reward_model_device reward_learning_rate reward_num_train_epochs reward_train_batch_size "
        "reward_max_length reward_freeze_backbone reward_pooling reward_backbone_layers reward_head_components "
        "reward_prompt_overlap reward_length_products reward_joint_overlap",
    ),
    Section.of(
        "rl",
        "RL against the learned reward: samples, advantages, the reference KL and critics.",
        "num_generations advantage_normalization reference_kl_enabled reference_kl_coef reference_devices "
        "critic_model_name critic_learning_rate critic_devices critic_type use_separate_critic "
        "critic_value_head_hidden_dim value_loss_coef value_clip_range value_head_hidden_dim",
    ),
    Section.of(
        "evaluation",
        "Held-out evaluation.",
        "eval_interval eval_num_samples eval_samples_per_item eval_batch_size",
    ),
)
# Where an option that no section names goes (one added since this table was written;
# tests/unit/flows/test_serve.py names it).
OTHER = Section("other", "More options.", ())
SECTION_NAMES = frozenset(s.name for s in (*SECTIONS, OTHER))

# Options no form shows, and why: they cannot change, change nothing in pbrl, or have a form of their own.
_SINGLE_TURN = "no effect: pbrl trains single-turn joint responses"
HIDDEN_ALWAYS: dict[str, str] = {
    "trainer": "the form's deployment is the trainer",
    "run_name": "the flow run's Run Name names the run folder",
    "agents": "one model per agent: use pbrl-train/config-file (agent_model is the form's model for all agents)",
    "num_turns": "must be 1",
    "discount": _SINGLE_TURN,
    "early_termination_threshold": _SINGLE_TURN,
    "external_prompt_passthrough": _SINGLE_TURN,
    "advantage_mode": "follows rl_algorithm, as in the reference; no stage reads it",
    "rollout_buffer_size": "only the default of train_batch_size (set that)",
}
HIDDEN_MADPO: dict[str, str] = {
    "advantage_normalization": "no effect: MADPO learns from pairs, without advantages",
    "reference_kl_enabled": "no effect: MADPO is reference-free in pbrl",
    "reference_kl_coef": "no effect: MADPO is reference-free in pbrl",
    "reference_devices": "no effect: MADPO loads no reference model",
}
HIDDEN_MARLHF: dict[str, str] = {
    "dpo_beta": "no effect: only MADPO's loss uses it",
    "collaboration_mode": "must be 'decentralized' with the MARLHF trainers",
}
TASK_NOTE = (
    "The task: its items, the agents' prompts and the reward. Your own items, prompts or reward replace the "
    "task's in the own_items section (a run without any registered task starts from pbrl-train/config-file)."
)
_PLACEHOLDER = re.compile(r"<(/?[A-Za-z_][^<>]*)>")  # <trainer>, <i>, </agent_1>: not HTML to a markdown renderer


def hidden_options(trainer: str) -> dict[str, str]:
    """The options of ``trainer`` that its form does not show, each with the reason.

    Raises:
        KeyError: for an unknown trainer.
    """
    model = JOB_CLASSES[trainer]
    hidden = {**HIDDEN_ALWAYS, **(HIDDEN_MARLHF if is_marlhf(trainer) else HIDDEN_MADPO)}
    if trainer == "marlhf":  # no comparator, and no centralized collaboration: nothing reads the adapter
        hidden["comparator_centralized_adapter"] = "no effect: marlhf has no comparator and no centralized actor"
    for name, schema in model.model_json_schema()["properties"].items():
        if one_value(schema) and name not in hidden:
            hidden[name] = f"has one value ({schema['enum'][0]!r})"
    return {name: why for name, why in hidden.items() if name in model.model_fields}


def one_value(schema: Mapping[str, Any]) -> bool:
    """Whether an option's JSON schema allows one value only (a ``Literal`` of one choice): nothing to choose."""
    return "anyOf" not in schema and len(schema.get("enum", ())) == 1


def form_layout(trainer: str) -> dict[str, tuple[str, ...]]:
    """Where each shown option of ``trainer`` goes: ``{"main": (...), <section>: (...), ...}`` in form order;
    sections the trainer has no option of are left out, options no section names go to ``other`` (last). Every
    option of the trainer's job model is either here, once, or in :func:`hidden_options`.

    Raises:
        KeyError: for an unknown trainer.
    """
    fields = JOB_CLASSES[trainer].model_fields
    hidden = hidden_options(trainer)
    shown = [n for n in fields if n not in hidden]
    layout = {"main": tuple(n for n in MAIN if n in shown)}
    for section in SECTIONS:
        options = tuple(n for n in section.options if n in shown)
        if options:
            layout[section.name] = options
    placed = {n for options in layout.values() for n in options}
    other = tuple(n for n in shown if n not in placed)
    if other:
        layout[OTHER.name] = other
    return layout


# ------------------------------------------------------------------------------------------------- the schema
def _plain(text: str | None) -> str | None:
    """A description as both UIs show it: ``<trainer>`` would vanish as an HTML tag where descriptions are
    markdown, so placeholders get angle quotes (``‹trainer›``)."""
    return None if text is None else _PLACEHOLDER.sub(r"‹\1›", text)


def _resolve(schema: Any, defs: Mapping[str, Any]) -> Any:
    """``schema`` with every ``$ref`` to ``defs`` inlined (a form field is one self-contained schema)."""
    if isinstance(schema, dict):
        if "$ref" in schema:
            target = defs[schema["$ref"].rsplit("/", 1)[-1]]
            return _resolve({**target, **{k: v for k, v in schema.items() if k != "$ref"}}, defs)
        return {k: _resolve(v, defs) for k, v in schema.items()}
    if isinstance(schema, list):
        return [_resolve(v, defs) for v in schema]
    return schema


def _field(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    """One option as a form field, titled with its name. An option whose default is None loses the ``None`` choice
    and its null default (an empty field is the default; the UI would show a 'Property is type "None"' tab for
    it); an option with another default keeps ``None`` as a choice where the option takes it (top_k: no cut). The
    fields of a nested model (a dataset spec) are made the same way."""
    out = {k: v for k, v in schema.items() if k != "title"}
    if "default" in out and out["default"] is None:
        del out["default"]
        if "anyOf" in out:
            rest = [b for b in out.pop("anyOf") if b.get("type") != "null"]
            out = {**rest[0], **out} if len(rest) == 1 else {**out, "anyOf": rest}
    if "anyOf" in out:
        out["anyOf"] = [_nested(b) for b in out["anyOf"]]
    if "description" in out:
        out["description"] = _plain(out["description"])
    return {"title": name, **_nested(out)}


def _nested(schema: dict[str, Any]) -> dict[str, Any]:
    if schema.get("type") == "object" and "properties" in schema:
        return {**schema, "properties": {k: _field(k, v) for k, v in schema["properties"].items()}}
    return schema


def _choices(name: str, schema: dict[str, Any], names: list[str], chosen: str, other: str, about: str) -> dict:
    """``name`` as two tabs: a drop-down of ``names`` and a free text (both valid to the server)."""
    text = {k: v for k, v in schema.items() if k not in ("default", "anyOf", "description", "title")}
    return {
        "title": name,
        "description": _plain(about or schema.get("description")),
        "anyOf": [
            {"type": "string", "enum": names, "title": chosen},
            {"type": "string", "minLength": 1, "title": other, **text},
        ],
    }


def _shown(value: Any) -> str:
    return json.dumps(value) if isinstance(value, dict | list) else str(value)


def _section_schema(
    section: Section, options: tuple[str, ...], fields: Mapping[str, dict[str, Any]], defaults: dict
) -> dict:
    """A section as two tabs, ``defaults`` (selected) and ``change`` (the fields), under a description that names
    what the section holds and lists every default (both UIs show a section's description; V1 shows no tab's).

    ``defaults`` takes only ``{}``: an object with no properties and no others allowed. (Not ``"const": {}``: the V1
    UI shows a const as "… is a const and cannot be changed" and offers no other tab; and not an object without
    ``properties``, which V1 turns into a JSON editor without tabs. Both UIs open the first object tab for ``{}``.)
    """
    set_ = [f"{n} {_shown(defaults[n])}" for n in options if defaults[n] is not None]
    empty = "the others empty" if len(set_) < len(options) else ""
    text = "; ".join(t for t in (", ".join(set_), empty) if t)
    return {
        "description": _plain(f"{section.about} At the defaults: {text}."),
        "anyOf": [
            {"type": "object", "properties": {}, "additionalProperties": False, "title": "defaults"},
            {
                "type": "object",
                "title": "change",
                "properties": {n: {**fields[n], "position": i} for i, n in enumerate(options)},
            },
        ],
    }


def form_schema(trainer: str) -> dict[str, dict[str, Any]]:
    """The JSON schema of each parameter of ``trainer``'s form, in form order: the main options (``task`` and
    ``agent_model`` with their choices), then one per section (:func:`form_layout`).

    Raises:
        KeyError: for an unknown trainer.
    """
    model = JOB_CLASSES[trainer]
    raw = model.model_json_schema()
    fields = {n: _field(n, _resolve(s, raw.get("$defs", {}))) for n, s in raw["properties"].items()}
    defaults = {n: info.get_default(call_default_factory=True) for n, info in model.model_fields.items()}
    layout = form_layout(trainer)
    schema: dict[str, dict[str, Any]] = {}
    for name in layout["main"]:
        if name == "task":
            schema[name] = _choices(name, fields[name], task_names(), "registered", "other", TASK_NOTE)
        elif name == "agent_model":
            schema[name] = _choices(name, fields[name], sorted(PACKAGED_MODELS), "packaged", "folder or hub id", "")
        else:
            schema[name] = {k: v for k, v in fields[name].items() if k != "default"}  # required; prefilled
    for section in (*SECTIONS, OTHER):
        if section.name in layout:
            schema[section.name] = _section_schema(section, layout[section.name], fields, defaults)
    return schema


def form_defaults(trainer: str) -> dict[str, Any]:
    """The values a new form shows (the deployment's parameters): each required main option that has a default."""
    model = JOB_CLASSES[trainer]
    return {
        n: model.model_fields[n].get_default(call_default_factory=True)
        for n in form_layout(trainer)["main"]
        if not model.model_fields[n].is_required() and model.model_fields[n].get_default() is not None
    }


def form_signature(trainer: str) -> inspect.Signature:
    """The signature of ``trainer``'s flow: one keyword parameter per entry of :func:`form_schema`, the main
    options required (no default), the sections defaulting to ``{}``. Prefect builds the parameter schema from it.

    Raises:
        KeyError: for an unknown trainer.
    """
    params = []
    for name, schema in form_schema(trainer).items():
        info: dict[str, Any] = {"description": schema.get("description")}
        body = {k: v for k, v in schema.items() if k != "description"}
        if name in SECTION_NAMES:
            info["default"] = {}
            annotation: Any = Annotated[dict[str, Any], WithJsonSchema(body)]
        else:
            annotation = Annotated[Any, WithJsonSchema(body)]
        params.append(
            inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=Field(**info), annotation=annotation)
        )
    return inspect.Signature(params, return_annotation=dict[str, Any])
