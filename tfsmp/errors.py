"""The exceptions tfsmp raises; each subclasses what a caller would already catch."""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "CommError",
    "ConfigError",
    "PartitionError",
    "ScheduleError",
    "StepError",
    "TfsmpError",
    "TraceError",
]


class TfsmpError(Exception):
    """Base class of every tfsmp error."""


class ConfigError(TfsmpError, ValueError):
    """A configuration value is invalid. Raised before any model work starts."""


class PartitionError(TfsmpError, ValueError):
    """A model cannot be split into the requested ordered stages."""


class TraceError(TfsmpError, ValueError):
    """A Keras model contains something the layer-graph tracer cannot see."""


class ScheduleError(TfsmpError, RuntimeError):
    """A pipeline schedule is malformed (ordering, pairing or buffers)."""


class CommError(TfsmpError, RuntimeError):
    """A communication call was used wrongly (bad group, rank or state)."""


class StepError(TfsmpError, RuntimeError):
    """A training or inference step was called with inputs it cannot run on."""


class CheckpointError(TfsmpError, ValueError):
    """A checkpoint is missing, corrupt, foreign, or does not match the model."""
