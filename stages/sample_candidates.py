"""Stage 1, sample-candidates: every agent samples its candidates for every train item
(docs/design/stages.md#sample-candidates).

Round r samples from the policy after round r-1. Iterative trainers also collect the comparator side
(docs/design/algorithms.md#comparators) through one :class:`pbrl.generation.comparators.Comparator`, whatever its
kind. Checkpoint sides are
batched across items and candidates; each row's tokens depend only on its seed
``(seed, round, side, agent, item, candidate)``. Comparator completions are stored in each target agent's
vocabulary (text from another tokenizer, an API or a centralized response is encoded once, here).
With ``collaboration_mode: centralized`` one actor (agent_0) samples joint responses on the joint prompt
(:mod:`pbrl.generation.collaboration`); the oracle splits them into roles.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pbrl.config import JobConfig, actor_job, is_centralized, is_iterative, num_actors
from pbrl.data.items import read_items
from pbrl.data.schema import CANDIDATES, CandidateRow, Item
from pbrl.data.seeds import derive_seed
from pbrl.data.storage import RunPaths, StageManifest
from pbrl.data.tables import write_table
from pbrl.distributed.shards import ShardSet, gather_shards
from pbrl.generation.api_formats import ApiSettings
from pbrl.generation.centralized import load_adapter
from pbrl.generation.collaboration import actor_prompts
from pbrl.generation.comparator_factory import build_comparator, compared_round
from pbrl.generation.comparators import (
    Comparator,
    ComparatorRequest,
    ComparatorSettings,
    Devices,
    SamplingSide,
    target_side,
)
from pbrl.generation.sampling import SamplingSettings, encode_prompt, generate
from pbrl.models.policies import AgentPolicy, load_agent
from pbrl.run.policy_records import policy_checkpoint
from pbrl.run.progress import Progress
from pbrl.run.settings import centralized_adapter, policy_source, sampling_settings
from pbrl.run.stage_record import StageRecord
from pbrl.run.task import resolve_task

NAME = "sample-candidates"
API_STORE = "comparator_api"  # rounds/<r>/comparator_api/: API answers kept as they arrive (resume)


def api_settings(job: JobConfig) -> ApiSettings:
    """The job's ``comparator_api_*`` fields as plain values (the key variable's NAME only)."""
    return ApiSettings(
        api_format=job.comparator_api_format,
        url=str(job.comparator_api_url),
        model=job.comparator_api_model,
        key_env=job.comparator_api_key_env,
        key_header=job.comparator_api_key_header,
        key_prefix=job.comparator_api_key_prefix,
        headers=dict(job.comparator_api_headers or {}),
        extra_body=dict(job.comparator_api_extra_body or {}),
        max_n_per_request=job.comparator_api_max_n_per_request,
        response_field=job.comparator_api_response_field,
        timeout=job.comparator_api_timeout,
        max_concurrency=job.comparator_api_max_concurrency,
    )


def comparator_settings(job: JobConfig, paths: RunPaths | None = None, round_index: int = 0) -> ComparatorSettings:
    """The job's comparator fields as plain values (unset counts and k take their documented defaults)."""
    if job.comparator_agents:
        models = tuple(job.comparator_agents)
    elif job.comparator_model_name:
        models = (job.comparator_model_name,) * num_actors(job)
    else:
        models = ()
    # Centralized collaboration: the one actor's comparator already writes the joint response (split by the oracle).
    centralized = job.comparator_generation_mode == "centralized" and not is_centralized(job)
    history_k = job.comparator_history_k or 1
    compared = compared_round(job.comparator_policy, round_index, history_k) if paths is not None else None
    return ComparatorSettings(
        policy=job.comparator_policy,
        num_candidates=job.comparator_num_candidates or job.preference_num_candidates,
        history_k=history_k,
        agent_devices=job.agent_devices,
        comparator_devices=job.comparator_devices,
        model_sources=models,
        dtype=policy_source(job).dtype,
        api=api_settings(job) if job.comparator_policy == "api" else None,
        centralized_adapter=load_adapter(job.comparator_centralized_adapter) if centralized else None,
        centralized_index=job.comparator_centralized_agent_index,
        store_dir=paths.round_dir(round_index) / API_STORE if paths is not None else None,
        checkpoint=policy_checkpoint(paths, compared) if paths is not None and compared is not None else None,
    )


