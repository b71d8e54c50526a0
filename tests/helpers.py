"""Small builders shared by the stage, trainer and flow tests."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pbrl.config import JobConfig, parse_job
from pbrl.run.folder import open_job, prepare_run


def tiny_job(model_dir: Path, output_dir: Path, **overrides: Any) -> JobConfig:
    """A small madpo_iter job on the toy task (4 items, 3 candidates, 8 new tokens)."""
    data: dict[str, Any] = {
        "trainer": "madpo_iter",
        "task": "toy",
        "task_options": {"num_items": 4},
        "agent_model": str(model_dir),
        "run_name": "run",
        "output_dir": str(output_dir),
        "num_iterations": 2,
        "preference_num_candidates": 3,
        "preference_pairs_per_sample": 2,
        "max_new_tokens": 8,
        "temperature": 1.0,
        "top_p": 1.0,
        "agent_learning_rate": 1e-3,
        "eval_num_samples": 2,
        "train_batch_size": 2,
    }
    data.update(overrides)
    return parse_job(data)


def new_run(model_dir: Path, output_dir: Path, **overrides: Any) -> tuple[Path, JobConfig]:
    """A new tiny run's folder and its job as stored (``auto`` settings resolved), the job every front end runs."""
    run_dir = prepare_run(tiny_job(model_dir, output_dir, **overrides), resume=False)
    return run_dir, open_job(run_dir)


def short_prompt(item: dict) -> str:
    """A formatter importable as ``tests.helpers:short_prompt`` (config import-path tests)."""
    return f"Say one word about {item['topic']}."


def long_prompt(item: dict) -> str:
    return f"Say two sentences about {item['topic']}."


# Artifacts two equivalent runs must share, byte for byte (the MADPO ones; MARLHF adds its own patterns).
RUN_ARTIFACTS = (
    "rounds/*/candidates.parquet",
    "rounds/*/scores.parquet",
    "rounds/*/pairs.parquet",
    "rounds/*/selected_pairs.parquet",
    "rounds/*/eval.parquet",
    "replay/iteration_*.json",
    "checkpoints/round_*/agent_*/*.safetensors",
)


def run_artifacts(
    run_dir: Path, patterns: tuple[str, ...] = RUN_ARTIFACTS, *, trainer_state: bool = False
) -> dict[str, object]:
    """Every artifact of ``run_dir`` matching ``patterns`` (bytes), each AdamW state (tensors, step counts
    included) and, with ``trainer_state``, each round's (round, optimizer_steps)."""
    import torch

    from pbrl.data.storage import read_json

    out: dict[str, object] = {}
    for pattern in patterns:
        for f in sorted(run_dir.glob(pattern)):
            out[f.relative_to(run_dir).as_posix()] = f.read_bytes()
    for f in sorted(run_dir.glob("checkpoints/round_*/agent_*/optimizer.pt")):
        state = torch.load(f, weights_only=True)
        out[f.relative_to(run_dir).as_posix()] = {(k, n): v for k, st in state["state"].items() for n, v in st.items()}
    if trainer_state:
        for f in sorted(run_dir.glob("checkpoints/round_*/trainer_state.json")):
            state = read_json(f)
            out[f.relative_to(run_dir).as_posix()] = (state["round"], state["optimizer_steps"])
    return out


def assert_same_artifacts(a: dict, b: dict) -> None:
    """Equal keys, equal bytes, equal tensors (exactly)."""
    import torch

    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())
    for key in a:
        if isinstance(a[key], dict):
            assert a[key].keys() == b[key].keys(), key
            for k in a[key]:
                va, vb = a[key][k], b[key][k]
                assert torch.equal(va, vb) if torch.is_tensor(va) else va == vb, (key, k)
        else:
            assert a[key] == b[key], key


def lora_dropout_policy(model_dir: Path, tmp_path: Path, seed: int = 0):
    """The tiny model with a LoRA adapter (r=4, dropout 0.5) whose B weights are 0.1, so the adapter path,
    where the dropout sits, changes the output; trainable, with SGD at lr 0 (the weights never move)."""
    import torch

    from pbrl.models.loading import init_lora_adapter, load_policy
    from pbrl.models.lora import LoraSettings
    from pbrl.models.policies import TrainablePolicy, trainable_parameters

    lora = LoraSettings(r=4, dropout=0.5)
    adapter = init_lora_adapter(model_dir, lora, tmp_path / f"adapter{seed}", seed=seed)
    model = load_policy(model_dir, checkpoint_dir=adapter, lora=lora, trainable=True)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.fill_(0.1)
    return TrainablePolicy(model, torch.optim.SGD(trainable_parameters(model), lr=0.0), 0)


