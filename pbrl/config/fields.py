"""The trainer fields of the pbrl configuration (docs/reference/options.md#options-reference): types, defaults,
single-field ranges and descriptions.

Fields are grouped in field-only mixins that the trainer, run and job models of :mod:`pbrl.config` combine;
nothing here has behaviour. The groups: ``_CommonFields`` (every trainer), ``_SingleRoundFields`` (``madpo``,
``marlhf``) and ``_RewardModelFields`` (the MARLHF trainers) here, ``_IterativeFields`` in
:mod:`pbrl.config.iterative_fields`; the end of this module combines them into one field class per trainer. The
run-level fields are in :mod:`pbrl.config.run_fields`, the strict scalar types (``true`` is not the number 1) and
the base model in :mod:`pbrl.config.field_types`. Option names and defaults are the reference library's (CoMLRL
``comlrl.trainers.preference``) except the ★ changes of docs/reference/options.md#options-reference. Cross-field
rules are in :mod:`pbrl.config.rules`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from pbrl.config.field_types import DeviceSpec, NonEmptyStr, StrictBool, StrictFloat, StrictInt, _Fields
from pbrl.config.iterative_fields import _IterativeFields
from pbrl.config.judge_fields import _JudgeFields

# Generation divides the float32 logits by the temperature. The reference has no greedy mode (it forces
# do_sample=True), so 0 is no setting there; 0 or a value near it (1e-40) gives inf logits and a NaN softmax.
# 1e-4 already samples the most likely token almost always, and above 100 sampling is nearly uniform.
TEMPERATURE_RANGE = (1e-4, 100)


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
        "response and log(1 + its length), standardized, and that length's square) or 'last_token' (the hidden "
        "state at the joint text's "
        "last token, the reference's).",
    )
    reward_backbone_layers: StrictInt | None = Field(
        None,
        ge=1,
        description="Run only the reward model backbone's first N decoder layers (its final norm then reads layer "
        "N); None = all (the reference's). Fitting and scoring cost about N / num_hidden_layers.",
    )
    reward_head_components: StrictInt | None = Field(
        None,
        ge=1,
        description="With reward_pooling='segments': the head reads each agent's pooled response features projected "
        "on their first k principal components over the fit's training rows (and its length); None = every feature "
        "(as before). A small k generalizes to unseen items where a head on every feature learns its pairs.",
    )
    reward_prompt_overlap: StrictBool = Field(
        False,
        description="With reward_pooling='segments': the head also reads, per agent, how much of what is particular "
        "to its prompt its response mentions (the idf-weighted share of the prompt's distinct tokens found in the "
        "response, idf over the fit's training prompts). For preferences about content, e.g. which names an "
        "answer mentions, that a mean of hidden states does not show (docs/results/marlhf.md).",
    )
    reward_joint_overlap: StrictBool = Field(
        False,
        description="With reward_pooling='segments': the head also reads how much of the prompts' words the agents' "
        "responses use between them (the idf-weighted share of the words of every agent's prompt found in any "
        "response; words of 3+ letters, idf over the fit's training prompts). For a team's preference about what "
        "the joint response covers, which no one agent's overlap shows "
        "(docs/results/marlhf.md#the-joint-overlap-2026-12-07).",
    )
    reward_length_products: StrictBool = Field(
        False,
        description="With reward_pooling='segments': the head also reads the product of every two agents' "
        "standardized log lengths, beside each length and its square: every quadratic form of the lengths, so "
        "that it can prefer the agents' relative lengths in a band (e.g. an explanation 2-6 times its summary) "
        "(docs/results/marlhf.md#the-agents-relative-lengths-and-what-bounds-the-held-out-figure-2026-12-07).",
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


class _MADPOFields(_SingleRoundFields, _JudgeFields, _CommonFields):
    num_train_epochs: StrictInt = _epochs(20)


class _MADPOIterFields(_IterativeFields, _JudgeFields, _CommonFields):
    num_train_epochs: StrictInt = _epochs(1)


class _MARLHFFields(_RewardModelFields, _SingleRoundFields, _JudgeFields, _CommonFields):
    num_train_epochs: StrictInt = _epochs(1)


class _MARLHFIterFields(_RewardModelFields, _IterativeFields, _JudgeFields, _CommonFields):
    num_train_epochs: StrictInt = _epochs(2)
    reward_num_train_epochs: StrictInt = Field(2, ge=1, description="Epochs of reward-model fitting per round.")
    preference_scoring_reward: Literal["task", "reward_model"] = Field(
        "task",
        description="Scores of new comparisons: 'task' (the oracle) or 'reward_model' (the latest fitted "
        "reward model; the task reward until one exists).",
    )
