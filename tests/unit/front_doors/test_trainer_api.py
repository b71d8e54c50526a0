"""The trainer API a TRL or CoMLRL user expects (issue #32): ``args=``, model objects with their tokenizers,
``peft_config``, callbacks, and one clear error per wrong argument; a trainer built from model objects trains on the
tiny model and its run reruns Cached from the command line."""

from __future__ import annotations

import json

import pytest
from peft import LoraConfig, PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer
from typer.testing import CliRunner

from pbrl.cli.commands import app
from pbrl.config import RUN_FIELDS, MADPOConfig, MADPOIterConfig, MARLHFConfig
from pbrl.data.storage import RunPaths, read_json
from pbrl.errors import ConfigError
from pbrl.models.loading import resolve_model_source
from pbrl.run import progress
from pbrl.run.progress import Event
from pbrl.trainers import MADPOIterTrainer, MADPOTrainer, MARLHFTrainer
from pbrl.trainers.callbacks import CallbackHandler, TrainerCallback, check_callbacks
from pbrl.trainers.model_objects import save_model_object
from tests.unit.run.test_export import docs_module

TINY = {"task": "toy", "task_options": {"num_items": 4}}


def tiny_objects(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir), AutoTokenizer.from_pretrained(model_dir)


# ---------------------------------------------------------------------------------------------- arguments
def test_args_keyword_and_positional_give_the_same_job(tiny_model_dir):
    config = MADPOIterConfig(num_iterations=3, dpo_beta=0.2)
    by_keyword = MADPOIterTrainer(args=config, agent_model=str(tiny_model_dir), run_name="a", **TINY)
    by_position = MADPOIterTrainer(config, agent_model=str(tiny_model_dir), run_name="a", **TINY)
    by_mapping = MADPOIterTrainer(args={"num_iterations": 3, "dpo_beta": 0.2}, agent_model=str(tiny_model_dir),
                                  run_name="a", **TINY)  # fmt: skip
    jobs = [t._job(t._run) for t in (by_keyword, by_position, by_mapping)]
    assert jobs[0] == jobs[1] == jobs[2] and jobs[0].num_iterations == 3 and jobs[0].dpo_beta == 0.2
    assert MADPOTrainer(agent_model=str(tiny_model_dir), **TINY).args == MADPOConfig()  # None: the defaults


@pytest.mark.parametrize(
    ("kwargs", "named", "hint"),
    [
        ({"agent_modle": "tiny-random"}, "'agent_modle'", "did you mean 'agent_model'"),
        ({"num_iterations": 2}, "'num_iterations'", "args=MADPOIterConfig(num_iterations=...)"),
        ({"rl_algorithm": "marloo"}, "'rl_algorithm'", "belongs to MARLHFConfig, MARLHFIterConfig"),
        ({"trainer": "madpo"}, "'trainer'", "set by the class"),
    ],
)
def test_a_wrong_argument_is_named_in_one_line(kwargs, named, hint):
    with pytest.raises(TypeError) as caught:
        MADPOIterTrainer(agent_model="tiny-random", task="toy", **kwargs)
    message = str(caught.value)
    assert named in message and hint in message and message.startswith("MADPOIterTrainer: ")
    assert "\n" not in message and len(message) < 300  # one line, never a dump of every option
    others = [f for f in RUN_FIELDS if f not in message and f"'{f}'" not in message]
    assert len(others) >= len(RUN_FIELDS) - 4


def test_args_of_another_trainer_is_named_without_its_values():
    with pytest.raises(TypeError) as caught:
        MADPOIterTrainer(args=MARLHFConfig(), agent_model="tiny-random", task="toy")
    message = str(caught.value)
    assert "args got a MARLHFConfig; give a MADPOIterConfig" in message and "dpo_beta" not in message


def test_bad_values_are_listed_with_their_options_only():
    with pytest.raises(ConfigError) as caught:
        MARLHFTrainer(args={"num_train_epochs": 0}, agent_model="tiny-random", task="toy", lora_r=0, report_to="comet")
    fields = [p.field for p in caught.value.problems]
    assert sorted(fields) == ["lora_r", "num_train_epochs", "report_to"], fields


