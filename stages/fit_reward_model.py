"""Stage 6, fit-reward-model (MARLHF, docs/design/algorithms.md#joint-reward-model): a freshly initialised joint
reward model, fitted with the
Bradley–Terry loss on the round's replay-selected pairs.

The pairs' joint input ids come from ``rounds/<s>/pair_joint_ids.parquet`` of each pair's source round
(written by build-pairs), so fitting reads exactly the ids that were stored with the pair; pairs dropped
there (their responses do not fit ``reward_max_length``) are counted here. A seeded share
(:data:`HELDOUT_SHARE`) of the pairs' *items* is held out with all their pairs (no held-out pair shares an item
with a training pair): ``rm/*`` metrics are measured on the training pairs, ``rm/heldout_*`` on the held-out ones,
both after fitting, with a 95 % interval of the held-out accuracy over items; a message says so when that interval
does not exclude chance (0.5). The model is written to
``rounds/<r>/reward_model/`` (safetensors). Head init, LoRA init, the held-out split and the batch order
each come from their own seed ``(seed, round, "fit-reward-model", side)``, so a rerun is bitwise identical.

With a frozen backbone the features of the round's own joint responses are written to
``rounds/<r>/reward_features.safetensors``, and those stored by earlier source rounds are read instead of running
the backbone on their responses again (:mod:`pbrl.learning.feature_store`).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from pbrl.config import JobConfig
from pbrl.data.schema import PAIR_JOINT_IDS, PairRow
from pbrl.data.seeds import derive_seed
from pbrl.data.storage import RunPaths, StageManifest
from pbrl.data.tables import read_rows, read_selected_pairs
from pbrl.errors import ArtifactError
from pbrl.learning.feature_store import backbone_fingerprint, features_path, load_features, save_features
from pbrl.learning.joint_template import JointInput, joint_input_ids, joint_template_for
from pbrl.learning.reward_fit import Pair, PairMetrics, fit_bradley_terry, heldout_split, pair_correct, pair_metrics
from pbrl.learning.reward_model import JointRewardModel, row_digest
from pbrl.learning.reward_model_build import RewardModelSpec, new_reward_model, save_reward_model
from pbrl.learning.reward_scoring import reward_device
from pbrl.reporting.stats import Interval, bootstrap_mean
from pbrl.run.reward_records import pair_joint_ids_path, reward_model_dir
from pbrl.run.selection_records import selected_source_rounds
from pbrl.run.settings import policy_source
from pbrl.run.stage_record import StageRecord

NAME = "fit-reward-model"
HELDOUT_SHARE = 0.25  # share of the selected pairs' items whose pairs are held out for rm/heldout_* (>= 1 item)
SCORE_BATCH = 16  # joint inputs per scoring forward


def input_files(paths: RunPaths, round_index: int, job: JobConfig) -> list[Path]:
    rounds = selected_source_rounds(paths, round_index)
    return [
        paths.selected_pairs(round_index),
        *(paths.pairs(r) for r in rounds),
        *(pair_joint_ids_path(paths.round_dir(r)) for r in rounds),
        *_stored_features(paths, round_index, rounds),
    ]


def _stored_features(paths: RunPaths, round_index: int, rounds: list[int]) -> list[Path]:
    """The feature files of earlier source rounds that exist (:mod:`pbrl.learning.feature_store`)."""
    files = [features_path(paths.round_dir(r)) for r in rounds if r < round_index]
    return [f for f in files if f.is_file()]


def spec_of(job: JobConfig) -> RewardModelSpec:
    """``reward_model_name`` (default: the first agent's model), the run's LoRA settings, the freeze flag, the
    pooling, the number of agents (policies) in a joint response and the backbone layers that run."""
    source = policy_source(job)
    return RewardModelSpec(
        source=job.reward_model_name or source.models[0],
        lora=source.lora,
        freeze_backbone=job.reward_freeze_backbone,
        pooling=job.reward_pooling,
        num_agents=len(source.models),
        backbone_layers=job.reward_backbone_layers,
        head_components=job.reward_head_components,
        prompt_overlap=job.reward_prompt_overlap,
        length_products=job.reward_length_products,
        joint_overlap=job.reward_joint_overlap,
    )


def joint_inputs(pairs: list[PairRow], stored: dict[str, dict], job: JobConfig) -> list[tuple[JointInput, JointInput]]:
    """The kept pairs' (winner, loser) joint inputs with their response spans, rebuilt from the pairs' stored ids
    (:func:`pbrl.learning.joint_template.joint_input_ids`, deterministic) and checked against the ids build-pairs
    stored (``pair_joint_ids.parquet``).

    Raises:
        ArtifactError: a rebuilt input differs from the stored one (names the pair; build-pairs must rerun).
    """
    source = policy_source(job)
    template, _ = joint_template_for(job.reward_model_name or source.models[0], source.models)
    out = []
    for p in pairs:
        w = joint_input_ids(template, p["prompt_ids"], p["winner_ids"], job.reward_max_length)
        lo = joint_input_ids(template, p["prompt_ids"], p["loser_ids"], job.reward_max_length)
        row = stored[p["pair_id"]]
        if w.ids != row["winner_joint_ids"] or lo.ids != row["loser_joint_ids"]:
            raise ArtifactError(
                f"pair_joint_ids.parquet: the joint input ids of pair {p['pair_id']!r} differ from its pair's "
                "token ids (written under another template or reward_max_length); rerun build-pairs of its round"
            )
        out.append((w, lo))
    return out


def usable_pairs(
    paths: RunPaths, round_index: int, job: JobConfig
) -> tuple[list[PairRow], list[PairRow], list[tuple[JointInput, JointInput]]]:
    """The round's replay-selected pairs, those whose joint inputs fit ``reward_max_length`` (kept), and the kept
    pairs' (winner, loser) joint inputs (:func:`joint_inputs`), from each source round's ``pair_joint_ids.parquet``.

    Raises:
        ArtifactError: a selected pair has no stored joint ids, or they differ from its pair's ids.
    """
    pairs = read_selected_pairs(paths.selected_pairs(round_index), paths.pairs)
    return pairs, *kept_inputs(paths, pairs, job)


def kept_inputs(
    paths: RunPaths, pairs: list[PairRow], job: JobConfig
) -> tuple[list[PairRow], list[tuple[JointInput, JointInput]]]:
    """Of stored ``pairs`` (any rounds), those whose joint inputs fit ``reward_max_length`` (kept) and their (winner,
    loser) joint inputs (:func:`joint_inputs`), from each source round's ``pair_joint_ids.parquet``.

    Raises:
        ArtifactError: a pair has no stored joint ids, or they differ from its pair's ids.
    """
    joint: dict[str, dict] = {}
    for r in source_rounds(pairs):
        stored = read_rows(pair_joint_ids_path(paths.round_dir(r)), PAIR_JOINT_IDS)
        joint.update({row["pair_id"]: row for row in stored})
    missing = [p["pair_id"] for p in pairs if p["pair_id"] not in joint]
    if missing:
        raise ArtifactError(
            f"pair_joint_ids.parquet: no joint input ids for selected pair(s) {missing[:5]}; "
            "rerun build-pairs of their round"
        )
    kept = [p for p in pairs if joint[p["pair_id"]]["dropped"] is None]
    return kept, joint_inputs(kept, joint, job)


def source_rounds(pairs: list[PairRow]) -> list[int]:
    """The rounds the selected ``pairs`` were built in, ascending (each pair row holds its own round)."""
    return sorted({p["round_index"] for p in pairs})


def stored_features(
    paths: RunPaths, round_index: int, rounds: list[int], fingerprint: str, device: str | torch.device = "cpu"
) -> dict:
    """A frozen backbone's features (row digest → (f,)) stored by the earlier of the selection's source ``rounds``
    (:func:`source_rounds`), as those rounds wrote them; {} without a fingerprint (a backbone that trains)."""
    known: dict = {}
    for path in _stored_features(paths, round_index, rounds) if fingerprint else []:
        known |= load_features(path, fingerprint, device=device)
    return known


@dataclass(frozen=True)
class FitOutcome:
    """What one fit measured: the fit's counts (:func:`pbrl.learning.reward_fit.fit_bradley_terry`), the metrics
    on the training and the held-out pairs, and per held-out pair whether the model orders it right."""

    stats: dict[str, int]
    fitted: PairMetrics
    heldout: PairMetrics
    correct: list[bool]


def run(run_dir: str | Path, round_index: int, job: JobConfig) -> StageManifest:
    record = StageRecord(NAME, run_dir, round_index, job)
    paths = record.paths
    pairs, kept, usable = usable_pairs(paths, round_index, job)
    dropped = len(pairs) - len(usable)
    out = reward_model_dir(paths.round_dir(round_index))
    if dropped:
        record.say(
            f"{dropped} selected pair(s) left out: their responses do not fit reward_max_length={job.reward_max_length}"
        )
    if not usable:
        return _finish_unfitted(record, len(pairs), dropped)

    spec = spec_of(job)
    device = reward_device(job.reward_model_device, job.agent_devices, job.num_agents)
    model = new_reward_model(spec, seed=_seed(job, round_index, "init"), device=device)
    train_idx, held_idx = heldout_split([p["item_id"] for p in kept], HELDOUT_SHARE, _seed(job, round_index, "heldout"))
    train, held = [usable[i] for i in train_idx], [usable[i] for i in held_idx]
    on_step = _step_logger(record, job.reward_num_train_epochs * -(-len(train) // job.reward_train_batch_size))
    fingerprint = _fingerprint(model, spec)
    known = stored_features(paths, round_index, source_rounds(pairs), fingerprint, model.head.weight.device)
    stored = features_path(paths.round_dir(round_index))
    # A frozen backbone runs once per distinct row (fit, then both metrics) and never on a stored one.
    with model.remembered_features(known) as memory:
        outcome = _fit_and_measure(model, train, held, job, _seed(job, round_index, "order"), on_step)
        own = _own_rows(kept, usable, round_index)
        save_features(stored, {d: memory[d] for d in own if d in memory}, fingerprint)
    items = [kept[i]["item_id"] for i in held_idx]
    interval = heldout_interval(items, outcome.correct, _seed(job, round_index, "heldout-interval"))
    save_reward_model(model, spec, out, max_length=job.reward_max_length)
    record.metrics = _metrics(outcome, interval)
    if interval is not None and interval.low <= 0.5:
        record.say(
            f"the reward model is no better than chance on pairs of items it never saw: accuracy "
            f"{interval.mean:.2f} [{interval.low:.2f}, {interval.high:.2f}] on {len(held)} pairs of "
            f"{interval.n} items; RL would follow noise (docs/design/algorithms.md#joint-reward-model)"
        )
    record.counts = {
        "pairs": len(pairs),
        "dropped_too_long": dropped,
        "train_pairs": len(train),
        "heldout_pairs": len(held),
        **outcome.stats,
    }
    if outcome.stats["skipped_steps"]:
        record.say(f"{outcome.stats['skipped_steps']} reward-model step(s) skipped: non-finite loss or gradient")
    record.details = {"fitted": True, "reward_model": paths.rel(out), "trained": spec.trained, "source": spec.source}
    return record.finish(input_files(paths, round_index, job), [out, *([stored] if stored.is_file() else [])])


def _seed(job: JobConfig, round_index: int, side: str) -> int:
    """The seed of one random step of the fit: ``(seed, round, "fit-reward-model", side)``."""
    return derive_seed(job.seed, round_index=round_index, stage=NAME, side=side)


def _finish_unfitted(record: StageRecord, num_pairs: int, dropped: int) -> StageManifest:
    """The manifest of a round without usable pairs (no model fitted); an earlier attempt's model folder and stored
    features, which no manifest names, are deleted after it is written."""
    paths, round_index = record.paths, record.round_index
    record.say("no usable preference pairs: no reward model is fitted and the policies are not updated")
    record.counts = {"pairs": num_pairs, "dropped_too_long": dropped, "train_pairs": 0, "heldout_pairs": 0}
    record.details = {"fitted": False}
    manifest = record.finish(input_files(paths, round_index, record.job), [])
    shutil.rmtree(reward_model_dir(paths.round_dir(round_index)), ignore_errors=True)  # an earlier attempt's folder
    features_path(paths.round_dir(round_index)).unlink(missing_ok=True)  # and its stored features
    return manifest


def _step_logger(record: StageRecord, total_steps: int) -> Callable[[float], None]:
    """A fit's ``on_step``: advances the stage's progress over ``total_steps`` and logs ``rm/loss`` at each step."""
    progress = record.progress(total_steps, "steps")

    def on_step(loss: float) -> None:
        progress.advance()
        record.log(progress.done, {"rm/loss": loss})

    return on_step


def _fingerprint(model: JointRewardModel, spec: RewardModelSpec) -> str:
    """The frozen backbone's fingerprint that keys stored features (:mod:`pbrl.learning.feature_store`); "" for a
    backbone that trains (its features are never stored)."""
    if not model.backbone_frozen:
        return ""
    return backbone_fingerprint(
        model.backbone,
        source=spec.source,
        pooling=spec.pooling,
        backbone_layers=spec.backbone_layers,
        num_agents=spec.num_agents,
    )


def _fit_and_measure(
    model: JointRewardModel,
    train: list[Pair],
    held: list[Pair],
    job: JobConfig,
    order_seed: int,
    on_step: Callable[[float], None],
) -> FitOutcome:
    """Fit ``model`` on the ``train`` pairs (Bradley–Terry, the job's ``reward_*`` settings, batches in the order of
    ``order_seed``), then measure it on the training and the held-out pairs."""
    stats = fit_bradley_terry(
        model,
        train,
        epochs=job.reward_num_train_epochs,
        batch_size=job.reward_train_batch_size,
        learning_rate=job.reward_learning_rate,
        seed=order_seed,
        max_grad_norm=job.max_grad_norm,
        on_step=on_step,
    )
    fitted, heldout = pair_metrics(model, train, SCORE_BATCH), pair_metrics(model, held, SCORE_BATCH)
    return FitOutcome(stats, fitted, heldout, pair_correct(model, held, SCORE_BATCH))


def _own_rows(kept: list[PairRow], usable: list[Pair], round_index: int) -> set[str]:
    """The row digests of the joint inputs of this round's own pairs (their features are stored by this round)."""
    return {
        row_digest(row) for p, pair in zip(kept, usable, strict=True) if p["round_index"] == round_index for row in pair
    }


def _metrics(outcome: FitOutcome, interval: Interval | None) -> dict[str, float]:
    """The ``rm/*`` metrics (training pairs) and ``rm/heldout_*`` ones (held-out pairs, with the accuracy's 95 %
    interval over items when there are held-out pairs)."""
    metrics = {
        "rm/loss": outcome.fitted.loss,
        "rm/accuracy": outcome.fitted.accuracy,
        "rm/margin_mean": outcome.fitted.margin_mean,
        "rm/heldout_loss": outcome.heldout.loss,
        "rm/heldout_accuracy": outcome.heldout.accuracy,
        "rm/heldout_margin_mean": outcome.heldout.margin_mean,
    }
    if interval is not None:
        metrics |= {"rm/heldout_accuracy_lo": interval.low, "rm/heldout_accuracy_hi": interval.high}
    return metrics


def heldout_interval(items: list[str], correct: list[bool], seed: int) -> Interval | None:
    """The held-out accuracy with its 95 % bootstrap interval over items (each item's share of correctly ordered
    pairs; :func:`pbrl.reporting.stats.bootstrap_mean`); None without held-out pairs."""
    if not correct:
        return None
    per_item: dict[str, list[float]] = {}
    for item, ok in zip(items, correct, strict=True):
        per_item.setdefault(item, []).append(float(ok))
    return bootstrap_mean([sum(v) / len(v) for v in per_item.values()], seed=seed)
