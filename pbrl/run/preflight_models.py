"""Preflight checks of what the config asks of its models: LoRA target modules that exist, a reward backbone depth
the model has, a tokenizer that fits the model's vocabulary, and prompts that fit the model's context with
``max_new_tokens`` to generate.

They read each model's config (and its tokenizer where one is on disk) without loading weights. A packaged model
that is not converted yet is read without converting it: ``tiny-random`` is built (it takes a second), a GGUF file
gives its config from its metadata (transformers' reader, no tensors), and its tokenizer, needed for the prompts'
lengths only, is read only when a prompt could be too long for the context at all.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import AutoConfig, PretrainedConfig

from pbrl.config import JobConfig
from pbrl.errors import ArtifactError, ConfigError, Problem
from pbrl.generation.sampling import encode_prompt
from pbrl.models.loading import check_lora_target_modules, load_tokenizer, resolve_model_source
from pbrl.models.packaged import (
    PACKAGED_MODELS,
    locate_packaged_file,
    packaged_model_dir,
    prepare_packaged_model,
    read_marker,
)
from pbrl.run.settings import RewardBackbone, reward_backbone

# Bytes of a prompt beyond which its token count is worth measuring: a token covers at least one byte, and a chat
# template adds fewer tokens than this; under it a prompt cannot reach a context of this size.
TEMPLATE_ALLOWANCE = 512


@dataclass(frozen=True)
class ModelFacts:
    """A model's config, and the folder to read its tokenizer from (None: a packaged GGUF not converted yet)."""

    source: str
    config: PretrainedConfig
    folder: Path | None


def model_facts(source: str, *, field: str, prepare: bool) -> ModelFacts:
    """The config of a model source, converting a packaged model only when ``prepare`` (``tiny-random``, which
    builds in a second, always).

    Raises:
        ConfigError: naming ``field``, the source resolves to nothing (see ``resolve_model_source``).
        ArtifactError: a packaged model's pip package or file is missing.
    """
    packaged = PACKAGED_MODELS.get(source)
    if packaged is not None and not prepare and packaged.kind != "tiny":
        folder = packaged_model_dir(source)
        if read_marker(folder) is None:  # not converted: the GGUF file's metadata, no tensors read
            from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint  # deferred: GGUF only

            gguf = locate_packaged_file(source)
            values = load_gguf_checkpoint(str(gguf), return_tensors=False)["config"]
            return ModelFacts(source, AutoConfig.for_model(**values), None)
        return ModelFacts(source, AutoConfig.from_pretrained(folder, local_files_only=True), folder)
    folder = prepare_packaged_model(source) if packaged is not None else resolve_model_source(source, field=field)
    return ModelFacts(source, AutoConfig.from_pretrained(folder, local_files_only=True), folder)


def lora_problems(target_modules: Sequence[str] | None, facts: ModelFacts, field: str) -> list[Problem]:
    """``lora_target_modules`` entries (``target_modules``; None or empty: LoRA off, or its default modules) that
    name no adaptable module of the model."""
    if not target_modules:
        return []
    unknown = check_lora_target_modules(facts.config, list(target_modules))
    if not unknown:
        return []
    return [
        Problem(
            "lora_target_modules",
            unknown,
            f"no module of {field} {facts.source} is named so; check the model's module names (e.g. q_proj, "
            "k_proj, v_proj, o_proj for Llama-style models)",
        )
    ]


def reward_model_problems(backbone: RewardBackbone, facts: ModelFacts) -> list[Problem]:
    """``reward_backbone_layers`` beyond the reward model backbone's layers, and ``reward_max_length`` beyond its
    context (a joint text that long would be read at positions the backbone has never seen)."""
    problems = []
    layers = backbone.backbone_layers
    total = getattr(facts.config, "num_hidden_layers", None)
    if layers is not None and total is not None and layers > total:
        problems.append(
            Problem("reward_backbone_layers", layers, f"the reward model backbone {facts.source} has {total} layers")
        )
    length = backbone.max_length
    context = getattr(facts.config, "max_position_embeddings", None)
    if length is not None and context is not None and length > context:
        problems.append(
            Problem(
                "reward_max_length",
                length,
                f"the reward model backbone {facts.source} reads at most {context} tokens; give at most {context}",
            )
        )
    return problems


