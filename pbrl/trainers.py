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
else ``./storage``), and the run names that folder, so every stage, ``pbrl stage`` and ``pbrl train --resume`` load
them as any local model.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import pandas as pd
import torch
from peft import LoraConfig, PeftModel
from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING
from transformers import AutoConfig, PreTrainedModel, PreTrainedTokenizerBase

from pbrl import orchestration
from pbrl.callbacks import TrainerCallback, check_callbacks, listening
from pbrl.config import (
    RUN_FIELDS,
    TRAINER_CONFIGS,
    JobConfig,
    MADPOConfig,
    MADPOIterConfig,
    MARLHFConfig,
    MARLHFIterConfig,
    RunConfig,
    TrainerConfig,
    collect_problems,
    make_job,
)
from pbrl.config.dataset_spec import DatasetSpec
from pbrl.config.models import suggest
from pbrl.data.storage import atomic_dir, hash_path
from pbrl.errors import ConfigError, Problem
from pbrl.models.loading import load_tokenizer, resolve_model_source
from pbrl.models.packaged import storage_root
from pbrl.reporting.metrics import round_table
from pbrl.reporting.trackers import RunTracker, require_trackers, tracker_names
from pbrl.run.export import TrainedAgent, export_agents, load_trained_agents
from pbrl.run.folder import generated_run_name, prepare_run
from pbrl.run.task import IN_PROCESS_TASK, resolve_task
from pbrl.tasks.base import Task

__all__ = [
    "MADPOConfig",
    "MADPOIterConfig",
    "MARLHFConfig",
    "MARLHFIterConfig",
    "DatasetSpec",
    "MADPOTrainer",
    "MADPOIterTrainer",
    "MARLHFTrainer",
    "MARLHFIterTrainer",
    "TrainResult",
    "TrainedAgent",
    "TrainerCallback",
    "export_agents",
]

# Items: a list of dicts or a ``datasets.Dataset`` (both iterate over mappings), a JSONL or Parquet path, or a dataset
# spec (DatasetSpec or a mapping of its fields).
Items = Iterable[Mapping[str, Any]] | str | Path | DatasetSpec | Mapping[str, Any]
AgentSource = str | Path | PreTrainedModel
MODEL_STORE = ("models", "objects")  # under the storage root: model objects saved by content
# LoraConfig fields pbrl's LoRA takes (pbrl.models.lora.LoraSettings) or that change nothing; any other set to a
# value other than peft's default is refused.
_LORA_FIELDS = {"r", "lora_alpha", "lora_dropout", "target_modules"}
_LORA_INERT = {"task_type", "peft_type", "auto_mapping", "peft_version", "base_model_name_or_path", "revision"}
_LORA_INERT |= {"inference_mode", "runtime_config"}


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


# ---------------------------------------------------------------------------------------------- argument checks
def _import_path(fn: Callable[..., Any]) -> str | None:
    """``"module:qualname"`` of a module-level function (None for lambdas, closures and __main__)."""
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not module or module == "__main__" or "<" in qualname:
        return None
    return f"{module}:{qualname}"


def _as_config_value(value: Any) -> Any:
    """A config value for ``value`` when it has one (a string, or an importable function), else None."""
    if isinstance(value, (str, Path)):
        return str(value)
    return _import_path(value) if callable(value) else None


def _dataset_config_value(value: Any) -> Any:
    """The config value of a ``train_dataset`` / ``eval_dataset`` argument: a path as text, a dataset spec
    (:class:`~pbrl.config.dataset_spec.DatasetSpec` or a mapping of its fields, validated with the config), else
    None: in-memory items (a list of dicts, a ``datasets.Dataset``) stay in this process."""
    if isinstance(value, (str, Path)):
        return str(value)
    if isinstance(value, Mapping):
        return dict(value)
    return value if isinstance(value, DatasetSpec) else None


def _argument_errors(trainer: str, cls_name: str, given: Mapping[str, Any], explicit: set[str]) -> list[str]:
    """One line per keyword argument that is not a run-level option of the trainer: a trainer option (set it on
    ``args``), an option of other trainers only, or unknown (with the closest names)."""
    config_cls = TRAINER_CONFIGS[trainer]
    accepted = (RUN_FIELDS - {"trainer"}) | explicit
    lines = []
    for name in given:
        if name in accepted:
            continue
        if name == "trainer":
            lines.append(f"'trainer' is set by the class ({cls_name} is '{trainer}')")
        elif name in config_cls.model_fields:
            lines.append(
                f"'{name}' is an option of {config_cls.__name__}: give it in args, e.g. "
                f"args={config_cls.__name__}({name}=...)"
            )
        elif owners := [c.__name__ for c in TRAINER_CONFIGS.values() if name in c.model_fields]:
            lines.append(f"'{name}' is not an option of {cls_name} (it belongs to {', '.join(owners)})")
        else:
            lines.append(f"unexpected argument '{name}'" + suggest(name, sorted(accepted)))
    return lines


