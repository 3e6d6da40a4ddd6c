"""`fit`'s fault tolerance: Keras's own BackupAndRestore, resume at the exact step, preemption.

Example (what `DistributedModel.fit` does with the user's callbacks)::

    callbacks = fit_callbacks(model, sample, user_callbacks)   # [head, *user_callbacks, tail]
    keras.Model.fit(model, x, y, callbacks=callbacks, ...)     # Keras's own fit runs them

    model.fit(x, y, epochs=3, callbacks=[keras.callbacks.BackupAndRestore("/ckpt/backup",
                                                                          save_freq=10)])

[Note: Keras's BackupAndRestore] ``keras.callbacks.BackupAndRestore`` (unchanged) needs a built
model, an optimizer it can build, ``save_weights``/``load_weights`` of a ``.weights.h5`` with the
optimizer's state, and ``model._initial_epoch``. tfsmp gives it all that, and more:

* *Built and partitioned first.* Before the callbacks' ``on_train_begin`` the head callback
  partitions the model (with the first batch, as the first step would), so the callback's
  ``optimizer.build(model.trainable_variables)`` finds the optimizer built with this rank's
  variables only and ``load_weights`` reads only this rank's arrays.
* *The exact step.* [Note: exact resume] Keras restarts an epoch from its first batch after a
  mid-epoch backup (its ``training_metadata.json`` keeps the batch, unread). tfsmp resumes at
  the step after the backup: `save_weights` writes the training position (``{"epoch": e,
  "step": s}``, s batches of epoch e done) into the weights file itself, as a root attribute
  that Keras ignores, and the tail callback hands it to ``fit`` (``model.resume_at``: Keras's
  ``model._initial_epoch`` and tfsmp's step). At that epoch's beginning the head callback asks
  the step functions to pass over its first s batches (``model.skip_batches``): Keras's loop
  then counts the epoch's batches from 0 and ends the shortened epoch when the data runs out
  (with Keras's "ran out of data" warning), while the positions written into backups count
  from s. Keras's own counters in the callback (``_current_epoch``, ``_last_batch_seen``) are
  set to match, so the resumed run backs up where an uninterrupted one would. The batches of a
  resumed epoch are the uninterrupted run's as long as the data order is deterministic
  (``keras.utils.set_random_seed`` or the ``seed`` parameter, or ``shuffle=False``; a dataset
  that yields the same order each time it is iterated).
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
import warnings
from typing import Any

import keras

from tfsmp import relaunch
from tfsmp.runtime import preemption

__all__ = ["POSITION_ATTR", "fit_callbacks", "read_position"]

_RAN_OUT = "Your input ran out of data"  # Keras's EpochIterator warning
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


def fit_callbacks(model: Any, sample: Any, callbacks: Any) -> list[Any]:
    """The user's callbacks between tfsmp's head and tail callbacks. See the module docstring.
    ``sample()`` returns a batch (or spec) to partition the model with before the first step."""
    user = user_callbacks(callbacks)
    head = _Head(sample, user)
    # Keras's CallbackList looks for a History and a ProgbarLogger among its callbacks; a
    # progress bar's peer on the other ranks keeps its place ([Note: a writer failing on rank 0])
    kept = [c for c in user if issubclass(getattr(c, "stands_for", type(c)),
                                          (keras.callbacks.History, keras.callbacks.ProgbarLogger))]
    shifted = [c for c in user if not any(c is k for k in kept)]
    return [head, *kept, *([_Shifted(shifted, head)] if shifted else []), _Tail(user)]


def user_callbacks(callbacks: Any) -> list[Any]:
    """The callbacks a user passed to ``fit``: a list, nested lists or a CallbackList."""
    if isinstance(callbacks, keras.callbacks.CallbackList):
        callbacks = callbacks.callbacks
    return list(keras.tree.flatten(callbacks)) if callbacks else []


def _keras_backups(callbacks: list[Any]) -> list[Any]:
    return [c for c in callbacks if isinstance(c, keras.callbacks.BackupAndRestore)]


def _world(model: Any) -> Any:
    view = model.rank_view
    return view.groups.world if view is not None else model.runtime_state().comm.world


class _Head(keras.callbacks.Callback):  # type: ignore[misc]
    """Runs before every user callback: prepares backups and checkpoint folders, tracks the
    position, and passes over a resumed epoch's trained batches ([Note: exact resume])."""

    def __init__(self, sample: Any, user: list[Any]) -> None:
        super().__init__()
        self._sample = sample
        self._backups = _keras_backups(user)
        self._partition_first = bool(self._backups) or _has_tfsmp_backup(user)
        self._checkpoints = [c for c in user if isinstance(c, keras.callbacks.ModelCheckpoint)]
        self._epoch = 0
        self.offset = 0  # batches of this epoch passed over (a resumed epoch)
        self._first_epoch = True

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        model = self.model
        setattr(model, _MODEL_ATTR, None)
        self._first_epoch = True
        world = _world(model)
        _make_checkpoint_folders(world, self._checkpoints)
        if not self._partition_first:
            return
        for backup in self._backups:
            _map_paths(backup)
            if world.rank != 0:
                backup.delete_checkpoint = False  # rank 0 deletes, after everyone is done
        if model.rank_view is None:
            model.partition(self._sample())
        if world.rank == 0:
            for backup in self._backups:
                os.makedirs(backup.backup_dir, exist_ok=True)
                _rewrite_metadata(backup)
        world.barrier()

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self._epoch, self.offset = epoch, 0
        if self._first_epoch:  # the tail callback (or tfsmp's backup) set where to resume
            self._first_epoch = False
            start_epoch, start_step = self.model.resume_position()
            if start_step and start_epoch == epoch:
                self.offset = start_step
                self.model.skip_batches(start_step)
                # the shortened epoch ends when the data does, which Keras warns of
                warnings.filterwarnings("ignore", message=_RAN_OUT)

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        position = {"epoch": self._epoch, "step": self.offset + batch + 1}
        setattr(self.model, _MODEL_ATTR, position)
        relaunch.publish_progress(position)

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        setattr(self.model, _MODEL_ATTR, {"epoch": epoch + 1, "step": 0})
        if self.offset:
            kept = [f for f in warnings.filters if f[1] is None or f[1].pattern != _RAN_OUT]
            warnings.filters[:] = kept  # type: ignore[index]

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        if self._partition_first:
            _world(self.model).barrier()  # every rank's last backup is written before deletion


