"""The joint input of MARLHF's reward model and critics: every agent's prompt and response as one token sequence.

Every agent's prompt and response are read as one token sequence, built from the stored
token ids (never by decoding and re-encoding a completion), in this fixed template (k = 1 … a, agents in
order; the marker lines are text tokenized once with the reward model's tokenizer): every prompt first, then
every response::

    Joint multi-agent response\\n
    ### Agent k prompt\\n  <prompt ids of agent k>          (k = 1 … a, "\\n" between two prompts)
    \\n### Agent k response\\n  <completion ids of agent k, EOS included when generated>   (k = 1 … a)

The prompts come first so that the joint responses of one item share everything before agent 1's response: the
reward model runs that prefix once per item (:func:`pbrl.models.forward.shared_prefix_hidden`), where the first
template (``joint-v1``: agent 1's prompt and response, then agent 2's …) repeated agent 2's prompt after every
distinct agent-1 response (docs/results/marlhf.md#the-prompts-first-2026-12-03).

The ids are built once per pair (stage build-pairs, ``pair_joint_ids.parquet``) and once per rollout
(``rollouts.parquet``) by :func:`joint_input_ids`, so fitting, scoring and replay read the same ids. Longer
than ``reward_max_length``: prompt tokens are cut from the left, agent 1's prompt first; when the markers
and the responses alone do not fit, the joint response is dropped with a counted reason — no response
token, least of all the last agent's, is ever cut.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pbrl.data.schema import PairJointIdsRow, PairRow
from pbrl.models.loading import load_tokenizer, resolve_model_source

TEMPLATE_VERSION = "joint-v2"
HEADER = "Joint multi-agent response\n"
DROP_TOO_LONG = "reward_max_length: the markers and the responses alone do not fit"


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
    separator: tuple[int, ...]  # between one agent's prompt and the next agent's prompt marker

    @classmethod
    def build(cls, tokenizer: Any, num_agents: int) -> JointTemplate:
        """Tokenize the marker text once (``add_special_tokens=False``)."""

        def enc(text: str) -> tuple[int, ...]:
            return tuple(tokenizer(text, add_special_tokens=False).input_ids)

        return cls(
            header=enc(HEADER),
            prompt_markers=tuple(enc(_prompt_marker(k + 1)) for k in range(num_agents)),
            response_markers=tuple(enc(_response_marker(k + 1)) for k in range(num_agents)),
            separator=enc("\n"),
        )


@dataclass(frozen=True)
class JointInput:
    """One joint input: ``ids`` (None when dropped), ``prompt_tokens_cut``, the drop ``reason``, and where each
    agent's response and prompt lie in ``ids`` (``response_spans[k]``, ``prompt_spans[k] = (start, end)``, end
    exclusive, what is left of a prompt after the cut; empty when dropped)."""

    ids: list[int] | None
    prompt_tokens_cut: int = 0
    reason: str | None = None
    response_spans: tuple[tuple[int, int], ...] = ()
    prompt_spans: tuple[tuple[int, int], ...] = ()


def joint_input_ids(
    template: JointTemplate,
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    max_length: int | None,
) -> JointInput:
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
        raise ValueError(
            f"joint input: got {len(prompt_ids)} prompts and {len(completion_ids)} completions for "
            f"a template of {a} agents"
        )
    prompts = [list(p) for p in prompt_ids]
    fixed = (
        len(template.header)
        + sum(len(m) for m in template.prompt_markers)
        + sum(len(m) for m in template.response_markers)
        + len(template.separator) * (a - 1)
        + sum(len(c) for c in completion_ids)
    )
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
    prompt_spans = []
    for k in range(a):
        ids += [*(template.separator if k else ()), *template.prompt_markers[k]]
        prompt_spans.append((len(ids), len(ids) + len(prompts[k])))
        ids += prompts[k]
    spans = []
    for k in range(a):
        ids += template.response_markers[k]
        spans.append((len(ids), len(ids) + len(completion_ids[k])))
        ids += completion_ids[k]
    return JointInput([int(i) for i in ids], cut, None, tuple(spans), tuple(prompt_spans))


def check_same_vocabulary(reward_tokenizer: Any, agent_tokenizers: Sequence[Any], reward_model_name: str) -> None:
    """The joint input reads the agents' stored ids directly, so every agent's vocabulary must be the reward
    model's.

    Raises:
        ValueError: naming ``reward_model_name`` and the first agent whose vocabulary differs.
    """
    vocab = reward_tokenizer.get_vocab()
    for i, tok in enumerate(agent_tokenizers):
        if tok.get_vocab() != vocab:
            raise ValueError(
                f"reward_model_name: {reward_model_name!r} has another vocabulary than agent {i}'s "
                "model; the joint reward model reads the agents' token ids, so give a backbone with "
                "the agents' tokenizer"
            )


def joint_template_for(source: str, agent_sources: Sequence[str]) -> tuple[JointTemplate, Any]:
    """The template for the reward model ``source`` and its tokenizer, after checking that every agent
    (``agent_sources``, one per agent) shares its vocabulary (:func:`check_same_vocabulary`)."""

    tokenizer = load_tokenizer(resolve_model_source(source, field="reward_model_name"))
    agents = {s: load_tokenizer(resolve_model_source(s)) for s in dict.fromkeys(agent_sources)}
    check_same_vocabulary(tokenizer, [agents[s] for s in agent_sources], source)
    return JointTemplate.build(tokenizer, len(agent_sources)), tokenizer


def pair_joint_rows(pairs: Sequence[PairRow], template: JointTemplate, max_length: int | None) -> list[PairJointIdsRow]:
    """PAIR_JOINT_IDS rows of pairs rows (``prompt_ids``, ``winner_ids``, ``loser_ids`` per agent): a pair
    is dropped (both ids null, reason given) when either side's responses do not fit ``max_length``."""
    rows = []
    for p in pairs:
        w = joint_input_ids(template, p["prompt_ids"], p["winner_ids"], max_length)
        lo = joint_input_ids(template, p["prompt_ids"], p["loser_ids"], max_length)
        reason = w.reason or lo.reason
        rows.append(
            {
                "pair_id": p["pair_id"],
                "winner_joint_ids": None if reason else w.ids,
                "loser_joint_ids": None if reason else lo.ids,
                "prompt_tokens_cut": w.prompt_tokens_cut + lo.prompt_tokens_cut,
                "dropped": reason,
            }
        )
    return rows