def _trainer_config(trainer: str, cls_name: str, args: Any) -> TrainerConfig:
    """``args`` as the trainer's config: None = the defaults; a mapping = its options.

    Raises:
        TypeError: naming ``args``, when it is another trainer's config or not a config at all.
        ConfigError: every problem of a mapping's options.
    """
    config_cls = TRAINER_CONFIGS[trainer]
    if args is None:
        return config_cls()
    if isinstance(args, config_cls):
        return args
    if isinstance(args, Mapping):
        return config_cls(**args)
    raise TypeError(
        f"{cls_name}: args got a {type(args).__name__}; give a {config_cls.__name__} (or a mapping of its options, "
        "or None for its defaults)"
    )


def _lora_options(peft_config: Any) -> tuple[dict[str, Any], list[Problem]]:
    """``lora_r`` / ``lora_alpha`` / ``lora_dropout`` / ``lora_target_modules`` of a ``peft.LoraConfig`` (target
    modules None = peft's default for the model, filled in when the model is known), and the problems of the
    fields pbrl's LoRA does not take (each named ``peft_config.<field>``)."""
    if not isinstance(peft_config, LoraConfig):
        return {}, [Problem("peft_config", type(peft_config).__name__, "give a peft.LoraConfig (pbrl trains LoRA)")]
    default = LoraConfig()
    problems = [
        Problem(f"peft_config.{f.name}", getattr(peft_config, f.name), "not supported by pbrl's LoRA; pbrl sets r, "
                "lora_alpha, lora_dropout and target_modules only: leave it at peft's default")
        for f in dataclasses.fields(LoraConfig)
        if f.name not in _LORA_FIELDS | _LORA_INERT and getattr(peft_config, f.name) != getattr(default, f.name)
    ]  # fmt: skip
    if peft_config.task_type not in (None, "CAUSAL_LM"):
        problems.append(Problem("peft_config.task_type", str(peft_config.task_type), "pbrl trains causal LMs"))
    targets = peft_config.target_modules
    if isinstance(targets, str):
        problems.append(
            Problem("peft_config.target_modules", targets, "give a list of module names (e.g. ['q_proj', 'v_proj'])")
        )
        targets = None
    options = {
        "lora_r": int(peft_config.r),
        "lora_alpha": int(peft_config.lora_alpha),
        "lora_dropout": float(peft_config.lora_dropout),
        "lora_target_modules": sorted(targets) if targets else None,
    }
    return options, problems


def _peft_default_targets(model_dir: Path) -> list[str]:
    """peft's default LoRA target modules for the architecture of the model in ``model_dir`` (what
    ``LoraConfig(target_modules=None)`` adapts).

    Raises:
        ConfigError: naming ``peft_config.target_modules`` when peft has no default for the architecture.
    """
    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    targets = TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING.get(config.model_type)
    if not targets:
        raise ConfigError(
            [Problem("peft_config.target_modules", None, f"peft has no default for a {config.model_type!r} model; "
                     "name the modules (e.g. ['q_proj', 'v_proj'])")]
        )  # fmt: skip
    return sorted(targets)


# ---------------------------------------------------------------------------------------------- model objects
def _model_digest(model: PreTrainedModel, tokenizer: Any) -> str:
    """SHA-256 of a model's weights (names, dtypes, shapes, bytes), config and saved tokenizer files: equal for the
    same weights, so the same object is saved once."""
    h = hashlib.sha256(model.config.to_json_string(use_diff=False).encode())
    for name, tensor in sorted(model.state_dict().items()):
        flat = tensor.detach().to("cpu").contiguous().view(-1)
        h.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}".encode())
        h.update(flat.view(torch.uint8).numpy().tobytes())
    with tempfile.TemporaryDirectory() as folder:
        tokenizer.save_pretrained(folder)
        h.update(hash_path(Path(folder)).encode())
    return h.hexdigest()


