"""Building, saving and loading MARLHF's joint reward model (:class:`~pbrl.learning.reward_model.JointRewardModel`):
:class:`RewardModelSpec` (plain values a stage unpacks from its job), :func:`new_reward_model`,
:func:`save_reward_model` (safetensors only) and :func:`load_reward_model` (safe loaders only)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModel

from pbrl.data.storage import atomic_dir, read_json, write_json
from pbrl.learning.joint_template import TEMPLATE_VERSION
from pbrl.learning.prompt_overlap import Decode, JointWordOverlap, PromptOverlap
from pbrl.learning.reward_model import HeadExtras, JointRewardModel
from pbrl.models.forward import keep_first_layers
from pbrl.models.loading import load_tokenizer, resolve_model_source, shared_backbone
from pbrl.models.lora import LoraSettings, quiet_peft_wrapping

_META = "reward_model.json"
_HEAD = "head.safetensors"
_RANGE = ("input_low", "input_high")  # each head input's range on the training rows (segments)


@dataclass(frozen=True)
class RewardModelSpec:
    """How a reward model is built: plain values a stage unpacks from its job.

    Attributes:
        source: the backbone as configured (packaged alias, folder or cached hub id; ``reward_model_name``
            or the first agent's model). Stored as given; the run folder never names an absolute path.
        lora: LoRA on the backbone, or None (train every backbone weight).
        freeze_backbone: train the head only (``reward_freeze_backbone``; LoRA is then not applied).
        pooling: what the head reads (``reward_pooling``, :data:`POOLINGS`).
        num_agents: agents per joint response (the ``segments`` features are a·(h+1); the head adds a squares).
        backbone_layers: the backbone's first decoder layers that run (``reward_backbone_layers``); None = all.
        head_components: principal components per agent that the head reads (``reward_head_components``).
        length_squares: with ``segments``, the head also reads each agent's squared length (always, from a job;
            False rebuilds the head of models saved before the squares, for comparisons).
        length_products: with ``segments``, the head also reads the product of every two agents' lengths
            (``reward_length_products``; records saved before it existed read False).
        prompt_overlap: with ``segments``, the head also reads each agent's prompt overlap (``reward_prompt_overlap``).
        joint_overlap: with ``segments``, the head also reads the joint response's word overlap with its prompts
            (``reward_joint_overlap``; records saved before it existed read False).
    """

    source: str
    lora: LoraSettings | None = None
    freeze_backbone: bool = False
    pooling: str = "last_token"
    num_agents: int = 1
    backbone_layers: int | None = None
    head_components: int | None = None
    length_squares: bool = True
    prompt_overlap: bool = False
    length_products: bool = False
    joint_overlap: bool = False

    def head_inputs(self, hidden_size: int) -> int:
        """f: h for ``last_token``, a·(h+1) for ``segments``."""
        return hidden_size if self.pooling == "last_token" else self.num_agents * (hidden_size + 1)

    def __post_init__(self) -> None:
        segments_only = {
            "reward_head_components": self.head_components is not None,
            "reward_prompt_overlap": self.prompt_overlap,
            "reward_length_products": self.length_products,
            "reward_joint_overlap": self.joint_overlap,
        }  # the options that say what a segments head reads (pbrl.config.trainer_rules.SEGMENTS_ONLY)
        for option, given in segments_only.items():
            if given and self.pooling != "segments":
                raise ValueError(f"{option}: allowed only with reward_pooling='segments'")

    def head_width(self, hidden_size: int) -> int:
        """The head's inputs: f, or a·(k+1) with ``head_components`` k; plus a with :attr:`squares`, plus a(a−1)/2
        with ``length_products``, plus a with ``prompt_overlap``, plus 1 with ``joint_overlap``."""
        k, a = self.head_components, self.num_agents
        width = self.head_inputs(hidden_size) if k is None else a * (k + 1)
        width += a * (a - 1) // 2 if self.length_products else 0
        return width + (a if self.squares else 0) + (a if self.prompt_overlap else 0) + int(self.joint_overlap)

    @property
    def feature_names(self) -> list[str]:
        """What the head reads, in order, as the saved record names it."""
        if self.pooling == "last_token":
            return ["last_token"]
        names = ["segments" if self.head_components is None else f"segments_pca{self.head_components}"]
        names += ["length_squares"] if self.squares else []
        names += ["length_products"] if self.length_products else []
        names += ["prompt_overlap"] if self.prompt_overlap else []
        return names + (["joint_overlap"] if self.joint_overlap else [])

    @property
    def squares(self) -> bool:
        """Whether the head reads the lengths' squares: ``length_squares`` with ``segments``."""
        return self.length_squares and self.pooling == "segments"

    @property
    def trained(self) -> str:
        return "head" if self.freeze_backbone else ("lora" if self.lora is not None else "full")


def _load_backbone(path: Path, *, trained: str, device: str) -> nn.Module:
    """The float32 backbone: its own copy when every weight trains (``full``), else over the frozen base weights
    that this process's LoRA policies of the same model already hold (one copy in memory)."""
    if trained == "full":
        return AutoModel.from_pretrained(path, dtype=torch.float32, local_files_only=True, use_safetensors=True)
    return shared_backbone(path, device=device)


def _pad_id(source: Path) -> int:

    return int(load_tokenizer(source).pad_token_id)


def _decoder(source: Path) -> Decode:
    """Token ids -> text with the backbone's tokenizer, special tokens left out (``reward_joint_overlap``)."""
    tokenizer = load_tokenizer(source)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


