"""The exceptions tfsmp raises; each subclasses what a caller would already catch. Also how
their messages quote a received value (`short_repr`) and suggest a name (`closest`,
`did_you_mean`), so that every layer says it alike."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any

__all__ = [
    "CheckpointError",
    "CommError",
    "ConfigError",
    "PartitionError",
    "ScheduleError",
    "StepError",
    "TfsmpError",
    "TraceError",
    "closest",
    "did_you_mean",
    "short_repr",
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


def short_repr(value: Any, limit: int = 120) -> str:
    """``repr(value)``, cut to ``limit`` characters so that junk input cannot flood a message."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def closest(word: Any, valid: Iterable[str]) -> str | None:
    """The valid name closest to ``word`` (difflib's ratio of at least 0.6), or None."""
    found = difflib.get_close_matches(str(word), list(valid), n=1)
    return found[0] if found else None


def did_you_mean(word: Any, valid: Iterable[str]) -> str:
    """`` Did you mean 'name'?`` for the closest valid name, or the empty string."""
    guess = closest(word, valid)
    return f" Did you mean {guess!r}?" if guess is not None else ""
