"""Issue #53.3: "validate OK" means the run will not fail on its config, as a property derived from the options
reference, not a list of cases.

Every option is sorted into a kind by what the reference says of it (its name, type and description): a device, a
folder the run writes, a model source, a dataset, a model part (modules, layers), a size in tokens, a thread count,
a mapping (which makes the config large). Each kind has bad values: devices this torch does not have, a file where a
folder goes, a folder where a model or a dataset goes, a module or a layer the model lacks, more tokens than the
model's context, more threads than CPUs, a value larger than Prefect stores. For every (option, bad value),
``validate`` (``preflight(..., prepare_models=False)``) must refuse it naming the option, or else ``train`` must not
fail on it: a round of the tiny run, stage by stage, and Prefect's own check of the flow's parameters.
"""

from __future__ import annotations

import json
import tempfile
import typing
from pathlib import Path
from typing import Any

import pytest
import torch

from pbrl.config import load_job
from pbrl.config.models import JOB_CLASSES
from pbrl.errors import ConfigError
from pbrl.run.preflight import preflight

CONFIGS = Path(__file__).resolve().parents[3] / "flows" / "configs"
BIG = "x" * 600_000  # more than Prefect's 512 KiB of flow parameters


def options() -> dict[str, tuple[str, Any, str]]:
    """``{option: (first trainer that has it, its annotation, its description)}`` over every trainer."""
    out: dict[str, tuple[str, Any, str]] = {}
    for trainer, cls in JOB_CLASSES.items():
        for name, field in cls.model_fields.items():
            out.setdefault(name, (trainer, field.annotation, field.description or ""))
    return out


