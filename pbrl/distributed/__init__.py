"""Scale-out with ``runner: ray``: shard plans and files, agents as Ray actors, rollouts on Ray workers."""
