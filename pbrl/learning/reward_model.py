"""The joint reward model of MARLHF (SPEC §5.6): one scalar score for a whole joint response.

**Joint input.** Every agent's prompt and response are read as one token sequence, built from the stored
token ids (never by decoding and re-encoding a completion), in this fixed template (k = 1 … a, agents in
order; the marker lines are text tokenized once with the reward model's tokenizer)::

    Joint multi-agent response\\n
    ### Agent k prompt\\n  <prompt ids of agent k>
    \\n### Agent k response\\n  <completion ids of agent k, EOS included when generated>
    \\n                                   (between agents)

The ids are built once per pair (stage build-pairs, ``pair_joint_ids.parquet``) and once per rollout
(``rollouts.parquet``) by :func:`joint_input_ids`, so fitting, scoring and replay read the same ids. Longer
than ``reward_max_length``: prompt tokens are cut from the left, agent 1's prompt first; when the markers
and the responses alone do not fit, the joint response is dropped with a counted reason — no response
token, least of all the last agent's, is ever cut.

**Model.** :class:`JointRewardModel`: a causal-LM backbone without its LM head (``AutoModel``), a scalar
linear head on the last layer's hidden state at the **last non-padding token** of each row. Masks and
position ids come from the row lengths, never from comparing ids with the pad id, so left and right
padding give the same score as the row alone and pad == EOS is safe. Forwards run in eval mode (dropout
off): fitting and scoring are deterministic.

**Fitting.** Bradley–Terry (Bradley and Terry 1952; Christiano et al. 2017; Ouyang et al. 2022 eq. 1):
L = −log σ(R(w) − R(l)), mean over a batch, AdamW. Saved with safetensors (:func:`save_reward_model`),
loaded with safe loaders only (:func:`load_reward_model`).

Shape legend: b batch (rows), t tokens, h hidden size.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModel

from pbrl.data.storage import RunPaths, atomic_dir, read_json, read_manifest, write_json
from pbrl.models.forward import eval_mode
from pbrl.models.loading import LoraSettings, load_tokenizer, resolve_devices, resolve_model_source

TEMPLATE_VERSION = "joint-v1"
HEADER = "Joint multi-agent response\n"
PAIR_JOINT_IDS_FILE = "pair_joint_ids.parquet"  # rounds/<r>/: the pairs' joint input ids (build-pairs)
REWARD_MODEL_DIR = "reward_model"  # rounds/<r>/reward_model/: the fitted model (fit-reward-model)
DROP_TOO_LONG = "reward_max_length: the markers and the responses alone do not fit"
_META = "reward_model.json"
_HEAD = "head.safetensors"


MARLHF_TRAINERS = ("marlhf", "marlhf_iter")


def is_marlhf(trainer: str) -> bool:
    """Whether ``trainer`` fits a reward model and learns by RL (MARLHF, base or iterative)."""
    return trainer in MARLHF_TRAINERS


def _prompt_marker(k: int) -> str:
    return f"### Agent {k} prompt\n"


def _response_marker(k: int) -> str:
    return f"\n### Agent {k} response\n"


@dataclass(frozen=True)
class JointTemplate:
    """The template's fixed pieces as token ids of the reward model's tokenizer (see module docstring)."""

    header: tuple[int, ...]
    prompt_markers: tuple[tuple[int, ...], ...]  # one per agent
    response_markers: tuple[tuple[int, ...], ...]  # one per agent
    separator: tuple[int, ...]  # between one agent's response and the next agent's prompt marker

    @classmethod
    def build(cls, tokenizer: Any, num_agents: int) -> JointTemplate:
        """Tokenize the marker text once (``add_special_tokens=False``)."""
        def enc(text: str) -> tuple[int, ...]:
            return tuple(tokenizer(text, add_special_tokens=False).input_ids)

        return cls(header=enc(HEADER),
                   prompt_markers=tuple(enc(_prompt_marker(k + 1)) for k in range(num_agents)),
                   response_markers=tuple(enc(_response_marker(k + 1)) for k in range(num_agents)),
                   separator=enc("\n"))


@dataclass(frozen=True)
class JointInput:
    """One joint input: ``ids`` (None when dropped), ``prompt_tokens_cut`` and the drop ``reason``."""

    ids: list[int] | None
    prompt_tokens_cut: int = 0
    reason: str | None = None


def joint_input_ids(template: JointTemplate, prompt_ids: Sequence[Sequence[int]],
                    completion_ids: Sequence[Sequence[int]], max_length: int | None) -> JointInput:
    """The joint input ids of one joint response (template in the module docstring).

    Args:
        template: :meth:`JointTemplate.build` for the reward model's tokenizer and a agents.
        prompt_ids: a lists, agent k's prompt ids as stored (its vocabulary must be the reward model's).
        completion_ids: a lists, agent k's completion ids as stored (EOS included when generated).
        max_length: most tokens, or None for no limit.

    Returns:
        :class:`JointInput`. Over ``max_length``, prompt tokens are cut from the left, agent 1's prompt
        first, then agent 2's …; when even the template's markers plus every response exceed it, ``ids`` is
        None with reason :data:`DROP_TOO_LONG`. Responses are never cut.

    Raises:
        ValueError: the number of prompts or completions differs from the template's agents.
    """
    a = len(template.prompt_markers)
    if len(prompt_ids) != a or len(completion_ids) != a:
        raise ValueError(f"joint input: got {len(prompt_ids)} prompts and {len(completion_ids)} completions for "
                         f"a template of {a} agents")
    prompts = [list(p) for p in prompt_ids]
    fixed = len(template.header) + sum(len(m) for m in template.prompt_markers) + sum(
        len(m) for m in template.response_markers) + len(template.separator) * (a - 1) + sum(
        len(c) for c in completion_ids)
    excess = fixed + sum(len(p) for p in prompts) - max_length if max_length is not None else 0
    if max_length is not None and fixed > max_length:
        return JointInput(None, 0, DROP_TOO_LONG)
    cut = max(excess, 0)
    remaining = cut
    for k in range(a):  # cut from the prompts' side: agent 1's prompt first, from its left end
        n = min(remaining, len(prompts[k]))
        prompts[k] = prompts[k][n:]
        remaining -= n
    ids: list[int] = list(template.header)
    for k in range(a):
        if k:
            ids += template.separator
        ids += [*template.prompt_markers[k], *prompts[k], *template.response_markers[k], *completion_ids[k]]
    return JointInput([int(i) for i in ids], cut)


def check_same_vocabulary(reward_tokenizer: Any, agent_tokenizers: Sequence[Any], reward_model_name: str) -> None:
    """The joint input reads the agents' stored ids directly, so every agent's vocabulary must be the reward
    model's.

    Raises:
        ValueError: naming ``reward_model_name`` and the first agent whose vocabulary differs.
    """
    vocab = reward_tokenizer.get_vocab()
    for i, tok in enumerate(agent_tokenizers):
        if tok.get_vocab() != vocab:
            raise ValueError(f"reward_model_name: {reward_model_name!r} has another vocabulary than agent {i}'s "
                             "model; the joint reward model reads the agents' token ids, so give a backbone with "
                             "the agents' tokenizer")


def _pad(rows: Sequence[Sequence[int]], pad_token_id: int, padding_side: str
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(b, t) ids, mask and position ids, and (b,) index of each row's last token; masks from the lengths."""
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
        input_ids[r, start:start + len(row)] = torch.tensor(list(row), dtype=torch.long)
        mask[r, start:start + len(row)] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # (b, t)
    return input_ids, mask, positions, offsets + lengths - 1