def vocabulary_problems(facts: ModelFacts, field: str) -> list[Problem]:
    """A tokenizer with more tokens than the model has embeddings: its highest ids would index past them."""
    vocab = getattr(facts.config, "vocab_size", None)
    if facts.folder is None or vocab is None:
        return []
    size = len(load_tokenizer(facts.folder))
    if size <= vocab:
        return []
    return [
        Problem(
            field,
            facts.source,
            f"its tokenizer has {size} tokens, more than the model's vocabulary ({vocab}): token ids "
            f"{vocab}..{size - 1} have no embedding; resize the model's embeddings or use its own tokenizer",
        )
    ]


def context_problems(
    facts: ModelFacts, prompts: Sequence[tuple[str, str]], max_new_tokens: int, field: str
) -> list[Problem]:
    """Prompts whose tokens plus ``max_new_tokens`` pass the model's context (``max_position_embeddings``): the
    model would be trained on positions it has never seen. ``prompts`` are ``(item_id, prompt)`` of one agent.

    A prompt is tokenized (chat template included, as sampling encodes it) only when its UTF-8 length could reach
    the context; a packaged model not converted yet is converted then.
    """
    context = getattr(facts.config, "max_position_embeddings", None)
    if context is None:
        return []
    room = context - max_new_tokens
    suspects = [(i, p) for i, p in prompts if len(p.encode()) + TEMPLATE_ALLOWANCE > room]
    if not suspects:
        return []
    folder = facts.folder or prepare_packaged_model(facts.source)
    tokenizer = load_tokenizer(folder)
    too_long = [(i, n) for i, p in suspects if (n := len(encode_prompt(tokenizer, p))) > room]
    if not too_long:
        return []
    shown = ", ".join(f"{i!r} ({n} tokens)" for i, n in too_long[:5])
    if max_new_tokens >= context:  # no prompt could fit: the option is at fault, not the prompts
        field, value = "max_new_tokens", max_new_tokens
    else:
        value = facts.source
    return [
        Problem(
            field,
            value,
            f"{len(too_long)} prompt(s) do not fit the context of {facts.source} ({context} tokens) with "
            f"max_new_tokens={max_new_tokens}: {shown}; shorten them, lower max_new_tokens or use a model with a "
            "longer context",
        )
    ]


def agent_model_problems(
    job: JobConfig, models: Sequence[str], prompts: Sequence[Sequence[tuple[str, str]]] | None, *, prepare: bool
) -> list[Problem]:
    """Every model check of the agents' models (one per agent; ``prompts``: each agent's ``(item_id, prompt)``)."""
    field = "agents" if job.agents else "agent_model"
    targets = job.lora_target_modules if job.lora_r is not None else None  # LoRA off: no target to check
    problems: list[Problem] = []
    facts_of: dict[str, ModelFacts | None] = {}
    for agent, source in enumerate(models):
        if source not in facts_of:
            facts_of[source] = _facts_or_problem(source, field, prepare, problems)
            if facts_of[source] is not None:
                problems += lora_problems(targets, facts_of[source], field)  # type: ignore[arg-type]
                problems += vocabulary_problems(facts_of[source], field)  # type: ignore[arg-type]
        facts = facts_of[source]
        if facts is not None and prompts is not None:
            problems += context_problems(facts, prompts[agent], job.max_new_tokens, field)
    if (backbone := reward_backbone(job)) is not None:  # MARLHF's reward model backbone
        source = backbone.model_name or models[0]
        reward_field = "reward_model_name" if backbone.model_name else field
        facts = facts_of.get(source) or _facts_or_problem(source, reward_field, prepare, problems)
        problems += reward_model_problems(backbone, facts) if facts is not None else []
    return problems


def _facts_or_problem(source: str, field: str, prepare: bool, problems: list[Problem]) -> ModelFacts | None:
    try:
        return model_facts(source, field=field, prepare=prepare)
    except ConfigError as exc:
        problems += exc.problems
    except (ArtifactError, OSError, ValueError) as exc:
        problems.append(Problem(field, source, str(exc)[:300]))
    return None


def with_ids(prompts: Sequence[Sequence[str]], items: Sequence[tuple[str, Any]]) -> list[list[tuple[str, str]]]:
    """Each actor's prompts (``[actor][item]``, :func:`pbrl.generation.collaboration.actor_prompts`) paired with
    their items' ids (``items``: ``(item_id, item)``, :func:`pbrl.data.items.with_item_ids`)."""
    ids = [item_id for item_id, _ in items]
    return [list(zip(ids, actor, strict=True)) for actor in prompts]
