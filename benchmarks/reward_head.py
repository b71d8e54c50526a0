"""Benchmark: what the frozen ``segments`` reward model's head should read, refitted on the stored rounds of MARLHF
runs (docs/results/marlhf.md#the-lengths-square-2026-12-03).

For each run folder (e.g. kept by ``benchmarks/learning.py --trainer marlhf_iter --keep``) and each round with a
fitted reward model, the round's pairs are read as fit-reward-model reads them (``usable_pairs``), the backbone's
features come from the run's stored files (``reward_features.safetensors`` of the round and its source rounds; the
backbone never runs, and the script fails if it would), and the head is refitted with the stage's own fit, seeds
and settings under each variant:

- ``--components``: principal components per agent (``reward_head_components``; ``all`` = every feature);
- with and without each agent's squared length (``RewardModelSpec.length_squares``), and with the squares and the
  products of every two agents' lengths (``RewardModelSpec.length_products``);
- ``--overlap on|off``: the head reads each agent's prompt overlap (``reward_prompt_overlap``) or not, whatever the
  run's job said; ``--joint-overlap on|off`` likewise for the joint response's word overlap (``reward_joint_overlap``);
- ``--squares-only``: only the shipped shape (the squares, no products), for a comparison of ``--components``;
- ``--splits``: the stage's held-out split of items (split 0, what ``rm/heldout_accuracy`` reports) and others
  drawn from the next seeds, so that a choice does not rest on which quarter of the items was held out;
- ``--ensemble``: also the variants as one model, each unseen pair ordered by the sum of their margins (their mean
  score: a reward-model ensemble, Coste et al. 2023);
- ``--choose-by-cv FOLDS``: also the variant that a cross-validation over the round's training items chooses (the
  items dealt into FOLDS folds; each variant fitted on the other folds and scored on one; the best pooled accuracy
  wins), i.e. the head's capacity chosen per round from its own data.
- ``--history``: round r's head fits every stored pair of the rounds up to r once (the union of their replay
  selections) instead of round r's selection, the items held out as the stage holds them out; ``--all-pairs``: every
  pair the rounds up to r built, selected or not (the backbone then runs on the rows no round stored, once).

Every row also gives the unseen-item accuracy on round r's own pairs (``heldout_own_*``: those the round's agents
produced, without the pairs replayed from earlier rounds).

Per variant it reports the accuracy on the training pairs and on the unseen items' pairs, with the interval over
items, and, over the rounds, the mean and the worst of the unseen-item accuracy (on split 0 and on every split).
Writes ``benchmarks/results/reward-head-<model>[-<tag>].json``. Nothing is timed.

Run: ``python benchmarks/reward_head.py RUN_DIR [RUN_DIR ...] [--components 4 8 16] [--splits 4]
[--ensemble] [--choose-by-cv 4]``.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
from benchkit import write_runs_result
from stored_pairs import fitted_rounds, history_pairs

import stages.fit_reward_model as fit
from pbrl.data.seeds import derive_seed
from pbrl.data.storage import RunPaths
from pbrl.learning.feature_store import backbone_fingerprint, features_path, load_features
from pbrl.learning.reward_fit import fit_bradley_terry, heldout_split, pair_margins, pair_metrics
from pbrl.learning.reward_model_build import new_reward_model
from pbrl.run.folder import open_job

Variant = tuple[int | None, bool, bool]  # (components, squares, products)
SHAPES = ((False, False), (True, False), (True, True))  # the lengths' (squares, products) compared per k
MARGIN_BANDS = (0.0, 0.1, 0.25, 0.5, math.inf)  # bands of a pair's task-reward margin (winner - loser, raw)


def refit_round(
    run_dir: Path,
    round_index: int,
    variants: list[Variant],
    splits: int,
    overlap: bool | None = None,
    *,
    ensemble: bool = False,
    cv_folds: int = 0,
    history: bool = False,
    all_pairs: bool = False,
    joint_overlap: bool | None = None,
) -> list[dict]:
    """One row per (split, components, squares, products): train / unseen-item accuracy of the refitted head, which
    reads the prompt overlap as the run's job did, or as ``overlap`` says (the joint overlap: ``joint_overlap``).
    With ``ensemble`` also a row per split whose components are ``"ensemble"``: the unseen pairs ordered by the sum
    of the variants' margins (their mean score). With ``cv_folds`` ≥ 2 also a row per split whose components are
    ``"cv"``: the variant a cross-validation over the training items chooses (:func:`item_folds`,
    :func:`cv_choice`), with its unseen-item accuracy. With ``history`` the pairs are every stored pair of the
    fitted rounds up to ``round_index`` (:func:`history_pairs`); with ``all_pairs`` every pair those rounds built,
    and the backbone may run.

    Raises:
        RuntimeError: a row's features are not stored (the backbone would run) and ``all_pairs`` is off.
    """
    job = open_job(run_dir)
    paths = RunPaths(run_dir)
    history = history or all_pairs
    pairs, kept, usable = (
        history_pairs(run_dir, round_index, every_built=all_pairs)
        if history
        else fit.usable_pairs(paths, round_index, job)
    )
    spec = fit.spec_of(job)
    spec = spec if overlap is None else replace(spec, prompt_overlap=overlap)
    spec = spec if joint_overlap is None else replace(spec, joint_overlap=joint_overlap)
    items = [p["item_id"] for p in kept]
    known: dict | None = None

    def seed(side: str) -> int:
        return derive_seed(job.seed, round_index=round_index, stage=fit.NAME, side=side)

    def refit(variant: Variant, train: list, scored: list, measure_train: bool = True) -> tuple[float, list[float]]:
        """The head of ``variant`` fitted on ``train`` as the stage fits it: its training accuracy (NaN without
        ``measure_train``: a cross-validation fold needs only its scored pairs) and the margins of the ``scored``
        pairs."""
        nonlocal known
        components, squares, products = variant
        model = new_reward_model(
            replace(spec, head_components=components, length_squares=squares, length_products=products),
            seed=seed("init"),
        )
        if known is None:
            fingerprint = backbone_fingerprint(
                model.backbone,
                source=spec.source,
                pooling=spec.pooling,
                backbone_layers=spec.backbone_layers,
                num_agents=spec.num_agents,
            )
            own = load_features(features_path(paths.round_dir(round_index)), fingerprint)
            known = fit.stored_features(paths, round_index, fit.source_rounds(pairs), fingerprint) | own
        with model.remembered_features(known) as memory:
            before = len(memory)
            fit_bradley_terry(
                model,
                train,
                epochs=job.reward_num_train_epochs,
                batch_size=job.reward_train_batch_size,
                learning_rate=job.reward_learning_rate,
                seed=seed("order"),
                max_grad_norm=job.max_grad_norm,
            )
            accuracy = pair_metrics(model, train, fit.SCORE_BATCH).accuracy if measure_train else math.nan
            margins = pair_margins(model, scored, fit.SCORE_BATCH)
            known |= _new_rows(memory, len(memory) - before, f"{run_dir} round {round_index}", allowed=all_pairs)
        return accuracy, margins

    rows = []
    for split in range(splits):
        train_idx, held_idx = heldout_split(items, fit.HELDOUT_SHARE, seed("heldout") + split)
        train, held = [usable[i] for i in train_idx], [usable[i] for i in held_idx]
        held_items, held_margins = [items[i] for i in held_idx], [_margin(kept[i]) for i in held_idx]
        base = {"run": run_dir.name, "round": round_index, "split": split, "prompt_overlap": spec.prompt_overlap}
        base["joint_overlap"] = spec.joint_overlap
        base |= {"train_pairs": len(train), "heldout_pairs": len(held), "history": "all" if all_pairs else history}
        own = [j for j, i in enumerate(held_idx) if kept[i]["round_index"] == round_index]  # round r's own pairs
        margins = {}
        for variant in variants:
            accuracy, margins[variant] = refit(variant, train, held)
            row = base | _variant_fields(variant) | {"train_accuracy": round(accuracy, 4)}
            rows.append(row | _heldout_fields(held_items, [m > 0 for m in margins[variant]], held_margins, seed))
            rows[-1] |= _own_fields(held_items, [margins[variant][j] > 0 for j in own], own, seed)
            print(_row_line(rows[-1]), flush=True)
        if ensemble:
            summed = [sum(ms) for ms in zip(*margins.values(), strict=True)]
            row = base | _shared_shape(variants, "ensemble") | {"train_accuracy": None}
            rows.append(row | _heldout_fields(held_items, [m > 0 for m in summed], held_margins, seed))
            print(_row_line(rows[-1]), flush=True)
        if cv_folds >= 2:
            train_items = [items[i] for i in train_idx]
            correct: dict[Variant, list[bool]] = {v: [] for v in variants}
            for fold in item_folds(train_items, cv_folds, seed("cv")):
                inner = [usable[i] for i, item in zip(train_idx, train_items, strict=True) if item not in fold]
                outer = [usable[i] for i, item in zip(train_idx, train_items, strict=True) if item in fold]
                for variant in variants:
                    correct[variant] += [m > 0 for m in refit(variant, inner, outer, measure_train=False)[1]]
            cv = {v: sum(c) / len(c) for v, c in correct.items() if c}
            chosen = cv_choice(cv)
            row = base | _shared_shape(variants, "cv") | {"train_accuracy": None, "chosen_components": chosen[0]}
            row |= {"cv_accuracy": {str(v[0]): round(a, 4) for v, a in cv.items()}}
            rows.append(row | _heldout_fields(held_items, [m > 0 for m in margins[chosen]], held_margins, seed))
            print(_row_line(rows[-1]), flush=True)
    return rows


def _new_rows(memory: dict, new: int, where: str, *, allowed: bool) -> dict:
    """The features a refit computed (``memory``, ``new`` of them not stored), kept for the next refit where the
    backbone may run (``allowed``).

    Raises:
        RuntimeError: the backbone ran (``new`` > 0) where it may not.
    """
    if new and not allowed:
        raise RuntimeError(
            f"{where}: {new} joint responses have no stored features "
            "(a frozen backbone's run keeps them in rounds/<r>/reward_features.safetensors)"
        )
    return memory if allowed else {}


def _own_fields(
    held_items: list[str], correct: list[bool], own: list[int], seed: Callable[[str], int]
) -> dict[str, Any]:
    """The unseen-item accuracy on the round's own held-out pairs (positions ``own`` of the held-out ones)."""
    interval = fit.heldout_interval([held_items[j] for j in own], correct, seed("heldout-interval"))
    return {
        "heldout_own_pairs": len(own),
        "heldout_own_pair_accuracy": round(sum(correct) / len(correct), 4) if correct else None,
        "heldout_own_low": round(interval.low, 4) if interval else None,
        "heldout_own_high": round(interval.high, 4) if interval else None,
    }


