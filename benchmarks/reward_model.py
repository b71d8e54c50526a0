"""Benchmark: what does the joint reward model learn of the docs task's preference? Accuracy on pairs of unseen items.

Data: one collection of the demo job (``flows/configs/demo.yaml``: 2 SmolLM2-135M-Instruct agents on
``humaneval_docs``) through the product's own stages — sample-candidates then score-with-oracle with
``--candidates`` target and as many comparator candidates per item (comparator = the current policy, so every
joint response is a draw of the same policy) on ``--items`` training problems. Every pair of an item's joint
responses whose task rewards differ by more than ``tie_tolerance`` is a preference pair (winner = higher reward).

Held out by *item*: for a training size of n items, ``--splits`` seeded draws of n items train a representation's
head; its accuracy is measured on **every pair of every other item** (no prompt, no response shared with a training
pair). Reported per representation and size: the mean and range over splits of the held-out accuracy, the
training pairs and the held-out pairs.

Representations (the backbone is frozen in all of them; each is a linear Bradley–Terry head on standardized
features, fitted to convergence with L-BFGS and an L2 penalty, i.e. a logistic regression on the feature
differences of winner and loser):
- ``last_token``: the last hidden state at the last token of the joint text (the reference's reward model);
- ``segments``: per agent the mean of the last hidden states over its response tokens and log(1 + its response
  tokens) (:func:`pbrl.learning.segment_head.segment_features`, the product's ``reward_pooling: segments``);
- ``segment_lengths``: only the log(1 + response tokens) of each agent;
- ``prompt_overlap``: per agent, the idf-weighted share of its prompt's distinct tokens that its response contains,
  the idf fitted on the split's training prompts (the product's ``reward_prompt_overlap``,
  :class:`pbrl.learning.prompt_overlap.PromptOverlap`: what is particular to an item, its identifiers, weighs most);
  ``overlap_tf`` weighs each prompt token by its tf-idf instead, the times the prompt holds it times its idf
  (:func:`tf_overlap`: measured, not kept in the product);
  ``segments+overlap`` adds it to ``segments``; ``word_overlap`` is the same on words, the idf over every prompt
  of the collection (:func:`word_overlap`);
- ``joint_overlap``: the idf-weighted share of the words of the agents' prompts together that their responses use
  together, the idf fitted on the split's training prompts (the product's ``reward_joint_overlap``,
  :class:`pbrl.learning.prompt_overlap.JointWordOverlap`); ``overlaps+joint``: it beside ``prompt_overlap``;
- ``hand``: a yardstick of what is learnable: words of the summary and of the explanation (log), the explanation /
  summary length ratio (log), the identifier coverage of the explanation, both lengths within bounds.
``--product`` also fits the product's reward model the way fit-reward-model does (AdamW, the run's learning rate,
epochs and batch size) for the configured pooling and training (head only or LoRA), on one split per size.

``--reward-terms coverage`` measures the same joint responses under another preference: the reward recomputed from
the stored texts as the sum of those parts of the docs reward (``coverage`` alone: a preference about content, which
names the explanation mentions; issue #55); ``segment_lengths`` then says how much length still tells.
``--round`` reads another round's collection of a ``--from-run`` folder (default 1, the initial policy's).

Writes ``benchmarks/results/reward-model-<model>[-<terms>][-<tag>].json``. Run: ``python benchmarks/reward_model.py``
(about 20 min on 2 idle CPU cores, mostly the sampling; ``--keep`` keeps the run folder, ``--from-run`` reuses one).
"""

from __future__ import annotations

import argparse
import math
import re
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import torch
from benchkit import REPO_ROOT, peak_rss_mb, write_result

from pbrl.config import JOB_CLASSES, JobConfig, load_job, parse_job
from pbrl.data.items import read_items
from pbrl.data.storage import RunPaths
from pbrl.learning.joint_template import JointInput, JointTemplate, joint_input_ids
from pbrl.learning.prompt_overlap import JointWordOverlap, PromptOverlap
from pbrl.learning.reward_fit import fit_bradley_terry, pair_correct
from pbrl.learning.reward_model_build import RewardModelSpec, new_reward_model
from pbrl.models.loading import load_tokenizer, resolve_model_source
from pbrl.models.threads import configure_threads
from pbrl.run.folder import open_job, prepare_run
from pbrl.tasks.humaneval_docs import ALL_TERMS, REWARD_TERMS, docs_score

