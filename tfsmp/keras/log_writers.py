"""Keras callbacks that send the logs out of the process: world rank 0 runs them, once.

Example::

    mine, end, guarded = plan_callbacks([keras.callbacks.CSVLogger("log.csv")], verbose, True,
                                        model, world, partitions, "fit")
    # on world rank 1: mine == [WriterPeer(CSVLogger)], which meets rank 0 at each of
    # CSVLogger's hooks; on rank 0 the CSVLogger itself, run under writer_guards(...)

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

[Note: a writer failing on rank 0] Running a callback on one rank makes its failures that
rank's alone: a `CSVLogger` that cannot open its file, a progress bar whose pipe was closed,
a TensorBoard that cannot write raise on world rank 0 and leave `fit` there, while the other
ranks go on into the next step's collectives and wait for a rank that is no longer coming
(until the process exits or the watchdog's limit). So a writer's failure is made every rank's:
on the other ranks a `WriterPeer` stands at the writer's place in the callback list, and at
each hook the writer implements (its class overrides Keras's empty default), rank 0 runs the
writer and then broadcasts a stop message carrying its error, if any, which the peer waits
for; the peer raises a `StepError` naming rank 0's error, and rank 0 raises its own. The
progress bar Keras adds on rank 0 (``verbose`` not 0) is put in the list by tfsmp instead
(`plan_callbacks`), at the end where Keras puts it, so that it has a peer too. The cost is one
small broadcast per such hook: per batch for the progress bar at ``verbose=1`` (where it
prints per batch) and for TensorBoard (which writes batch scalars), per epoch for the rest.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import keras
import numpy as np

from tfsmp import failure
from tfsmp.comm import collective_label
from tfsmp.errors import StepError

__all__ = ["LOG_WRITERS", "RANK_ZERO", "Writer", "WriterPeer", "hooks_of", "plan_callbacks",
           "writer_guards"]

LOG_WRITERS: tuple[type, ...] = (keras.callbacks.CSVLogger, keras.callbacks.RemoteMonitor,
                                 keras.callbacks.TensorBoard)
# what runs on world rank 0 only: the log writers and the progress bar
RANK_ZERO: tuple[type, ...] = (*LOG_WRITERS, keras.callbacks.ProgbarLogger)

# the hooks Keras's CallbackList calls, and the legacy names Keras's defaults forward to
_HOOKS = ("on_train_begin", "on_train_end", "on_epoch_begin", "on_epoch_end", "on_test_begin",
          "on_test_end", "on_predict_begin", "on_predict_end", "on_train_batch_begin",
          "on_train_batch_end", "on_test_batch_begin", "on_test_batch_end",
          "on_predict_batch_begin", "on_predict_batch_end")
_LEGACY = {"on_train_batch_begin": "on_batch_begin", "on_train_batch_end": "on_batch_end"}


def hooks_of(cls: type) -> tuple[str, ...]:
    """The hooks of Keras's CallbackList that run code of ``cls``: those it overrides (Keras
    marks its empty defaults), a train batch's also through the legacy ``on_batch_*``."""
    def own(name: str) -> bool:
        return not getattr(getattr(cls, name, None), "_is_default", False)

    return tuple(h for h in _HOOKS if own(h) or (h in _LEGACY and own(_LEGACY[h])))


@dataclass(frozen=True)
class Writer:
    """What the other ranks know of a callback that runs on world rank 0 only: its name, the
    hooks it implements, and what a TensorBoard logs weights at (Keras's attribute names)."""

    name: str
    hooks: tuple[str, ...]
    histogram_freq: int = 0
    embeddings_freq: int = 0

    @classmethod
    def of(cls, callback: Any, verbose: Any) -> Writer:
        hooks = hooks_of(type(callback))
        quiet = verbose == 2 or (verbose == 0 and type(callback) is keras.callbacks.ProgbarLogger)
        if isinstance(callback, keras.callbacks.ProgbarLogger) and quiet:
            # at verbose=2 Keras's progress bar prints at an epoch's end only, and at verbose=0
            # Keras's own prints nothing (a subclass's hooks may still fail): no batch hooks
            hooks = tuple(h for h in hooks if "batch" not in h)
        board = isinstance(callback, keras.callbacks.TensorBoard)
        return cls(type(callback).__name__, hooks,
                   int(callback.histogram_freq or 0) if board else 0,
                   int(callback.embeddings_freq or 0) if board else 0)