class JointRewardModel(nn.Module):
    """Backbone (a causal LM's base model, or a peft model around it) + a scalar head (h → 1)."""

    def __init__(self, backbone: nn.Module, head: nn.Linear, pad_token_id: int):
        super().__init__()
        self.backbone, self.head, self.pad_token_id = backbone, head, int(pad_token_id)

    def forward(self, joint_ids: Sequence[Sequence[int]], padding_side: str = "right") -> torch.Tensor:
        """Scores R of b joint inputs, shape (b,), float32, on the head's device; gradients flow when enabled.

        Every submodule runs in eval mode (dropout off) and gets its mode back afterwards.
        """
        input_ids, mask, positions, last = _pad(joint_ids, self.pad_token_id, padding_side)
        device = self.head.weight.device
        with eval_mode(self):
            hidden = self.backbone(input_ids=input_ids.to(device), attention_mask=mask.to(device),
                                   position_ids=positions.to(device), use_cache=False).last_hidden_state  # (b, t, h)
            pooled = hidden[torch.arange(len(joint_ids), device=device), last.to(device)]  # (b, h)
            return self.head(pooled.to(self.head.weight.dtype)).squeeze(-1)  # (b,)


@torch.no_grad()
def score_joint(model: JointRewardModel, joint_ids: Sequence[Sequence[int]], batch_size: int = 16) -> list[float]:
    """Scores of many joint inputs without gradients, ``batch_size`` rows per forward (right padding)."""
    out: list[float] = []
    for start in range(0, len(joint_ids), batch_size):
        out += [float(x) for x in model(joint_ids[start:start + batch_size]).double().cpu()]
    return out


