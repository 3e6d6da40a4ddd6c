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

Training is Keras's own trainer: `fit`, `evaluate`, `predict` and the ``*_on_batch`` calls are
`keras.Model`'s, and this class supplies only the step functions they call
(`make_train_function` and its siblings: [Note: Keras's trainer drives] in
tfsmp/keras/trainer_steps.py).
"""

from __future__ import annotations

import contextlib
import io
import os
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import keras
import numpy as np
import tensorflow as tf
from keras.src.trainers.trainer import Trainer

from tfsmp.comm import collective_label
from tfsmp.errors import ConfigError, StepError
from tfsmp.keras.data import agree_shuffle_seed, sampler
from tfsmp.keras.log_writers import plan_callbacks, writer_guards
from tfsmp.keras.overrides import check_overrides, check_trainable

if TYPE_CHECKING:
    from tfsmp.core import State
    from tfsmp.keras.trainer_steps import TrainerSteps
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


def _is_model(model: Any) -> bool:
    """A ``keras.Model``, or a layer with Keras's `Trainer` mixed in ([Note: a layer with
    Keras's Trainer] in tfsmp/graph/tracer.py): what Keras itself trains."""
    return isinstance(model, keras.Model) or (isinstance(model, keras.layers.Layer)
                                              and isinstance(model, Trainer))


def _as_model(model: Any) -> Any:
    """The model `DistributedModel` wraps: ``model``, or what a function returns (built in
    `deferred_init`); None for a subclass of its own.

    Raises:
        TypeError: neither a model nor a function returning one.
    """
    if isinstance(model, keras.layers.Layer) and not _is_model(model):
        raise TypeError(
            f"DistributedModel wraps a keras.Model (or a function returning one, or a layer "
            f"that mixes Keras's Trainer in). Received: {type(model).__name__}, a keras "
            f"Layer, not a Model. Fix: build a model of it, e.g. "
            f"keras.Sequential([keras.Input(shape), layer]) or a Functional model; a "
            f"pipeline needs at least as many layers as partitions.")
    if model is not None and not _is_model(model):
        if callable(model):
            with deferred_init():
                model = model()
        if not _is_model(model):
            raise TypeError(
                f"DistributedModel wraps a keras.Model (or a function returning one). "
                f"Received: {type(model).__name__}.")
    return model


@keras.saving.register_keras_serializable(package="tfsmp")
class DistributedModel(keras.Model):  # type: ignore[misc]
    """A Keras model whose layers run as pipeline stages across ranks. See the module docstring."""

    def __init__(self, model: keras.Model | Callable[[], keras.Model] | None = None,
                 *args: Any, **kwargs: Any) -> None:
        wrapped = _as_model(model)  # a keras.Model, or a layer with Trainer mixed in
        name = kwargs.pop("name", None) or (
            f"distributed_{wrapped.name}" if wrapped is not None else None)
        super().__init__(*args, name=name, **kwargs)
        self._wrapped = wrapped
        if wrapped is not None and hasattr(wrapped, "output_names"):
            self.output_names = wrapped.output_names
        self._engine: Any = None
        self._state: Any = None
        self._trainer_steps: TrainerSteps | None = None
        # variable ids and trainable flags at partitioning: [Note: changing the model]
        self._trained_set: tuple[tuple[int, ...], tuple[bool, ...]] | None = None
        self._profile_batch: Any = None
        self._resume_skip = 0  # [Note: exact resume] in tfsmp/checkpoint/fit_resume.py
        self._terminate_on_nan = False  # a fit with Keras's TerminateOnNaN: `nonfinite_mode`
        DistributedModel._live.append(weakref.ref(self))
        _install_saving()

    _live: list[weakref.ref[Any]] = []

    def __getattr__(self, name: str) -> Any:
        """The wrapped model's public attributes that this model lacks (``dm.train_counter``,
        ``dm.encoder``), as a callback's ``self.model`` finds them on the user's model in
        plain Keras: a callback gets the `DistributedModel`. Called only when the normal lookup
        fails; private names and a model without a wrapped one fail as usual."""
        wrapped = self.__dict__.get("_wrapped")
        if wrapped is None or name.startswith("_"):
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")
        return getattr(wrapped, name)

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

    # -- the user's model as Keras code reads it -----------------------------------------------

    @property
    def layers(self) -> list[Any]:
        """The wrapped model's `layers`, as a callback's ``self.model.layers`` (TensorBoard's
        weights and embeddings, a user's callback) and `get_layer` find them on the user's
        model in plain Keras; a `DistributedModel` subclass has its own."""
        wrapped = self.__dict__.get("_wrapped")
        if wrapped is not None and isinstance(wrapped, keras.Model):
            return list(wrapped.layers)
        return list(keras.Model.layers.fget(self))

    @layers.setter
    def layers(self, value: Any) -> None:
        keras.Model.layers.fset(self, value)  # Keras's: the name is reserved

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
        # a wrapped model whose class computes its own loss from state its own compile keeps
        # (Keras's Distiller: its student loss) is compiled that way first, as its user would
        # compile it; unless it was compiled before it was wrapped (by its user, who compiles
        # it again). Other models' own compiles (keras_hub's tasks) are not run: what they set
        # on the wrapped model is not what the pipeline trains with.
        wrapped = self.__dict__.get("_wrapped")
        forward = self.__dict__.get("_tfsmp_compiles_wrapped")
        if forward is None and wrapped is not None:
            from tfsmp.keras.model_loss import overridden_by

            forward = self.__dict__["_tfsmp_compiles_wrapped"] = (
                type(wrapped).compile is not keras.Model.compile
                and overridden_by(self) is wrapped
                and not getattr(wrapped, "compiled", False))
        if forward and wrapped is not None:
            extra = {k: v for k, v in (("loss_weights", loss_weights),
                                       ("weighted_metrics", weighted_metrics)) if v is not None}
            type(wrapped).compile(wrapped, optimizer=optimizer, loss=loss, metrics=metrics,
                                  **extra, **kwargs)
        super().compile(optimizer=optimizer, loss=loss, loss_weights=loss_weights,
                        metrics=metrics, weighted_metrics=weighted_metrics, **kwargs)
        self._trainer_steps = None  # Keras's compile dropped its step functions too
        if self._engine is None:
            return
        if not self._refresh_engine():
            self._engine.set_objective(getattr(self, "_compile_loss", None))
            self._engine.set_optimizer(self.optimizer)
        self._attach_optimizer_view()  # the new optimizer lists its variables as Keras's would
        self._attach_model_loss()

    def compile_from_config(self, config: dict[str, Any]) -> None:
        """Keras's `compile_from_config` (how a loaded or cloned model is compiled again);
        the optimizer is built when the model is partitioned, on each rank's own variables."""
        from keras.src.saving import serialization_lib

        self.compile(**serialization_lib.deserialize_keras_object(config))

    # [Note: jit_compile is xla] Keras's `compile(jit_compile=True)` asks for XLA, and the
    # pipeline honours it where XLA can run: in the stage programs, as the `xla` parameter
    # does. Keras resolves the argument ("auto", a model with a layer that does not support
    # XLA, `run_eagerly`: with its own warnings) into `model.jit_compile`, which is read here
    # when the stage programs are made; Keras's own train function, which would compile the
    # whole step, is replaced ([Note: Keras's trainer drives] in trainer_steps.py), because
    # the step sends messages and runs collectives that XLA cannot compile. Stage programs
    # compiled with XLA give what plain Keras compiled with `jit_compile=True` gives (Dropout's
    # masks included: XLA draws other random bits than TensorFlow's kernels),
    # tests/mpi/test_runtime_equality.py. A new compile that changes it rebuilds the stage
    # programs, as [Note: changing the model] does.

    # [Note: changing the model] Keras reads which variables train when it builds its train
    # function, so freezing or unfreezing layers and compiling again trains the new set. The
    # stage programs fix their trainable variables when built; so before a training step, a
    # model whose trainable flags changed since partitioning gets new stage programs under the
    # same plan (each rank keeps its variables and their values), with the compiled loss and
    # optimizer. A model whose variables changed (enable_lora, quantize, layers added) would
    # need a new plan, with variables other ranks hold: it is refused.

    def _trainable_signature(self) -> tuple[tuple[int, ...], tuple[bool, ...]]:
        variables = self._all_variables()
        return tuple(id(v) for v in variables), tuple(bool(v.trainable) for v in variables)

    def _xla(self) -> bool:
        """Whether the stage programs compile with XLA: the `xla` parameter, or Keras's
        ``compile(jit_compile=True)`` ([Note: jit_compile is xla])."""
        config = self.runtime_state().config
        if self.jit_compile is True and config.blas == "openblas":
            raise ConfigError(
                "compile(jit_compile=True) compiles the stage programs' products with XLA's "
                "own, and blas='openblas' chooses the kernel of TensorFlow's MatMul. Received: "
                "jit_compile=True, blas='openblas'. Use one of them: compile(jit_compile=False), "
                "or blas='tensorflow'.")
        return bool(self.jit_compile) or bool(config.xla)

    def _refresh_engine(self) -> bool:
        """New stage programs if the trainable flags changed ([Note: changing the model]) or
        a new `compile` asks for XLA where the programs have none, or the reverse; returns
        whether it made them."""
        if self._engine is None:
            return False
        ids, flags = self._trainable_signature()
        before = self._trained_set
        if before is None or ((ids, flags) == before
                              and self._engine.compiles_with_xla() == self._xla()):
            return False
        if ids != before[0]:
            raise StepError(
                f"{self._rank_tag()} A partitioned model's variables must stay those it was "
                f"partitioned with. Received: {len(ids)} variables now, {len(before[0])} at "
                f"partitioning (enable_lora, quantize or a layer change after the first step). "
                f"Fix: make the change before the first step (or model.partition), or wrap the "
                f"changed model in a new DistributedModel.")
        from tfsmp.runtime.setup import rebuild_engine

        self._engine = rebuild_engine(self._engine, getattr(self, "_compile_loss", None),
                                      getattr(self, "optimizer", None), xla=self._xla())
        self._trained_set = (ids, flags)
        self._attach_model_loss()
        return True

    def model_loss(self) -> Any:
        """The model's own compute_loss as the step's loss term, or None when its class keeps
        Keras's ([Note: a model's own compute_loss] in tfsmp/keras/model_loss.py)."""
        return self.__dict__.get("_tfsmp_model_loss")

    def _attach_model_loss(self) -> None:
        from tfsmp.keras.model_loss import ModelLoss, overridden_by

        found = self.__dict__.get("_tfsmp_model_loss")
        if found is None or found.owner is not overridden_by(self):
            found = self.__dict__["_tfsmp_model_loss"] = ModelLoss.of(self)
        if self._engine is not None:
            self._engine.set_custom_loss(found)

    def _attach_optimizer_view(self) -> None:
        """[Note: the optimizer as Keras lists it] in tfsmp/checkpoint/keras_optimizer.py."""
        import importlib.util

        if importlib.util.find_spec("tfsmp.checkpoint.keras_optimizer") is not None:
            from tfsmp.checkpoint import keras_optimizer

            keras_optimizer.attach_view(self)

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
            subclassed=self._wrapped is None, xla=self._xla(), profile_batch=self._profile_batch)
        self._trained_set = self._trainable_signature()
        import importlib.util

        if importlib.util.find_spec("tfsmp.checkpoint.export") is not None:
            from tfsmp.checkpoint import export

            export.remember_inputs(self, sample_x)  # save_model's signature takes these dtypes
            export.apply_pending(self)  # weights or a checkpoint restored before partitioning
        self._attach_optimizer_view()
        self._attach_model_loss()
        for hook in list(_POST_PARTITION_HOOKS):
            hook()
        return self._engine

    @property
    def rank_view(self) -> RankView | None:
        """This rank's view of the partitioned model (None before partitioning): its stages,
        their variables by checkpoint key, the writer of each key, the groups
        (tfsmp/runtime/view.py)."""
        return None if self._engine is None else self._engine.view

    def rank_view_or_raise(self) -> RankView:
        """The view, once partitioned; a clear error before."""
        return self._view()

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

    # -- training: Keras's own trainer, tfsmp's step ([Note: Keras's trainer drives]) ----------

    def _check_compiled(self) -> None:
        # a model compiled without a loss trains on its layers' losses, as in Keras; whether
        # it has any is the engine's check, on every rank before the first step
        if getattr(self, "optimizer", None) is None:
            raise StepError(
                "fit needs a loss and an optimizer. Received: a model not compiled with an "
                "optimizer (one whose layers add their own losses needs only the optimizer). "
                "Call model.compile(optimizer=..., loss=...) first.")

    def _steps(self, entry: str, *, train: bool = False, loss: bool = False) -> TrainerSteps:
        """The step functions Keras's trainer calls, after the checks every entry point makes
        before any work: compiled (``loss``), no override tfsmp cannot run, the model unchanged
        since partitioning ([Note: changing the model])."""
        from tfsmp.keras.trainer_steps import TrainerSteps

        self._state = self._runtime_state()
        if loss:
            self._check_compiled()
        check_overrides(self, entry, rank_tag=self._rank_tag())
        if train:
            config, data = self._state.config, self._state.comm.data.size
            check_trainable(self, pipeline_ranks=config.partitions,
                            parts=config.microbatches * data, rank_tag=self._rank_tag())
            self._refresh_engine()
        if self._trainer_steps is None:
            self._trainer_steps = TrainerSteps(self)
        return self._trainer_steps

    def make_train_function(self, force: bool = False) -> Any:
        return self._install("train_function", force,
                             lambda: self._steps("fit", train=True, loss=True).train)

    def make_test_function(self, force: bool = False) -> Any:
        return self._install("test_function", force,
                             lambda: self._steps("evaluate", loss=True).test)

    def make_predict_function(self, force: bool = False) -> Any:
        return self._install("predict_function", force, lambda: self._steps("predict").predict)

    def _install(self, name: str, force: bool, make: Callable[[], Any]) -> Any:
        """Keras's ``make_*_function`` contract: the function Keras keeps in ``name``, made
        once (after each compile) unless ``force``."""
        current = getattr(self, name, None)
        if current is not None and not force:
            return current
        function = make()
        setattr(self, name, function)
        return function

    def _rank_verbose(self, verbose: Any) -> Any:
        """Keras's progress bar on world rank 0 only (every rank runs Keras's loop)."""
        return verbose if self.runtime_state().rank == 0 else 0

    @collective_label("DistributedModel.fit")
    def fit(self, x: Any = None, y: Any = None, batch_size: int | None = None, epochs: int = 1,
            verbose: Any = "auto", callbacks: Any = None, **kwargs: Any) -> Any:
        """Keras's `fit`, unchanged ([Note: Keras's trainer drives]); ``batch_size`` is the
        global batch (split over replicas). tfsmp adds its fault-tolerance callbacks around the
        user's ([Note: Keras's BackupAndRestore] in tfsmp/checkpoint/fit_resume.py)."""
        from tfsmp.checkpoint import fit_resume
        from tfsmp.keras.trainer_steps import agree_finished

        self._state = self._runtime_state()
        self._check_compiled()
        check_overrides(self, "fit", rank_tag=self._rank_tag())
        agree_shuffle_seed(self._state.comm.world)
        user = fit_resume.user_callbacks(callbacks)
        world, parts = self._state.comm.world, self._state.config.partitions
        # [Note: one writer of the logs], [Note: a writer failing on rank 0]
        mine, end, guarded = plan_callbacks(user, verbose, True, self, world, parts, "fit")
        wrapped = fit_resume.fit_callbacks(self, sampler(x, batch_size), mine) + end
        self._terminate_on_nan = any(isinstance(c, keras.callbacks.TerminateOnNaN) for c in user)
        try:
            # [Note: TensorBoard's weights]
            with writer_guards(mine + end, guarded, self, world, parts):
                history = super().fit(x, y, batch_size, epochs, self._rank_verbose(verbose),
                                      wrapped, **kwargs)
        finally:
            self.resume_at(None, 0)
            self._terminate_on_nan = False
        agree_finished(self, "fit")
        return history

    @collective_label("DistributedModel.evaluate")
    def evaluate(self, x: Any = None, y: Any = None, batch_size: int | None = None,
                 verbose: Any = "auto", sample_weight: Any = None, steps: int | None = None,
                 callbacks: Any = None, return_dict: bool = False, **kwargs: Any) -> Any:
        """Keras's `evaluate`, unchanged: the logs on every rank."""
        from tfsmp.keras.trainer_steps import agree_finished

        inside_fit = bool(kwargs.get("_use_cached_eval_dataset"))  # fit's callbacks as they are
        with self._log_writers(callbacks, verbose, inside_fit, "evaluate") as callbacks:
            logs = super().evaluate(x, y, batch_size, self._rank_verbose(verbose), sample_weight,
                                    steps, callbacks, return_dict, **kwargs)
        if not inside_fit:
            agree_finished(self, "evaluate")
        return logs

    @collective_label("DistributedModel.predict")
    def predict(self, x: Any, batch_size: int | None = None, verbose: Any = "auto",
                steps: int | None = None, callbacks: Any = None) -> Any:
        """Keras's `predict`, unchanged: the outputs on every rank."""
        from tfsmp.keras.trainer_steps import agree_finished

        with self._log_writers(callbacks, verbose, False, "predict") as callbacks:
            out = super().predict(x, batch_size, self._rank_verbose(verbose), steps, callbacks)
        agree_finished(self, "predict")
        return out

    @contextlib.contextmanager
    def _log_writers(self, callbacks: Any, verbose: Any, inside_fit: bool,
                     entry: str) -> Iterator[Any]:
        """The callbacks of an `evaluate` or `predict` on this rank: the log writers and the
        progress bar on world rank 0 only, with their peers elsewhere ([Note: one writer of the
        logs], [Note: a writer failing on rank 0]), TensorBoard's model summary the wrapped
        model's; evaluate inside `fit` gets fit's, already so."""
        if inside_fit:
            yield callbacks
            return
        from tfsmp.checkpoint import fit_resume

        state = self.runtime_state()
        world = state.comm.world
        user = fit_resume.user_callbacks(callbacks)
        mine, end, guarded = plan_callbacks(user, verbose, False, self, world, 1, entry)
        if not mine + end:
            yield callbacks
            return
        with writer_guards(mine + end, guarded, self, world, 1):  # no epoch ends: no weights
            yield mine + end

    @property
    def metrics(self) -> list[Any]:
        """Keras's `metrics` of this model, with the metrics the wrapped model holds.

        [Note: held metrics] Keras lists a model's compiled trackers, then the `Metric` objects
        the model holds as attributes (``self.my_metric = keras.metrics.Mean()``), then those
        its layers hold, walking every layer below it but skipping the metrics of a layer that
        mixes Keras's `Trainer` in. Here the model is the `DistributedModel` and the user's
        model such a layer: Keras's walk still reaches the user's layers, but drops the metrics
        the user's model holds itself. They go where Keras puts them for the user's model,
        after the compiled trackers and before the layers' metrics, so `History`,
        `get_metrics_result()`, `reset_metrics()` and `metrics_variables` see what plain Keras
        sees. A held metric that a layer's `call()` updates is updated per microbatch, on the
        ranks that run that layer, like other state a layer changes in its call
        (docs/keras_semantics.md, "Per microbatch").
        """
        found = list(super().metrics)
        wrapped = self.__dict__.get("_wrapped")
        held = list(wrapped._metrics) if wrapped is not None else []  # noqa: SLF001 (a Keras layer's)
        if not held:
            return found
        below = sum(len(layer.metrics) for layer in self._flatten_layers(include_self=False)
                    if not isinstance(layer, Trainer))
        return found[:len(found) - below] + held + found[len(found) - below:]

    # -- what the step functions read (methods: Keras's savers walk properties) ---------------

    def loss_tracker(self) -> Any:
        """Keras's tracker of the mean loss (``model.metrics[0]``)."""
        return self._loss_tracker

    def compiled_loss_metrics(self) -> list[Any]:
        """Keras's Mean of each output's loss, when the model has several outputs."""
        compile_loss = getattr(self, "_compile_loss", None)
        return list(compile_loss.metrics) if compile_loss is not None else []

    def compiled_metrics_object(self) -> Any:
        """Keras's `CompileMetrics` of the compiled metrics (None: none compiled)."""
        return getattr(self, "_compile_metrics", None)

    def nonfinite_mode(self) -> str:
        """What a training step does with a non-finite loss or gradient: the ``nonfinite``
        parameter, or, during a ``fit`` with Keras's ``TerminateOnNaN``, "apply": as in plain
        Keras, the step applies what it computed and reports the loss, and the callback stops
        training."""
        if self._terminate_on_nan:
            return "apply"
        return str(self.runtime_state().config.nonfinite)

    def fit_position(self) -> dict[str, int] | None:
        """Where the running ``fit`` is: ``{"epoch": e, "step": s}``, s batches of epoch e done
        (None outside fit, or before its first step)."""
        from tfsmp.checkpoint import fit_resume

        return fit_resume.current_position(self)

    def take_resume_skip(self) -> int:
        """Batches of the current epoch that an interrupted run had trained on, once: the
        step functions pass over them ([Note: exact resume] in fit_resume)."""
        skip, self._resume_skip = self._resume_skip, 0
        return skip

    def skip_batches(self, count: int) -> None:
        """The next epoch starts ``count`` batches in ([Note: exact resume] in fit_resume)."""
        self._resume_skip = int(count)

    # -- inference -----------------------------------------------------------------------------

    def _pipelined_call(self, inputs: Any) -> Any:
        from tfsmp.keras.trainer_steps import TrainerSteps

        steps = self._trainer_steps or TrainerSteps(self)
        flat = steps.forward(tf.nest.map_structure(np.asarray, inputs))
        return self._view().traced.pack_outputs([tf.convert_to_tensor(v) for v in flat])

    # -- weights -------------------------------------------------------------------------------

    def _all_variables(self) -> list[Any]:
        if self._wrapped is not None:
            return list(self._wrapped.weights)
        return list(keras.Model.weights.fget(self))

    def _owned(self) -> set[int]:
        mine = {id(v) for v in self._view().held_variables().values()}
        return {i for i, v in enumerate(self._all_variables()) if id(v) in mine}

    def model_weights(self) -> list[Any]:
        """Every weight of the whole model, in `get_weights`'s order (after partitioning this
        rank holds the values of those `held_weights` names only)."""
        return self._all_variables()

    def held_weights(self) -> set[int]:
        """The indices in `model_weights` of the weights this rank holds."""
        if self._engine is None:
            return set(range(len(self._all_variables())))
        return self._owned()

    @collective_label("DistributedModel.get_weights")
    def get_weights(self) -> list[np.ndarray]:
        """All weights of the whole model, in the wrapped model's order, on every rank."""
        if self._engine is None:
            return list(self.source_model().get_weights())
        count = len(self._all_variables())
        merged = self.weights_at(set(range(count)))
        return [merged[i] for i in range(count)]

    def weights_at(self, indices: set[int]) -> dict[int, np.ndarray]:
        """The weights at these indices of `model_weights`, gathered on every rank of this
        rank's pipeline (every rank calls, with the same indices)."""
        variables = self._all_variables()
        if self._engine is None:
            return {i: variables[i].numpy() for i in sorted(indices)}
        local = {i: variables[i].numpy() for i in self._owned() if i in indices}
        merged: dict[int, np.ndarray] = {}
        for part in self._view().groups.pipeline.allgather_obj(local):
            merged.update(part)
        for i in sorted(indices - set(merged)):  # no stage holds it: the model holds it but
            merged[i] = variables[i].numpy()      # its call never reads it (a Distiller's
        return merged                             # teacher), and no rank released it

    @collective_label("DistributedModel.set_weights")
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

    def save(self, filepath: Any, overwrite: bool = True, zipped: bool | None = None,
             **kwargs: Any) -> None:
        """Keras's `save`: the whole model as the plain Keras file ``keras.Model.save`` writes
        of the unpartitioned model (``.keras``, or legacy ``.h5``), or (tfsmp's addition) its
        weights (``.weights.h5``). Call on every rank; world rank 0 writes ([Note: Keras's
        saving functions] in tfsmp/checkpoint/keras_saving.py)."""
        from tfsmp.checkpoint import export

        path = None if isinstance(filepath, io.IOBase) else str(os.fspath(filepath))
        if path is not None and path.endswith(".weights.h5") and not kwargs and zipped is None:
            export.save_weights(self, path, overwrite=overwrite)
            return
        if path is not None and not overwrite:
            export.check_overwrite(self, path)  # Keras would prompt, on every rank
        try:
            super().save(filepath, overwrite=True, zipped=zipped, **kwargs)
        except ValueError as e:  # Keras's words, and where a SavedModel comes from here
            if "Invalid filepath extension" not in str(e):
                raise
            raise ValueError(
                f"{e} A DistributedModel also writes its weights to `.weights.h5`; for a "
                f"TensorFlow SavedModel call model.save_model(directory); to resume training "
                f"use tfsmp.CheckpointManager.") from None

    def save_weights(self, filepath: str, overwrite: bool = True, **kwargs: Any) -> None:
        """Writes a standard Keras ``.weights.h5`` of the whole model (every rank calls)."""
        from tfsmp.checkpoint import export

        export.save_weights(self, filepath, overwrite=overwrite)

    def load_weights(self, filepath: str, skip_mismatch: bool = False, **kwargs: Any) -> None:
        """Loads plain-Keras weights; each rank reads only its own variables.

        A legacy `.h5` file, and Keras's extra arguments (``by_name``, ``objects_to_skip``), go
        through Keras's own `load_weights` (its argument checks), whose readers tfsmp
        dispatches ([Note: legacy h5 weights] in tfsmp/checkpoint/keras_saving.py)."""
        from tfsmp.checkpoint import export

        path = str(os.fspath(filepath))
        legacy = path.endswith((".h5", ".hdf5")) and not path.endswith(".weights.h5")
        if legacy or kwargs:
            from keras.src.saving import saving_api

            saving_api.load_weights(self, filepath, skip_mismatch=skip_mismatch, **kwargs)
            return
        export.load_weights(self, path, skip_mismatch=skip_mismatch)

    def export(self, filepath: Any, format: str = "tf_saved_model", verbose: Any = None,
               input_signature: Any = None, **kwargs: Any) -> None:
        """Keras's `export` of the whole unpartitioned model (every rank calls; world rank 0
        exports a single-process copy with the gathered weights)."""
        from tfsmp.checkpoint import export

        export.export_model(self, str(os.fspath(filepath)), format, verbose, input_signature,
                            **kwargs)

    def save_model(self, save_path: str = "/opt/ml/model") -> None:
        """SMP's `save_model`: the whole unpartitioned model as a TensorFlow SavedModel."""
        from tfsmp.checkpoint import export

        export.save_model(self, save_path)

    # -- Keras's serialization: the wrapped model's, and pickling -------------------------------

    def get_config(self) -> dict[str, Any]:
        """The wrapped model's serialization (a subclass: Keras's own config)."""
        if self._wrapped is None:
            return dict(super().get_config())
        from keras.src.saving import serialization_lib

        return {"name": self.name,
                "model": serialization_lib.serialize_keras_object(self._wrapped)}

    @classmethod
    def from_config(cls, config: dict[str, Any], custom_objects: Any = None) -> Any:
        """A `DistributedModel` of the model in ``config`` (as `get_config` wrote it): how
        ``keras.models.clone_model`` and Keras's deserialization rebuild one."""
        if "model" not in config:
            return super().from_config(config, custom_objects=custom_objects)
        from keras.src.saving import serialization_lib

        model = serialization_lib.deserialize_keras_object(
            config["model"], custom_objects=custom_objects)
        return cls(model, name=config.get("name"))

    def __reduce__(self) -> Any:
        """Pickles as the whole unpartitioned model's ``.keras`` archive, as Keras pickles a
        model (a collective call once partitioned; tfsmp/checkpoint/keras_saving.py)."""
        from tfsmp.checkpoint import keras_saving

        return keras_saving.reduce(self)

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


def _install_saving() -> None:
    """Keras's saving functions dispatch a `DistributedModel` to tfsmp's collective export
    ([Note: Keras's saving functions] in tfsmp/checkpoint/keras_saving.py)."""
    from tfsmp.checkpoint import keras_saving

    keras_saving.install()


def _dry_zeros(rows: Any, dims: tuple[int | None, ...], dtype: str) -> tf.Tensor:
    """Zeros shaped like a step's model output: exact where ``dims`` are known (always when
    eager), and of statically unknown size where a traced input's shape leaves them unknown."""
    known = tf.constant([1 if d is None else int(d) for d in dims], tf.int32)
    zeros = tf.zeros(tf.concat([[rows], known], 0), dtype=dtype)
    if any(d is None for d in dims):
        zeros = tf.compat.v1.placeholder_with_default(zeros, shape=[None, *dims])
    return zeros
