"""Shared fixtures. Tiers: ``pytest`` alone runs the fast unit and stage tests; ``make test`` (and CI) also
runs the ``flow`` tests (Prefect test harness, one per session) and the ``slow`` ones (real SmolLM2).

Where tests live: ``unit/<package>/`` tests one package of ``pbrl`` (``front_doors/``: the CLI, the trainer API and
callbacks; ``stages/``, ``flows/`` and ``benchmarks/``: those folders), on the tiny model, stages called directly;
``flow/`` runs whole jobs under Prefect; ``browser/`` drives the Prefect UI in Chromium (its fixtures in its own
conftest); ``pinned/`` pins what ``make mutate`` found unchecked (docs/results/mutation.md); ``repo/`` checks the
docs, the README and the shape of the code. Builders shared by several folders are in ``helpers.py``.

Prefect reads its settings at import, so they are set here, before anything imports it: an isolated
PREFECT_HOME, no telemetry, no user profile or server.

The suite runs in the precision ``torch_dtype: auto`` picks on this machine, as a user's run does: bfloat16 on a CPU
with bfloat16 arithmetic, float32 elsewhere (``PBRL_CPU_BF16=1`` or ``0`` in the environment runs it as on the other
kind of CPU). A test that needs float32's hand-worked values asks for float32 itself; a pinned result that differs
by precision is pinned for both (docs/design/architecture.md#what-is-bitwise).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

_PREFECT_HOME = tempfile.mkdtemp(prefix="pbrl-test-prefect-")
for _key in ("PREFECT_API_URL", "PREFECT_API_KEY", "PREFECT_PROFILE"):
    os.environ.pop(_key, None)
os.environ.update(
    {
        "PREFECT_HOME": _PREFECT_HOME,
        "DO_NOT_TRACK": "1",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "90",
        "PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW": "ignore",
        "PREFECT_LOGGING_LEVEL": "WARNING",
        "PREFECT_LOGGING_EXTRA_LOGGERS": "pbrl",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
)

import pytest  # noqa: E402

from pbrl.models.tiny import build_tiny_model  # noqa: E402


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The browser tests run last (pytest would take ``tests/browser/`` first): their session fixture ``ui``, a Prefect
    server and ``pbrl serve``, would otherwise keep running beside every later test."""
    items.sort(key=lambda item: item.nodeid.startswith("tests/browser/"))  # stable: the rest keep their order


@pytest.fixture(autouse=True)
def _no_load_follower_after_a_test():
    """A flow a test runs starts torch's load follower in this process (pbrl/models/threads.py): the next test
    starts without one, with the thread count of before."""
    import torch

    from pbrl.models import threads

    before = torch.get_num_threads()
    yield
    threads._follower = None
    if torch.get_num_threads() != before:
        torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Folder of the tiny Llama model + tokenizer (vocab 320, pad id 0, EOS id 3 ``<|im_end|>``, ChatML)."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def prefect_api():
    """One Prefect test server for the whole session (opt-in: pure tests never pay for it). The flow
    heartbeat is off in tests only (it costs ~1 s per flow run)."""
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings
    from prefect.testing.utilities import prefect_test_harness

    with (
        temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}),
        prefect_test_harness(server_startup_timeout=90),
    ):
        yield