def item_folds(items: list[str], folds: int, seed: int) -> list[set[str]]:
    """The distinct ``items`` (first-seen order) dealt into ``folds`` sets in a seeded order: item j of the
    permutation goes to fold j mod ``folds`` (sizes differ by at most one; fewer items than folds: empty folds are
    dropped)."""
    distinct = list(dict.fromkeys(items))
    perm = np.random.default_rng(seed).permutation(len(distinct))
    dealt = [{distinct[int(j)] for j in perm[f::folds]} for f in range(folds)]
    return [fold for fold in dealt if fold]


def cv_choice(cv: dict[Variant, float]) -> Variant:
    """The variant with the highest cross-validated accuracy; a tie goes to the one with more components (``None``,
    every feature, counts as the most)."""
    return max(cv, key=lambda v: (cv[v], math.inf if v[0] is None else v[0]))


def _variant_fields(variant: Variant) -> dict[str, Any]:
    components, squares, products = variant
    return {"components": components, "length_squares": squares, "length_products": products}


def _shared_shape(variants: list[Variant], name: str) -> dict[str, Any]:
    """The fields of a row made of several variants: their lengths' shape where they share it, else None."""
    squares = {v[1] for v in variants}
    products = {v[2] for v in variants}
    return {
        "components": name,
        "length_squares": squares.pop() if len(squares) == 1 else None,
        "length_products": products.pop() if len(products) == 1 else None,
    }


