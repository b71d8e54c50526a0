"""The public trainer API (docs/guides/python-api.md#the-python-api), with the reference library's names.

    from pbrl.trainers import MADPOIterTrainer, MADPOIterConfig
    trainer = MADPOIterTrainer(args=MADPOIterConfig(num_iterations=2), agent_model="smollm2-135m-instruct",
                               task="humaneval_docs", run_name="docs-1", report_to="tensorboard")
    result = trainer.train()
    agents = result.agents()          # [(model, tokenizer), ...]: the newest trained policies

Each trainer runs the same Prefect flows as ``pbrl train``; the run folder is the same for the same
configuration. Callables (``reward_func``, ``formatters``, ``reward_processor``) may be given directly;
module-level functions are also recorded by import path so that ``pbrl stage`` can rerun a stage later. Model
objects (``agents=[model, ...]``) are saved once, by content, under ``<storage>/models/objects/`` (``PBRL_STORAGE``,
else ``./storage``), and the run names them ``model-object:<name>``, never an absolute path, so every stage,
``pbrl stage`` and ``pbrl train --resume`` load them as any local model. The arguments become config values in
:mod:`pbrl.trainers.arguments`; model objects and ``peft_config`` are handled in :mod:`pbrl.trainers.model_objects`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import pandas as pd
from peft import LoraConfig
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from pbrl import orchestration
from pbrl.config import (
    JobConfig,
    RunConfig,
    TrainerConfig,
    collect_problems,
    make_job,
)
from pbrl.config.dataset_spec import DatasetSpec
from pbrl.errors import ConfigError, Problem
from pbrl.judging.verdicts import PairwiseJudge
from pbrl.models.loading import resolve_model_source
from pbrl.models.packaged import PACKAGED_MODELS
from pbrl.reporting.metrics import round_table
from pbrl.reporting.tracker_tools import require_trackers, tracker_names
from pbrl.reporting.trackers import RunTracker
from pbrl.run.export import TrainedAgent, load_trained_agents
from pbrl.run.folder import held_if_exists, prepare_run, run_dir_for
from pbrl.run.judging import IN_PROCESS_JUDGE, attach_judge, judge_object
from pbrl.run.preflight_env import device_problems, folder_problems, thread_problems
from pbrl.run.settings import policy_source
from pbrl.run.task import IN_PROCESS_TASK, resolve_task
from pbrl.tasks.base import Task
from pbrl.trainers.arguments import argument_errors, as_config_value, run_record, trainer_config
from pbrl.trainers.callbacks import TrainerCallback, check_callbacks, listening
from pbrl.trainers.model_objects import model_objects, peft_default_targets, peft_lora_options, save_model_object

# Items: a list of dicts or a ``datasets.Dataset`` (both iterate over mappings), a JSONL or Parquet path, or a dataset
# spec (DatasetSpec or a mapping of its fields).
Items = Iterable[Mapping[str, Any]] | str | Path | DatasetSpec | Mapping[str, Any]
AgentSource = str | Path | PreTrainedModel


@dataclass(frozen=True)
class TrainResult:
    """What :meth:`train` returns: ``run_dir`` (the run folder), ``stages`` (each stage call with its round and
    state, Completed or Cached), ``messages`` (what to know: rounds without pairs, skipped updates, dropped
    candidates) and ``rounds`` (the round table: one row per round, pairs, loss, accuracy, eval reward ...)."""

    run_dir: Path
    stages: list[dict[str, Any]]
    messages: list[str]
    rounds: pd.DataFrame

    def agents(
        self,
        round: int | None = None,
        *,
        merge_lora: bool = False,
        device: str | None = None,
    ) -> list[TrainedAgent]:
        """Every agent's trained policy as ``(model, tokenizer)``: after round ``round``, default the newest round
        that has weights (a round without pairs keeps the previous policy; 0 = the initial policies). LoRA runs give
        ``peft.PeftModel`` s, merged into plain models with ``merge_lora``. ``device``: None = the first GPU, else
        the CPU. See :func:`pbrl.run.export.load_trained_agents` (errors included)."""
        return load_trained_agents(self.run_dir, round, merge_lora=merge_lora, device=device)


# ---------------------------------------------------------------------------------------------- the trainers
class _PreferenceTrainer:
    """The trainers' one constructor and ``train``. Subclasses name the trainer (``_trainer``)."""

    _trainer: ClassVar[str]

    # Over 60 lines because of its signature and docstring (every argument of the API, each documented); the code,
    # which checks every argument and reports every problem at once, is ~25 lines.
    # Its parameters are the reference library's trainer arguments: a config record's fields, as keywords.
    def __init__(
        self,
        args: TrainerConfig | Mapping[str, Any] | None = None,
        *,
        agents: Sequence[AgentSource] | None = None,
        agent_model: AgentSource | None = None,
        tokenizers: PreTrainedTokenizerBase | Sequence[PreTrainedTokenizerBase | None] | None = None,
        peft_config: LoraConfig | None = None,
        task: str | None = None,
        task_options: Mapping[str, Any] | None = None,
        train_dataset: Items | None = None,
        eval_dataset: Items | None = None,
        reward_func: Callable[..., Sequence[float]] | str | None = None,
        reward_processor: Callable[[float], float] | str | None = None,
        formatters: Sequence[Callable[[dict], str] | str] | None = None,
        judge: PairwiseJudge | Callable[..., Any] | str | None = None,
        callbacks: Sequence[TrainerCallback | type] | None = None,
        report_to: str | Sequence[str] | None = None,
        run_name: str | None = None,
        output_dir: str | Path | None = None,
        seed: int | None = None,
        resume: bool = False,
        **run_options: Any,
    ) -> None:
        """Check every argument; nothing is loaded or written until :meth:`train`.

        Args:
            args: the trainer config (``MADPOIterConfig`` ...; its options: docs/reference/options.md), a mapping of
                its options, or None for its defaults.
            agents: one model per agent: a packaged alias, a local folder, a hub id already on disk, or a
                ``transformers.PreTrainedModel`` (saved once by content, see the module docstring).
            agent_model: one model for every agent (the same forms).
            tokenizers: the tokenizer of the model objects: one for all, or one per agent (None for a named model);
                default: the tokenizer saved at the object's ``name_or_path``.
            peft_config: a ``peft.LoraConfig`` (r, lora_alpha, lora_dropout, target_modules; None target modules =
                peft's default for the architecture) instead of ``lora_r`` / ``lora_alpha`` / ... .
            task, task_options: a registered task and its options.
            train_dataset, eval_dataset: items: a list of dicts, a JSONL or Parquet path, a ``datasets.Dataset`` or
                a dataset spec.
            reward_func, reward_processor, formatters: callables or ``"pkg.module:function"`` paths.
            judge: where preferences come from when not from scores (TRL's ``OnlineDPOTrainer(judge=...)``): a
                built-in judge's name (``"reward_noisy"``, ``"api"``, ``"local"``), a Python judge (a function of
                ``(prompts, first, second)``, its import path, or an object with ``name`` and ``answer``;
                docs/guides/judges.md). Giving one sets ``preference_source='judge'`` unless ``args`` says
                otherwise.
            callbacks: :class:`pbrl.trainers.TrainerCallback` s (instances or classes) that hear the run's events.
            report_to: experiment trackers: 'tensorboard', 'mlflow', 'wandb', 'trackio' or a list (default none).
            run_name: the run folder's name (default ``<trainer>-<UTC time>``); output_dir: where run folders go.
            seed: the run seed. resume: continue the run ``run_name`` (finished stages come back Cached).
            run_options: any other run-level option by name (``lora_r``, ``agent_devices``, ``torch_dtype`` ...).

        Raises:
            TypeError: naming each argument that is not an option of this trainer (a trainer option belongs in
                ``args``), an ``args`` of another trainer, or a callback without hooks.
            ConfigError: every problem of the values at once, each naming its option; then the devices, folders and
                thread count this machine cannot run (the models and items are checked by :meth:`train`).
        """
        cls_name = type(self).__name__
        wrong = argument_errors(self._trainer, cls_name, run_options, _EXPLICIT)
        if wrong:
            raise TypeError(f"{cls_name}: " + "; ".join(wrong))
        problems = self._take_args(args, judge)
        self.callbacks = check_callbacks(callbacks)
        self.resume = resume
        self._fns = {"reward_func": reward_func, "reward_processor": reward_processor}
        self._judge = judge
        self._formatters = formatters
        self._items = {"train_dataset": train_dataset, "eval_dataset": eval_dataset}
        self._task = task
        self._objects, object_problems = model_objects(agents, agent_model, tokenizers)
        lora, lora_problems = peft_lora_options(peft_config, run_options)
        problems += object_problems + lora_problems
        # peft's LoraConfig(target_modules=None) adapts the architecture's default modules, known once the model is.
        self._peft_default_targets = peft_config is not None and lora.get("lora_target_modules") is None
        named = {"agents": agents, "agent_model": agent_model, "task": task, "task_options": task_options}
        named |= {"train_dataset": train_dataset, "eval_dataset": eval_dataset, "report_to": report_to}
        named |= {"run_name": run_name, "output_dir": output_dir, "seed": seed}
        self._run = run_record(self._trainer, {**run_options, **lora}, named)
        self._check(problems)

    def _take_args(self, args: TrainerConfig | Mapping[str, Any] | None, judge: Any) -> list[Problem]:
        """Set ``self.args``, the trainer config of ``args`` (with a judge, ``preference_source='judge'`` unless
        ``args`` sets it); return its problems instead (``self.args`` is then not set).

        Raises:
            TypeError: as :func:`~pbrl.trainers.arguments.trainer_config`.
        """
        try:
            self.args = trainer_config(self._trainer, type(self).__name__, args)
        except ConfigError as exc:  # listed with the run-level options' problems (_check)
            return list(exc.problems)
        if judge is not None and "preference_source" not in self.args.model_fields_set:
            self.args = self.args.model_copy(update={"preference_source": "judge"})
        return []

    def _check(self, problems: list[Problem]) -> None:
        """Raise every problem of the arguments at once, with the run-level options' own; then check the job and
        what this machine cannot run (devices, folders, threads: :mod:`pbrl.run.preflight_env`), before anything
        is loaded.

        Raises:
            ConfigError: the problems, each naming its option.
        """
        if problems:
            found = problems + collect_problems(RunConfig, self._run_values(self._run)[0])
            raise ConfigError(list({str(p): p for p in found}.values()))
        job = self._job(self._run)  # every value checked now (model objects stand in by name)
        stored = bool(self._objects) or any(m in PACKAGED_MODELS for m in policy_source(job).models)
        machine = device_problems(job) + thread_problems(job) + folder_problems(job, packaged_models=stored)
        if machine:
            raise ConfigError(machine)

    def _run_values(
        self, run: Mapping[str, Any], sources: Mapping[str, str] | None = None
    ) -> tuple[dict[str, Any], dict[str, str]]:
        """The run-level options of ``run`` as the config takes them (model objects named by ``sources``, their
        saved folders, or while checking by a stand-in name; formatters by import path; the in-process task label),
        and the import paths of the callables that have one."""
        run = dict(run)
        names = {field: (sources or {}).get(field, f"model-object-{field}") for field in self._objects}
        if run.get("agents"):  # None: a model object (or an argument already reported as wrong)
            run["agents"] = [a or names.get(f"agents[{i}]", f"model-object-{i}") for i, a in enumerate(run["agents"])]
        if "agent_model" in names:
            run["agent_model"] = names["agent_model"]
        fn_paths = {k: path for k, v in self._fns.items() if v is not None and (path := as_config_value(v))}
        formatter_paths = [as_config_value(f) for f in self._formatters] if self._formatters else None
        run["formatters"] = formatter_paths if formatter_paths and all(formatter_paths) else None
        judged = getattr(self, "args", None) is not None and self.args.preference_source == "judge"  # no reward needed
        if (
            self._in_process(run)
            and self._task is None
            and not (run.get("train_dataset") and run["formatters"] and (fn_paths.get("reward_func") or judged))
        ):
            run["task"] = IN_PROCESS_TASK  # a label: the task lives in this process (pbrl.run.task.attach_task)
        return run, fn_paths

    def _job(self, run: Mapping[str, Any], sources: Mapping[str, str] | None = None) -> JobConfig:
        """The job of ``run`` (:meth:`_run_values`) with the trainer config and the callables' import paths."""
        values, fn_paths = self._run_values(run, sources)
        if self._judge is not None:  # by name or import path where it has one, else the in-process label
            fn_paths["judge"] = as_config_value(self._judge) or IN_PROCESS_JUDGE
        return make_job(values, self.args.model_copy(update=fn_paths))

    def _in_process(self, run: Mapping[str, Any]) -> bool:
        callables = (*self._fns.values(), *(self._formatters or ()))
        return any(callable(v) for v in callables) or (
            self._items["train_dataset"] is not None and run.get("train_dataset") is None
        )

    def _attached_task(self, job: JobConfig) -> Task | None:
        """The task as Python objects when callables or in-memory items were given, else None (the config's)."""
        if not self._in_process(self._run):
            return None
        base = resolve_task(job) if self._task else None
        formatters = self._formatters
        reward_func, reward_processor = self._fns["reward_func"], self._fns["reward_processor"]
        return Task(
            name=self._task or "python",
            formatters=tuple(formatters)
            if formatters and all(callable(f) for f in formatters)
            else (base.formatters if base else ()),
            reward_func=reward_func if callable(reward_func) else (base.reward_func if base else None),
            reward_processor=reward_processor
            if callable(reward_processor)
            else (base.reward_processor if base else None),
            train_items=base.train_items if base else (),
            eval_items=base.eval_items if base else (),
        )

    def train(self) -> TrainResult:
        """Run the training flow (or, with ``resume``, continue the run): model objects are saved (once), the run
        folder prepared, the trackers of ``report_to`` started, then every round runs as in ``pbrl train``.

        Raises:
            ConfigError: a tracker's package is missing, the task or items are invalid, a model cannot be found
                offline, or the run exists (without ``resume``) or differs from the stored run, each named.
        """
        orchestration.quiet_libraries()  # before models load: no weight-loading bars from transformers
        require_trackers(self._run.get("report_to"))
        sources = {field: save_model_object(model, tok) for field, (model, tok) in self._objects.items()}
        run = dict(self._run)
        if self._peft_default_targets:
            first = next(iter(sources.values()), None) or (run.get("agents") or [run.get("agent_model")])[0]
            run["lora_target_modules"] = peft_default_targets(resolve_model_source(str(first)))
        job = self._job(run, sources)
        with held_if_exists(run_dir_for(job)):  # a busy run is refused before anything is written or started
            run_dir = prepare_run(
                job,
                resume=self.resume,
                task=self._attached_task(job),
                train_items=self._items["train_dataset"] if run.get("train_dataset") is None else None,
                eval_items=self._items["eval_dataset"] if run.get("eval_dataset") is None else None,
            )
            if self._judge is not None and not isinstance(self._judge, str):  # a judge object: this process only
                attach_judge(run_dir, judge_object(self._judge, job))
            tracker = RunTracker.for_run(run_dir, tracker_names(job.report_to)) if job.report_to else None
            with listening(run_dir, [*self.callbacks, *([tracker] if tracker else [])]):
                try:
                    if tracker is not None:
                        tracker.open()  # before the flow: a tracker that cannot start stops the run here
                    out = orchestration.train(job, resume=True)
                except BaseException:
                    if tracker is not None:
                        tracker.close(failed=True)
                    raise
                if tracker is not None:
                    tracker.close()
        run_dir = Path(out["run_dir"])
        return TrainResult(run_dir=run_dir, stages=out["stages"], messages=out["messages"], rounds=round_table(run_dir))


