"""Comparators (docs/design/algorithms.md#comparators): where the comparator side of each iterative comparison comes
from.

Every comparator has one interface, :class:`Comparator`: given a :class:`ComparatorRequest` (the round,
items, each agent's prompts and prompt ids in the *target* tokenizer) it returns :class:`CandidateRow`
records whose completion ids are in each target agent's vocabulary (MADPO scores comparator completions
with the target policy), the text, where the ids came from (``ids_source``: ``generated`` when the ids are
the sampled ones, ``encoded_from_text`` when text entered from a model with another tokenizer, an API or a
centralized response) and a finish reason. The stage builds one with
:func:`pbrl.generation.comparator_factory.build_comparator`
and never looks at its kind.

Kinds (``comparator_policy``): ``current`` (live weights, own seed stream), ``current_copy`` (a frozen copy
on ``comparator_devices``), ``history`` (C_max(0, r-1-k)) sample a policy checkpoint of this run: they name
it as ``checkpoint_side`` and the stage samples it together with the target side (one model load and one
batched generate when checkpoint and devices agree), so their rows are the ones sampled before this module
existed. ``model`` loads explicit models with their own tokenizers and chat templates; ``api`` asks a remote
model (:mod:`pbrl.generation.api_client`). With ``comparator_generation_mode='centralized'`` one comparator
(index ``centralized_index``) writes every role in one response, split by an adapter
(:mod:`pbrl.generation.centralized`);
an unparsable response drops that candidate and is counted.

Text entry: text-only sources are tokenized once, by :func:`encode_entry`, with the target agent's
tokenizer; those ids are stored and every later stage reads them (never encoded again).
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

from pbrl.data.schema import CandidateRow
from pbrl.data.seeds import derive_seed
from pbrl.data.storage import read_json, write_json
from pbrl.generation.api_client import fetch_answers
from pbrl.generation.api_formats import ApiAnswer, ApiRequest, ApiSettings
from pbrl.generation.centralized import CentralizedAdapter, split_roles
from pbrl.generation.sampling import Generation, SamplingSettings, encode_prompt, generate

Devices = str | list[str] | None  # one device, one per agent, or None (resolved by pbrl.models.loading.resolve_devices)
IdsSource = Literal["generated", "encoded_from_text"]
STAGE = "sample-candidates"  # the seed-stream stage name (the stage that calls comparators)

# Calls of encode_entry in this process, by target tokenizer name: proof that stored text is encoded once.
ENTRY_ENCODINGS: Counter[str] = Counter()


@dataclass(frozen=True)
class SamplingSide:
    """One side of a round's collection: who samples (a checkpoint), on which seed stream, how many."""

    side: str  # "target" | "comparator"; also the seed-stream name
    checkpoint: Path
    num_candidates: int
    devices: Devices


@dataclass(frozen=True)
class ComparatorRequest:
    """What every comparator is given; all lists indexed ``[agent][item]`` where nested.

    Attributes:
        round_index: the round (1-based).
        seed: the run seed (seeds derive from it with ``side="comparator"``).
        items: the train items, each with its ``item_id``.
        prompts: each agent's prompt text per item.
        prompt_ids: each agent's prompt ids per item, in the target agent's tokenizer (what is stored).
        target_tokenizers: each target agent's tokenizer (text entry encodes with it).
        sampling: sampling settings (API comparators send them).
        shared_rows: rows the stage sampled for ``checkpoint_side`` (empty when the comparator has none).
    """

    round_index: int
    seed: int
    items: Sequence[Mapping[str, Any]]
    prompts: Sequence[Sequence[str]]
    prompt_ids: Sequence[Sequence[list[int]]]
    target_tokenizers: Sequence[Any]
    sampling: SamplingSettings
    shared_rows: Sequence[CandidateRow] = ()


@dataclass
class ComparatorOutput:
    """The comparator rows and counters a stage records (e.g. ``centralized_parse_failures``)."""

    rows: list[CandidateRow]
    counts: dict[str, int] = field(default_factory=dict)


