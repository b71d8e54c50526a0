"""Stage 1, sample-candidates: every agent samples its candidates for every train item (SPEC §4.1).

Round r samples from the policy after round r-1. Iterative trainers also sample the comparator side
(SPEC §5.3) on its own seed stream. Rows are batched across items and candidates; each row's tokens
depend only on its seed ``(seed, round, side, agent, item, candidate)``.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from pbrl.comparators import SamplingSide, comparator_side, target_side
from pbrl.config import JobConfig, is_iterative
from pbrl.policies import load_agent
from pbrl.run import format_prompts, read_items, resolve_task
from pbrl.sampling import encode_prompt, generate
from pbrl.schema import CANDIDATES, write_table
from pbrl.seeds import derive_seed
from pbrl.stagekit import StageRecord
from pbrl.storage import RunPaths, StageManifest

NAME = "sample-candidates"


def sides(paths: RunPaths, round_index: int, job: JobConfig) -> list[SamplingSide]:
    """The target side, plus the comparator side for iterative trainers."""
    out = [target_side(paths, round_index, job)]
    if is_iterative(job.trainer):
        out.append(comparator_side(paths, round_index, job))
    return out


def input_files(paths: RunPaths, round_index: int, job: JobConfig) -> list[Path]:
    """Items and every checkpoint sampled from (their content keys the cache)."""
    return [paths.items, *sorted({s.checkpoint for s in sides(paths, round_index, job)})]


def run(run_dir: str | Path, round_index: int, job: JobConfig) -> StageManifest:
    record = StageRecord(NAME, run_dir, round_index, job)
    paths = record.paths
    task = resolve_task(job, paths.root)
    items = read_items(paths, "train")
    plan = sides(paths, round_index, job)
    # Sides that share a checkpoint and devices share one loaded model and one batched generate.
    groups: dict[tuple[Path, str], list[SamplingSide]] = defaultdict(list)
    for s in plan:
        groups[(s.checkpoint, repr(s.devices))].append(s)

    rows = []
    for agent in range(job.num_agents):
        prompts = format_prompts(task.formatters[agent], items, agent)
        for (checkpoint, _), group in groups.items():
            policy = load_agent(job, paths, agent, checkpoint, trainable=False, devices=group[0].devices)
            prompt_ids = [encode_prompt(policy.tokenizer, p) for p in prompts]
            requests = [(s.side, i, k) for s in group for i in range(len(items)) for k in range(s.num_candidates)]
            seeds = [
                derive_seed(job.seed, round_index=round_index, stage=NAME, side=side, agent=agent,
                            item=items[i]["item_id"], index=k)
                for side, i, k in requests
            ]
            gens = generate(
                policy.model, policy.tokenizer, [prompt_ids[i] for _, i, _ in requests], seeds,
                max_new_tokens=job.max_new_tokens, temperature=job.temperature, top_p=job.top_p,
                top_k=job.top_k, batch_size=job.generation_batch_size,
            )
            for (side, i, k), g in zip(requests, gens, strict=True):
                rows.append({
                    "item_id": items[i]["item_id"], "side": side, "candidate_index": k, "agent_index": agent,
                    "prompt": prompts[i], "prompt_ids": prompt_ids[i], "completion": g.text,
                    "completion_ids": g.completion_ids, "finish_reason": g.finish_reason, "seed": g.seed,
                })
            del policy

    order = {s.side: n for n, s in enumerate(plan)}
    position = {item["item_id"]: n for n, item in enumerate(items)}
    rows.sort(key=lambda r: (order[r["side"]], position[r["item_id"]], r["candidate_index"], r["agent_index"]))
    write_table(paths.candidates(round_index), rows, CANDIDATES)
    record.counts = {"items": len(items), "rows": len(rows)}
    for s in plan:
        record.counts[f"{s.side}_candidates"] = len(items) * s.num_candidates
    record.counts["length_finishes"] = sum(r["finish_reason"] == "length" for r in rows)
    record.details = {"sides": {s.side: paths.rel(s.checkpoint) for s in plan}}
    return record.finish(input_files(paths, round_index, job), [paths.candidates(round_index)])
