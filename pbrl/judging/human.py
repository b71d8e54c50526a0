"""People as the judge (``judge: human``, docs/guides/label-pairs.md): the choices a person has for a pair, the answer
each choice is stored as, and a pair as people read it (the item's task, then the two joint responses side by side,
role by role, code shown as code), for the Prefect UI's form (:func:`pair_markdown`) and the terminal
(:func:`segments`, rendered by ``pbrl label``).

A person is one more judge: a label is an :class:`~pbrl.judging.verdicts.Answer` to the question in the order it was
shown, stored in the run's answer store under the judge name ``human`` like any judge's answer. ``skip`` (the person
cannot tell) is an answer without a verdict, so a skipped pair is not shown again and gives no preference.
"""

from __future__ import annotations

import html
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from pbrl.judging.verdicts import Answer, Comparison

NAME = "human"
Choice = Literal["A", "B", "tie", "skip"]
CHOICES: tuple[Choice, ...] = ("A", "B", "tie", "skip")
LATER = "later"  # a form's choice for a pair left for later (not labelled: asked again)
SKIPPED = "skipped by the labeller"
MAX_SHOWN_CHARS = 20_000  # of one text; a longer one is cut with a note (a person cannot read more in one cell)
# A line that opens code. [ \t]*, not \s*: with \s* (which crosses line ends) a text of many blank lines took
# quadratic time (20,000 newlines: 3 s); fenced blocks are found line by line for the same reason (segments).
_CODE_START = re.compile(r"^[ \t]*(def |class |import |from \S+ import |#include|function |@\w+)", re.MULTILINE)


def answer_of(choice: str, seconds: float = 0.0) -> Answer:
    """The stored answer of a person's ``choice`` (``A``, ``B``, ``tie`` or ``skip``) after ``seconds`` of looking.

    Raises:
        ValueError: another choice.
    """
    if choice == "skip":
        return Answer(None, raw="skip", seconds=seconds, reason=SKIPPED)
    if choice not in ("A", "B", "tie"):
        raise ValueError(f"label: got {choice!r}; allowed: {', '.join(CHOICES)}")
    return Answer(choice, raw=choice, seconds=seconds)  # type: ignore[arg-type]


def choice_of(answer: Answer) -> str:
    """The choice a stored answer records (its verdict, or ``skip``)."""
    return answer.verdict if answer.verdict is not None else "skip"


@dataclass(frozen=True)
class HumanJudge:
    """``judge: human``: people answer, through the Prefect UI's forms or ``pbrl label``, into the answer store; the
    stage judge-pairs reads their labels there (:func:`pbrl.run.labelling.labelled_answers`). Asking it directly
    is a bug."""

    name: str = NAME

    def answer(self, comparisons: Sequence[Comparison]) -> list[Answer]:
        raise RuntimeError("judge 'human' answers through `pbrl label` or the Prefect UI's forms, not when asked")


def looks_like_code(text: str) -> bool:
    """Whether a text without fences is code: a line opening a definition or import, or most lines indented."""
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines or len(lines) < 2:
        return bool(lines) and _CODE_START.match(text) is not None
    indented = sum(line.startswith(("    ", "\t")) for line in lines)
    return _CODE_START.search(text) is not None or indented * 2 > len(lines)


def segments(text: str) -> list[tuple[Literal["text", "code"], str]]:
    """``text`` cut into prose and code: fenced blocks are code, and so is a whole text that looks like code."""
    if len(text) > MAX_SHOWN_CHARS:
        text = text[:MAX_SHOWN_CHARS] + f"\n… ({len(text) - MAX_SHOWN_CHARS} more characters not shown)"
    if "```" not in text:
        return [("code" if looks_like_code(text) else "text", text)]
    out: list[tuple[Literal["text", "code"], str]] = []
    prose: list[str] = []
    block: list[str] | None = None  # the lines of an open fenced block
    for line in text.split("\n"):
        if block is None:
            if line.startswith("```") and "`" not in line[3:]:  # an opening fence: ``` and a language name
                block = [line]
            else:
                prose.append(line)
        elif line.startswith("```") and not line[3:].strip(" \t"):  # its closing fence
            prose = _flush(out, prose)
            out.append(("code", "\n".join(block[1:]).rstrip("\n")))
            block = None
        else:
            block.append(line)
    _flush(out, prose + (block or []))  # a fence never closed is prose
    return out


def _flush(out: list[tuple[Literal["text", "code"], str]], lines: list[str]) -> list[str]:
    """Append ``lines`` to ``out`` as one prose segment (none when blank); returns a fresh list."""
    text = "\n".join(lines)
    if text.strip():
        out.append(("text", text.strip("\n")))
    return []


def _cell(text: str) -> str:
    """One table cell's HTML, on one line (a blank line would end the HTML block in Markdown): prose escaped with
    its line breaks, code in ``<pre>`` with its newlines as entities."""
    if not text.strip():
        return "<i>(empty)</i>"
    parts = []
    for kind, part in segments(text):
        escaped = html.escape(part, quote=False)
        if kind == "code":
            parts.append("<pre><code>" + escaped.replace("\n", "&#10;") + "</code></pre>")
        else:
            parts.append(escaped.replace("\n", "<br>"))
    return "".join(parts)


def pair_markdown(comparison: Comparison, question_id: str, number: int, total: int) -> str:
    """One pair as the Prefect UI's form shows it (Markdown with HTML tables, which both Prefect UIs render): a
    heading with the pair's number, item and id, the task as each agent was asked, then A and B side by side, one
    row per role. Every model-written text is HTML-escaped."""
    roles = [html.escape(r, quote=False) for r in comparison.roles]
    prompts = zip(roles, comparison.prompts, strict=True)
    task = "".join(f"<tr><td><b>{r}</b></td><td>{_cell(p)}</td></tr>" for r, p in prompts)
    rows = "".join(
        f"<tr><td><b>{r}</b></td><td>{_cell(a)}</td><td>{_cell(b)}</td></tr>"
        for r, a, b in zip(roles, comparison.first, comparison.second, strict=True)
    )
    return "\n".join([
        f"### Pair {number} of {total} · item `{comparison.item_id}` · `{question_id}`",
        "",
        "**The task**, as each agent was asked:",
        "",
        f"<table><thead><tr><th>role</th><th>prompt</th></tr></thead><tbody>{task}</tbody></table>",
        "",
        "**The two joint responses**, role by role:",
        "",
        f'<table><thead><tr><th>role</th><th>A</th><th>B</th></tr></thead><tbody>{rows}</tbody></table>',
        "",
    ])  # fmt: skip
