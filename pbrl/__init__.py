"""pbrl: multi-agent preference-based RL for cooperating LLM agents."""

# OpenMP's wait policy is left as the user (or the OpenMP runtime) sets it: on an idle 2-core machine passive
# waiting made the demo round 1.35x slower (update-policies 74 -> 110 s; measured in
# docs/results/benchmarks.md#precision-the-sampling-path-and-threads), and what protects a shared machine is
# fitting the threads to the CPUs a process owns and leaving to other processes the CPUs they keep busy
# (pbrl/models/threads.py).

import os

# oneMKL's strict reproducibility mode: matrix products whose bits do not depend on the thread count, which the load
# follower changes (pbrl/models/threads.py). MKL reads it when it first runs, so it is set before anything else.
STRICT_MKL_CBWR = "AUTO,STRICT"
if not os.environ.get("MKL_CBWR"):  # unset or empty (MKL reads an empty value as unset)
    os.environ["MKL_CBWR"] = STRICT_MKL_CBWR

__version__ = "0.1.0"