def comparator(paths: RunPaths, round_index: int, job: JobConfig) -> Comparator | None:
    """The round's comparator (iterative trainers), None for base trainers. Loads nothing yet."""
    if not is_iterative(job.trainer):
        return None
    source = policy_source(job)

    def load_checkpoint(agent: int, checkpoint: Path, devices: Devices):
        policy = load_agent(source, agent, checkpoint, trainable=False, devices=devices)
        return policy.model, policy.tokenizer

    return build_comparator(comparator_settings(job, paths, round_index), load_checkpoint)


def sides(paths: RunPaths, round_index: int, job: JobConfig, comp: Comparator | None) -> list[SamplingSide]:
    """The target side, plus the comparator's checkpoint side when it samples one with the target."""
    out = [target_side(policy_checkpoint(paths, round_index - 1), job.preference_num_candidates, job.agent_devices)]
    if comp is not None and comp.checkpoint_side is not None:
        out.append(comp.checkpoint_side)
    return out


def input_files(paths: RunPaths, round_index: int, job: JobConfig) -> list[Path]:
    """Items and every checkpoint sampled from (their content keys the cache)."""
    comp = comparator(paths, round_index, job)
    checkpoints = {s.checkpoint for s in sides(paths, round_index, job, comp)} | set(comp.inputs if comp else ())
    return [paths.items, *sorted(checkpoints)]


def items_to_shard(paths: RunPaths, round_index: int, job: JobConfig) -> list[Item]:
    """The items this stage splits into shards (runner 'ray'): the train items."""
    return read_items(paths, "train")


@dataclass(frozen=True)
class SamplingPass:
    """What every agent's sampling in one pass shares: the round, the run seed, the items (in order), the sampling
    settings and the progress its rows advance."""

    round_index: int
    seed: int
    items: list[Item]
    settings: SamplingSettings
    progress: Progress


def collect(
    paths: RunPaths, round_index: int, job: JobConfig, items: list[Item]
) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """Every candidate row of ``items`` (all train items, or one shard's), unsorted, and the comparator's counts.

    Each row's tokens depend only on its own seed, so the rows of a subset are the same rows as in a run over
    all items.
    """
    task = resolve_task(job, paths.root)
    # Centralized collaboration: one actor, agent_0, on the joint prompt (pbrl.generation.collaboration).
    job = actor_job(job)
    comp = comparator(paths, round_index, job)
    plan = sides(paths, round_index, job, comp)
    total = job.num_agents * len(items) * sum(s.num_candidates for s in plan)
    progress = Progress(str(paths.root), round_index, NAME, total, "rows")
    sampling = SamplingPass(round_index, job.seed, items, sampling_settings(job), progress)
    groups = _shared_models(plan)
    rows: list[CandidateRow] = []
    prompts, prompt_ids, tokenizers = [], [], []
    for agent, agent_prompts in enumerate(actor_prompts(task, items, centralized_adapter(job))):
        prompts.append(agent_prompts)
        for (checkpoint, _), group in groups.items():
            policy = load_agent(policy_source(job), agent, checkpoint, trainable=False, devices=group[0].devices)
            ids = [encode_prompt(policy.tokenizer, p) for p in agent_prompts]
            if any(s.side == "target" for s in group):  # the target's tokenizer and prompt ids are what is stored
                prompt_ids.append(ids)
                tokenizers.append(policy.tokenizer)
            rows += _sample_group(policy, group, agent, agent_prompts, ids, sampling)
            del policy
    if comp is None:
        return [r.as_dict() for r in rows], {}
    request = ComparatorRequest(
        round_index,
        job.seed,
        items,
        prompts,
        prompt_ids,
        tokenizers,
        sampling.settings,
        shared_rows=[r for r in rows if r.side == "comparator"],
    )
    output = comp.candidates(request)
    rows = [r for r in rows if r.side != "comparator"] + output.rows
    return [r.as_dict() for r in rows], output.counts