def test_peft_config_becomes_the_lora_options_and_what_pbrl_cannot_do_is_named(tiny_model_dir):
    trainer = MADPOIterTrainer(
        agent_model=str(tiny_model_dir),
        peft_config=LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["v_proj", "q_proj"],
                               task_type="CAUSAL_LM"),
        **TINY,
    )  # fmt: skip
    job = trainer._job(trainer._run)
    assert (job.lora_r, job.lora_alpha, job.lora_dropout, job.lora_target_modules) == (4, 8, 0.1, ["q_proj", "v_proj"])
    with pytest.raises(ConfigError) as caught:
        MADPOIterTrainer(agent_model="tiny-random", peft_config=LoraConfig(use_dora=True, bias="all"), lora_r=8,
                         **TINY)  # fmt: skip
    fields = sorted(p.field for p in caught.value.problems)
    assert fields == ["lora_r", "peft_config.bias", "peft_config.use_dora"], fields
    with pytest.raises(ConfigError, match="peft_config: got 'dict'; give a peft.LoraConfig"):
        MADPOIterTrainer(agent_model="tiny-random", peft_config={"r": 8}, **TINY)


def test_model_objects_take_one_tokenizer_each_or_one_for_all(tiny_model_dir):
    model, tokenizer = tiny_objects(tiny_model_dir)
    MADPOIterTrainer(agents=[model, model], tokenizers=tokenizer, **TINY)
    MADPOIterTrainer(agents=[model, str(tiny_model_dir)], tokenizers=[tokenizer, None], **TINY)
    MADPOIterTrainer(agent_model=model, **TINY)  # its tokenizer is saved where it was loaded from
    with pytest.raises(ConfigError) as caught:
        MADPOIterTrainer(agents=[model, model], tokenizers=[tokenizer], **TINY)
    assert [p.field for p in caught.value.problems] == ["tokenizers"]
    with pytest.raises(ConfigError) as caught:
        MADPOIterTrainer(agents=[model, str(tiny_model_dir)], tokenizers=[tokenizer, tokenizer], **TINY)
    assert [p.field for p in caught.value.problems] == ["tokenizers[1]"]
    with pytest.raises(ConfigError) as caught:
        MADPOIterTrainer(agents=[model, 3], tokenizers=tokenizer, **TINY)
    assert [p.field for p in caught.value.problems] == ["agents[1]"]


def test_a_model_object_is_saved_once_by_content_and_loads_back(tiny_model_dir, tmp_path):
    import torch

    model, tokenizer = tiny_objects(tiny_model_dir)
    name = save_model_object(model, tokenizer, tmp_path)
    assert name.startswith("model-object:LlamaForCausalLM-")  # a name in the storage, never an absolute path
    first = resolve_model_source(name, tmp_path)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert save_model_object(model, tokenizer, tmp_path) == name  # the same weights: the same folder, not rewritten
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp and first.parent == tmp_path / "models" / "objects"
    loaded = AutoModelForCausalLM.from_pretrained(first)
    assert all(
        torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values(), strict=True)
    )
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    assert save_model_object(model, tokenizer, tmp_path) != name  # other weights: another folder


# ---------------------------------------------------------------------------------------------- callbacks
class Recorder(TrainerCallback):
    def __init__(self) -> None:
        self.heard: list[Event] = []

    def on_run_start(self, event: Event) -> None:
        self.heard.append(event)

    def on_stage_end(self, event: Event) -> None:
        self.heard.append(event)

    def on_round_end(self, event: Event) -> None:
        self.heard.append(event)

    def on_log(self, event: Event) -> None:
        self.heard.append(event)

    def on_run_end(self, event: Event) -> None:
        self.heard.append(event)


