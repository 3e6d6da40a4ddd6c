"""`fit`'s fault tolerance: Keras's own BackupAndRestore, resume at the exact step, preemption.

Example (what `DistributedModel.fit` does with the user's callbacks)::

    callbacks = fit_callbacks(model, source, user_callbacks)   # [head, *user_callbacks, tail]
    cb = keras.callbacks.CallbackList(callbacks, add_history=True, model=model, ...)

    model.fit(x, y, epochs=3, callbacks=[keras.callbacks.BackupAndRestore("/ckpt/backup",
                                                                          save_freq=10)])

[Note: Keras's BackupAndRestore] ``keras.callbacks.BackupAndRestore`` (unchanged) needs a built
model, an optimizer it can build, ``save_weights``/``load_weights`` of a ``.weights.h5`` with the
optimizer's state, and ``model._initial_epoch``. tfsmp gives it all that, and more:

* *Built and partitioned first.* Before the callbacks' ``on_train_begin`` the head callback
  partitions the model (with the first batch, as the first step would), so the callback's
  ``optimizer.build(model.trainable_variables)`` finds the optimizer built with this rank's
  variables only and ``load_weights`` reads only this rank's arrays.
* *The exact step.* Keras restarts an epoch from its first batch after a mid-epoch backup (its
  ``training_metadata.json`` keeps the batch, unread). tfsmp resumes at the step after the
  backup: `save_weights` writes the training position (``{"epoch": e, "step": s}``, s batches
  of epoch e done) into the weights file itself, as a root attribute that Keras ignores, and the
  tail callback hands it to ``fit`` (``model._initial_epoch`` / ``model._initial_step``). Keras's
  own counters in the callback (``_current_epoch``, ``_last_batch_seen``) are set to match, so
  the resumed run backs up where an uninterrupted one would and writes the right epoch into
  its metadata. The batches of a resumed epoch are the uninterrupted run's as long as the data
  order is deterministic (arrays with the ``seed`` parameter set, or ``shuffle=False``; a
  dataset that yields the same order each time it is iterated).
* *Never a wrong restore.* The position travels with the weights, written atomically
  (`export`), so a rank killed at any moment leaves the old pair or the new one. Keras writes
  ``training_metadata.json`` after the weights from every rank, without a temporary file; the
  head callback rewrites it from the weights file before Keras reads it, so a kill between the
  two writes, or in the middle of the second, cannot mislead it.
* *One rank deletes.* At the end of ``fit`` every rank would ``rmtree`` the backup directory;
  only world rank 0 does, after a barrier (the others' ``delete_checkpoint`` is turned off).
* *The container's paths.* In a local SageMaker-style job, ``/opt/ml/...`` backup directories
  point into the job directory, as tfsmp's own checkpoint paths do.

The tail callback also handles preemption ([Note: preemption] in tfsmp/runtime/preemption.py):
after each step it asks every rank whether one was signalled; if so, every configured backup —
Keras's or tfsmp's BackupAndRestore, else each live `CheckpointManager` of the model — is written
at the position just reached, and every rank exits with code 75 for the launcher to relaunch.
Every step's position is also published for the launcher ([Note: restart records] in
tfsmp/relaunch.py).
"""

from __future__ import annotations

import json
import os
from typing import Any

import keras

from tfsmp import relaunch
from tfsmp.runtime import preemption

__all__ = ["POSITION_ATTR", "fit_callbacks", "read_position"]

POSITION_ATTR = "tfsmp_fit_position"  # root attribute of a .weights.h5 written during fit
_MODEL_ATTR = "_tfsmp_fit_position"   # where fit's current position lives on the model


def read_position(weights_path: str) -> dict[str, int] | None:
    """The training position a `.weights.h5` was written at (None: none recorded, no file)."""
    import h5py

    if not os.path.isfile(weights_path):
        return None
    try:
        with h5py.File(weights_path, "r") as f:
            text = f.attrs.get(POSITION_ATTR)
    except OSError:
        return None
    if text is None:
        return None
    data = json.loads(text if isinstance(text, str) else bytes(text).decode())
    return {"epoch": int(data["epoch"]), "step": int(data["step"])}


