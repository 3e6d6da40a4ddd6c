"""The step functions Keras's own trainer calls on a `DistributedModel`: one pipelined step a batch.

Example (what `DistributedModel.make_train_function` installs; Keras's `fit` calls it)::

    steps = TrainerSteps(model)
    model.train_function = steps.train        # logs = model.train_function(iterator)
    model.test_function = steps.test
    model.predict_function = steps.predict    # outputs = model.predict_function([batch, ...])

[Note: Keras's trainer drives] `DistributedModel` has no loop of its own: Keras's `fit`,
`evaluate`, `predict`, `train_on_batch`, ... run as written (data adapters, shuffling,
`steps_per_epoch`, callbacks, History, validation, `stop_training`, progress bar), and call the
functions Keras's TensorFlow trainer makes with `make_train_function` and its siblings. Those
are replaced here by Python functions (MPI calls cannot live in a graph) that, per batch Keras
hands them: agree with every rank that all have a batch and that it is the same batch
([Note: replicas run out together], [Note: same batch on every rank] in tfsmp/keras/data.py),
run the pipelined step of the whole batch ([Note: one owner of the step] in
tfsmp/runtime/engine.py), and update Keras's own metric objects so that every rank holds the
same metric state ([Note: metrics on every rank] in tfsmp/keras/trainer_metrics.py). They
return what Keras's functions return: the logs (``get_metrics_result()``) or the outputs.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import tensorflow as tf
from keras.src.trainers.data_adapters import data_adapter_utils

from tfsmp import failure
from tfsmp.comm import collective_label
from tfsmp.errors import StepError
from tfsmp.keras import trainer_metrics
from tfsmp.keras.data import batch_digest, different_ranks, keras_input_rank, same_batch_error

if TYPE_CHECKING:
    from tfsmp.keras.model import DistributedModel

__all__ = ["TrainerSteps", "agree_finished"]

_EXHAUSTED = (StopIteration, tf.errors.OutOfRangeError)


def _unpack(data: Any, model: DistributedModel) -> tuple[Any, Any, Any]:
    """``(x, y, sample_weight)`` of a batch Keras's iterator yielded, as it yielded them: its
    tensors go to the step as they are (a round trip through NumPy copied the batch twice, about
    a millisecond of a step at batch 256)."""
    x, y, sw = data_adapter_utils.unpack_x_y_sample_weight(data)
    return keras_input_rank(model.source_model(), x), y, sw


def _no_optionals(data: Any) -> Any:
    """Keras's TensorFlow trainer's `_autoconvert_optionals`: an empty input a generator
    yielded (None, which Keras's adapter carries as a ``tf.experimental.Optional``) is None."""
    return tf.nest.map_structure(
        lambda v: None if isinstance(v, tf.experimental.Optional) else v, data)


def _check_no_missing_inputs(model: DistributedModel, data: Any) -> None:
    """[Note: optional inputs] A Keras input declared ``optional=True`` may be given None, and
    the model's layers then take another path. A pipeline's stage programs are traced once with
    every input present and send fixed-shape buffers, so a None input is refused (the same
    batch on every rank: every rank raises alike)."""
    x, _, _ = data_adapter_utils.unpack_x_y_sample_weight(data)
    if not isinstance(x, dict | list | tuple):
        return
    named = x.items() if isinstance(x, dict) else enumerate(x)
    missing = [str(k) for k, v in named if v is None]
    if missing:
        raise StepError(
            f"[{model.runtime_state().tag()}] A pipelined model needs a value for every input: "
            f"its stage programs are traced with every input present. Received: None for "
            f"input(s) {missing} (optional inputs). Fix: pass a tensor for them (zeros of their "
            f"shape, if the model should ignore them), or train this model with plain Keras.")


def _agree(model: DistributedModel, batch: Any, phase: str,
           error: BaseException | None = None) -> bool:
    """[Note: replicas run out together] One small allgather before every step: whether every
    rank has a batch, which phase each rank is in, and each batch's digest. Returns whether all
    ranks have one (False: all ran out together).

    Raises:
        StepError: on every rank alike, when some ranks ran out and others did not, ranks are
            in different phases (one evaluates while another trains), or the batches differ.
        Exception: ``error``, the one this rank met reading its batch; its peers raise a
            StepError that names it (a rank that cannot read its data ends the step everywhere).
    """
    state = model.runtime_state()
    world = state.comm.world
    if world.size == 1:  # one rank agrees with itself: no digest, no collective
        if error is not None:
            raise error
        return batch is not None
    failed = None if error is None else f"{type(error).__name__}: {error}".splitlines()[0]
    mine = (phase, batch is not None, None if batch is None else batch_digest(batch), failed)
    with collective_label("the per-step batch agreement", api=False):
        everyone = world.allgather_obj(mine)
    tag = f"[{state.tag()}]"
    failures = [(r, e) for r, (*_, e) in enumerate(everyone) if e is not None]
    if failures:
        if error is not None:
            raise error
        r, what = failures[0]
        raise failure.echo(StepError(
            f"{tag} Every rank must read its next batch. Received: rank {r} failed reading its "
            f"batch in {phase} ({what}). Fix the data on that rank (its own message says how)."),
            origin=world.ranks[r])
    got = [(p, h, d) for p, h, d, _ in everyone]
    where = _where(model, phase)
    phases = sorted({p for p, _, _ in got})
    if len(phases) > 1:
        where = ", ".join(f"rank {r}: {p}" for r, (p, _, _) in enumerate(got))
        raise StepError(
            f"{tag} Every rank must run the same steps of fit, evaluate and predict. Received: "
            f"ranks in different phases ({where}), which happens when their data yields "
            f"different numbers of batches. Give every rank the same data (seeded alike), or "
            f"pass steps_per_epoch=/steps= no larger than the shortest.")
    have = [h for _, h, _ in got]
    if all(have):
        digests = [d for _, _, d in got]
        if different_ranks(digests, list(world.ranks)):
            raise same_batch_error(tag, digests, list(world.ranks), where)
        return True
    if any(have):
        short = [r for r, h in enumerate(have) if not h]
        replicas = sorted({state.topology.data_rank_of(r) for r in short})
        raise StepError(
            f"{tag} Every rank's dataset must yield the same number of batches. Received: "
            f"rank(s) {short} (data replica(s) {replicas}) ran out of data {where} while the "
            f"others had a batch. Give every rank the same dataset (seeded alike), or pass "
            f"steps_per_epoch= no larger than the shortest one.")
    return False


def _where(model: DistributedModel, phase: str) -> str:
    """Where a step of ``phase`` is, for messages: fit's epoch and step, else the phase."""
    if phase != "fit":
        return f"in {phase}"
    position = model.fit_position() or {"epoch": 0, "step": 0}
    return f"at step {position['step']} of epoch {position['epoch']}"


def agree_finished(model: DistributedModel, phase: str) -> None:
    """After Keras's loop of ``phase`` ends on this rank: every rank ended it too (a rank whose
    data had more batches would otherwise wait in its next step for ever)."""
    if model.rank_view is None and not model.runtime_state().comm.world.size > 1:
        return
    with collective_label("the end-of-data agreement", api=False):
        _agree(model, None, phase)


class TrainerSteps:
    """The functions Keras's trainer calls, for one `DistributedModel`. See the module docstring."""

    def __init__(self, model: DistributedModel) -> None:
        self.model = model
        self.metrics = trainer_metrics.TrainerMetrics(model)

    # -- data -----------------------------------------------------------------------------------

    def _next(self, iterator: Iterator[Any], phase: str) -> Any | None:
        """The next batch every rank agrees on (None: every rank ran out)."""
        data, error = None, None
        try:
            data = _no_optionals(next(iterator))
            _check_no_missing_inputs(self.model, data)
        except _EXHAUSTED:
            pass
        except Exception as e:  # every rank learns of it in the agreement, and stops alike
            error = e
        if not _agree(self.model, data, phase, error):
            return None
        return data

    def _skip_resumed(self, iterator: Iterator[Any]) -> None:
        """[Note: exact resume] in tfsmp/checkpoint/fit_resume.py: the batches of a resumed epoch
        that the interrupted run had trained on are read and passed over (the model is
        partitioned with the first of them, so a backup that covers a whole epoch resumes)."""
        skip = self.model.take_resume_skip()
        for _ in range(skip):
            data = self._next(iterator, "fit")
            if data is None:
                return
            x, y, _ = _unpack(data, self.model)
            self.metrics.ensure_built(self.model.engine_for(x), x, y)

    # -- train / test -----------------------------------------------------------------------------

    def train(self, iterator: Iterator[Any]) -> dict[str, Any]:
        """Keras's ``train_function``: ``steps_per_execution`` steps, the last one's logs."""
        self._skip_resumed(iterator)
        return self._run(iterator, "fit", self._train_batch)

    def test(self, iterator: Iterator[Any]) -> dict[str, Any]:
        """Keras's ``test_function``."""
        return self._run(iterator, "evaluate", self._test_batch)

    def _run(self, iterator: Iterator[Any], phase: str, one: Any) -> dict[str, Any]:
        logs: dict[str, Any] | None = None
        for _ in range(max(int(self.model.steps_per_execution or 1), 1)):
            data = self._next(iterator, phase)
            if data is None:
                break
            logs = one(*_unpack(data, self.model))
        if logs is None:
            raise StopIteration  # Keras's epoch iterator ends the epoch, on every rank alike
        return logs

    def _train_batch(self, x: Any, y: Any, sw: Any) -> dict[str, Any]:
        model = self.model
        engine = model.engine_for(x)
        # every rank sees the same batch, so every rank raises, before any message; a model
        # compiled without a loss trains on its layers' losses and needs no targets (Keras)
        if y is None and getattr(model, "_compile_loss", None) is not None:
            raise StepError(
                f"[{model.runtime_state().tag()}] The loss needs targets. Received: y=None. "
                f"Pass y to fit(), or yield (x, y) pairs from the dataset.")
        engine.nonfinite = model.nonfinite_mode()
        saved = self._before_custom(x, training=True)
        result = engine.train_step(x, y, sw)  # the global batch: [Note: one owner of the step]
        return self._after(engine, result, x, y, sw, saved, training=True)

    def _test_batch(self, x: Any, y: Any, sw: Any) -> dict[str, Any]:
        engine = self.model.engine_for(x)
        saved = self._before_custom(x, training=False)
        result = engine.evaluate(x, y, sw)
        return self._after(engine, result, x, y, sw, saved, training=False)

    # [Note: a model's own compute_loss] in tfsmp/keras/model_loss.py: the phase and the inputs'
    # structure for its calls, and the metrics' state before them (restored after the step)
    def _before_custom(self, x: Any, *, training: bool) -> Any:
        loss = self.model.model_loss()
        if loss is None:
            return None
        from tfsmp.keras import model_loss

        loss.training, loss.template = training, x
        variables = model_loss.metric_variables(self.model)
        return variables, model_loss.snapshot(variables)

    def _after(self, engine: Any, result: Any, x: Any, y: Any, sw: Any, saved: Any, *,
               training: bool) -> dict[str, Any]:
        loss = self.model.model_loss()
        if loss is None or saved is None:
            return self.metrics.after_step(engine.view, result, x, y, sw)
        return self.metrics.after_custom_step(
            engine.view, result, x, y, sw, loss=loss, saved=saved, training=training,
            layer_losses=engine.has_layer_losses(), rank_tag=f"[{self.model.runtime_state().tag()}]")

    # -- predict ----------------------------------------------------------------------------------

    def predict(self, data: list[Any]) -> Any:
        """Keras's ``predict_function``: the outputs of a list of batches, on every rank."""
        chunks = []
        for element in data:
            x = _unpack(element, self.model)[0]
            _agree(self.model, x, "predict")
            chunks.append(self.forward(x))
        flat = [np.concatenate([c[j] for c in chunks]) for j in range(len(chunks[0]))]
        # tensors, as Keras's predict function returns (its predict calls .numpy() on them)
        return self.model.rank_view_or_raise().traced.pack_outputs(
            [tf.convert_to_tensor(v) for v in flat])

    def forward(self, x: Any) -> list[np.ndarray]:
        """Pipelined forward of a global batch; its merged outputs (NumPy) on every rank."""
        engine = self.model.engine_for(x)
        _, result = engine.forward(x)
        return gather_outputs(engine.view, result)


def gather_outputs(view: Any, result: Any) -> list[np.ndarray]:
    """The outputs of every replica's rows, in batch order, on every rank."""
    flat = trainer_metrics.replica_outputs(view, result)
    with collective_label("the outputs' broadcast", api=False):
        got: list[np.ndarray] = view.groups.pipeline.bcast_obj(
            None if flat is None else [a for a, _ in flat], root=view.last_rank)
    return got
