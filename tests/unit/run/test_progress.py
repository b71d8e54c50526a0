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


def test_each_event_reads_as_one_line():
    from pbrl.run.progress import describe

    assert describe(Event("stage_start", "r", 1, "build-pairs")) == "round 1 build-pairs: started"
    assert (
        describe(Event("stage_end", "r", 1, "build-pairs", state="Completed", seconds=2.25, counts={"pairs": 16}))
        == "round 1 build-pairs: done in 2.2 s (pairs 16)"
    )
    assert describe(Event("stage_end", "r", 2, "evaluate", state="Cached")) == "round 2 evaluate: cached"
    assert describe(Event("progress", "r", 1, "sample-candidates", done=24, total=48, unit="rows")) == (
        "round 1 sample-candidates: 24/48 rows"
    )
    assert describe(Event("log", "r", 1, "update-policies", step=3, metrics={"madpo/loss": 0.69314})) == (
        "round 1 update-policies step 3: madpo/loss 0.6931"
    )
    assert (
        describe(
            Event(
                "round_end",
                "r",
                3,
                seconds=271,
                metrics={
                    "eval_reward": 2.6,
                    "eval_lo": 2.44,
                    "eval_hi": 2.75,
                    "paired": 0.44,
                    "paired_lo": 0.2,
                    "paired_hi": 0.65,
                },
            )
        )
        == "round 3: done in 271 s — eval 2.6 [2.44, 2.75], paired gain +0.44 [+0.2, +0.65]"
    )
    assert describe(Event("run_end", "runs/x", state="Completed", seconds=60)) == "run runs/x: completed after 60 s"