def _shared_models(plan: list[SamplingSide]) -> dict[tuple[Path, str], list[SamplingSide]]:
    """The sides grouped by (checkpoint, devices): sides that share both share one loaded model and one batched
    generate."""
    groups: dict[tuple[Path, str], list[SamplingSide]] = defaultdict(list)
    for s in plan:
        groups[(s.checkpoint, repr(s.devices))].append(s)
    return groups


def _sample_group(
    policy: AgentPolicy,
    group: list[SamplingSide],
    agent: int,
    prompts: list[str],
    ids: list[list[int]],
    sampling: SamplingPass,
) -> list[CandidateRow]:
    """The candidate rows of one agent's sides that share ``policy``: every side's candidates of every item, in one
    batched generate, each row from its own seed ``(seed, round, side, agent, item, candidate)``.

    Args:
        prompts: the agent's prompt text of every item; ``ids``: the same prompts in ``policy``'s tokens.
    """
    items = sampling.items
    requests = [(s.side, i, k) for s in group for i in range(len(items)) for k in range(s.num_candidates)]
    seeds = [
        derive_seed(
            sampling.seed,
            round_index=sampling.round_index,
            stage=NAME,
            side=side,
            agent=agent,
            item=items[i]["item_id"],
            index=k,
        )
        for side, i, k in requests
    ]
    names = [f"agent {agent}, item {items[i]['item_id']!r}, {side} candidate {k}" for side, i, k in requests]
    gens = generate(
        policy.model,
        policy.tokenizer,
        [ids[i] for _, i, _ in requests],
        seeds,
        sampling.settings,
        row_names=names,
        on_rows=sampling.progress.advance,
    )
    return [
        CandidateRow(
            items[i]["item_id"],
            side,
            k,
            agent,
            prompts[i],
            ids[i],
            g.text,
            g.completion_ids,
            g.finish_reason,
            g.stop_token_id,
            g.seed,
            "generated",
        )
        for (side, i, k), g in zip(requests, gens, strict=True)
    ]


def run(run_dir: str | Path, round_index: int, job: JobConfig, shards: ShardSet | None = None) -> StageManifest:
    """Sample every train item's candidates, or (``shards``) gather the rows the shards wrote
    (:mod:`pbrl.distributed.shards`); the table written is the same either way."""
    record = StageRecord(NAME, run_dir, round_index, job)
    paths = record.paths
    items = read_items(paths, "train")
    comp = comparator(paths, round_index, job)
    plan = sides(paths, round_index, job, comp)
    if shards is None:
        rows, counts = collect(paths, round_index, job, items)
    else:
        rows, counts = gather_shards(paths, round_index, NAME, shards, CANDIDATES)

    order = {"target": 0, "comparator": 1}
    position = {item["item_id"]: n for n, item in enumerate(items)}
    rows.sort(key=lambda r: (order[r["side"]], position[r["item_id"]], r["candidate_index"], r["agent_index"]))
    write_table(paths.candidates(round_index), rows, CANDIDATES)
    record.counts = {"items": len(items), "rows": len(rows)}
    record.counts["target_candidates"] = len(items) * job.preference_num_candidates
    if comp is not None:
        record.counts["comparator_candidates"] = len(
            {(r["item_id"], r["candidate_index"]) for r in rows if r["side"] == "comparator"}
        )
        record.counts.update(counts)
        record.counts["encoded_from_text"] = sum(r["ids_source"] == "encoded_from_text" for r in rows)
    record.counts["length_finishes"] = sum(r["finish_reason"] == "length" for r in rows)
    sources = {s.side: paths.rel(s.checkpoint) for s in plan}
    if comp is not None and "comparator" not in sources:
        sources["comparator"] = f"{job.comparator_policy} ({job.comparator_generation_mode})"
    record.details = {"sides": sources}
    if counts.get("centralized_parse_failures"):
        record.say(
            f"{counts['centralized_parse_failures']} centralized comparator response(s) could not be parsed "
            "into roles and were dropped"
        )
    return record.finish(input_files(paths, round_index, job), [paths.candidates(round_index)])