class Comparator(Protocol):
    """``checkpoint_side``: a checkpoint the stage samples with the target side (None: the comparator samples
    itself); ``inputs``: run files its rows depend on (they key the stage cache); ``candidates`` returns the
    comparator rows for the request."""

    checkpoint_side: SamplingSide | None
    inputs: tuple[Path, ...]

    def candidates(self, request: ComparatorRequest) -> ComparatorOutput: ...


@dataclass(frozen=True)
class ComparatorSettings:
    """What a comparator needs from the job, as plain values.

    Attributes:
        policy: the ``comparator_policy`` name (a key of :data:`COMPARATORS`).
        num_candidates: comparator candidates per item (``comparator_num_candidates``, else
            ``preference_num_candidates``), ≥ 1.
        history_k: with ``history``, how many updates older the compared policy is (≥ 1).
        agent_devices: where the live agents run.
        comparator_devices: where a separate comparator copy runs; None = ``agent_devices``.
        model_sources: with ``model``: one comparator model source per agent.
        dtype: dtype of comparator models.
        api: with ``api``: the API settings.
        centralized_adapter: with centralized generation: the adapter; None = decentralized.
        centralized_index: which comparator writes the joint response.
        store_dir: where API answers are kept as they arrive (a rerun asks only for the missing ones).
        checkpoint: with ``current``, ``current_copy`` and ``history``: the compared policy's checkpoint folder,
            the policy after round :func:`~pbrl.generation.comparator_factory.compared_round` (resolved by the
            caller, :func:`pbrl.run.policy_records.policy_checkpoint`).
    """

    policy: str
    num_candidates: int
    history_k: int
    agent_devices: Devices
    comparator_devices: Devices
    model_sources: tuple[str, ...] = ()
    dtype: str = "float32"
    api: ApiSettings | None = None
    centralized_adapter: CentralizedAdapter | None = None
    centralized_index: int = 0
    store_dir: Path | None = None
    checkpoint: Path | None = None

    @property
    def copy_devices(self) -> Devices:
        """Devices of a separately loaded comparator: ``comparator_devices``, else ``agent_devices``."""
        return self.comparator_devices if self.comparator_devices is not None else self.agent_devices


def target_side(checkpoint: Path, num_candidates: int, devices: Devices) -> SamplingSide:
    """The current agents: ``checkpoint`` holds the policy after the previous round (the stage resolves it,
    :func:`pbrl.run.policy_records.policy_checkpoint`)."""
    return SamplingSide("target", checkpoint, num_candidates, devices)


# ------------------------------------------------------------------------------------------- text entry
def same_tokenizer(a: Any, b: Any) -> bool:
    """Whether ids of ``a`` mean the same tokens in ``b`` (same vocabulary and EOS)."""
    return a is b or (a.get_vocab() == b.get_vocab() and a.eos_token_id == b.eos_token_id)


def encode_entry(tokenizer: Any, text: str, *, finished: bool) -> tuple[list[int], int | None]:
    """Token ids of text entering a run (docs/design/file-formats.md#conventions): the one function that tokenizes
    completion text, called
    once per row at entry. No special tokens are added to the text; ``finished`` (the source ended the answer
    itself) appends the target's EOS, as a generated completion that stopped holds its stop id.

    Returns:
        (ids, stop_token_id): the stop id is the appended EOS, None when not finished (or the tokenizer has
        no EOS).
    """
    ENTRY_ENCODINGS[getattr(tokenizer, "name_or_path", "")] += 1
    ids = list(tokenizer(text, add_special_tokens=False).input_ids)
    eos = tokenizer.eos_token_id
    if not finished or eos is None:
        return ids, None
    return ids + [int(eos)], int(eos)


