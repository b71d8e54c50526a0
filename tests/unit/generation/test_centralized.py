"""Centralized comparator generation (docs/design/algorithms.md#centralized-comparator-generation): one comparator
writes every role in one response, an adapter
splits it; an unparsable response drops that candidate (counted) and never aborts the round."""

from __future__ import annotations

from typing import Any

import pytest

from pbrl.data.schema import CANDIDATES, PAIRS
from pbrl.data.storage import RunPaths
from pbrl.data.tables import read_rows
from pbrl.errors import ConfigError
from pbrl.generation.centralized import CentralizedParseError, TaggedAdapter, load_adapter, split_roles
from stages import STAGE_MODULES
from tests.helpers import new_run
from tests.unit.generation.test_comparators_api import KEY_ENV, LoopbackServer, api_job_fields

WORDS = ["agent", "policy"]


class PipeAdapter:
    """A plugged-in adapter (importable as ``tests.unit.generation.test_centralized:PipeAdapter``): roles joined by
    ``|||``."""

    def build_prompt(self, item: dict, agent_prompts: list[str]) -> str:
        return " ||| ".join(agent_prompts)

    def parse_completion(self, completion: str, num_agents: int) -> list[str]:
        parts = [p.strip() for p in completion.split("|||")]
        if len(parts) != num_agents:
            raise CentralizedParseError(f"{len(parts)} parts")
        return parts


def test_tagged_prompt_lists_every_role_prompt_and_asks_for_each_section():
    prompt = TaggedAdapter().build_prompt({"item_id": "q"}, ["Write A.", "Write B.", "Write C."])
    assert prompt == (
        "You are a centralized coordinator writing the separate outputs of 3 agents that work together on one "
        "task. Each agent's original prompt follows.\n\n"
        "Agent 0 original prompt:\nWrite A.\n\nAgent 1 original prompt:\nWrite B.\n\n"
        "Agent 2 original prompt:\nWrite C.\n\n"
        "Write every agent's output, each inside its own tags, in this form and nothing else:\n"
        "<agent_0>agent 0's output</agent_0>\n<agent_1>agent 1's output</agent_1>\n<agent_2>agent 2's output</agent_2>"
    )


def test_tagged_parse_takes_each_section_stripped_in_role_order_and_refuses_a_missing_one():
    adapter = TaggedAdapter()
    # The reference's numbering (from 0, what the prompt asks for) ...
    text = "noise <AGENT_1>\n second </agent_1> <agent_0>first\nline</agent_0> <agent_2>third</agent_2> tail"
    assert adapter.parse_completion(text, 3) == ["first\nline", "second", "third"]
    # ... and, when those sections are not all there, numbered from 1 (issue #29: a reference-format joint
    # response used to be dropped as unparsable).
    text = "noise <AGENT_2>\n second </agent_2> <agent_1>first\nline</agent_1> <agent_3>third</agent_3> tail"
    assert adapter.parse_completion(text, 3) == ["first\nline", "second", "third"]
    with pytest.raises(CentralizedParseError, match=r"<agent_1> \(numbered from 1: <agent_1>, <agent_3>\)$"):
        adapter.parse_completion("<agent_0>a</agent_0><agent_2>c</agent_2>", 3)
    with pytest.raises(CentralizedParseError, match="<agent_2>"):
        adapter.parse_completion("<agent_1>a</agent_1><agent_3>c</agent_3>", 3)
    with pytest.raises(CentralizedParseError, match="<agent_1>"):
        adapter.parse_completion("<agent_1>  </agent_1><agent_2>b</agent_2>", 2)
    assert split_roles(adapter, "plain text", 2) is None


def test_an_adapter_plugs_in_by_import_path_and_a_bad_one_is_named():
    adapter = load_adapter("tests.unit.generation.test_centralized:PipeAdapter")
    assert isinstance(adapter, PipeAdapter)
    assert split_roles(adapter, "x ||| y", 2) == ["x", "y"]
    assert split_roles(adapter, "x", 2) is None
    with pytest.raises(ConfigError) as info:
        load_adapter("tests.unit.generation.test_centralized:Missing")
    assert info.value.problems[0].field == "comparator_centralized_adapter"
    with pytest.raises(ConfigError, match="parse_completion"):
        load_adapter("tests.unit.generation.test_centralized:WORDS")


def test_an_adapter_returning_the_wrong_number_of_roles_is_a_bug_not_a_drop():
    class Bad:
        def parse_completion(self, completion: str, num_agents: int) -> list[str]:
            return ["only one"]

    with pytest.raises(ConfigError, match="exactly 2 strings"):
        split_roles(Bad(), "x", 2)  # type: ignore[arg-type]


def test_an_adapter_returning_a_mapping_of_roles_is_refused_not_read_as_role_names():
    """Issue #29: ``{role: text}`` passed the length check and its keys (strings) became the role texts."""

    class Mapping:
        def parse_completion(self, completion: str, num_agents: int) -> dict[str, str]:
            return {"summary": "a text", "explanation": "another text"}

    with pytest.raises(ConfigError) as info:
        split_roles(Mapping(), "x", 2)  # type: ignore[arg-type]
    assert info.value.problems[0].field == "comparator_centralized_adapter" and "got {'summary'" in str(info.value)


