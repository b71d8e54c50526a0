"""The model card (``README.md``) of an exported agent (:func:`pbrl.run.export.export_agents`): YAML metadata, the
run's facts about the agent in one table, how to load it and the run's sampling settings."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pbrl.config import JobConfig, is_centralized
from pbrl.data.storage import RunPaths, read_manifest
from pbrl.models.lora import LoraSettings
from pbrl.models.packaged import MODEL_OBJECT_PREFIX, PACKAGED_MODELS
from pbrl.run.settings import policy_source

TRAINER_CLASSES = {
    "madpo": "MADPOTrainer",
    "madpo_iter": "MADPOIterTrainer",
    "marlhf": "MARLHFTrainer",
    "marlhf_iter": "MARLHFIterTrainer",
}


def hub_id(source: str) -> bool:
    """Whether an agent source is a hub id (neither a packaged alias nor a local folder)."""
    if source in PACKAGED_MODELS or source.startswith(MODEL_OBJECT_PREFIX):
        return False
    return not Path(source).expanduser().is_dir()


def card_header(trainer: str, base: str, *, adapter: bool) -> list[str]:
    """The card's YAML metadata lines: the library (peft for an adapter), the base model when it is a hub id, tags."""
    meta = ["---", f"library_name: {'peft' if adapter else 'transformers'}"]
    if hub_id(base):
        meta.append(f"base_model: {base}")
    return [*meta, "tags:", "- pbrl", f"- {trainer}", "- multi-agent", "- preference-based-rl", "---", ""]


def eval_reward(paths: RunPaths, round_index: int) -> str:
    """The eval reward after round ``round_index`` with its 95 % interval and draws, as the evaluate manifest
    records it; "not evaluated" without one."""
    evaluation = read_manifest(paths, round_index, "evaluate")
    m = evaluation.metrics if evaluation is not None else {}
    if "eval/reward_mean" not in m:
        return f"not evaluated after round {round_index}"
    reward = f"{m['eval/reward_mean']:.4g} [{m['eval/reward_ci_low']:.4g}, {m['eval/reward_ci_high']:.4g}]"
    return reward + f" (95 % interval; {evaluation.counts.get('samples', '?')} draws of round {round_index})"


def weights_text(lora: LoraSettings | None, *, merge_lora: bool) -> str:
    """What the folder's weights are: full weights, the LoRA adapter (merged or not) with its settings."""
    if lora is None:
        return "full weights"
    weights = "LoRA adapter merged into the base weights" if merge_lora else "LoRA adapter (peft)"
    return (
        weights + f"; r={lora.r}, alpha={lora.alpha}, dropout={lora.dropout}, targets {', '.join(lora.target_modules)}"
    )


def use_lines(*, adapter: bool) -> list[str]:
    """The card's "Use" section: loading the folder with peft (an adapter) or transformers."""
    loader = "peft import AutoPeftModelForCausalLM" if adapter else "transformers import AutoModelForCausalLM"
    cls = "AutoPeftModelForCausalLM" if adapter else "AutoModelForCausalLM"
    return [
        "## Use",
        "",
        "```python",
        f"from {loader}, AutoTokenizer",
        "",
        f'model = {cls}.from_pretrained("<this folder>")',
        'tokenizer = AutoTokenizer.from_pretrained("<this folder>")',
        "```",
        "",
    ]


def sampling_note(job: JobConfig, *, merged_lora: bool) -> str:
    """How the run sampled, and how its tokens are reproduced from the export (``merged_lora``: a LoRA adapter
    exported merged into the base weights)."""
    top_k = "none" if job.top_k is None else job.top_k
    return (
        f"The run sampled with temperature {job.temperature}, top_p {job.top_p}, top_k {top_k}, at most "
        f"{job.max_new_tokens} new tokens, the prompt in the tokenizer's chat template, frozen weights in "
        f"{job.torch_dtype}. `pbrl.generation.sampling.generate` with a row's seed (`pbrl.data.seeds.derive_seed`) "
        + (
            "reproduces its tokens from the run's adapter export (merged weights are float32, the sum that "
            "the run computed in two precisions rounded into one)."
            if merged_lora and job.torch_dtype != "float32"
            else f"reproduces its tokens, the model loaded with `dtype={job.torch_dtype!r}`."
        )
    )


def model_card(
    job: JobConfig,
    run: dict[str, Any],
    paths: RunPaths,
    round_index: int,
    checkpoint: Path,
    agent: int,
    *,
    merge_lora: bool,
) -> str:
    """The ``README.md`` of an exported agent: YAML metadata (library, base model when it is a hub id, tags), then
    the run, round, trainer, agent, eval reward after that round (with its 95 % interval, when evaluated), the base
    model and LoRA settings, how to load it and the sampling settings of the run."""
    source = policy_source(job)
    lora = source.lora
    adapter = lora is not None and not merge_lora
    base = source.models[agent]
    role = "the centralized actor (writes every role)" if is_centralized(job) else f"agent {agent} of {job.num_agents}"
    rows = [
        ("run", f"{paths.root.resolve().name} (run id {run.get('run_id', '?')})"),
        ("round", f"{round_index}: the policy after round {round_index} ({paths.rel(checkpoint)})"),
        ("trainer", f"{job.trainer} ({TRAINER_CLASSES.get(job.trainer, '?')})"),
        ("agent", role),
        ("eval reward", eval_reward(paths, round_index)),
        ("base model", base),
        ("weights", weights_text(lora, merge_lora=merge_lora)),
        ("seed", str(job.seed)),
    ]
    intro = "Trained with [pbrl](https://pypi.org/project/pbrl/): cooperating LLM agents trained from preferences "
    intro += "between their joint responses."
    return "\n".join(
        [
            *card_header(job.trainer, base, adapter=adapter),
            f"# {paths.root.resolve().name}: {role}, round {round_index}",
            "",
            intro,
            "",
            "| | |",
            "|---|---|",
            *(f"| {k} | {v} |" for k, v in rows),
            "",
            *use_lines(adapter=adapter),
            sampling_note(job, merged_lora=lora is not None and merge_lora),
            "",
        ]
    )
