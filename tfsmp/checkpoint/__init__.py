"""Partition-independent, atomic checkpoints and plain-Keras export (names resolve lazily).

Example::

    manager = tfsmp.CheckpointManager(tf.train.Checkpoint(model=dm, optimizer=opt), "/ckpts")
    manager.save(); manager.restore()
    model.fit(x, y, callbacks=[tfsmp.checkpoint.BackupAndRestore("/ckpts/backup")])
    tfsmp.checkpoint.export_checkpoint("/ckpts", "model.keras")
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY: dict[str, str] = {
    "CheckpointManager": "tfsmp.checkpoint.manager",
    "BackupAndRestore": "tfsmp.checkpoint.callbacks",
    "export_checkpoint": "tfsmp.checkpoint.offline",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'tfsmp.checkpoint' has no attribute '{name}'")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