def _saves(callback: Any) -> bool:
    """Whether ``callback``'s work is collective (its saves: world rank 0 writes): Keras's
    checkpointing callbacks and tfsmp's (tfsmp.checkpoint, a layer above this one)."""
    return isinstance(callback, (keras.callbacks.ModelCheckpoint,
                                 keras.callbacks.BackupAndRestore)) or any(
        cls.__module__.startswith("tfsmp.checkpoint") for cls in type(callback).__mro__)


def _signature(callback: Any) -> tuple[str, str]:
    kind = ("writer" if isinstance(callback, RANK_ZERO) else
            "saver" if _saves(callback) else "other")
    return kind, f"{type(callback).__module__}.{type(callback).__qualname__}"


def plan_callbacks(callbacks: list[Any], verbose: Any, history: bool, model: Any, world: Any,
                   partitions: int, entry: str
                   ) -> tuple[list[Any], list[Any], dict[int, Writer]]:
    """The callbacks this world rank hands Keras's loop in the user's place, those it appends
    after everything else (where Keras appends its History and progress bar), and (on rank 0)
    what each one it runs for every rank is, by ``id`` ([Note: a writer failing on rank 0]).
    One small collective: the ranks' callbacks are gathered with world rank 0's description of
    its writers and of the progress bar it runs, so that they have their peers at the same
    places on the other ranks, also where a script passes them on rank 0 only (Horovod's idiom:
    ``if hvd.rank() == 0: callbacks.append(TensorBoard(...))``, ``verbose=1 if hvd.rank() == 0
    else 0``). Keras's own progress bar (and in ``fit`` the History before it) is appended where
    Keras appends them when world rank 0's ``verbose`` asks for one and rank 0 passed none (of
    any ProgbarLogger class, as Keras looks for one).

    Raises:
        StepError: on every rank alike, when ranks pass different checkpointing callbacks (their
            saves are collective).
    """
    if world.size == 1:
        return list(callbacks), [], {}
    mine = [_signature(c) for c in callbacks]
    described: list[Writer | None] = []
    end: list[Any] = []
    if world.rank == 0:
        described = [Writer.of(c, verbose) if k == "writer" else None
                     for c, (k, _) in zip(callbacks, mine)]
        if verbose != 0 and not any(isinstance(c, keras.callbacks.ProgbarLogger)
                                    for c in callbacks):
            end = [keras.callbacks.ProgbarLogger()]
    bar = Writer.of(end[0], verbose) if end else None
    with collective_label("the callbacks' agreement", api=False):
        everyone = world.allgather_obj((mine, (described, bar) if world.rank == 0 else None))
    signatures = [sig for sig, _ in everyone]
    _check_savers(signatures, model, entry)
    if world.rank == 0:
        guarded = {id(c): w for c, w in zip([*callbacks, *end], [*described, bar])
                   if w is not None}
        return list(callbacks), [*_history(callbacks, history and bar is not None), *end], guarded
    writers0, bar = everyone[0][1]
    peers = {i: WriterPeer(w, model, world, partitions)
             for i, w in enumerate(writers0) if w is not None}
    own = [c for c in callbacks if not isinstance(c, RANK_ZERO)]
    plan = _place(signatures[0], peers, own, signatures)
    end = ([*_history(callbacks, history), WriterPeer(bar, model, world, partitions)]
           if bar is not None else [])
    return plan, end, {}


def _history(callbacks: list[Any], wanted: bool) -> list[Any]:
    """A History before the progress bar tfsmp appends, as Keras appends one in ``fit``."""
    if not wanted or any(isinstance(c, keras.callbacks.History) for c in callbacks):
        return []
    return [keras.callbacks.History()]


