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
from pathlib import Path

import torch

from pbrl.config import JobConfig
from pbrl.data.schema import PAIR_JOINT_IDS, SELECTED_PAIRS, PairRow
from pbrl.data.seeds import derive_seed
from pbrl.data.storage import RunPaths, StageManifest
from pbrl.data.tables import read_rows, read_selected_pairs
from pbrl.errors import ArtifactError
from pbrl.learning.feature_store import backbone_fingerprint, features_path, load_features, save_features
from pbrl.learning.joint_template import JointInput, joint_input_ids, joint_template_for
from pbrl.learning.reward_fit import fit_bradley_terry, heldout_split, pair_correct, pair_metrics
from pbrl.learning.reward_model import row_digest
from pbrl.learning.reward_model_build import RewardModelSpec, new_reward_model, save_reward_model
from pbrl.learning.reward_scoring import pair_joint_ids_path, reward_device, reward_model_dir
from pbrl.reporting.stats import Interval, bootstrap_mean
from pbrl.run.settings import policy_source
from pbrl.run.stage_record import StageRecord

NAME = "fit-reward-model"
HELDOUT_SHARE = 0.25  # share of the selected pairs' items whose pairs are held out for rm/heldout_* (>= 1 item)
SCORE_BATCH = 16  # joint inputs per scoring forward


def _source_rounds(paths: RunPaths, round_index: int) -> list[int]:
    return sorted({r["source_round"] for r in read_rows(paths.selected_pairs(round_index), SELECTED_PAIRS)})


def input_files(paths: RunPaths, round_index: int, job: JobConfig) -> list[Path]:
    rounds = _source_rounds(paths, round_index)
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
    return pairs, kept, joint_inputs(kept, joint, job)


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


# Over 60 lines: the stage reads as one recipe (the pairs' joint ids, the held-out split, the fit, the metrics
# with their interval over items, the model and manifest) over shared local state.
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
        record.say("no usable preference pairs: no reward model is fitted and the policies are not updated")
        record.counts = {"pairs": len(pairs), "dropped_too_long": dropped, "train_pairs": 0, "heldout_pairs": 0}
        record.details = {"fitted": False}
        manifest = record.finish(input_files(paths, round_index, job), [])
        shutil.rmtree(out, ignore_errors=True)  # an earlier attempt's folder: no manifest names it
        features_path(paths.round_dir(round_index)).unlink(missing_ok=True)  # and its stored features
        return manifest

    spec = spec_of(job)

    def seed(side: str) -> int:
        return derive_seed(job.seed, round_index=round_index, stage=NAME, side=side)

    device = reward_device(job.reward_model_device, job.agent_devices, job.num_agents)
    model = new_reward_model(spec, seed=seed("init"), device=device)
    train_idx, held_idx = heldout_split([p["item_id"] for p in kept], HELDOUT_SHARE, seed("heldout"))
    train, held = [usable[i] for i in train_idx], [usable[i] for i in held_idx]
    progress = record.progress(job.reward_num_train_epochs * -(-len(train) // job.reward_train_batch_size), "steps")

    def on_step(loss: float) -> None:
        progress.advance()
        record.log(progress.done, {"rm/loss": loss})

    fingerprint = (
        backbone_fingerprint(
            model.backbone,
            source=spec.source,
            pooling=spec.pooling,
            backbone_layers=spec.backbone_layers,
            num_agents=spec.num_agents,
        )
        if model.backbone_frozen
        else ""
    )
    known = stored_features(paths, round_index, source_rounds(pairs), fingerprint, model.head.weight.device)
    # A frozen backbone runs once per distinct row (fit, then both metrics) and never on a stored one.
    with model.remembered_features(known) as memory:
        stats = fit_bradley_terry(
            model,
            train,
            epochs=job.reward_num_train_epochs,
            batch_size=job.reward_train_batch_size,
            learning_rate=job.reward_learning_rate,
            seed=seed("order"),
            max_grad_norm=job.max_grad_norm,
            on_step=on_step,
        )
        fitted, heldout = pair_metrics(model, train, SCORE_BATCH), pair_metrics(model, held, SCORE_BATCH)
        correct = pair_correct(model, held, SCORE_BATCH)
        own = {
            row_digest(row)
            for p, pair in zip(kept, usable, strict=True)
            if p["round_index"] == round_index
            for row in pair
        }
        save_features(
            features_path(paths.round_dir(round_index)), {d: memory[d] for d in own if d in memory}, fingerprint
        )
    interval = heldout_interval([kept[i]["item_id"] for i in held_idx], correct, seed("heldout-interval"))
    save_reward_model(model, spec, out, max_length=job.reward_max_length)
    record.metrics = {
        "rm/loss": fitted.loss,
        "rm/accuracy": fitted.accuracy,
        "rm/margin_mean": fitted.margin_mean,
        "rm/heldout_loss": heldout.loss,
        "rm/heldout_accuracy": heldout.accuracy,
        "rm/heldout_margin_mean": heldout.margin_mean,
    }
    if interval is not None:
        record.metrics |= {"rm/heldout_accuracy_lo": interval.low, "rm/heldout_accuracy_hi": interval.high}
        if interval.low <= 0.5:
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
        **stats,
    }
    if stats["skipped_steps"]:
        record.say(f"{stats['skipped_steps']} reward-model step(s) skipped: non-finite loss or gradient")
    record.details = {"fitted": True, "reward_model": paths.rel(out), "trained": spec.trained, "source": spec.source}
    stored = features_path(paths.round_dir(round_index))
    return record.finish(input_files(paths, round_index, job), [out, *([stored] if stored.is_file() else [])])


def heldout_interval(items: list[str], correct: list[bool], seed: int) -> Interval | None:
    """The held-out accuracy with its 95 % bootstrap interval over items (each item's share of correctly ordered
    pairs; :func:`pbrl.reporting.stats.bootstrap_mean`); None without held-out pairs."""
    if not correct:
        return None
    per_item: dict[str, list[float]] = {}
    for item, ok in zip(items, correct, strict=True):
        per_item.setdefault(item, []).append(float(ok))
    return bootstrap_mean([sum(v) / len(v) for v in per_item.values()], seed=seed)
