"""`DistributedModel`: a Keras model trained as a pipeline across MPI ranks.

Example::

    import tfsmp as smp
    smp.init({"partitions": 2, "microbatches": 4})
    model = smp.DistributedModel(keras_model)          # wrap any Keras model ...
    model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    model.fit(x, y, batch_size=64, epochs=3)           # ... and train it the Keras way

    class Net(smp.DistributedModel):                   # or subclass it, SMP-style
        def __init__(self):
            super().__init__()
            self.d1, self.d2 = keras.layers.Dense(64), keras.layers.Dense(10)
        def call(self, x):
            return self.d2(self.d1(x))

At first use the model is traced, planned into ``partitions × virtual_stages`` stages (on world
rank 0, then broadcast so every rank runs the same plan), and each rank keeps only its own
stages' variables: a model built inside `deferred_init()` allocates nothing until then; a built
model releases the variables other ranks own.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import keras
import numpy as np
import tensorflow as tf
from keras.src.backend import get_keras_mask, set_keras_mask

from tfsmp.errors import StepError
from tfsmp.keras.data import (
    BatchSource,
    batch_digest,
    capped_steps,
    check_same_batch,
    class_sample_weights,
    different_ranks,
    same_batch_error,
    split_validation,
)
from tfsmp.keras.overrides import check_overrides
from tfsmp.runtime import microbatch as mbatch

if TYPE_CHECKING:
    from tfsmp.core import State
    from tfsmp.runtime.view import RankView

__all__ = ["DistributedModel", "deferred_init", "register_post_partition_hook"]

_POST_PARTITION_HOOKS: list[Callable[[], Any]] = []


def register_post_partition_hook(fn: Callable[[], Any]) -> Callable[[], Any]:
    """Runs ``fn()`` on every rank right after the model is partitioned (usable as a decorator)."""
    _POST_PARTITION_HOOKS.append(fn)
    return fn


@contextlib.contextmanager
def deferred_init() -> Iterator[None]:
    """Build a model inside this scope to allocate no weights until each rank takes its stages."""
    from tfsmp.graph.deferred import deferred_scope

    with deferred_scope():
        yield


class DistributedModel(keras.Model):  # type: ignore[misc]
    """A Keras model whose layers run as pipeline stages across ranks. See the module docstring."""

    def __init__(self, model: keras.Model | Callable[[], keras.Model] | None = None,
                 *args: Any, **kwargs: Any) -> None:
        if model is not None and not isinstance(model, keras.Model):
            if callable(model):
                with deferred_init():
                    model = model()
            if not isinstance(model, keras.Model):
                raise TypeError(
                    f"DistributedModel wraps a keras.Model (or a function returning one). "
                    f"Received: {type(model).__name__}.")
        name = kwargs.pop("name", None) or (f"distributed_{model.name}" if model is not None else None)
        super().__init__(*args, name=name, **kwargs)
        self._wrapped = model
        if model is not None and hasattr(model, "output_names"):
            self.output_names = model.output_names
        self._engine: Any = None
        self._state: Any = None
        self._metrics_fn: Any = None
        self._loss_sum, self._loss_count = 0.0, 0
        self._profile_batch: Any = None
        DistributedModel._live.append(weakref.ref(self))

    _live: list[weakref.ref[Any]] = []

    @classmethod
    def _instances(cls) -> list[DistributedModel]:
        models = [r() for r in cls._live]
        cls._live = [r for r, m in zip(cls._live, models) if m is not None]
        return [m for m in models if m is not None]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from tfsmp.keras.step import active_context

        ctx = active_context()
        if ctx is not None and (ctx.model is None or ctx.model is self):
            ctx.model = self  # a step binds to the DistributedModel its body calls
            return self._step_call(ctx, args, kwargs)
        symbolic = any(isinstance(t, keras.KerasTensor) for t in tf.nest.flatten((args, kwargs)))
        if symbolic or self._wrapped is not None:
            return super().__call__(*args, **kwargs)
        raise StepError(
            "A DistributedModel subclass may be called only inside an smp.step function (its "
            "layers run on different ranks). Received: a call outside any step. Put the forward "
            "and backward pass in a function decorated with @smp.step.")

    def _step_call(self, ctx: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        from tfsmp.keras.step import CapturedCall

        if ctx.mode == "capture":
            raise CapturedCall(args, kwargs)
        ctx.calls += 1
        if ctx.calls > 1:
            raise StepError(
                "A step may call the DistributedModel once per microbatch. Received: a second "
                "call. Reuse its output, or put the whole computation in the model's call().")
        if ctx.mode == "run":
            return ctx.run_call(*args, **kwargs)
        x = args[0] if args else next(iter(kwargs.values()))  # "dry": shapes only
        with tf.init_scope():
            engine = self.engine_for(tf.nest.map_structure(
                lambda t: keras.KerasTensor(tuple(t.shape), dtype=t.dtype.name), x))
        rows = tf.shape(tf.nest.flatten(x)[0])[0]
        traced = engine.view.traced
        infos = [traced.graph.tensors[k] for k in traced.output_keys]
        dims = [info.shape for info in infos]
        if any(d is None for shape in dims for d in shape):  # known only from x's shapes
            dims = [shape[1:] for shape in engine.output_shapes(x)]
        return traced.pack_outputs(
            [_dry_zeros(rows, d, info.dtype) for d, info in zip(dims, infos)])

    # -- the rank's own variables after partitioning -------------------------------------------

    @property
    def trainable_variables(self) -> list[Any]:
        """Before partitioning: all of them. After: this rank's stages' (its optimizer's)."""
        view = self.rank_view
        if view is None:
            return list(super().trainable_variables)
        return list(view.trainable_variables)

    @property
    def trainable_weights(self) -> list[Any]:
        return self.trainable_variables

    @property
    def variables(self) -> list[Any]:
        """Before partitioning: all of them. After: this rank's stages' variables."""
        if self._engine is None:
            return list(super().variables)
        all_vars = self._all_variables()
        return [all_vars[i] for i in sorted(self._owned())]

    def profile(self, x: Any) -> None:
        """SMP's `profile`: measure per-layer times on this batch; the plan then balances
        measured time instead of FLOP estimates. Call before the first step."""
        self._profile_batch = x

    # -- Keras plumbing -----------------------------------------------------------------------

    def call(self, inputs: Any, training: Any = None) -> Any:
        if self._wrapped is None:
            raise NotImplementedError(
                "A DistributedModel subclass must implement call(), or wrap a model: "
                "DistributedModel(keras_model).")
        if self._engine is not None and tf.executing_eagerly():
            return self._pipelined_call(inputs)
        return self._wrapped(inputs, training=training)

    @property
    def wrapped(self) -> keras.Model | None:
        return self._wrapped

    # keras.callbacks.BackupAndRestore (docs/resume.md) requires `model.built`: a wrapped model
    # that is built, or a partitioned one, is built; otherwise Keras's own flag decides.
    @property
    def built(self) -> bool:
        wrapped = self.__dict__.get("_wrapped")
        return bool(self.__dict__.get("_tfsmp_built") or self.__dict__.get("_engine") is not None
                    or (wrapped is not None and wrapped.built))

    @built.setter
    def built(self, value: bool) -> None:
        self.__dict__["_tfsmp_built"] = bool(value)

    def compile(self, optimizer: Any = "rmsprop", loss: Any = None, loss_weights: Any = None,
                metrics: Any = None, weighted_metrics: Any = None, **kwargs: Any) -> None:
        if kwargs.get("jit_compile") is True:
            kwargs["jit_compile"] = False  # use the `xla` parameter: it compiles stage programs
        kwargs.setdefault("jit_compile", False)
        super().compile(optimizer=optimizer, loss=loss, loss_weights=loss_weights,
                        metrics=metrics, weighted_metrics=weighted_metrics, **kwargs)
        self._metrics_fn = None
        if self._engine is not None:
            self._engine.set_objective(getattr(self, "_compile_loss", None))
            self._engine.set_optimizer(self.optimizer)

    # -- setup ---------------------------------------------------------------------------------

    def _runtime_state(self) -> Any:
        import tfsmp.core as core

        if not core.is_initialized():
            core.init()
        return core.state()

    def _rank_tag(self) -> str:
        return f"[{self._state.tag()}]"

    # -- the public seam of the layers above (tfsmp/checkpoint) ---------------------------------

    # Methods, not properties: Keras's and TensorFlow's savers walk a model's properties, and
    # the source model of a subclass is the model itself.

    def runtime_state(self) -> State:
        """This process's runtime (`tfsmp.core.State`: config, topology, comm, rank), kept by
        the model from first use on; `smp.init()` runs with the environment's config if no one
        called it yet."""
        if self._state is None:
            self._state = self._runtime_state()
        return self._state  # type: ignore[no-any-return]

    def source_model(self) -> keras.Model:
        """The Keras model whose layers are partitioned: the wrapped model, or this model itself
        when it is a `DistributedModel` subclass."""
        return self._wrapped if self._wrapped is not None else self

    def resume_at(self, epoch: int | None, step: int) -> None:
        """Where the next `fit` starts: at batch ``step`` of ``epoch`` (counted from 0), as
        Keras's `BackupAndRestore` resumes (``epoch=None``: at `fit`'s own ``initial_epoch``);
        `fit` forgets it once it has started there."""
        self._initial_epoch, self._initial_step = epoch, step

    def resume_position(self) -> tuple[int, int]:
        """``(epoch, step)`` where the next `fit` starts, as `resume_at` set it (``(0, 0)``:
        at the beginning, or at `fit`'s ``initial_epoch``)."""
        return (int(getattr(self, "_initial_epoch", None) or 0),
                int(getattr(self, "_initial_step", 0) or 0))

    def engine_for(self, sample_x: Any) -> Any:
        if self._engine is not None:
            return self._engine
        from tfsmp.runtime.setup import build_engine

        self._state = self._runtime_state()
        if getattr(self, "optimizer", None) is None:
            self.optimizer = None  # SMP scripts apply gradients with their own optimizer
        self._engine = build_engine(
            self.source_model(), sample_x, self._state,
            compile_loss=getattr(self, "_compile_loss", None),
            optimizer=getattr(self, "optimizer", None), rank_tag=self._rank_tag(),
            subclassed=self._wrapped is None, profile_batch=self._profile_batch)
        import importlib.util

        if importlib.util.find_spec("tfsmp.checkpoint.export") is not None:
            from tfsmp.checkpoint import export

            export.remember_inputs(self, sample_x)  # save_model's signature takes these dtypes
            export.apply_pending(self)  # weights or a checkpoint restored before partitioning
        for hook in list(_POST_PARTITION_HOOKS):
            hook()
        return self._engine

    @property
    def rank_view(self) -> RankView | None:
        """This rank's view of the partitioned model (None before partitioning): its stages,
        their variables by checkpoint key, the writer of each key, the groups
        (tfsmp/runtime/view.py)."""
        return None if self._engine is None else self._engine.view

    def _view(self) -> RankView:
        """The view, once partitioned (every caller runs after partitioning)."""
        view = self.rank_view
        if view is None:
            raise StepError(
                "This needs the partitioned model. Received: a DistributedModel that has not "
                "run a step yet. Fix: call model.partition(x) or run a step first.")
        return view

    @property
    def plan(self) -> Any:
        """The `StagePlan` in use (None before first use)."""
        view = self.rank_view
        return None if view is None else view.plan

    def partition(self, sample_x: Any) -> Any:
        """Traces and partitions now (otherwise done at first use); returns the plan."""
        return self.engine_for(sample_x).view.plan

    # -- training ------------------------------------------------------------------------------

    def _check_compiled(self) -> None:
        if getattr(self, "_compile_loss", None) is None or getattr(self, "optimizer", None) is None:
            raise StepError(
                "fit needs a loss and an optimizer. Received: the model was not compiled with a "
                "loss. Call model.compile(optimizer=..., loss=...) first.")

    def _agree(self, value: Any) -> Any:
        """Rank 0's value of ``value`` on every rank."""
        return self._state.comm.world.bcast_obj(value, root=0)

    def train_on_batch(self, x: Any, y: Any = None, sample_weight: Any = None,
                       class_weight: Any = None, return_dict: bool = False) -> Any:
        """One optimizer step on one global batch; returns that batch's loss (as Keras does)."""
        self._check_compiled()
        self._state = self._runtime_state()
        check_overrides(self, "train_on_batch", rank_tag=self._rank_tag())
        if class_weight is not None:
            sample_weight = class_sample_weights(y, sample_weight, class_weight)
        engine = self.engine_for(x)
        self._reset_metrics()
        logs = self._train_batch(engine, x, y, sample_weight)
        return logs if return_dict else self._flatten_metrics_in_order(logs)  # as Keras orders

    def test_on_batch(self, x: Any, y: Any = None, sample_weight: Any = None,
                      return_dict: bool = False) -> Any:
        """Keras's ``test_on_batch``, pipelined: the batch's loss and metrics on every rank."""
        self._check_compiled()
        self._state = self._runtime_state()
        check_overrides(self, "test_on_batch", rank_tag=self._rank_tag())
        engine = self.engine_for(x)
        self._reset_metrics()
        logs = self._step_logs(engine.view, engine.evaluate(x, y, sample_weight),
                               mbatch.batch_size_of(x))
        return logs if return_dict else self._flatten_metrics_in_order(logs)

    def predict_on_batch(self, x: Any) -> Any:
        """Keras's ``predict_on_batch``, pipelined: the outputs on every rank."""
        self._state = self._runtime_state()
        check_overrides(self, "predict_on_batch", rank_tag=self._rank_tag())
        flat = self._forward_batch(x)
        return self._view().traced.pack_outputs(flat)

    def _train_batch(self, engine: Any, x: Any, y: Any, sw: Any) -> dict[str, float]:
        if y is None:  # every rank sees the same batch, so every rank raises, before any message
            raise StepError(
                f"{self._rank_tag()} The loss needs targets. Received: y=None. Pass y to fit(), "
                f"or yield (x, y) pairs from the dataset.")
        result = engine.train_step(x, y, sw)  # the global batch: [Note: one owner of the step]
        return self._step_logs(engine.view, result, mbatch.batch_size_of(x))

    def _step_logs(self, view: RankView, result: Any, global_batch: int) -> dict[str, float]:
        """Keras's logs after a batch: the mean loss so far (weighted by batch size), each
        output's loss and the compiled metrics, the same on every rank."""
        self._loss_sum += result.loss * global_batch
        self._loss_count += global_batch
        self._update_loss_metrics(result, global_batch)
        logs: dict[str, float] | None = None
        if view.is_last_rank:
            self._update_metrics(view, result)
            logs = self._metric_results(view)
        out: dict[str, float] = view.groups.pipeline.bcast_obj(logs, root=view.last_rank)
        return {"loss": self._loss_sum / max(self._loss_count, 1), **out}

    def _update_loss_metrics(self, result: Any, rows: int) -> None:
        """Keras keeps a Mean of each output's unweighted loss when there are several
        (`CompileLoss.metrics`); they get the batch's values, as in one process."""
        compile_loss = getattr(self, "_compile_loss", None)
        metrics = list(compile_loss.metrics) if compile_loss is not None else []
        for metric, value in zip(metrics, result.term_values):
            metric.update_state(value, sample_weight=rows)

    def _update_metrics(self, view: RankView, result: Any) -> None:
        """The compiled metrics, per microbatch of this replica, from the outputs (with their
        Keras masks) of the step that just ran on the last stage."""
        metrics = getattr(self, "_compile_metrics", None)
        if metrics is None:
            return
        for i in sorted(result.outputs):
            mb = result.microbatches[i]
            if mb.y is None:
                continue
            outputs = result.outputs[i]
            masks = [get_keras_mask(t) for t in outputs]
            if self._metrics_fn is None:
                metrics.update_state(mb.y, view.traced.pack_outputs(outputs), mb.sample_weight)
                self._metrics_fn = tf.function(self._metrics_update)  # eager first call built them
            else:
                self._metrics_fn(mb.y, outputs, masks, mb.sample_weight)

    def _metrics_update(self, y: Any, outputs: list[Any], masks: list[Any], sw: Any) -> None:
        for t, m in zip(outputs, masks):
            if m is not None:
                set_keras_mask(t, m)  # a compiled function's arguments carry no Keras mask
        self._compile_metrics.update_state(y, self._view().traced.pack_outputs(outputs), sw)

    def _logged_metrics(self) -> list[Any]:
        """What Keras logs besides "loss": the compiled metrics, then each output's loss (Keras
        keeps a Mean of each output's unweighted loss when there are several; every rank
        updates those with the batch's values, so no replica sum is needed for them)."""
        out = []
        metrics = getattr(self, "_compile_metrics", None)
        if metrics is not None and metrics.built:
            out.append(metrics)
        compile_loss = getattr(self, "_compile_loss", None)
        if compile_loss is not None:
            out.extend(compile_loss.metrics)
        return out

    def _metric_results(self, view: RankView) -> dict[str, float]:
        metrics = self._logged_metrics()
        compiled = getattr(self, "_compile_metrics", None)
        # the compiled metrics saw this replica's rows only; each output's loss, the batch's
        variables = list(compiled.variables) if compiled is not None and compiled.built else []
        saved = None
        if view.data_size > 1:  # sum metric states over replicas, read, then restore local ones
            saved = [v.numpy() for v in variables]
            for v in variables:
                buf = np.array(v.numpy(), dtype=np.float64)
                view.groups.data.allreduce_(buf)
                v.assign(buf.astype(v.dtype))
        out: dict[str, float] = {}
        for m in metrics:
            result = m.result()
            if isinstance(result, dict):
                out.update({k: float(np.asarray(v)) for k, v in result.items()})
            else:
                out[m.name] = float(np.asarray(result))
        if saved is not None:
            for v, s in zip(variables, saved):
                v.assign(s)
        return out

    def _reset_metrics(self) -> None:
        self._loss_sum, self._loss_count = 0.0, 0
        for m in self._logged_metrics():
            m.reset_state()

    def fit(self, x: Any = None, y: Any = None, batch_size: int | None = None, epochs: int = 1,
            verbose: Any = "auto", callbacks: list[Any] | None = None,
            validation_split: float = 0.0, validation_data: Any = None, shuffle: bool = True,
            class_weight: dict[int, float] | None = None, sample_weight: Any = None,
            initial_epoch: int = 0, steps_per_epoch: int | None = None,
            validation_steps: int | None = None, validation_batch_size: int | None = None,
            validation_freq: int = 1, **kwargs: Any) -> keras.callbacks.History:
        """Keras `fit`, pipelined. ``batch_size`` is the global batch (split over replicas)."""
        _reject(kwargs, (), "fit")
        self._check_compiled()
        self._state = self._runtime_state()
        check_overrides(self, "fit", rank_tag=self._rank_tag())
        epochs = min(epochs, keras.config.max_epochs() or epochs)  # Keras's debugging caps
        steps_per_epoch, validation_steps = map(capped_steps, (steps_per_epoch, validation_steps))
        if validation_split and validation_data is None:  # the arrays' tail, before shuffling
            (x, y, sample_weight), validation_data = split_validation(
                x, y, sample_weight, validation_split)
        entropy = int(np.random.SeedSequence().entropy or 0)  # type: ignore[arg-type]
        seed = self._agree(entropy % (2**31) if self._state.config.seed is None
                           else self._state.config.seed)
        source = BatchSource(x, y, sample_weight, batch_size=batch_size, shuffle=shuffle,
                             seed=seed, steps_per_epoch=steps_per_epoch, class_weight=class_weight)
        verbose = 1 if verbose == "auto" else verbose
        from tfsmp.checkpoint import fit_resume  # BackupAndRestore at the exact step, preemption

        cb = keras.callbacks.CallbackList(
            fit_resume.fit_callbacks(self, source, callbacks), add_history=True,
            add_progbar=bool(verbose) and self._state.rank == 0,
            model=self, verbose=verbose, epochs=epochs, steps=source.num_batches)
        self.stop_training = False
        self._prepare_checkpoint_dirs(cb)
        cb.on_train_begin()
        # tfsmp.checkpoint.BackupAndRestore sets where an interrupted fit stopped (as Keras's does)
        initial_epoch = getattr(self, "_initial_epoch", None) or initial_epoch
        skip = getattr(self, "_initial_step", 0) or 0
        self.resume_at(None, 0)
        logs: dict[str, float] = {}
        for epoch in range(initial_epoch, epochs):
            self._reset_metrics()
            cb.on_epoch_begin(epoch)
            for step, (xb, yb, wb) in enumerate(self._agreed(source, epoch)):
                if epoch == initial_epoch and step < skip:
                    continue
                cb.on_train_batch_begin(step)
                engine = self.engine_for(xb)
                logs = self._train_batch(engine, xb, yb, wb)
                cb.on_train_batch_end(step, logs)
                if self.stop_training:
                    break
            epoch_logs = dict(logs)
            if validation_data is not None and (epoch + 1) % validation_freq == 0:
                vx, vy, vw = _unpack(validation_data)
                val = self.evaluate(vx, vy, sample_weight=vw, verbose=0, return_dict=True,
                                    batch_size=validation_batch_size or batch_size,
                                    steps=validation_steps)
                epoch_logs.update({f"val_{k}": v for k, v in val.items()})
            cb.on_epoch_end(epoch, epoch_logs)
            if self.stop_training:
                break
        if self._engine is not None:
            self._engine.finalize()  # as Keras's fit ends: EMA weights swapped in (use_ema)
        cb.on_train_end(logs)
        return self.history

    def _prepare_checkpoint_dirs(self, cb: Any) -> None:
        """Creates ModelCheckpoint folders on rank 0 first: ranks racing Keras's makedirs would
        otherwise fail on one rank while the others wait in the collective save."""
        import os

        if self._state.rank == 0:
            for c in cb.callbacks:
                if isinstance(c, keras.callbacks.ModelCheckpoint):
                    folder = os.path.dirname(str(c.filepath))
                    if folder and "{" not in folder:
                        os.makedirs(folder, exist_ok=True)
        self._state.comm.world.barrier()

    def _agreed(self, source: BatchSource, epoch: int) -> Iterator[tuple[Any, Any, Any]]:
        """``source``'s batches while every rank has one. [Note: replicas run out together]
        A dataset or generator is iterated on every rank; if one rank runs out first, its
        peers would wait for it in the next step forever. Each step all ranks first agree
        (one small allgather) that all have a batch, before any message of the step; the same
        message carries the batch's digest. [Note: same batch on every rank]"""
        batches = source.epoch(epoch)
        world = self._state.comm.world
        if source.arrays:  # tfsmp batches arrays itself: the same count on every rank
            for step, rows in enumerate(batches):
                if step == 0:  # the sample count and the first batch of the epoch
                    check_same_batch(world, (source.num_samples, rows), rank_tag=self._rank_tag(),
                                     where=f"in the first batch of epoch {epoch}")
                yield rows
            return
        topo = self._state.topology
        for step in itertools.count():
            batch = next(batches, None)
            got = world.allgather_obj((batch is not None,
                                       None if batch is None else batch_digest(batch)))
            have = [h for h, _ in got]
            if all(have):
                digests = [d for _, d in got]
                if different_ranks(digests, list(world.ranks)):
                    raise same_batch_error(self._rank_tag(), digests, list(world.ranks),
                                           f"at step {step} of epoch {epoch}")
                yield batch  # type: ignore[misc]
                continue
            if any(have):
                short = [r for r, h in enumerate(have) if not h]
                replicas = sorted({topo.data_rank_of(r) for r in short})
                raise StepError(
                    f"{self._rank_tag()} Every rank's dataset must yield the same number of "
                    f"batches. Received: rank(s) {short} (data replica(s) {replicas}) ran out "
                    f"of data at step {step} of epoch {epoch} while the others had a batch. "
                    f"Give every rank the same dataset (seeded alike), or pass "
                    f"steps_per_epoch= no larger than the shortest one.")
            return

    # -- inference -----------------------------------------------------------------------------

    def _forward_batch(self, x: Any) -> Any:
        """Pipelined forward of a global batch; returns merged outputs on every rank."""
        engine = self.engine_for(x)
        _, result = engine.forward(x)
        return self._gather_outputs(engine.view, result)

    def _gather_outputs(self, view: RankView, result: Any) -> Any:
        """The outputs of every replica's rows, in batch order, on every rank."""
        flat = None
        if view.is_last_rank:
            parts = [[np.asarray(t) for t in result.outputs[i]] for i in sorted(result.outputs)]
            flat = ([np.concatenate([p[j] for p in parts]) for j in range(len(parts[0]))]
                    if parts else None)
            if view.data_size > 1:
                gathered = [g for g in view.groups.data.allgather_obj(flat) if g is not None]
                flat = [np.concatenate([g[j] for g in gathered]) for j in range(len(gathered[0]))]
        return view.groups.pipeline.bcast_obj(flat, root=view.last_rank)

    def _pipelined_call(self, inputs: Any) -> Any:
        flat = self._forward_batch(tf.nest.map_structure(np.asarray, inputs))
        return self._view().traced.pack_outputs([tf.convert_to_tensor(v) for v in flat])

    def predict(self, x: Any, batch_size: int | None = None, verbose: Any = "auto",
                steps: int | None = None, callbacks: Any = None) -> Any:
        """Pipelined predict; the outputs are returned on every rank."""
        self._state = self._runtime_state()
        check_overrides(self, "predict", rank_tag=self._rank_tag())
        source = BatchSource(x, None, None, batch_size=batch_size, steps_per_epoch=steps)
        chunks = [self._forward_batch(xb) for xb, _, _ in source.epoch(0)]
        traced = self._view().traced
        flat = [np.concatenate([c[j] for c in chunks]) for j in range(len(chunks[0]))]
        return traced.pack_outputs(flat)

    def evaluate(self, x: Any = None, y: Any = None, batch_size: int | None = None,
                 verbose: Any = "auto", sample_weight: Any = None, steps: int | None = None,
                 callbacks: Any = None, return_dict: bool = False, **kwargs: Any) -> Any:
        """Pipelined evaluate: the loss Keras's test step computes (compiled loss, layer losses,
        weight regularizers) and the compiled metrics over the data, on every rank."""
        self._check_compiled()
        self._state = self._runtime_state()
        check_overrides(self, "evaluate", rank_tag=self._rank_tag())
        source = BatchSource(x, y, sample_weight, batch_size=batch_size, steps_per_epoch=steps)
        self._reset_metrics()
        logs: dict[str, float] = {}
        for xb, yb, wb in self._agreed(source, 0):
            engine = self.engine_for(xb)
            result = engine.evaluate(xb, yb, wb)
            logs = self._step_logs(engine.view, result, mbatch.batch_size_of(xb))
        if return_dict:
            return logs
        return self._flatten_metrics_in_order(logs)  # Keras's order: loss, output losses, ...

    # -- weights -------------------------------------------------------------------------------

    def _all_variables(self) -> list[Any]:
        if self._wrapped is not None:
            return list(self._wrapped.weights)
        return list(keras.Model.weights.fget(self))

    def _owned(self) -> set[int]:
        mine = {id(v) for v in self._view().held_variables().values()}
        return {i for i, v in enumerate(self._all_variables()) if id(v) in mine}

    def get_weights(self) -> list[np.ndarray]:
        """All weights of the whole model, in the wrapped model's order, on every rank."""
        if self._engine is None:
            return list(self.source_model().get_weights())
        variables = self._all_variables()
        owned = self._owned()
        local = {i: variables[i].numpy() for i in owned}
        merged: dict[int, np.ndarray] = {}
        for part in self._view().groups.pipeline.allgather_obj(local):
            merged.update(part)
        out: list[np.ndarray] = [merged[i] for i in range(len(variables))]
        return out

    def set_weights(self, weights: list[Any]) -> None:
        """Sets all weights (the whole model's list); each rank assigns only its own."""
        if self._engine is None:
            self.source_model().set_weights(weights)
            return
        variables = self._all_variables()
        if len(weights) != len(variables):
            raise ValueError(
                f"set_weights needs one array per model weight. Received: {len(weights)} arrays "
                f"for {len(variables)} weights.")
        for i in self._owned():
            if tuple(np.shape(weights[i])) != tuple(variables[i].shape):
                raise ValueError(
                    f"Weight shapes must match. Received: shape {np.shape(weights[i])} for "
                    f"'{variables[i].path}' of shape {tuple(variables[i].shape)}.")
            variables[i].assign(weights[i])

    def save(self, filepath: str, overwrite: bool = True, **kwargs: Any) -> None:
        """Writes the whole model as a plain Keras file (``.keras``, or legacy ``.h5``) or its
        weights (``.weights.h5``). Call on every rank; rank 0 writes."""
        from tfsmp.checkpoint import export

        export.save(self, filepath, overwrite=overwrite, **kwargs)

    def save_weights(self, filepath: str, overwrite: bool = True, **kwargs: Any) -> None:
        """Writes a standard Keras ``.weights.h5`` of the whole model (every rank calls)."""
        from tfsmp.checkpoint import export

        export.save_weights(self, filepath, overwrite=overwrite)

    def load_weights(self, filepath: str, skip_mismatch: bool = False, **kwargs: Any) -> None:
        """Loads plain-Keras weights; each rank reads only its own variables."""
        from tfsmp.checkpoint import export

        export.load_weights(self, filepath, skip_mismatch=skip_mismatch)

    def save_model(self, save_path: str = "/opt/ml/model") -> None:
        """SMP's `save_model`: the whole unpartitioned model as a TensorFlow SavedModel."""
        from tfsmp.checkpoint import export

        export.save_model(self, save_path)

    def held_variable_bytes(self) -> int:
        """Bytes of model weights that hold storage in this process (after partitioning: only
        this rank's stages; the others were released or never allocated)."""
        return sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize
                   for v in self._all_variables() if getattr(v, "_value", None) is not None)

    def summary(self, *args: Any, **kwargs: Any) -> None:
        """Prints each layer with its stage (plan known) or the wrapped model's summary."""
        if self._engine is None:
            self.source_model().summary(*args, **kwargs)
            return None
        print_fn = kwargs.get("print_fn") or print
        view = self._view()
        plan, graph = view.plan, view.traced.graph
        width = max(len(n) for n in plan.stage_of)
        print_fn(f"DistributedModel '{self.name}': {plan.num_stages} stages ({plan.planner} plan, "
                 f"imbalance {plan.imbalance():.2f})")
        print_fn(f"{'layer':<{width}}  {'kind':<22} {'stage':>5} {'params':>10}")
        for name, stage in plan.stage_of.items():
            node = graph.nodes[name]
            print_fn(f"{name:<{width}}  {node.kind:<22} {stage:>5} {node.param_count:>10}")
        return None


def _dry_zeros(rows: Any, dims: tuple[int | None, ...], dtype: str) -> tf.Tensor:
    """Zeros shaped like a step's model output: exact where ``dims`` are known (always when
    eager), and of statically unknown size where a traced input's shape leaves them unknown."""
    known = tf.constant([1 if d is None else int(d) for d in dims], tf.int32)
    zeros = tf.zeros(tf.concat([[rows], known], 0), dtype=dtype)
    if any(d is None for d in dims):
        zeros = tf.compat.v1.placeholder_with_default(zeros, shape=[None, *dims])
    return zeros


def _reject(kwargs: dict[str, Any], names: tuple[str, ...], method: str) -> None:
    """Keras's TypeError for unknown keywords (``names``: accepted and ignored ones)."""
    unknown = set(kwargs) - set(names)
    if unknown:
        raise TypeError(f"{method}() got unexpected keyword arguments: {sorted(unknown)}")


def _unpack(data: Any) -> tuple[Any, Any, Any]:
    if isinstance(data, tuple):
        padded = (*data, None, None, None)
        return padded[0], padded[1], padded[2]
    return data, None, None

