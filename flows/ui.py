"""Training flows for runs started from the Prefect UI (docs/guides/prefect-ui.md#serve-the-deployments): a typed form
per trainer, and a config file.

The Prefect UI renders a deployment's parameters from the flow's JSON schema, one field per top-level
parameter: a string, number or boolean as an input, an ``enum`` (``Literal``) as a drop-down, a nullable
option (``anyOf [..., null]``) as tabs ``int | None``, an object with properties as a card, an object
without properties as a JSON editor. A parameter that is a discriminated union of the four job models
(``pbrl-train/train``) renders as one JSON editor only. So each trainer gets a flow whose parameters are
that trainer's options themselves, generated from its job model (:data:`pbrl.config.JOB_CLASSES`): type,
range, default and description come from :mod:`pbrl.config.fields`, nothing is copied here. Only the
group of an option (its place in the form) is decided here, by :data:`GROUPS`.

Both kinds of flow validate what they are given exactly as the CLI does (:func:`pbrl.config.parse_job`,
:func:`pbrl.config.load_job`, then the preflight of :func:`pbrl.run.folder.prepare_run`), and then run the same
body as ``pbrl train`` (:func:`flows.training.run_training`).
"""

from __future__ import annotations

import inspect
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Annotated, Any

from prefect import Flow, flow
from prefect.runtime import flow_run
from pydantic import Field
from pydantic.fields import FieldInfo

from flows.training import run_training
from pbrl.config import JOB_CLASSES, load_job, parse_job
from pbrl.run.folder import generated_run_name

# The form's sections, in display order. An option belongs to the first group naming it exactly, else to
# the first group with a matching pattern; an option no group claims still appears, under "other".
GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "run",
        (
            "seed",
            "run_name",
            "output_dir",
            "task",
            "task_options",
            "train_dataset",
            "eval_dataset",
            "formatters",
            "max_train_items",
            "reward_func",
            "reward_processor",
            "policy_checkpoint_dir",
            "runner",
            "ray_address",
            "shard_size",
        ),
    ),
    (
        "agents",
        (
            "num_agents",
            "agent_model",
            "agents",
            "agent_devices",
            "max_memory",
            "lora_*",
            "torch_dtype",
            "mixed_precision",
            "parallel_training",
            "collaboration_mode",
            "joint_mode",
            "num_turns",
        ),
    ),
    (
        "collection",
        (
            "preference_num_candidates",
            "pair_selection",
            "preference_pairs_per_sample",
            "preference_scoring_reward",
            "max_new_tokens",
            "temperature",
            "top_p",
            "top_k",
            "generation_batch_size",
            "tie_tolerance",
            "oracle_max_failure_share",
        ),
    ),
    ("comparator", ("comparator_*",)),
    ("replay", ("preference_replay_*",)),
    (
        "training",
        (
            "num_iterations",
            "num_train_epochs",
            "dpo_beta",
            "agent_learning_rate",
            "train_batch_size",
            "rollout_buffer_size",
            "gradient_*",
            "max_grad_norm",
            "logging_steps",
            "use_environment_step",
            "environment_steps_per_pair",
            "log_reward_distribution",
            "discount",
            "early_termination_threshold",
            "external_prompt_passthrough",
        ),
    ),
    (
        "reward model and RL",
        (
            "reward_*",
            "rl_algorithm",
            "num_generations",
            "critic_*",
            "value_*",
            "use_separate_critic",
            "advantage_*",
            "reference_*",
        ),
    ),
    ("evaluation", ("eval_*",)),
)
OTHER = "other"
# The flow's own parameters (not config options), shown in the run section.
RESUME_DESCRIPTION = (
    "Continue the run named run_name from its last complete stage (completed stages come back "
    "Cached) instead of starting a new run."
)
CONFIGS_DIR = Path(__file__).resolve().parent / "configs"
DEPLOYMENT_NAMES = {"madpo": "madpo", "madpo_iter": "madpo-iter", "marlhf": "marlhf", "marlhf_iter": "marlhf-iter"}


def group_of(name: str) -> str:
    """The form section of option ``name`` (see :data:`GROUPS`)."""
    for group, names in GROUPS:
        if name in names:
            return group
    for group, names in GROUPS:
        if any(fnmatchcase(name, pattern) for pattern in names if "*" in pattern):
            return group
    return OTHER


def _parameter(name: str, info: FieldInfo, group: str) -> inspect.Parameter:
    """One option as a keyword parameter: its type with its constraints, and as default a ``Field`` carrying
    the option's default and description; the title (the field's label in the UI) names its group."""
    annotation = Annotated[(info.annotation, *info.metadata)] if info.metadata else info.annotation
    default = Field(
        info.get_default(call_default_factory=True),
        description=info.description,
        json_schema_extra={"title": f"{group}: {name}"},
    )
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation)


