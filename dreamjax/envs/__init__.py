"""Environments behind one text protocol: real adapters (imported lazily by name) and, later, the experience model."""

from dreamjax.envs.base import BatchEnv, Env, Observation, SerialBatchEnv, StepResult, Task
from dreamjax.envs.registry import ADAPTERS, make_env

__all__ = ["ADAPTERS", "BatchEnv", "Env", "Observation", "SerialBatchEnv", "StepResult", "Task", "make_env"]