def _text_row(
    request: ComparatorRequest, agent: int, i: int, k: int, text: str, finish: str, seed: int | None
) -> CandidateRow:
    ids, stop = encode_entry(request.target_tokenizers[agent], text, finished=finish != "length")
    return CandidateRow(
        str(request.items[i]["item_id"]),
        "comparator",
        k,
        agent,
        request.prompts[agent][i],
        list(request.prompt_ids[agent][i]),
        text,
        ids,
        finish,
        stop,
        seed,
        "encoded_from_text",
    )


def _seed(request: ComparatorRequest, agent: int, i: int, k: int) -> int:
    return derive_seed(
        request.seed,
        round_index=request.round_index,
        stage=STAGE,
        side="comparator",
        agent=agent,
        item=request.items[i]["item_id"],
        index=k,
    )


def _centralized_prompts(adapter: CentralizedAdapter, request: ComparatorRequest) -> list[str]:
    num_agents = len(request.prompts)
    return [
        adapter.build_prompt(item, [request.prompts[a][i] for a in range(num_agents)])
        for i, item in enumerate(request.items)
    ]


def _split(
    adapter: CentralizedAdapter,
    request: ComparatorRequest,
    joint: Mapping[tuple[int, int], str],
    seeds: Mapping[tuple[int, int], int | None],
) -> ComparatorOutput:
    """Rows of every parsable joint response ``joint[(item, k)]``; unparsable ones dropped and counted."""
    num_agents = len(request.prompts)
    out = ComparatorOutput([], {"centralized_parse_failures": 0})
    for (i, k), text in sorted(joint.items()):
        roles = split_roles(adapter, text, num_agents)
        if roles is None:
            out.counts["centralized_parse_failures"] += 1
            continue
        # A parsed section was closed by its tag: the role's answer is finished.
        out.rows += [_text_row(request, a, i, k, roles[a], "eos", seeds[(i, k)]) for a in range(num_agents)]
    return out


# -------------------------------------------------------------------------------------- the comparators
@dataclass
class CheckpointComparator:
    """current / current_copy / history: the stage samples ``checkpoint_side`` with the target side."""

    checkpoint_side: SamplingSide | None

    @property
    def inputs(self) -> tuple[Path, ...]:
        return (self.checkpoint_side.checkpoint,) if self.checkpoint_side is not None else ()

    def candidates(self, request: ComparatorRequest) -> ComparatorOutput:
        return ComparatorOutput(list(request.shared_rows))


LoadedModel = tuple[Any, Any]  # (model, tokenizer)


@dataclass
class LocalModelComparator:
    """Samples local models with their own tokenizers and chat templates (``model``; and checkpoint kinds in
    centralized generation). ``load(agent)`` gives agent ``agent``'s comparator (model, tokenizer)."""

    load: Callable[[int], LoadedModel]
    num_candidates: int
    adapter: CentralizedAdapter | None = None
    centralized_index: int = 0
    inputs: tuple[Path, ...] = ()
    checkpoint_side: SamplingSide | None = None

    def _sample(
        self, agent: int, request: ComparatorRequest, prompts: Sequence[str], seed_agent: int
    ) -> tuple[Any, dict[tuple[int, int], Generation]]:
        model, tokenizer = self.load(agent)
        prompt_ids = [encode_prompt(tokenizer, p) for p in prompts]
        rows = [(i, k) for i in range(len(request.items)) for k in range(self.num_candidates)]
        names = [f"comparator of agent {agent}, item {request.items[i]['item_id']!r}, candidate {k}" for i, k in rows]
        gens = generate(
            model,
            tokenizer,
            [prompt_ids[i] for i, _ in rows],
            [_seed(request, seed_agent, i, k) for i, k in rows],
            request.sampling,
            row_names=names,
        )
        del model
        return tokenizer, dict(zip(rows, gens, strict=True))

    def candidates(self, request: ComparatorRequest) -> ComparatorOutput:
        if self.adapter is not None:
            c = self.centralized_index
            _, gens = self._sample(c, request, _centralized_prompts(self.adapter, request), c)
            return _split(
                self.adapter,
                request,
                {key: g.text for key, g in gens.items()},
                {key: g.seed for key, g in gens.items()},
            )
        out = ComparatorOutput([])
        for agent in range(len(request.prompts)):
            tokenizer, gens = self._sample(agent, request, request.prompts[agent], agent)
            keep_ids = same_tokenizer(tokenizer, request.target_tokenizers[agent])
            for (i, k), g in gens.items():
                if keep_ids:
                    out.rows.append(
                        CandidateRow(
                            str(request.items[i]["item_id"]),
                            "comparator",
                            k,
                            agent,
                            request.prompts[agent][i],
                            list(request.prompt_ids[agent][i]),
                            g.text,
                            g.completion_ids,
                            g.finish_reason,
                            g.stop_token_id,
                            g.seed,
                            "generated",
                        )
                    )
                else:
                    out.rows.append(_text_row(request, agent, i, k, g.text, g.finish_reason, g.seed))
        return out