def bradley_terry_loss(winner_scores: torch.Tensor, loser_scores: torch.Tensor) -> torch.Tensor:
    """Per-pair Bradley–Terry loss −log σ(R(w) − R(l)), shape (b,), nats (softplus form, stable for any
    margin). Source: Bradley and Terry 1952; the reward-model loss of Ouyang et al. 2022, eq. 1."""
    return F.softplus(-(winner_scores - loser_scores))


# ---------------------------------------------------------------------------------------------- build
@dataclass(frozen=True)
class RewardModelSpec:
    """How a reward model is built: plain values a stage unpacks from its job.

    Attributes:
        source: the backbone as configured (packaged alias, folder or cached hub id; ``reward_model_name``
            or the first agent's model). Stored as given; the run folder never names an absolute path.
        lora: LoRA on the backbone, or None (train every backbone weight).
        freeze_backbone: train the head only (``reward_freeze_backbone``; LoRA is then not applied).
    """

    source: str
    lora: LoraSettings | None = None
    freeze_backbone: bool = False

    @property
    def trained(self) -> str:
        return "head" if self.freeze_backbone else ("lora" if self.lora is not None else "full")


def _load_backbone(path: Path) -> nn.Module:

    return AutoModel.from_pretrained(path, dtype=torch.float32, local_files_only=True, use_safetensors=True)


def _pad_id(source: Path) -> int:

    return int(load_tokenizer(source).pad_token_id)


def new_reward_model(spec: RewardModelSpec, *, seed: int, device: str = "cpu") -> JointRewardModel:
    """A freshly initialised reward model: the backbone's pretrained weights, a new head (PyTorch's default
    ``nn.Linear`` init) and, with LoRA, a new adapter (peft init: B = 0), all drawn from ``seed``; global
    RNG state is left untouched. Trainable parameters require grad (the head always; the backbone's per
    :attr:`RewardModelSpec.trained`), all float32."""
    src = resolve_model_source(spec.source, field="reward_model_name")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        backbone = _load_backbone(src)
        head = nn.Linear(backbone.config.hidden_size, 1)
        if spec.trained == "head":
            backbone.requires_grad_(False)
        elif spec.trained == "lora":

            backbone = get_peft_model(backbone, LoraConfig(r=spec.lora.r, lora_alpha=spec.lora.alpha,
                                                           lora_dropout=spec.lora.dropout,
                                                           target_modules=list(spec.lora.target_modules)))
    return JointRewardModel(backbone, head, _pad_id(src)).to(device)