def _check_savers(signatures: list[list[tuple[str, str]]], model: Any, entry: str) -> None:
    def savers(sig: list[tuple[str, str]]) -> list[str]:
        return [n.rsplit(".", 1)[-1] for k, n in sig if k == "saver"]

    if all(savers(sig) == savers(signatures[0]) for sig in signatures):
        return
    got = "; ".join(f"rank {r}: {savers(sig)}" for r, sig in enumerate(signatures))
    raise StepError(
        f"[{model.runtime_state().tag()}] Every rank must pass {entry} the same checkpointing "
        f"callbacks: a pipelined model's saves are collective (every rank sends its stages' "
        f"weights, world rank 0 writes the file). Received: {got}. Fix: pass them on every rank "
        f"(the file is still written once); the log writers (CSVLogger, RemoteMonitor, "
        f"TensorBoard, ProgbarLogger) may be passed on rank 0 only.")


def _place(first: list[tuple[str, str]], peers: dict[int, WriterPeer], own: list[Any],
           signatures: list[list[tuple[str, str]]]) -> list[Any]:
    """This rank's callbacks (``own``, without writers) with world rank 0's writers' peers at
    rank 0's places (``first`` is rank 0's signature): exactly, where every rank passed the
    same other callbacks; else among the checkpointing callbacks (the same on every rank), the
    collective ones a peer must keep its order with."""
    others = [[e for e in sig if e[0] != "writer"] for sig in signatures]
    out: list[Any] = []
    if all(o == others[0] for o in others):
        rest = iter(own)
        for i, (kind, _) in enumerate(first):
            out.append(peers[i] if kind == "writer" else next(rest))
        return out
    before: dict[int, list[WriterPeer]] = {}
    savers = 0
    for i, (kind, _) in enumerate(first):
        if kind == "writer":
            before.setdefault(savers, []).append(peers[i])
        savers += kind == "saver"
    savers = 0
    for c in own:
        if _signature(c)[0] == "saver":
            out += before.pop(savers, [])
            savers += 1
        out.append(c)
    return out + before.pop(savers, [])


# -- TensorBoard's weights ---------------------------------------------------------------------
#
# [Note: TensorBoard's weights] Keras's TensorBoard logs weight histograms (``histogram_freq``),
# weight images (``write_images``) and an embeddings projector (``embeddings_freq``) at the end
# of the epochs it is asked to, by reading every layer's weights (``self.model.layers``, each
# ``layer.weights``) and, for the projector, by ``self.model.save_weights``. At partitions > 1
# world rank 0, the one rank that runs TensorBoard ([Note: one writer of the logs]), holds only
# its own stages' weights. So at those epochs the other ranks' `WriterPeer` at
# TensorBoard's place in their callback list serves them, and rank 0's TensorBoard runs Keras's own
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


# -- the exchange at each hook ([Note: a writer failing on rank 0]) ---------------------------


def _label(writer: Writer, hook: str, weights: bool) -> str:
    """What the watchdog names a rank waiting in the exchange ([Note: collective labels])."""
    return _LABEL if weights else f"{writer.name}.{hook} on world rank 0"


def _logs_weights_now(writer: Writer, partitions: int, hook: str, args: tuple[Any, ...]) -> bool:
    """Whether this hook is an epoch's end at which a TensorBoard reads the weights that
    other ranks hold ([Note: TensorBoard's weights])."""
    return (partitions > 1 and hook == "on_epoch_end" and bool(args)
            and _logs_weights_at(writer, args[0]))


