"""Centralized comparator generation (docs/design/algorithms.md#centralized-comparator-generation): one comparator
writes every role in one response.

An adapter turns the agents' own prompts for an item into one centralized prompt, and parses the joint
response back into one text per role. The default, :class:`TaggedAdapter`, asks for sections
``<agent_0>…</agent_0>`` … ``<agent_{n-1}>…</agent_{n-1}>``, numbered from 0 as the reference's
``TaggedCentralizedComparatorAdapter`` numbers them ("Agent 0 original prompt"), and reads responses in either
numbering: the 0-based tags when every one of them is there, else the 1-based ``<agent_1>`` … ``<agent_n>``
(what pbrl asked for before 2026-12-02, and what a model may write on its own). Another adapter is plugged in
by import path ``"pkg.module:Name"`` (a class, instantiated without arguments, or an object) through
:func:`load_adapter`.

A response that cannot be parsed raises :class:`CentralizedParseError`; the caller drops that candidate and
counts it (★ the reference aborts training on it). The same adapter splits the joint responses of centralized
collaboration (``collaboration_mode: centralized``, :mod:`pbrl.generation.collaboration`) for the task reward.

The centralized prompt of the default adapter (``{n}`` agents, ``{i}`` from 0)::

    You are a centralized coordinator writing the separate outputs of {n} agents that work together on
    one task. Each agent's original prompt follows.

    Agent {i} original prompt:
    {prompt of agent i}
    ...

    Write every agent's output, each inside its own tags, in this form and nothing else:
    <agent_0>agent 0's output</agent_0>
    ...
    <agent_{n-1}>agent {n-1}'s output</agent_{n-1}>
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from pbrl.errors import ConfigError, Problem

ADAPTER_FIELD = "comparator_centralized_adapter"


class CentralizedParseError(ValueError):
    """A centralized response that does not hold every role's section; the message names the missing ones."""


@runtime_checkable
class CentralizedAdapter(Protocol):
    """Builds one centralized prompt from the role prompts and splits a joint response into roles."""

    def build_prompt(self, item: Mapping[str, Any], agent_prompts: Sequence[str]) -> str:
        """The one prompt the centralized comparator answers; ``agent_prompts`` has one entry per role."""
        ...

    def parse_completion(self, completion: str, num_agents: int) -> list[str]:
        """Exactly ``num_agents`` role texts, in role order.

        Raises:
            CentralizedParseError: a role's section is missing or empty.
        """
        ...


class TaggedAdapter:
    """The default adapter: ``<agent_i>…</agent_i>`` sections, i = 0..n−1 as the reference asks for them, or
    1..n (case-insensitive, content stripped; module docstring)."""

    def build_prompt(self, item: Mapping[str, Any], agent_prompts: Sequence[str]) -> str:
        n = len(agent_prompts)
        parts = [
            f"You are a centralized coordinator writing the separate outputs of {n} agents that work "
            "together on one task. Each agent's original prompt follows.",
            "",
        ]
        for i, prompt in enumerate(agent_prompts):
            parts += [f"Agent {i} original prompt:", prompt, ""]
        parts.append("Write every agent's output, each inside its own tags, in this form and nothing else:")
        parts += [f"<agent_{i}>agent {i}'s output</agent_{i}>" for i in range(n)]
        return "\n".join(parts)

    def parse_completion(self, completion: str, num_agents: int) -> list[str]:
        zero_based = _sections(completion, range(num_agents))
        if all(zero_based):
            return zero_based
        one_based = _sections(completion, range(1, num_agents + 1))
        if all(one_based):
            return one_based
        missing = ", ".join(f"<agent_{i}>" for i, text in enumerate(zero_based) if not text)
        missing_one = ", ".join(f"<agent_{i + 1}>" for i, text in enumerate(one_based) if not text)
        raise CentralizedParseError(f"missing or empty section(s) {missing} (numbered from 1: {missing_one})")