def _types(annotation: Any) -> set[Any]:
    """The plain types an annotation admits (``int | None`` -> {int, NoneType}; ``list[str]`` -> {list})."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _types(typing.get_args(annotation)[0])
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return set().union(*(_types(a) for a in typing.get_args(annotation)))
    return {origin or annotation}


def kind_of(name: str, annotation: Any, description: str) -> str | None:
    """The kind of an option, read from the reference; None: none of the kinds the issue names."""
    types, text = _types(annotation), description.lower()
    if name.endswith(("_device", "_devices")):
        return "device"
    if name.endswith("_dir") or text.startswith("folder"):
        return "folder"
    if name.endswith(("_model", "_model_name", "agents")) and types & {str, list}:
        return "model"
    if name.endswith("_dataset"):
        return "dataset"
    if int in types and ("layers" in text or "decoder layer" in text):
        return "layers"
    if list in types and "modules" in text:
        return "modules"
    if int in types and "tokens" in text and text.startswith("most"):
        return "tokens"
    if int in types and "threads" in text:
        return "threads"
    if dict in types:
        return "mapping"
    return None


def _unavailable_devices() -> list[str]:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    found = [f"cuda:{gpus}"]
    if not (getattr(torch, "xpu", None) and torch.xpu.is_available()):
        found.append("xpu:0")
    if not torch.backends.mps.is_available():
        found.append("mps")
    return found


def bad_values(kind: str, tmp: Path) -> list[tuple[str, Any]]:
    """``(label, value)`` of each bad value of a kind (files and folders made under ``tmp``)."""
    a_file = tmp / "a-file.txt"
    a_file.write_text("not a folder")
    empty = tmp / "empty-folder"
    empty.mkdir(exist_ok=True)
    broken = tmp / "broken.jsonl"
    broken.write_text('{"topic": "x"\n')
    values: dict[str, list[tuple[str, Any]]] = {
        "device": [(d, d) for d in _unavailable_devices()],
        "folder": [("a file", str(a_file)), ("under a file", str(a_file / "sub"))],
        "model": [("a file", str(a_file)), ("an empty folder", str(empty)), ("missing", str(tmp / "missing"))],
        "dataset": [("a folder", str(empty)), ("broken JSON", str(broken)), ("missing", str(tmp / "no.jsonl"))],
        "layers": [("beyond the model's", 99)],
        "modules": [("none of the model's", ["no_such_module"])],
        "tokens": [("beyond the context", 100_000)],
        "threads": [("beyond the CPUs", 1_000_000)],
        "mapping": [("larger than Prefect stores", {"big": BIG})],
    }
    return values[kind]


def _for_option(name: str, value: Any) -> Any:
    """A model given to a list-only option as one per agent (``agents``, ``comparator_agents``)."""
    return [value, value] if name in ("agents", "comparator_agents") else value


# Options a value of a kind needs beside it to be read at all (LoRA for its modules, the reward layers' trainer).
COMPANIONS = {"modules": {"lora_r": 4}, "mapping": {}}


MODEL_READING = ("modules", "layers", "tokens")  # kinds checked against the model: tried on a packaged one too


def cases(probe: Path) -> list[tuple[str, str, str, str]]:
    """``(option, kind, bad value's label, agent model)`` of every option of a kind (``probe``: a scratch folder)."""
    found = []
    for name, (_, annotation, description) in options().items():
        kind = kind_of(name, annotation, description)
        if kind is None:
            continue
        models = ("folder", "tiny-random") if kind in MODEL_READING else ("folder",)
        found += [(name, kind, label, m) for label, _ in bad_values(kind, probe) for m in models]
    return found


with tempfile.TemporaryDirectory() as _probe:
    CASES = cases(Path(_probe))


def test_every_kind_the_issue_names_has_options_in_the_reference():
    """The derivation finds the options it is meant to (a renamed option would silently drop out of the test)."""
    kinds: dict[str, set[str]] = {}
    for name, kind, _, _ in CASES:
        kinds.setdefault(kind, set()).add(name)
    assert {"agent_devices", "reward_model_device", "comparator_devices"} <= kinds["device"]
    assert {"output_dir", "preference_replay_dir", "policy_checkpoint_dir"} <= kinds["folder"]
    assert {"agent_model", "agents", "reward_model_name", "comparator_model_name"} <= kinds["model"]
    assert {"train_dataset", "eval_dataset"} <= kinds["dataset"]
    assert kinds["layers"] == {"reward_backbone_layers"} and kinds["modules"] == {"lora_target_modules"}
    assert "max_new_tokens" in kinds["tokens"] and kinds["threads"] == {"num_threads"}
    assert "task_options" in kinds["mapping"]


def _job(name: str, value: Any, kind: str, model: str, out: Path):
    trainer = options()[name][0]
    overrides = {
        "output_dir": str(out),
        "run_name": "prop",
        "agent_model": model,
        "eval_num_samples": 2,
        **COMPANIONS.get(kind, {}),
    }
    if trainer.endswith("_iter"):
        overrides["num_iterations"] = 1
    if name == "agents":
        overrides.pop("agent_model")
    overrides[name] = _for_option(name, value)
    config = CONFIGS / f"tiny-{trainer.replace('_', '-')}.yaml"
    return load_job(config, [f"{k}={json.dumps(v)}" for k, v in overrides.items()])


def _train_fails(job) -> Exception | None:
    """What ``train`` raises on this job: Prefect's check of the flow's parameters, then one round, stage by stage."""
    from prefect._internal.schemas.validators import validate_parameter_size

    from pbrl.run.folder import open_job, prepare_run
    from pbrl.run.stage_plan import trainer_stages
    from stages import STAGE_MODULES

    try:
        validate_parameter_size({"config": job.model_dump(mode="json")}, 524_288)
        run_dir = prepare_run(job, resume=False)
        stored = open_job(run_dir)
        for round_index, names in ((0, ("evaluate",)), (1, trainer_stages(stored.trainer))):
            for stage in names:
                STAGE_MODULES[stage].run(run_dir, round_index, stored)
    except Exception as exc:
        return exc
    return None


@pytest.mark.parametrize(("name", "kind", "label", "model"), CASES, ids=[f"{m}-{n}-{lbl}" for n, _, lbl, m in CASES])
def test_validate_refuses_every_bad_value_that_train_would(
    name, kind, label, model, tiny_model_dir, tmp_path, monkeypatch
):
    monkeypatch.setenv("PBRL_STORAGE", str(tmp_path / "storage"))
    value = dict(bad_values(kind, tmp_path))[label]
    try:
        job = _job(name, value, kind, str(tiny_model_dir) if model == "folder" else "tiny-random", tmp_path / "runs")
        preflight(job, prepare_models=False)
    except ConfigError as exc:
        fields = {p.field.split("[")[0] for p in exc.problems}
        assert name in fields, exc  # refused, naming the option
        return
    failure = _train_fails(job)
    assert failure is None, f"validate accepted {name}={label!r}, then train failed: {failure!r}"


# ------------------------------------------------------------------------------ the cases of the issue's list
def _tiny(tiny_model_dir, tmp_path, **overrides):
    values = {"agent_model": str(tiny_model_dir), "output_dir": str(tmp_path / "runs"), **overrides}
    return load_job(CONFIGS / "tiny-madpo-iter.yaml", [f"{k}={json.dumps(v)}" for k, v in values.items()])


def test_every_problem_is_reported_at_once(tiny_model_dir, tmp_path):
    a_file = tmp_path / "f"
    a_file.write_text("x")
    job = _tiny(
        tiny_model_dir,
        tmp_path,
        agent_devices="cuda:7",
        output_dir=str(a_file),
        num_threads=10**6,
        lora_r=4,
        lora_target_modules=["q_proj", "nope"],
    )
    with pytest.raises(ConfigError) as caught:
        preflight(job, prepare_models=False)
    assert {p.field for p in caught.value.problems} == {
        "agent_devices",
        "output_dir",
        "num_threads",
        "lora_target_modules",
    }


def test_prompts_longer_than_the_context_are_refused_naming_the_items(tiny_model_dir, tmp_path):
    """Issue #53.3: such prompts were accepted silently, and trained on."""
    items = tmp_path / "long.jsonl"
    items.write_text(json.dumps({"topic": "word " * 2500}) + "\n" + json.dumps({"topic": "apples"}) + "\n")
    with pytest.raises(ConfigError, match=r"1 prompt\(s\) do not fit the context .* \(2048 tokens\) .*'item-00000'"):
        preflight(_tiny(tiny_model_dir, tmp_path, train_dataset=str(items)), prepare_models=False)


def test_a_tokenizer_larger_than_the_model_vocabulary_is_refused(tiny_model_dir, tmp_path):
    import shutil

    from transformers import AutoTokenizer

    folder = tmp_path / "grown"
    shutil.copytree(tiny_model_dir, folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.add_tokens([f"<new_{i}>" for i in range(5)])
    tokenizer.save_pretrained(folder)
    with pytest.raises(ConfigError, match=r"its tokenizer has 325 tokens, more than the model's vocabulary \(320\)"):
        preflight(_tiny(folder, tmp_path), prepare_models=False)


class WrongTypeAdapter:
    """A centralized adapter whose parse_completion returns a dict (role -> text) instead of a list."""

    def build_prompt(self, item, agent_prompts):
        return "\n".join(agent_prompts)

    def parse_completion(self, completion, num_agents):
        return {f"agent_{i}": completion for i in range(num_agents)}


def test_a_centralized_adapter_that_breaks_its_contract_is_refused_by_validate(tiny_model_dir, tmp_path):
    job = _tiny(
        tiny_model_dir,
        tmp_path,
        collaboration_mode="centralized",
        comparator_centralized_adapter="tests.unit.run.test_validate_property:WrongTypeAdapter",
    )
    with pytest.raises(ConfigError, match="parse_completion must return a list of exactly 2 strings"):
        preflight(job, prepare_models=False)


def test_the_trainer_constructor_refuses_a_model_on_the_meta_device_and_what_the_machine_lacks(
    tiny_model_dir, tmp_path, monkeypatch
):
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from pbrl.trainers import MADPOIterTrainer

    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny_model_dir))
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    with pytest.raises(ConfigError, match="agent_model: got 'LlamaForCausalLM'; its weights are on the meta device"):
        MADPOIterTrainer(agent_model=model, tokenizers=tokenizer, task="toy")
    with pytest.raises(ConfigError, match="agent_devices: got 'cuda:9'"):
        MADPOIterTrainer(agent_model=str(tiny_model_dir), task="toy", agent_devices="cuda:9")
    a_file = tmp_path / "storage-file"
    a_file.write_text("x")
    monkeypatch.setenv("PBRL_STORAGE", str(a_file))  # where a model object would be saved
    loaded = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with pytest.raises(ConfigError, match=r"PBRL_STORAGE'; pbrl stores models .*storage-file, which is a file"):
        MADPOIterTrainer(agent_model=loaded, tokenizers=tokenizer, task="toy")


def test_with_runner_ray_the_devices_are_the_clusters_not_this_machines(tiny_model_dir, tmp_path):
    """A CPU-only head node submits runs whose devices are its GPU workers' (docs/guides/ray.md)."""
    from pbrl.run.preflight_env import device_problems

    job = _tiny(tiny_model_dir, tmp_path, agent_devices="cuda:3")
    assert [p.field for p in device_problems(job)] == ([] if torch.cuda.device_count() > 3 else ["agent_devices"])
    assert device_problems(job.model_copy(update={"runner": "ray"})) == []
