"""`BackupAndRestore`: resume an interrupted `DistributedModel.fit` exactly where it stopped.

Example::

    backup = tfsmp.checkpoint.BackupAndRestore("/opt/ml/checkpoints/backup")
    model.fit(x, y, epochs=10, callbacks=[backup])   # killed during epoch 6 ...
    model.fit(x, y, epochs=10, callbacks=[backup])   # ... a new job resumes at epoch 6

Keras's own ``keras.callbacks.BackupAndRestore`` saves weights only; this one saves the whole
training state through `CheckpointManager` (weights, optimizer slots and iterations, random
generator state) plus the training position, and restores it under any partitioning. The epoch
to resume from and the step within it are handed to ``fit`` through
``DistributedModel.resume_at`` (Keras's own callback sets ``model._initial_epoch``).
"""

from __future__ import annotations

import shutil
from typing import Any

import keras

from tfsmp.checkpoint import format as fmt

__all__ = ["BackupAndRestore"]


class BackupAndRestore(keras.callbacks.Callback):  # type: ignore[misc]
    """Backs up the training state during ``fit`` and restores it when ``fit`` starts again.

    Args:
        backup_dir: Directory for the backups (shared by every rank).
        save_freq: ``"epoch"`` (after every epoch) or an int N (every N batches, too).
        delete_checkpoint: Delete the backups when ``fit`` completes.
    """

    def __init__(self, backup_dir: str, save_freq: str | int = "epoch",
                 delete_checkpoint: bool = True) -> None:
        super().__init__()
        if save_freq != "epoch" and (not isinstance(save_freq, int) or save_freq < 1):
            raise ValueError(f'save_freq must be "epoch" or a positive int. Received: '
                             f"save_freq={save_freq!r}")
        self.backup_dir = str(backup_dir)
        self.save_freq = save_freq
        self.delete_checkpoint = delete_checkpoint
        self.restored_position: dict[str, int] | None = None
        self._manager: Any = None
        self._epoch = 0
        self._batches = 0

    def _get_manager(self) -> Any:
        from tfsmp.checkpoint.manager import CheckpointManager

        if self._manager is None:
            model = self.model
            self._manager = CheckpointManager(
                {"model": model, "optimizer": model.optimizer}, directory=self.backup_dir,
                max_to_keep=1, checkpoint_name="backup")
        return self._manager

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        manager = self._get_manager()
        latest = manager.latest_checkpoint
        world = self.model.runtime_state().comm.world
        if world.bcast_obj(latest, root=0) is None:
            return
        position = dict(fmt.read_manifest(latest).get("position") or {})
        manager.restore_path(latest)
        epoch, step = int(position.get("epoch", 0)), int(position.get("step", 0))
        self.restored_position = {"epoch": epoch, "step": step}
        self.model.resume_at(epoch, step)
        self._epoch = epoch
        # save_freq counts batches since fit began: on from where the uninterrupted run was
        per_epoch = (self.params or {}).get("steps") or 0
        self._batches = epoch * int(per_epoch) + step

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self._epoch = epoch

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        if self.save_freq == "epoch":
            return
        self._batches += 1
        if self._batches % int(self.save_freq) == 0:
            from tfsmp.checkpoint.fit_resume import current_position

            # fit's position counts a resumed epoch's passed-over batches too ([Note: exact
            # resume] in fit_resume); Keras's ``batch`` counts from where this fit began
            self.backup_now(current_position(self.model) or {"epoch": self._epoch,
                                                              "step": batch + 1})

    def backup_now(self, position: dict[str, int]) -> str:
        """Writes a backup at ``position`` now (every rank calls); returns its path. ``fit`` calls
        it when a preemption signal arrives ([Note: preemption] in tfsmp/runtime/preemption.py)."""
        return str(self._get_manager().save(position=dict(position)))

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self.backup_now({"epoch": epoch + 1, "step": 0})

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        if not self.delete_checkpoint:
            return
        world = self.model.runtime_state().comm.world
        world.barrier()
        if world.rank == 0:
            shutil.rmtree(self.backup_dir, ignore_errors=True)
        world.barrier()
