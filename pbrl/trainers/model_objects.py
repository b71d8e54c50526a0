"""Model objects given to the Python trainers (``agents=[model, ...]``, ``agent_model=model``) and their
``peft_config`` (docs/guides/python-api.md#the-python-api).

Model objects are checked, given their tokenizers, and saved once, by content, under ``<storage>/models/objects/``
(``PBRL_STORAGE``, else ``./storage``), and the run names them ``model-object:<name>`` (never an absolute path), so
every stage, ``pbrl stage`` and ``pbrl train --resume`` load them as any local model, wherever the storage moved. A
``peft.LoraConfig`` becomes pbrl's LoRA options (``lora_r``, ``lora_alpha``, ``lora_dropout``,
``lora_target_modules``); what pbrl's LoRA cannot do is named.
"""

from __future__ import annotations

import dataclasses
import hashlib
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, PeftModel
from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING
from transformers import AutoConfig, PreTrainedModel, PreTrainedTokenizerBase

from pbrl.data.storage import atomic_dir, hash_path
from pbrl.errors import ConfigError, Problem
from pbrl.models.loading import load_tokenizer, resolve_model_source
from pbrl.models.packaged import MODEL_OBJECT_PREFIX, model_object_dir

# LoraConfig fields pbrl's LoRA takes (pbrl.models.lora.LoraSettings) or that change nothing; any other set to a
# value other than peft's default is refused.
_LORA_FIELDS = {"r", "lora_alpha", "lora_dropout", "target_modules"}
_LORA_INERT = {"task_type", "peft_type", "auto_mapping", "peft_version", "base_model_name_or_path", "revision"}
_LORA_INERT |= {"inference_mode", "runtime_config"}


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


def save_model_object(model: PreTrainedModel, tokenizer: Any, root: Path | None = None) -> str:
    """Save ``model`` (safetensors) and ``tokenizer`` once, by content, to ``<root>/models/objects/<class>-<hash>/``
    (root: the storage root, ``PBRL_STORAGE`` or ``./storage``); an equal object saved before is not written again.

    Returns:
        Its name in a run's config, ``model-object:<class>-<hash>``: resolved against the storage root where it is
        used (:func:`pbrl.models.loading.resolve_model_source`), so the run folder names no absolute path and a
        moved storage keeps working with ``PBRL_STORAGE``.

    Raises:
        ArtifactError: the disk is full (named).
    """
    name = f"{type(model).__name__}-{_model_digest(model, tokenizer)[:16]}"
    folder = model_object_dir(MODEL_OBJECT_PREFIX + name, root)
    if not (folder / "config.json").is_file():
        with atomic_dir(folder) as tmp:
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
    return MODEL_OBJECT_PREFIX + name


def _check_model(field: str, model: Any) -> list[Problem]:
    if isinstance(model, PeftModel):
        return [Problem(field, type(model).__name__, "a peft model: give its base model with peft_config, or merge it "
                        "first (model.merge_and_unload())")]  # fmt: skip
    if isinstance(model, PreTrainedModel):
        placed = {p.device.type for p in model.parameters()}
        if "meta" in placed:
            return [Problem(field, type(model).__name__, "its weights are on the meta device (never loaded): load "
                            "them (from_pretrained without init_empty_weights or device_map='meta')")]  # fmt: skip
        return []
    if isinstance(model, (str, Path)):
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


def model_objects(
    agents: Sequence[Any] | None, agent_model: Any, tokenizers: Any
) -> tuple[dict[str, tuple[PreTrainedModel, Any]], list[Problem]]:
    """``{"agents[i]" | "agent_model": (model, tokenizer)}`` of the model objects among the agents, and the
    problems of the model and tokenizer arguments."""
    if agents is not None and (isinstance(agents, (str, Path, PreTrainedModel)) or not isinstance(agents, Sequence)):
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


# ---------------------------------------------------------------------------------------------- peft_config
def lora_options(peft_config: Any) -> tuple[dict[str, Any], list[Problem]]:
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


def peft_lora_options(
    peft_config: LoraConfig | None, run_options: Mapping[str, Any]
) -> tuple[dict[str, Any], list[Problem]]:
    """The LoRA options of ``peft_config`` ({} without one; :func:`lora_options`) and their problems, with one for
    each of them also given as a run option (``run_options``: the trainer's other run-level options)."""
    if peft_config is None:
        return {}, []
    lora, problems = lora_options(peft_config)
    problems += [
        Problem(k, run_options[k], "give LoRA settings either as peft_config or as lora_* options, not both")
        for k in lora
        if k in run_options
    ]
    return lora, problems


def peft_default_targets(model_dir: Path) -> list[str]:
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
