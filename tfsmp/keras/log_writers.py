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

import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import keras
import numpy as np

from tfsmp.comm import collective_label
from tfsmp.errors import StepError

__all__ = ["LOG_WRITERS", "TensorBoardPeer", "on_this_rank", "tensorboard_views"]

LOG_WRITERS: tuple[type, ...] = (keras.callbacks.CSVLogger, keras.callbacks.RemoteMonitor,
                                 keras.callbacks.TensorBoard)


def on_this_rank(callbacks: list[Any], rank: int, model: Any = None, world: Any = None,
                 partitions: int = 1) -> list[Any]:
    """``callbacks`` less the log writers on every world rank but 0; at partitions > 1 a
    TensorBoard that logs weights leaves a `TensorBoardPeer` in its place ([Note:
    TensorBoard's weights])."""
    if rank == 0:
        return list(callbacks)
    out = []
    for c in callbacks:
        if partitions > 1 and _logs_weights(c):
            out.append(TensorBoardPeer(c, model, world))
        elif not isinstance(c, LOG_WRITERS):
            out.append(c)
    return out


# -- TensorBoard's weights ---------------------------------------------------------------------
#
# [Note: TensorBoard's weights] Keras's TensorBoard logs weight histograms (``histogram_freq``),
# weight images (``write_images``) and an embeddings projector (``embeddings_freq``) at the end
# of the epochs it is asked to, by reading every layer's weights (``self.model.layers``, each
# ``layer.weights``) and, for the projector, by ``self.model.save_weights``. At partitions > 1
# world rank 0, the one rank that runs TensorBoard ([Note: one writer of the logs]), holds only
# its own stages' weights. So at those epochs the other ranks run a `TensorBoardPeer` at
# TensorBoard's place in their callback list, and rank 0's TensorBoard runs Keras's own
# ``on_epoch_end`` with its model seen through a view whose layers' ``weights`` are the values
# gathered for that layer alone from the ranks that hold them (the lowest world rank holding a
# variable sends it): a layer at a time, so rank 0 never holds the whole model, and the events
# file has the tags and values plain Keras writes. The projector's ``save_weights`` is
# collective; rank 0 asks the peers to join it. Rank 0 ends every such epoch with a stop
# message that carries its error, if any (raised anywhere in TensorBoard's ``on_epoch_end``), so
# a peer never waits for a request that will not come and fails with rank 0's error, and a
# peer whose part failed (a failed save) still waits for the stop, so no message is left over
# to meet a later collective.

_STOP, _WEIGHTS, _SAVE = "stop", "weights", "save"
_LABEL = "TensorBoard's weights at an epoch's end"  # what the watchdog names ([Note: collective labels])
_TAG = 7301  # the gathered weights' messages on the world communicator


def _logs_weights_at(board: Any, epoch: int) -> bool:
    """Whether ``board`` reads the model's weights at the end of ``epoch`` (the conditions of
    Keras's TensorBoard.on_epoch_end for histograms, images and the projector)."""
    hist, emb = board.histogram_freq, board.embeddings_freq
    return bool((hist and epoch % hist == 0) or (emb and epoch % emb == 0))


def _logs_weights(board: Any) -> bool:
    return isinstance(board, keras.callbacks.TensorBoard) and bool(
        board.histogram_freq or board.embeddings_freq)


class _Owners:
    """Which world rank sends each weight of the model (the lowest one holding it). Made on
    every world rank alike (an allgather)."""

    def __init__(self, model: Any, world: Any) -> None:
        self.world = world
        self.variables = model.model_weights()
        self.index = {id(v): i for i, v in enumerate(self.variables)}
        sender: dict[int, int] = {}
        for rank, held in enumerate(world.allgather_obj(sorted(model.held_weights()))):
            for i in held:
                sender.setdefault(i, rank)
        self.sender = sender

    def send(self, indices: list[int]) -> None:
        """A peer's part of one request: the values it is the sender of."""
        rank = self.world.rank
        mine = {i: self.variables[i].numpy() for i in indices if self.sender.get(i) == rank}
        if mine:
            self.world.send_obj(mine, 0, _TAG)

    def gather(self, variables: list[Any]) -> list[_Weight]:
        """Rank 0's side: the values of ``variables``, asked of the ranks that send them."""
        wanted = [self.index.get(id(v)) for v in variables]
        remote = sorted({i for i in wanted if i is not None and self.sender.get(i, 0) != 0})
        got: dict[int, np.ndarray] = {}
        if remote:
            self.world.bcast_obj((_WEIGHTS, remote), root=0)
            for rank in sorted({self.sender[i] for i in remote}):
                got.update(self.world.recv_obj(rank, _TAG))
        out = []
        for v, i in zip(variables, wanted):
            value = np.asarray(got[i] if i in got else v.numpy()).view(_Weight)
            value.path = v.path
            out.append(value)
        return out


