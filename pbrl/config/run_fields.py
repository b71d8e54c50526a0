"""The run-level fields of the pbrl configuration (docs/reference/options.md#options-reference): the trainer, seed
and run folder, the runner, the task and its items, the agents' models, LoRA, devices, precision, memory and
trackers. Types, defaults, single-field ranges and descriptions; nothing here has behaviour.

Option names and defaults are the reference library's (CoMLRL ``comlrl.trainers.preference``) except the ★
changes of docs/reference/options.md#options-reference. The job models of :mod:`pbrl.config.models` combine
these with one trainer's fields (:mod:`pbrl.config.fields`); cross-field rules are in :mod:`pbrl.config.run_rules`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BeforeValidator, Field

from pbrl.config.dataset_spec import DatasetSpec
from pbrl.config.field_types import (
    MAX_TIMEOUT_S,
    DeviceSpec,
    NameList,
    NonEmptyStr,
    StrictBool,
    StrictFloat,
    StrictInt,
    _Fields,
)

# The experiment trackers of ``report_to`` (pbrl.reporting.tracker_tools): one name or a list of them.
TrackerName = Literal["tensorboard", "mlflow", "wandb", "trackio"]


def _hugging_face_spellings(value: Any) -> Any:
    # transformers' report_to spells "no tracker" 'none' (also as ['none']): the same as None here. Its 'all' (every
    # installed tool) is kept as written and expanded where the trackers start (pbrl.reporting.tracker_tools).
    return None if value == "none" or value == ["none"] else value


def _gpu_index(key: int | str) -> int | str:
    # A run's stored config is JSON, whose keys are strings: "0" is GPU 0 again (accelerate reads an int).
    return int(key) if isinstance(key, str) and key.isdigit() else key


MemoryKey = Annotated[StrictInt | NonEmptyStr, AfterValidator(_gpu_index)]


class _RunFields(_Fields):
    trainer: Literal["madpo", "marlhf", "madpo_iter", "marlhf_iter"] = Field(
        description="Trainer: 'madpo', 'marlhf' (one collection) or 'madpo_iter', 'marlhf_iter' (rounds)."
    )
    seed: StrictInt = Field(0, ge=0, description="Run seed; every random stream derives from it.")
    run_name: NonEmptyStr | None = Field(
        None,
        description="Run folder name (letters, digits, '-', '_', '.'). None = generated: `pbrl train` uses "
        "the config file's name; the Python trainers and runs started from the Prefect UI or a deployment use "
        "'<trainer>-<UTC time YYYYmmdd-HHMMSS>' (e.g. 'madpo_iter-20250102-030405').",
    )
    output_dir: NonEmptyStr = Field("storage/runs", description="Folder that holds run folders.")
    runner: Literal["local", "ray"] = Field(
        "local",
        description="Where the item-parallel stages run: 'local' (in the flow's process) or 'ray' "
        "(sample-candidates, score-with-oracle and evaluate split into shards of shard_size items, each a Prefect "
        "task on prefect-ray's RayTaskRunner; needs the 'ray' extra). The artifacts are the same either way.",
    )
    ray_address: NonEmptyStr | None = Field(
        None,
        description="With runner 'ray': the Ray cluster to use, 'auto' (the cluster this machine belongs to) or "
        "an address such as 'ray://head:10001'; None = a local Ray started by the run (or the one already "
        "initialised in this process).",
    )
    shard_size: StrictInt = Field(
        16, ge=1, description="With runner 'ray': items per shard of a sharded stage (the last shard takes the rest)."
    )
    task: NonEmptyStr | None = Field(
        None,
        description="Registered task name (e.g. 'humaneval_coop'); or give train_dataset + formatters + reward_func.",
    )
    task_options: dict[str, Any] = Field(default_factory=dict, description="Keyword options for the task factory.")
    train_dataset: NonEmptyStr | DatasetSpec | None = Field(
        None,
        description="Training items: a .jsonl or .parquet file, or a dataset spec loaded offline with Hugging "
        "Face datasets (a mapping: path = a save_to_disk folder, data file(s) or a hub id already in the local "
        "cache; optional name, split, data_files, columns (rename source -> field), id_column); None = the task's "
        "items.",
    )
    eval_dataset: NonEmptyStr | DatasetSpec | None = Field(
        None,
        description="Evaluation items, in the same forms as train_dataset; None = the task's, else the train items.",
    )
    formatters: NameList | None = Field(
        None, description="One prompt formatter import path 'pkg.module:function' per agent; None = the task's."
    )
    max_train_items: StrictInt | None = Field(
        None, ge=1, description="Use at most this many training items; None = all."
    )
    agent_model: NonEmptyStr | None = Field(
        None,
        description="One model for all agents: a local folder, a hub id "
        "already on disk, or a packaged alias like 'smollm2-135m-instruct'.",
    )
    agents: NameList | None = Field(
        None, description="One model per agent (same forms as agent_model). Give this or agent_model."
    )
    lora_r: StrictInt | None = Field(None, ge=1, description="LoRA rank; None = full fine-tuning (LoRA off).")
    lora_alpha: StrictInt = Field(16, ge=1, description="LoRA scaling alpha.")
    lora_dropout: StrictFloat = Field(0.0, ge=0, lt=1, description="LoRA dropout probability.")
    lora_target_modules: NameList | None = Field(
        None, description="Modules that get LoRA adapters; None = q_proj, k_proj, v_proj, o_proj."
    )
    agent_devices: DeviceSpec = Field(
        None,
        description="Agent device(s): one device for all, or a list of 1 or "
        "num_agents; 'auto' = each model placed by accelerate's device map within "
        "max_memory; None = the first GPU, else CPU.",
    )
    tie_tolerance: StrictFloat = Field(
        1e-9, ge=0, description="Scores within this absolute distance are a tie (no pair)."
    )
    oracle_max_failure_share: StrictFloat = Field(
        0.5,
        ge=0,
        le=1,
        description="Share of joint responses whose reward may fail (dropped and counted) before the round stops; "
        "the same share of evaluation draws, and an evaluation whose every draw failed stops it too.",
    )
    reward_timeout: StrictFloat = Field(
        600.0,
        gt=0,
        le=MAX_TIMEOUT_S,
        description="Seconds one reward_func call (reward_processor included) may take. The reward runs in a worker "
        "process; past the limit the process is killed, and the call's joint responses are scored again one at a "
        "time, each within the limit: only those that time out alone are dropped and counted like any reward "
        "failure (after 2 timeouts of one item its other responses of that call are given up).",
    )
    max_joint_responses_per_item: StrictInt = Field(
        256,
        ge=2,
        description="The oracle's guard with joint_mode='cross' (an item has K^n combinations): at most this many "
        "combinations per item are scored; when an item has more, this many are drawn without replacement with a "
        "generator seeded from the run seed, round and item. Aligned joint responses are never capped.",
    )
    generation_batch_size: StrictInt = Field(64, ge=1, description="Rows (prompt x candidate) per generate call.")
    eval_samples_per_item: StrictInt = Field(
        1,
        ge=1,
        description="Sampled joint responses per evaluation item "
        "(eval_num_samples items x this many draws, each with its own seed, "
        "the same seeds every round so rounds are compared on the same draws).",
    )
    torch_dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="Dtype of frozen model weights (reference, comparator copies, a LoRA base, sampling "
        "copies); trainable parameters are always float32 master weights (see mixed_precision). 'auto' (★) is "
        "bfloat16 where the agents' device computes it natively (a CUDA GPU with bfloat16, a CPU with avx512_bf16 "
        "or amx_bf16; the environment variable PBRL_CPU_BF16=0 or 1 overrides a CPU's flags), else float32; a run "
        "records what auto resolved to and keeps it on resume.",
    )
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = Field(
        "auto",
        description="accelerate's mixed precision of training: 'no' (float32), 'bf16' or 'fp16' autocast of "
        "training forwards over float32 master weights; 'fp16' also scales the loss (dynamic grad scaler, saved "
        "with the optimizer state). 'auto' (★) is bf16 on a CUDA GPU with bfloat16 and no elsewhere (CPU autocast "
        "casts every weight on every forward); a run records what auto resolved to and keeps it on resume.",
    )
    num_threads: StrictInt | None = Field(
        None,
        ge=1,
        description="torch's intra-op threads (and OpenMP's) in the process that runs the stages, fixed; None = "
        "the CPUs this process may use (its affinity mask, capped by a cgroup CPU quota), fewer while other "
        "processes keep some of them busy (measured about once a second; one thread per free CPU, at least 1, so "
        "that waiting threads do not spin against another job's; only where the job computes in float32 and "
        "oneMKL's strict reproducibility mode, which importing pbrl sets, keeps results independent of the count: "
        "bfloat16 and float16 CPU products go through oneDNN, which it does not govern). Ray shards and actors use "
        "the CPUs Ray reserved for them. The stage manifests record the mean and the fewest threads a stage ran with. "
        "More than this machine's CPUs is refused.",
    )
    gradient_checkpointing: StrictBool = Field(
        False,
        description="transformers' activation checkpointing of the trained policies: layer activations are "
        "recomputed in the backward pass instead of stored, trading about one more forward pass for memory. It "
        "turns the KV cache off in training forwards, so update-policies then scores each (prompt + completion) "
        "row in full instead of running each shared prompt once.",
    )
    gradient_accumulation_steps: StrictInt = Field(
        1,
        ge=1,
        description="Micro-batches per policy update step: each step's train_batch_size pairs are scored "
        "and differentiated in this many micro-batches (ceil(train_batch_size / steps) pairs each) whose gradients "
        "are summed into one optimizer step, so peak training memory follows the micro-batch. Unlike transformers' "
        "Trainer, the pairs per step stay train_batch_size (it does not multiply the effective batch).",
    )
    max_memory: dict[MemoryKey, StrictInt | NonEmptyStr] | None = Field(
        None,
        description="accelerate's per-device memory limits for devices set to 'auto', e.g. {cpu: 2GiB} or "
        "{0: 10GiB, cpu: 30GiB}: keys a GPU index, 'cpu', 'mps' or 'disk'; values bytes or a size like '2GiB', "
        "'500MB'. What does not fit is split over the next devices, then offloaded (frozen weights only). None = "
        "all free memory.",
    )
    report_to: Annotated[
        TrackerName | Literal["all"] | Annotated[list[TrackerName], Field(min_length=1)] | None,
        BeforeValidator(_hugging_face_spellings),
    ] = Field(
        None,
        description="Experiment trackers that follow the run (one name or a list): 'tensorboard' (event files in "
        "<run>/tensorboard), 'mlflow' (MLFLOW_TRACKING_URI, else a local store in <run>/mlruns), 'wandb' (online when "
        "logged in; WANDB_MODE=offline writes <run>/wandb without a network) and 'trackio' (local, in TRACKIO_DIR). "
        "Each gets the config as hyper-parameters, the logged training steps, every round's row of the round table "
        "and report.png; a resumed run continues the same tracked run (its id is kept in <run>/tracking.json). "
        "Projects and credentials come from the tools' environment variables only (WANDB_PROJECT, WANDB_API_KEY, "
        "MLFLOW_EXPERIMENT_NAME, ...). Each tool is an optional extra: pip install 'pbrl[tracking]'. None (or 'none', "
        "as in transformers) = no tracker; 'all' = every tool whose package is installed. Keys no stage cache: a "
        "resume may add or change it.",
    )
