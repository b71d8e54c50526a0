"""The cross-field rules of the run-level options (run name, runner, agents, devices, memory, LoRA, datasets,
task) and of a whole job, where run and trainer options meet."""

from __future__ import annotations

from pbrl.config.rules import (
    AUTO,
    AUTO_FIELDS,
    CENTRALIZED,
    MEMORY_DEVICES,
    MEMORY_SIZE_PATTERN,
    RUN_NAME_PATTERN,
    Rule,
    Values,
    actors,
    device_problems,
    import_path_problems,
    only_with,
    rule,
    same_model_problems,
)
from pbrl.config.trainer_rules import TRAINER_RULES
from pbrl.errors import Problem

# --------------------------------------------------------------------------- run-level fields
RUN_RULES: list[Rule] = []


@rule(RUN_RULES, "run_name")
def _run_name(v: Values) -> list[Problem]:
    name = v["run_name"]
    if name is None or (RUN_NAME_PATTERN.match(name) and set(name) != {"."}):
        return []
    return [Problem("run_name", name, "allowed characters: letters, digits, '-', '_', '.' (and not only dots)")]


@rule(RUN_RULES, "runner", "ray_address")
def _runner_fields(v: Values) -> list[Problem]:
    # Whether the 'ray' extra is installed is checked where a run starts (pbrl.distributed.shards.require_ray_extra),
    # not
    # here: a stored Ray run must stay readable (status, report) on a machine without Ray.
    if v["runner"] == "local" and v["ray_address"] is not None:
        return [only_with("ray_address", v["ray_address"], "runner='ray'")]
    return []


@rule(RUN_RULES, "runner", "agent_devices")
def _ray_devices(v: Values) -> list[Problem]:
    # On Ray a shard task or an agent actor reserves its GPUs from the devices named here (flows/ray_runner.py,
    # pbrl/distributed/ray_agents.py); 'auto' names none, so the work would silently land on a CPU.
    devices = v["agent_devices"]
    named = devices if isinstance(devices, list) else [devices]
    if v["runner"] != "ray" or "auto" not in named:
        return []
    return [
        Problem(
            "agent_devices",
            devices,
            "'auto' cannot be reserved on Ray (runner='ray'); name the devices "
            "('cpu', 'cuda:0' or one per agent) so that each shard and agent actor asks Ray for its GPU",
        )
    ]


@rule(RUN_RULES, "agent_model", "agents")
def _agent_source(v: Values) -> list[Problem]:
    if v["agent_model"] is None and v["agents"] is None:
        return [
            Problem(
                "agent_model", None, "missing; give agent_model (one model for all agents) or agents (one per agent)"
            )
        ]
    return same_model_problems("agents", v["agents"], "agent_model", v["agent_model"])


@rule(RUN_RULES, "formatters")
def _formatter_paths(v: Values) -> list[Problem]:
    return import_path_problems("formatters", v["formatters"])


@rule(RUN_RULES, "agent_devices")
def _agent_devices(v: Values) -> list[Problem]:
    return device_problems("agent_devices", v["agent_devices"], None)


@rule(RUN_RULES, "max_memory")
def _max_memory(v: Values) -> list[Problem]:
    memory = v["max_memory"]
    if memory is None:
        return []
    bad_keys = [k for k in memory if not (isinstance(k, int) and k >= 0) and k not in MEMORY_DEVICES]
    bad_sizes = [
        k
        for k, size in memory.items()
        if (isinstance(size, int) and size <= 0) or (isinstance(size, str) and not MEMORY_SIZE_PATTERN.match(size))
    ]
    problems = []
    if bad_keys:
        problems.append(
            Problem(
                "max_memory",
                memory,
                f"key(s) {', '.join(repr(k) for k in bad_keys)}: keys are a "
                "GPU index (0, 1, ...), 'cpu', 'mps' or 'disk' (accelerate's max_memory)",
            )
        )
    if bad_sizes:
        problems.append(
            Problem(
                "max_memory",
                memory,
                f"size(s) of {', '.join(repr(k) for k in bad_sizes)}: sizes "
                "are bytes > 0 or a number with a unit: GiB, MiB, KiB, GB, MB, KB (e.g. '2GiB')",
            )
        )
    return problems