class _Weight(np.ndarray):
    """A gathered weight's value, with the variable's ``path`` (what TensorBoard names it by)."""

    path: str


class _LayerView:
    """A layer whose ``weights`` are their gathered values; everything else is the layer's."""

    def __init__(self, layer: Any, owners: _Owners) -> None:
        self._layer, self._owners = layer, owners

    @property
    def weights(self) -> list[_Weight]:
        return self._owners.gather(self._layer.weights)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._layer, name)


class _ModelView:
    """The model as rank 0's TensorBoard reads it at an epoch that logs weights."""

    def __init__(self, model: Any, owners: _Owners) -> None:
        self._model, self._owners = model, owners

    @property
    def layers(self) -> list[_LayerView]:
        return [_LayerView(layer, self._owners) for layer in self._model.layers]

    def save_weights(self, filepath: str, *args: Any, **kwargs: Any) -> None:
        self._owners.world.bcast_obj((_SAVE, None), root=0)
        self._model.save_weights(filepath, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


class TensorBoardPeer(keras.callbacks.Callback):  # type: ignore[misc]
    """Stands at a weight-logging TensorBoard's place on the ranks that do not run it, and
    serves its weights to world rank 0 ([Note: TensorBoard's weights])."""

    def __init__(self, board: Any, model: Any, world: Any) -> None:
        super().__init__()
        self.board, self.dm, self.world = board, model, world

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        if not _logs_weights_at(self.board, epoch):
            return
        with collective_label(_LABEL, api=False):
            body = self._serve()
        if body is not None:
            raise StepError(
                f"[{self.dm.runtime_state().tag()}] TensorBoard failed on world rank 0 at the "
                f"end of epoch {epoch}, while it logged the model's weights: {body}")

    def _serve(self) -> Any:
        """Answers rank 0's requests until its stop; returns rank 0's error text, if any (a
        failure of this rank's own part is raised after the stop)."""
        owners = _Owners(self.dm, self.world)
        failed: BaseException | None = None
        while True:
            kind, body = self.world.bcast_obj(None, root=0)
            if kind == _STOP:
                break
            try:
                if kind == _WEIGHTS:
                    owners.send(body)
                else:  # the projector's checkpoint: world rank 0 writes it
                    self.dm.save_weights(os.path.join(tempfile.gettempdir(), "unused.weights.h5"))
            except Exception as e:  # told after the stop: rank 0 ends the exchange
                failed = failed or e
        if failed is not None:
            raise failed
        return body


@contextmanager
def tensorboard_views(callbacks: list[Any], model: Any, world: Any,
                      partitions: int) -> Iterator[None]:
    """On world rank 0, for the block: each TensorBoard of ``callbacks`` writes the user's
    model's graph summary, and at partitions > 1 reads the weights it logs through the ranks
    that hold them ([Note: TensorBoard's weights]). Elsewhere does nothing."""
    boards = ([c for c in callbacks if isinstance(c, keras.callbacks.TensorBoard)]
              if world.rank == 0 else [])
    # Keras's TensorBoard reads its model as ``self.model``, which returns ``_model``; these
    # are its own methods, run unchanged on another model (noqa: SLF001 for its names)
    for board in boards:
        board._write_keras_model_summary = _summary(board, model)  # noqa: SLF001
        if partitions > 1 and _logs_weights(board):
            board.on_epoch_end = _epoch_end(board, model, world)
    try:
        yield
    finally:
        for board in boards:
            board.__dict__.pop("on_epoch_end", None)
            board.__dict__.pop("_write_keras_model_summary", None)


def _summary(board: Any, model: Any) -> Callable[[], None]:
    """Keras writes the model's config as the graph dashboard's conceptual graph for a
    Functional or Sequential model only, by its class's name; the `DistributedModel` is
    neither, so the wrapped model takes its place (the same JSON as plain Keras's)."""

    def write_keras_model_summary() -> None:
        kept = board._model  # noqa: SLF001
        board._model = model.source_model()  # noqa: SLF001
        try:
            type(board)._write_keras_model_summary(board)  # noqa: SLF001
        finally:
            board._model = kept  # noqa: SLF001

    return write_keras_model_summary


def _epoch_end(board: Any, model: Any, world: Any) -> Callable[..., None]:
    def on_epoch_end(epoch: int, logs: Any = None) -> None:
        if not _logs_weights_at(board, epoch):
            type(board).on_epoch_end(board, epoch, logs)
            return
        with collective_label(_LABEL, api=False):
            owners = _Owners(model, world)
            kept, error = board._model, None  # noqa: SLF001
            board._model = _ModelView(kept, owners)  # noqa: SLF001
            try:
                type(board).on_epoch_end(board, epoch, logs)
            except BaseException as e:
                error = f"{type(e).__name__}: {e}"
                raise
            finally:
                board._model = kept  # noqa: SLF001
                world.bcast_obj((_STOP, error), root=0)

    return on_epoch_end
