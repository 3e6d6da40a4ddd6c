"""Keras's own metric objects on a pipelined model: updated from the last stage, equal on every rank.

Example (what `TrainerSteps` does after each pipelined step)::

    logs = TrainerMetrics(model).after_step(view, result, x, y, sample_weight)
    model.get_metrics_result() == logs          # on every rank

[Note: metrics on every rank] Keras's trainer reads its metric objects (``model.metrics``:
the loss tracker, each output's loss, the compiled metrics) for the logs of every batch and
epoch, and callbacks and user code read them on whatever rank they run. So every rank holds
the same metric state, and it is Keras's state for the whole global batch:

* the loss tracker and the per-output loss trackers get the step's loss values, which every
  rank already has (the step's report), with the batch's size as weight, as Keras does;
* the compiled metrics are updated once per step with the whole global batch, on the last
  stage's ranks: their outputs are concatenated over microbatches and, with several
  data-parallel replicas, gathered over replicas in batch order. Updating per microbatch or per
  replica and summing states would be wrong for a metric function that returns one value per
  batch (a Mean of per-call values) or any metric whose state is not a sum over rows;
* the last stage's rank then sends the compiled metrics' variables to the other pipeline
  ranks (one small broadcast), which build the same metric objects from the outputs' shapes at
  the first step and assign the values.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import tensorflow as tf
from keras.src.backend import get_keras_mask, set_keras_mask

from tfsmp import failure
from tfsmp.errors import StepError
from tfsmp.runtime import microbatch as mbatch
from tfsmp.runtime.dispatch import Program

__all__ = ["TrainerMetrics", "replica_outputs"]

Output = tuple[np.ndarray, "np.ndarray | None"]  # an output's values and its Keras mask


def _concat(parts: list[list[Output]]) -> list[Output]:
    out: list[Output] = []
    for j in range(len(parts[0])):
        values = np.concatenate([p[j][0] for p in parts])
        masks = [p[j][1] for p in parts]
        mask: np.ndarray | None = None
        if all(m is not None for m in masks):
            mask = np.concatenate([m for m in masks if m is not None])
        out.append((values, mask))
    return out


def replica_outputs(view: Any, result: Any) -> list[Output] | None:
    """On the last stage's ranks: the model outputs (with their masks) of every replica's rows
    of the step's global batch, in batch order; None on the other ranks. A collective of the
    last stage's data-parallel group."""
    if not view.is_last_rank:
        return None
    parts = [[(np.asarray(t), _mask(t)) for t in result.outputs[i]]
             for i in sorted(result.outputs)]
    local = _concat(parts) if parts else None
    if view.data_size > 1:
        gathered = [g for g in view.groups.data.allgather_obj(local) if g is not None]
        return _concat(gathered) if gathered else None
    return local


def _mask(t: Any) -> np.ndarray | None:
    m = get_keras_mask(t)
    return None if m is None else np.asarray(m)


