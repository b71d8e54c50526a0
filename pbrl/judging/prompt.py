"""The text a language-model judge reads: the task as each agent saw it and the two joint responses, role by role.

The default template (:data:`DEFAULT_TEMPLATE`, docs/guides/judges.md#the-prompt) asks for one word, ``A``, ``B`` or
``tie``, which :func:`pbrl.judging.verdicts.parse_verdict` reads strictly. ``judge_prompt_template`` replaces it with
a file of the same fields, in Python's ``str.format`` syntax:

- ``{num_agents}``: how many agents answered together;
- ``{task}``: each agent's role and prompt (:func:`render_task`);
- ``{response_a}``, ``{response_b}``: each agent's role and text of the joint response shown first and second
  (:func:`render_response`); both are required.

Texts are put in as they are, each under its role's heading and fenced (a fence longer than any run of backticks
inside), so code stays code and a text cannot close its own block.
"""

from __future__ import annotations

import re
import string
from collections.abc import Sequence

from pbrl.judging.verdicts import Comparison

FIELDS = ("num_agents", "task", "response_a", "response_b")
REQUIRED = ("response_a", "response_b")

DEFAULT_TEMPLATE = """\
You are judging the work of a team of {num_agents} agents. Each agent has a role and was given its own \
instructions for the same task; together their texts form one joint response.

# The task, as each agent was asked

{task}

# Joint response A

{response_a}

# Joint response B

{response_b}

# Your judgement

Which joint response is better as a whole: does each agent do its own part well, and do the parts work \
together? Ignore the order in which the responses are shown and their length as such.
Answer with exactly one word: A, B, or tie.
"""


def _fenced(text: str) -> str:
    """``text`` in a Markdown fence longer than any run of backticks it holds."""
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}\n{text}\n{fence}"


def _by_role(roles: Sequence[str], texts: Sequence[str]) -> str:
    return "\n\n".join(f"## {role}\n\n{_fenced(text)}" for role, text in zip(roles, texts, strict=True))


def render_task(comparison: Comparison) -> str:
    """Each agent's role and prompt, in agent order."""
    return _by_role(comparison.roles, comparison.prompts)


def render_response(comparison: Comparison, which: str) -> str:
    """Each agent's role and text of the joint response shown ``which`` (``"A"`` or ``"B"``)."""
    texts = comparison.first if which == "A" else comparison.second
    return _by_role(comparison.roles, texts)


def template_problems(template: str) -> list[str]:
    """What is wrong with a prompt template: a field it names that is not one of :data:`FIELDS`, a required field
    it lacks, or a format error; empty when it is usable."""
    try:
        named = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
    except ValueError as exc:
        return [f"not a format string ({exc}); write a literal brace as {{{{ or }}}}"]
    problems = [f"unknown field {{{name}}}; allowed: {', '.join(FIELDS)}" for name in sorted(named - set(FIELDS))]
    problems += [f"lacks {{{name}}}" for name in REQUIRED if name not in named]
    return problems


def render(template: str, comparison: Comparison) -> str:
    """The judge's prompt for ``comparison`` from ``template`` (checked with :func:`template_problems`).

    Raises:
        ValueError: the template has a problem (every one named).
    """
    problems = template_problems(template)
    if problems:
        raise ValueError("judge_prompt_template: " + "; ".join(problems))
    return template.format(
        num_agents=len(comparison.roles),
        task=render_task(comparison),
        response_a=render_response(comparison, "A"),
        response_b=render_response(comparison, "B"),
    )
