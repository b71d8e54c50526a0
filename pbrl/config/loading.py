"""Reading, combining and hashing pbrl jobs: :func:`parse_job`, :func:`load_job` (YAML + ``key=value``
overrides), :func:`make_job` / :func:`split_job` and :func:`config_hash`. Import these from :mod:`pbrl.config`.

Every entry raises one :class:`~pbrl.errors.ConfigError` listing every problem at once. YAML is read with
YAML 1.2 numbers (``1e-5`` is a float, as users expect; PyYAML's YAML 1.1 reads it as a string), and an
override keeps the text as typed where the option takes text (``--set run_name=2024`` is ``'2024'``).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel

from pbrl.config.messages import scalar_kinds
from pbrl.config.models import (
    ALL_FIELDS,
    JOB_CLASSES,
    RUN_FIELDS,
    SECRET_KEY,
    TRAINER_CONFIGS,
    TRAINER_NAMES,
    VALIDATION_MODE,
    JobConfig,
    RunConfig,
    TrainerConfig,
    collect_problems,
    is_iterative,
    suggest,
)
from pbrl.errors import ConfigError, Problem

_Model = TypeVar("_Model", bound=BaseModel)
# Where a run lives, and where its stages execute (the artifacts are the same on every runner), never key a cache.
_HASH_EXCLUDED = frozenset(
    {"run_name", "output_dir", "runner", "ray_address", "shard_size", "num_threads", "report_to"}
)


class _YAMLLoader(yaml.SafeLoader):
    """SafeLoader that also reads exponent numbers without a dot or exponent sign (``1e-5``, ``2.0e5``) and
    refuses a key given twice in one mapping (YAML forbids it; PyYAML would keep the last one silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, yaml.Node] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.get(key)
            except TypeError:  # an unhashable key: PyYAML's own error follows
                continue
            if first is not None:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping", node.start_mark,
                    f"found duplicate key {key!r} (first at line {first.start_mark.line + 1})", key_node.start_mark,
                )  # fmt: skip
            seen[key] = key_node
        return super().construct_mapping(node, deep=deep)


_YAMLLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


# Bounds of a config document once its aliases are expanded (issue #53.4: a 500-byte file of nested aliases made
# validate run for minutes). A config is a flat mapping of options; its largest values (a dataset spec, task options,
# an agents list) hold hundreds of values, so these bounds leave room for any real config and stop every walk over
# the values (validation, hashing, messages) from meeting more than this, whatever the input.
MAX_VALUES = 200_000  # nodes (mappings, lists, scalars), each alias counted as often as it is used
MAX_TEXT = 4_000_000  # characters of all scalars, each alias's counted as often as it is used
MAX_DEPTH = 64  # nesting of mappings and lists


def read_yaml(text: str) -> Any:
    """``text`` parsed like ``yaml.safe_load``, with YAML 1.2 exponent floats, within :data:`MAX_VALUES`,
    :data:`MAX_TEXT` and :data:`MAX_DEPTH` once every alias is expanded; checked on the composed node graph, before
    any value is built.

    Raises:
        yaml.YAMLError: not valid YAML, or past a bound (an alias that contains itself is past every bound).
    """
    loader = _YAMLLoader(text)  # a SafeLoader subclass: no arbitrary objects
    try:
        try:
            node = loader.get_single_node()
        except RecursionError:
            raise yaml.YAMLError(f"nested more than {MAX_DEPTH} levels deep") from None
        if node is None:
            return None
        _check_expanded_size(node)
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _check_expanded_size(root: yaml.Node) -> None:
    """Raise yaml.YAMLError when the document under ``root``, aliases expanded, passes a bound. Each node's expanded
    size is computed once (a graph of shared nodes, not the tree it stands for: linear in the file's size)."""
    sizes: dict[int, tuple[int, int, int]] = {}  # id(node) -> (values, characters, depth) of its expansion
    open_nodes: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        if key in sizes:
            continue
        children = _children(node)
        if not children_done:
            if key in open_nodes:
                raise yaml.YAMLError(f"an alias at line {node.start_mark.line + 1} contains itself")
            open_nodes.add(key)
            stack.append((node, True))
            stack.extend((child, False) for child in children if id(child) not in sizes)
            continue
        open_nodes.discard(key)
        values = 1 + sum(sizes[id(c)][0] for c in children)
        chars = len(node.value) if isinstance(node, yaml.ScalarNode) else sum(sizes[id(c)][1] for c in children)
        depth = 1 + max((sizes[id(c)][2] for c in children), default=0)
        if values > MAX_VALUES or chars > MAX_TEXT or depth > MAX_DEPTH:
            raise yaml.YAMLError(
                f"the value at line {node.start_mark.line + 1} expands to {values:,} values, {chars:,} characters and "
                f"{depth} levels (its aliases counted each time they are used); a config holds at most "
                f"{MAX_VALUES:,}, {MAX_TEXT:,} and {MAX_DEPTH}"
            )
        sizes[key] = (values, chars, depth)


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return []


