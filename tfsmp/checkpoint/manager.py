"""`CheckpointManager`: SMP's checkpoint API over partition-independent, atomic checkpoints.

Example::

    ckpt = tf.train.Checkpoint(model=model, optimizer=optimizer, epoch=tf.Variable(0))
    manager = smp.CheckpointManager(ckpt, directory="/opt/ml/checkpoints", max_to_keep=3)
    manager.restore()                      # latest, if any (none: a logged no-op)
    for step, (x, y) in enumerate(data):
        train_step(x, y)
        if step % 100 == 0:
            manager.save()                 # every rank calls; returns ".../ckpt-N"

Unlike SMP (one TF checkpoint per ``mp_rank_<i>`` that restores only under the same
partitioning), a checkpoint here is keyed by variable path ([Note: checkpoint layout] in
`tfsmp.checkpoint.format`): written with p pipeline ranks and d replicas, it restores into q
pipeline ranks and e replicas (any number of stages), each rank reading only its own variables.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import keras

from tfsmp.checkpoint import format as fmt
from tfsmp.checkpoint import store
from tfsmp.checkpoint.checksum import CorruptFileError
from tfsmp.comm import collective_label
from tfsmp.errors import CheckpointError

__all__ = ["CheckpointManager"]

_LOG = logging.getLogger("tfsmp.checkpoint")


def _children(checkpoint: Any) -> dict[str, Any]:
    """The objects a ``tf.train.Checkpoint`` (or a plain dict) was built with, by name."""
    if isinstance(checkpoint, dict):
        return dict(checkpoint)
    children = getattr(checkpoint, "_trackable_children", None)
    if children is None:
        raise TypeError(
            f"CheckpointManager takes a tf.train.Checkpoint(model=..., optimizer=...). "
            f"Received: {type(checkpoint).__name__}.")
    return {k: v for k, v in children().items() if k != "save_counter"}


def _split(checkpoint: Any) -> tuple[Any, Any, dict[str, Any]]:
    """(DistributedModel, optimizer or None, {name: extra variable})."""
    from tfsmp.keras.model import DistributedModel

    model, optimizer, extras = None, None, {}
    for name, obj in _children(checkpoint).items():
        if isinstance(obj, DistributedModel):
            if model is not None:
                raise CheckpointError(
                    f"A checkpoint holds one DistributedModel. Received: a second one, "
                    f"{name!r}. Use one CheckpointManager per model.")
            model = obj
        elif isinstance(obj, keras.optimizers.Optimizer):
            optimizer = obj
        elif isinstance(obj, keras.Variable) or _is_tf_variable(obj):
            extras[name] = obj
        else:
            raise CheckpointError(
                f"A tfsmp checkpoint holds a DistributedModel, its optimizer and variables. "
                f"Received: {name}={type(obj).__name__}. Store Python values in a tf.Variable.")
    if model is None:
        raise CheckpointError(
            "The checkpoint must hold a DistributedModel. Received: none among "
            f"{sorted(_children(checkpoint))}. Pass tf.train.Checkpoint(model=dm, optimizer=opt).")
    return model, optimizer, extras


def _is_tf_variable(obj: Any) -> bool:
    import tensorflow as tf

    return isinstance(obj, tf.Variable)


class CheckpointManager:
    """Saves and restores a `DistributedModel`'s training state. See the module docstring.

    Args:
        checkpoint: ``tf.train.Checkpoint(model=dm, optimizer=opt, **variables)``.
        directory: Where checkpoints go (shared by every rank).
        max_to_keep: Keep at most this many checkpoints (None: all).
        checkpoint_name: Checkpoints are ``<directory>/<checkpoint_name>-<N>``.
    """

    def __init__(self, checkpoint: Any, directory: str = "/opt/ml/checkpoints",
                 max_to_keep: int | None = None, checkpoint_name: str = "ckpt") -> None:
        if max_to_keep is not None and (not isinstance(max_to_keep, int) or max_to_keep < 1):
            raise ValueError(f"max_to_keep must be a positive integer or None. Received: "
                             f"max_to_keep={max_to_keep!r}")
        self._checkpoint = checkpoint
        self._model, self._optimizer, self._extras = _split(checkpoint)
        from tfsmp.checkpoint.layout import resolve_sagemaker_path

        self._directory = resolve_sagemaker_path(os.fspath(directory))
        self._max_to_keep = max_to_keep
        self._name = checkpoint_name
        from tfsmp.runtime import preemption

        preemption.register_saver(self)  # fit saves it on a preemption signal

    def holds(self, model: Any) -> bool:
        """Whether this manager checkpoints ``model`` (a `DistributedModel`)."""
        return self._model is model

    @property
    def checkpoint(self) -> Any:
        return self._checkpoint

    @property
    def directory(self) -> str:
        return self._directory

    @property
    def max_to_keep(self) -> int | None:
        return self._max_to_keep

    @property
    def checkpoints(self) -> list[str]:
        """Complete checkpoints in the directory, oldest first."""
        return fmt.list_checkpoints(self._directory, self._name)

    @property
    def latest_checkpoint(self) -> str | None:
        """The newest complete checkpoint (what ``latest`` names), or None."""
        return fmt.read_latest(self._directory, self._name)

    def _next_number(self) -> int:
        numbers = [fmt.checkpoint_number(os.path.basename(p), self._name) or 0
                   for p in self.checkpoints]
        return max(numbers, default=0) + 1

    @collective_label("CheckpointManager.save")
    def save(self, checkpoint_number: int | None = None, position: dict[str, Any] | None = None
             ) -> str:
        """Writes ``<directory>/<checkpoint_name>-<N>``; every rank calls it.

        Args:
            checkpoint_number: N (default: one more than the highest existing).
            position: The training position to record, e.g. ``{"epoch": 2, "step": 0}``.

        Returns:
            The checkpoint's path (on every rank).
        """
        dm = self._model
        st = dm.runtime_state()
        number = checkpoint_number
        if number is None:
            number = st.comm.world.bcast_obj(self._next_number(), root=0)
        return store.save_state(dm, self._directory, f"{self._name}-{int(number)}",
                                optimizer=self._optimizer, extras=self._extras,
                                position=position, max_to_keep=self._max_to_keep,
                                prefix=self._name)

    @collective_label("CheckpointManager.restore")
    def restore(self, restore_prefix: str | None = None) -> str | None:
        """Restores ``restore_prefix`` (a name like ``"ckpt-2"`` or a path; None: the latest).

        Every rank calls it. Before the model is partitioned (e.g. at step 0) the model's
        variables that exist and the checkpoint's extra variables are restored at once (so
        ``get_weights``, ``save`` and reading a variable see them); the optimizer's state (and
        variables of a model built in `deferred_init`) follow right after partitioning.

        As SMP's, a restore with nothing to restore (no checkpoint yet, or ``restore_prefix``
        naming one that does not exist) changes nothing and logs a warning.

        Returns:
            The checkpoint's path, or None when there is none to restore.

        Raises:
            CheckpointError: ``restore_prefix`` names something that is not a tfsmp checkpoint
                (e.g. a TensorFlow one), or the checkpoint is bad (raised before any variable
                changes).
        """
        try:
            path = fmt.resolve(self._directory, self._name, restore_prefix)
        except CorruptFileError:  # a backup that looks present but cannot be used: reported
            raise
        except CheckpointError:
            if _exists_as_something(self._directory, restore_prefix):
                raise
            path = None
        if path is None:
            names = [os.path.basename(p) for p in self.checkpoints]
            what = "latest" if restore_prefix is None else repr(restore_prefix)
            _LOG.warning("No checkpoint restored: %s is not in '%s' (it holds %s). Training starts "
                         "from the model's current state.", what, self._directory,
                         names or "no checkpoints")
            return None
        self.restore_path(path)
        return path

    def restore_path(self, path: str) -> dict[str, Any]:
        """Restores the checkpoint at ``path``; returns its manifest."""
        from tfsmp.checkpoint import export

        dm = self._model
        if dm.rank_view is not None:
            manifest = store.restore_state(dm, path, optimizer=self._optimizer,
                                           extras=self._extras)
            _note_replicas(dm, manifest)
            return manifest
        manifest, done = store.restore_unpartitioned(dm, path, extras=self._extras)
        _note_replicas(dm, manifest)
        weights = dm.source_model().weights  # none yet: a subclass is built at partitioning
        rest_of_model = not weights or any(id(v) not in done for v in weights)
        if self._optimizer is not None or rest_of_model:
            optimizer = self._optimizer

            def apply(model: Any) -> None:
                store.restore_state(model, path, optimizer=optimizer, skip=done, rng=False)

            export.defer(dm, apply, weights=rest_of_model)
        return manifest


def _note_replicas(dm: Any, manifest: dict[str, Any]) -> None:
    """Logs when a checkpoint of d replicas is restored into another number of them (a job
    relaunched on fewer hosts): `fit` keeps the global batch, an `smp.step` loop does not."""
    st = dm.runtime_state()
    saved = (manifest.get("topology") or {}).get("dp_size")
    now = st.topology.dp_size
    if saved is None or int(saved) == now or st.rank != 0:
        return
    _LOG.warning(
        "Restored a checkpoint written by %d data-parallel replicas into %d. DistributedModel.fit "
        "keeps the global batch (batch_size is split over the replicas); an smp.step loop feeds "
        "each replica its own batch, so its global batch is now %d/%d of what it was: scale the "
        "per-replica batch or the learning rate if that matters.", int(saved), now, now,
        int(saved))


def _exists_as_something(directory: str, restore_prefix: str | None) -> bool:
    """Whether ``restore_prefix`` names an existing file or directory (or TF checkpoint prefix)
    that is not a tfsmp checkpoint: an error, unlike a checkpoint that does not exist (yet)."""
    if restore_prefix is None:
        return False
    for path in (str(restore_prefix), os.path.join(directory, str(restore_prefix))):
        if os.path.exists(path) or os.path.exists(path + ".index"):
            return True
    return False