class WriterPeer(keras.callbacks.Callback):  # type: ignore[misc]
    """Stands at a rank-0-only callback's place on the other ranks: at each hook the callback
    implements it waits for rank 0's stop message, serving the weights a TensorBoard asks for
    on the way ([Note: TensorBoard's weights]), and raises rank 0's error ([Note: a writer
    failing on rank 0])."""

    def __init__(self, writer: Writer, model: Any, world: Any, partitions: int = 1) -> None:
        super().__init__()
        self.writer, self.dm, self.world, self.partitions = writer, model, world, partitions
        # what it stands for, by the name Keras's CallbackList looks for (fit_resume keeps a
        # progress bar's place)
        self.stands_for = (keras.callbacks.ProgbarLogger if writer.name == "ProgbarLogger"
                           else type(self))
        for hook in writer.hooks:
            setattr(self, hook, self._meet(hook))

    def _meet(self, hook: str) -> Callable[..., None]:
        def meet(*args: Any, **kwargs: Any) -> None:
            weights = _logs_weights_now(self.writer, self.partitions, hook, args)
            with collective_label(_label(self.writer, hook, weights), api=False):
                error = self._serve(weights)
            if error is not None:
                tag = self.dm.runtime_state().tag()
                raise failure.echo(StepError(
                    f"[{tag}] {self.writer.name}.{hook} failed on world rank 0, the one rank "
                    f"that runs the log writers and the progress bar: {error}"),
                    origin=self.world.ranks[0])
        return meet

    def _serve(self, weights: bool) -> Any:
        """Answers rank 0's requests until its stop; returns rank 0's error text, if any (a
        failure of this rank's own part is raised after the stop)."""
        owners = _Owners(self.dm, self.world) if weights else None
        failed: BaseException | None = None
        while True:
            kind, body = self.world.bcast_obj(None, root=0)
            if kind == _STOP:
                break
            try:
                if kind == _WEIGHTS and owners is not None:
                    owners.send(body)
                else:  # the projector's checkpoint: world rank 0 writes it
                    self.dm.save_weights(os.path.join(tempfile.gettempdir(), "unused.weights.h5"))
            except Exception as e:  # told after the stop: rank 0 ends the exchange
                failed = failed or e
        if failed is not None:
            raise failed
        return body


@contextmanager
def writer_guards(callbacks: list[Any], guarded: dict[int, Writer], model: Any, world: Any,
                  partitions: int) -> Iterator[None]:
    """On world rank 0, for the block: each callback of ``callbacks`` that ``guarded``
    describes (`plan_callbacks`) ends each of its hooks with the stop message its peers wait
    for ([Note: a writer failing on rank 0]), reading at partitions > 1 the weights a
    TensorBoard logs through the ranks that hold them ([Note: TensorBoard's weights]); each
    TensorBoard writes the user's model's graph summary. Elsewhere does nothing."""
    patched: list[tuple[Any, str]] = []
    # Keras's TensorBoard reads its model as ``self.model``, which returns ``_model``; these
    # are its own methods, run unchanged on another model (noqa: SLF001 for its names)
    for c in callbacks if world.rank == 0 else []:
        if isinstance(c, keras.callbacks.TensorBoard):
            c._write_keras_model_summary = _summary(c, model)  # noqa: SLF001
            patched.append((c, "_write_keras_model_summary"))
        writer = guarded.get(id(c))
        if writer is None:
            continue
        for hook in writer.hooks:
            setattr(c, hook, _guarded(c, writer, hook, model, world, partitions))
            patched.append((c, hook))
    try:
        yield
    finally:
        for c, name in patched:
            c.__dict__.pop(name, None)


def _guarded(callback: Any, writer: Writer, hook: str, model: Any, world: Any,
             partitions: int) -> Callable[..., None]:
    """Rank 0's ``callback.hook``: Keras's, then the stop message (with its error, if any); at
    an epoch's end that logs weights, with the model seen through the gathered weights."""
    run = getattr(type(callback), hook)

    def guarded(*args: Any, **kwargs: Any) -> None:
        now = _logs_weights_now(writer, partitions, hook, args)
        with collective_label(_label(writer, hook, now), api=False):
            kept, error = callback.__dict__.get("_model"), None
            try:
                if now:
                    callback._model = _ModelView(kept, _Owners(model, world))  # noqa: SLF001
                run(callback, *args, **kwargs)
            except BaseException as e:
                error = f"{type(e).__name__}: {e}"
                raise
            finally:
                if now:
                    callback._model = kept  # noqa: SLF001
                world.bcast_obj((_STOP, error), root=0)

    return guarded


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
