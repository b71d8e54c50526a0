"""Run events (pbrl.run.progress): what the front ends hear while a run goes on."""

from __future__ import annotations

import pytest

from pbrl.run import progress
from pbrl.run.progress import Event, Progress


def test_listeners_hear_every_event_and_a_broken_one_stops_nothing():
    heard: list[Event] = []

    def broken(event: Event) -> None:
        raise RuntimeError("a front end bug")

    stop_broken = progress.subscribe(broken)
    stop = progress.subscribe(heard.append)
    try:
        progress.publish(Event("stage_start", "run", 1, "build-pairs"))
        counter = Progress("run", 1, "sample-candidates", total=5, unit="rows", every=2)
        for _ in range(5):
            counter.advance()
    finally:
        stop()
        stop_broken()
    progress.publish(Event("run_end", "run"))  # nobody listens any more
    assert [(e.kind, e.stage, e.done, e.total) for e in heard] == [
        ("stage_start", "build-pairs", None, None),
        ("progress", "sample-candidates", 2, 5),
        ("progress", "sample-candidates", 4, 5),
        ("progress", "sample-candidates", 5, 5),  # the last unit is always shown
    ]


@pytest.mark.flow
@pytest.mark.usefixtures("prefect_api")
def test_a_training_run_publishes_every_kind_of_event_in_order(tiny_model_dir, tmp_path):
    from flows.training import train_flow
    from tests.helpers import tiny_job

    heard: list[Event] = []
    stop = progress.subscribe(heard.append)
    try:
        train_flow(tiny_job(tiny_model_dir, tmp_path, num_iterations=1))
    finally:
        stop()
    kinds = [e.kind for e in heard]
    assert kinds[0] == "run_start" and kinds[-1] == "run_end" and heard[-1].state == "Completed"
    assert [(e.kind, e.round) for e in heard if e.kind.startswith("round")] == [
        ("round_start", 0),
        ("round_end", 0),
        ("round_start", 1),
        ("round_end", 1),
    ]
    ends = [(e.round, e.stage, e.state) for e in heard if e.kind == "stage_end"]
    assert ends == [(0, "evaluate", "Completed")] + [
        (1, s, "Completed")
        for s in (
            "sample-candidates",
            "score-with-oracle",
            "build-pairs",
            "store-round",
            "replay-select",
            "update-policies",
            "evaluate",
        )
    ]
    rows = [e for e in heard if e.kind == "progress" and e.stage == "sample-candidates"]
    assert rows and rows[-1].done == rows[-1].total == 2 * 4 * 3 * 2  # agents x items x candidates x sides
    logs = [e for e in heard if e.kind == "log"]
    assert logs and all("madpo/loss" in e.metrics for e in logs)
    assert "eval_reward" in heard[[e.kind for e in heard].index("round_end", kinds.index("round_start", 1))].metrics
