"""Loading float32 files as bfloat16 weights group by group (pbrl/models/cast_load.py): found measuring the demo's
peak memory, where ``from_pretrained(dtype=bfloat16)`` of SmolLM2's float32 file peaked 870 MiB above where it
ended (the whole stored copy resident while casting). The streamed load must be the same model, bit for bit."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from pbrl.models import cast_load
from pbrl.models.cast_load import load_cast
from pbrl.models.loading import load_model


def _reference(path, dtype):
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True, use_safetensors=True)


@pytest.mark.parametrize("group_bytes", [64 * 2**20, 1])  # one group; one tensor per opening of the file
def test_streamed_bfloat16_load_is_from_pretrained_bit_for_bit(tiny_model_dir, monkeypatch, group_bytes):
    monkeypatch.setattr(cast_load, "GROUP_BYTES", group_bytes)
    model, ref = load_cast(tiny_model_dir, torch.bfloat16), _reference(tiny_model_dir, torch.bfloat16)
    assert model is not None and not model.training
    mine, theirs = model.state_dict(), ref.state_dict()
    assert mine.keys() == theirs.keys()
    assert all(mine[k].dtype == torch.bfloat16 and torch.equal(mine[k], theirs[k]) for k in mine)
    assert dict(model.named_buffers()).keys() == dict(ref.named_buffers()).keys()
    assert all(torch.equal(a, b) for a, b in zip(model.buffers(), ref.buffers(), strict=True))  # rotary inv_freq
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # still tied
    assert model.generation_config.to_dict() == ref.generation_config.to_dict()
    assert model.name_or_path == str(tiny_model_dir)
    ids = torch.tensor([[1, 5, 9, 30, 2]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)


def test_load_model_takes_the_streamed_path_for_bfloat16_only(tiny_model_dir, monkeypatch):
    calls = []
    real = cast_load.load_cast
    monkeypatch.setattr("pbrl.models.loading.load_cast", lambda *a: calls.append(a[1]) or real(*a))
    assert load_model(tiny_model_dir, dtype="bfloat16").dtype == torch.bfloat16
    assert load_model(tiny_model_dir, dtype="float32").dtype == torch.float32  # already float32: from_pretrained
    assert calls == [torch.bfloat16, torch.float32] and real(tiny_model_dir, torch.float32) is None


def test_files_that_are_not_the_models_parameters_go_through_from_pretrained(tiny_model_dir, tmp_path):
    """An extra or a missing tensor, or no safetensors at all: None, so the caller uses from_pretrained."""
    weights = load_file(tiny_model_dir / "model.safetensors")
    for name, change in {
        "extra": lambda w: w | {"unexpected.weight": torch.zeros(2)},
        "missing": lambda w: {k: v for k, v in w.items() if not k.endswith("q_proj.weight")},
    }.items():
        folder = shutil.copytree(tiny_model_dir, tmp_path / name)
        save_file(change(dict(weights)), folder / "model.safetensors", metadata={"format": "pt"})
        assert load_cast(folder, torch.bfloat16) is None, name
    empty = tmp_path / "no-weights"
    empty.mkdir()
    (empty / "config.json").write_text(json.dumps(json.loads((tiny_model_dir / "config.json").read_text())))
    assert load_cast(empty, torch.bfloat16) is None
