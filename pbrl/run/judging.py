"""The run's judge (docs/guides/judges.md), built from the job: the noisy-label simulator, an API model, a local
model, a Python judge by import path, or a judge object attached by the Python API in this process; and the
answer store of the run."""

from __future__ import annotations

import os
from pathlib import Path

from pbrl.config import JobConfig
from pbrl.config.judge_fields import BUILT_IN_JUDGES, IN_PROCESS_JUDGE
from pbrl.data.storage import RunPaths
from pbrl.errors import ArtifactError, ConfigError, Problem
from pbrl.generation.api_formats import ApiSettings
from pbrl.judging.api_judge import JUDGE_ROLE
from pbrl.judging.callable_judge import CallableJudge
from pbrl.judging.factory import api_judge_from_options, local_judge_from_options, read_template
from pbrl.judging.human import HumanJudge
from pbrl.judging.simulated import RewardLabelJudge
from pbrl.judging.store import AnswerStore
from pbrl.judging.verdicts import PairwiseJudge
from pbrl.models.loading import resolve_devices, resolve_model_source
from pbrl.models.packaged import PACKAGED_MODELS, locate_packaged_file
from pbrl.run.stage_plan import trainer_stages
from pbrl.run.task import resolve_task
from pbrl.tasks.base import Task, import_object

# Judges given as Python objects through the trainer API, keyed by resolved run folder (as attached tasks are:
# pbrl.run.task), found by the stages of that run in this process.
_ATTACHED_JUDGES: dict[str, PairwiseJudge] = {}
ANSWERS_FILE = Path("judge") / "answers.jsonl"


def attach_judge(run_dir: Path, judge: PairwiseJudge) -> None:
    """Make a judge object available to the stages of the run in this process."""
    _ATTACHED_JUDGES[str(Path(run_dir).resolve())] = judge


def round_stages(job: JobConfig, run_dir: Path) -> tuple[str, ...]:
    """The stages of a round of this run, in order: judge-pairs when a judge gives the preferences,
    score-with-oracle when the task has a reward (docs/design/stages.md)."""
    scored = resolve_task(job, run_dir).reward_func is not None
    return trainer_stages(job.trainer, judged=job.preference_source == "judge", scored=scored)


def judge_object(value: object, job: JobConfig) -> PairwiseJudge:
    """A judge given to the trainer API as a Python object: an object with ``name`` and ``answer`` as it is, a
    function wrapped (:class:`~pbrl.judging.callable_judge.CallableJudge`, named by its import path or, for one
    that has none, its qualified name).

    Raises:
        TypeError: ``value`` is neither.
    """
    if callable(getattr(value, "answer", None)) and isinstance(getattr(value, "name", None), str):
        return value  # type: ignore[return-value]
    if not callable(value):
        raise TypeError(f"judge: got {type(value).__name__}; give a function, a judge object (name, answer) or a name")
    name = job.judge if job.judge not in (None, IN_PROCESS_JUDGE) else getattr(value, "__qualname__", repr(value))
    return CallableJudge(value, name=str(name), tie_margin=job.judge_tie_margin, timeout_s=job.judge_timeout)


def answer_store(paths: RunPaths) -> AnswerStore:
    """The run's store of every answer its judge gave (:mod:`pbrl.judging.store`)."""
    return AnswerStore(paths.root / ANSWERS_FILE)


def prompt_template(job: JobConfig) -> str:
    """The judge's prompt template: the file ``judge_prompt_template`` names, else the built-in one
    (:func:`pbrl.judging.factory.read_template`).

    Raises:
        ConfigError: the file cannot be read or the template has a problem (each named).
    """
    return read_template(job.judge_prompt_template)


def judge_for(job: JobConfig, run_dir: Path, task: Task) -> PairwiseJudge:
    """The run's judge (see the module docstring).

    Raises:
        ConfigError: the judge cannot be built: ``reward_noisy`` for a task without a reward, an import path that
            does not import, a judge object that lives in another process, a model that cannot be found.
    """
    judge = job.judge
    if judge is None:
        raise ConfigError([Problem("judge", None, "required with preference_source='judge'")])
    attached = _ATTACHED_JUDGES.get(str(Path(run_dir).resolve()))
    if attached is not None:
        return attached
    if judge == IN_PROCESS_JUDGE:
        raise ConfigError([Problem("judge", judge, "this run's judge was given as a Python object to the trainer API "
                                   "and lives only in that process; give a module-level function's import path to run "
                                   "its stages from the CLI or the UI")])  # fmt: skip
    if judge == "reward_noisy":
        if task.reward_func is None:
            raise ConfigError([Problem("judge", judge, f"simulates labels from the task's reward, and task "
                                       f"{task.name!r} has none")])  # fmt: skip
        return RewardLabelJudge(job.judge_label_noise, job.judge_bt_temperature, job.tie_tolerance, job.seed)
    if judge in ("api", "local"):
        return _model_judge(job, judge)
    if judge == HumanJudge.name:
        return HumanJudge()
    try:
        found = import_object(judge)
    except ImportError as exc:
        raise ConfigError([Problem("judge", judge, str(exc))]) from exc
    if callable(getattr(found, "answer", None)) and isinstance(getattr(found, "name", None), str):
        return found  # an object with the PairwiseJudge methods
    if not callable(found):
        raise ConfigError([Problem("judge", judge, "is neither a function nor a judge object (name, answer)")])
    return CallableJudge(found, name=judge, tie_margin=job.judge_tie_margin, timeout_s=job.judge_timeout)


