"""The fields of the pbrl configuration (docs/reference/options.md#options-reference): types, defaults, single-field
ranges and descriptions.

Fields are grouped in field-only mixins (``_CommonFields``, ``_IterativeFields`` ...) that the trainer,
run and job models of :mod:`pbrl.config` combine; nothing here has behaviour. Option names and defaults are
the reference library's (CoMLRL ``comlrl.trainers.preference``) except the ★ changes of
docs/reference/options.md#options-reference.

Scalars are strict: ``true`` is not the number 1 and ``2024`` is not the string ``'2024'`` (a YAML user
who writes ``num_iterations: true`` or ``run_name: 2024`` gets an error, not a silent conversion). The one
conversion kept is int -> float (``dpo_beta: 1`` is 1.0), which loses nothing. Cross-field rules are in
:mod:`pbrl.config.rules`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, Strict

from pbrl.config.dataset_spec import DatasetSpec

# Strict scalars (pydantic's StrictInt ... spelled out so the JSON schema and error types stay the plain ones).
StrictInt = Annotated[int, Strict()]
StrictFloat = Annotated[float, Strict()]  # strict float still takes an int (1 -> 1.0), never a bool or a string
StrictBool = Annotated[bool, Strict()]
StrictStr = Annotated[str, Strict()]
NonEmptyStr = Annotated[str, Strict(), Field(min_length=1)]
DeviceSpec = NonEmptyStr | Annotated[list[NonEmptyStr], Field(min_length=1)] | None
NameList = Annotated[list[NonEmptyStr], Field(min_length=1)]
# The experiment trackers of ``report_to`` (pbrl.reporting.trackers): one name or a list of them.
TrackerName = Literal["tensorboard", "mlflow", "wandb", "trackio"]


def _gpu_index(key: int | str) -> int | str:
    # A run's stored config is JSON, whose keys are strings: "0" is GPU 0 again (accelerate reads an int).
    return int(key) if isinstance(key, str) and key.isdigit() else key


MemoryKey = Annotated[StrictInt | NonEmptyStr, AfterValidator(_gpu_index)]

# Generation divides the float32 logits by the temperature. The reference has no greedy mode (it forces
# do_sample=True), so 0 is no setting there; 0 or a value near it (1e-40) gives inf logits and a NaN softmax.
# 1e-4 already samples the most likely token almost always, and above 100 sampling is nearly uniform.
TEMPERATURE_RANGE = (1e-4, 100)


class _Fields(BaseModel):
    # hide_input_in_errors: a raw pydantic error must never print a value that may be a secret.
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False, hide_input_in_errors=True)


class _CommonFields(_Fields):
    num_agents: StrictInt = Field(
        2,
        ge=1,
        description="Number of cooperating agents (policies). Must equal the number "
        "of formatters and of `agents` when those are given.",
    )
    num_turns: StrictInt = Field(
        1, description="Turns per episode. Must be 1: pbrl trains single-turn joint responses."
    )
    joint_mode: Literal["aligned", "cross"] = Field(
        "aligned",
        description="How candidates form joint responses: 'aligned' joins the agents' candidates with the same "
        "index (as the reference); 'cross' scores combinations of the agents' candidates (K^n per item, at most "
        "max_joint_responses_per_item) and pairs them, counterfactual pairs (one agent's candidate differs) "
        "included; iterative trainers pair a target combination with the same one after some agents' candidates "
        "were replaced by comparator candidates. Needs collaboration_mode='decentralized'.",
    )
    dpo_beta: StrictFloat = Field(
        0.1,
        gt=0,
        description="MADPO inverse temperature η in the loss -log σ(η Δ) on the "
        "joint log-prob margin Δ. Accepted but unused by MARLHF, as in the reference.",
    )
    agent_learning_rate: StrictFloat = Field(5e-6, gt=0, description="AdamW learning rate of every agent's policy.")
    rollout_buffer_size: StrictInt = Field(
        2,
        ge=1,
        description="As in the reference, only the default of "
        "train_batch_size (pairs per update step when that is None).",
    )
    train_batch_size: StrictInt | None = Field(
        None, ge=1, description="Preference pairs per policy update step; None = rollout_buffer_size (2 by default)."
    )
    max_new_tokens: StrictInt = Field(256, gt=0, description="Most tokens generated per completion.")
    temperature: StrictFloat = Field(
        0.6,
        ge=TEMPERATURE_RANGE[0],
        le=TEMPERATURE_RANGE[1],
        description="Sampling temperature, in [1e-4, 100]. "
        "Generation always samples, as in the reference, so 0 is not 'greedy': the float32 logits are divided by "
        "the temperature, and 0 (or a value near it) makes them inf and the softmax NaN. 1e-4 already picks the most "
        "likely token almost always; above 100 sampling is close to uniform over the vocabulary.",
    )
    top_p: StrictFloat = Field(
        0.6, gt=0, le=1, description="Nucleus sampling: keep the smallest token set whose probability reaches top_p."
    )
    top_k: StrictInt | None = Field(50, ge=1, description="Sample among the k most likely tokens; None = no top-k cut.")
    eval_interval: StrictInt = Field(
        1,
        ge=0,
        description="Evaluate every eval_interval ROUNDS and once before the "
        "first update (round 0 baseline); 0 disables evaluation. (The reference counts "
        "update steps, default 16; pbrl evaluates between rounds, where the policy is "
        "checkpointed.)",
    )
    eval_num_samples: StrictInt = Field(
        4,
        ge=0,
        description="Evaluation items per evaluation (one sampled completion "
        "per agent each), scored with the task reward.",
    )
    eval_batch_size: StrictInt = Field(
        1,
        ge=1,
        description="Evaluation items per generate call (the reference's eval "
        "dataloader batch); the sampled tokens do not depend on it.",
    )
    logging_steps: StrictInt = Field(
        50,
        ge=1,
        description="Train metrics are logged at an update step only when the "
        "env-step axis advanced by at least logging_steps since the last logged step.",
    )
    use_environment_step: StrictBool = Field(
        True,
        description="Advance the env-step axis of the metrics by "
        "environment_steps_per_pair x pairs at every update step.",
    )
    environment_steps_per_pair: StrictInt = Field(
        2,
        ge=1,
        description="Env steps one pair counts for on the metrics' "
        "env-step axis (the reference's unit: a pair = two joint samples).",
    )
    collaboration_mode: Literal["decentralized", "centralized"] = Field(
        "decentralized",
        description="'decentralized': one policy per agent, each answering its own prompt; "
        "'centralized': one actor (one policy, agent_0) writes every role in one joint response from the "
        "centralized prompt of comparator_centralized_adapter, which also splits it into roles for the reward "
        "(num_agents is then the number of roles; an unparsable response is dropped and counted). MADPO learns "
        "from the joint completion as one sequence; iterative trainers' comparator generation is centralized too. "
        "Not available with the MARLHF trainers.",
    )
    comparator_centralized_adapter: NonEmptyStr | None = Field(
        None,
        description="With comparator_generation_mode or collaboration_mode 'centralized': import path "
        "'pkg.module:Name' of the adapter that builds the centralized prompt and splits the joint response into "
        "roles; None = <agent_1>…</agent_1> sections.",
    )
    parallel_training: Literal["none", "mp"] = Field(
        "none",
        description="'none': every agent on the first device of agent_devices; 'mp': agent i on device i "
        "of agent_devices (required).",
    )
    discount: StrictFloat = Field(
        1.0,
        description="Multi-turn return discount of the reference's RL backends; no "
        "effect (pbrl trains single-turn joint responses).",
    )
    early_termination_threshold: StrictFloat | None = Field(
        None, description="Multi-turn early stop of the reference's RL backends; no effect (single-turn)."
    )
    external_prompt_passthrough: StrictBool = Field(
        False, description="Multi-turn external prompts of the reference's RL backends; no effect (single-turn)."
    )
    advantage_normalization: StrictBool = Field(
        True,
        description="MARLHF RL: divide each group's advantages by "
        "their standard deviation (clamped at 1e-6); no effect on MADPO.",
    )
    advantage_mode: Literal["mean", "raw", "max", "rloo"] = Field(
        "mean",
        description="MARLHF RL baseline; set from rl_algorithm for magrpo (mean), mareinforce (raw), maremax "
        "(max) and marloo (rloo), as in the reference; no effect on MADPO.",
    )
    max_grad_norm: StrictFloat | None = Field(
        1.0,
        gt=0,
        description="Clip each agent's gradient norm to this value "
        "before a step; None = no clipping (the reference has none).",
    )
    reward_func: NonEmptyStr | None = Field(
        None,
        description="Oracle reward as an import path "
        "'pkg.module:function'; None = the task's reward. The Python API "
        "passes callables separately.",
    )
    reward_processor: NonEmptyStr | None = Field(
        None,
        description="Import path 'pkg.module:function' of a float "
        "-> float map applied to every raw reward; None = the task's "
        "(identity if it has none).",
    )
    reference_kl_enabled: StrictBool = Field(
        False,
        description="Subtract reference_kl_coef times a sampled KL to a "
        "frozen copy of the initial policy from the reward (MARLHF policy "
        "learning only; MADPO accepts it, ignores it and warns).",
    )
    reference_kl_coef: StrictFloat = Field(0.1, ge=0, description="Weight of the reference KL penalty.")
    reference_devices: DeviceSpec = Field(
        None,
        description="Device(s) of the reference models: one device, or a "
        "list of 1 or num_agents; 'auto' = accelerate's device map within "
        "max_memory; None = the agents' devices. Checked only with "
        "reference_kl_enabled=True.",
    )


class _SingleRoundFields(_Fields):
    preference_num_candidates: StrictInt = Field(
        80,
        ge=2,
        description="Candidates sampled per agent per item; pairs are formed among the joint candidates of each item.",
    )
    pair_selection: Literal["reward_gap", "all", "random", "counterfactual"] = Field(
        "reward_gap",
        description="Which pairs of an item to keep: 'reward_gap' (largest score gap first), 'all', "
        "'random' (seeded shuffle) or 'counterfactual' (joint_mode='cross' only: pairs that differ in one agent's "
        "candidate first, the agents in turn, each by largest gap; then the others).",
    )
    preference_pairs_per_sample: StrictInt | None = Field(
        16, ge=1, description="Pairs kept per item after ordering; must be None with pair_selection='all'."
    )


class _IterativeFields(_Fields):
    num_iterations: StrictInt = Field(6, ge=1, description="Rounds of collect -> store -> replay -> learn.")
    preference_num_candidates: StrictInt = Field(
        20,
        ge=1,
        description="Target candidates sampled per agent per item "
        "in each round; 1 is enough, since pairs are target j vs comparator "
        "j (the reference asks for >= 2).",
    )
    pair_selection: Literal["comparator_reward", "reward_gap", "all", "random", "counterfactual"] = Field(
        "comparator_reward",
        description="Order of an item's target/comparator pairs: "
        "'comparator_reward' (comparator score, then gap, largest first), 'reward_gap', 'all', 'random' or "
        "'counterfactual' (joint_mode='cross' only: pairs that differ in one agent's candidate first, the agents "
        "in turn, each by largest gap; then the others).",
    )
    preference_pairs_per_sample: StrictInt | None = Field(
        4, ge=1, description="Pairs kept per item after ordering; must be None with pair_selection='all'."
    )
    comparator_policy: Literal["current", "current_copy", "model", "history", "api"] = Field(
        "current",
        description="Source of the comparator side: 'current' (live weights, own seed stream), "
        "'current_copy' (frozen copy on comparator_devices), 'model' (explicit models), 'history' (an older "
        "checkpoint of this run) or 'api' (a remote model).",
    )
    comparator_history_k: StrictInt | None = Field(
        None,
        ge=1,
        description="With 'history': compare against the policy "
        "k updates older (None = 1). Only with comparator_policy='history'.",
    )
    comparator_model_name: NonEmptyStr | None = Field(
        None,
        description="With 'model': one comparator model for all agents (folder, hub id on disk or packaged alias).",
    )
    comparator_agents: NameList | None = Field(
        None,
        description="With 'model': one comparator model per agent "
        "(length num_agents). Give this or comparator_model_name.",
    )
    comparator_devices: DeviceSpec = Field(
        None,
        description="Device(s) of comparator models: one device, or a "
        "list of 1 or num_agents; 'auto' = accelerate's device map within "
        "max_memory; None = the agents' devices.",
    )
    comparator_num_candidates: StrictInt | None = Field(
        None,
        ge=1,
        description="Comparator candidates per item; "
        "None = preference_num_candidates. Only matching indices are "
        "paired.",
    )
    comparator_generation_mode: Literal["decentralized", "centralized"] = Field(
        "decentralized",
        description="'decentralized': each agent's comparator answers its own prompt; "
        "'centralized': one comparator writes every role in one response, parsed into roles.",
    )
    comparator_centralized_agent_index: StrictInt = Field(
        0,
        description="With 'centralized': which agent's "
        "comparator writes the joint response; in [0, num_agents) "
        "(checked only in centralized mode).",
    )
    comparator_api_format: Literal["generic", "openai", "anthropic", "openai_responses"] = Field(
        "generic", description="Request/response format of the API comparator."
    )
    comparator_api_url: NonEmptyStr | None = Field(
        None, description="Endpoint URL of the API comparator; required with comparator_policy='api'."
    )
    comparator_api_model: NonEmptyStr | None = Field(None, description="Model name sent to the API comparator.")
    comparator_api_key_env: NonEmptyStr | None = Field(
        None, description="NAME of the environment variable holding the API key; the key itself is never configured."
    )
    comparator_api_key_header: NonEmptyStr = Field(
        "Authorization", description="Header that carries the API key (anthropic: 'Authorization' becomes 'x-api-key')."
    )
    comparator_api_key_prefix: StrictStr = Field(
        "Bearer",
        description="Text before the key in its header "
        "('Bearer' gives 'Bearer <key>'; '' the bare key; anthropic: none).",
    )
    comparator_api_headers: dict[NonEmptyStr, StrictStr] | None = Field(
        None,
        description="Extra HTTP headers of every API request; a header named like a credential (Authorization, "
        "Cookie, anything with key, token, secret, auth, password) is refused: the key comes from "
        "comparator_api_key_env.",
    )
    comparator_api_extra_body: dict[NonEmptyStr, Any] | None = Field(
        None, description="JSON fields merged last into every API request body."
    )
    comparator_api_max_n_per_request: StrictInt | None = Field(
        None, ge=1, description="openai format: most candidates asked per request (n); None = all."
    )
    comparator_api_response_field: NonEmptyStr = Field(
        "completions", description="Generic format: dotted path of the list of completions in the JSON response."
    )
    comparator_api_timeout: StrictFloat = Field(
        120.0,
        gt=0,
        description="Total deadline of one API request (connect, send and every read of the answer), in seconds.",
    )
    comparator_api_max_concurrency: StrictInt = Field(4, ge=1, description="Most API requests in flight at once.")
    preference_replay_mode: Literal["current", "nearest_k", "all_history", "lambda_decay"] = Field(
        "current",
        description="Which stored rounds' pairs train a round: 'current' (this round's only), "
        "'nearest_k' (last k non-empty rounds), 'all_history', or 'lambda_decay' (weights λ^age).",
    )
    preference_replay_k: StrictInt | None = Field(
        None,
        ge=1,
        description="'nearest_k': number of recent non-empty rounds (required); 'current': None or 1; otherwise None.",
    )
    preference_replay_lambda: StrictFloat | None = Field(
        None, ge=0, le=1, description="'lambda_decay': decay λ in [0, 1] (required); forbidden with the other modes."
    )
    preference_replay_sample_size: StrictInt | None = Field(
        None,
        ge=1,
        description="Pairs drawn per round in the "
        "historical modes; None = this round's pair count. "
        "Forbidden with 'current'.",
    )
    preference_replay_dir: NonEmptyStr | None = Field(
        None, description="Folder of the round pair files; None = <run>/replay."
    )
    log_reward_distribution: StrictBool = Field(
        False,
        description="Record per-round histograms (16 bins over the "
        "task's declared reward range) of the raw rewards of target, "
        "comparator and selected-pair candidates, as metrics and plots. Needs "
        "a task/reward_func with a reward_range.",
    )
    policy_checkpoint_dir: NonEmptyStr | None = Field(
        None,
        description="Also export the policy of every round "
        "here, in the reference's layout: initial/agent_<i>/ and "
        "iteration_<nnnn>/agent_<i>/ (0-based: iteration_0000 = after "
        "round 1). None = the run's checkpoints/ only.",
    )


class _RewardModelFields(_Fields):
    reward_model_name: NonEmptyStr | None = Field(
        None, description="Backbone of the joint reward model; None = the agents' model."
    )
    reward_model_device: NonEmptyStr | None = Field(
        None,
        description="Device of the reward model; 'auto' = "
        "accelerate's device map within max_memory; None = the first "
        "agent's device (the reference defaults to 'cuda:0').",
    )
    reward_learning_rate: StrictFloat = Field(1e-5, gt=0, description="AdamW learning rate of the reward model.")
    reward_num_train_epochs: StrictInt = Field(1, ge=1, description="Epochs of reward-model fitting per round.")
    reward_train_batch_size: StrictInt = Field(1, ge=1, description="Preference pairs per reward-model step.")
    reward_max_length: StrictInt | None = Field(
        None, ge=1, description="Most tokens of a joint text for the reward model; None = the tokenizer's limit."
    )
    reward_freeze_backbone: StrictBool = Field(False, description="Train only the reward model's scalar head.")
    reward_pooling: Literal["last_token", "segments"] = Field(
        "segments",
        description="What the reward model's head reads: 'segments' (per agent, the mean hidden state over its "
        "response and log(1 + its length), standardized) or 'last_token' (the hidden state at the joint text's "
        "last token, the reference's).",
    )
    rl_algorithm: Literal["magrpo", "mareinforce", "marloo", "maremax", "maac", "iac"] = Field(
        "magrpo",
        description="RL backend against the learned reward: 'magrpo' (group-mean baseline), "
        "'mareinforce' (no baseline), 'marloo' (leave-one-out), 'maremax' (group max), 'maac' (centralized "
        "critic), 'iac' (independent critics).",
    )
    num_generations: StrictInt = Field(
        4, ge=1, description="RL samples per item per agent; >= 2 for magrpo, mareinforce, marloo and maremax."
    )
    critic_model_name: NonEmptyStr | None = Field(
        None, description="Critic backbone for 'maac'/'iac'; None = the agents' model."
    )
    critic_learning_rate: StrictFloat | None = Field(
        None, gt=0, description="Critic learning rate for 'maac'/'iac'; None = agent_learning_rate."
    )
    value_loss_coef: StrictFloat = Field(0.6, gt=0, description="Weight of the value loss ('maac'/'iac').")
    value_clip_range: StrictFloat | None = Field(
        0.2, gt=0, description="Value clipping range ('maac'/'iac'); None = no clipping."
    )
    critic_devices: DeviceSpec = Field(
        None,
        description="Device(s) of the critics ('maac'/'iac'): one device, or a "
        "list of 1 or num_agents; None = the agents' devices. Checked only with those.",
    )
    critic_type: Literal["v", "q"] = Field("v", description="Critic target ('maac'/'iac'): 'v' (state value) or 'q'.")
    use_separate_critic: StrictBool = Field(
        True, description="'iac': a separate critic model per agent (True) or a value head on the actor (False)."
    )
    critic_value_head_hidden_dim: StrictInt | None = Field(
        None, ge=1, description="Hidden width of a separate critic's value head; None = a linear head."
    )
    value_head_hidden_dim: StrictInt | None = Field(
        None,
        ge=1,
        description="Hidden width of the actor's value head (use_separate_critic=False); None = a linear head.",
    )


def _epochs(default: int) -> Any:
    return Field(
        default, ge=1, description="Passes over the selected pairs per round (MADPO) or RL epochs per round (MARLHF)."
    )


class _MADPOFields(_SingleRoundFields, _CommonFields):
    num_train_epochs: StrictInt = _epochs(20)


class _MADPOIterFields(_IterativeFields, _CommonFields):
    num_train_epochs: StrictInt = _epochs(1)


class _MARLHFFields(_RewardModelFields, _SingleRoundFields, _CommonFields):
    num_train_epochs: StrictInt = _epochs(1)


class _MARLHFIterFields(_RewardModelFields, _IterativeFields, _CommonFields):
    num_train_epochs: StrictInt = _epochs(2)
    reward_num_train_epochs: StrictInt = Field(2, ge=1, description="Epochs of reward-model fitting per round.")
    preference_scoring_reward: Literal["task", "reward_model"] = Field(
        "task",
        description="Scores of new comparisons: 'task' (the oracle) or 'reward_model' (the latest fitted "
        "reward model; the task reward until one exists).",
    )


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
        description="Share of joint responses whose reward may fail (dropped and counted) before the round stops.",
    )
    reward_timeout: StrictFloat = Field(
        600.0,
        gt=0,
        description="Seconds one reward_func call may take; past it the call is abandoned and its joint responses "
        "are dropped and counted like any reward failure.",
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
        description="torch's intra-op threads (and OpenMP's) in the process that runs the stages; None = the CPUs "
        "this process may use (its affinity mask, capped by a cgroup CPU quota). Ray shards and actors use the "
        "CPUs Ray reserved for them. On a machine other jobs share, also set OMP_WAIT_POLICY=PASSIVE in the "
        "environment (waiting threads sleep instead of spinning).",
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
    report_to: TrackerName | Annotated[list[TrackerName], Field(min_length=1)] | None = Field(
        None,
        description="Experiment trackers that follow the run (one name or a list): 'tensorboard' (event files in "
        "<run>/tensorboard), 'mlflow' (MLFLOW_TRACKING_URI, else a local store in <run>/mlruns), 'wandb' (online when "
        "logged in; WANDB_MODE=offline writes <run>/wandb without a network) and 'trackio' (local, in TRACKIO_DIR). "
        "Each gets the config as hyper-parameters, the logged training steps, every round's row of the round table "
        "and report.png; a resumed run continues the same tracked run (its id is kept in <run>/tracking.json). "
        "Projects and credentials come from the tools' environment variables only (WANDB_PROJECT, WANDB_API_KEY, "
        "MLFLOW_EXPERIMENT_NAME, ...). Each tool is an optional extra: pip install 'pbrl[tracking]'. None = no "
        "tracker. Keys no stage cache: a resume may add or change it.",
    )
