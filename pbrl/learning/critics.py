"""Critics of the actor-critic MARLHF backends (docs/design/algorithms.md#critics): ``maac`` (one centralized critic)
and ``iac`` (one critic per agent): the value model, how it is built, saved and restored, and its update step. The
critics of one RL pass, their targets and round metrics: :mod:`pbrl.learning.critic_set`; their advantages:
:mod:`pbrl.learning.advantages`.

**What a critic reads.** With ``critic_type: v`` a critic predicts the value of the history *before* the action
(the reference's V(h): prompts only), so A = R − V(h) is an unbiased baseline; with ``critic_type: q`` it also
reads the responses (the reference's Q(h, a)). ``maac``: the reward model's joint template
(:func:`pbrl.learning.joint_template.joint_input_ids`, built with the critic's tokenizer from the stored ids; with
``v`` every
response is empty, so the row ends at the last agent's response marker; over ``reward_max_length`` prompts are cut
as for the reward model). ``iac``: agent i's own prompt ids (``v``), or prompt + completion ids (``q``). Every
critic pools the last layer's hidden state at the **last non-padding token** (masks from the row lengths, as the
reward model does) and maps it to a scalar with its value head: a linear layer, or Linear → tanh → Linear of
width ``critic_value_head_hidden_dim`` / ``value_head_hidden_dim`` (the reference's head; weights N(0, 0.02²),
biases 0).

**Where a critic lives.** ``maac`` and ``iac`` with ``use_separate_critic: true`` (the default): a separate
backbone per critic (``critic_model_name``, default the agent's model; LoRA when ``lora_r`` is set), float32,
forwards in eval mode (dropout off) like the reward model. ``iac`` with ``use_separate_critic: false``: a value
head on the agent's own policy backbone — the policy model object itself, one copy in memory, not a registered
submodule of the critic (its weights are saved and optimised with the policy only). The hidden state is computed
without gradients, so the value loss trains the head alone and never reaches the policy's weights.

**Update** (after the agents' policy steps of the same batch): the clipped value loss of PPO (Schulman et al. 2017,
"Proximal Policy Optimization Algorithms"; OpenAI baselines ``ppo2``) weighted by ``value_loss_coef``, AdamW
(``weight_decay=0``) at ``critic_learning_rate``, the gradient norm clipped to ``max_grad_norm``, the non-finite
skip rule of the policies. The "previous prediction" is the value recorded at rollout time; the clip binds when
the prediction at update time differs from it (a value head whose backbone the policy step just moved).

Shape legend: n rows (joint responses of a batch), a agents.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from pbrl.data.storage import atomic_dir, read_json, write_json
from pbrl.errors import ArtifactError
from pbrl.learning.joint_template import JointTemplate, joint_input_ids
from pbrl.learning.losses import clipped_value_loss
from pbrl.learning.reward_model_build import RewardModelSpec, new_reward_model
from pbrl.models.forward import eval_mode, pad_rows
from pbrl.models.lora import LoraSettings
from pbrl.models.policies import load_optimizer_state, save_optimizer
from pbrl.models.precision import backward_and_step

_WEIGHTS, _OPTIMIZER, _META = "weights.safetensors", "optimizer.pt", "critic.json"


# ---------------------------------------------------------------------------------------------- pure parts
def value_head(hidden_size: int, hidden_dim: int | None) -> nn.Module:
    """h → 1 linear, or Linear(h, d) → tanh → Linear(d, 1) with d = ``hidden_dim``; weights N(0, 0.02²), biases 0
    (the reference's ``CausalLMWithValueHead`` init). Draws from the global RNG: call under a seeded fork."""
    head: nn.Module = (
        nn.Linear(hidden_size, 1)
        if hidden_dim is None
        else nn.Sequential(nn.Linear(hidden_size, hidden_dim), nn.Tanh(), nn.Linear(hidden_dim, 1))
    )
    for module in head.modules():
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            nn.init.zeros_(module.bias)
    return head


def critic_rows(
    backend: str,
    critic_type: str,
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    *,
    template: JointTemplate | None = None,
    max_length: int | None = None,
) -> list[list[int] | None]:
    """The input ids of each critic for one joint response (agent k's stored ``prompts[k]``, ``completions[k]``):
    ``maac`` one row (the joint template; None when it does not fit ``max_length``), ``iac`` one row per agent."""
    if backend == "maac":
        responses = completions if critic_type == "q" else [[] for _ in prompts]
        return [joint_input_ids(template, prompts, responses, max_length).ids]  # type: ignore[arg-type]
    return [
        [*map(int, p), *(map(int, c) if critic_type == "q" else ())] for p, c in zip(prompts, completions, strict=True)
    ]


# ---------------------------------------------------------------------------------------------- models
class ValueModel(nn.Module):
    """A backbone + a value head on the hidden state of each row's last non-padding token.

    ``policy`` given: the backbone is that causal LM itself (shared, not registered here), run without gradients;
    else ``backbone`` (an ``AutoModel``, possibly peft-wrapped) is a submodule and is trained with the head."""

    def __init__(
        self, head: nn.Module, pad_token_id: int, *, backbone: nn.Module | None = None, policy: nn.Module | None = None
    ):
        super().__init__()
        if (backbone is None) == (policy is None):
            raise ValueError("ValueModel: give exactly one of backbone (separate critic) or policy (value head)")
        self.head, self.pad_token_id = head, int(pad_token_id)
        self.backbone = backbone
        self._policy = (policy,) if policy is not None else ()  # a tuple: not a submodule, one copy in memory

    @property
    def policy(self) -> nn.Module | None:
        return self._policy[0] if self._policy else None

    def forward(self, rows: Sequence[Sequence[int]]) -> torch.Tensor:
        """Values (b,), float32, on the head's device; gradients reach the head, and the backbone only when it is
        the critic's own."""
        input_ids, mask, positions, last = pad_rows(rows, self.pad_token_id, "right")  # (b, t) ×3, (b,)
        device = next(self.head.parameters()).device
        body = self.policy if self.policy is not None else self.backbone
        kwargs = {
            "input_ids": input_ids.to(device),
            "attention_mask": mask.to(device),
            "position_ids": positions.to(device),
            "use_cache": False,
        }
        with eval_mode(body):
            if self.policy is not None:
                with torch.no_grad():  # the value loss never reaches the policy's weights
                    hidden = body(**kwargs, output_hidden_states=True).hidden_states[-1]  # (b, t, h)
            else:
                hidden = body(**kwargs).last_hidden_state  # (b, t, h)
        at = hidden.device  # the last layer's device (accelerate may place it apart from the head)
        pooled = hidden[torch.arange(len(rows), device=at), last.to(at)]  # (b, h)
        return self.head(pooled.to(device, torch.float32)).squeeze(-1)  # (b,)


@dataclass(frozen=True)
class CriticSpec:
    """How one critic is built (plain values a stage unpacks from its job).

    Attributes:
        kind: ``"separate"`` (own backbone from ``source``) or ``"value_head"`` (on the agent's policy).
        source: the separate backbone as configured (``critic_model_name`` or the agent's model); None for a head.
        lora: LoRA on a separate backbone, or None (train every backbone weight).
        head_hidden_dim: the value head's hidden width, or None (linear).
        joint_template: the version of the joint template the critic reads (``maac``:
            :data:`pbrl.learning.joint_template.TEMPLATE_VERSION`), or None (``iac`` reads each agent's own ids).
            Recorded in ``critic.json``, so that a critic saved under another template is refused on restore
            rather than read against rows laid out differently.
    """

    kind: str
    source: str | None
    lora: LoraSettings | None
    head_hidden_dim: int | None
    joint_template: str | None = None


@dataclass
class Critic:
    spec: CriticSpec
    model: ValueModel
    optimizer: torch.optim.Optimizer

    @property
    def parameters(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]


def new_critic(
    spec: CriticSpec,
    *,
    seed: int,
    learning_rate: float,
    device: str = "cpu",
    policy: nn.Module | None = None,
    pad_token_id: int | None = None,
) -> Critic:
    """A freshly initialised critic (backbone pretrained weights, LoRA adapter and head drawn from ``seed``; global
    RNG untouched) with its AdamW (``weight_decay=0``). A ``value_head`` critic needs ``policy`` (the agent's
    causal LM, its hidden size from ``policy.config``) and ``pad_token_id``; it is placed on the policy's input
    device."""
    if spec.kind == "separate":
        shell = new_reward_model(RewardModelSpec(source=str(spec.source), lora=spec.lora), seed=seed, device=device)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            head = value_head(shell.backbone.config.hidden_size, spec.head_hidden_dim)
        model = ValueModel(head.to(device), shell.pad_token_id, backbone=shell.backbone)
    elif spec.kind == "value_head":
        if policy is None or pad_token_id is None:
            raise ValueError("a value-head critic needs the agent's policy model and its pad token id")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            head = value_head(policy.config.hidden_size, spec.head_hidden_dim)
        model = ValueModel(head.to(policy.get_input_embeddings().weight.device), pad_token_id, policy=policy)
    else:
        raise ValueError(f"critic kind: got {spec.kind!r}; allowed: separate, value_head")
    params = [p for p in model.parameters() if p.requires_grad]
    return Critic(spec, model, torch.optim.AdamW(params, lr=learning_rate, weight_decay=0.0))


def _meta(spec: CriticSpec) -> dict[str, Any]:
    """``critic.json``'s record of ``spec``, as JSON reads it back (tuples become lists). ``joint_template`` is
    written only for a critic that reads the joint template (a folder without the key reads as None)."""
    record = {
        "kind": spec.kind,
        "source": spec.source,
        "head_hidden_dim": spec.head_hidden_dim,
        "lora": asdict(spec.lora) if spec.lora else None,
    }
    if spec.joint_template is not None:
        record["joint_template"] = spec.joint_template
    return json.loads(json.dumps(record))


def save_critic(critic: Critic, folder: Path) -> None:
    """Write ``folder`` atomically: the trainable weights (safetensors; a value head's policy backbone is the
    policy's, saved with it), the AdamW state (``optimizer.pt``) and ``critic.json`` last."""

    with atomic_dir(Path(folder)) as tmp:
        save_file(
            {name: p.detach().cpu().contiguous() for name, p in critic.model.named_parameters() if p.requires_grad},
            tmp / _WEIGHTS,
        )
        save_optimizer(critic.optimizer, tmp / _OPTIMIZER)
        write_json(tmp / _META, _meta(critic.spec))


def restore_critic(critic: Critic, folder: Path) -> None:
    """Load a :func:`save_critic` folder into a critic built from the same spec (weights and optimizer state,
    bitwise; safe loaders only).

    Raises:
        ArtifactError: the folder was written for another critic (another spec, or another joint template: a
            ``maac`` critic saved before the template recorded its version is refused too), or misses a trained
            weight.
    """

    folder = Path(folder)
    meta = read_json(folder / _META)
    if meta != _meta(critic.spec):
        raise ArtifactError(f"{folder / _META}: written for critic {meta}, but this run builds {_meta(critic.spec)}")
    state = load_file(str(folder / _WEIGHTS))
    trained = {name for name, p in critic.model.named_parameters() if p.requires_grad}
    if set(state) != trained:
        raise ArtifactError(
            f"{folder / _WEIGHTS}: holds other weights than the critic trains "
            f"(missing {sorted(trained - set(state))[:3]}, extra {sorted(set(state) - trained)[:3]})"
        )
    with torch.no_grad():
        for name, p in critic.model.named_parameters():
            if name in state:
                p.copy_(state[name].to(p.device, p.dtype))
    critic.optimizer.load_state_dict(load_optimizer_state(folder / _OPTIMIZER))


def critic_step(
    critic: Critic,
    rows: Sequence[Sequence[int]],
    returns: torch.Tensor,
    old_values: torch.Tensor,
    *,
    value_loss_coef: float,
    clip_range: float | None,
    max_grad_norm: float | None,
) -> tuple[float, str]:
    """One AdamW step of ``critic`` on ``value_loss_coef`` · mean clipped value loss of n rows (returns (n,), the
    rollout-time values (n,)). A non-finite loss or gradient norm skips the step (weights and optimizer state
    untouched).

    Returns:
        (the unweighted mean clipped value loss, outcome ``"updated"``, ``"skipped"`` or ``"no_rows"``).
    """
    if not rows:
        return float("nan"), "no_rows"
    values = critic.model(rows).double()  # (n,)
    device = values.device
    loss = clipped_value_loss(
        values, old_values.to(device, torch.float64), returns.to(device, torch.float64), clip_range
    ).mean()
    if not torch.isfinite(loss):
        return float(loss.detach()), "skipped"
    stepped = backward_and_step(
        critic.optimizer, value_loss_coef * loss, critic.parameters, max_grad_norm=max_grad_norm
    )
    return float(loss.detach()), "updated" if stepped else "skipped"


@torch.no_grad()
def predict(critic: Critic, rows: Sequence[Sequence[int] | None], batch_size: int = 16) -> torch.Tensor:
    """Values of rows without gradients, (n,) float64 on CPU; 0 where a row is None (did not fit)."""
    kept = [r for r in rows if r is not None]
    values = [float(v) for s in range(0, len(kept), batch_size) for v in critic.model(kept[s : s + batch_size]).cpu()]
    it = iter(values)
    return torch.tensor([next(it) if r is not None else 0.0 for r in rows], dtype=torch.float64)
