"""The job unpacked into the settings records that pbrl's components take (config stays at the edge: the library
packages below :mod:`pbrl.run` take these records or plain values, never the job).

Each record holds plain values: :class:`~pbrl.models.policies.PolicySource` (how the agents load),
:class:`~pbrl.models.policies.AgentTraining` (how an agent trains), :class:`~pbrl.distributed.shards.RaySettings`
(where Ray work runs), :class:`RunOutputs` (the folders an iterative run writes outside its own),
:class:`RewardBackbone` (MARLHF's reward-model options that preflight checks) and the centralized adapter of
``collaboration_mode: centralized``. An option only some trainers have is read after an ``isinstance`` check on
the job groups of :mod:`pbrl.config.models` (``IterativeJob``, ``RewardModelJob``), so a grep for
``job.<option>`` finds every read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pbrl.config import IterativeJob, JobConfig, RewardModelJob, is_centralized, num_actors
from pbrl.distributed.shards import RaySettings
from pbrl.generation.centralized import CentralizedAdapter, load_adapter
from pbrl.generation.sampling import SamplingSettings
from pbrl.models.loading import resolve_devices
from pbrl.models.lora import LoraSettings
from pbrl.models.placement import normalize_max_memory, placement_spec
from pbrl.models.policies import AgentTraining, PolicySource
from pbrl.models.precision import AUTO, PrecisionChoice, resolve_precision
from pbrl.models.threads import configure_threads


def float32_job(job: JobConfig) -> bool:
    """Whether ``job`` computes in float32 only: ``torch_dtype`` float32 and ``mixed_precision`` no, as resolved for
    this machine."""
    job, _ = concrete_precision(job)
    return job.torch_dtype == "float32" and job.mixed_precision == "no"


def configure_job_threads(job: JobConfig) -> int:
    """torch's threads in a process that runs ``job``'s stages (:func:`pbrl.models.threads.configure_threads`):
    ``num_threads``, else the CPUs the process owns, following the load where the job computes in float32 only
    (:func:`float32_job`). Returns the count in use."""
    return configure_threads(job.num_threads, float32=float32_job(job))


def policy_source(job: JobConfig) -> PolicySource:
    """The job's agent fields (``agents`` or ``agent_model`` × the actors: ``num_agents``, or 1 with
    ``collaboration_mode: centralized``; ``lora_*``, ``torch_dtype``, ``agent_devices`` placed by
    ``parallel_training``, ``mixed_precision``, ``max_memory``) as a :class:`PolicySource`."""
    job, _ = concrete_precision(job)  # a run's stored job is concrete already; an in-memory one resolves here
    lora = None
    if job.lora_r is not None:
        kwargs: dict[str, Any] = {"r": job.lora_r, "alpha": job.lora_alpha, "dropout": job.lora_dropout}
        if job.lora_target_modules:
            kwargs["target_modules"] = tuple(job.lora_target_modules)
        lora = LoraSettings(**kwargs)
    # One policy per agent; one actor (agent_0) for every role in centralized collaboration.
    models = tuple(job.agents) if job.agents else (str(job.agent_model),) * num_actors(job)
    # parallel_training 'none' puts every agent on the first device, 'mp' agent i on device i (reference).
    spec = placement_spec(job.agent_devices, job.parallel_training)
    devices = spec if spec is None or isinstance(spec, str) else tuple(spec)
    return PolicySource(
        models=models,
        lora=lora,
        dtype=job.torch_dtype,
        devices=devices,
        mixed_precision=job.mixed_precision,
        max_memory=normalize_max_memory(job.max_memory),
    )


def sampling_settings(job: JobConfig, batch_size: int | None = None) -> SamplingSettings:
    """The job's sampling fields as plain values, ``batch_size`` rows per generate call (default
    ``generation_batch_size``; evaluation passes ``eval_batch_size``)."""
    return SamplingSettings(
        max_new_tokens=job.max_new_tokens,
        temperature=job.temperature,
        top_p=job.top_p,
        top_k=job.top_k,
        batch_size=job.generation_batch_size if batch_size is None else batch_size,
    )


def agent_training(job: JobConfig) -> AgentTraining:
    """How each agent trains: its policy source, ``agent_learning_rate`` and ``gradient_checkpointing``."""
    return AgentTraining(
        policy_source(job), learning_rate=job.agent_learning_rate, gradient_checkpointing=job.gradient_checkpointing
    )


def ray_settings(job: JobConfig) -> RaySettings:
    """``ray_address`` and ``shard_size`` of the job."""
    return RaySettings(address=job.ray_address, shard_size=job.shard_size)


def centralized_adapter(job: JobConfig) -> CentralizedAdapter | None:
    """The adapter that splits a centralized actor's joint response into roles (``comparator_centralized_adapter``;
    None in the option = ``<agent_i>`` sections); None when every agent writes its own response.

    Raises:
        ConfigError: the adapter's import path does not import or lacks its methods.
    """
    if not is_centralized(job):
        return None
    return load_adapter(job.comparator_centralized_adapter)


@dataclass(frozen=True)
class RunOutputs:
    """The folders an iterative run writes outside its own: ``preference_replay_dir`` (None: ``<run>/replay``) and
    ``policy_checkpoint_dir`` (None: no export). Both None for the base trainers, which have neither option."""

    replay_dir: str | None = None
    policy_checkpoint_dir: str | None = None


def run_outputs(job: JobConfig) -> RunOutputs:
    """The job's :class:`RunOutputs`."""
    if isinstance(job, IterativeJob):
        return RunOutputs(replay_dir=job.preference_replay_dir, policy_checkpoint_dir=job.policy_checkpoint_dir)
    return RunOutputs()


