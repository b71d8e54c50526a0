"""The label deadline under Prefect (issue #52): ``pbrl serve``'s keeper resumes a suspended flow run whose round goes
on without labels (``judge_label_timeout_policy: continue``) once its deadline has passed, and no other."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

pytestmark = [pytest.mark.flow, pytest.mark.usefixtures("prefect_api")]


def test_the_deadline_keeper_resumes_only_suspended_runs_past_their_deadline():
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.states import Running, Suspended

    from flows.labels import DEADLINE_LABEL, resume_past_deadlines

    @flow
    def waits_for_labels() -> None:
        pass

    now = datetime.now(UTC)
    deadlines = {"past": now - timedelta(minutes=1), "future": now + timedelta(hours=1), "none": None, "running": now}
    ids = {}
    with get_client(sync_client=True) as client:  # a suspended flow run resumes only from a deployment
        flow_id = client.create_flow(waits_for_labels)
        deployment = client.create_deployment(flow_id=flow_id, name="labels-deadline", entrypoint="labels.py:waits")
        for name, deadline in deadlines.items():
            run = client.create_flow_run_from_deployment(deployment, name=f"labels-{name}")
            state = Running() if name == "running" else Suspended(timeout_seconds=7200, pause_key=f"pbrl-labels-{name}")
            client.set_flow_run_state(run.id, state, force=True)
            if deadline is not None:
                client.update_flow_run_labels(run.id, {DEADLINE_LABEL: deadline.isoformat()})
            ids[name] = str(run.id)
        resumed = resume_past_deadlines(now)
        states = {name: client.read_flow_run(run_id).state.type.value for name, run_id in ids.items()}
    assert ids["past"] in resumed and not {ids["future"], ids["none"], ids["running"]} & set(resumed), resumed
    assert states == {"past": "SCHEDULED", "future": "PAUSED", "none": "PAUSED", "running": "RUNNING"}