_PLAIN_HOOKS = ("on_train_begin", "on_train_end", "on_epoch_begin", "on_epoch_end",
                "on_test_begin", "on_test_end", "on_predict_begin", "on_predict_end",
                "on_test_batch_begin", "on_test_batch_end", "on_predict_batch_begin",
                "on_predict_batch_end")


class _Shifted(keras.callbacks.Callback):  # type: ignore[misc]
    """The user's callbacks, in their order, with the batch index of a resumed epoch counted
    from the epoch's beginning ([Note: exact resume]): Keras's loop counts the batches it runs,
    from 0; a callback sees the batch's place in the epoch, as in an uninterrupted run."""

    def __init__(self, inner: list[Any], head: _Head) -> None:
        super().__init__()
        self.inner = inner
        self._head = head
        for hook in _PLAIN_HOOKS:
            setattr(self, hook, self._forward(hook))

    def _forward(self, hook: str) -> Any:
        def forward(*args: Any, **kwargs: Any) -> None:
            for c in self.inner:
                getattr(c, hook)(*args, **kwargs)
        return forward

    def set_model(self, model: Any) -> None:
        super().set_model(model)
        for c in self.inner:
            c.set_model(model)

    def set_params(self, params: Any) -> None:
        super().set_params(params)
        for c in self.inner:
            c.set_params(params)

    def on_train_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        for c in self.inner:
            c.on_train_batch_begin(self._head.offset + batch, logs)

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        for c in self.inner:
            c.on_train_batch_end(self._head.offset + batch, logs)


def _has_tfsmp_backup(callbacks: list[Any]) -> bool:
    from tfsmp.checkpoint.callbacks import BackupAndRestore

    return any(isinstance(c, BackupAndRestore) for c in callbacks)


def _make_checkpoint_folders(world: Any, checkpoints: list[Any]) -> None:
    """Creates ModelCheckpoint folders on world rank 0 first: ranks racing Keras's makedirs
    would otherwise fail on one rank while the others wait in the collective save."""
    if not checkpoints:
        return
    if world.rank == 0:
        for c in checkpoints:
            folder = os.path.dirname(str(c.filepath))
            if folder and "{" not in folder:
                os.makedirs(folder, exist_ok=True)
    world.barrier()


class _Tail(keras.callbacks.Callback):  # type: ignore[misc]
    """Runs after every user callback: the restored position, and preemption after each step."""

    def __init__(self, user: list[Any]) -> None:
        super().__init__()
        self._user = user
        self._backups = _keras_backups(user)
        self._listening = False

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

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        if self._listening and preemption.agreed(_world(self.model)):
            _save_and_exit(self.model, self._user)

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


def _save_and_exit(model: Any, callbacks: list[Any]) -> None:
    """Every rank: writes the configured backups at the position just reached, then exits 75."""
    from tfsmp.checkpoint.callbacks import BackupAndRestore
    from tfsmp.checkpoint.manager import CheckpointManager

    position = current_position(model) or {"epoch": 0, "step": 0}
    written: list[str] = []
    for c in callbacks:
        if isinstance(c, keras.callbacks.BackupAndRestore):
            c._current_epoch = position["epoch"]
            c._last_batch_seen = max(position["step"] - 1, 0)
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