def _model_judge(job: JobConfig, kind: str) -> PairwiseJudge:
    """The API or local judge of the job (:mod:`pbrl.judging.api_judge`, :mod:`pbrl.judging.local_judge`)."""
    template = job.judge_prompt_template
    if kind == "api":
        settings = ApiSettings(
            api_format=job.judge_api_format,
            url=str(job.judge_api_url),
            model=job.judge_model,
            key_env=job.judge_api_key_env,
            key_header=job.judge_api_key_header,
            key_prefix=job.judge_api_key_prefix,
            headers=dict(job.judge_api_headers or {}),
            extra_body=dict(job.judge_api_extra_body or {}),
            response_field=job.judge_api_response_field,
            timeout=job.judge_api_timeout,
            max_concurrency=job.judge_api_max_concurrency,
            role=JUDGE_ROLE,
        )
        return api_judge_from_options(settings, max_tokens=job.judge_api_max_tokens, prompt_template=template)
    device = resolve_devices(job.agent_devices, job.num_agents)[0]  # beside the first agent
    return local_judge_from_options(
        model=str(job.judge_model),
        prompt_template=template,
        batch_size=job.judge_batch_size,
        tie_margin=job.judge_tie_margin,
        dtype=job.torch_dtype,
        device="cpu" if device == "auto" else device,
    )


def preflight_problems(job: JobConfig, task: Task | None, *, prepare_models: bool) -> list[Problem]:
    """What ``pbrl validate`` checks of the judge beyond the options: the simulator has a reward to simulate
    from, a Python judge imports and is a judge, the local judge's model is there (a packaged one converted when
    ``prepare_models``), the prompt template reads and is usable, the API key's variable is set. Every problem, in
    that order."""
    if job.preference_source != "judge" or job.judge in (None, IN_PROCESS_JUDGE):
        return []
    return [
        *_reward_problems(job, task),
        *_python_judge_problems(job),
        *_local_model_problems(job, prepare_models=prepare_models),
        *_template_problems(job),
        *_key_problems(job),
    ]


def _reward_problems(job: JobConfig, task: Task | None) -> list[Problem]:
    """A judge that needs the task's reward (the simulator; a person's judge while evaluation asks for win rates)."""
    if task is None or task.reward_func is not None:
        return []
    if job.judge == "reward_noisy":
        return [
            Problem("judge", job.judge, f"simulates labels from the task's reward, and task {task.name!r} has none")
        ]
    if job.judge == HumanJudge.name and job.eval_interval > 0:
        return [Problem("judge", job.judge, f"task {task.name!r} has no reward, so evaluation asks the judge "
                        "for win rates, and people label training pairs only; give the task a reward_func "
                        "or set eval_interval: 0")]  # fmt: skip
    return []


def _python_judge_problems(job: JobConfig) -> list[Problem]:
    """A judge named by its import path imports and is a function or a judge object."""
    if job.judge in BUILT_IN_JUDGES:
        return []
    try:
        found = import_object(job.judge)
    except ImportError as exc:
        return [Problem("judge", job.judge, str(exc))]
    if not callable(found) and not callable(getattr(found, "answer", None)):
        return [Problem("judge", job.judge, "is neither a function nor a judge object (name, answer)")]
    return []


def _local_model_problems(job: JobConfig, *, prepare_models: bool) -> list[Problem]:
    """The local judge's model is there (a packaged one converted when ``prepare_models``)."""
    if job.judge != "local" or job.judge_model is None:
        return []
    try:
        if prepare_models or job.judge_model not in PACKAGED_MODELS:
            resolve_model_source(job.judge_model, field="judge_model")
        else:
            locate_packaged_file(job.judge_model)
    except ConfigError as exc:
        return list(exc.problems)
    except ArtifactError as exc:
        return [Problem("judge_model", job.judge_model, str(exc))]
    return []


def _template_problems(job: JobConfig) -> list[Problem]:
    """The prompt template of a model judge (api, local) reads and is usable."""
    if job.judge not in ("api", "local"):
        return []
    try:
        prompt_template(job)
    except ConfigError as exc:
        return list(exc.problems)
    return []


def _key_problems(job: JobConfig) -> list[Problem]:
    """The API judge's key variable is set (its value is never read here)."""
    if job.judge == "api" and job.judge_api_key_env and not os.environ.get(job.judge_api_key_env):
        return [Problem("judge_api_key_env", job.judge_api_key_env, "this environment variable is not set; export "
                        "the API key in it")]  # fmt: skip
    return []
