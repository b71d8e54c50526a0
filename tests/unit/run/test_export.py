"""Trained agents out of a run (issue #32): ``result.agents()`` / ``load_trained_agents`` and ``export_agents``
(``pbrl export``) write standard Hugging Face folders that ``from_pretrained`` loads and that sample the run's own
tokens with the run's seeds (an adapter over its base in the run's torch_dtype); merged and unmerged LoRA exports give
the same tokens in float32."""

from __future__ import annotations

import importlib.util
import json

import pyarrow.parquet as pq
import pytest
import torch
from peft import AutoPeftModelForCausalLM, PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from pbrl.data.seeds import derive_seed
from pbrl.data.storage import RunPaths, StageManifest, write_manifest
from pbrl.errors import ConfigError
from pbrl.generation.sampling import SamplingSettings, encode_prompt, generate
from pbrl.models.head_input import has_contiguous_head_input
from pbrl.models.loading import load_tokenizer
from pbrl.models.lora import quiet_peft_wrapping
from pbrl.run.export import EXPORT_FILE, export_agents, load_trained_agents, trained_round
from pbrl.run.folder import open_job
from tests.helpers import new_run


def docs_module(label: str, tmp_path):
    """A labelled python block of docs/guides/tracking-and-export.md, imported."""
    from tests.repo.test_docs import workdir

    path = workdir("guides/tracking-and-export.md", tmp_path) / label
    spec = importlib.util.spec_from_file_location(f"docs_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def same_weights(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


# ---------------------------------------------------------------------------------------------- without a flow
def test_the_initial_full_weights_export_loads_with_from_pretrained(tiny_model_dir, tmp_path):
    run_dir, job = new_run(tiny_model_dir, tmp_path, num_iterations=1)
    assert trained_round(run_dir) == 0  # nothing trained yet: the initial policies
    folders = export_agents(run_dir, tmp_path / "out")
    assert [f.name for f in folders] == ["agent_0", "agent_1"]
    model = AutoModelForCausalLM.from_pretrained(folders[1])
    assert same_weights(model, AutoModelForCausalLM.from_pretrained(tiny_model_dir))
    tokenizer = AutoTokenizer.from_pretrained(folders[1])
    used = load_tokenizer(tiny_model_dir)  # as the run used it: a pad token (EOS when none), left padding
    assert (tokenizer.pad_token, tokenizer.padding_side) == (used.pad_token, "left")
    card = (folders[1] / "README.md").read_text()
    for text in ("# run: agent 1 of 2, round 0", "madpo_iter (MADPOIterTrainer)", "not evaluated after round 0",
                 "library_name: transformers", "full weights"):  # fmt: skip
        assert text in card, text
    record = json.loads((tmp_path / "out" / EXPORT_FILE).read_text())
    assert record["round"] == 0 and record["checkpoint"] == "checkpoints/initial" and not record["lora"]
    export_agents(run_dir, tmp_path / "out")  # an earlier export is replaced
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(ConfigError, match="out: got .*mine'; exists and is not an earlier export"):
        export_agents(run_dir, tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_full_weights_export_keeps_float32_on_a_bfloat16_host(tiny_model_dir, tmp_path, monkeypatch):
    """Found on a CPU with amx_bf16: torch_dtype 'auto' became bfloat16 and the export loaded the trained (float32
    master) weights in it, so the initial export differed from the source model. Trained weights keep float32; only
    an unmerged adapter's frozen base takes the run's torch_dtype."""
    monkeypatch.setenv("PBRL_CPU_BF16", "1")
    run_dir, _ = new_run(tiny_model_dir, tmp_path / "full", num_iterations=1)
    assert open_job(run_dir).torch_dtype == "bfloat16"
    (folder, _) = export_agents(run_dir, tmp_path / "out")
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert model.dtype == torch.float32 and same_weights(model, AutoModelForCausalLM.from_pretrained(tiny_model_dir))
    lora_run, _ = new_run(tiny_model_dir, tmp_path / "lora", num_iterations=1, lora_r=4)
    (adapter, _) = load_trained_agents(lora_run, device="cpu")
    assert adapter.model.get_base_model().model.embed_tokens.weight.dtype == torch.bfloat16
    # a user sampling from that bfloat16 base gets the head's input made contiguous, as pbrl's own policies do
    # (pbrl.models.head_input: torch copied a frozen bfloat16 head once per row)
    assert has_contiguous_head_input(adapter.model)
    (merged, _) = load_trained_agents(lora_run, merge_lora=True, device="cpu")
    assert all(p.dtype == torch.float32 for p in merged.model.parameters())


def test_a_round_without_pairs_keeps_the_previous_policy(tiny_model_dir, tmp_path):
    """A round that had no pairs writes no checkpoint: its update-policies manifest names the previous one."""
    run_dir, job = new_run(tiny_model_dir, tmp_path, num_iterations=2, lora_r=4)
    paths = RunPaths(run_dir)
    write_manifest(
        paths,
        StageManifest(stage="update-policies", round_index=1, config_hash="x",
                      details={"checkpoint": "checkpoints/initial", "updated": False}),
    )  # fmt: skip
    assert trained_round(run_dir) == 1
    agents = load_trained_agents(run_dir, device="cpu")
    assert len(agents) == 2 and isinstance(agents[0].model, PeftModel)
    base_dtype = getattr(torch, open_job(run_dir).torch_dtype)  # the frozen base in the run's precision
    with quiet_peft_wrapping():  # peft reads a property transformers 5 deprecated
        initial = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=base_dtype), paths.initial / "agent_0"
        )
    assert same_weights(agents[0].model, initial)
    merged = load_trained_agents(run_dir, 1, merge_lora=True, device="cpu")
    assert not isinstance(merged[0].model, PeftModel)
    with pytest.raises(ConfigError, match="round: got 2; this run has the policies of rounds 0, 1"):
        load_trained_agents(run_dir, 2)


