"""The options reference, ``docs/reference/options.md``, generated from the configuration models.

Every option is rendered once, with its type, default, range, the trainers that have it and its description,
all read from the pydantic fields (:mod:`pbrl.config.fields`), so the page can never say something the models
do not. Regenerate the page after changing a field::

    python -m pbrl.config.reference > docs/reference/options.md

``tests/repo/test_docs.py`` fails while the committed page differs from :func:`options_markdown`.

Groups: the run-level options (:class:`~pbrl.config.models.RunConfig`), then the trainer options by the set of
trainers that have them (every trainer, the iterative ones, the MARLHF ones, MARLHF-iterative alone); within a
group, options keep the order of the models. An option whose type, default, range or description differs between
trainers (``num_train_epochs``, ``preference_num_candidates`` ...) lists each variant with its trainers.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Iterable, Sequence
from typing import Any

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from pbrl.config.models import JOB_CLASSES, RUN_FIELDS, TRAINER_CONFIGS, RunConfig

PAGE = "docs/reference/options.md"
REGENERATE = f"python -m pbrl.config.reference > {PAGE}"
CHANGES_ANCHOR = "../design/algorithms.md#deliberate-changes-from-the-reference"

# Options whose default, range or meaning differs on purpose from the reference library (CoMLRL): option ->
# (the trainers where it does, None = everywhere it exists; what differs). The whole list, with the reasons,
# is docs/design/algorithms.md, "Deliberate changes from the reference"; tests/repo/test_docs.py checks that every
# option named here is named there too.
CHANGED_FROM_REFERENCE: dict[str, tuple[tuple[str, ...] | None, str]] = {
    "num_train_epochs": (("marlhf",), "default 1 for MARLHF (the reference inherits MADPO's 20)"),
    "eval_interval": (
        None,
        "counts rounds, default 1, with a round-0 baseline (the reference counts update steps, default 16)",
    ),
    "preference_num_candidates": (
        ("madpo_iter", "marlhf_iter"),
        "iterative trainers accept 1 (the reference asks for at least 2)",
    ),
    "reward_model_device": (None, "default: the first agent's device (the reference's 'cuda:0' fails without a GPU)"),
    "max_grad_norm": (None, "clips at 1.0 by default (the reference does not clip)"),
    "comparator_history_k": (
        None,
        "k counts updates back from the current policy (the reference's k = 1 silently equals the current weights)",
    ),
}

GROUPS: tuple[tuple[str, frozenset[str], str], ...] = (
    ("Every trainer", frozenset(TRAINER_CONFIGS), "Options of `madpo`, `madpo_iter`, `marlhf` and `marlhf_iter`."),
    (
        "Iterative trainers",
        frozenset({"madpo_iter", "marlhf_iter"}),
        "Rounds, comparators, replay and round exports: `madpo_iter` and `marlhf_iter` only.",
    ),
    (
        "MARLHF trainers",
        frozenset({"marlhf", "marlhf_iter"}),
        "The joint reward model, the RL backends and their critics: `marlhf` and `marlhf_iter` only.",
    ),
    ("MARLHF-iterative only", frozenset({"marlhf_iter"}), "Options of `marlhf_iter` alone."),
)

_BOUNDS = (
    (annotated_types.Ge, "ge", "≥"),
    (annotated_types.Gt, "gt", ">"),
    (annotated_types.Le, "le", "≤"),
    (annotated_types.Lt, "lt", "<"),
)


def type_text(annotation: Any) -> str:
    """A field's type for people: ``int``, ``float | None``, ``'current' | 'nearest_k'``, ``list[str]``."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return type_text(args[0])
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        parts = [type_text(a) for a in args if a is not type(None)]
        return " | ".join(parts + (["None"] if type(None) in args else []))
    if origin in (list, tuple, dict, set):
        return f"{origin.__name__}[{', '.join(type_text(a) for a in args)}]"
    if annotation is typing.Any:
        return "Any"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return f"{annotation.__name__} (a mapping)"
    return getattr(annotation, "__name__", str(annotation))


def range_text(info: FieldInfo) -> str:
    """The single-field bounds of an option (``≥ 1``, ``> 0, ≤ 1``), or ``""``."""
    parts = []
    for item in info.metadata:
        for cls, attr, sign in _BOUNDS:
            if isinstance(item, cls):
                parts.append(f"{sign} {getattr(item, attr)}")
    return ", ".join(parts)


def default_text(info: FieldInfo) -> str:
    """The default as YAML-minded people read it, in backticks; ``required`` when there is none."""
    if info.is_required():
        return "required"
    return f"`{info.get_default(call_default_factory=True)!r}`"


def markdown_text(text: str) -> str:
    """A description as markdown: whitespace runs joined, and ``<`` outside code spans escaped, so that
    ``<run>/replay`` stays text instead of becoming an HTML tag."""
    parts = " ".join(text.split()).split("`")
    return "`".join(p if i % 2 else p.replace("<", "\\<") for i, p in enumerate(parts))


