"""``runner: ray``: the agents of a MADPO update-policies as Ray actors, one per agent
(docs/guides/ray.md#agents-as-ray-actors, issue #15).

Each :class:`AgentActor` loads its agent's trainable policy and AdamW state from the round's start checkpoint
(:func:`pbrl.models.policies.trainable_agent`, the code of the in-process path) and keeps them for the stage. Per batch
the driver runs :func:`pbrl.learning.madpo.madpo_agents_step` over :class:`RemoteAgent` handles with
``concurrent=True``:
every actor whose detached margins another agent needs (:func:`pbrl.learning.madpo.phase_one_agents`) computes
them in parallel, the driver sums the "others" terms, then every actor takes
its own step in parallel; at the end each actor writes its ``agent_<i>/`` (weights and optimizer state) into the
checkpoint's temporary folder. The numbers are the in-process update's (bitwise on CPU: the actor runs with the
driver's torch thread count), since each actor runs the same functions on the same inputs; in process agent 0's
detached margins are the ones its own training forward computes, the same values.

Resources: an actor whose agent's device (``agent_devices``) is a ``cuda`` device asks for that GPU (a share
of it, ``1/k``, when k agents name the same device) and loads on ``cuda:0``, the first GPU Ray gives it;
any other device asks for 1 CPU only (``agent_devices: auto`` is refused with ``runner: ray`` by the config
rules: Ray reserves named devices). The run folder must be on storage the
actors' nodes see (a shared POSIX filesystem), as for the shard tasks.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from pbrl.distributed.shards import RaySettings, ray_init_kwargs, require_ray_extra
from pbrl.learning.madpo import LocalAgent
from pbrl.models.loading import resolve_devices
from pbrl.models.policies import AgentTraining, PolicySource, trainable_agent, write_agent


def agent_resources(source: PolicySource) -> list[dict[str, float]]:
    """Ray resources of each agent's actor: ``{"num_cpus": 1}``, plus ``num_gpus`` when the agent's device (as the
    in-process run places it, :func:`placed_devices`) is a ``cuda`` device: 1 for a device of its own, ``1/k``
    for a device k agents share (so the actors ask Ray for one GPU per distinct device the agents use)."""
    devices = [cuda_device_name(d) for d in placed_devices(source)]
    sharing = Counter(d for d in devices if d is not None)
    return [{"num_cpus": 1, **({"num_gpus": 1 / sharing[d]} if d is not None else {})} for d in devices]


def placed_devices(source: PolicySource) -> list[str]:
    """Each agent's device as the in-process run places it (``source.devices``: ``agent_devices`` already placed by
    ``parallel_training``, :func:`pbrl.models.placement.placement_spec`), one per agent."""
    spec = source.devices
    return list(resolve_devices(list(spec) if isinstance(spec, tuple) else spec, source.num_agents))


def cuda_device_name(device: str) -> str | None:
    """``cuda:<k>`` for a CUDA device (``cuda`` alone is ``cuda:0``), None for anything else."""
    if device == "auto" or torch.device(device).type != "cuda":
        return None
    index = torch.device(device).index
    return f"cuda:{index or 0}"


class AgentActor:
    """One agent's trainable policy and AdamW, in a Ray actor (wrapped with ``ray.remote`` by
    :func:`remote_agents`). Its methods are the :class:`pbrl.learning.madpo.StepAgent` phases and the checkpoint
    write."""

    def __init__(self, training: AgentTraining, agent: int, start: str, num_threads: int) -> None:
        torch.set_num_threads(num_threads)  # the CPU Ray reserved for the actor (pbrl/models/threads.py)
        devices = placed_devices(training.source)
        if cuda_device_name(devices[agent]) is not None:
            # Ray numbers the GPUs it gave this actor from 0: the agent's device is this actor's cuda:0.
            devices[agent] = "cuda:0"
            training = dataclasses.replace(
                training, source=dataclasses.replace(training.source, devices=tuple(devices))
            )
        self.agent = agent
        self.local = LocalAgent(trainable_agent(training, Path(start), agent)[0])

    def has_dropout(self) -> bool:
        return self.local.has_dropout()

    def detached_margins(self, prompt_ids, winner_ids, loser_ids, seed, parts) -> torch.Tensor:
        return self.local.detached_margins(prompt_ids, winner_ids, loser_ids, seed, parts)

    def update(
        self, prompt_ids, winner_ids, loser_ids, others, seed, parts, *, beta, max_grad_norm
    ) -> tuple[torch.Tensor, bool]:
        return self.local.update(
            prompt_ids, winner_ids, loser_ids, others, seed, parts, beta=beta, max_grad_norm=max_grad_norm
        )

    def write(self, folder: str) -> None:
        """Write ``agent_<i>/`` (weights, optimizer state) into ``folder`` (the checkpoint's temporary folder)."""

        write_agent(self.local.policy, Path(folder) / f"agent_{self.agent}")


class RemoteAgent:
    """A :class:`pbrl.learning.madpo.StepAgent` whose phases run in an :class:`AgentActor`: each call returns a Ray
    object
    ref, turned into its result by :func:`gather` (``ray.get``)."""

    def __init__(self, handle: Any, dropout: bool) -> None:
        self.handle = handle
        self.dropout = dropout

    def has_dropout(self) -> bool:
        return self.dropout

    def detached_margins(self, prompt_ids, winner_ids, loser_ids, seed, parts) -> Any:
        return self.handle.detached_margins.remote(prompt_ids, winner_ids, loser_ids, seed, parts)

    def update(self, prompt_ids, winner_ids, loser_ids, others, seed, parts, *, beta, max_grad_norm) -> Any:
        return self.handle.update.remote(
            prompt_ids, winner_ids, loser_ids, others, seed, parts, beta=beta, max_grad_norm=max_grad_norm
        )


def gather(refs: list[Any]) -> list[Any]:
    """The results of a phase's object refs, in agent order (raises the first actor's error)."""
    import ray  # deferred: ray is an optional extra

    return ray.get(refs)


@contextlib.contextmanager
def remote_agents(training: AgentTraining, ray_settings: RaySettings, start: Path) -> Iterator[list[RemoteAgent]]:
    """One :class:`AgentActor` per agent of ``training.source``, loaded from ``start``, for the ``with`` block; the
    actors are ended on exit. Uses the Ray this process is connected to (:func:`flows.ray_runner.ray_session`), else
    connects for the block (``ray_settings.address``) and disconnects after.

    Raises:
        ConfigError: the 'ray' extra is not installed.
        ray.exceptions.RayActorError: an actor failed to load its agent (its error inside).
    """

    require_ray_extra("ray")
    import ray  # deferred: ray is an optional extra

    started = not ray.is_initialized()
    if started:
        ray.init(**ray_init_kwargs(ray_settings.address))
    handles = []
    try:
        actor = ray.remote(AgentActor)
        threads = 1  # each actor reserves 1 CPU (agent_resources): its torch uses that many threads
        handles = [
            actor.options(**resources).remote(training, agent, str(start), threads)
            for agent, resources in enumerate(agent_resources(training.source))
        ]
        dropouts = ray.get([h.has_dropout.remote() for h in handles])
        yield [RemoteAgent(h, d) for h, d in zip(handles, dropouts, strict=True)]
    finally:
        for handle in handles:
            ray.kill(handle)
        if started:
            ray.shutdown()


def write_agents(agents: list[RemoteAgent], folder: Path) -> None:
    """Every actor writes its ``agent_<i>/`` into ``folder``, in parallel; returns when all are written."""
    gather([agent.handle.write.remote(str(folder)) for agent in agents])
