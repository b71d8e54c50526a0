"""How sure the current model is about each question of a round (``judge_pair_choice: uncertain``,
docs/guides/label-pairs.md#a-label-budget-which-pairs-to-ask): the margin that the model after the previous round
gives the question's ``x`` over its ``y``, so that a label budget (``judge_max_pairs``) asks the pairs with the
smallest |margin|.

- MADPO (``madpo``, ``madpo_iter``): the policies' implicit DPO reward, summed over the agents,
  ``margin = β Σ_i [(log π_i(x_i) − log π_ref,i(x_i)) − (log π_i(y_i) − log π_ref,i(y_i))]`` (Rafailov et al. 2023,
  eq. 5; β = ``dpo_beta``), the current policies those after the previous round, the reference the initial ones.
- MARLHF: the newest fitted reward model's ``R(x) − R(y)``.

There is no model to ask in round 1 (the policies are the reference; no reward model is fitted yet) nor before a
round that changed them: then there are no margins and the budget is drawn at random. The margins of a round are
computed once and kept in ``rounds/<r>/pair_margins.json`` (what the model was, and one margin per question), so
that every later look at the round (``pbrl label``, ``pbrl status``, a resume) chooses the same pairs without
loading a model.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from pbrl.config import JobConfig, is_centralized, is_marlhf
from pbrl.data.storage import RunPaths, read_json, write_json
from pbrl.learning.logprobs import sequence_logprobs
from pbrl.learning.reward_scoring import RewardScorer, reward_device
from pbrl.models.policies import load_agent
from pbrl.preference.joint import JointKey
from pbrl.preference.questions import Question
from pbrl.run.policy_records import policy_checkpoint
from pbrl.run.reward_records import newest_reward_model
from pbrl.run.settings import policy_source

MARGINS_FILE = "pair_margins.json"
Asked = tuple[str, Question]  # (item id, question)


def margins_path(paths: RunPaths, round_index: int) -> Path:
    return paths.round_dir(round_index) / MARGINS_FILE


def question_margins(
    paths: RunPaths, round_index: int, job: JobConfig, rows_of: dict[JointKey, list[dict]], questions: list[Asked]
) -> list[float | None] | None:
    """The current model's margin of every question (x over y; None where the reward model could not score one),
    in order; None when there is no model to ask (see the module docstring). Read from ``pair_margins.json`` when
    the round has one for the same questions.

    Raises:
        ArtifactError: a checkpoint or reward model that the manifests name is missing.
    """
    path = margins_path(paths, round_index)
    ids = [_question_id(item_id, q) for item_id, q in questions]
    if path.is_file():
        kept = read_json(path)
        if kept.get("questions") == ids:
            return kept["margins"]
    model, margins = _compute(paths, round_index, job, rows_of, questions)
    if margins is not None:
        write_json(path, {"model": model, "questions": ids, "margins": margins})
    return margins


def _question_id(item_id: str, q: Question) -> str:
    return f"{item_id}:{q.x.side}{q.x.index}-{q.y.side}{q.y.index}"


def _compute(
    paths: RunPaths, round_index: int, job: JobConfig, rows_of: dict[JointKey, list[dict]], questions: list[Asked]
) -> tuple[str | None, list[float | None] | None]:
    """(what model gave the margins, the margins), or (None, None) without a model to ask."""
    if is_marlhf(job.trainer):
        found = newest_reward_model(paths, round_index)
        if found is None:
            return None, None
        rewards = _rewards(found[1], job, rows_of, questions)
        margins = [None if rewards[x] is None or rewards[y] is None else rewards[x] - rewards[y]  # type: ignore[operator]
                   for x, y in _joint_keys(questions)]  # fmt: skip
        return str(found[1].relative_to(paths.root)), margins
    current = policy_checkpoint(paths, round_index - 1)
    if current == paths.initial:
        return None, None
    ratios = _log_ratios(paths, job, current, rows_of, questions)
    margins = [job.dpo_beta * (ratios[x] - ratios[y]) for x, y in _joint_keys(questions)]
    return str(current.relative_to(paths.root)), margins


def _joint_keys(questions: list[Asked]) -> list[tuple[JointKey, JointKey]]:
    return [((item_id, q.x.side, q.x.index), (item_id, q.y.side, q.y.index)) for item_id, q in questions]


def _needed(questions: list[Asked]) -> list[JointKey]:
    """The joint responses the questions compare, each once, in order."""
    return list(dict.fromkeys(k for pair in _joint_keys(questions) for k in pair))


def _log_ratios(
    paths: RunPaths, job: JobConfig, current: Path, rows_of: dict[JointKey, list[dict]], questions: list[Asked]
) -> dict[JointKey, float]:
    """Σ_i log π_i(c_i | p_i) − log π_ref,i(c_i | p_i) of every joint response compared (the policies' implicit
    reward without β), scored without dropout; one actor for every role in centralized collaboration."""
    keys = _needed(questions)
    totals = dict.fromkeys(keys, 0.0)
    source = policy_source(job)
    for agent in range(job.num_agents):
        actor = 0 if is_centralized(job) else agent
        prompts = [list(rows_of[k][agent]["prompt_ids"]) for k in keys]
        completions = [list(rows_of[k][agent]["completion_ids"]) for k in keys]
        for checkpoint, sign in ((current, 1.0), (paths.initial, -1.0)):
            policy = load_agent(source, actor, checkpoint, trainable=False)
            pad = policy.tokenizer.pad_token_id if policy.tokenizer.pad_token_id is not None else 0
            with torch.no_grad():
                logps = sequence_logprobs(policy.model, prompts, completions, pad_token_id=pad)  # (len(keys),)
            for key, value in zip(keys, logps.float().tolist(), strict=True):
                totals[key] += sign * value
            del policy
    return totals


def _rewards(
    folder: Path, job: JobConfig, rows_of: dict[JointKey, list[dict]], questions: list[Asked]
) -> dict[JointKey, float | None]:
    """The reward model's R of every joint response compared (None: its responses do not fit its length)."""
    keys = _needed(questions)
    device = reward_device(job.reward_model_device, job.agent_devices, job.num_agents)
    scorer = RewardScorer(folder, job.num_agents, device=device)
    prompts: Sequence = [[list(row["prompt_ids"]) for row in rows_of[k]] for k in keys]
    completions: Sequence = [[list(row["completion_ids"]) for row in rows_of[k]] for k in keys]
    return {key: score for key, (score, _) in zip(keys, scorer.score(prompts, completions), strict=True)}
