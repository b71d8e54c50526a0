"""Centralized collaboration (``collaboration_mode: centralized``,
docs/design/algorithms.md#centralized-collaboration): one actor writes every role in one
joint response; the adapter splits it for the reward; MADPO learns from the joint completion as one sequence of the
one policy; the run folder holds one policy, ``agent_0``."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import pytest
import torch

from pbrl.config import JOB_CLASSES, ConfigNotice, actor_job, num_actors, parse_job
from pbrl.data.schema import CANDIDATES, PAIRS, SCORES
from pbrl.data.storage import RunPaths
from pbrl.data.tables import read_rows, write_table
from pbrl.errors import ConfigError
from pbrl.generation.centralized import EqualSharesAdapter, TaggedAdapter
from pbrl.generation.collaboration import ROLES, actor_prompts, roles_path, score_joint
from pbrl.preference.oracle import Oracle
from pbrl.run.settings import centralized_adapter
from pbrl.tasks.registry import get_task
from stages import STAGE_MODULES
from tests.helpers import new_run, tiny_job

MINIMAL = {"trainer": "madpo_iter", "task": "toy", "agent_model": "m"}
TOY_PROMPTS = ["Agent 1: say something short about {t}.", "Agent 2: say something short about {t}."]


class EmptyRoleAdapter(EqualSharesAdapter):
    """Parses anything, leaving role 2 empty."""

    def parse_completion(self, completion: str, num_agents: int) -> list[str]:
        return [completion] + [""] * (num_agents - 1)


def problems_of(**fields) -> list[tuple[str, str]]:
    with pytest.raises(ConfigError) as info:
        parse_job({**MINIMAL, **fields})
    return [(p.field, str(p)) for p in info.value.problems]


# ------------------------------------------------------------------------------------------------ config
def test_the_default_is_decentralized_and_centralized_takes_one_actor_for_every_role():
    assert parse_job(MINIMAL).collaboration_mode == "decentralized"
    job = parse_job(
        {**MINIMAL, "collaboration_mode": "centralized", "num_agents": 3, "task_options": {"num_agents": 3}}
    )
    assert (job.num_agents, num_actors(job), job.comparator_generation_mode) == (3, 1, "centralized")
    assert actor_job(job).num_agents == 1 and actor_job(job).collaboration_mode == "centralized"
    base = parse_job({**MINIMAL, "trainer": "madpo", "collaboration_mode": "centralized"})
    assert num_actors(base) == 1


def test_a_given_decentralized_comparator_generation_is_replaced_with_a_notice_as_in_the_reference():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        job = parse_job({**MINIMAL, "collaboration_mode": "centralized", "comparator_generation_mode": "decentralized"})
    assert job.comparator_generation_mode == "centralized"
    notes = [str(w.message) for w in caught if issubclass(w.category, ConfigNotice)]
    assert any("comparator_generation_mode='decentralized' is replaced by 'centralized'" in n for n in notes)


@pytest.mark.parametrize(
    ("fields", "field", "says"),
    [
        ({"collaboration_mode": "Centralized"}, "collaboration_mode", "allowed: decentralized, centralized"),
        ({"collaboration_mode": "centralised"}, "collaboration_mode", "allowed: decentralized, centralized"),
        ({"trainer": "marlhf_iter"}, "collaboration_mode", "not available with trainer 'marlhf' or 'marlhf_iter'"),
        ({"trainer": "marlhf"}, "collaboration_mode", "not available with trainer 'marlhf' or 'marlhf_iter'"),
        ({"comparator_centralized_agent_index": 1}, "comparator_centralized_agent_index", "must be 0"),
        ({"agents": ["a", "b"]}, "agents", "exactly one model"),
        ({"agent_devices": ["cpu", "cpu"]}, "agent_devices", "must list 1 device"),
        ({"comparator_policy": "model", "comparator_agents": ["a", "b"]}, "comparator_agents", "exactly one model"),
        (
            {"comparator_policy": "current_copy", "comparator_devices": ["cpu", "cpu"]},
            "comparator_devices",
            "must list 1 device",
        ),
    ],
)
def test_centralized_config_errors_name_the_field_and_the_fix(fields, field, says):
    data = {**MINIMAL, "collaboration_mode": "centralized", **fields}
    if "agents" in fields:
        del data["agent_model"]
    with pytest.raises(ConfigError) as info:
        parse_job(data)
    found = [(p.field, str(p)) for p in info.value.problems]
    assert len(found) == 1 and found[0][0] == field and says in found[0][1], found
    if fields.get("trainer", "").startswith("marlhf"):  # the message names both fields
        assert "trainer" in found[0][1] and "collaboration_mode" in found[0][1]


def test_one_actor_model_is_fine_centralized_and_refused_for_two_decentralized_agents():
    job = parse_job({"trainer": "madpo", "task": "toy", "collaboration_mode": "centralized", "agents": ["m"]})
    assert job.agents == ["m"] and num_actors(job) == 1
    with pytest.raises(ConfigError, match=r"agents: got \['m'\]; must name one model per agent \(num_agents=2\)"):
        parse_job({"trainer": "madpo", "task": "toy", "agents": ["m"]})


def test_preflight_names_an_adapter_that_does_not_import_for_a_base_trainer_too(tiny_model_dir, tmp_path):
    from pbrl.run.preflight import preflight

    job = tiny_job(
        tiny_model_dir,
        tmp_path,
        collaboration_mode="centralized",
        comparator_centralized_adapter="tests.unit.generation.test_collaboration:Missing",
    )
    data = {**job.model_dump(mode="json"), "trainer": "madpo", "pair_selection": "reward_gap"}
    base = parse_job({k: v for k, v in data.items() if k in JOB_CLASSES["madpo"].model_fields})
    for each in (job, base):
        with pytest.raises(ConfigError) as info:
            preflight(each)
        assert [p.field for p in info.value.problems] == ["comparator_centralized_adapter"]


# ------------------------------------------------------------------------------------------ prompts, reward
def test_the_actor_prompt_is_the_tagged_prompt_of_every_role_prompt():
    job = parse_job({**MINIMAL, "collaboration_mode": "centralized"})
    task = get_task("toy", num_items=2)
    (prompts,) = actor_prompts(task, list(task.train_items), centralized_adapter(job))
    role = [p.format(t="apples") for p in TOY_PROMPTS]
    assert prompts[0] == (
        "You are a centralized coordinator writing the separate outputs of 2 agents that work together on one "
        "task. Each agent's original prompt follows.\n\n"
        f"Agent 0 original prompt:\n{role[0]}\n\nAgent 1 original prompt:\n{role[1]}\n\n"
        "Write every agent's output, each inside its own tags, in this form and nothing else:\n"
        "<agent_0>agent 0's output</agent_0>\n<agent_1>agent 1's output</agent_1>"
    )
    decentralized = actor_prompts(task, list(task.train_items), centralized_adapter(parse_job(MINIMAL)))
    assert decentralized == [[TOY_PROMPTS[a].format(t=t) for t in ("apples", "rivers")] for a in range(2)]


def test_the_reward_sees_the_role_texts_and_role_prompts_and_a_missing_section_is_a_counted_failure():
    seen = {}

    def reward(a, b, prompts=None, batch_items=None):
        seen.update(a=a, b=b, prompts=prompts, items=[i["item_id"] for i in batch_items])
        return [len(x) + 10 * len(y) for x, y in zip(a, b, strict=True)]

    task = get_task("toy", num_items=2)
    task = type(task)(name="t", formatters=task.formatters, reward_func=reward)
    items = list(get_task("toy", num_items=2).train_items)
    texts = [
        "<agent_1>abc</agent_1> <agent_2>abcdef</agent_2>",
        "<agent_1>only one</agent_1>",
        "<agent_2>xy</agent_2><agent_1> z </agent_1>",
    ]
    oracle = Oracle(task.reward_func)  # in this process (no reward_timeout), so that `seen` is filled here
    scores, parsed = score_joint(TaggedAdapter(), task, texts, [items[0], items[1], items[1]], oracle)
    assert [s.raw for s in scores] == [3 + 60, None, 1 + 20]
    assert scores[1].failure == (
        "centralized_parse: missing or empty section(s) <agent_0> (numbered from 1: <agent_2>)"
    )
    assert [p.roles for p in parsed] == [["abc", "abcdef"], None, ["z", "xy"]]
    # one batched call over the parsed responses, with each one's role prompts and item
    assert seen == {
        "a": ["abc", "z"],
        "b": ["abcdef", "xy"],
        "items": ["toy-000", "toy-001"],
        "prompts": [[p.format(t=t) for p in TOY_PROMPTS] for t in ("apples", "rivers")],
    }
    empty, parsed = score_joint(EmptyRoleAdapter(), task, ["anything"], [items[0]], oracle)
    assert empty[0].failure == "centralized_parse: empty role(s) 2" and parsed[0].roles is None


# ------------------------------------------------------------------------------- through the stages, by hand
ROLE_TEXTS = {  # (item, candidate) -> (role 1, role 2); toy reward: 0.8 * closeness(L2, 2 L1) + 0.2 * variety
    ("toy-000", 0): ("ab", "abcd"),
    ("toy-000", 1): ("ab", "abcdefgh"),
    ("toy-000", 2): ("abcd", "ab"),
    ("toy-001", 0): ("xyz", "xyzxyz"),
    ("toy-001", 1): ("x", "xyzxyzxyz"),
    ("toy-001", 2): ("xy", "xy"),
}
PROMPT_IDS = [[5, 6, 7], [8, 9]]


def _ids(text: str) -> list[int]:
    return [10 + ord(c) % 200 for c in text] + [3]  # any in-vocabulary ids: no model reads them here


def write_candidates(run_dir: Path, *, centralized: bool, broken: frozenset = frozenset()) -> None:
    rows = []
    for (item, k), roles in ROLE_TEXTS.items():
        base = {
            "item_id": item,
            "side": "target",
            "candidate_index": k,
            "finish_reason": "eos",
            "stop_token_id": 3,
            "seed": k,
            "ids_source": "generated",
        }
        if centralized:
            second = "" if (item, k) in broken else f"<agent_2>{roles[1]}</agent_2>"
            joint = f"<agent_1>{roles[0]}</agent_1>\n{second}"
            rows.append(
                {
                    **base,
                    "agent_index": 0,
                    "prompt": "joint prompt",
                    "prompt_ids": PROMPT_IDS[0] + PROMPT_IDS[1],
                    "completion": joint,
                    "completion_ids": _ids(joint),
                }
            )
        else:
            rows += [
                {
                    **base,
                    "agent_index": a,
                    "prompt": f"prompt {a}",
                    "prompt_ids": PROMPT_IDS[a],
                    "completion": roles[a],
                    "completion_ids": _ids(roles[a]),
                }
                for a in range(2)
            ]
    write_table(RunPaths(run_dir).candidates(1), rows, CANDIDATES)


def by_hand_run(tiny_model_dir, out: Path, *, centralized: bool, broken: frozenset = frozenset(), **fields):
    from pbrl.run.folder import prepare_run

    extra = {"collaboration_mode": "centralized"} if centralized else {}
    data = {
        **tiny_job(tiny_model_dir, out).model_dump(mode="json"),
        "trainer": "madpo",
        "task_options": {"num_items": 2},
        "preference_num_candidates": 3,
        "preference_pairs_per_sample": None,
        "pair_selection": "all",
        **extra,
        **fields,
    }
    job = parse_job({k: v for k, v in data.items() if k in JOB_CLASSES["madpo"].model_fields})
    run_dir = prepare_run(job, resume=False)
    write_candidates(run_dir, centralized=centralized, broken=broken)
    manifests = {name: STAGE_MODULES[name].run(run_dir, 1, job) for name in ("score-with-oracle", "build-pairs")}
    return run_dir, job, manifests


def test_well_formed_joint_responses_give_the_pairs_of_the_equivalent_decentralized_rows(tiny_model_dir, tmp_path):
    cen, _, _ = by_hand_run(tiny_model_dir, tmp_path / "c", centralized=True)
    dec, _, _ = by_hand_run(tiny_model_dir, tmp_path / "d", centralized=False)
    same = (
        "item_id",
        "winner_side",
        "winner_index",
        "loser_side",
        "loser_index",
        "winner_reward",
        "loser_reward",
        "winner_raw_reward",
        "loser_raw_reward",
        "candidate_reward_mean",
    )
    pairs = {name: read_rows(RunPaths(d).pairs(1), PAIRS) for name, d in (("c", cen), ("d", dec))}
    assert len(pairs["c"]) == 2 * 3 and [{k: p[k] for k in same} for p in pairs["c"]] == [
        {k: p[k] for k in same} for p in pairs["d"]
    ]
    assert read_rows(RunPaths(cen).scores(1), SCORES) == read_rows(RunPaths(dec).scores(1), SCORES)
    # toy-000 #1: roles "ab", "abcdefgh": 0.8 * closeness(8, 4) + 0.2 * 8/20 = 0.4 + 0.08
    score = {(s["item_id"], s["candidate_index"]): s["raw_reward"] for s in read_rows(RunPaths(cen).scores(1), SCORES)}
    assert score[("toy-000", 1)] == pytest.approx(0.48)
    # the centralized pair holds the one actor's joint text and its ids exactly as stored
    top = pairs["c"][0]
    winner = ROLE_TEXTS[(top["item_id"], top["winner_index"])]
    joint = f"<agent_1>{winner[0]}</agent_1>\n<agent_2>{winner[1]}</agent_2>"
    assert top["winner_completions"] == [joint] and top["winner_ids"] == [_ids(joint)]
    assert top["prompt_ids"] == [[5, 6, 7, 8, 9]]
    roles = read_rows(roles_path(RunPaths(cen).round_dir(1)), ROLES)
    assert roles[1] == {
        "item_id": "toy-000",
        "side": "target",
        "candidate_index": 1,
        "roles": ["ab", "abcdefgh"],
        "failure": None,
    }


def test_a_joint_response_missing_a_section_is_dropped_and_counted_and_never_stops_the_round(tiny_model_dir, tmp_path):
    # 4 of 6 broken: more than oracle_max_failure_share=0.5, which would stop the round for reward failures
    broken = frozenset({("toy-000", 0), ("toy-000", 1), ("toy-001", 0), ("toy-001", 2)})
    run_dir, _, manifests = by_hand_run(tiny_model_dir, tmp_path, centralized=True, broken=broken)
    scored = manifests["score-with-oracle"]
    assert scored.counts["centralized_parse_failures"] == 4 and scored.counts["failed"] == 0
    assert scored.details["failure_reasons"] == {"centralized_parse": 4}
    assert "4 joint response(s) dropped: centralized_parse" in scored.messages
    scores = read_rows(RunPaths(run_dir).scores(1), SCORES)
    failures = {(s["item_id"], s["candidate_index"]): s["failure"] for s in scores}
    assert {k for k, f in failures.items() if f} == broken
    assert (
        failures[("toy-000", 0)]
        == "centralized_parse: missing or empty section(s) <agent_0> (numbered from 1: <agent_2>)"
    )
    # one scored candidate is left per item (toy-000 #2, toy-001 #1): no pair, and the round went on
    assert read_rows(RunPaths(run_dir).pairs(1), PAIRS) == [] and manifests["build-pairs"].counts["pairs"] == 0


def test_madpo_learns_from_the_joint_completion_as_one_sequence_of_agent_0(tiny_model_dir, tmp_path):
    """The loss of a one-pair step is −log σ(β Δ), Δ = the joint completions' log-prob margin under the one actor,
    every completion token scored (EOS included); checkpoints hold agent_0 only."""
    from transformers import AutoModelForCausalLM

    run_dir, job, _ = by_hand_run(
        tiny_model_dir, tmp_path, centralized=True, train_batch_size=1, num_train_epochs=1, dpo_beta=0.5
    )
    # keep one pair: the replay of a base trainer takes the round's pairs, so write that round with one pair
    paths = RunPaths(run_dir)
    (pair,) = read_rows(paths.pairs(1), PAIRS)[:1]
    write_table(paths.pairs(1), [pair], PAIRS)
    manifests = {
        name: STAGE_MODULES[name].run(run_dir, 1, job) for name in ("store-round", "replay-select", "update-policies")
    }
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()

    def logprob(prompt: list[int], completion: list[int]) -> float:
        ids = torch.tensor([prompt + completion])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0].double(), dim=-1)
        return sum(float(logp[len(prompt) - 1 + t, tok]) for t, tok in enumerate(completion))

    (prompt,) = pair["prompt_ids"]
    delta = logprob(prompt, pair["winner_ids"][0]) - logprob(prompt, pair["loser_ids"][0])
    update = manifests["update-policies"]
    assert update.metrics["madpo/loss"] == pytest.approx(math.log1p(math.exp(-0.5 * delta)), rel=1e-4)
    assert update.metrics["madpo/margin_agent_0"] == pytest.approx(delta, rel=1e-4)
    assert "madpo/margin_agent_1" not in update.metrics
    assert sorted(p.name for p in paths.round_checkpoint(1).glob("agent_*")) == ["agent_0"]
    assert sorted(p.name for p in paths.initial.glob("agent_*")) == ["agent_0"]


# --------------------------------------------------------------------------------- sampling and evaluation
def test_one_actor_samples_joint_responses_and_its_comparator_too(tiny_model_dir, tmp_path):
    run_dir, job = new_run(
        tiny_model_dir,
        tmp_path,
        collaboration_mode="centralized",
        comparator_centralized_adapter="pbrl.generation.centralized:EqualSharesAdapter",
    )
    manifests = {name: STAGE_MODULES[name].run(run_dir, 1, job) for name in ("sample-candidates", "score-with-oracle")}
    rows = read_rows(RunPaths(run_dir).candidates(1), CANDIDATES)
    assert {r["agent_index"] for r in rows} == {0} and len(rows) == 4 * 3 * 2  # items x candidates x sides
    assert all(r["prompt"].startswith("You are a centralized coordinator") for r in rows)
    assert {r["ids_source"] for r in rows} == {"generated"}
    assert manifests["sample-candidates"].details["sides"]["comparator"] == "checkpoints/initial"
    roles = read_rows(roles_path(RunPaths(run_dir).round_dir(1)), ROLES)
    by_key = {(r["item_id"], r["side"], r["candidate_index"]): r for r in roles}
    for r in rows:
        parsed = by_key[(r["item_id"], r["side"], r["candidate_index"])]
        if parsed["roles"] is not None:
            assert "".join(parsed["roles"]) == r["completion"].strip()


def test_a_centralized_run_exports_its_one_actor_at_start_with_policy_checkpoint_dir(tiny_model_dir, tmp_path):
    # Failing input: prepare_run exported num_agents (= roles) policies and stopped at a missing initial/agent_1.
    export = tmp_path / "exports"
    new_run(tiny_model_dir, tmp_path, collaboration_mode="centralized", policy_checkpoint_dir=str(export))
    exported = sorted(p.relative_to(export).as_posix() for p in export.rglob("agent_*") if p.is_dir())
    assert exported and all(name.endswith("agent_0") for name in exported), exported


@pytest.mark.parametrize("policy", ["history", "current_copy", "model"])
def test_every_local_comparator_kind_is_one_actor_on_the_joint_prompt(tiny_model_dir, tmp_path, policy):
    fields = {"comparator_model_name": str(tiny_model_dir)} if policy == "model" else {}
    run_dir, job = new_run(
        tiny_model_dir,
        tmp_path,
        collaboration_mode="centralized",
        comparator_policy=policy,
        preference_num_candidates=2,
        **fields,
    )
    STAGE_MODULES["sample-candidates"].run(run_dir, 1, job)
    rows = read_rows(RunPaths(run_dir).candidates(1), CANDIDATES)
    comparator = [r for r in rows if r["side"] == "comparator"]
    assert len(comparator) == 4 * 2 and {r["agent_index"] for r in comparator} == {0}
    target = {(r["item_id"], r["candidate_index"]): r["prompt"] for r in rows if r["side"] == "target"}
    assert all(r["prompt"] == target[(r["item_id"], r["candidate_index"])] for r in comparator)
    assert all(r["prompt"].startswith("You are a centralized coordinator") for r in comparator)


def test_an_api_comparator_answers_the_joint_prompt_once_per_item_and_its_text_is_kept_whole(
    tiny_model_dir, tmp_path, monkeypatch
):
    from tests.unit.generation.test_comparators_api import KEY_ENV, LoopbackServer, api_job_fields

    monkeypatch.setenv(KEY_ENV, "sk-collaboration-test")

    def write(fmt: str, body: dict, n: int) -> list[str]:
        return [f"<agent_1>one {k}</agent_1><agent_2>two {k}</agent_2>" for k in range(n)]

    with LoopbackServer("generic", write) as server:
        run_dir, job = new_run(
            tiny_model_dir, tmp_path, collaboration_mode="centralized", **api_job_fields(server.url, fmt="generic")
        )
        for name in ("sample-candidates", "score-with-oracle"):
            STAGE_MODULES[name].run(run_dir, 1, job)
    assert len(server.records) == 4 and {r.body["agent_index"] for r in server.records} == {0}
    assert all(r.body["prompt"].startswith("You are a centralized coordinator") for r in server.records)
    comparator = [r for r in read_rows(RunPaths(run_dir).candidates(1), CANDIDATES) if r["side"] == "comparator"]
    assert [r["completion"] for r in comparator[:2]] == [
        "<agent_1>one 0</agent_1><agent_2>two 0</agent_2>",
        "<agent_1>one 1</agent_1><agent_2>two 1</agent_2>",
    ]
    assert {r["ids_source"] for r in comparator} == {"encoded_from_text"}
    roles = {
        (r["item_id"], r["candidate_index"]): r["roles"]
        for r in read_rows(roles_path(RunPaths(run_dir).round_dir(1)), ROLES)
        if r["side"] == "comparator"
    }
    assert roles[("toy-000", 1)] == ["one 1", "two 1"]


def test_evaluation_splits_each_joint_draw_into_roles(tiny_model_dir, tmp_path):
    from pbrl.data.schema import EVAL

    run_dir, job = new_run(tiny_model_dir, tmp_path, collaboration_mode="centralized")  # tagged: never parses
    manifest = STAGE_MODULES["evaluate"].run(run_dir, 0, job)
    rows = read_rows(RunPaths(run_dir).eval(0), EVAL)
    assert len(rows) == 2 and all(len(r["completions"]) == len(r["completion_ids"]) == 1 for r in rows)
    assert all(r["failure"].startswith("centralized_parse: missing") for r in rows)
    assert manifest.counts["failed"] == 2
    eval_roles = read_rows(roles_path(RunPaths(run_dir).round_dir(0), eval_draws=True), ROLES)
    assert [(r["item_id"], r["side"], r["candidate_index"], r["roles"]) for r in eval_roles] == [
        ("toy-000", "eval", 0, None),
        ("toy-001", "eval", 0, None),
    ]


# --------------------------------------------------------------------------------------------- the config
TINY = Path(__file__).resolve().parents[3] / "flows" / "configs" / "tiny-centralized.yaml"
ROUND_STAGES = (
    "sample-candidates",
    "score-with-oracle",
    "build-pairs",
    "store-round",
    "replay-select",
    "update-policies",
    "evaluate",
)


@pytest.mark.flow
@pytest.mark.usefixtures("prefect_api")
@pytest.mark.parametrize("adapter", [None, "pbrl.generation.centralized:TaggedAdapter"], ids=["as-shipped", "tagged"])
def test_tiny_centralized_config_trains_two_rounds_then_reruns_cached(tmp_path, adapter):
    from typer.testing import CliRunner

    from pbrl import orchestration
    from pbrl.cli.commands import app
    from pbrl.config import load_job

    overrides = [f"output_dir={tmp_path}"] + ([f"comparator_centralized_adapter={adapter}"] if adapter else [])
    result = CliRunner().invoke(app, ["train", str(TINY), *[a for o in overrides for a in ("--set", o)]])
    assert result.exit_code == 0, result.output
    paths = RunPaths(tmp_path / "tiny-centralized")
    for r in (1, 2):
        for stage in ROUND_STAGES:
            assert paths.manifest(r, stage).is_file(), (r, stage)
        assert roles_path(paths.round_dir(r)).is_file() and roles_path(paths.round_dir(r), eval_draws=True).is_file()
    scored = [read_rows(paths.scores(r), SCORES) for r in (1, 2)]
    failures = sum(s["failure"] is not None for rows in scored for s in rows)
    if adapter is not None:  # the tiny random model never writes the tags: every joint response dropped, counted
        assert failures == 2 * 8 * 4 * 2 and not paths.round_checkpoint(1).exists()
    else:
        assert failures < 2 * 8 * 4 * 2
        for r in (1, 2):
            assert sorted(p.name for p in paths.round_checkpoint(r).glob("agent_*")) == ["agent_0"]
    job = load_job(TINY, [*overrides, "run_name=tiny-centralized"])
    out = orchestration.train(job, resume=True)
    assert {s["state"] for s in out["stages"]} == {"Cached"}


def test_validate_reports_the_roles_and_the_one_actor_of_a_centralized_config(tiny_model_dir):
    from typer.testing import CliRunner

    from pbrl.cli.commands import app

    result = CliRunner().invoke(app, ["validate", str(TINY), "--set", f"agent_model={tiny_model_dir}"])
    assert result.exit_code == 0, result.output
    assert "(madpo_iter, 2 roles, one actor)" in " ".join(result.output.split())