def _sections(completion: str, numbers: range) -> list[str]:
    """The stripped text of each ``<agent_i>…</agent_i>`` section, i in ``numbers`` ("" when absent)."""
    texts = []
    for i in numbers:
        match = re.search(rf"<agent_{i}>(.*?)</agent_{i}>", completion, flags=re.IGNORECASE | re.DOTALL)
        texts.append(match.group(1).strip() if match else "")
    return texts


def load_adapter(path: str | None) -> CentralizedAdapter:
    """The adapter named by import path ``"pkg.module:Name"`` (a class is instantiated with no arguments);
    None gives :class:`TaggedAdapter`.

    Raises:
        ConfigError: naming ``comparator_centralized_adapter``, when the path does not import or the object
            lacks ``build_prompt`` / ``parse_completion``.
    """
    if path is None:
        return TaggedAdapter()
    module_name, _, attr = path.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ConfigError([Problem(ADAPTER_FIELD, path, f"does not import ({exc}); give 'pkg.module:Name'")]) from exc
    adapter = obj() if isinstance(obj, type) else obj
    if not (callable(getattr(adapter, "build_prompt", None)) and callable(getattr(adapter, "parse_completion", None))):
        raise ConfigError(
            [
                Problem(
                    ADAPTER_FIELD,
                    path,
                    "needs callable build_prompt(item, agent_prompts) and parse_completion(completion, num_agents)",
                )
            ]
        )
    return adapter


def parse_roles(adapter: CentralizedAdapter, completion: str, num_agents: int) -> tuple[list[str] | None, str | None]:
    """The role texts of one joint response and why it could not be parsed: ``(roles, None)`` or
    ``(None, reason)`` (the adapter's :class:`CentralizedParseError` message; the caller drops and counts it).

    Raises:
        ConfigError: naming the adapter, when it returned anything but a list (or tuple) of exactly
            ``num_agents`` strings (a bug in the adapter, never dropped silently: a dict ``{role: text}`` would
            make the role names the texts).
    """
    try:
        roles = adapter.parse_completion(completion, num_agents)
    except CentralizedParseError as exc:
        return None, str(exc) or "unparsable"
    if not isinstance(roles, list | tuple) or len(roles) != num_agents or not all(isinstance(r, str) for r in roles):
        shown = repr(roles)[:120]
        raise ConfigError(
            [
                Problem(
                    ADAPTER_FIELD,
                    type(adapter).__name__,
                    f"parse_completion must return a list of "
                    f"exactly {num_agents} strings (one per role, in role order), got {shown}",
                )
            ]
        )
    return list(roles), None


def split_roles(adapter: CentralizedAdapter, completion: str, num_agents: int) -> list[str] | None:
    """The role texts of one joint response, or None when the adapter cannot parse it (the caller counts it).

    Raises:
        ConfigError: as :func:`parse_roles`.
    """
    return parse_roles(adapter, completion, num_agents)[0]


class EqualSharesAdapter:
    """An adapter for models that never write ``<agent_i>`` tags (the tiny random model of smoke runs and
    ``flows/configs/tiny-centralized.yaml``): the prompt of :class:`TaggedAdapter`, and role i = the i-th of n
    equal character runs of the stripped response (the last run takes the remainder).

    Raises:
        CentralizedParseError: the response has fewer than 2·n characters.
    """

    def build_prompt(self, item: Mapping[str, Any], agent_prompts: Sequence[str]) -> str:
        return TaggedAdapter().build_prompt(item, agent_prompts)

    def parse_completion(self, completion: str, num_agents: int) -> list[str]:
        text = completion.strip()
        if len(text) < 2 * num_agents:
            raise CentralizedParseError(f"{len(text)} characters")
        size = len(text) // num_agents
        return [text[i * size : (i + 1) * size if i < num_agents - 1 else len(text)] for i in range(num_agents)]
