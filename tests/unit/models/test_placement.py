"""Placement (issue #19 part 3): ``agent_devices`` with ``parallel_training``, and ``auto`` placement with
accelerate's device map within ``max_memory``.

Tolerance of a split/offloaded model against the unsplit one (stated once): the offloaded weights are the same
float32 values, moved back to the CPU for each forward, so every result is expected bitwise equal; the tests
allow 1e-6 (absolute, on adapter weights of magnitude ≈ 0.1 to 1) for a reordered reduction.
"""

from __future__ import annotations

import pytest
import torch

from pbrl.errors import ConfigError
from pbrl.learning.madpo import PairBatch
from pbrl.models.loading import init_lora_adapter, load_model, resolve_devices
from pbrl.models.lora import LoraSettings
from pbrl.models.placement import keep_resident, main_device, normalize_max_memory, placement_spec, resident_modules
from pbrl.models.policies import TrainablePolicy, trainable_parameters
from pbrl.run.settings import policy_source
from tests.helpers import madpo_step

TOLERANCE = 1e-6
TINY_BUDGET = {"cpu": "100KB"}  # the tiny model holds ≈ 95k float32 parameters (≈ 380 kB): most go to disk
LORA = LoraSettings(r=4, target_modules=("q_proj", "v_proj"))
PROMPTS = [[2, 40, 41, 42, 3, 2, 50], [2, 60, 61, 3, 2, 50]]
WINNERS = [[70, 71, 72, 3], [80, 81, 3]]
LOSERS = [[90, 91, 3], [100, 101, 102, 103, 104]]


@pytest.mark.parametrize(
    ("devices", "parallel", "expected"),
    [
        (["cuda:0", "cuda:1"], "none", "cuda:0"),
        (["cuda:0", "cuda:1"], "mp", ["cuda:0", "cuda:1"]),
        ("cuda:1", "none", "cuda:1"),
        ("cuda:1", "mp", "cuda:1"),
        (None, "none", None),
        ("auto", "none", "auto"),
        ("auto", "mp", "auto"),
    ],
)
def test_placement_spec(devices, parallel, expected):
    assert placement_spec(devices, parallel) == expected


def test_auto_survives_device_resolution():
    assert resolve_devices("auto", 3) == ["auto", "auto", "auto"]
    assert resolve_devices(["cpu", "auto"], 2) == ["cpu", "auto"]


def test_max_memory_keys_and_main_device():
    assert normalize_max_memory({"0": "1GiB", "cpu": 5, 1: "2GB", "disk": "1TB"}) == {
        0: "1GiB",
        "cpu": 5,
        1: "2GB",
        "disk": "1TB",
    }
    assert normalize_max_memory(None) is None
    assert main_device({"model.embed_tokens": "cpu", "model.layers": 1, "lm_head": 0}) == "cuda:1"
    assert main_device({"model": "cpu", "lm_head": "disk"}) == "cpu"


@pytest.fixture(scope="module")
def meta_model(tiny_model_dir):
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny_model_dir))
    model.tie_weights()
    return model


def test_resident_modules(meta_model):
    assert resident_modules(meta_model, trainable=True, lora_targets=None) == {""}  # full fine-tuning: all
    assert resident_modules(meta_model, trainable=False, lora_targets=None) == {"model.embed_tokens", "lm_head"}
    assert resident_modules(meta_model, trainable=True, lora_targets=("q_proj",)) == {
        "model.embed_tokens",
        "lm_head",
        "model.layers.0.self_attn.q_proj",
        "model.layers.1.self_attn.q_proj",
    }


def test_keep_resident_splits_an_offloaded_block_around_the_adapted_module(meta_model):
    device_map = {"model.embed_tokens": "cpu", "model.layers": "disk", "model.norm": "disk", "lm_head": "cpu"}
    placed = keep_resident(meta_model, device_map, {"model.embed_tokens", "lm_head", "model.layers.1.self_attn.q_proj"})
    assert placed == {
        "model.embed_tokens": "cpu",
        "model.layers.0": "disk",
        "model.layers.1.self_attn.q_proj": "cpu",
        "model.layers.1.self_attn.k_proj": "disk",
        "model.layers.1.self_attn.v_proj": "disk",
        "model.layers.1.self_attn.o_proj": "disk",
        "model.layers.1.mlp": "disk",
        "model.layers.1.input_layernorm": "disk",
        "model.layers.1.post_attention_layernorm": "disk",
        "model.norm": "disk",
        "lm_head": "cpu",
    }


def test_keep_resident_with_a_gpu_moves_cpu_offloaded_modules_to_it(meta_model):
    # With a GPU in the map, accelerate runs the model there and 'cpu' entries are offloaded: the head goes to 0.
    placed = keep_resident(meta_model, {"model": 0, "lm_head": "cpu"}, {"lm_head"})
    assert placed == {"model": 0, "lm_head": 0}
    assert keep_resident(meta_model, {"model": 0, "lm_head": 1}, {"lm_head"}) == {"model": 0, "lm_head": 1}