def parse_job(data: Mapping[str, Any], *, warn: bool = True) -> JobConfig:
    """Validate a flat mapping of options into the job model named by its ``trainer`` key.

    ``warn=False`` skips the :class:`~pbrl.config.rules.ConfigNotice` warnings (for a job re-read from a run
    folder, which was checked and warned about when the run started).

    Raises:
        ConfigError: listing every problem at once: a missing/unknown ``trainer`` (alone, since it decides
            the options), unknown options (with a suggestion), type and range errors, and the cross-field
            rules of docs/guides/configuration.md#strict-types-no-aliases — the rules are checked on the given values
            that passed type validation plus
            the trainer's defaults, and rules that read an invalid option are skipped.
    """
    return _parse_job(data, warn=warn)


def _parse_job(data: Mapping[str, Any], *, warn: bool) -> Any:
    if not isinstance(data, Mapping):
        raise ConfigError([Problem("config", type(data).__name__, "must be a mapping of option: value")])
    trainer = data.get("trainer")
    if not isinstance(trainer, str) or trainer not in JOB_CLASSES:
        message = f"allowed: {TRAINER_NAMES}" if "trainer" in data else f"missing; allowed: {TRAINER_NAMES}"
        raise ConfigError([Problem("trainer", trainer, message)])
    return _parse(JOB_CLASSES[trainer], data, warn=warn)


def parse_config(cls: type[_Model], data: Mapping[str, Any]) -> _Model:
    """Validate ``data`` as ``cls`` (a trainer config, RunConfig or a job class).

    Raises:
        ConfigError: every problem at once (see :func:`~pbrl.config.models.collect_problems`).
    """
    return _parse(cls, data, warn=True)


def _parse(cls: type[_Model], data: Mapping[str, Any], *, warn: bool) -> _Model:
    problems = collect_problems(cls, data)
    if problems:
        raise ConfigError(problems)
    return cls.model_validate(dict(data), context={VALIDATION_MODE: "full" if warn else "quiet"})


def parse_override(text: str) -> tuple[str, Any]:
    """Split a ``"key=value"`` override; the value is read as YAML (``key=`` gives None, ``1e-5`` a float).

    Where ``key`` is an option that takes text but not the number or boolean that YAML read, the value is
    the text as typed (``run_name=2024`` -> ``'2024'``, ``run_name=1e5`` -> ``'1e5'``): a shell user cannot
    easily quote for YAML, and a YAML file would need the quotes.

    Raises:
        ConfigError: when there is no '=' or no key, or when the value is not valid YAML.
    """
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError([Problem("override", text, "must look like key=value (e.g. dpo_beta=0.2)")])
    try:
        value = read_yaml(raw)
    except yaml.YAMLError as exc:
        raise ConfigError([Problem(key, raw, f"override value is not valid YAML ({_yaml_reason(exc)})")]) from None
    if key in ALL_FIELDS and isinstance(value, bool | int | float):
        kinds = scalar_kinds(ALL_FIELDS[key].annotation)
        fits = type(value) in kinds or (type(value) is int and float in kinds)
        if str in kinds and not fits:
            return key, raw.strip()
    return key, value