CONFIG = REPO_ROOT / "flows" / "configs" / "demo.yaml"
REPRESENTATIONS = (
    "last_token", "segments", "segment_lengths", "hand", "prompt_overlap", "overlap_tf", "segments+overlap",
    "word_overlap", "joint_overlap", "overlaps+joint",
)  # fmt: skip
L2 = 1.0  # the L2 penalty of the logistic regressions (on standardized features, summed over pairs)


def collect(out: Path, args: argparse.Namespace) -> Path:
    """The product's sample-candidates and score-with-oracle on ``args.items`` training problems."""
    from stages import STAGE_MODULES

    job = load_job(
        CONFIG,
        [
            f"agent_model={args.model}",
            f"task_options={{num_train_items: {args.items}, num_eval_items: 4}}",
            f"preference_num_candidates={args.candidates}",
            f"max_new_tokens={args.max_new_tokens}",
            "num_iterations=1",
            f"seed={args.seed}",
            f"output_dir={out}",
            "run_name=reward-model-data",
        ],
    )
    run_dir = prepare_run(job, resume=False)
    for stage in ("sample-candidates", "score-with-oracle"):
        started = time.perf_counter()
        STAGE_MODULES[stage].run(run_dir, 1, job)
        print(f"[reward-model] {stage}: {time.perf_counter() - started:.0f} s", flush=True)
    return run_dir


def joint_responses(run_dir: Path, job: JobConfig, round_index: int = 1) -> list[dict[str, Any]]:
    """Every scored joint response of a round: item, reward, prompts and completions (text and ids) per agent."""
    paths = RunPaths(run_dir)
    candidates = pq.read_table(paths.candidates(round_index)).to_pylist()
    return assemble(pq.read_table(paths.scores(round_index)).to_pylist(), candidates, job.num_agents)


def assemble(scores: list[dict[str, Any]], candidates: list[dict[str, Any]], num_agents: int) -> list[dict[str, Any]]:
    """The scored joint responses, each agent's text from the candidate its score row names (``candidate_sides``,
    ``candidate_indices``: with ``joint_mode: cross`` joint response j of an item combines agent 0's candidate 0
    with agent 1's candidate j, not both agents' candidate j); rows whose reward failed are left out."""
    by_key = {(c["item_id"], c["side"], c["candidate_index"], c["agent_index"]): c for c in candidates}
    out = []
    for s in scores:
        if s["failure"] is not None:
            continue
        sides = s["candidate_sides"] or [s["side"]] * num_agents  # absent: aligned, candidate j of every agent
        indices = s["candidate_indices"] or [s["candidate_index"]] * num_agents
        rows = [by_key[(s["item_id"], sides[a], indices[a], a)] for a in range(num_agents)]
        out.append(
            {
                "item_id": s["item_id"],
                "reward": s["reward"],
                "prompt_ids": [r["prompt_ids"] for r in rows],
                "completion_ids": [r["completion_ids"] for r in rows],
                "completions": [r["completion"] for r in rows],
            }
        )
    return out


def preference_pairs(responses: list[dict[str, Any]], tie_tolerance: float) -> list[tuple[int, int]]:
    """(winner, loser) indexes into ``responses``: every pair of one item's responses, rewards apart by > tol."""
    pairs = []
    for i, a in enumerate(responses):
        for j in range(i + 1, len(responses)):
            b = responses[j]
            if a["item_id"] == b["item_id"] and abs(a["reward"] - b["reward"]) > tie_tolerance:
                pairs.append((i, j) if a["reward"] > b["reward"] else (j, i))
    return pairs