# ---------------------------------------------------------------------------------------------- a trained run
@pytest.fixture(scope="module")
def lora_run(tiny_model_dir, tmp_path_factory, prefect_api):
    from pbrl import orchestration
    from tests.helpers import tiny_job

    job = tiny_job(tiny_model_dir, tmp_path_factory.mktemp("export"), lora_r=4, lora_alpha=8, eval_num_samples=2)
    out = orchestration.train(job)
    return job, RunPaths(out["run_dir"])


def run_draw(job, paths: RunPaths, round_index: int, row: int, agent: int) -> tuple[str, list[int], int]:
    """The prompt, sampled ids and seed of one evaluation draw of the run (evaluate's seeds: round 0's key, the
    s-th draw of its item)."""
    rows = pq.read_table(paths.eval(round_index)).to_pylist()
    item = rows[row]["item_id"]
    sample = sum(1 for r in rows[:row] if r["item_id"] == item)
    seed = derive_seed(job.seed, round_index=0, stage="evaluate", side="eval", agent=agent, item=item, index=sample)
    return rows[row]["prompts"][agent], rows[row]["completion_ids"][agent], seed


def sample(model, tokenizer, job, prompt: str, seed: int) -> list[int]:
    settings = SamplingSettings(job.max_new_tokens, job.temperature, job.top_p, job.top_k, job.eval_batch_size)
    return generate(model, tokenizer, [encode_prompt(tokenizer, prompt)], [seed], settings)[0].completion_ids


@pytest.mark.flow
def test_exported_agents_load_with_from_pretrained_and_sample_the_runs_tokens(lora_run, tmp_path):
    job, paths = lora_run
    assert trained_round(paths.root) == 2
    adapters = export_agents(paths.root, tmp_path / "adapters")
    merged = export_agents(paths.root, tmp_path / "merged", merge_lora=True)
    assert (adapters[0] / "adapter_model.safetensors").is_file() and not (adapters[0] / "model.safetensors").exists()
    assert (merged[0] / "model.safetensors").is_file() and not (merged[0] / "adapter_config.json").exists()
    card = (adapters[1] / "README.md").read_text()
    assert "| round | 2: the policy after round 2 (checkpoints/round_0002) |" in card and "library_name: peft" in card
    evaluation = json.loads(paths.manifest(2, "evaluate").read_text())["metrics"]
    assert f"{evaluation['eval/reward_mean']:.4g} [" in card

    compared = 0
    run_dtype = getattr(torch, open_job(paths.root).torch_dtype)  # bfloat16 on a CPU with bfloat16 arithmetic
    for agent in range(job.num_agents):
        prompt, ids, seed = run_draw(job, paths, 2, 0, agent)
        tokenizer = AutoTokenizer.from_pretrained(adapters[agent])
        unmerged = AutoPeftModelForCausalLM.from_pretrained(adapters[agent], dtype=run_dtype)
        assert sample(unmerged, tokenizer, job, prompt, seed) == ids  # the run's exact tokens, in its precision
        # merged weights are float32 (as they trained): they sample what the adapter samples over a float32 base
        full = AutoModelForCausalLM.from_pretrained(merged[agent])
        in_float32 = AutoPeftModelForCausalLM.from_pretrained(adapters[agent], dtype=torch.float32)
        merged_ids = sample(full, AutoTokenizer.from_pretrained(merged[agent]), job, prompt, seed)
        assert merged_ids == sample(in_float32, tokenizer, job, prompt, seed)  # merged == unmerged
        if run_dtype == torch.float32:
            assert merged_ids == ids
        compared += len(ids)
    assert compared > 0
    reproduce = docs_module("reproduce.py", tmp_path)  # the guide's own check, on both exports
    for folder in (adapters[1], merged[1]) if run_dtype == torch.float32 else (adapters[1],):
        ran, again = reproduce.run_tokens_again(paths.root, folder, 1, 2, row=1)
        assert ran == again and ran
    # the trained adapters differ from the initial ones (the round's weights, not round 0's, were exported)
    initial = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(job.agent_model), paths.initial / "agent_0"
    )
    assert not same_weights(AutoPeftModelForCausalLM.from_pretrained(adapters[0]), initial)


@pytest.mark.flow
def test_result_agents_are_the_policies_of_the_newest_round(lora_run):
    job, paths = lora_run
    agents = load_trained_agents(paths.root, device="cpu")
    prompt, ids, seed = run_draw(job, paths, 2, 1, 1)
    assert sample(agents[1].model, agents[1].tokenizer, job, prompt, seed) == ids
    first = load_trained_agents(paths.root, 1, device="cpu")
    prompt, ids, seed = run_draw(job, paths, 1, 0, 0)
    assert sample(first[0].model, first[0].tokenizer, job, prompt, seed) == ids