@dataclass(frozen=True)
class RewardBackbone:
    """MARLHF's reward-model options that preflight checks against the backbone's config: ``reward_model_name``
    (None: the first agent's model), ``reward_backbone_layers`` and ``reward_max_length`` (None: unset)."""

    model_name: str | None
    backbone_layers: int | None
    max_length: int | None


def reward_backbone(job: JobConfig) -> RewardBackbone | None:
    """The job's :class:`RewardBackbone`; None for the MADPO trainers, which fit no reward model."""
    if not isinstance(job, RewardModelJob):
        return None
    return RewardBackbone(job.reward_model_name, job.reward_backbone_layers, job.reward_max_length)


# ---------------------------------------------------------------------------------------------- auto precision
def _precision(source: JobConfig | PrecisionChoice) -> dict[str, str]:
    """``torch_dtype`` and ``mixed_precision`` of a job or a :class:`PrecisionChoice`, by option name."""
    return {"torch_dtype": source.torch_dtype, "mixed_precision": source.mixed_precision}


def agent_device(job: JobConfig) -> str:
    """The first agent's device, the one ``auto`` precision is resolved for (``agent_devices: auto`` places
    with accelerate: CUDA when there is one)."""
    device = resolve_devices(job.agent_devices, job.num_agents)[0]
    if device == "auto":
        return "cuda:0" if torch.cuda.is_available() else "cpu"
    return device


def concrete_precision(job: JobConfig, stored: JobConfig | None = None) -> tuple[JobConfig, PrecisionChoice | None]:
    """``job`` with ``torch_dtype: auto`` / ``mixed_precision: auto`` made concrete: what a stored run recorded
    (``stored``: resuming keeps the run's choice, whatever this machine has), else what the agents' device
    computes natively (:func:`pbrl.models.precision.resolve_precision`). Returns the job and the choice made
    here (None when nothing was ``auto``, or the stored run decided)."""
    autos = [f for f, value in _precision(job).items() if value == AUTO]
    if not autos:
        return job, None
    if stored is not None:
        recorded = _precision(stored)
        return job.model_copy(update={f: recorded[f] for f in autos}), None
    choice = resolve_precision(job.torch_dtype, job.mixed_precision, agent_device(job))
    chosen = _precision(choice)
    return job.model_copy(update={f: chosen[f] for f in autos}), choice


def describe_precision(choice: PrecisionChoice | None, torch_dtype: str, mixed_precision: str) -> str | None:
    """The line a run prints when ``auto`` was resolved (``choice``; ``torch_dtype`` and ``mixed_precision`` as the
    job now holds them), e.g. ``precision: torch_dtype auto -> float32, mixed_precision auto -> no (this CPU has none
    of avx512_bf16, amx_bf16)``."""
    if choice is None:
        return None
    return f"precision: torch_dtype auto -> {torch_dtype}, mixed_precision auto -> {mixed_precision} ({choice.reason})"
