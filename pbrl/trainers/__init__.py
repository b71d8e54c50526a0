"""The Python API (docs/guides/python-api.md#the-python-api), with the reference library's names::

    from pbrl.trainers import MADPOIterTrainer, MADPOIterConfig, TrainerCallback

The trainers are :mod:`pbrl.trainers.trainer`; their keyword arguments become config values in
:mod:`pbrl.trainers.arguments`, model objects and ``peft_config`` are handled in :mod:`pbrl.trainers.model_objects`,
and callbacks hear a run's events through :mod:`pbrl.trainers.callbacks`.
"""

from pbrl.config import MADPOConfig, MADPOIterConfig, MARLHFConfig, MARLHFIterConfig
from pbrl.config.dataset_spec import DatasetSpec
from pbrl.run.export import TrainedAgent, export_agents
from pbrl.trainers.callbacks import TrainerCallback
from pbrl.trainers.trainer import MADPOIterTrainer, MADPOTrainer, MARLHFIterTrainer, MARLHFTrainer, TrainResult

__all__ = [
    "MADPOConfig",
    "MADPOIterConfig",
    "MARLHFConfig",
    "MARLHFIterConfig",
    "DatasetSpec",
    "MADPOTrainer",
    "MADPOIterTrainer",
    "MARLHFTrainer",
    "MARLHFIterTrainer",
    "TrainResult",
    "TrainedAgent",
    "TrainerCallback",
    "export_agents",
]
