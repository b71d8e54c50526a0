"""Mixed precision of training (``mixed_precision: no | bf16 | fp16``, accelerate's names and meaning).

Trainable parameters stay float32 *master* weights (:func:`pbrl.models.loading.load_model`); inside a training forward
the matmuls run in the low-precision dtype under ``torch.autocast`` and the optimizer steps the float32
weights, so an update far below bfloat16's spacing (2^-7 at 1.0) still lands. ``fp16`` has 5 exponent bits:
its gradients can underflow, so the loss is scaled by a dynamic :class:`torch.amp.GradScaler` (scale 2^16,
halved on an overflowing step, which is then skipped; doubled after 2000 finite steps), whose state is saved
with the optimizer state so a resumed run is bitwise identical.

This is what ``accelerate.Accelerator(mixed_precision=...)`` does (``accelerator.autocast()`` is
``torch.autocast`` with these dtypes; its fp16 scaler is ``torch.amp.GradScaler``), but accelerate reads the
precision and the single device from its process-wide ``AcceleratorState``, while pbrl's agents may each sit on
their own device (``parallel_training: mp``). So the same pieces are used per agent here; the names are
accelerate's :class:`accelerate.utils.PrecisionType` values.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pbrl.errors import ArtifactError, ConfigError, Problem
from pbrl.models.threads import follow_load

MIXED_PRECISION = ("no", "bf16", "fp16")  # accelerate.utils.PrecisionType, without fp8 (needs extra kernels)
AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
GRAD_SCALER_FILE = "grad_scaler.pt"  # beside optimizer.pt in a round checkpoint's agent_<i>/ (fp16 only)


@dataclass
class Precision:
    """How one agent's training forwards and steps run.

    Attributes:
        mode: ``"no"`` (float32), ``"bf16"`` or ``"fp16"`` autocast.
        device_type: ``"cpu"`` or ``"cuda"`` ..., the autocast device type of the agent's model.
        scaler: the fp16 loss scaler; None for ``no`` and ``bf16`` (bfloat16 has float32's exponent range).
    """

    mode: str = "no"
    device_type: str = "cpu"
    scaler: torch.amp.GradScaler | None = None


def make_precision(mode: str, device: str | torch.device) -> Precision:
    """The :class:`Precision` of ``mode`` for a model whose inputs go to ``device``.

    Raises:
        ValueError: naming ``mixed_precision``, for an unknown mode, or one this torch cannot autocast on the
            device type (e.g. bf16 on a CUDA GPU without bfloat16 support).
    """
    if mode not in MIXED_PRECISION:
        raise ValueError(f"mixed_precision: got {mode!r}; allowed: {', '.join(MIXED_PRECISION)}")
    device_type = torch.device(device).type
    if mode == "no":
        return Precision("no", device_type, None)
    problem = autocast_problem(mode, device_type)
    if problem:
        raise ValueError(f"mixed_precision: got {mode!r}; {problem}")
    scaler = torch.amp.GradScaler(device_type) if mode == "fp16" else None
    return Precision(mode, device_type, scaler)


def autocast_problem(mode: str, device_type: str) -> str | None:
    """Why ``mode`` autocast cannot run on ``device_type`` with this torch, or None when it can (a preflight
    check: the device must be present for the CUDA bfloat16 test)."""
    if mode == "no":
        return None
    if not torch.amp.is_autocast_available(device_type):
        return f"this torch ({torch.__version__}) has no autocast on {device_type!r}; use mixed_precision: no"
    if device_type == "cuda" and mode == "bf16" and torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
        return "this GPU has no bfloat16 support; use fp16 (with loss scaling) or no"
    try:
        with torch.autocast(device_type, dtype=AUTOCAST_DTYPES[mode]):
            pass
    except (RuntimeError, ValueError) as exc:  # torch refuses the dtype on this device type
        return f"this torch ({torch.__version__}) cannot autocast {mode} on {device_type!r} ({exc}); use no"
    return None


def autocast(precision: Precision | None) -> contextlib.AbstractContextManager[Any]:
    """``torch.autocast`` in the precision's dtype; a no-op for ``no`` / None."""
    if precision is None or precision.mode == "no":
        return contextlib.nullcontext()
    return torch.autocast(precision.device_type, dtype=AUTOCAST_DTYPES[precision.mode])


def backward_and_step(
    optimizer: torch.optim.Optimizer,
    loss: torch.Tensor,
    params: list[torch.nn.Parameter],
    *,
    max_grad_norm: float | None,
    precision: Precision | None = None,
) -> bool:
    """One optimizer step on ``loss`` (a finite scalar): backward (scaled for fp16), gradient norm clipped to
    ``max_grad_norm`` (None: not clipped) on the true (unscaled) gradients, step, gradients cleared.

    Returns False, leaving ``params`` and the optimizer state untouched, when the gradient norm is not finite
    (with fp16 the scaler also halves its scale, as after any overflow); True when the step was taken.
    """
    follow_load()  # before the backward: a safe point to change torch's threads (pbrl/models/threads.py)
    scaler = precision.scaler if precision is not None else None
    optimizer.zero_grad(set_to_none=True)
    (scaler.scale(loss) if scaler is not None else loss).backward()
    if scaler is not None:
        scaler.unscale_(optimizer)  # true gradients for the clipping and the norm check
    if max_grad_norm is not None:
        norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    else:
        grads = [p.grad.norm() for p in params if p.grad is not None]
        norm = torch.linalg.vector_norm(torch.stack(grads)) if grads else torch.tensor(0.0)
    finite = bool(torch.isfinite(norm))
    if finite:
        if scaler is not None:
            scaler.step(optimizer)  # the unscale_ above already found the gradients finite: it steps
        else:
            optimizer.step()
    if scaler is not None:
        scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return finite


def save_precision_state(precision: Precision | None, agent_dir: Path) -> None:
    """Write the fp16 scaler's state to ``agent_dir / grad_scaler.pt`` atomically; nothing without a scaler."""
    if precision is None or precision.scaler is None:
        return
    path = Path(agent_dir) / GRAD_SCALER_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        torch.save(precision.scaler.state_dict(), tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def load_precision_state(precision: Precision | None, agent_dir: Path) -> None:
    """Restore the fp16 scaler from ``agent_dir / grad_scaler.pt`` (safe loader) when the checkpoint has one.

    A checkpoint written without fp16 (none, or the initial policy) has no file: the scaler keeps its initial
    state, as a fresh fp16 run would.

    Raises:
        ArtifactError: the file is there but unreadable, naming it.
    """
    if precision is None or precision.scaler is None:
        return
    path = Path(agent_dir) / GRAD_SCALER_FILE
    if not path.is_file():
        return
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # a truncated or foreign file
        raise ArtifactError(f"{path}: unreadable grad-scaler state ({exc})") from exc
    precision.scaler.load_state_dict(state)


# ---------------------------------------------------------------------------------------------- auto
AUTO = "auto"
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo flags of CPUs with bfloat16 arithmetic
# Overrides the CPU's flags for 'auto': 0 = as a CPU without bfloat16 arithmetic, 1 = as one with it. For a machine
# whose flags are hidden (some VMs and containers) and for reproducing a run of another CPU; the test suite sets 0
# so its hand-worked float32 values hold on any CPU (tests/conftest.py).
CPU_BF16_ENV = "PBRL_CPU_BF16"


@dataclass(frozen=True)
class PrecisionChoice:
    """What ``torch_dtype: auto`` and ``mixed_precision: auto`` resolve to on a device, and why."""

    torch_dtype: str
    mixed_precision: str
    reason: str


def _cpuinfo_value(key: str) -> str | None:
    """The value of the first ``key : value`` line of ``/proc/cpuinfo``; None where the line or the file (not
    Linux) is not there."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next((line.partition(":")[2].strip() for line in f if line.startswith(key)), None)
    except OSError:
        return None


def cpu_flags() -> set[str]:
    """The CPU's feature flags (``/proc/cpuinfo``); empty where that file is not there (not Linux)."""
    return set((_cpuinfo_value("flags") or "").split())


def cpu_model() -> str | None:
    """The CPU's model name (``/proc/cpuinfo``), None where it is not given: what benchmark results record, since
    machines of one name differ between sessions (with and without AVX-512 or AMX)."""
    return _cpuinfo_value("model name")


def native_bf16(device: str | torch.device) -> tuple[bool, str]:
    """Whether ``device`` computes bfloat16 natively, and a short reason: a CUDA GPU that supports it
    (compute capability 8.0 and up, ``torch.cuda.is_bf16_supported``), or a CPU whose flags include
    ``avx512_bf16`` or ``amx_bf16`` (the environment variable ``PBRL_CPU_BF16`` = 0 or 1 overrides the flags).

    Raises:
        ConfigError: ``PBRL_CPU_BF16`` is set to something other than 0 or 1.
    """
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return False, "no CUDA device is available"
        index = device.index if device.index is not None else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        ok = torch.cuda.is_bf16_supported()
        return ok, f"CUDA compute capability {major}.{minor} {'supports' if ok else 'lacks'} bfloat16"
    if device.type == "cpu":
        forced = os.environ.get(CPU_BF16_ENV, "").strip()
        if forced:
            if forced not in ("0", "1"):
                raise ConfigError([Problem(CPU_BF16_ENV, forced, "must be 0 or 1 (or unset: the CPU's flags decide)")])
            return forced == "1", f"{CPU_BF16_ENV}={forced}"
        found = sorted(cpu_flags().intersection(BF16_CPU_FLAGS))
        if found:
            return True, f"this CPU has {', '.join(found)}"
        return False, f"this CPU has none of {', '.join(BF16_CPU_FLAGS)}"
    return False, f"no bfloat16 detection for device type {device.type!r}"


def resolve_precision(torch_dtype: str, mixed_precision: str, device: str | torch.device) -> PrecisionChoice:
    """``auto`` settings made concrete for ``device`` (explicit settings are kept as they are).

    ``torch_dtype: auto`` is ``bfloat16`` where the device computes it natively, else ``float32``: frozen weights
    (sampling and evaluation copies, a LoRA base, comparators, references) then run their matmuls in bfloat16,
    while trainable weights stay float32 master weights. ``mixed_precision: auto`` is ``bf16`` autocast on a
    CUDA GPU with bfloat16 and ``no`` on a CPU: on CPUs autocast casts every weight on every forward, and measured
    no clear gain (docs/results/benchmarks.md).
    """
    native, why = native_bf16(device)
    dtype = ("bfloat16" if native else "float32") if torch_dtype == AUTO else torch_dtype
    is_cuda = torch.device(device).type == "cuda"
    mode = ("bf16" if native and is_cuda else "no") if mixed_precision == AUTO else mixed_precision
    return PrecisionChoice(dtype, mode, why)