@rule(RUN_RULES, "lora_r", "lora_target_modules")
def _lora_modules(v: Values) -> list[Problem]:
    if v["lora_r"] is None and v["lora_target_modules"] is not None:
        return [only_with("lora_target_modules", v["lora_target_modules"], "lora_r set (LoRA on)")]
    return []


@rule(RUN_RULES, "train_dataset", "eval_dataset")
def _dataset_suffix(v: Values) -> list[Problem]:
    return [
        Problem(f, v[f], "must be a .jsonl or .parquet file")
        for f in ("train_dataset", "eval_dataset")
        if isinstance(v[f], str) and not v[f].lower().endswith((".jsonl", ".parquet"))
    ]


@rule(RUN_RULES, "task", "task_options")
def _task_options(v: Values) -> list[Problem]:
    if v["task"] is None and v["task_options"]:
        return [Problem("task_options", v["task_options"], "allowed only with task (they go to its factory)")]
    return []


# --------------------------------------------------------------------------- a whole job (run + trainer)
JOB_RULES: list[Rule] = []


@rule(JOB_RULES, "agents", "num_agents", "collaboration_mode")
def _agent_count(v: Values) -> list[Problem]:
    if v["agents"] is None or len(v["agents"]) == actors(v):
        return []
    if v["collaboration_mode"] == CENTRALIZED:
        return [
            Problem(
                "agents",
                v["agents"],
                "must name exactly one model with collaboration_mode='centralized' "
                "(one actor writes every role; num_agents counts the roles); or give agent_model",
            )
        ]
    return [Problem("agents", v["agents"], f"must name one model per agent (num_agents={v['num_agents']})")]


@rule(JOB_RULES, "formatters", "num_agents")
def _formatter_count(v: Values) -> list[Problem]:
    if v["formatters"] is not None and len(v["formatters"]) != v["num_agents"]:
        return [
            Problem("formatters", v["formatters"], f"must give one formatter per agent (num_agents={v['num_agents']})")
        ]
    return []


@rule(JOB_RULES, "agent_devices", "num_agents", "collaboration_mode")
def _agent_device_count(v: Values) -> list[Problem]:
    spec = v["agent_devices"]
    if not isinstance(spec, list) or len(spec) in (1, actors(v)):
        return []
    if v["collaboration_mode"] == CENTRALIZED:
        return [Problem("agent_devices", spec, "must list 1 device with collaboration_mode='centralized' (one actor)")]
    return [Problem("agent_devices", spec, f"must list 1 device or one per agent (num_agents={v['num_agents']})")]


@rule(JOB_RULES, "parallel_training", "agent_devices")
def _parallel_devices(v: Values) -> list[Problem]:
    if v["parallel_training"] == "mp" and v["agent_devices"] is None:
        return [
            Problem(
                "agent_devices",
                None,
                "required with parallel_training='mp' (agent i runs on device i); give one device per agent",
            )
        ]
    return []


@rule(JOB_RULES, "max_memory", "agent_devices")
def _max_memory_needs_auto(v: Values) -> list[Problem]:
    # max_memory only bounds accelerate's device map: without an 'auto' device option it would change nothing.
    if v["max_memory"] is None or any(v.get(f) == AUTO for f in AUTO_FIELDS):
        return []
    return [
        only_with(
            "max_memory",
            v["max_memory"],
            "a device option set to 'auto' (agent_devices, "
            "comparator_devices, reference_devices or reward_model_device)",
        )
    ]


@rule(JOB_RULES, "task", "train_dataset", "formatters", "reward_func", "preference_source")
def _task_source(v: Values) -> list[Problem]:
    if v["task"] is not None:
        return []
    # A task judged by a pairwise judge needs no reward (docs/guides/judges.md#a-task-without-a-reward).
    judged = v["preference_source"] == "judge"
    parts = ("train_dataset", "formatters") if judged else ("train_dataset", "formatters", "reward_func")
    together = " + ".join(parts) + (" (a judge decides; reward_func optional)" if judged else "") + " together"
    missing = [f for f in parts if v[f] is None]
    if len(missing) == len(parts):
        return [Problem("task", None, f"missing; give task (a registered task name), or {together}")]
    return [Problem(f, None, f"required when task is not given ({together})") for f in missing]


def job_rules(trainer: str) -> tuple[Rule, ...]:
    """Every rule of a flat job of ``trainer``: the trainer's, the run's and the ones that join them."""
    return TRAINER_RULES[trainer] + tuple(RUN_RULES) + tuple(JOB_RULES)