def _variant(info: FieldInfo) -> tuple[str, str, str, str]:
    return type_text(info.annotation), default_text(info), range_text(info), markdown_text(info.description or "")


def _trainer_list(trainers: Iterable[str]) -> str:
    return ", ".join(f"`{t}`" for t in trainers)


def _changed(name: str, trainers: Sequence[str]) -> str | None:
    if name not in CHANGED_FROM_REFERENCE:
        return None
    where, what = CHANGED_FROM_REFERENCE[name]
    if where is not None and not set(where) & set(trainers):
        return None
    return what


def option_section(name: str, variants: dict[tuple[str, str, str, str], list[str]]) -> list[str]:
    """The markdown of one option: a heading (its anchor is the option name) and its facts.

    Args:
        variants: (type, default, range, description) -> the trainers that have the option so ("all" for a
            run-level option).
    """
    trainers = [t for ts in variants.values() for t in ts]
    lines = [f"### `{name}`", ""]
    changed = _changed(name, trainers)
    if changed:
        lines += [f"★ Changed from the reference: {changed} ([why]({CHANGES_ANCHOR})).", ""]
    if len(variants) == 1:
        ((kind, default, bounds, description),) = variants
        lines += [f"- type: `{kind}`", f"- default: {default}"]
        lines += [f"- range: {bounds}"] if bounds else []
        lines += [f"- trainers: {'all' if trainers == ['all'] else _trainer_list(trainers)}", "", description, ""]
        return lines
    # Variants: the facts per trainer set, then the description once when it is the same for all.
    for (kind, default, bounds, _), owners in variants.items():
        facts = f"type `{kind}`, default {default}" + (f", range {bounds}" if bounds else "")
        lines += [f"- {_trainer_list(owners)}: {facts}"]
    descriptions = {d for (_, _, _, d) in variants}
    if len(descriptions) == 1:
        return lines + ["", descriptions.pop(), ""]
    lines.append("")
    for (_, _, _, description), owners in variants.items():
        lines += [f"{_trainer_list(owners)}: {description}", ""]
    return lines


def _trainer_variants(name: str) -> dict[tuple[str, str, str, str], list[str]]:
    variants: dict[tuple[str, str, str, str], list[str]] = {}
    for trainer, cls in TRAINER_CONFIGS.items():
        if name in cls.model_fields:
            variants.setdefault(_variant(cls.model_fields[name]), []).append(trainer)
    return variants


def trainer_option_names() -> list[str]:
    """Every trainer option, in the order the job models declare them."""
    names: dict[str, None] = {}
    for cls in JOB_CLASSES.values():
        names.update({n: None for n in cls.model_fields if n not in RUN_FIELDS})
    return list(names)


def options_markdown() -> str:
    """The whole options reference page (markdown, MyST-compatible), ending with one newline."""
    lines = [
        "# Options reference",
        "",
        "<!-- Generated by `" + REGENERATE + "` from the field descriptions in pbrl/config/fields.py, "
        "iterative_fields.py, judge_fields.py and run_fields.py. -->",
        "<!-- Do not edit by hand: tests/repo/test_docs.py fails while this page differs from the models. -->",
        "",
        "Every option of a pbrl job, generated from the configuration models (`pbrl/config/fields.py`, "
        "`iterative_fields.py`, `judge_fields.py`, `run_fields.py`). A YAML "
        "config is flat: run-level options and the trainer's options side by side; the Python trainers take the "
        "trainer options in their config object (`MADPOIterConfig(...)`) and the run-level ones as keyword "
        "arguments. Option names are those of the reference library, CoMLRL's `comlrl.trainers.preference`; "
        f"★ marks a deliberate change from it ([the list]({CHANGES_ANCHOR})). Cross-field rules (which options "
        "go together) are checked by `pbrl validate`; see [the configuration guide]"
        "(../guides/configuration.md).",
        "",
        "## Run-level options",
        "",
        "Where the run lives, what it trains on, the agents' models, LoRA, devices, precision and memory, the "
        "oracle's limits, and where the item-parallel stages run. Every trainer has them.",
        "",
    ]
    for name, info in RunConfig.model_fields.items():
        lines += option_section(name, {_variant(info): ["all"]})
    names = trainer_option_names()
    owners = {n: frozenset(t for t, c in TRAINER_CONFIGS.items() if n in c.model_fields) for n in names}
    grouped = {g[1] for g in GROUPS}
    missing = sorted(n for n in names if owners[n] not in grouped)
    if missing:  # a new trainer set: give it a group above
        raise ValueError(f"options in no group of pbrl.config.reference.GROUPS: {missing}")
    for title, trainers, intro in GROUPS:
        lines += [f"## {title}", "", intro, ""]
        for name in names:
            if owners[name] == trainers:
                lines += option_section(name, _trainer_variants(name))
    while lines[-1] == "":
        lines.pop()
    return "\n".join(lines) + "\n"


def main() -> None:
    """Print the page: ``python -m pbrl.config.reference > docs/reference/options.md``."""
    print(options_markdown(), end="")


if __name__ == "__main__":
    main()
