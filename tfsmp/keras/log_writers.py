"""Keras callbacks that send the logs out of the process: world rank 0 sends them, once.

Example::

    callbacks = on_this_rank([keras.callbacks.CSVLogger("log.csv")], rank=1)   # []

[Note: one writer of the logs] Every rank runs Keras's `fit` with the same callbacks and the
same logs (the step gives every rank the loss and metrics), so a callback that writes the logs
to a file or a server would write them once per rank: on a shared file system the ranks append
to one file (Keras's `CSVLogger` test found twice its rows), elsewhere each host keeps its own
copy. As Keras's progress bar prints on world rank 0 only, these callbacks run on world rank 0
only; the user's object is left untouched on the other ranks (it is not called there).
`TensorBoard` is one of them: every rank's writer put an events file of its own into the one
log folder, and TensorBoard then draws each scalar once per rank (as tf.keras's multi-worker
TensorBoard kept only the chief's logs). Its profiler therefore traces world rank 0's step.
Callbacks that save the model (`ModelCheckpoint`, `BackupAndRestore`) stay on every rank: their
saves are collective, and world rank 0 writes ([Note: Keras's saving functions] in
tfsmp/checkpoint/keras_saving.py).
"""

from __future__ import annotations

from typing import Any

import keras

__all__ = ["LOG_WRITERS", "on_this_rank"]

LOG_WRITERS: tuple[type, ...] = (keras.callbacks.CSVLogger, keras.callbacks.RemoteMonitor,
                                 keras.callbacks.TensorBoard)


def on_this_rank(callbacks: list[Any], rank: int) -> list[Any]:
    """``callbacks`` less the log writers on every world rank but 0."""
    if rank == 0:
        return list(callbacks)
    return [c for c in callbacks if not isinstance(c, LOG_WRITERS)]