def form_signature(trainer: str) -> inspect.Signature:
    """The signature of the per-trainer flow: every option of the trainer's job model except ``trainer``,
    grouped (:data:`GROUPS`, options keep the model's order within a group), with ``resume`` after the
    run section. Prefect builds the deployment's parameter schema from it.

    Raises:
        KeyError: for an unknown trainer.
    """
    fields = [(n, f) for n, f in JOB_CLASSES[trainer].model_fields.items() if n != "trainer"]
    order = {group: i for i, (group, _) in enumerate(GROUPS)}
    fields.sort(key=lambda item: order.get(group_of(item[0]), len(order)))
    params = [_parameter(name, info, group_of(name)) for name, info in fields]
    resume = inspect.Parameter(
        "resume",
        inspect.Parameter.KEYWORD_ONLY,
        annotation=bool,
        default=Field(False, description=RESUME_DESCRIPTION, json_schema_extra={"title": "run: resume"}),
    )
    after_run = sum(1 for name, _ in fields if group_of(name) == "run")
    params.insert(after_run, resume)
    return inspect.Signature(params, return_annotation=dict[str, Any])


def _named(trainer: str):
    def run_name() -> str:

        return flow_run.parameters.get("run_name") or generated_run_name(trainer)

    return run_name


def trainer_flow(trainer: str) -> Flow[..., dict[str, Any]]:
    """The flow ``pbrl-train`` whose parameters are the options of ``trainer`` (see :func:`form_signature`).

    The options are validated like a YAML file's (:func:`pbrl.config.parse_job`: every problem at once,
    as a ConfigError); a run without ``run_name`` is named after its flow run (``<trainer>-<UTC time>``).
    Prefect's own parameter validation is off: the server already checked the JSON schema, and pbrl's
    validation gives pbrl's messages.
    """

    def run(**options: Any) -> dict[str, Any]:

        resume = options.pop("resume", False)
        options["run_name"] = options.get("run_name") or flow_run.name or None
        job = parse_job({"trainer": trainer, **options})
        return run_training(job, resume=resume)

    run.__name__ = run.__qualname__ = trainer  # the deployment's entrypoint is flows/ui.py:<trainer>
    run.__module__ = __name__
    run.__doc__ = (
        f"Train with trainer {trainer!r} from a form of its options (grouped: " + ", ".join(g for g, _ in GROUPS) + ")."
    )
    run.__signature__ = form_signature(trainer)  # type: ignore[attr-defined]
    return flow(run, name="pbrl-train", flow_run_name=_named(trainer), log_prints=True, validate_parameters=False)


madpo = trainer_flow("madpo")
madpo_iter = trainer_flow("madpo_iter")
marlhf = trainer_flow("marlhf")
marlhf_iter = trainer_flow("marlhf_iter")
TRAINER_FLOWS: dict[str, Flow[..., dict[str, Any]]] = {
    "madpo": madpo,
    "madpo_iter": madpo_iter,
    "marlhf": marlhf,
    "marlhf_iter": marlhf_iter,
}


def config_path(config: str) -> Path:
    """Where the config-file flow reads ``config``: the path as given (relative to the working folder of
    ``pbrl serve``, as ``pbrl train`` would read it), else relative to the pbrl checkout (so that
    ``flows/configs/tiny-madpo.yaml`` works wherever ``pbrl serve`` runs). A path found in neither is
    returned as given, for :func:`pbrl.config.load_job` to report."""
    given = Path(config).expanduser()
    if given.is_file() or given.is_absolute():
        return given
    in_checkout = CONFIGS_DIR.parent.parent / given
    return in_checkout if in_checkout.is_file() else given


def _file_run_name() -> str:

    return flow_run.parameters.get("run_name") or Path(str(flow_run.parameters.get("config", "run"))).stem


def _shipped_configs() -> str:
    return ", ".join(f"flows/configs/{p.name}" for p in sorted(CONFIGS_DIR.glob("*.yaml")))


@flow(name="pbrl-train", flow_run_name=_file_run_name, log_prints=True)
def config_file(
    config: str = Field(
        description="Path of a YAML config as the worker sees it (relative paths from the folder "
        "where `pbrl serve` runs, else from the pbrl checkout); shipped: " + _shipped_configs()
    ),
    overrides: list[str] = Field(
        [],
        description="Overrides key=value, applied in order, as "
        "`pbrl train CONFIG --set key=value` (e.g. num_iterations=3).",
    ),
    run_name: str | None = Field(
        None,
        description="Run folder name; None = the config's run_name, else the config "
        "file's name (as `pbrl train --run-name`).",
    ),
    resume: bool = Field(False, description=RESUME_DESCRIPTION),
) -> dict[str, Any]:
    """Train the run a YAML config file describes, exactly as ``pbrl train CONFIG --set ... --run-name ...``:
    the same validation and messages as ``pbrl validate`` (the run fails with them), the same run folder."""
    extra = [*overrides, *([f"run_name={run_name}"] if run_name else [])]
    job = load_job(config_path(config), extra)
    if not job.run_name:
        job = job.model_copy(update={"run_name": Path(config).stem})
    return run_training(job, resume=resume)
