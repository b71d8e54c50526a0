"""The stages of a round, one module each, each a plain ``run(run_dir, round_index, job) -> StageManifest``.

Every stage module also exposes ``NAME`` and ``input_files(paths, round_index, job)``: the files whose
content keys its cache. Stages never import each other; they talk through files and manifests.
"""

from __future__ import annotations

from types import ModuleType

from stages import (
    build_pairs,
    evaluate,
    fit_reward_model,
    judge_pairs,
    replay_select,
    sample_candidates,
    score_with_oracle,
    store_round,
    update_policies,
)

STAGE_MODULES: dict[str, ModuleType] = {
    m.NAME: m
    for m in (
        sample_candidates,
        score_with_oracle,
        judge_pairs,
        build_pairs,
        store_round,
        replay_select,
        fit_reward_model,
        update_policies,
        evaluate,
    )
}
