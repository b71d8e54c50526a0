"""Trained agents out of a run: loaded (:func:`load_trained_agents`, behind ``TrainResult.agents()``), exported as
standard Hugging Face folders (:func:`export_agents`, ``pbrl export``), and the reference's copy of every policy
checkpoint (:func:`export_policy_checkpoint`); docs/guides/tracking-and-export.md#trained-agents-out.

**Hugging Face folders.** ``export_agents`` writes ``<out>/agent_<i>/`` per agent (one, ``agent_0``, for the actor of
``collaboration_mode: centralized``): with LoRA the adapter (``adapter_config.json`` + ``adapter_model.safetensors``,
for ``peft.AutoPeftModelForCausalLM``) or, with ``merge_lora``, the adapter merged into full weights; without LoRA
the full weights (``AutoModelForCausalLM``). Each folder also holds the tokenizer as the run used it (pad token =
EOS when the model has none, left padding) and a model card (``README.md``) naming the run, round, trainer, agent and
eval reward. ``<out>/pbrl-export.json`` records what was exported. The policy of round r is the one the run's
manifests name (:func:`pbrl.run.policy_records.policy_checkpoint`): a round without pairs writes no checkpoint and keeps
the previous policy.

**The reference's layout.** The reference (CoMLRL ``MADPOIterTrainer._save_policy_checkpoint``;
docs/design/file-formats.md#checkpoints) writes ``<policy_checkpoint_dir>/initial/agent_<i>/`` at the start and
``iteration_<idx:04d>/agent_<i>/`` after each iteration, with a **0-based** index (``iteration_0000`` = after the
first iteration). pbrl keeps its own checkpoints in the run folder (``checkpoints/initial``,
``checkpoints/round_<rrrr>``, 1-based); with ``policy_checkpoint_dir`` set, each one is also copied there under the
reference's name, so tools written for the reference find them. The copy holds what the run's agent folder holds
(full weights or the LoRA adapter, tokenizer files when saved; for full fine-tuning ``initial/agent_<i>`` holds
``source.json`` naming the base model), without the optimizer state (the reference exports none).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, NamedTuple

import torch

from pbrl.config import JobConfig, parse_job
from pbrl.data.folders import usual_modes
from pbrl.data.storage import RunPaths, atomic_dir, existing_rounds, read_json, read_manifest, write_json
from pbrl.errors import ArtifactError, ConfigError, Problem
from pbrl.models.head_input import contiguous_head_input
from pbrl.models.loading import DTYPES, load_tokenizer, resolve_devices, resolve_model_source
from pbrl.models.lora import quiet_peft_wrapping, save_pretrained_stably
from pbrl.models.policies import SOURCE_FILE, PolicySource
from pbrl.run.export_target import EXPORT_FILE, export_target, replace_export
from pbrl.run.model_card import hub_id, model_card
from pbrl.run.policy_records import UPDATE_STAGE, policy_checkpoint
from pbrl.run.settings import policy_source

OPTIMIZER_FILE = "optimizer.pt"
CARD_FILE = "README.md"


def reference_label(round_index: int) -> str:
    """The reference's folder name of the policy after pbrl round ``round_index``: 0 -> ``initial``,
    r >= 1 -> ``iteration_<r-1:04d>`` (round 1 -> ``iteration_0000``).

    Raises:
        ValueError: a negative round.
    """
    if round_index < 0:
        raise ValueError(f"round_index: got {round_index}; must be >= 0")
    return "initial" if round_index == 0 else f"iteration_{round_index - 1:04d}"


def export_policy_checkpoint(checkpoint: str | Path, export_dir: str | Path, round_index: int, num_agents: int) -> Path:
    """Copy ``checkpoint/agent_<i>/`` (i < num_agents) to ``export_dir/<reference_label(round)>/agent_<i>/``.

    The folder is assembled under a temporary name and renamed, so an interrupted export leaves no partial
    folder under the final name; an existing export of the same round is replaced.

    Returns:
        The exported folder.

    Raises:
        FileNotFoundError: an agent folder is missing from ``checkpoint`` (names it).
    """
    checkpoint = Path(checkpoint)
    sources = [checkpoint / f"agent_{i}" for i in range(num_agents)]
    for source in sources:
        if not source.is_dir():
            raise FileNotFoundError(f"{source}: no such agent checkpoint folder to export")
    dest = Path(export_dir) / reference_label(round_index)
    with atomic_dir(dest) as tmp:
        for i, source in enumerate(sources):
            shutil.copytree(source, tmp / f"agent_{i}", ignore=shutil.ignore_patterns(OPTIMIZER_FILE))
    return dest


# ---------------------------------------------------------------------------------------------- trained agents out
class TrainedAgent(NamedTuple):
    """One agent's trained policy, loaded: a ``transformers`` causal LM (a ``peft.PeftModel`` for an unmerged LoRA
    adapter) in eval mode, and its tokenizer as the run used it. Unpacks as ``model, tokenizer``."""

    model: Any
    tokenizer: Any


def stored_job(run_dir: str | Path) -> JobConfig:
    """The job of ``run.json``, placed where the folder is now (as :func:`pbrl.run.folder.open_job`).

    Raises:
        ArtifactError: run.json is missing or invalid.
    """
    folder = Path(run_dir).resolve()
    data = read_json(RunPaths(folder).run_json)
    try:
        return parse_job({**data["config"], "output_dir": str(folder.parent), "run_name": folder.name}, warn=False)
    except (KeyError, TypeError, ConfigError) as exc:
        raise ArtifactError(f"{RunPaths(folder).run_json}: invalid stored config ({exc})") from exc


def trained_round(run_dir: str | Path, round: int | None = None) -> int:
    """The round whose policy to take: ``round`` when given, else the newest round whose update-policies has
    finished (0, the initial policies, when none has). The policy of that round is
    :func:`pbrl.run.policy_records.policy_checkpoint`'s (the previous one when the round had no pairs).

    Raises:
        ConfigError: naming ``round``, when it is not a round whose policy the run has.
    """
    paths = RunPaths(run_dir)
    updated = [r for r in existing_rounds(paths) if r >= 1 and read_manifest(paths, r, UPDATE_STAGE) is not None]
    if round is None:
        return max(updated, default=0)
    if round != 0 and round not in updated:
        have = ", ".join(map(str, [0, *updated]))
        raise ConfigError([Problem("round", round, f"this run has the policies of rounds {have}")])
    return round


def load_trained_agents(
    run_dir: str | Path,
    round: int | None = None,
    *,
    merge_lora: bool = False,
    device: str | None = None,
) -> list[TrainedAgent]:
    """Every agent's policy after round ``round`` (default: the newest round that has weights,
    :func:`trained_round`), each loaded on its own (no weight shared between agents), offline, in eval mode: full
    and merged weights in float32 (the precision they trained in), a LoRA adapter's frozen base in the run's
    ``torch_dtype``.

    Args:
        run_dir: a run folder.
        round: 0 = the initial policies; r = the policy after round r.
        merge_lora: merge a LoRA adapter into the base weights (a plain ``transformers`` model) instead of returning
            a ``peft.PeftModel``.
        device: where the models go; None = the first GPU, else the CPU.

    Returns:
        One :class:`TrainedAgent` per actor (``num_agents``; 1 with ``collaboration_mode: centralized``).

    Raises:
        ArtifactError: run.json or the round's checkpoint is missing or incomplete.
        ConfigError: a model source cannot be found offline, or ``round`` is not a round of the run.
    """
    job = stored_job(run_dir)
    paths = RunPaths(run_dir)
    checkpoint = policy_checkpoint(paths, trained_round(run_dir, round))
    source = policy_source(job)
    target = resolve_devices(device, 1)[0]
    agents = [_load_agent(source, agent, checkpoint, merge_lora) for agent in range(source.num_agents)]
    return [TrainedAgent(model.to(target), tokenizer) for model, tokenizer in agents]


def _load_agent(source: PolicySource, agent: int, checkpoint: Path, merge_lora: bool) -> TrainedAgent:
    """Agent ``agent`` as stored in ``checkpoint``, with plain ``transformers`` / ``peft`` loaders (as a user's code
    would load the export), on the CPU: full weights (or a base merged with its adapter) in float32, as they
    trained; a base under an unmerged adapter in ``source.dtype``."""
    from peft import PeftModel  # deferred: peft imports are slow and only a LoRA run needs them
    from transformers import AutoModelForCausalLM  # deferred: only loading needs it

    base = resolve_model_source(source.models[agent])
    agent_dir = checkpoint / f"agent_{agent}"
    if not agent_dir.is_dir():
        raise ArtifactError(f"{agent_dir}: missing; the checkpoint has no folder for agent {agent}")
    full = source.lora is None and (agent_dir / "config.json").is_file()
    if source.lora is None and not full and not (agent_dir / SOURCE_FILE).is_file():
        raise ArtifactError(f"{agent_dir}: neither full weights (config.json) nor {SOURCE_FILE}")
    # Weights that trained are float32 master weights (pbrl/models/loading.py): full weights and a merged adapter
    # keep that precision; only the frozen base under an unmerged adapter is in the run's torch_dtype.
    dtype = DTYPES[source.dtype] if source.lora is not None and not merge_lora else torch.float32
    try:
        model = AutoModelForCausalLM.from_pretrained(
            agent_dir if full else base, dtype=dtype, local_files_only=True, use_safetensors=True
        )
        tokenizer = load_tokenizer(base)
        if source.lora is not None:
            with quiet_peft_wrapping():  # peft reads a deprecated transformers flag: a FutureWarning per load
                model = PeftModel.from_pretrained(model, str(agent_dir))
            if merge_lora:
                model = model.merge_and_unload()
    except (ArtifactError, ConfigError):
        raise
    except Exception as exc:  # a truncated or edited weights file: the loaders' own errors name no fix
        raise ArtifactError(
            f"{agent_dir}: cannot be loaded ({type(exc).__name__}: {str(exc)[:200]}); the checkpoint is damaged: "
            "`pbrl status` names it, and `pbrl stage update-policies --run <run> --round <r> --force` writes it again"
        ) from None
    for config in (model.config, model.generation_config):  # as the run's loader fills them (pad = EOS when none)
        if getattr(config, "pad_token_id", None) is None:
            config.pad_token_id = tokenizer.pad_token_id
    contiguous_head_input(model)  # a user sampling from a bfloat16 base on the CPU: no copy of the head per row
    return TrainedAgent(model.eval(), tokenizer)


def export_agents(
    run_dir: str | Path,
    out: str | Path,
    round: int | None = None,
    *,
    merge_lora: bool = False,
) -> list[Path]:
    """Write every agent's policy after round ``round`` (default: the newest that has weights) as a Hugging Face
    folder ``<out>/agent_<i>/``, loadable with ``AutoModelForCausalLM.from_pretrained`` (full or merged weights) or
    ``peft.AutoPeftModelForCausalLM.from_pretrained`` (an adapter; its ``base_model_name_or_path`` is the hub id the
    run named, else the local base folder), with the tokenizer and a model card
    (:func:`pbrl.run.model_card.model_card`).
    ``push_to_hub`` then uploads one as it is (``model.push_to_hub("me/agent-0")`` after loading it).

    A new ``out`` is assembled under a temporary name and renamed into place; an earlier export in ``out`` (it has
    ``pbrl-export.json``) has its own files replaced and nothing else (:mod:`pbrl.run.export_target`); any other
    non-empty folder is refused. Every file gets the modes of the process's umask.

    Returns:
        The agent folders, in agent order.

    Raises:
        ConfigError: ``out`` cannot take the export (:func:`pbrl.run.export_target.export_target`), or ``round`` is
            not a round of the run (both named).
        ArtifactError: run.json or the round's checkpoint is missing, incomplete or damaged, or ``out`` cannot be
            written (permissions, a full disk).
    """
    out = Path(out)
    earlier = export_target(out, Path(run_dir))
    job = stored_job(run_dir)
    paths = RunPaths(run_dir)
    round_index = trained_round(run_dir, round)
    checkpoint = policy_checkpoint(paths, round_index)

    def write(folder: Path) -> None:
        _write_export(folder, job, paths, round_index, checkpoint, merge_lora)

    try:
        if earlier is None:
            with atomic_dir(out) as tmp:  # a new (or empty) folder: renamed into place whole
                write(tmp)
        else:
            replace_export(out, earlier, write)
    except OSError as exc:  # a target that cannot be written (permissions, a full disk): one line naming it
        raise ArtifactError(f"{out}: the export cannot be written there ({exc.strerror or exc})") from None
    return [out / f"agent_{i}" for i in range(policy_source(job).num_agents)]


def _write_export(
    folder: Path, job: JobConfig, paths: RunPaths, round_index: int, checkpoint: Path, merge_lora: bool
) -> None:
    """Write every agent's folder and, last, ``pbrl-export.json`` (with every file written) into ``folder``."""
    source = policy_source(job)
    run = read_json(paths.run_json)
    for agent in range(source.num_agents):
        loaded = _load_agent(source, agent, checkpoint, merge_lora)
        target = folder / f"agent_{agent}"
        if source.lora is not None and not merge_lora and hub_id(source.models[agent]):
            loaded.model.peft_config["default"].base_model_name_or_path = source.models[agent]
        save_pretrained_stably(loaded.model, target)  # the same adapter_config.json bytes in every process
        # saved as the run used it: transformers saves the init kwargs, not the attribute set after loading
        loaded.tokenizer.init_kwargs["padding_side"] = loaded.tokenizer.padding_side
        loaded.tokenizer.save_pretrained(target)
        card = model_card(job, run, paths, round_index, checkpoint, agent, merge_lora=merge_lora)
        (target / CARD_FILE).write_text(card, encoding="utf-8")
        del loaded
    written = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    write_json(
        folder / EXPORT_FILE,
        {
            "run": paths.root.resolve().name,
            "run_id": run.get("run_id"),
            "round": round_index,
            "checkpoint": paths.rel(checkpoint),
            "trainer": job.trainer,
            "agents": [f"agent_{i}" for i in range(source.num_agents)],
            "lora": source.lora is not None,
            "merged": bool(merge_lora and source.lora is not None),
            "files": [*written, EXPORT_FILE],  # what a later export may replace; nothing else is touched
        },
    )
    usual_modes(folder)
