"""The judge fields of the pbrl configuration (docs/reference/options.md#options-reference, docs/guides/judges.md):
where preferences come from, which judge gives them, and the options of each judge. Types, defaults, single-field
ranges and descriptions only; the rules that tie them together are in :mod:`pbrl.config.judge_rules`.

The reference library orders pairs by a pointwise reward only; TRL's ``OnlineDPOTrainer(judge=...)`` asks a pairwise
judge. These fields are pbrl's own (not in the reference library): a judge compares two joint responses.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from pbrl.config.field_types import (
    MAX_TIMEOUT_H,
    MAX_TIMEOUT_S,
    NonEmptyStr,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    _Fields,
)

BUILT_IN_JUDGES = ("reward_noisy", "api", "local", "human")
HUMAN_JUDGE = "human"  # people label the pairs: in the Prefect UI or with `pbrl label` (docs/guides/label-pairs.md)
IN_PROCESS_JUDGE = "python"  # the judge of a run that got one as a Python object from the trainer API (in-process)


class _JudgeFields(_Fields):
    preference_source: Literal["reward", "judge"] = Field(
        "reward",
        description="Where preferences come from: 'reward' (the oracle scores every joint response and pairs are "
        "ordered by score, as the reference) or 'judge' (a pairwise judge says which of two joint responses is "
        "better; the stage judge-pairs asks it, see judge).",
    )
    judge: NonEmptyStr | None = Field(
        None,
        description="With preference_source 'judge': 'reward_noisy' (the task reward as a labeller that errs: "
        "judge_label_noise or judge_bt_temperature), 'api' (a model behind an API: judge_api_*), 'local' (a causal "
        "LM, judge_model, judging by the log-probabilities of 'A' and 'B'), 'human' (people label the pairs in the "
        "Prefect UI or with `pbrl label`: judge_label_*; docs/guides/label-pairs.md) or the import path "
        "'pkg.module:function' of a Python judge (docs/guides/judges.md). The Python API also takes a function or a "
        "judge object.",
    )
    judge_label_noise: StrictFloat = Field(
        0.0, ge=0, le=0.5, description="judge 'reward_noisy': share of decided preferences flipped (seeded)."
    )
    judge_bt_temperature: StrictFloat | None = Field(
        None,
        gt=0,
        description="judge 'reward_noisy': draw Bradley–Terry labels, P(A) = σ((r_A − r_B) / T), with this "
        "temperature T instead of flipping (seeded); None = flips of judge_label_noise.",
    )
    judge_position_swap: StrictBool | None = Field(
        None,
        description="Ask every pair in both orders (first as A, then as B): language-model judges prefer a "
        "position. False: one order per pair, drawn from the run seed and recorded. None: True for every judge but "
        "'human' (a person labels each pair once, in a drawn order).",
    )
    judge_swap_disagreement: Literal["tie", "drop"] = Field(
        "tie",
        description="With judge_position_swap, when the two orders disagree: 'tie' (no pair, counted as a tie) or "
        "'drop' (no pair, counted as dropped).",
    )
    judge_timeout: StrictFloat = Field(
        600.0,
        gt=0,
        le=MAX_TIMEOUT_S,
        description="A Python judge given as a function: seconds one comparison may take. The function runs in a "
        "worker process; past the limit the process is killed and that comparison has no verdict (dropped and "
        "counted with its reason), and the next comparison starts a fresh worker.",
    )
    judge_tie_margin: StrictFloat = Field(
        0.0,
        ge=0,
        lt=0.5,
        description="A judge that gives P(A is better) (local, a Python judge returning a number) answers 'tie' when "
        "it lies within this distance of 1/2.",
    )
    judge_max_pairs: StrictInt | None = Field(
        None,
        ge=1,
        description="Label budget: at most this many pairs are asked per round, chosen by judge_pair_choice from the "
        "pairs that pair_selection keeps; None = all of them.",
    )
    judge_pair_choice: Literal["random", "uncertain"] = Field(
        "random",
        description="With judge_max_pairs: which pairs are asked. 'random': drawn at random (seeded); 'uncertain': "
        "those the current model is least sure about (the smallest |margin|: the policies' implicit DPO reward for "
        "MADPO, the last reward model's for MARLHF; drawn at random while there is no model to ask, as in round 1).",
    )
    judge_label_batch_size: StrictInt = Field(
        5,
        ge=1,
        le=50,
        description="judge 'human': pairs per form in the Prefect UI (a flow run waits for one form at a time).",
    )
    judge_label_timeout_hours: StrictFloat | None = Field(
        None,
        gt=0,
        le=MAX_TIMEOUT_H,
        description="judge 'human': hours a round waits for its labels, from when it first asked for them; then "
        "judge_label_timeout_policy applies. None = wait as long as it takes.",
    )
    judge_label_timeout_policy: Literal["fail", "continue"] = Field(
        "fail",
        description="judge 'human', after judge_label_timeout_hours: 'fail' (the round fails, saying how many pairs "
        "are unlabelled; label them and resume) or 'continue' (the round trains on the pairs labelled so far).",
    )
    judge_model: NonEmptyStr | None = Field(
        None,
        description="judge 'local': the judge's causal LM (a local folder, a hub id already on disk or a packaged "
        "alias); judge 'api': the model name sent to the API.",
    )
    judge_prompt_template: NonEmptyStr | None = Field(
        None,
        description="judge 'api' or 'local': a text file with the judge's prompt, in str.format syntax with the fields "
        "{num_agents}, {task}, {response_a} and {response_b} (the last two required); None = the built-in template "
        "(docs/guides/judges.md#the-prompt).",
    )
    judge_batch_size: StrictInt = Field(8, ge=1, description="judge 'local': comparisons per forward pass.")
    judge_api_format: Literal["generic", "openai", "anthropic", "openai_responses"] = Field(
        "openai",
        description="judge 'api': the request format, as comparator_api_format ('generic' posts "
        "{prompt, task_item, ...} and reads judge_api_response_field).",
    )
    judge_api_url: NonEmptyStr | None = Field(None, description="judge 'api': the endpoint URL.")
    judge_api_key_env: NonEmptyStr | None = Field(
        None, description="judge 'api': NAME of the environment variable holding the API key (never the key)."
    )
    judge_api_key_header: NonEmptyStr = Field(
        "Authorization", description="judge 'api': header carrying the key ('x-api-key' for anthropic is set)."
    )
    judge_api_key_prefix: StrictStr = Field("Bearer", description="judge 'api': text before the key in its header.")
    judge_api_headers: dict[NonEmptyStr, StrictStr] | None = Field(
        None, description="judge 'api': extra headers of every request (no credentials: use judge_api_key_env)."
    )
    judge_api_extra_body: dict[NonEmptyStr, Any] | None = Field(
        None, description="judge 'api': JSON fields merged last into every request body."
    )
    judge_api_response_field: NonEmptyStr = Field(
        "completions", description="judge 'api' with format 'generic': dotted path of the answer list."
    )
    judge_api_max_tokens: StrictInt = Field(
        16, ge=1, description="judge 'api': most tokens of one answer (the answer is one word)."
    )
    judge_api_timeout: StrictFloat = Field(
        120.0,
        gt=0,
        le=MAX_TIMEOUT_S,
        description="judge 'api': seconds one request may take in all (connect, send, every read).",
    )
    judge_api_max_concurrency: StrictInt = Field(4, ge=1, description="judge 'api': most requests in flight.")
    judge_api_max_tokens_per_round: StrictInt | None = Field(
        None,
        ge=1,
        description="judge 'api': token budget of a round: once the answers cost this many tokens (as the API reports "
        "them), the round's remaining pairs are not asked (counted); None = no budget.",
    )
