"""Mixed precision (``pbrl/precision.py``) pinned where ``make mutate`` found behaviour no test checked (README,
"Mutation testing"). Expectations are worked out by hand (torch's documented GradScaler defaults, file names).

Wrong versions (mutmut ids of ``pbrl/precision.py``) made to fail here, by family:

- ``make_precision``: the device type of a ``no`` precision dropped, the fp16 scaler's defaults.
- ``autocast_problem``: the bfloat16-support clause taken without CUDA, or for fp16 (``and``/``or`` swaps).
- ``save_precision_state``: the agent folder not created with its parents; a failed write leaving a
  temporary file or replacing its error by the clean-up's (``missing_ok=False``); a file written without
  a scaler.
- ``load_precision_state``: a precision without a scaler read (``and``), an unsafe loader (``weights_only``).
"""

from __future__ import annotations

import datetime

import pytest
import torch

from pbrl.errors import ArtifactError
from pbrl.precision import (
    GRAD_SCALER_FILE,
    Precision,
    autocast_problem,
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


@pytest.mark.skipif(torch.cuda.is_available() and not torch.cuda.is_bf16_supported(),
                    reason="this GPU lacks bfloat16: the clause under test applies")
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