def save_model_object(model: PreTrainedModel, tokenizer: Any, root: Path | None = None) -> Path:
    """Save ``model`` (safetensors) and ``tokenizer`` once, by content, to
    ``<root>/models/objects/<class>-<hash>/`` (root: the storage root, ``PBRL_STORAGE`` or ``./storage``) and return
    that folder (absolute); an equal object saved before is not written again.

    Raises:
        ArtifactError: the disk is full (named).
    """
    folder = (root or storage_root()).joinpath(
        *MODEL_STORE
    ) / f"{type(model).__name__}-{_model_digest(model, tokenizer)[:16]}"
    if not (folder / "config.json").is_file():
        with atomic_dir(folder) as tmp:
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
    return folder.resolve()


def _path_text(value: Any) -> str | None:
    """A model source or folder argument as config text (None for None and for a model object)."""
    return str(value) if isinstance(value, (str, Path)) else None


def _check_model(field: str, model: Any) -> list[Problem]:
    if isinstance(model, PeftModel):
        return [Problem(field, type(model).__name__, "a peft model: give its base model with peft_config, or merge it "
                        "first (model.merge_and_unload())")]  # fmt: skip
    if isinstance(model, (str, Path, PreTrainedModel)):
        return []
    return [Problem(field, type(model).__name__, "give a model id, a local folder or a transformers PreTrainedModel")]


def _tokenizer_for(field: str, model: PreTrainedModel, tokenizer: Any) -> tuple[Any, list[Problem]]:
    """The tokenizer of a model object: the one given, else the one saved beside the model it was loaded from."""
    if tokenizer is not None:
        if isinstance(tokenizer, PreTrainedTokenizerBase):
            return tokenizer, []
        return None, [Problem(field, type(tokenizer).__name__, "give a transformers tokenizer")]
    try:
        return load_tokenizer(resolve_model_source(model.name_or_path, field=field)), []
    except Exception:
        return None, [Problem(field, None, f"the model object's tokenizer: give it (tokenizers=...); none is saved at "
                              f"its name_or_path {model.name_or_path!r}")]  # fmt: skip