def test_full_fine_tuning_refuses_to_offload_trainable_weights(tiny_model_dir):
    with pytest.raises(ConfigError, match="max_memory: got .*cpu.*full fine-tuning trains every weight"):
        load_model(tiny_model_dir, device="auto", trainable=True, max_memory=TINY_BUDGET)
    # With room for everything, nothing is offloaded and it trains like the CPU copy.
    model = load_model(tiny_model_dir, device="auto", trainable=True, max_memory={"cpu": "64MiB"})
    assert set(model.hf_device_map.values()) == {"cpu"}
    assert all(p.device.type == "cpu" and p.dtype == torch.float32 and p.requires_grad for p in model.parameters())


def _lora_policy(model_dir, adapter, device):
    model = load_model(
        model_dir,
        device=device,
        lora=LORA,
        adapter_dir=adapter,
        trainable=True,
        max_memory=TINY_BUDGET if device == "auto" else None,
    )
    optimizer = torch.optim.AdamW(trainable_parameters(model), lr=1e-2, weight_decay=0.0)
    return TrainablePolicy(model, optimizer, pad_token_id=0)


def test_offloaded_lora_policy_trains_like_the_unsplit_one(tiny_model_dir, tmp_path):
    adapter = init_lora_adapter(tiny_model_dir, LORA, tmp_path / "adapter", seed=3)
    split, whole = _lora_policy(tiny_model_dir, adapter, "auto"), _lora_policy(tiny_model_dir, adapter, "cpu")
    assert "disk" in split.model.hf_device_map.values()  # the budget forced offload
    params = dict(split.model.named_parameters())
    assert params["base_model.model.model.layers.0.mlp.up_proj.weight"].device.type == "meta"  # offloaded
    trainable = {n: p for n, p in params.items() if p.requires_grad}
    assert len(trainable) == 8 and all(p.device.type == "cpu" and p.dtype == torch.float32 for p in trainable.values())
    batch = PairBatch([PROMPTS], [WINNERS], [LOSERS])
    for _ in range(3):  # lora_B starts at 0: from the second step on every adapter weight moves
        stats = [madpo_step([p], batch, beta=0.1, max_grad_norm=1.0) for p in (split, whole)]
        assert abs(stats[0].loss - stats[1].loss) <= TOLERANCE
        assert float((stats[0].margins - stats[1].margins).abs().max()) <= TOLERANCE
    reference = dict(whole.model.named_parameters())
    start = dict(_lora_policy(tiny_model_dir, adapter, "cpu").model.named_parameters())
    for name, param in trainable.items():
        assert not torch.equal(param, start[name]), f"{name} did not move"
        assert float((param - reference[name]).abs().max()) <= TOLERANCE, name


def test_auto_placement_through_a_round_matches_the_cpu_run(tiny_model_dir, tmp_path):
    """One round of the stages with ``agent_devices: auto`` and a 100 kB CPU budget (base weights offloaded to
    disk, LoRA adapters resident) gives the same candidates and, within the tolerance, the same adapters."""
    from safetensors.torch import load_file

    from pbrl.data.storage import RunPaths
    from pbrl.models.policies import load_agent
    from stages import STAGE_MODULES
    from tests.helpers import new_run

    adapters, pairs = {}, {}
    for placement in ({"agent_devices": "cpu"}, {"agent_devices": "auto", "max_memory": TINY_BUDGET}):
        name = placement["agent_devices"]
        run_dir, job = new_run(tiny_model_dir, tmp_path / name, lora_r=4, agent_learning_rate=1e-2, **placement)
        for stage in (
            "sample-candidates",
            "score-with-oracle",
            "build-pairs",
            "store-round",
            "replay-select",
            "update-policies",
        ):
            manifest = STAGE_MODULES[stage].run(run_dir, 1, job)
        assert manifest.counts["steps"] >= 1
        paths = RunPaths(run_dir)
        if name == "auto":  # the stages loaded it offloaded: the job's max_memory reached the loader
            policy = load_agent(policy_source(job), 0, paths.round_checkpoint(1), trainable=False)
            assert "disk" in policy.model.hf_device_map.values() and policy.device == "cpu"
        pairs[name] = paths.pairs(1).read_bytes()
        adapters[name] = load_file(paths.round_checkpoint(1) / "agent_1" / "adapter_model.safetensors")
    assert pairs["auto"] == pairs["cpu"]
    assert adapters["auto"].keys() == adapters["cpu"].keys()
    for key, value in adapters["cpu"].items():
        assert float((adapters["auto"][key] - value).abs().max()) <= TOLERANCE, key
