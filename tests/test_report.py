"""report.png and the round table behind it."""

from __future__ import annotations

import warnings

import numpy as np
import pandas as pd

from pbrl.reporting.report import write_report_png


def test_a_run_without_any_training_round_draws_without_warnings(tmp_path):
    """Issue #29: a legend warning ("No artists with labels") when no round trained."""
    table = pd.DataFrame({"eval_reward": [0.5], "eval_lo": [0.4], "eval_hi": [0.6], "loss": [np.nan],
                          "accuracy": [np.nan]}, index=[0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = write_report_png(tmp_path, table)
    assert out.is_file() and out.stat().st_size > 0