def _heldout_fields(
    held_items: list[str], correct: list[bool], margins: list[float], seed: Callable[[str], int]
) -> dict[str, Any]:
    """A row's unseen-item accuracy: by item with its interval (the stage's ``heldout_interval``), by pair, and by
    the pairs' task-reward margin."""
    interval = fit.heldout_interval(held_items, correct, seed("heldout-interval"))
    return {
        "heldout_accuracy": round(interval.mean, 4) if interval else None,
        "heldout_pair_accuracy": round(sum(correct) / len(correct), 4) if correct else None,
        "heldout_low": round(interval.low, 4) if interval else None,
        "heldout_high": round(interval.high, 4) if interval else None,
        "heldout_by_margin": by_margin(correct, margins),
    }


def _margin(pair: dict) -> float:
    return pair["winner_raw_reward"] - pair["loser_raw_reward"]


def by_margin(correct: list[bool], margins: list[float]) -> list[dict[str, Any]]:
    """The accuracy of pairs by their task-reward margin, one entry per :data:`MARGIN_BANDS` band (lo, hi]:
    ``{"band": [lo, hi], "pairs": n, "correct": c}`` (pooled over rows by :func:`summary`)."""
    out = []
    for lo, hi in zip(MARGIN_BANDS, MARGIN_BANDS[1:], strict=False):
        inside = [c for c, m in zip(correct, margins, strict=True) if lo < m <= hi]
        out.append({"band": [lo, hi], "pairs": len(inside), "correct": sum(inside)})
    return out