@torch.no_grad()
def backbone_features(responses: list[dict[str, Any]], job: JobConfig) -> dict[str, np.ndarray]:
    """``last_token`` (n, h) and ``segments`` (n, a·(h+1)) of the frozen backbone."""
    from pbrl.learning.segment_head import segment_features
    from pbrl.models.forward import pad_rows

    spec = RewardModelSpec(source=job.agent_model, freeze_backbone=True)
    model = new_reward_model(spec, seed=0)
    inputs = joint_inputs(responses, spec.source, job.num_agents)
    last, segments = [], []
    for start in range(0, len(inputs), 8):
        chunk = inputs[start : start + 8]
        ids, mask, positions, last_index = pad_rows([x.ids for x in chunk], model.pad_token_id, "right")
        hidden = model.backbone(input_ids=ids, attention_mask=mask, position_ids=positions).last_hidden_state
        last.append(hidden[torch.arange(len(chunk)), last_index])
        segments.append(segment_features(hidden, [x.response_spans for x in chunk]))
    return {"last_token": torch.cat(last).double().numpy(), "segments": torch.cat(segments).double().numpy()}


def hand_features(responses: list[dict[str, Any]], items: dict[str, dict]) -> np.ndarray:
    """The yardstick's 5 features per response (see the module docstring), (n, 5)."""
    from pbrl.tasks.humaneval_docs import EXPLANATION_WORDS, SUMMARY_WORDS, coverage, key_identifiers

    rows = []
    for r in responses:
        s, e = (c.strip() for c in r["completions"])
        ws, we = len(s.split()), len(e.split())
        ok = SUMMARY_WORDS[0] <= ws <= SUMMARY_WORDS[1] and EXPLANATION_WORDS[0] <= we <= EXPLANATION_WORDS[1]
        cov = coverage(e, key_identifiers(items[r["item_id"]])) if e else 0.0
        rows.append([math.log1p(ws), math.log1p(we), math.log((len(e) + 1) / (len(s) + 1)), cov, float(ok)])
    return np.array(rows, dtype=np.float64)


def joint_inputs(responses: list[dict[str, Any]], source: str, num_agents: int) -> list[JointInput]:
    """Every response as the reward model's joint input (the model ``source``'s template, 512 tokens at most)."""
    template = JointTemplate.build(load_tokenizer(resolve_model_source(source)), num_agents)
    return [joint_input_ids(template, r["prompt_ids"], r["completion_ids"], 512) for r in responses]


def prompt_overlap(
    responses: list[dict[str, Any]], inputs: list[JointInput], num_agents: int
) -> Callable[[set[str]], np.ndarray]:
    """The product's ``reward_prompt_overlap`` (:class:`pbrl.learning.prompt_overlap.PromptOverlap`) of every response
    (``inputs``: :func:`joint_inputs`), its idf table fitted on the training items' prompts of a split, as the fit
    does: (training items) -> (n, a)."""

    def of(train_items: set[str]) -> np.ndarray:
        rows = [x for x, r in zip(inputs, responses, strict=True) if r["item_id"] in train_items]
        return PromptOverlap.fit(rows, num_agents).features(inputs).double().numpy()

    return of


def tf_overlap(
    responses: list[dict[str, Any]], inputs: list[JointInput], num_agents: int
) -> Callable[[set[str]], np.ndarray]:
    """:func:`prompt_overlap` with each prompt token weighed by its tf-idf, tf_P(t)·idf(t) with tf_P(t) the times the
    prompt holds t (scikit-learn's ``TfidfVectorizer`` default), instead of each distinct token by its idf alone: a
    name the prompt repeats (a parameter in the signature, docstring and examples) weighs more. (training items) ->
    (n, a); the idf table is the product's, fitted on the split's training prompts."""

    def of(train_items: set[str]) -> np.ndarray:
        table = PromptOverlap.fit(
            [x for x, r in zip(inputs, responses, strict=True) if r["item_id"] in train_items], num_agents
        )
        out = np.zeros((len(inputs), num_agents))
        for i, x in enumerate(inputs):
            ids = x.ids or []
            for k, ((p0, p1), (r0, r1)) in enumerate(zip(x.prompt_spans, x.response_spans, strict=True)):
                weight = {t: n * table.idf(k, t) for t, n in Counter(ids[p0:p1]).items()}
                total, said = sum(weight.values()), set(ids[r0:r1])
                out[i, k] = sum(w for t, w in weight.items() if t in said) / total if total > 0 else 0.0
        return out

    return of


