"""pbrl: multi-agent preference-based RL for cooperating LLM agents."""

import os

# OpenMP threads that wait for work sleep instead of spinning (pbrl/run/threads.py says why); set before torch
# loads its OpenMP runtime, which reads it once. A value the user set wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"