def new_reward_model(spec: RewardModelSpec, *, seed: int, device: str = "cpu") -> JointRewardModel:
    """A freshly initialised reward model: the backbone's pretrained weights, a new head (PyTorch's default
    ``nn.Linear`` init) and, with LoRA, a new adapter (peft init: B = 0), all drawn from ``seed``; global
    RNG state is left untouched. Trainable parameters require grad (the head always; the backbone's per
    :attr:`RewardModelSpec.trained`), all float32."""
    src = resolve_model_source(spec.source, field="reward_model_name")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        backbone = keep_first_layers(_load_backbone(src, trained=spec.trained, device=device), spec.backbone_layers)
        head = nn.Linear(spec.head_width(backbone.config.hidden_size), 1)
        if spec.trained == "head":
            backbone.requires_grad_(False)
        elif spec.trained == "lora":
            config = LoraConfig(
                r=spec.lora.r,
                lora_alpha=spec.lora.alpha,
                lora_dropout=spec.lora.dropout,
                target_modules=list(spec.lora.target_modules),
            )
            with quiet_peft_wrapping():
                backbone = get_peft_model(backbone, config)
    features = spec.head_inputs(backbone.config.hidden_size)
    extras = HeadExtras(spec.squares, spec.length_products, spec.prompt_overlap, spec.joint_overlap)
    decode = _decoder(src) if spec.joint_overlap else None
    model = JointRewardModel(backbone, head, _pad_id(src), spec.pooling, features, extras, decode)
    return model.to(device)


def save_reward_model(model: JointRewardModel, spec: RewardModelSpec, out_dir: Path, *, max_length: int | None) -> None:
    """Write the model atomically (safetensors only): ``head.safetensors``; the trained backbone weights
    (``backbone/`` for full training, ``adapter/`` for LoRA, none when frozen); ``reward_model.json`` last."""

    with atomic_dir(Path(out_dir)) as tmp:
        head = {**model.head.state_dict(), "feature_shift": model.feature_shift, "feature_scale": model.feature_scale}
        for name in ("feature_projection", "overlap_shift", "overlap_scale", *_RANGE):
            if getattr(model, name) is not None:
                head[name] = getattr(model, name)
        save_file({k: v.detach().cpu().contiguous() for k, v in head.items()}, tmp / _HEAD)
        if spec.trained == "full":
            model.backbone.save_pretrained(tmp / "backbone", safe_serialization=True)
        elif spec.trained == "lora":
            model.backbone.save_pretrained(tmp / "adapter", safe_serialization=True)
        write_json(
            tmp / _META,
            {
                "template": TEMPLATE_VERSION,
                "source": spec.source,
                "trained": spec.trained,
                "lora": asdict(spec.lora) if spec.lora is not None else None,
                "pooling": spec.pooling,
                "num_agents": spec.num_agents,
                "backbone_layers": spec.backbone_layers,
                "head_components": spec.head_components,
                "length_squares": model.length_squares,
                "length_products": model.length_products,
                "features": spec.feature_names,
                "prompt_overlap": model.overlap.to_record() if model.overlap is not None else None,
                "joint_overlap": model.word_overlap.to_record() if model.word_overlap is not None else None,
                "max_length": max_length,
            },
        )


def load_reward_model(folder: Path, *, device: str = "cpu") -> tuple[JointRewardModel, dict[str, Any]]:
    """Load a model written by :func:`save_reward_model` (safetensors only), frozen, in eval mode.

    Returns:
        The model and its ``reward_model.json`` record (``source``, ``trained``, ``max_length``, …).

    Raises:
        ArtifactError: the record is missing; ValueError: it was written with another template.
    """

    folder = Path(folder)
    meta = read_json(folder / _META)
    if meta.get("template") != TEMPLATE_VERSION:
        raise ValueError(f"{folder / _META}: template {meta.get('template')!r}, expected {TEMPLATE_VERSION!r}")
    src = resolve_model_source(meta["source"], field="reward_model_name")
    backbone = _load_backbone(
        folder / "backbone" if meta["trained"] == "full" else src, trained=meta["trained"], device=device
    )
    if meta["trained"] != "full":  # a saved full backbone is stored cut; older records: every layer
        backbone = keep_first_layers(backbone, meta.get("backbone_layers"))
    if meta["trained"] == "lora":
        with quiet_peft_wrapping():
            backbone = PeftModel.from_pretrained(backbone, str(folder / "adapter"), is_trainable=False)
    state = load_file(str(folder / _HEAD))
    head = nn.Linear(state["weight"].shape[1], 1)
    head.load_state_dict({k: state[k] for k in ("weight", "bias")})
    pooling, squares = meta.get("pooling", "last_token"), meta.get("length_squares", False)  # older: neither
    overlap = meta.get("prompt_overlap")  # older records: none
    products = meta.get("length_products", False)  # records before 2026-12-07: none
    joint = meta.get("joint_overlap")  # older records: none
    extras = HeadExtras(squares, products, overlap is not None, joint is not None)
    decode = _decoder(src) if joint is not None else None
    model = JointRewardModel(backbone, head, _pad_id(src), pooling, state["feature_shift"].shape[0], extras, decode)
    # older records have no input range (saved before 2026-12-06): their inputs stay unclamped (±inf)
    for name in ("feature_shift", "feature_scale", "feature_projection", "overlap_shift", "overlap_scale", *_RANGE):
        if name in state:
            getattr(model, name).copy_(state[name])
    if overlap is not None:
        model.overlap = PromptOverlap.from_record(overlap)
    if joint is not None:
        model.word_overlap = JointWordOverlap.from_record(joint)
    model = model.to(device)
    model.requires_grad_(False)
    model.eval()
    return model, meta