def logprob_alone(model, prompt: list[int], completion: list[int]) -> float:
    """log π(completion | prompt) by brute force: one unpadded forward pass of the one row, float64
    ``log_softmax``, the sum of every completion token's log-prob (nats). The reference the scoring code is
    checked against, so it shares none of that code. A bfloat16 model computes the row as its row-invariant
    forwards do (pbrl/models/row_invariance.py), the arithmetic that ``rows_alone`` scoring promises."""
    import contextlib

    import torch

    from pbrl.models import row_invariance

    ids = torch.tensor([prompt + completion])
    alone = row_invariance.row_invariant(model) if row_invariance.applies(model) else contextlib.nullcontext()
    with torch.no_grad(), alone:
        logp = torch.log_softmax(model(input_ids=ids).logits[0].double(), dim=-1)  # (t, v)
    return sum(float(logp[len(prompt) - 1 + j, tok]) for j, tok in enumerate(completion))


def tiny_policies(model_dir: Path, lora=None, lr: float = 1e-2, adapter_root: Path | None = None, n: int = 2):
    """``n`` trainable float32 CPU agents of the tiny model, AdamW at ``lr`` (no weight decay), pad id 0; with
    ``lora`` (a :class:`pbrl.models.lora.LoraSettings`) each gets its own adapter ``adapter_root/agent_<i>``
    initialised from seed i."""
    import torch

    from pbrl.models.loading import init_lora_adapter, load_policy
    from pbrl.models.policies import TrainablePolicy, trainable_parameters

    out = []
    for seed in range(n):
        adapter = init_lora_adapter(model_dir, lora, adapter_root / f"agent_{seed}", seed=seed) if lora else None
        model = load_policy(model_dir, checkpoint_dir=adapter, lora=lora, device="cpu", dtype="float32", trainable=True)
        out.append(
            TrainablePolicy(
                model, torch.optim.AdamW(trainable_parameters(model), lr=lr, weight_decay=0.0), pad_token_id=0
            )
        )
    return out


# The all-ties reward: task toy with reward_func CONSTANT_REWARD (every comparison a tie).
CONSTANT_REWARD = "tests.helpers:constant_reward"


def constant_reward(
    *completions: Sequence[str],
    prompts: Sequence[Sequence[str]] | None = None,
    batch_items: Sequence[dict[str, Any]] | None = None,
) -> list[float]:
    """1.0 for every joint response: every pair is a tie (tests the all-ties path). Same arguments as
    :func:`pbrl.tasks.toy.toy_reward`."""
    sizes = {len(agent) for agent in completions}
    assert len(sizes) == 1, sizes
    return [1.0] * sizes.pop()


def register_deployments(**kwargs: Any) -> dict[str, Any]:
    """Create or update pbrl's deployments on the server at PREFECT_API_URL without serving them:
    ``{"<flow>/<deployment>": deployment id}``, e.g. ``ids["pbrl-train/madpo-iter"]``."""
    from flows.serve import build_deployments

    return {f"{d.flow_name}/{d.name}": d.apply() for d in build_deployments(**kwargs)}


def madpo_step(policies: Sequence[Any], batch: Any, **kwargs: Any) -> Any:
    """One MADPO step of in-process policies: :func:`pbrl.learning.madpo.madpo_agents_step` over
    :class:`~pbrl.learning.madpo.LocalAgent` s (what update-policies runs without Ray)."""
    from pbrl.learning.madpo import LocalAgent, madpo_agents_step

    return madpo_agents_step([LocalAgent(p) for p in policies], batch, **kwargs)


BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@contextmanager
def benchmark_script(name: str) -> Iterator[Any]:
    """The module of ``benchmarks/<name>.py``, importable while the block runs (the scripts import their helper
    module ``benchkit`` from their own folder)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCHMARKS))
