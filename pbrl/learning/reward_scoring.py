"""A fitted joint reward model at work: which device it runs on, and :class:`RewardScorer`, a fitted model (its
folder given as a path) scoring joint responses from stored ids (MARLHF's update-policies, and score-with-oracle
with ``preference_scoring_reward: reward_model``). The model itself: :mod:`pbrl.learning.reward_model`; where a
run keeps its fitted models and which one is newest: :mod:`pbrl.run.reward_records`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from pbrl.learning.joint_template import JointTemplate, joint_input_ids
from pbrl.learning.reward_model import score_joint
from pbrl.learning.reward_model_build import load_reward_model
from pbrl.models.loading import load_tokenizer, resolve_devices, resolve_model_source


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

    def score(
        self, prompt_ids: Sequence[Sequence[Sequence[int]]], completion_ids: Sequence[Sequence[Sequence[int]]]
    ) -> list[tuple[float | None, list[int] | None]]:
        """Per joint response ([joint][agent] prompt and completion ids): (R, joint ids), or (None, None)
        when its responses do not fit ``reward_max_length``."""
        joint = [
            joint_input_ids(self.template, p, c, self.max_length)
            for p, c in zip(prompt_ids, completion_ids, strict=True)
        ]
        kept = [j for j in joint if j.ids is not None]
        scores = iter(score_joint(self.model, kept, self.batch_size))
        return [(next(scores), j.ids) if j.ids is not None else (None, None) for j in joint]