# --------------------------------------------------------------------------------- through the stage
def role_text(agent: int, item_id: str, k: int) -> str:
    return f"the {WORDS[agent]} says {item_id} answer {k}"


def decentralized_writer(fmt: str, body: dict[str, Any], n: int) -> list[str]:
    return [role_text(body["agent_index"], body["task_item"]["item_id"], k) for k in range(n)]


def centralized_writer(broken: set[tuple[str, int]]):
    """Tagged joint answers; those (item_id, k) in ``broken`` miss agent 2's section."""

    def write(fmt: str, body: dict[str, Any], n: int) -> list[str]:
        item = body["task_item"]["item_id"]
        out = []
        for k in range(n):
            text = f"<agent_1>{role_text(0, item, k)}</agent_1>\n"
            if (item, k) not in broken:
                text += f"<agent_2>{role_text(1, item, k)}</agent_2>"
            out.append(text)
        return out

    return write


def collect(tiny_model_dir, out_dir, writer, *, centralized: bool, stages=("sample-candidates",)):
    with LoopbackServer("generic", writer) as server:
        extra = {"comparator_generation_mode": "centralized"} if centralized else {}
        run_dir, job = new_run(tiny_model_dir, out_dir, **api_job_fields(server.url, fmt="generic"), **extra)
        manifests = {name: STAGE_MODULES[name].run(run_dir, 1, job) for name in stages}
    return run_dir, server, manifests


@pytest.fixture
def key(monkeypatch):
    monkeypatch.setenv(KEY_ENV, "sk-centralized-test")


def test_a_response_missing_a_section_is_dropped_and_counted(tiny_model_dir, tmp_path, key):
    writer = centralized_writer({("toy-001", 1)})
    run_dir, server, manifests = collect(tiny_model_dir, tmp_path, writer, centralized=True)
    items = sorted({r.body["task_item"]["item_id"] for r in server.records})
    assert len(server.records) == len(items) == 4  # one request per item, from the centralized comparator only
    assert all(
        r.body["agent_index"] == 0 and r.body["prompt"].startswith("You are a centralized coordinator")
        for r in server.records
    )
    counts = manifests["sample-candidates"].counts
    assert counts["centralized_parse_failures"] == 1 and counts["comparator_candidates"] == 4 * 3 - 1
    rows = read_rows(RunPaths(run_dir).candidates(1), CANDIDATES)
    kept = {(r["item_id"], r["candidate_index"]) for r in rows if r["side"] == "comparator"}
    assert ("toy-001", 1) not in kept and len(kept) == 11
    assert any("could not be parsed" in m for m in manifests["sample-candidates"].messages)


def test_well_formed_centralized_answers_give_the_pairs_of_the_equivalent_decentralized_rows(
    tiny_model_dir, tmp_path, key
):
    stages = ("sample-candidates", "score-with-oracle", "build-pairs")
    runs = {
        "decentralized": collect(
            tiny_model_dir, tmp_path / "d", decentralized_writer, centralized=False, stages=stages
        )[0],
        "centralized": collect(
            tiny_model_dir, tmp_path / "c", centralized_writer(set()), centralized=True, stages=stages
        )[0],
    }
    comparator_rows, pairs = {}, {}
    for name, run_dir in runs.items():
        paths = RunPaths(run_dir)
        comparator_rows[name] = [
            {
                k: r[k]
                for k in (
                    "item_id",
                    "candidate_index",
                    "agent_index",
                    "prompt",
                    "prompt_ids",
                    "completion",
                    "completion_ids",
                    "ids_source",
                )
            }
            for r in read_rows(paths.candidates(1), CANDIDATES)
            if r["side"] == "comparator"
        ]
        pairs[name] = [{k: v for k, v in p.items() if k != "pair_id"} for p in read_rows(paths.pairs(1), PAIRS)]
    assert len(comparator_rows["centralized"]) == 4 * 3 * 2
    assert comparator_rows["centralized"][0]["completion"] == role_text(0, "toy-000", 0)
    assert comparator_rows["centralized"] == comparator_rows["decentralized"]
    assert pairs["centralized"] and pairs["centralized"] == pairs["decentralized"]


def test_a_checkpoint_comparator_writing_unparsable_text_drops_every_candidate_without_aborting(
    tiny_model_dir, tmp_path
):
    """The tiny random model never writes tags: every centralized candidate is dropped, the round goes on."""
    run_dir, job = new_run(
        tiny_model_dir,
        tmp_path,
        comparator_generation_mode="centralized",
        comparator_centralized_agent_index=1,
        preference_num_candidates=2,
    )
    manifest = STAGE_MODULES["sample-candidates"].run(run_dir, 1, job)
    assert manifest.counts["centralized_parse_failures"] == 4 * 2
    assert manifest.counts["comparator_candidates"] == 0
    assert manifest.details["sides"]["comparator"] == "current (centralized)"
    for name in ("score-with-oracle", "build-pairs"):
        STAGE_MODULES[name].run(run_dir, 1, job)
    assert read_rows(RunPaths(run_dir).pairs(1), PAIRS) == []