def load_job(path: str | Path, overrides: Sequence[str] = ()) -> JobConfig:
    """Read a flat YAML job file, apply ``"key=value"`` overrides in order, and validate (see parse_job).

    Raises:
        ConfigError: naming the file when it cannot be read, is not valid YAML or is not a mapping; else
            every problem of the overrides and of the merged options at once.
    """
    path = Path(path)
    try:
        data = read_yaml(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError([Problem("config file", str(path), f"cannot be read ({exc.strerror or exc})")]) from None
    except yaml.YAMLError as exc:
        raise ConfigError([Problem("config file", str(path), f"is not valid YAML ({_yaml_reason(exc)})")]) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(
            [Problem("config file", str(path), f"must hold a mapping of option: value, not a {type(data).__name__}")]
        )
    return apply_overrides(data, overrides)


def apply_overrides(data: Mapping[str, Any], overrides: Sequence[str]) -> JobConfig:
    """``data`` (a flat mapping of options) with ``"key=value"`` overrides applied in order, validated.

    Raises:
        ConfigError: every problem of the overrides (malformed, unknown option) and of the merged options at once.
    """
    data = dict(data)
    problems: list[Problem] = []
    for text in overrides:
        try:
            key, value = parse_override(text)
        except ConfigError as exc:
            problems += exc.problems
            continue
        if key in ALL_FIELDS or key == SECRET_KEY:
            data[key] = value
        else:
            problems.append(Problem(key, value, "unknown option in an override" + suggest(key, ALL_FIELDS)))
    try:
        job = parse_job(data)
    except ConfigError as exc:
        raise ConfigError(problems + exc.problems) from None
    if problems:
        raise ConfigError(problems)
    return job


def _yaml_reason(exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return where + str(getattr(exc, "problem", None) or exc)


def make_job(run: RunConfig | Mapping[str, Any], trainer: TrainerConfig) -> JobConfig:
    """Combine run-level options and a trainer config into the flat job model.

    Raises:
        ConfigError: when ``run`` names another trainer or holds non-run options, or when the combination
            breaks a rule that joins run and trainer options (e.g. ``len(agents) != num_agents``).
    """
    names = {cls: name for name, cls in TRAINER_CONFIGS.items()}
    if type(trainer) not in names:
        raise ConfigError(
            [
                Problem(
                    "trainer",
                    type(trainer).__name__,
                    "must be one of the trainer configs: " + ", ".join(c.__name__ for c in names),
                )
            ]
        )
    name = names[type(trainer)]
    run_values = dict(run)
    problems = [
        Problem(k, v, "not a run-level option; set it on the trainer config")
        for k, v in run_values.items()
        if k not in RUN_FIELDS
    ]
    if run_values.get("trainer", name) != name:
        problems.append(
            Problem(
                "trainer",
                run_values["trainer"],
                f"does not match the trainer config {type(trainer).__name__} ('{name}')",
            )
        )
    if problems:
        raise ConfigError(problems)
    return _parse_job({**run_values, **dict(trainer), "trainer": name}, warn=False)


def split_job(job: Any) -> tuple[RunConfig, TrainerConfig]:
    """The run-level options and the trainer config of a flat job (inverse of make_job)."""
    trainer_cls = TRAINER_CONFIGS[job.trainer]
    quiet = {VALIDATION_MODE: "quiet"}
    values = dict(job)  # pydantic's fields and their values, as they are (no dump, no conversion)
    run = RunConfig.model_validate({k: values[k] for k in RUN_FIELDS}, context=quiet)
    trainer = trainer_cls.model_validate({k: values[k] for k in trainer_cls.model_fields}, context=quiet)
    return run, trainer


def config_hash(job: BaseModel) -> str:
    """sha256 hex of the canonical JSON (sorted keys) of ``job.model_dump(mode="json")``.

    ``run_name`` and ``output_dir`` are left out: where a run lives must not change its cache keys.
    """
    data = {k: v for k, v in job.model_dump(mode="json").items() if k not in _HASH_EXCLUDED}
    text = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def stage_config_hash(job: JobConfig) -> str:
    """The config hash that keys stage caches: ``num_iterations`` is left out, since adding an iteration
    to a run (the nightly deployment) must not invalidate the rounds already done."""
    if is_iterative(job.trainer):
        job = job.model_copy(update={"num_iterations": 1})
    return config_hash(job)