def current_position(model: Any) -> dict[str, int] | None:
    """The position ``fit`` has reached (what a weights file written now records)."""
    position = getattr(model, _MODEL_ATTR, None)
    return dict(position) if position else None


def fit_callbacks(model: Any, source: Any, callbacks: Any) -> list[Any]:
    """The user's callbacks between tfsmp's head and tail callbacks. See the module docstring."""
    user = list(keras.tree.flatten(callbacks)) if callbacks else []
    return [_Head(source, user), *user, _Tail(user)]


def _keras_backups(callbacks: list[Any]) -> list[Any]:
    return [c for c in callbacks if isinstance(c, keras.callbacks.BackupAndRestore)]


def _world(model: Any) -> Any:
    view = model.rank_view
    return view.groups.world if view is not None else model.runtime_state().comm.world


class _Head(keras.callbacks.Callback):  # type: ignore[misc]
    """Runs before every user callback: prepares Keras's BackupAndRestore, tracks the position."""

    def __init__(self, source: Any, user: list[Any]) -> None:
        super().__init__()
        self._source = source
        self._backups = _keras_backups(user)
        self._epoch = 0

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        model = self.model
        setattr(model, _MODEL_ATTR, None)
        if not self._backups:
            return
        world = _world(model)
        for backup in self._backups:
            _map_paths(backup)
            if world.rank != 0:
                backup.delete_checkpoint = False  # rank 0 deletes, after everyone is done
        if model.rank_view is None:
            model.partition(_sample(self._source))
        if world.rank == 0:
            for backup in self._backups:
                os.makedirs(backup.backup_dir, exist_ok=True)
                _rewrite_metadata(backup)
        world.barrier()

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self._epoch = epoch

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        position = {"epoch": self._epoch, "step": batch + 1}
        setattr(self.model, _MODEL_ATTR, position)
        relaunch.publish_progress(position)

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        setattr(self.model, _MODEL_ATTR, {"epoch": epoch + 1, "step": 0})

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        if self._backups:
            _world(self.model).barrier()  # every rank's last backup is written before deletion


class _Tail(keras.callbacks.Callback):  # type: ignore[misc]
    """Runs after every user callback: the restored position, and preemption after each step."""

    def __init__(self, user: list[Any]) -> None:
        super().__init__()
        self._user = user
        self._backups = _keras_backups(user)
        self._listening = False
        self._epoch = 0

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        # Listen only where a preemption can be honoured with a checkpoint, or a launcher will
        # relaunch: elsewhere SIGTERM keeps its default meaning and steps pay nothing.
        self._listening = _can_back_up(self.model, self._user) and preemption.install()
        for backup in self._backups:  # Keras's on_train_begin restored from it, if anything
            position = read_position(backup._weights_path)
            if position is not None:
                _resume_at(self.model, backup, position)
        epoch, step = self.model.resume_position()
        start = {"epoch": epoch, "step": step}
        relaunch.publish_progress(start)

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self._epoch = epoch

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        if self._listening and preemption.agreed(_world(self.model)):
            _save_and_exit(self.model, self._user, self._epoch, batch)

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        if self._listening:
            preemption.uninstall()
            self._listening = False
        setattr(self.model, _MODEL_ATTR, None)


def _can_back_up(model: Any, callbacks: list[Any]) -> bool:
    """Whether a preemption in this fit is worth listening for: a backup callback or a
    `CheckpointManager` of the model exists, or a relaunching launcher runs the job."""
    from tfsmp.checkpoint.callbacks import BackupAndRestore
    from tfsmp.checkpoint.manager import CheckpointManager

    if relaunch.enabled() or any(isinstance(c, (keras.callbacks.BackupAndRestore,
                                                BackupAndRestore)) for c in callbacks):
        return True
    return bool(preemption.savers(lambda s: isinstance(s, CheckpointManager) and s.holds(model)))


