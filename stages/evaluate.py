"""Stage 8, evaluate: the current policies on the first ``eval_num_samples`` evaluation items (SPEC §4.8).

One sampled completion per agent per item (its own seed stream), scored with the task reward
(``reward_func`` + ``reward_processor``), never with a learned reward model. Round 0 is the baseline of
the initial policies; round r evaluates the policy after round r's update.
"""

from __future__ import annotations

from pathlib import Path

from pbrl.config import JobConfig
from pbrl.oracle import score_batch
from pbrl.policies import load_agent, policy_checkpoint
from pbrl.run import format_prompts, read_items, resolve_task
from pbrl.sampling import encode_prompt, generate
from pbrl.schema import EVAL, write_table
from pbrl.seeds import derive_seed
from pbrl.stagekit import StageRecord
from pbrl.storage import RunPaths, StageManifest

NAME = "evaluate"


def input_files(paths: RunPaths, round_index: int, job: JobConfig) -> list[Path]:
    return [paths.items, policy_checkpoint(paths, round_index)]


def run(run_dir: str | Path, round_index: int, job: JobConfig) -> StageManifest:
    record = StageRecord(NAME, run_dir, round_index, job)
    paths = record.paths
    task = resolve_task(job, paths.root)
    items = read_items(paths, "eval")[: job.eval_num_samples]
    checkpoint = policy_checkpoint(paths, round_index)
    prompts, completions = [], []
    for agent in range(job.num_agents):
        agent_prompts = format_prompts(task.formatters[agent], items, agent)
        policy = load_agent(job, paths, agent, checkpoint, trainable=False)
        seeds = [derive_seed(job.seed, round_index=round_index, stage=NAME, side="eval", agent=agent,
                             item=item["item_id"]) for item in items]
        gens = generate(
            policy.model, policy.tokenizer, [encode_prompt(policy.tokenizer, p) for p in agent_prompts], seeds,
            max_new_tokens=job.max_new_tokens, temperature=job.temperature, top_p=job.top_p, top_k=job.top_k,
            batch_size=job.generation_batch_size,
        )
        prompts.append(agent_prompts)
        completions.append(gens)
        del policy
    scores = score_batch(
        task.reward_func, task.reward_processor, [[g.text for g in gens] for gens in completions],
        prompts=[[prompts[a][j] for a in range(job.num_agents)] for j in range(len(items))],
        batch_items=items,
    ) if items else []
    rows = [
        {"item_id": item["item_id"], "prompts": [prompts[a][j] for a in range(job.num_agents)],
         "completions": [completions[a][j].text for a in range(job.num_agents)],
         "completion_ids": [completions[a][j].completion_ids for a in range(job.num_agents)],
         "finish_reasons": [completions[a][j].finish_reason for a in range(job.num_agents)],
         "raw_reward": s.raw, "reward": s.reward, "failure": s.failure}
        for j, (item, s) in enumerate(zip(items, scores, strict=True))
    ]
    write_table(paths.eval(round_index), rows, EVAL)
    rewards = [s.reward for s in scores if s.ok]
    record.counts = {"items": len(items), "failed": len(items) - len(rewards)}
    if rewards:
        mean = sum(rewards) / len(rewards)
        # Single turn: the expected return equals the mean reward (the reference logs both).
        record.metrics = {"eval/turn_1/reward_mean": mean, "eval/turn_1/expected_return": mean}
    record.details = {"checkpoint": paths.rel(checkpoint)}
    return record.finish(input_files(paths, round_index, job), [paths.eval(round_index)])