# ---------------------------------------------------------------------------------------------- the trainers
class _PreferenceTrainer:
    """The trainers' one constructor and ``train``. Subclasses name the trainer (``_trainer``)."""

    _trainer: ClassVar[str]

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
            callbacks: :class:`pbrl.callbacks.TrainerCallback` s (instances or classes) that hear the run's events.
            report_to: experiment trackers: 'tensorboard', 'mlflow', 'wandb', 'trackio' or a list (default none).
            run_name: the run folder's name (default ``<trainer>-<UTC time>``); output_dir: where run folders go.
            seed: the run seed. resume: continue the run ``run_name`` (finished stages come back Cached).
            run_options: any other run-level option by name (``lora_r``, ``agent_devices``, ``torch_dtype`` ...).

        Raises:
            TypeError: naming each argument that is not an option of this trainer (a trainer option belongs in
                ``args``), an ``args`` of another trainer, or a callback without hooks.
            ConfigError: every problem of the values at once, each naming its option.
        """
        cls_name = type(self).__name__
        wrong = _argument_errors(self._trainer, cls_name, run_options, _EXPLICIT)
        if wrong:
            raise TypeError(f"{cls_name}: " + "; ".join(wrong))
        problems: list[Problem] = []
        try:
            self.args = _trainer_config(self._trainer, cls_name, args)
        except ConfigError as exc:  # listed with the run-level options' problems below
            problems = list(exc.problems)
        self.callbacks = check_callbacks(callbacks)
        self.resume = resume
        self._fns = {"reward_func": reward_func, "reward_processor": reward_processor}
        self._formatters = formatters
        self._items = {"train_dataset": train_dataset, "eval_dataset": eval_dataset}
        self._task = task
        self._objects, object_problems = self._model_objects(agents, agent_model, tokenizers)
        problems += object_problems
        lora: dict[str, Any] = {}
        if peft_config is not None:
            lora, lora_problems = _lora_options(peft_config)
            problems += lora_problems
            problems += [
                Problem(k, run_options[k], "give LoRA settings either as peft_config or as lora_* options, not both")
                for k in lora
                if k in run_options
            ]
        # peft's LoraConfig(target_modules=None) adapts the architecture's default modules, known once the model is.
        self._peft_default_targets = peft_config is not None and lora.get("lora_target_modules") is None
        run = {
            **run_options,
            **lora,
            "trainer": self._trainer,
            "run_name": run_name or generated_run_name(self._trainer),
            # model objects stand in as None here; _job names them by their saved folders
            "agents": [a if isinstance(a, str) else _path_text(a) for a in agents] if agents else None,
            "agent_model": _path_text(agent_model),
            "task": task,
            "task_options": dict(task_options) if task_options else None,
            "train_dataset": _dataset_config_value(train_dataset),
            "eval_dataset": _dataset_config_value(eval_dataset),
            "report_to": report_to if report_to is None or isinstance(report_to, str) else list(report_to),
            "output_dir": _path_text(output_dir),
            "seed": seed,
        }
        self._run = {k: v for k, v in run.items() if v is not None}
        if problems:  # with the run-level options' own problems: every problem at once
            found = problems + collect_problems(RunConfig, self._run_values(self._run)[0])
            raise ConfigError(list({str(p): p for p in found}.values()))
        self._job(self._run)  # every value checked now (model objects stand in by name)

    def _model_objects(
        self, agents: Sequence[Any] | None, agent_model: Any, tokenizers: Any
    ) -> tuple[dict[str, tuple[PreTrainedModel, Any]], list[Problem]]:
        """``{"agents[i]" | "agent_model": (model, tokenizer)}`` of the model objects among the agents, and the
        problems of the model and tokenizer arguments."""
        if agents is not None and (
            isinstance(agents, (str, Path, PreTrainedModel)) or not isinstance(agents, Sequence)
        ):
            return {}, [Problem("agents", type(agents).__name__, "give a list: one model per agent")]
        named = [(f"agents[{i}]", a) for i, a in enumerate(agents or [])]
        if agent_model is not None:
            named.append(("agent_model", agent_model))
        problems = [p for field, model in named for p in _check_model(field, model)]
        per_agent = isinstance(tokenizers, Sequence) and not isinstance(tokenizers, (str, PreTrainedTokenizerBase))
        fits = not per_agent or len(tokenizers) == len(named)
        if not fits:
            problems.append(Problem("tokenizers", f"{len(tokenizers)} tokenizers", f"give one per agent ({len(named)})"
                                    " or one for all"))  # fmt: skip
        objects = {}
        for i, (field, model) in enumerate(named):
            given = (tokenizers[i] if per_agent else tokenizers) if fits else None
            if isinstance(model, PreTrainedModel):
                found: list[Problem] = []
                tokenizer = None
                if fits:
                    tokenizer, found = _tokenizer_for(f"tokenizers[{i}]" if per_agent else "tokenizers", model, given)
                problems += found
                objects[field] = (model, tokenizer)
            elif per_agent and given is not None:
                problems.append(Problem(f"tokenizers[{i}]", type(given).__name__, f"{field} is a model name or folder, "
                                        "whose tokenizer loads from there: give None for it"))  # fmt: skip
        if tokenizers is not None and not objects:
            problems.append(Problem("tokenizers", type(tokenizers).__name__, "no agent is a model object; a named "
                                    "model's tokenizer loads from its folder"))  # fmt: skip
        return objects, problems

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
        fn_paths = {k: path for k, v in self._fns.items() if v is not None and (path := _as_config_value(v))}
        formatter_paths = [_as_config_value(f) for f in self._formatters] if self._formatters else None
        run["formatters"] = formatter_paths if formatter_paths and all(formatter_paths) else None
        if (
            self._in_process(run)
            and self._task is None
            and not (run.get("train_dataset") and run["formatters"] and fn_paths.get("reward_func"))
        ):
            run["task"] = IN_PROCESS_TASK  # a label: the task lives in this process (pbrl.run.task.attach_task)
        return run, fn_paths

    def _job(self, run: Mapping[str, Any], sources: Mapping[str, str] | None = None) -> JobConfig:
        """The job of ``run`` (:meth:`_run_values`) with the trainer config and the callables' import paths."""
        values, fn_paths = self._run_values(run, sources)
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
            reward_func=reward_func if callable(reward_func) else base.reward_func,  # type: ignore[union-attr]
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
        sources = {field: str(save_model_object(model, tok)) for field, (model, tok) in self._objects.items()}
        run = dict(self._run)
        if self._peft_default_targets:
            first = next(iter(sources.values()), None) or (run.get("agents") or [run.get("agent_model")])[0]
            run["lora_target_modules"] = _peft_default_targets(resolve_model_source(str(first)))
        job = self._job(run, sources)
        run_dir = prepare_run(
            job,
            resume=self.resume,
            task=self._attached_task(job),
            train_items=self._items["train_dataset"] if run.get("train_dataset") is None else None,
            eval_items=self._items["eval_dataset"] if run.get("eval_dataset") is None else None,
        )
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