@dataclass
class ApiComparator:
    """A remote model (``api``): one request set per (agent, item) — or per item when centralized — with
    answers stored in ``store_dir`` as they arrive, so a rerun requests only the missing ones."""

    settings: ApiSettings
    num_candidates: int
    store_dir: Path
    adapter: CentralizedAdapter | None = None
    centralized_index: int = 0
    inputs: tuple[Path, ...] = ()
    checkpoint_side: SamplingSide | None = None

    def _store_path(self, request: ApiRequest, sampling: SamplingSettings) -> Path:
        # Everything that changes the answers keys the file (never the key, which is not in these settings).
        s = self.settings
        fingerprint = json.dumps(
            {
                "format": s.api_format,
                "url": s.url,
                "model": s.model,
                "extra_body": dict(s.extra_body),
                "response_field": s.response_field,
                "sampling": asdict(sampling),
                "prompt": request.prompt,
                "agent": request.agent_index,
                "item": request.name,
                "n": request.num_candidates,
            },
            sort_keys=True,
            default=str,
        )
        return self.store_dir / f"{hashlib.sha256(fingerprint.encode()).hexdigest()[:24]}.json"

    def _answers(self, requests: list[ApiRequest], request: ComparatorRequest) -> list[list[ApiAnswer]]:
        stored: dict[int, list[ApiAnswer]] = {}
        for n, r in enumerate(requests):
            path = self._store_path(r, request.sampling)
            if path.is_file():
                stored[n] = [ApiAnswer(**a) for a in read_json(path)["answers"]]
        missing = [r for n, r in enumerate(requests) if n not in stored]

        def keep(r: ApiRequest, answers: list[ApiAnswer]) -> None:
            write_json(self._store_path(r, request.sampling), {"answers": [asdict(a) for a in answers]})

        fetched = iter(fetch_answers(missing, self.settings, request.sampling, on_answers=keep))
        return [stored[n] if n in stored else next(fetched) for n in range(len(requests))]

    def candidates(self, request: ComparatorRequest) -> ComparatorOutput:
        items = request.items
        if self.adapter is not None:
            c = self.centralized_index
            prompts = _centralized_prompts(self.adapter, request)
            asks = [
                ApiRequest(f"centralized, item {item['item_id']!r}", prompts[i], c, item, self.num_candidates)
                for i, item in enumerate(items)
            ]
            answers = self._answers(asks, request)
            joint = {(i, k): a.text for i in range(len(items)) for k, a in enumerate(answers[i])}
            return _split(self.adapter, request, joint, dict.fromkeys(joint))
        keys = [(agent, i) for agent in range(len(request.prompts)) for i in range(len(items))]
        asks = [
            ApiRequest(
                f"agent {agent}, item {items[i]['item_id']!r}",
                request.prompts[agent][i],
                agent,
                items[i],
                self.num_candidates,
            )
            for agent, i in keys
        ]
        out = ComparatorOutput([])
        for (agent, i), answers in zip(keys, self._answers(asks, request), strict=True):
            out.rows += [_text_row(request, agent, i, k, a.text, a.finish_reason, None) for k, a in enumerate(answers)]
        return out
