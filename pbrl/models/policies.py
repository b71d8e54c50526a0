"""How each agent's policy is stored and loads: the initial checkpoint, a round checkpoint's files, and loading
and saving an agent from a checkpoint folder given as a plain path (which checkpoint holds the policy after a round
is run-folder knowledge: :func:`pbrl.run.policy_records.policy_checkpoint`).

Library code here takes plain values: a :class:`PolicySource` says how the agents' policies load (model
sources, LoRA settings, dtype, devices); stages build it from their job with :meth:`PolicySource.from_job`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pbrl.data.seeds import derive_seed
from pbrl.data.storage import RunPaths, atomic_path, hash_path, read_json, write_json
from pbrl.errors import ArtifactError
from pbrl.models.loading import (
    init_lora_adapter,
    load_policy,
    load_tokenizer,
    resolve_devices,
    resolve_model_source,
    save_agent,
)
from pbrl.models.lora import LoraSettings
from pbrl.models.placement import AUTO, main_device
from pbrl.models.precision import Precision, load_precision_state, make_precision, save_precision_state

TRAINER_STATE = "trainer_state.json"  # written last in checkpoints/round_<r>/: its presence marks completeness
SOURCE_FILE = "source.json"  # written last in checkpoints/initial/agent_<i>/
OPTIMIZER_FILE = "optimizer.pt"  # an agent's AdamW state in a round checkpoint's agent_<i>/


@dataclass
class TrainablePolicy:
    """An agent being trained: its model (float32 trainable parameters), AdamW, pad id, and the mixed precision
    of its training forwards and steps (None: float32, see :mod:`pbrl.models.precision`)."""

    model: Any
    optimizer: torch.optim.Optimizer
    pad_token_id: int
    precision: Precision | None = None


def trainable_parameters(model: Any) -> list[torch.nn.Parameter]:
    """The parameters of ``model`` that require gradients (the LoRA adapter, or every weight), in order."""
    return [p for p in model.parameters() if p.requires_grad]


@dataclass(frozen=True)
class PolicySource:
    """How the agents' policies load, as plain values.

    Attributes:
        models: one model source per agent (a packaged alias, a local folder or a cached hub id).
        lora: LoRA settings, or None for full fine-tuning.
        dtype: dtype of frozen weights, ``"float32" | "bfloat16" | "float16"`` (trainable parameters are
            always float32, see :func:`pbrl.models.loading.load_model`).
        devices: the agents' devices: one device for all, one per agent, ``"auto"`` (accelerate's device map
            within ``max_memory``, :func:`pbrl.models.placement.auto_device_map`), or None (CUDA if available).
        mixed_precision: autocast of training forwards, ``"no" | "bf16" | "fp16"`` (:mod:`pbrl.models.precision`).
        max_memory: accelerate's per-device limits for ``"auto"`` placement (``{0: "10GiB", "cpu": "30GiB"}``);
            None = all free memory.
    """

    models: tuple[str, ...]
    lora: LoraSettings | None = None
    dtype: str = "float32"
    devices: str | tuple[str, ...] | None = None
    mixed_precision: str = "no"
    max_memory: dict[int | str, int | str] | None = None

    @property
    def num_agents(self) -> int:
        return len(self.models)


@dataclass(frozen=True)
class AgentTraining:
    """How an agent trains: its policy source, AdamW's learning rate and activation checkpointing (plain values)."""

    source: PolicySource
    learning_rate: float
    gradient_checkpointing: bool = False


def write_initial_checkpoints(paths: RunPaths, source: PolicySource, *, seed: int) -> None:
    """checkpoints/initial/agent_<i>/: the initial LoRA adapter (seeded from ``seed``, the run seed, by
    :func:`pbrl.data.seeds.derive_seed`), or only ``source.json`` naming the base weights and their content hash
    (full fine-tuning keeps no second copy of the base model). An agent folder whose ``source.json``
    exists is complete and kept."""
    for i, model in enumerate(source.models):
        agent_dir = paths.initial / f"agent_{i}"
        if (agent_dir / SOURCE_FILE).is_file():
            continue
        resolved = resolve_model_source(model)
        if source.lora is not None:
            init_lora_adapter(
                resolved, source.lora, agent_dir, seed=derive_seed(seed, round_index=0, stage="init-lora", agent=i)
            )
        base_hash = hash_path(Path(resolved)) if Path(str(resolved)).exists() else str(resolved)
        write_json(agent_dir / SOURCE_FILE, {"source": model, "resolved": str(resolved), "hash": base_hash})


def read_trainer_state(checkpoint: Path) -> dict[str, Any]:
    """The trainer state stored with a round checkpoint ({} for the initial one)."""
    path = checkpoint / TRAINER_STATE
    return read_json(path) if path.is_file() else {}


@dataclass(frozen=True)
class AgentPolicy:
    """A loaded policy; ``device`` is where its inputs go (with ``"auto"`` placement, the main device of its
    device map)."""

    model: Any
    tokenizer: Any
    device: str