def joint_overlap(
    responses: list[dict[str, Any]], inputs: list[JointInput], source: str
) -> Callable[[set[str]], np.ndarray]:
    """The product's ``reward_joint_overlap`` (:class:`pbrl.learning.prompt_overlap.JointWordOverlap`) of every
    response, its idf table fitted on the training items' joint prompts of a split, as the fit does: (training
    items) -> (n, 1)."""
    tokenizer = load_tokenizer(resolve_model_source(source))

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)

    def of(train_items: set[str]) -> np.ndarray:
        rows = [x for x, r in zip(inputs, responses, strict=True) if r["item_id"] in train_items]
        return JointWordOverlap.fit(rows, decode).features(inputs, decode).double().numpy()

    return of


def word_overlap(responses: list[dict[str, Any]], prompts: list[list[str]], num_agents: int) -> np.ndarray:
    """The prompt overlap on words (maximal runs of letters, digits and underscores) instead of token ids (a
    tokenizer spells ``numbers`` after ``(`` and after a space with different ids, a word is the same word), with
    idf(t) = log(N / df(t)) over every distinct prompt of the collection. ``prompts[i][a]`` is response i's prompt
    text of agent a, (n, a)."""
    words = [[set(re.findall(r"\w+", p)) for p in row] for row in prompts]
    out = np.zeros((len(responses), num_agents))
    for a in range(num_agents):
        distinct = {frozenset(w[a]) for w in words}
        df: dict[str, int] = {}
        for p in distinct:
            for t in p:
                df[t] = df.get(t, 0) + 1
        idf = {t: math.log(len(distinct) / d) for t, d in df.items()}
        for i, r in enumerate(responses):
            said = set(re.findall(r"\w+", r["completions"][a]))
            total = sum(idf[t] for t in words[i][a])
            out[i, a] = sum(idf[t] for t in words[i][a] & said) / total if total else 0.0
    return out


def representations(
    responses: list[dict[str, Any]], items: dict[str, dict], job: JobConfig, wanted: list[str]
) -> dict[str, np.ndarray | Callable[[set[str]], np.ndarray]]:
    """The features of each representation in ``wanted`` (names of :data:`REPRESENTATIONS`), in that order: an array
    (n, f), or a function of a split's training items for the overlaps, whose idf those items fit. The backbone runs
    only for a representation that reads it."""
    features: dict[str, Any] = {"hand": hand_features(responses, items)} if "hand" in wanted else {}
    inputs = joint_inputs(responses, job.agent_model, job.num_agents)
    overlap_of = prompt_overlap(responses, inputs, job.num_agents)
    features["prompt_overlap"] = overlap_of
    features["overlap_tf"] = tf_overlap(responses, inputs, job.num_agents)
    joint_of = joint_overlap(responses, inputs, job.agent_model)
    features["joint_overlap"] = joint_of
    features["overlaps+joint"] = lambda train: np.concatenate([overlap_of(train), joint_of(train)], axis=1)
    # the segments' length feature, log(1 + response tokens) per agent, needs no backbone (in float64 here)
    features["segment_lengths"] = np.log1p([[end - start for start, end in x.response_spans] for x in inputs])
    if set(wanted) & {"last_token", "segments", "segments+overlap"}:
        features.update(backbone_features(responses, job))
        segments = features["segments"]
        features["segments+overlap"] = lambda train: np.concatenate([segments, overlap_of(train)], axis=1)
    if "word_overlap" in wanted:
        tokenizer = load_tokenizer(resolve_model_source(job.agent_model))
        texts = [[tokenizer.decode(ids) for ids in r["prompt_ids"]] for r in responses]
        features["word_overlap"] = word_overlap(responses, texts, job.num_agents)
    return {name: features[name] for name in wanted}