# The trainers' own arguments (suggested for a misspelt one, with the run-level options).
_EXPLICIT = frozenset(inspect.signature(_PreferenceTrainer.__init__).parameters) - {"self", "run_options"}


class MADPOTrainer(_PreferenceTrainer):
    """MADPO, base: one collection among the agents' own candidates, then ``num_train_epochs`` of updates.
    All-tie data returns without updating the policies and says so
    (docs/design/stages.md#when-there-is-nothing-to-learn)."""

    _trainer = "madpo"


class MADPOIterTrainer(_PreferenceTrainer):
    """MADPO, iterative: ``num_iterations`` rounds of collect → store → replay → learn against a comparator."""

    _trainer = "madpo_iter"


class MARLHFTrainer(_PreferenceTrainer):
    """MARLHF, base: one collection among the agents' own candidates, a joint reward model fitted on its pairs
    (fit-reward-model, Bradley–Terry), then ``num_train_epochs`` of RL against it (``rl_algorithm``: magrpo,
    mareinforce, marloo or maremax; optional reference KL). Evaluation uses the task reward. All-tie data
    fits no reward model and returns without updating the policies, and says so
    (docs/design/stages.md#when-there-is-nothing-to-learn)."""

    _trainer = "marlhf"


class MARLHFIterTrainer(_PreferenceTrainer):
    """MARLHF, iterative: ``num_iterations`` rounds of collect → store → replay → fit a fresh reward model →
    RL, against a comparator. With ``preference_scoring_reward='reward_model'`` the newest fitted reward model
    scores new comparisons (the task reward until one exists)."""

    _trainer = "marlhf_iter"
