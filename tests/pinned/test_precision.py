"""Mixed precision (``pbrl/models/precision.py``) pinned where ``make mutate`` found behaviour no test checked
(docs/results/mutation.md#the-last-measured-run). Expectations are worked out by hand (torch's documented GradScaler
defaults, file names).

Wrong versions (mutmut ids of ``pbrl/models/precision.py``) made to fail here, by family:

- ``make_precision``: the device type of a ``no`` precision dropped, the fp16 scaler's defaults.
- ``autocast_problem``: the bfloat16-support clause taken without CUDA, or for fp16 (``and``/``or`` swaps).
- ``save_precision_state``: the agent folder not created with its parents; a failed write leaving a
  temporary file or replacing its error by the clean-up's (``missing_ok=False``); a file written without
  a scaler.
- ``load_precision_state``: a precision without a scaler read (``and``), an unsafe loader (``weights_only``).
- ``backward_and_step`` without clipping: the gradient norm not computed (``grads = None``, ``and False``), so a
  non-finite gradient is stepped; ``or True`` / ``torch.tensor(None)`` failing when no parameter has a gradient;
  ``zero_grad(set_to_none=False | None)`` first, so a stale gradient of a parameter the loss does not reach is
  stepped (AdamW then keeps state for it).
- ``pbrl.learning.madpo._agent_update`` with fp16 and gradient accumulation: the earlier micro-batches' gradients taken
  on the unscaled loss (``scaler = None``, ``... and False``, ``scale = 1.0``), so that float16 gradients below
  its smallest subnormal (6e-8) flush to zero.
"""

from __future__ import annotations

import datetime

import pytest
import torch

from pbrl.errors import ArtifactError
from pbrl.models.precision import (
    GRAD_SCALER_FILE,
    Precision,
    autocast_problem,
    backward_and_step,
    load_precision_state,
    make_precision,
    save_precision_state,
)


def test_make_precision_values():
    assert make_precision("no", "cpu") == Precision("no", "cpu", None)
    assert make_precision("no", torch.device("cpu")) == Precision("no", "cpu", None)
    assert make_precision("bf16", "cpu") == Precision("bf16", "cpu", None)
    fp16 = make_precision("fp16", "cpu")
    assert (fp16.mode, fp16.device_type) == ("fp16", "cpu")
    # torch.amp.GradScaler's documented defaults: scale 2^16, x2 after 2000 finite steps, /2 after an overflow.
    state = fp16.scaler.state_dict()
    assert fp16.scaler.is_enabled() and fp16.scaler.get_scale() == 2.0**16
    assert (state["growth_factor"], state["backoff_factor"], state["growth_interval"]) == (2.0, 0.5, 2000)


@pytest.mark.skipif(
    torch.cuda.is_available() and not torch.cuda.is_bf16_supported(),
    reason="this GPU lacks bfloat16: the clause under test applies",
)
def test_the_bfloat16_support_clause_needs_cuda_bf16_and_an_unsupporting_gpu():
    # Without CUDA (autocast then disables itself with a warning) or with a bf16-capable GPU: no problem, for
    # either mode; the "no bfloat16 support" answer is only for bf16 on a present GPU that lacks it.
    with pytest.warns(UserWarning) if not torch.cuda.is_available() else _nothing():
        assert autocast_problem("fp16", "cuda") is None
    with pytest.warns(UserWarning) if not torch.cuda.is_available() else _nothing():
        assert autocast_problem("bf16", "cuda") is None


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_save_creates_the_agent_folder_and_round_trips(tmp_path):
    precision = make_precision("fp16", "cpu")
    precision.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)  # a state that is not the initial one
    agent_dir = tmp_path / "ckpt" / "round_3" / "agent_1"
    save_precision_state(precision, agent_dir)
    assert sorted(p.name for p in agent_dir.iterdir()) == [GRAD_SCALER_FILE]
    fresh = make_precision("fp16", "cpu")
    load_precision_state(fresh, agent_dir)
    assert fresh.scaler.get_scale() == 2.0**10
    for without in (None, make_precision("no", "cpu"), make_precision("bf16", "cpu")):
        save_precision_state(without, tmp_path / "none")
    assert not (tmp_path / "none").exists()


class _FailingScaler:
    def state_dict(self):
        raise RuntimeError("boom")


