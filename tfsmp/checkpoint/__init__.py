"""Partition-independent, atomic checkpoints and plain-Keras export (names resolve lazily).

Example::

    manager = tfsmp.CheckpointManager(tf.train.Checkpoint(model=dm, optimizer=opt), "/ckpts")
    manager.save(); manager.restore()
    model.fit(x, y, callbacks=[tfsmp.checkpoint.BackupAndRestore("/ckpts/backup")])
    tfsmp.checkpoint.export_checkpoint("/ckpts", "model.keras")
"""

from __future__ import annotations

from typing import Any

from tfsmp.lazy import LazyNames

_LAZY: dict[str, str] = {
    "CheckpointManager": "tfsmp.checkpoint.manager",
    "BackupAndRestore": "tfsmp.checkpoint.callbacks",
    "CorruptFileError": "tfsmp.checkpoint.checksum",
    "export_checkpoint": "tfsmp.checkpoint.offline",
}

__all__ = sorted(_LAZY)


_NAMES = LazyNames(__name__, _LAZY)


def __getattr__(name: str) -> Any:
    return _NAMES.resolve(name)


def __dir__() -> list[str]:
    return _NAMES.listing()