def save_reward_model(model: JointRewardModel, spec: RewardModelSpec, out_dir: Path, *,
                      max_length: int | None) -> None:
    """Write the model atomically (safetensors only): ``head.safetensors``; the trained backbone weights
    (``backbone/`` for full training, ``adapter/`` for LoRA, none when frozen); ``reward_model.json`` last."""

    with atomic_dir(Path(out_dir)) as tmp:
        save_file({k: v.detach().cpu().contiguous() for k, v in model.head.state_dict().items()}, tmp / _HEAD)
        if spec.trained == "full":
            model.backbone.save_pretrained(tmp / "backbone", safe_serialization=True)
        elif spec.trained == "lora":
            model.backbone.save_pretrained(tmp / "adapter", safe_serialization=True)
        write_json(tmp / _META, {"template": TEMPLATE_VERSION, "source": spec.source, "trained": spec.trained,
                                 "lora": asdict(spec.lora) if spec.lora is not None else None,
                                 "max_length": max_length})


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
    backbone = _load_backbone(folder / "backbone" if meta["trained"] == "full" else src)
    if meta["trained"] == "lora":

        backbone = PeftModel.from_pretrained(backbone, str(folder / "adapter"), is_trainable=False)
    state = load_file(str(folder / _HEAD))
    head = nn.Linear(state["weight"].shape[1], 1)
    head.load_state_dict(state)
    model = JointRewardModel(backbone, head, _pad_id(src)).to(device)
    model.requires_grad_(False)
    model.eval()
    return model, meta


# ---------------------------------------------------------------------------------------------- fit
@dataclass(frozen=True)
class PairMetrics:
    loss: float  # mean Bradley–Terry loss, nats
    accuracy: float  # share of pairs with R(w) > R(l)
    margin_mean: float  # mean R(w) − R(l)


@torch.no_grad()
def pair_metrics(model: JointRewardModel, pairs: Sequence[tuple[Sequence[int], Sequence[int]]],
                 batch_size: int) -> PairMetrics:
    """Loss, accuracy and mean margin of ``pairs`` (winner ids, loser ids); NaN for no pairs."""
    if not pairs:
        return PairMetrics(math.nan, math.nan, math.nan)
    w = torch.tensor(score_joint(model, [p[0] for p in pairs], batch_size), dtype=torch.float64)  # (b,)
    lo = torch.tensor(score_joint(model, [p[1] for p in pairs], batch_size), dtype=torch.float64)  # (b,)
    margins = w - lo
    return PairMetrics(float(bradley_terry_loss(w, lo).mean()), float((margins > 0).double().mean()),
                       float(margins.mean()))


def fit_bradley_terry(model: JointRewardModel, pairs: Sequence[tuple[Sequence[int], Sequence[int]]], *,
                      epochs: int, batch_size: int, learning_rate: float, seed: int,
                      max_grad_norm: float | None) -> dict[str, int]:
    """Fit ``model`` in place: ``epochs`` passes over ``pairs`` (winner ids, loser ids) in a seeded order,
    ``batch_size`` pairs per AdamW step (torch defaults besides ``lr``), winner and loser rows in one padded
    forward, gradient norm clipped to ``max_grad_norm`` (None: not clipped). A step whose loss or gradient
    norm is not finite is skipped (parameters and optimizer state untouched) and counted.

    Returns:
        ``{"steps": n, "skipped_steps": n}``.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=learning_rate)
    rng = np.random.default_rng(seed)
    steps = skipped = 0
    for _ in range(epochs):
        order = rng.permutation(len(pairs))
        for begin in range(0, len(pairs), batch_size):
            chunk = [pairs[j] for j in order[begin:begin + batch_size]]
            scores = model([p[0] for p in chunk] + [p[1] for p in chunk])  # (2b,)
            loss = bradley_terry_loss(scores[:len(chunk)], scores[len(chunk):]).mean()
            steps += 1
            optimizer.zero_grad(set_to_none=True)
            if not torch.isfinite(loss):
                skipped += 1
                continue
            loss.backward()
            norm = (torch.nn.utils.clip_grad_norm_(params, max_grad_norm) if max_grad_norm is not None
                    else torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params if p.grad is not None])))
            if not torch.isfinite(norm):
                optimizer.zero_grad(set_to_none=True)
                skipped += 1
                continue
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return {"steps": steps, "skipped_steps": skipped}


def heldout_split(n: int, share: float, seed: int) -> tuple[list[int], list[int]]:
    """Seeded split of ``n`` pair indices into (train, held-out): round(share·n) held out, at least 1 when
    n ≥ 2, none when n < 2 (one pair trains). Both lists in increasing order."""
    held = 0 if n < 2 else min(n - 1, max(1, round(share * n)))
    perm = np.random.default_rng(seed).permutation(n)
    return sorted(int(i) for i in perm[held:]), sorted(int(i) for i in perm[:held])


# ---------------------------------------------------------------------------------------------- in a run
def reward_model_dir(round_dir: Path) -> Path:
    """``rounds/<r>/reward_model/``."""
    return Path(round_dir) / REWARD_MODEL_DIR


def pair_joint_ids_path(round_dir: Path) -> Path:
    """``rounds/<r>/pair_joint_ids.parquet``."""
    return Path(round_dir) / PAIR_JOINT_IDS_FILE


def joint_template_for(source: str, agent_sources: Sequence[str]) -> tuple[JointTemplate, Any]:
    """The template for the reward model ``source`` and its tokenizer, after checking that every agent
    (``agent_sources``, one per agent) shares its vocabulary (:func:`check_same_vocabulary`)."""

    tokenizer = load_tokenizer(resolve_model_source(source, field="reward_model_name"))
    agents = {s: load_tokenizer(resolve_model_source(s)) for s in dict.fromkeys(agent_sources)}
    check_same_vocabulary(tokenizer, [agents[s] for s in agent_sources], source)
    return JointTemplate.build(tokenizer, len(agent_sources)), tokenizer


def pair_joint_rows(pairs: Sequence[dict[str, Any]], template: JointTemplate, max_length: int | None
                    ) -> list[dict[str, Any]]:
    """PAIR_JOINT_IDS rows of pairs rows (``prompt_ids``, ``winner_ids``, ``loser_ids`` per agent): a pair
    is dropped (both ids null, reason given) when either side's responses do not fit ``max_length``."""
    rows = []
    for p in pairs:
        w = joint_input_ids(template, p["prompt_ids"], p["winner_ids"], max_length)
        lo = joint_input_ids(template, p["prompt_ids"], p["loser_ids"], max_length)
        reason = w.reason or lo.reason
        rows.append({"pair_id": p["pair_id"], "winner_joint_ids": None if reason else w.ids,
                     "loser_joint_ids": None if reason else lo.ids,
                     "prompt_tokens_cut": w.prompt_tokens_cut + lo.prompt_tokens_cut, "dropped": reason})
    return rows