def summary(rows: list[dict]) -> list[dict[str, Any]]:
    """Per variant: the mean and the worst unseen-item pair accuracy over the rounds, on split 0 and on all, and the
    unseen-item accuracy by the pairs' reward margin pooled over every round and split (:func:`pooled_margins`)."""
    out = []
    for key in dict.fromkeys(_variant(r) for r in rows):
        mine = [r for r in rows if _variant(r) == key and r["heldout_pair_accuracy"] is not None]
        first = [r["heldout_pair_accuracy"] for r in mine if r["split"] == 0]
        every = [r["heldout_pair_accuracy"] for r in mine]
        out.append(
            {
                "components": key[0],
                "length_squares": key[1],
                "length_products": key[2],
                "split0_mean": round(statistics.fmean(first), 4),
                "split0_min": min(first),
                "all_splits_mean": round(statistics.fmean(every), 4),
                "all_splits_min": min(every),
                "rounds": len(first),
                "by_margin": pooled_margins([r.get("heldout_by_margin", []) for r in mine]),
            }
        )
    return out


def pooled_margins(entries: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Rows' :func:`by_margin` entries summed band by band: ``{"band", "pairs", "accuracy"}`` (None without pairs)."""
    bands: dict[tuple[float, float], list[int]] = {}
    for entry in entries:
        for band in entry:
            total = bands.setdefault(tuple(band["band"]), [0, 0])
            total[0] += band["pairs"]
            total[1] += band["correct"]
    return [
        {"band": list(band), "pairs": n, "accuracy": round(c / n, 4) if n else None} for band, (n, c) in bands.items()
    ]


def _variant(row: dict) -> Variant:
    return row["components"], row["length_squares"], row.get("length_products", False)


def _row_line(r: dict) -> str:
    k = "all" if r["components"] is None else r["components"]
    k = f"{k} (k={r['chosen_components']})" if "chosen_components" in r else k
    train = "" if r["train_accuracy"] is None else f"{r['train_accuracy']:.3f} "
    return (
        f"{r['run']} round {r['round']} split {r['split']} k={k} squares={r['length_squares']} "
        f"products={r['length_products']}: "
        f"train {train}({r['train_pairs']}), unseen {r['heldout_pair_accuracy']:.3f} "
        f"[{r['heldout_low']:.2f}, {r['heldout_high']:.2f}] ({r['heldout_pairs']})"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="MARLHF run folders with a frozen reward-model backbone")
    parser.add_argument("--components", nargs="+", default=["4", "8", "16"], help="k per agent, or 'all'")
    parser.add_argument("--splits", type=int, default=4, help="held-out splits of the items (split 0: the stage's)")
    parser.add_argument("--tag", default="", help="added to the result's name")
    parser.add_argument(
        "--overlap", choices=("on", "off"), help="the head reads the prompt overlap (default: as the run's job did)"
    )
    parser.add_argument(
        "--joint-overlap", choices=("on", "off"), help="the head reads the joint overlap (default: as the job did)"
    )
    parser.add_argument(
        "--squares-only", action="store_true", help="only the shipped shape of the lengths: their squares, no products"
    )
    parser.add_argument(
        "--ensemble", action="store_true", help="also the variants together: the unseen pairs by their summed margins"
    )
    parser.add_argument(
        "--history", action="store_true", help="round r fits every stored pair of rounds <= r once (their union)"
    )
    parser.add_argument(
        "--all-pairs", action="store_true", help="round r fits every pair rounds <= r built (the backbone may run)"
    )
    parser.add_argument(
        "--choose-by-cv",
        type=int,
        default=0,
        metavar="FOLDS",
        help="also the variant a cross-validation over the training items (FOLDS folds of items) chooses",
    )
    args = parser.parse_args()
    components = [None if c == "all" else int(c) for c in args.components]
    shapes = [(True, False)] if args.squares_only else SHAPES
    variants = [(k, squares, products) for k in components for squares, products in shapes]
    rows = []
    for run_dir in args.runs:
        for r in fitted_rounds(run_dir):
            overlap = None if args.overlap is None else args.overlap == "on"
            rows.extend(
                refit_round(
                    run_dir,
                    r,
                    variants,
                    args.splits,
                    overlap,
                    ensemble=args.ensemble,
                    cv_folds=args.choose_by_cv,
                    history=args.history,
                    all_pairs=args.all_pairs,
                    joint_overlap=None if args.joint_overlap is None else args.joint_overlap == "on",
                )
            )
    table = summary(rows)
    print("\ncomponents  squares  products  split-0 mean  split-0 worst  all-splits mean  all-splits worst")
    for s in table:
        k = "all" if s["components"] is None else s["components"]
        print(
            f"{k!s:>10}  {s['length_squares']!s:>7}  {s['length_products']!s:>8}  "
            f"{s['split0_mean']:12.3f}  {s['split0_min']:13.3f}  "
            f"{s['all_splits_mean']:15.3f}  {s['all_splits_min']:16.3f}"
        )
    path = write_runs_result("reward-head", args.runs, args.tag, {"rows": rows, "summary": table})
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
