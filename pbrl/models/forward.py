"""How a model's forward passes run: eval mode (dropout off) for sampling and scoring, training forwards with
seeded dropout masks, and the distinct prompts of a batch (each prefilled once)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from pbrl.models.precision import Precision, autocast


@contextmanager
def eval_mode(model: nn.Module) -> Iterator[nn.Module]:
    """Put every submodule of ``model`` in eval mode (dropout off) and restore each one's mode afterwards.

    Restores the modes module by module, so a model whose parts were in different modes (e.g. a frozen
    backbone kept in eval under a training head) comes back exactly as it was. Gradient mode is untouched.
    """
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield model
    finally:
        for module, was_training in modes:
            module.training = was_training


def has_dropout(model: torch.nn.Module) -> bool:
    """True when ``model`` holds a dropout module with p > 0 (e.g. peft's ``lora_dropout``)."""
    kinds = (
        torch.nn.Dropout,
        torch.nn.Dropout1d,
        torch.nn.Dropout2d,
        torch.nn.Dropout3d,
        torch.nn.AlphaDropout,
        torch.nn.FeatureAlphaDropout,
    )
    return any(isinstance(m, kinds) and m.p > 0 for m in model.modules())


def _cuda_indices(model: torch.nn.Module) -> list[int]:
    """The CUDA devices holding ``model``'s resident parameters (several when accelerate split it)."""
    indices = set()
    for param in model.parameters():
        if param.device.type == "cuda":
            indices.add(param.device.index if param.device.index is not None else torch.cuda.current_device())
    return sorted(indices)


@contextmanager
def training_forward(model: torch.nn.Module, seed: int, precision: Precision | None = None) -> Iterator[None]:
    """Inside the block, every forward of ``model`` runs in train mode, so its dropout takes effect, with
    masks drawn from torch's RNG seeded with ``seed``: the same seed gives the same masks (a resumed run
    is bitwise identical), and the global RNG state is restored on exit (``torch.random.fork_rng``).
    With ``precision`` (``mixed_precision`` bf16/fp16), the forwards also run under its autocast
    (:func:`pbrl.models.precision.autocast`); the float32 master weights are not cast.

    Score with ``sequence_logprobs(..., dropout=True)`` inside the block (it otherwise forces eval mode).
    Every submodule's mode is restored on exit. Backward draws no random numbers (the masks are saved by
    the forward). A model split over several GPUs by ``agent_devices: auto`` gets ``seed`` on each of them.
    """
    modes = [(module, module.training) for module in model.modules()]
    cuda = _cuda_indices(model)
    model.train()
    try:
        with torch.random.fork_rng(devices=cuda), autocast(precision):
            torch.random.default_generator.manual_seed(seed)
            for index in cuda:
                with torch.cuda.device(index):
                    torch.cuda.manual_seed(seed)
            yield
    finally:
        for module, was_training in modes:
            module.training = was_training


def distinct_prompts(prompt_ids: Sequence[Sequence[int]]) -> tuple[list[list[int]], list[int]]:
    """The distinct prompts in first-seen order and, per row, the index of its prompt among them."""
    index: dict[tuple[int, ...], int] = {}
    distinct: list[list[int]] = []
    rows = []
    for prompt in prompt_ids:
        key = tuple(int(i) for i in prompt)
        if key not in index:
            index[key] = len(distinct)
            distinct.append(list(key))
        rows.append(index[key])
    return distinct, rows


def pad_rows(
    rows: Sequence[Sequence[int]], pad_token_id: int, padding_side: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token rows as one padded batch: (b, t) ids, mask and position ids, and (b,) the index of each row's last
    token. Masks and positions come from the row lengths, never from comparing ids with the pad id (pad may equal
    EOS). Raises ValueError for an unknown ``padding_side`` or an empty row."""
    if padding_side not in ("left", "right"):
        raise ValueError(f"padding_side: got {padding_side!r}; allowed: left, right")
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.long)
    if len(rows) == 0 or int(lengths.min()) == 0:
        raise ValueError("joint input ids: every row needs at least one token")
    width = int(lengths.max())
    offsets = width - lengths if padding_side == "left" else torch.zeros_like(lengths)
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)  # (b, t)
    mask = torch.zeros((len(rows), width), dtype=torch.long)  # (b, t)
    for r, row in enumerate(rows):
        start = int(offsets[r])
        input_ids[r, start : start + len(row)] = torch.tensor(list(row), dtype=torch.long)
        mask[r, start : start + len(row)] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # (b, t)
    return input_ids, mask, positions, offsets + lengths - 1
