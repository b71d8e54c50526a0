"""LoRA adapters (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models") through peft: the
settings, a model wrapped in a fresh or saved adapter, and the module names an adapter may target."""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, PeftConfig, PeftModel, get_peft_model, load_peft_weights, set_peft_model_state_dict
from transformers.pytorch_utils import Conv1D

from pbrl.errors import ArtifactError


@dataclass(frozen=True)
class LoraSettings:
    """LoRA hyper-parameters (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models")."""

    r: int
    alpha: int = 16
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")


# ---------------------------------------------------------------------------------------------------------
# Sources, tokenizers, models.


def save_pretrained_stably(model: Any, folder: Path) -> None:
    """``model.save_pretrained(folder)`` with every set-valued field of its peft configs (``target_modules``, ...)
    written as a sorted list, so that ``adapter_config.json`` is the same bytes in every process.

    peft keeps such fields as sets and writes them in the set's order, which follows Python's per-process string
    hashing (``PYTHONHASHSEED``): the demo's round-1 checkpoint folder hashed differently in two runs with bitwise
    equal weights (2026-12-04). The fields are restored after. A model without peft configs is saved as it is."""
    changed = []
    for config in getattr(model, "peft_config", {}).values():
        for name, value in vars(config).items():
            if isinstance(value, set):
                changed.append((config, name, value))
                setattr(config, name, sorted(value, key=str))
    try:
        model.save_pretrained(folder)
    finally:
        for config, name, value in changed:
            setattr(config, name, value)


@contextmanager
def quiet_peft_wrapping() -> Iterator[None]:
    """peft (0.x) reads the model's ``is_gradient_checkpointing`` when it wraps it, a property that transformers 5
    deprecated (a FutureWarning at every LoRA load): that concerns the pinned pair, not the user. Only that
    warning is silenced, and only around peft's wrapping calls."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield


def with_lora(model: Any, lora: LoraSettings, adapter_dir: Path | None, *, trainable: bool, seed: int | None) -> Any:
    """``model`` under a LoRA adapter: the one saved in ``adapter_dir`` (its settings checked against ``lora``),
    or a fresh one drawn from ``seed``. Only the adapter is trainable, and only when ``trainable``.

    Raises:
        ArtifactError: ``adapter_dir`` is not an adapter of these settings, or its weights do not fit.
        ValueError: neither ``adapter_dir`` nor ``seed`` is given.
    """
    if adapter_dir is not None:
        check_adapter(Path(adapter_dir), lora)
        if getattr(model, "hf_device_map", None) is None:
            with quiet_peft_wrapping():
                return PeftModel.from_pretrained(model, str(adapter_dir), is_trainable=trainable)
        # Placed by accelerate (device="auto"): PeftModel.from_pretrained would re-dispatch the model with a
        # device map of its own, offloading the adapted modules too; wrap it in place and load the weights.
        with quiet_peft_wrapping():
            peft_model = get_peft_model(model, PeftConfig.from_pretrained(str(adapter_dir)))
        result = set_peft_model_state_dict(peft_model, load_peft_weights(str(adapter_dir), device="cpu"))
        missing = [k for k in result.missing_keys if "lora_" in k]
        if missing or result.unexpected_keys:
            raise ArtifactError(
                f"{adapter_dir}: adapter weights do not fit the model (missing {missing[:3]}, "
                f"unexpected {list(result.unexpected_keys)[:3]})"
            )
        peft_model.requires_grad_(False)
        if trainable:
            for name, param in peft_model.named_parameters():
                param.requires_grad_("lora_" in name)
        return peft_model
    if seed is None:
        raise ValueError("a fresh LoRA adapter needs a seed; or pass adapter_dir written by init_lora_adapter")
    config = LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        task_type="CAUSAL_LM",
    )
    torch.manual_seed(seed)  # the caller forked the RNG, so the global stream is restored afterwards
    with quiet_peft_wrapping():
        peft_model = get_peft_model(model, config)
    if not trainable:
        peft_model.requires_grad_(False)
    return peft_model


def lora_module_names(model: torch.nn.Module) -> set[str]:
    """Names a LoRA ``target_modules`` entry may use for ``model``: every module that peft can adapt
    (``nn.Linear``, ``nn.Embedding``, ``nn.Conv1d/2d/3d``, transformers ``Conv1D``), by its full dotted
    name and by each dotted suffix of it (peft matches an entry ``e`` to a module named ``n`` when
    ``n == e`` or ``n`` ends with ``"." + e``).
    """
    adaptable = (torch.nn.Linear, torch.nn.Embedding, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d, Conv1D)
    names: set[str] = set()
    for name, module in model.named_modules():
        if name and isinstance(module, adaptable):
            parts = name.split(".")
            names.update(".".join(parts[i:]) for i in range(len(parts)))
    return names


def check_adapter(adapter_dir: Path, lora: LoraSettings) -> None:
    """Raises ArtifactError naming every setting in which the adapter saved in ``adapter_dir`` differs from ``lora``."""
    config_path = adapter_dir / "adapter_config.json"
    if not config_path.is_file():
        raise ArtifactError(f"{config_path}: missing; {adapter_dir} is not a LoRA adapter folder")
    stored = json.loads(config_path.read_text())
    expected = {
        "r": lora.r,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": sorted(lora.target_modules),
    }
    found = {key: stored.get(key) for key in expected}
    if isinstance(found["target_modules"], list):
        found["target_modules"] = sorted(found["target_modules"])
    diffs = [
        f"{key}: stored {found[key]!r}, configured {value!r}" for key, value in expected.items() if found[key] != value
    ]
    if diffs:
        raise ArtifactError(f"{config_path}: adapter built with other LoRA settings ({'; '.join(diffs)})")
