"""Where each agent's policy lives in a run: the initial checkpoint and the one after each round's update."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pbrl.config import JobConfig
from pbrl.models import (
    LoraSettings,
    init_lora_adapter,
    load_policy,
    load_tokenizer,
    resolve_devices,
    resolve_model_source,
)
from pbrl.seeds import derive_seed
from pbrl.storage import RunPaths, hash_path, read_json, write_json

TRAINER_STATE = "trainer_state.json"  # written last in checkpoints/round_<r>/: its presence marks completeness


def lora_settings(job: JobConfig) -> LoraSettings | None:
    """LoRA settings from the run config, or None for full fine-tuning."""
    if job.lora_r is None:
        return None
    kwargs: dict[str, Any] = {"r": job.lora_r, "alpha": job.lora_alpha, "dropout": job.lora_dropout}
    if job.lora_target_modules:
        kwargs["target_modules"] = tuple(job.lora_target_modules)
    return LoraSettings(**kwargs)


def agent_sources(job: JobConfig) -> list[str]:
    """One model source per agent (``agents``, or ``agent_model`` repeated)."""
    return list(job.agents) if job.agents else [job.agent_model] * job.num_agents  # type: ignore[list-item]


def write_initial_checkpoints(paths: RunPaths, job: JobConfig) -> None:
    """checkpoints/initial/agent_<i>/: the seeded initial LoRA adapter, or ``source.json`` naming the base
    weights and their content hash (full fine-tuning keeps no second copy of the base model)."""
    lora = lora_settings(job)
    for i, source in enumerate(agent_sources(job)):
        agent_dir = paths.initial / f"agent_{i}"
        if (agent_dir / "source.json").is_file():
            continue
        resolved = resolve_model_source(source)
        if lora is not None:
            seed = derive_seed(job.seed, round_index=0, stage="init-lora", agent=i)
            init_lora_adapter(resolved, lora, agent_dir, seed=seed)
        base_hash = hash_path(Path(resolved)) if Path(str(resolved)).exists() else str(resolved)
        write_json(agent_dir / "source.json", {"source": source, "resolved": str(resolved), "hash": base_hash})


def policy_checkpoint(paths: RunPaths, round_index: int) -> Path:
    """The policy after round ``round_index``'s update: the newest complete ``round_<k>`` with k <= round_index
    (a round without pairs writes none), else ``initial``. Later rounds on disk are never used."""
    for k in range(round_index, 0, -1):
        ckpt = paths.round_checkpoint(k)
        if (ckpt / TRAINER_STATE).is_file():
            return ckpt
    return paths.initial


def read_trainer_state(checkpoint: Path) -> dict[str, Any]:
    """The trainer state stored with a round checkpoint ({} for the initial one)."""
    path = checkpoint / TRAINER_STATE
    return read_json(path) if path.is_file() else {}


@dataclass(frozen=True)
class AgentPolicy:
    model: Any
    tokenizer: Any
    device: str


def load_agent(
    job: JobConfig,
    paths: RunPaths,
    agent: int,
    checkpoint: Path,
    *,
    trainable: bool,
    devices: str | list[str] | None = None,
) -> AgentPolicy:
    """Load agent ``agent``'s policy as stored in ``checkpoint`` (initial or a round) on its device
    (from ``devices`` when given, e.g. comparator_devices, else ``agent_devices``)."""
    source = agent_sources(job)[agent]
    resolved = resolve_model_source(source)
    device = resolve_devices(devices if devices is not None else job.agent_devices, job.num_agents)[agent]
    lora = lora_settings(job)
    agent_dir = checkpoint / f"agent_{agent}"
    if lora is not None:
        ckpt_dir: Path | None = agent_dir
    else:
        ckpt_dir = None if checkpoint == paths.initial else agent_dir
    model = load_policy(
        resolved, checkpoint_dir=ckpt_dir, lora=lora, device=device, dtype=job.torch_dtype, trainable=trainable
    )
    return AgentPolicy(model=model, tokenizer=load_tokenizer(resolved), device=device)