def test_a_failed_save_leaves_no_file_and_keeps_its_error(tmp_path):
    precision = Precision("fp16", "cpu", _FailingScaler())
    with pytest.raises(RuntimeError, match="^boom$"):
        save_precision_state(precision, tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_load_reads_nothing_without_a_scaler_and_only_with_the_safe_loader(tmp_path):
    written = Precision("fp16", "cpu", torch.amp.GradScaler("cpu", init_scale=2.0**5))
    save_precision_state(written, tmp_path)
    for without in (None, make_precision("no", "cpu"), make_precision("bf16", "cpu")):
        assert load_precision_state(without, tmp_path) is None
    # A pickle with a global the safe loader does not allow is refused, never executed, and the file named.
    bad = tmp_path / "bad"
    bad.mkdir()
    state = make_precision("fp16", "cpu").scaler.state_dict()
    torch.save({**state, "written": datetime.date(2026, 1, 1)}, bad / GRAD_SCALER_FILE)
    with pytest.raises(ArtifactError, match=GRAD_SCALER_FILE):
        load_precision_state(make_precision("fp16", "cpu"), bad)


# ---------------------------------------------------------------------------------------------- backward_and_step
def test_without_clipping_a_non_finite_gradient_is_not_stepped():
    """max_grad_norm=None still checks the gradient norm: an infinite gradient (d/dw of w·inf) skips the step,
    the weight and the (empty) AdamW state stay; a finite one steps."""
    w = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    optimizer = torch.optim.AdamW([w], lr=0.1, weight_decay=0.0)
    loss = (w * torch.tensor([float("inf"), 1.0])).sum()
    assert backward_and_step(optimizer, loss, [w], max_grad_norm=None) is False
    assert w.tolist() == [1.0, 2.0] and not optimizer.state and w.grad is None
    assert backward_and_step(optimizer, (3.0 * w).sum(), [w], max_grad_norm=None) is True
    assert w.tolist() == pytest.approx([0.9, 1.9], abs=1e-6)  # Adam's first step: lr times the gradient's sign


def test_a_loss_that_reaches_no_parameter_steps_nothing_and_fails_nothing():
    """No parameter gets a gradient (norm 0, finite): True, nothing moves, AdamW keeps no state."""
    w = torch.nn.Parameter(torch.tensor([1.0]))
    free = torch.tensor([2.0], requires_grad=True)  # the loss depends on a tensor outside ``params`` only
    optimizer = torch.optim.AdamW([w], lr=0.1, weight_decay=0.0)
    assert backward_and_step(optimizer, (free * 5).sum(), [w], max_grad_norm=None) is True
    assert w.tolist() == [1.0] and not optimizer.state


def test_a_stale_gradient_of_an_unreached_parameter_is_dropped_not_stepped():
    """A parameter holding a gradient from before the call that the loss does not reach: set to None first, so
    AdamW (weight decay 0.5) neither decays it nor keeps state for it; the reached parameter steps."""
    used, unused = torch.nn.Parameter(torch.tensor([1.0])), torch.nn.Parameter(torch.tensor([1.0]))
    unused.grad = torch.tensor([7.0])
    optimizer = torch.optim.AdamW([used, unused], lr=0.1, weight_decay=0.5)
    assert backward_and_step(optimizer, (2.0 * used).sum(), [used, unused], max_grad_norm=None) is True
    assert unused.tolist() == [1.0] and unused not in optimizer.state
    assert used.tolist() == pytest.approx([1.0 * (1 - 0.1 * 0.5) - 0.1], abs=1e-6)  # decoupled decay, then -lr


# ---------------------------------------------------------------------------------------------- fp16 accumulation
def test_fp16_accumulation_keeps_gradients_that_would_underflow_unscaled(tiny_model_dir):
    """dpo_beta = 1e-8 makes the loss gradient at the float16 logits about beta/4 = 2.5e-9, below float16's
    smallest subnormal (6e-8): unscaled it flushes to zero. With the scaler's 2^16 every micro-batch's gradient
    survives, so a step over two one-pair micro-batches equals the float32 step (SGD, lr = 1/beta: the update is
    the gradient of the unit-beta loss) to float16 rounding; without the scale on the first micro-batch its half
    of the gradient would be lost (measured: 62 % relative error instead of 1.5 %)."""
    from pbrl.learning.madpo import PairBatch
    from pbrl.models.loading import load_policy
    from pbrl.models.policies import TrainablePolicy, trainable_parameters
    from tests.helpers import madpo_step

    beta = 1e-8
    batch = PairBatch(
        [[[2, 40, 41, 42, 3, 2, 50], [2, 60, 61, 3, 2, 50]]],
        [[[70, 71, 72, 3], [80, 81, 3]]],
        [[[90, 91, 3], [100, 101, 102, 103, 104]]],
    )

    def update(mode: str | None) -> torch.Tensor:
        model = load_policy(tiny_model_dir, checkpoint_dir=None, lora=None, dtype="float32", trainable=True)
        policy = TrainablePolicy(
            model,
            torch.optim.SGD(trainable_parameters(model), lr=1 / beta),
            pad_token_id=0,
            precision=None if mode is None else make_precision(mode, "cpu"),
        )
        before = [p.detach().clone() for p in model.parameters()]
        madpo_step([policy], batch, beta=beta, max_grad_norm=None, micro_batch_size=1)
        return torch.cat([(p.detach() - b).flatten() for p, b in zip(model.parameters(), before, strict=True)])

    exact, fp16 = update(None), update("fp16")
    assert float(exact.norm()) > 1.0  # the float32 step moves the weights
    assert float((fp16 - exact).norm() / exact.norm()) < 0.05