def fit_logistic(x: np.ndarray, pairs: list[tuple[int, int]]) -> np.ndarray:
    """Scores z·w of every response, with w the weights of P(winner ≻ loser) = σ(w·(z_w − z_l)) on standardized
    features z, L2 penalty :data:`L2` (L-BFGS to convergence); the standardization is over the training pairs'
    responses."""
    used = sorted({i for p in pairs for i in p})
    mean, std = x[used].mean(0), x[used].std(0) + 1e-8
    z = torch.tensor((x - mean) / std)
    diff = z[[w for w, _ in pairs]] - z[[lo for _, lo in pairs]]  # (p, f)
    w = torch.zeros(x.shape[1], dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([w], max_iter=500, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = torch.nn.functional.softplus(-(diff @ w)).sum() + 0.5 * L2 * (w * w).sum()
        loss.backward()
        return loss

    opt.step(closure)
    return (z @ w.detach()).numpy()  # every response's score, (n,)


def accuracy(scores: np.ndarray, pairs: list[tuple[int, int]]) -> float:
    """Share of pairs whose winner scores higher, a tie counting 1/2 (a head with no signal, whose weights stay 0,
    scores 0.5, not 0)."""
    if not pairs:
        return math.nan
    return float(
        np.mean([1.0 if scores[w] > scores[lo] else 0.5 if scores[w] == scores[lo] else 0.0 for w, lo in pairs])
    )


def splits(items: list[str], n_train: int, count: int, seed: int) -> list[set[str]]:
    rng = np.random.default_rng(seed)
    return [set(rng.choice(items, size=n_train, replace=False).tolist()) for _ in range(count)]


def table(
    features: dict[str, np.ndarray | Callable[[set[str]], np.ndarray]],
    responses: list[dict],
    pairs: list[tuple[int, int]],
    args: argparse.Namespace,
) -> list[dict[str, Any]]:
    items = sorted({r["item_id"] for r in responses})
    rows = []
    for n in args.train_items:
        for rep, x in features.items():
            accs, n_train, n_held = [], [], []
            for train_items in splits(items, n, args.splits, args.seed):
                train = [p for p in pairs if responses[p[0]]["item_id"] in train_items]
                held = [p for p in pairs if responses[p[0]]["item_id"] not in train_items]
                split_x = x(train_items) if callable(x) else x  # fitted on the split's training items
                accs.append(accuracy(fit_logistic(split_x, train), held))
                n_train.append(len(train))
                n_held.append(len(held))
            rows.append(
                {
                    "representation": rep,
                    "train_items": n,
                    "train_pairs_mean": statistics.fmean(n_train),
                    "heldout_pairs_mean": statistics.fmean(n_held),
                    "heldout_accuracy_mean": round(statistics.fmean(accs), 4),
                    "heldout_accuracy_min": round(min(accs), 4),
                    "heldout_accuracy_max": round(max(accs), 4),
                }
            )
            r = rows[-1]
            print(
                f"  {rep:16s} {n:3d} items ({r['train_pairs_mean']:5.1f} pairs): held-out accuracy "
                f"{r['heldout_accuracy_mean']:.3f} [{r['heldout_accuracy_min']:.2f}, {r['heldout_accuracy_max']:.2f}]"
                f" on {r['heldout_pairs_mean']:.0f} pairs",
                flush=True,
            )
    return rows


def product_fits(
    responses: list[dict], pairs: list[tuple[int, int]], job: JobConfig, args: argparse.Namespace
) -> list[dict[str, Any]]:
    """The product's reward model, fitted as fit-reward-model does, on one split per training size."""
    from stages.fit_reward_model import spec_of

    # The collection ran the demo's MADPO job; the reward model's options are MARLHF's: the same run as marlhf_iter.
    run = {k: v for k, v in job.model_dump().items() if k in JOB_CLASSES["marlhf_iter"].model_fields}
    job = parse_job({**run, "trainer": "marlhf_iter", **args.product_settings})
    spec = spec_of(job)
    inputs = joint_inputs(responses, spec.source, job.num_agents)
    items = sorted({r["item_id"] for r in responses})
    rows = []
    for n in args.train_items:
        train_items = splits(items, n, 1, args.seed)[0]
        train = [(inputs[w], inputs[lo]) for w, lo in pairs if responses[w]["item_id"] in train_items]
        held = [(inputs[w], inputs[lo]) for w, lo in pairs if responses[w]["item_id"] not in train_items]
        model = new_reward_model(spec, seed=args.seed)
        started = time.perf_counter()
        stats = fit_bradley_terry(
            model,
            train,
            epochs=job.reward_num_train_epochs,
            batch_size=job.reward_train_batch_size,
            learning_rate=job.reward_learning_rate,
            seed=args.seed,
            max_grad_norm=job.max_grad_norm,
        )
        seconds = time.perf_counter() - started
        rows.append(
            {
                "settings": dict(args.product_settings),
                "trained": spec.trained,
                "train_items": n,
                "train_pairs": len(train),
                "heldout_pairs": len(held),
                "train_accuracy": statistics.fmean(pair_correct(model, train, 16)),
                "heldout_accuracy": statistics.fmean(pair_correct(model, held, 16)),
                "fit_seconds": round(seconds, 1),
                **stats,
            }
        )
        print(f"  product {rows[-1]}", flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--items", type=int, default=20, help="training problems sampled")
    parser.add_argument("--candidates", type=int, default=5, help="target (and comparator) candidates per item")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="the demo's 48")
    parser.add_argument("--train-items", type=int, nargs="+", default=[2, 4, 8, 12, 16])
    parser.add_argument("--splits", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--from-run", type=Path, help="reuse the run folder of an earlier --keep")
    parser.add_argument("--round", type=int, default=1, help="the collection of this round of --from-run")
    parser.add_argument("--keep", action="store_true")
    parser.add_argument(
        "--reward-terms",
        nargs="+",
        choices=ALL_TERMS,
        help="the preference: the docs reward's parts summed (humaneval_docs' reward_terms), recomputed from the "
        "stored texts; e.g. 'coverage' for a preference about content alone (default: the run's own scores)",
    )
    parser.add_argument(
        "--product",
        action="append",
        default=[],
        metavar="KEY=VALUE[,KEY=VALUE]",
        help="also fit the product's reward model with these job settings (repeatable)",
    )
    parser.add_argument(
        "--representations",
        nargs="+",
        choices=REPRESENTATIONS,
        default=list(REPRESENTATIONS),
        help="the representations compared (default all; without the backbone's, the backbone never runs)",
    )
    parser.add_argument("--tag", default="", help="added to the result's name")
    args = parser.parse_args()
    configure_threads(None)
    started = time.perf_counter()
    run_dir = args.from_run or collect(Path(tempfile.mkdtemp(prefix="pbrl-rm-")), args)
    job = open_job(run_dir)
    responses = joint_responses(run_dir, job, args.round)
    pairs = preference_pairs(responses, job.tie_tolerance)
    items = {x["item_id"]: x for x in read_items(RunPaths(run_dir), "train")}
    if args.reward_terms:  # the same joint responses under another preference: the chosen parts of the docs reward
        for r in responses:
            r["reward"] = docs_score(*r["completions"], items[r["item_id"]], tuple(args.reward_terms))
        pairs = preference_pairs(responses, job.tie_tolerance)
    print(f"[reward-model] {len(responses)} joint responses, {len(pairs)} pairs on {len(items)} items", flush=True)
    rows = table(representations(responses, items, job, args.representations), responses, pairs, args)
    product = []
    for spec in args.product:
        args.product_settings = {k: _value(v) for k, v in (kv.split("=", 1) for kv in spec.split(","))}
        product += product_fits(responses, pairs, job, args)
    winners_shorter = statistics.fmean(
        len(responses[w]["completion_ids"][0]) < len(responses[lo]["completion_ids"][0]) for w, lo in pairs
    )
    tag = "-".join([*(args.reward_terms or []), *([args.tag] if args.tag else [])]) or None
    winners_longer = statistics.fmean(
        len(responses[w]["completion_ids"][1]) > len(responses[lo]["completion_ids"][1]) for w, lo in pairs
    )
    path = write_result(
        "reward-model",
        Path(args.model).name + (f"-{tag}" if tag else ""),
        {
            "reward_terms": args.reward_terms or list(REWARD_TERMS),
            "run": str(run_dir) if args.keep or args.from_run else None,
            "round": args.round,
            "items": len(items),
            "joint_responses": len(responses),
            "pairs": len(pairs),
            "winner_has_shorter_summary": round(winners_shorter, 3),
            "winner_has_longer_explanation": round(winners_longer, 3),
            "table": rows,
            "product": product,
            "peak_rss_mb": peak_rss_mb(),
            "total_s": round(time.perf_counter() - started, 1),
            "method": __doc__.split("\n\n", 1)[1].split("\n\nWrites")[0],
        },
    )
    print(f"result: {path}")
    if not (args.keep or args.from_run):
        import shutil

        shutil.rmtree(Path(run_dir).parent, ignore_errors=True)
    else:
        print(f"run folder: {run_dir}")
    return 0


def _value(text: str) -> Any:
    import yaml

    return yaml.safe_load(text)


if __name__ == "__main__":
    sys.exit(main())
