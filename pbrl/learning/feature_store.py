"""Stored features of a frozen reward-model backbone, so that a later round does not run the backbone again on
the joint responses of earlier rounds (docs/design/algorithms.md#joint-reward-model).

With ``reward_freeze_backbone`` the joint reward model's pooled features of a joint response are a fixed function
of its ids and response spans, the backbone's weights, the layers that run (``reward_backbone_layers``), the pooling
and the joint template. fit-reward-model of round r writes the features of the joint responses of round r's own
selected, usable pairs to ``rounds/<r>/reward_features.safetensors``; a later round whose replay-selected pairs come
from round r reads them back instead of recomputing them (under ``preference_replay_mode: all_history`` round r
would otherwise run the backbone on every earlier round's responses again). A file whose fingerprint (the values
above, with a digest of the backbone's weights) differs from the current model's is not used. The file is one
(n, f) float32 tensor ``features``; its one metadata key ``store`` holds JSON of the fingerprint and the n rows'
digests (:func:`pbrl.learning.reward_model.row_digest`), in the tensor's row order.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from pbrl.data.storage import atomic_path
from pbrl.learning.joint_template import TEMPLATE_VERSION

FEATURES_FILE = "reward_features.safetensors"


def features_path(round_dir: Path) -> Path:
    """``rounds/<r>/reward_features.safetensors``."""
    return Path(round_dir) / FEATURES_FILE


def backbone_fingerprint(
    backbone: torch.nn.Module, *, source: str, pooling: str, backbone_layers: int | None, num_agents: int
) -> str:
    """What a frozen backbone's features depend on besides the row, as a JSON string: the joint template's version,
    the backbone ``source`` as configured, ``pooling``, ``backbone_layers``, ``num_agents`` and a sha256 of every
    parameter's name, shape, dtype and bytes (about a second for SmolLM2-135M's 10 layers, against a minute of
    fitting)."""
    digest = hashlib.sha256()
    with torch.no_grad():
        for name, param in backbone.named_parameters():
            digest.update(f"{name}:{tuple(param.shape)}:{param.dtype};".encode())
            digest.update(param.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return json.dumps(
        {
            "template": TEMPLATE_VERSION,
            "source": source,
            "pooling": pooling,
            "backbone_layers": backbone_layers,
            "num_agents": num_agents,
            "weights": digest.hexdigest(),
        },
        sort_keys=True,
    )


def save_features(path: Path, features: Mapping[str, torch.Tensor], fingerprint: str) -> None:
    """Write ``features`` (row digest → (f,) tensor) atomically with ``fingerprint``; an empty mapping writes
    nothing (and removes a file left by an earlier attempt)."""
    path = Path(path)
    if not features:
        path.unlink(missing_ok=True)
        return
    digests = sorted(features)  # a stable order: the same features write the same bytes
    tensor = torch.stack([features[d].detach().float().cpu() for d in digests]).contiguous()  # (n, f)
    # One metadata key: safetensors writes several keys in no fixed order, and the file's hash is a cache input.
    store = json.dumps({"fingerprint": fingerprint, "rows": digests}, sort_keys=True)
    with atomic_path(path) as tmp:
        save_file({"features": tensor}, tmp, metadata={"store": store})


def load_features(path: Path, fingerprint: str, *, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """The features stored at ``path`` (row digest → (f,) float32 on ``device``), or {} when there is no such file
    or it was written for another backbone, pooling, depth or template (its fingerprint differs)."""
    path = Path(path)
    if not path.is_file():
        return {}
    with safe_open(str(path), framework="pt") as handle:
        store = json.loads((handle.metadata() or {}).get("store", "{}"))
        if store.get("fingerprint") != fingerprint:
            return {}
        tensor = handle.get_tensor("features").to(device)  # (n, f)
    return dict(zip(store["rows"], tensor, strict=True))