def test_callbacks_hear_their_own_run_and_a_broken_one_stops_nothing(tmp_path):
    class Broken(TrainerCallback):
        def on_log(self, event: Event) -> None:
            raise RuntimeError("a callback bug")

    recorder = Recorder()
    handler = CallbackHandler(tmp_path / "run", check_callbacks([Broken, recorder]))
    stop = progress.subscribe(handler)
    try:
        progress.publish(Event("log", str(tmp_path / "run"), 1, "update-policies", step=1, metrics={"madpo/loss": 0.7}))
        progress.publish(Event("log", str(tmp_path / "other"), 1, "update-policies", step=1))
        progress.publish(Event("round_end", str(tmp_path / "run" / ".." / "run"), 1, metrics={"eval_reward": 0.5}))
    finally:
        stop()
    assert [(e.kind, e.run_dir.endswith("run")) for e in recorder.heard] == [("log", True), ("round_end", True)]
    with pytest.raises(TypeError, match=r"callbacks\[1\]: object has none of the hooks"):
        check_callbacks([recorder, object()])


# ---------------------------------------------------------------------------------------------- end to end
@pytest.mark.flow
@pytest.mark.usefixtures("prefect_api")
def test_model_objects_with_peft_config_train_two_rounds_and_rerun_cached_from_the_cli(
    tiny_model_dir, tmp_path, monkeypatch
):
    monkeypatch.setenv("PBRL_STORAGE", str(tmp_path / "storage"))
    model, tokenizer = tiny_objects(tiny_model_dir)
    other = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    import torch

    with torch.no_grad():
        for param in other.parameters():
            param.mul_(1.01)  # agent 1 starts from other weights: two saved folders
    recorder = Recorder()
    eval_log = docs_module("eval_log.py", tmp_path).EvalLog(tmp_path / "eval.csv")  # the guide's callback
    result = MADPOIterTrainer(
        args=MADPOIterConfig(
            num_iterations=2, preference_num_candidates=3, preference_pairs_per_sample=2, max_new_tokens=8,
            temperature=1.0, top_p=1.0, agent_learning_rate=1e-3, eval_num_samples=2, train_batch_size=2,
            logging_steps=1,
        ),
        agents=[model, other],
        tokenizers=tokenizer,
        peft_config=LoraConfig(r=4, lora_alpha=8, task_type="CAUSAL_LM"),  # target modules: peft's llama default
        callbacks=[recorder, eval_log],
        run_name="objects",
        output_dir=tmp_path / "runs",
        **TINY,
    ).train()  # fmt: skip
    run_dir = result.run_dir
    assert list(result.rounds.index) == [0, 1, 2]
    config = read_json(RunPaths(run_dir).run_json)["config"]
    saved = [tmp_path / "storage" / "models" / "objects" / p.removeprefix("model-object:") for p in config["agents"]]
    assert len(set(config["agents"])) == 2 and all((s / "model.safetensors").is_file() for s in saved)
    assert config["lora_r"] == 4 and config["lora_target_modules"] == ["q_proj", "v_proj"]
    adapter = json.loads((run_dir / "checkpoints" / "round_0002" / "agent_1" / "adapter_config.json").read_text())
    assert adapter["r"] == 4 and sorted(adapter["target_modules"]) == ["q_proj", "v_proj"]
    kinds = [e.kind for e in recorder.heard]
    assert kinds[0] == "run_start" and kinds[-1] == "run_end" and kinds.count("round_end") == 3
    assert any(e.kind == "log" and "madpo/loss" in e.metrics for e in recorder.heard)
    updates = [e for e in recorder.heard if e.kind == "stage_end" and e.stage == "update-policies"]
    assert updates and "madpo/loss" in updates[0].metrics and updates[0].counts["steps"] >= 1
    logged = (tmp_path / "eval.csv").read_text().splitlines()
    assert [line.split(",")[0] for line in logged] == ["0", "1", "2"]
    assert [float(line.split(",")[1]) for line in logged] == pytest.approx(list(result.rounds["eval_reward"]))
    agents = result.agents()
    assert len(agents) == 2 and isinstance(agents[0].model, PeftModel) and agents[1].tokenizer.pad_token

    heard: list[Event] = []
    stop = progress.subscribe(heard.append)
    try:
        out = CliRunner().invoke(app, ["train", "--run", str(run_dir), "--resume"])
    finally:
        stop()
    assert out.exit_code == 0, out.output
    states = [e.state for e in heard if e.kind == "stage_end"]
    assert len(states) == 15 and set(states) == {"Cached"}, states
