"""Where the agents run: ``agent_devices`` read with ``parallel_training``, as the reference reads them.

The reference (CoMLRL ``MAGRPOTrainer`` device set-up; docs/reference/options.md#parallel_training): with
``parallel_training='none'`` every agent sits on **one** device, the first of ``agent_devices``; with ``'mp'``
agent i sits on device i of ``agent_devices`` (which ``'mp'`` requires; a one-device list is broadcast).
This module turns the two options into the device spec that the loaders resolve per agent.

``agent_devices: auto`` (and ``auto`` for the comparator, reference and reward-model devices) places each model
with accelerate's device-map machinery within ``max_memory`` (:func:`auto_device_map`): a model larger than one
device is split over the GPUs, or its frozen weights offloaded to CPU or disk.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import torch
from accelerate import infer_auto_device_map, init_empty_weights
from transformers import AutoConfig, AutoModelForCausalLM

from pbrl.errors import ConfigError, Problem

DeviceSpec = str | list[str] | None


def placement_spec(agent_devices: DeviceSpec, parallel_training: Literal["none", "mp"]) -> DeviceSpec:
    """The per-agent device spec: ``agent_devices`` itself with ``'mp'``; its first device with ``'none'``.

    Examples: (["cuda:0", "cuda:1"], "none") -> "cuda:0"; (["cuda:0", "cuda:1"], "mp") -> the list;
    ("cuda:1", either) -> "cuda:1"; (None, "none") -> None (the default device); ("auto", either) -> "auto"
    (each model placed by :func:`auto_device_map`).

    Raises:
        ValueError: ``'mp'`` without ``agent_devices``, an empty list, or an unknown ``parallel_training``.
    """
    if parallel_training not in ("none", "mp"):
        raise ValueError(f"parallel_training: got {parallel_training!r}; allowed: none, mp")
    if isinstance(agent_devices, list) and not agent_devices:
        raise ValueError("agent_devices: got []; give one device, or one per agent")
    if parallel_training == "mp":
        if agent_devices is None:
            raise ValueError("agent_devices: required with parallel_training='mp' (agent i runs on device i)")
        return agent_devices
    return agent_devices[0] if isinstance(agent_devices, list) else agent_devices


# ---------------------------------------------------------------------------------------------------------
# agent_devices: auto — accelerate's device-map machinery.

AUTO = "auto"  # a device option's value that places each model with accelerate's device map
MaxMemory = Mapping[int | str, int | str]  # accelerate's format: {0: "10GiB", "cpu": "30GiB"}; keys GPU index/cpu/disk
_OFFLOAD = "disk"


def normalize_max_memory(max_memory: MaxMemory | None) -> dict[int | str, int | str] | None:
    """``max_memory`` as accelerate reads it: digit-string keys become GPU indices (``{"0": "10GiB"}``, as a JSON
    round trip of the run's config writes ``{0: "10GiB"}``, -> ``{0: "10GiB"}``); other keys and sizes unchanged."""
    if max_memory is None:
        return None
    return {int(k) if isinstance(k, str) and k.isdigit() else k: v for k, v in max_memory.items()}


def main_device(device_map: Mapping[str, int | str]) -> str:
    """The device where an auto-placed model's inputs go and its offloaded weights execute: the first GPU of
    ``device_map`` (as accelerate's ``dispatch_model`` picks it), else ``"mps"``, else ``"cpu"``."""
    for value in device_map.values():
        if isinstance(value, int):
            return f"cuda:{value}"
    return "mps" if "mps" in device_map.values() else "cpu"


def _offloaded(value: int | str, main: str) -> bool:
    # accelerate offloads "disk" entries always, and "cpu" entries when the model executes on an accelerator.
    return value == _OFFLOAD or (value == "cpu" and main != "cpu")


def resident_modules(model: Any, *, trainable: bool, lora_targets: tuple[str, ...] | None) -> set[str]:
    """Names of the modules of ``model`` that must hold real weights on an execution device (never offloaded).

    - the input and output embeddings: inputs are placed on the embedding's device, and a tied head shares it;
    - with LoRA, every module an adapter wraps (peft matches ``target_modules`` entry ``e`` to module ``n`` when
      ``n == e`` or ``n`` ends with ``"." + e``): the adapter weights live beside the base weight, and an
      accelerate offload hook would swap them for its stored copy at every forward;
    - full fine-tuning of a trainable model: the whole model (``""``): an offloaded weight cannot be trained.
    """
    if trainable and lora_targets is None:
        return {""}
    names = {
        name
        for name, module in model.named_modules()
        if module is model.get_input_embeddings() or module is model.get_output_embeddings()
    }
    for name, _ in model.named_modules():
        if lora_targets and any(name == e or name.endswith("." + e) for e in lora_targets):
            names.add(name)
    return names


def keep_resident(
    model: Any,
    device_map: Mapping[str, int | str],
    resident: set[str],
    *,
    max_memory: MaxMemory | None = None,
    field: str = "agent_devices",
) -> dict[str, int | str]:
    """``device_map`` with every module of ``resident`` moved off an offloaded entry onto the main device.

    An offloaded entry that contains resident modules is split into its children (recursively), so only the
    resident ones move; the main device then holds more than its ``max_memory`` share by their size.

    Raises:
        ConfigError: naming ``max_memory`` (its value given only for the message), when the whole model must
            stay resident (full fine-tuning) but the map offloads part of it.
    """

    main = main_device(device_map)
    out: dict[str, int | str] = {}

    def place(name: str, value: int | str) -> None:
        inside = [r for r in resident if r == name or not name or r.startswith(name + ".")]
        if not _offloaded(value, main) or not inside:
            out[name] = value
            return
        if "" in resident:
            offloaded = sorted(k or "the whole model" for k, v in device_map.items() if _offloaded(v, main))
            raise ConfigError(
                [
                    Problem(
                        "max_memory",
                        max_memory,
                        f"{field}='auto' offloads "
                        f"{', '.join(offloaded[:4])}{' ...' if len(offloaded) > 4 else ''} to "
                        f"{value}, but full fine-tuning "
                        "trains every weight and an offloaded weight cannot be trained; raise "
                        "max_memory, add devices, or use LoRA (lora_r) so that only frozen base "
                        "weights are offloaded",
                    )
                ]
            )
        module = model.get_submodule(name)
        children = list(module.named_children())
        own = list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False))
        if name in resident or not children or own:
            out[name] = main if main == "cpu" or main == "mps" else int(main.split(":")[1])
            return
        for child, _ in children:
            place(f"{name}.{child}" if name else child, value)

    for name, value in device_map.items():
        place(name, value)
    return out


def auto_device_map(
    source: Path,
    *,
    dtype: torch.dtype,
    max_memory: MaxMemory | None,
    trainable: bool,
    lora_targets: tuple[str, ...] | None,
    field: str = "agent_devices",
) -> dict[str, int | str]:
    """accelerate's device map for the causal LM in folder ``source`` loaded in ``dtype``: its modules spread
    over the GPUs, then the CPU, then disk, within ``max_memory`` (accelerate's ``infer_auto_device_map``, never
    splitting a block the model lists in ``_no_split_modules``); the :func:`resident_modules` are kept on the
    main device. The model is built on the meta device: no weights are read.

    Raises:
        ConfigError: see :func:`keep_resident`.
    """

    config = AutoConfig.from_pretrained(source, local_files_only=True)
    with torch.random.fork_rng(devices=[]), init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.tie_weights()  # tied embeddings count once and land on one device
    device_map = infer_auto_device_map(
        model,
        max_memory=normalize_max_memory(max_memory),
        dtype=dtype,
        no_split_module_classes=list(model._no_split_modules or []),
    )
    resident = resident_modules(model, trainable=trainable, lora_targets=lora_targets)
    return keep_resident(model, device_map, resident, max_memory=max_memory, field=field)