def _map_paths(backup: Any) -> None:
    """Points a Keras BackupAndRestore under ``/opt/ml`` into a local SageMaker-style job."""
    from tfsmp.checkpoint.layout import resolve_sagemaker_path

    mapped = resolve_sagemaker_path(str(backup.backup_dir))
    if mapped == str(backup.backup_dir):
        return
    backup.backup_dir = mapped
    backup._weights_path = os.path.join(mapped, "latest.weights.h5")
    backup._training_metadata_path = os.path.join(mapped, "training_metadata.json")
    backup._prev_weights_path = backup._weights_path + ".bkp"
    backup._prev_training_metadata_path = backup._training_metadata_path + ".bkp"


def _sample(source: Any) -> Any:
    """A batch to partition with: the first batch of the data (arrays), or its element spec."""
    if source.arrays:
        x, _, _ = next(iter(source.epoch(0)))
        return x
    import tensorflow as tf

    spec = source.adapter.get_tf_dataset().element_spec
    x = spec[0] if isinstance(spec, tuple) else spec
    return tf.nest.map_structure(
        lambda s: keras.KerasTensor(tuple(s.shape), dtype=s.dtype.name), x)


def _metadata(position: dict[str, int]) -> dict[str, int]:
    """Keras's training_metadata.json for a position (``batch``: the last batch done)."""
    return {"epoch": position["epoch"], "batch": max(position["step"] - 1, 0)}


def _rewrite_metadata(backup: Any) -> None:
    """World rank 0: makes Keras's metadata agree with the weights file (atomically)."""
    position = read_position(backup._weights_path)
    if position is None:
        return
    path = backup._training_metadata_path
    with open(path + ".tmp", "w") as f:
        json.dump(_metadata(position), f)
    os.replace(path + ".tmp", path)


def _resume_at(model: Any, backup: Any, position: dict[str, int]) -> None:
    """Resume ``fit`` at ``position``, with Keras's counters where an uninterrupted run has them."""
    model.resume_at(position["epoch"], position["step"])
    backup._current_epoch = position["epoch"]
    backup._last_batch_seen = max(position["step"] - 1, 0)
    backup._batches_seen_since_last_saving = 0


def _save_and_exit(model: Any, callbacks: list[Any], epoch: int, batch: int) -> None:
    """Every rank: writes the configured backups at the position just reached, then exits 75."""
    from tfsmp.checkpoint.callbacks import BackupAndRestore
    from tfsmp.checkpoint.manager import CheckpointManager

    position = {"epoch": epoch, "step": batch + 1}
    written: list[str] = []
    for c in callbacks:
        if isinstance(c, keras.callbacks.BackupAndRestore):
            c._current_epoch, c._last_batch_seen = epoch, batch
            c._save_model()
            written.append(c._weights_path)
        elif isinstance(c, BackupAndRestore):
            written.append(c.backup_now(position))
    if not written:
        for manager in preemption.savers(
                lambda s: isinstance(s, CheckpointManager) and s.holds(model)):
            written.append(manager.save(position=position))
    world = _world(model)
    signalled = world.allgather_obj(preemption.signal_name())
    if preemption.requested():  # the launcher names who was preempted ([Note: restart records])
        relaunch.record_failure(f"rank {world.rank}", f"preempted ({preemption.signal_name()}); "
                                f"{'backup written' if written else 'nothing to back up'}")
    who = [f"rank {r} ({name})" for r, name in enumerate(signalled) if name]
    what = f"wrote {', '.join(written)}" if written else "no backup or CheckpointManager to write"
    message = (f"[tfsmp] preempted by {', '.join(who)} {relaunch.format_position(position)}: "
               f"{what}; exiting with code {relaunch.RELAUNCH_EXIT_CODE} to be relaunched")
    preemption.exit_for_relaunch(message if world.rank == 0 else None)