class TrainerMetrics:
    """Updates a `DistributedModel`'s Keras metrics after each step ([Note: metrics on every
    rank])."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self._update_fn: Any = None
        self._loss_fn: Any = None  # `_update_losses`'s compiled call, for the metrics of
        self._loss_key: tuple[Any, ...] = ()

    def after_step(self, view: Any, result: Any, x: Any, y: Any, sw: Any) -> dict[str, Any]:
        """Updates every metric with the step that just ran; returns Keras's logs."""
        model = self.model
        rows = mbatch.batch_size_of(x)
        # [Note: logs in the loss means' call]
        last = model.compiled_metrics_object() is None
        logs: dict[str, Any] | None = self._update_losses(result, rows, read=last)
        if logs is None:
            self._update_compiled(view, result, y, sw)
            logs = model.get_metrics_result()
        return logs

    def _update_losses(self, result: Any, rows: int, read: bool = False
                       ) -> dict[str, Any] | None:
        """The loss tracker's and each output's loss Mean's update with this step's values, in
        one compiled call (as Keras's train step updates them in its graph; run eagerly, their
        ops cost about a millisecond of a step's Python). With ``read``, the same call returns
        Keras's logs (``get_metrics_result()``), else None.

        [Note: logs in the loss means' call] Keras's train step reads its metrics' results in
        the graph that updated them; read eagerly after the update, each Mean's result is a few
        eager ops, and a `tf.function` call pays its argument matching again each step (together
        about half a millisecond of Python a step, on this machine). So when no compiled metric
        is updated after the loss means (a model compiled without metrics), their compiled call
        also returns ``get_metrics_result()``, and it is called as the concrete function of its
        one signature. Keras's own method computes the same ops in the graph, so the logs are
        the same values, under the same keys in the same order."""
        model = self.model
        metrics = [model.loss_tracker(), *model.compiled_loss_metrics()]
        values = [result.loss, *result.term_values][:len(metrics)]
        if any(v is None for v in values):
            for metric, value in zip(metrics, values):
                metric.update_state(value, sample_weight=rows)
            return None
        updated = metrics[:len(values)]
        key = (read, *(id(m) for m in (model.metrics if read else updated)))
        if self._loss_key != key:
            self._loss_key = key
            fn = tf.function(functools.partial(_update_means, updated,
                                               model.get_metrics_result if read else None))
            self._loss_fn = fn.get_concrete_function(
                tf.TensorSpec([len(values)], tf.float32), tf.TensorSpec([], tf.float32))
        logs = self._loss_fn(tf.constant(values, tf.float32), tf.constant(rows, tf.float32))
        return dict(logs) if read else None

    def _update_compiled(self, view: Any, result: Any, y: Any, sw: Any) -> None:
        compiled = self.model.compiled_metrics_object()
        if compiled is None or y is None:
            return
        outputs = replica_outputs(view, result)
        failed: Exception | None = None
        payload: Any = None
        if outputs is not None:
            try:
                self._update_here(compiled, y, outputs, sw)
            except Exception as e:  # e.g. metrics for an output that does not exist (Keras's
                failed = e          # ValueError): every rank raises it, none waits for the rest
            payload = (("error", type(failed).__name__, str(failed)) if failed is not None else
                       ([(v.shape, v.dtype.str) for v, _ in outputs],
                        [np.asarray(v) for v in compiled.variables]))
        if view.groups.pipeline.size > 1:
            payload = view.groups.pipeline.bcast_obj(payload, root=view.last_rank)
        if failed is not None:
            raise failed
        if view.is_last_rank or payload is None:
            return
        if payload[0] == "error":
            raise failure.echo(_same_error(payload[1], payload[2]),
                               origin=view.groups.pipeline.ranks[view.last_rank])
        specs, values = payload
        if not compiled.built:  # the same objects as the last stage's: built from its shapes
            zeros = self._pack([np.zeros(s, dtype=d) for s, d in specs])
            compiled.build(y, zeros)
            compiled.update_state(y, zeros)  # variables made at the first update, as there
        for variable, value in zip(compiled.variables, values):
            variable.assign(value)

    def _update_here(self, compiled: Any, y: Any, outputs: list[Output], sw: Any) -> None:
        """The last stage's update of the compiled metrics with the global batch."""
        if not compiled.built:
            compiled.build(y, self._pack([v for v, _ in outputs]))
            # some metrics make their variables at their first update (F1Score): the other
            # ranks do the same update on zeros, so both hold the same variables
            compiled.update_state(y, self._pack([np.zeros_like(v) for v, _ in outputs]))
            compiled.reset_state()
        self._update(y, outputs, sw)

    def after_custom_step(self, view: Any, result: Any, x: Any, y: Any, sw: Any, *,
                          loss: Any, saved: tuple[list[Any], list[np.ndarray]],
                          training: bool, layer_losses: bool, rank_tag: str) -> dict[str, Any]:
        """`after_step` for a model's own compute_loss ([Note: a model's own compute_loss] in
        model_loss.py): the metric updates of the per-microbatch calls undone, the override
        called once on the global batch on the last stage's ranks (its value is the step's
        loss), and every metric's state sent to the other pipeline ranks."""
        from tfsmp.keras import model_loss

        model = self.model
        variables, before = saved
        model_loss.restore(variables, before)
        known = {id(v) for v in variables}
        for metric in model.metrics:  # made during this step (its first): from their start
            if any(id(v) not in known for v in metric.variables):
                metric.reset_state()
        rows = mbatch.batch_size_of(x)
        outputs = replica_outputs(view, result)
        failed: Exception | None = None
        payload: Any = None
        if outputs is not None:
            try:
                y_pred = self._pack_masked(outputs)
                terms = list(getattr(result, "term_values", None) or [])
                total = float(result.loss) - (float(terms[0]) if terms else 0.0)
                value = loss.batch_value(x, y, y_pred, sw, training=training,
                                         losses=[tf.constant(total, tf.float32)]
                                         if layer_losses else [])
                model.loss_tracker().update_state(value, sample_weight=rows)
                compiled = model.compiled_metrics_object()
                if compiled is not None and y is not None:
                    self._update_here(compiled, y, outputs, sw)
            except Exception as e:  # every rank raises it, none waits for the rest
                failed = e
            payload = (("error", type(failed).__name__, str(failed)) if failed is not None else
                       ([(v.shape, v.dtype.str) for v, _ in outputs],
                        model_loss.snapshot(model_loss.metric_variables(model))))
        if view.groups.pipeline.size > 1:
            payload = view.groups.pipeline.bcast_obj(payload, root=view.last_rank)
        if failed is not None:
            raise failed
        if not view.is_last_rank and payload is not None:
            if payload[0] == "error":
                raise failure.echo(_same_error(payload[1], payload[2]),
                                   origin=view.groups.pipeline.ranks[view.last_rank])
            specs, values = payload
            compiled = model.compiled_metrics_object()
            if compiled is not None and y is not None and not compiled.built:
                zeros = self._pack([np.zeros(s, dtype=d) for s, d in specs])
                compiled.build(y, zeros)
                compiled.update_state(y, zeros)
            mine = model_loss.metric_variables(model)
            if len(mine) != len(values):
                raise StepError(
                    f"{rank_tag} Every rank must hold the same metrics. Received: "
                    f"{len(mine)} metric variables here, {len(values)} on the last stage's "
                    f"rank. Create the metrics a compute_loss() updates in the model's "
                    f"__init__.")
            model_loss.restore(mine, values)
        return dict(model.get_metrics_result())

    def _pack_masked(self, outputs: list[Output]) -> Any:
        values = [tf.convert_to_tensor(v) for v, _ in outputs]
        for t, (_, m) in zip(values, outputs):
            if m is not None:
                set_keras_mask(t, tf.convert_to_tensor(m))
        return self.model.rank_view_or_raise().traced.pack_outputs(values)

    def ensure_built(self, engine: Any, x: Any, y: Any) -> None:
        """Builds the compiled metrics from the outputs' shapes without a step (an epoch a
        resumed fit passes over entirely still reports Keras's logs)."""
        compiled = self.model.compiled_metrics_object()
        if compiled is None or compiled.built or y is None:
            return
        graph = engine.view.traced.graph
        dtypes = [graph.tensors[k].dtype for k in engine.view.traced.output_keys]
        zeros = [np.zeros([1 if d is None else d for d in shape], dtype=dtype)
                 for shape, dtype in zip(engine.output_shapes(x), dtypes)]
        compiled.build(y, self._pack(zeros))
        compiled.update_state(y, self._pack(zeros))
        compiled.reset_state()

    def _pack(self, flat: list[Any]) -> Any:
        return self.model.rank_view_or_raise().traced.pack_outputs(
            [tf.convert_to_tensor(v) for v in flat])

    def _update(self, y: Any, outputs: list[Output], sw: Any) -> None:
        if self._update_fn is None:
            self._update_fn = Program(tf.function(self._update_graph, reduce_retracing=True))
        values = [tf.convert_to_tensor(v) for v, _ in outputs]
        masks = [None if m is None else tf.convert_to_tensor(m) for _, m in outputs]
        self._update_fn(y, values, masks, sw)

    def _update_graph(self, y: Any, values: list[Any], masks: list[Any], sw: Any) -> None:
        for t, m in zip(values, masks):
            if m is not None:
                set_keras_mask(t, m)  # a compiled function's arguments carry no Keras mask
        self.model.compiled_metrics_object().update_state(y, self._pack(values), sw)


def _same_error(kind: str, message: str) -> Exception:
    """The last stage's error on another rank: the same built-in class (Keras's ValueError for
    a bad metric), else a StepError naming it."""
    import builtins

    cls = getattr(builtins, kind, None)
    if isinstance(cls, type) and issubclass(cls, Exception):
        return cls(message)
    return StepError(f"The last stage's rank failed updating the compiled metrics. Received: "
                     f"{kind}: {message}")


def _update_means(metrics: list[Any], read: Any, values: tf.Tensor, rows: tf.Tensor) -> Any:
    for j, metric in enumerate(metrics):
        metric.update_state(values[j], sample_weight=rows)
    return read() if read is not None else None
