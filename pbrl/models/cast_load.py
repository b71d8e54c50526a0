"""Loading a checkpoint into a narrower dtype than it is stored in (float32 files as bfloat16 weights) without
holding the whole stored copy in memory (docs/results/benchmarks.md#precision-the-sampling-path-and-threads).

transformers' ``from_pretrained(dtype=torch.bfloat16)`` of a float32 safetensors file keeps the file mapped
while it casts: every page of the float32 copy is resident at once beside the bfloat16 weights, so loading
SmolLM2-135M (513 MiB stored) peaks 870 MiB above where it ends (measured 2026-12-02: peak RSS 1117 MiB,
606 MiB after). A demo round loads the agents' bases several times, and that transient set the round's peak
memory. Here the model is built empty (``transformers.initialization.no_init_weights``: nothing is randomly
initialised) and each group of at most :data:`GROUP_BYTES` stored bytes is read from a freshly opened file and
cast into its parameter, so at most one group of stored pages is resident (measured peak 642 MiB, the same
logits bit for bit). This is a narrow replacement of one step of ``from_pretrained``: it applies only where the
model's parameters and the files' tensors match one to one (tied weights aside); anything else (sharded index
without safetensors, extra or missing tensors, quantized or remote-code models) goes through
``from_pretrained`` unchanged.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig
from transformers.initialization import no_init_weights

GROUP_BYTES = 64 * 2**20  # stored bytes read per opening of a file: the most of the stored copy resident at once
_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}  # safetensors' dtype names


def _stored_tensors(src: Path) -> dict[str, tuple[Path, torch.dtype]] | None:
    files = sorted(src.glob("*.safetensors"))
    if not files:
        return None
    found: dict[str, tuple[Path, torch.dtype]] = {}
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                found[name] = (path, _DTYPES.get(f.get_slice(name).get_dtype()))
    return found


def load_cast(src: Path, dtype: torch.dtype) -> Any | None:
    """``AutoModelForCausalLM`` of the local folder ``src`` with its weights cast to ``dtype``, in eval mode, on
    the CPU, read group by group (see the module docstring); None when this path does not apply: the stored
    floating tensors are already ``dtype``, the folder has no safetensors, or the files' tensors are not the
    model's parameters and persistent buffers one to one (the caller then uses ``from_pretrained``).

    The model's generation config is read from the folder as ``from_pretrained`` does. Raises what
    ``AutoConfig.from_pretrained`` raises for an unreadable config.
    """
    stored = _stored_tensors(src)
    if stored is None or all(d in (dtype, None) for _, d in stored.values()):
        return None
    config = AutoConfig.from_pretrained(src, local_files_only=True)
    if getattr(config, "quantization_config", None) is not None:
        return None
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.tie_weights()  # tied weights: one tensor under each name, filled once
    state = model.state_dict()
    if not set(stored) <= set(state) or any(name not in stored for name in _untied(state)):
        return None
    groups: list[list[str]] = [[]]
    size = 0
    for name in stored:
        nbytes = state[name].numel() * torch.finfo(stored[name][1] or torch.float32).bits // 8
        if groups[-1] and size + nbytes > GROUP_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    with torch.no_grad():
        for group in groups:
            for path in sorted({stored[n][0] for n in group}):
                with safe_open(path, framework="pt") as f:
                    for name in (n for n in group if stored[n][0] == path):
                        state[name].copy_(f.get_tensor(name))
    model.config._name_or_path = str(src)
    if (src / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(src, local_files_only=True)
    return model.eval()


def _untied(state: dict[str, torch.Tensor]) -> list[str]:
    """The state's names that must come from the files: one name per distinct tensor (a tied output embedding
    shares the input embedding's tensor and is filled with it)."""
    seen: set[int] = set()
    names = []
    for name, tensor in state.items():
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            names.append(name)
    return names