def reward_device(configured: str | None, agent_devices: str | Sequence[str] | None, num_agents: int) -> str:
    """``reward_model_device``, else the first agent's device."""

    if configured:
        return configured
    spec = agent_devices if agent_devices is None or isinstance(agent_devices, str) else list(agent_devices)
    return resolve_devices(spec, num_agents)[0]


class RewardScorer:
    """A fitted reward model with its template, scoring joint responses from stored ids (no gradients)."""

    def __init__(self, folder: Path, num_agents: int, *, device: str = "cpu", batch_size: int = 16):

        self.model, self.meta = load_reward_model(folder, device=device)
        tokenizer = load_tokenizer(resolve_model_source(self.meta["source"], field="reward_model_name"))
        self.template = JointTemplate.build(tokenizer, num_agents)
        self.max_length, self.batch_size = self.meta["max_length"], batch_size

    def score(self, prompt_ids: Sequence[Sequence[Sequence[int]]], completion_ids: Sequence[Sequence[Sequence[int]]]
              ) -> list[tuple[float | None, list[int] | None]]:
        """Per joint response ([joint][agent] prompt and completion ids): (R, joint ids), or (None, None)
        when its responses do not fit ``reward_max_length``."""
        joint = [joint_input_ids(self.template, p, c, self.max_length)
                 for p, c in zip(prompt_ids, completion_ids, strict=True)]
        kept = [j.ids for j in joint if j.ids is not None]
        scores = iter(score_joint(self.model, kept, self.batch_size))
        return [(next(scores), j.ids) if j.ids is not None else (None, None) for j in joint]


def newest_reward_model(paths: RunPaths, before_round: int) -> tuple[int, Path] | None:
    """The newest fitted reward model of a round < ``before_round``: (round, folder), from the
    fit-reward-model manifests (``details.fitted``); None when none exists yet."""
    for r in range(before_round - 1, 0, -1):
        manifest = read_manifest(paths, r, "fit-reward-model")
        if manifest is not None and manifest.details.get("fitted"):
            return r, paths.root / manifest.details["reward_model"]
    return None