def load_agent(
    source: PolicySource,
    agent: int,
    checkpoint: Path,
    *,
    trainable: bool,
    devices: str | list[str] | tuple[str, ...] | None = None,
) -> AgentPolicy:
    """Load agent ``agent``'s policy as stored in ``checkpoint`` (``checkpoints/initial`` or a round's) on its
    device (from ``devices`` when given, e.g. comparator_devices, else ``source.devices``); ``"auto"`` places it
    with accelerate within ``source.max_memory``. Use :func:`trainable_policy` to train it.

    A full fine-tuning checkpoint's ``agent_<i>/`` holds a model folder (``config.json``); the initial one
    holds only ``source.json`` and loads the base weights. A LoRA checkpoint holds the adapter.

    Raises:
        ArtifactError: ``agent_<i>/`` is missing or holds the other kind of weights (adapter vs full model).
    """
    resolved = resolve_model_source(source.models[agent])
    spec = devices if devices is not None else source.devices
    device = resolve_devices(list(spec) if isinstance(spec, tuple) else spec, source.num_agents)[agent]
    agent_dir = Path(checkpoint) / f"agent_{agent}"
    ckpt_dir: Path | None = agent_dir
    if source.lora is None and (agent_dir / SOURCE_FILE).is_file() and not (agent_dir / "config.json").is_file():
        ckpt_dir = None  # the initial policy of full fine-tuning: the base weights
    model = load_policy(
        resolved,
        checkpoint_dir=ckpt_dir,
        lora=source.lora,
        device=device,
        dtype=source.dtype,
        trainable=trainable,
        max_memory=source.max_memory,
    )
    if device == AUTO:
        device = main_device(model.hf_device_map)
    return AgentPolicy(model=model, tokenizer=load_tokenizer(resolved), device=device)


def trainable_policy(
    source: PolicySource, policy: AgentPolicy, *, learning_rate: float, state_dir: Path | None = None
) -> TrainablePolicy:
    """``policy`` (loaded with ``trainable=True``) ready to train: AdamW over its trainable parameters (on their
    devices, wherever placement put them; ``weight_decay=0``: a pair that carries no preference signal must not
    move the weights) and its mixed precision (``source.mixed_precision`` on ``policy.device``).

    ``state_dir`` (a checkpoint's ``agent_<i>/``): restore ``optimizer.pt`` and, for fp16, ``grad_scaler.pt``
    when present, so a resumed run continues bitwise. Save both with :func:`save_training_state`.

    Raises:
        ValueError: naming ``mixed_precision``, when it cannot autocast on the policy's device.
    """
    optimizer = torch.optim.AdamW(trainable_parameters(policy.model), lr=learning_rate, weight_decay=0.0)
    precision = make_precision(source.mixed_precision, policy.device)
    if state_dir is not None:
        if (Path(state_dir) / OPTIMIZER_FILE).is_file():
            optimizer.load_state_dict(load_optimizer_state(Path(state_dir) / OPTIMIZER_FILE))
        load_precision_state(precision, Path(state_dir))
    return TrainablePolicy(policy.model, optimizer, policy.tokenizer.pad_token_id, precision)


def save_training_state(policy: TrainablePolicy, agent_dir: Path) -> None:
    """Write ``optimizer.pt`` (and, for fp16, ``grad_scaler.pt``) into ``agent_dir``, atomically each."""
    save_optimizer(policy.optimizer, Path(agent_dir) / OPTIMIZER_FILE)
    save_precision_state(policy.precision, Path(agent_dir))


def trainable_agent(training: AgentTraining, start: Path, agent: int) -> tuple[TrainablePolicy, Any]:
    """Agent ``agent``'s policy at ``start``, trainable, with its AdamW (weight_decay=0), mixed precision and the
    optimizer/grad-scaler state stored beside the weights, activation checkpointing on with
    ``gradient_checkpointing``; and its tokenizer. Also what a Ray actor loads (:mod:`pbrl.distributed.ray_agents`)."""
    policy = load_agent(training.source, agent, start, trainable=True)
    trainable = trainable_policy(
        training.source, policy, learning_rate=training.learning_rate, state_dir=start / f"agent_{agent}"
    )
    if training.gradient_checkpointing:  # recompute activations in backward (transformers' option)
        trainable.model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    return trainable, policy.tokenizer


def write_agent(policy: TrainablePolicy, agent_dir: Path) -> None:
    """A checkpoint's ``agent_<i>/``: the weights (or adapter), ``optimizer.pt`` (+ ``grad_scaler.pt`` with fp16)."""
    save_agent(policy.model, agent_dir)
    save_training_state(policy, agent_dir)


def save_optimizer(optimizer: torch.optim.Optimizer, path: Path) -> None:
    """Write ``optimizer.state_dict()`` with ``torch.save`` atomically (temporary file, then rename)."""
    with atomic_path(Path(path)) as tmp:  # a full disk is named (pbrl.data.storage)
        torch.save(optimizer.state_dict(), tmp)


def load_optimizer_state(path: Path) -> dict[str, Any]:
    """Read an optimizer state dict with the safe loader (``weights_only=True``) onto the CPU.

    ``optimizer.load_state_dict`` then moves the state to each parameter's device.

    Raises:
        ArtifactError: the file is missing.
    """
    path = Path(path)
    if not path.is_file():
        raise ArtifactError(f"{path}: optimizer state missing")
    return torch.load(path, map_location="cpu", weights_only=True)
