"""`@smp.step` and `StepOutput`: SMP's TensorFlow script API on the pipeline runtime.

Example::

    @smp.step
    def train_step(images, labels):
        with tf.GradientTape() as tape:
            logits = model(images, training=True)
            loss = loss_fn(labels, logits)
        return tape.gradient(loss, model.trainable_variables), loss, logits

    grads, loss, logits = train_step(x, y)          # StepOutputs, one value per microbatch
    opt.apply_gradients(zip([g.accumulate() for g in grads], model.trainable_variables))

[Note: how a step runs] Arguments are split into ``microbatches`` along their batch axes. For
each microbatch the *last stage* runs the body: inside it, ``model(x)`` returns that stage's
outputs computed from the tensors received from earlier stages, every user GradientTape watches
those tensors, and ``tape.gradient`` also differentiates with respect to them; those gradients go
back through the pipeline. Other ranks run the body only up to the model call (to learn its
inputs: preprocessing inside a step must therefore be deterministic), then their stage programs,
keeping every microbatch's weight gradients. The last stage broadcasts what the body returned;
each rank then puts its own weight gradients where the body returned ``tape.gradient(...,
model.trainable_variables)``, since ``model.trainable_variables`` are the rank's own stages'.

Called inside an outer ``tf.function`` (as SMP's examples do), the step becomes one
``tf.py_function`` running the pipeline eagerly; a symbolic dry run of the body gives its
output structure and dtypes. The dry run is traced into a function graph of its own that never
executes, so what the body does after the model call (metric updates, counters) has no effect
there: it runs only on the last stage, with real values. Metric variables it changes are then
copied to every rank of the pipeline ([Note: metrics in a step] in `tfsmp.keras.step_metrics`).

Gradients: ``tape.gradient`` of a tape opened in the body, or SMP's documented
``optimizer.get_gradients(loss, model.trainable_variables)`` ([Note: porting names] in
`tfsmp.keras.porting`), which differentiates a tape tfsmp keeps around the body. With several
data-parallel replicas and ``horovod: False``, each microbatch's weight gradients are averaged
over the pipeline rank's replicas before the step returns (the reduction `fit` does); with ``horovod:
True`` the script reduces them itself (``hvd.allreduce(g.accumulate())``), as SMP required.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import threading
from collections.abc import Callable, Iterator
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tfsmp.errors import StepError
from tfsmp.keras import porting
from tfsmp.keras.data import check_step_inputs
from tfsmp.keras.step_metrics import MetricSync, code_names
from tfsmp.runtime.executor import StepResult
from tfsmp.runtime.hooks import LastStage, StepRuntime

__all__ = ["StepOutput", "active_context", "step", "step_gradients"]

_local = threading.local()
_TAPE_GRADIENT = tf.GradientTape.gradient  # the original, while a step patches the class
porting.install()


class StepOutput:
    """One value per microbatch of something a step returned, with SMP's reductions.

    Example::

        loss.reduce_mean()      # mean over microbatches
        logits.merge()          # concatenated along the batch axis
    """

    def __init__(self, outputs: list[Any]) -> None:
        self.outputs = list(outputs)

    def __repr__(self) -> str:
        return f"StepOutput({len(self.outputs)} microbatches)"

    def reduce_mean(self) -> Any:
        return tf.add_n([tf.convert_to_tensor(o) for o in self.outputs]) / len(self.outputs)

    def reduce_sum(self) -> Any:
        return tf.add_n([tf.convert_to_tensor(o) for o in self.outputs])

    def concat(self, axis: int = 0) -> Any:
        return tf.concat([tf.convert_to_tensor(o) for o in self.outputs], axis=axis)

    def stack(self, axis: int = 0) -> Any:
        return tf.stack([tf.convert_to_tensor(o) for o in self.outputs], axis=axis)

    def merge(self, axis: int = 0) -> Any:
        """Concatenates along the batch axis (SMP: for predictions)."""
        return self.concat(axis)

    def accumulate(self, method: str = "variable", var: Any = None) -> Any:
        """The mean over microbatches, like `reduce_mean`. ``method`` is SMP's ("variable",
        "add_n", "accumulate_n"); all give the same value here. With ``var`` (and method
        "variable") the result is also assigned to ``var``, which is returned."""
        if method not in ("variable", "add_n", "accumulate_n"):
            raise StepError(
                f"accumulate's method must be one of 'variable', 'add_n', 'accumulate_n'. "
                f"Received: method={method!r}")
        mean = self.reduce_mean()
        if var is not None and method == "variable":
            var.assign(mean)
            return var
        return mean


# -- the context a step body runs in -------------------------------------------------------------


class CapturedCall(Exception):
    """Raised by the model call in capture mode: the body need not run further."""

    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        super().__init__("captured")
        self.args, self.kwargs = args, kwargs


class _Context:
    """What a running step body sees: how `model(...)` and `tape.gradient` behave."""

    def __init__(self, model: Any, mode: str) -> None:
        self.model = model
        self.mode = mode  # "capture" | "run" | "dry"
        self.calls = 0
        self.tapes: list[tf.GradientTape] = []
        self.watch: list[tf.Tensor] = []
        self.watch_grads: list[Any] | None = None
        self.grad_lists: list[Any] = []
        self.stage_outputs: Any = None
        self.run_call: Callable[..., Any] | None = None
        self.own_tape: tf.GradientTape | None = None  # get_gradients differentiates this one
        self.metrics: MetricSync | None = None  # "run": records variable assignments


def active_context() -> _Context | None:
    return getattr(_local, "context", None)


@contextlib.contextmanager
def _activate(ctx: _Context, own_tape: bool = False) -> Iterator[_Context]:
    """Runs the body's ``model(...)``, tapes and variable assignments through ``ctx``; with
    ``own_tape``, inside a persistent tape for ``optimizer.get_gradients``."""
    import keras

    previous = active_context()
    _local.context = ctx
    enter, gradient = tf.GradientTape.__enter__, tf.GradientTape.gradient
    variable_cls = next(c for c in keras.Variable.__mro__ if "assign" in vars(c))
    assign = variable_cls.assign

    def patched_enter(tape: tf.GradientTape) -> tf.GradientTape:
        result = enter(tape)
        ctx.tapes.append(tape)
        if ctx.watch:
            tape.watch(ctx.watch)
        return result

    def patched_gradient(tape: tf.GradientTape, target: Any, sources: Any,
                         output_gradients: Any = None, unconnected_gradients: Any = None) -> Any:
        return _gradient(ctx, gradient, tape, target, sources, output_gradients,
                         unconnected_gradients)

    def patched_assign(variable: Any, value: Any) -> Any:
        if ctx.metrics is not None:
            ctx.metrics.record(variable)
        return assign(variable, value)

    tf.GradientTape.__enter__ = patched_enter
    tf.GradientTape.gradient = patched_gradient
    if ctx.metrics is not None:
        variable_cls.assign = patched_assign
    try:
        with _own_tape(ctx) if own_tape else contextlib.nullcontext():
            yield ctx
    finally:
        tf.GradientTape.__enter__ = enter
        tf.GradientTape.gradient = gradient
        variable_cls.assign = assign
        _local.context = previous


@contextlib.contextmanager
def _own_tape(ctx: _Context) -> Iterator[None]:
    tape = tf.GradientTape(persistent=True)
    with tape:  # the patched __enter__ also watches the received tensors
        ctx.own_tape = tape
        try:
            yield
        finally:
            ctx.own_tape = None


def step_gradients(loss: Any, params: Any) -> Any:
    """``optimizer.get_gradients(loss, params)`` inside a step: the gradient from the tape tfsmp
    keeps around the body (see [Note: porting names] in `tfsmp.keras.porting`).

    Raises:
        StepError: outside a step, or when the body does not name ``get_gradients`` itself.
    """
    ctx = active_context()
    if ctx is None or ctx.mode == "capture":
        raise porting.outside_step_error()
    if ctx.own_tape is None:
        raise StepError(
            "optimizer.get_gradients must be called in the smp.step function itself, so that "
            "tfsmp records the forward pass for it. Received: a call from a helper the step "
            "calls. Fix: call optimizer.get_gradients in the step function, or use "
            "`with tf.GradientTape() as tape:` around the model call and tape.gradient.")
    with ctx.own_tape.stop_recording():
        return _gradient(ctx, _TAPE_GRADIENT, ctx.own_tape, loss, params, None, None)


def _names_get_gradients(fn: Callable[..., Any]) -> bool:
    code = getattr(inspect.unwrap(fn), "__code__", None)
    return code is not None and "get_gradients" in set(code_names(code))


def _gradient(ctx: _Context, gradient: Any, tape: tf.GradientTape, target: Any, sources: Any,
              output_gradients: Any, unconnected: Any) -> Any:
    """``tape.gradient`` inside a step: in "run" mode also w.r.t. the received tensors; in "dry"
    mode zeros shaped like the sources (only the structure matters)."""
    flat = tf.nest.flatten(sources)
    if ctx.mode == "dry":
        result = tf.nest.pack_sequence_as(sources, [tf.zeros_like(_value(s)) for s in flat])
    else:
        kwargs = {} if unconnected is None else {"unconnected_gradients": unconnected}
        grads = gradient(tape, target, flat + list(ctx.watch), output_gradients=output_gradients,
                         **kwargs)
        if ctx.watch:
            ctx.watch_grads = list(grads[len(flat):])
        result = tf.nest.pack_sequence_as(sources, list(grads[:len(flat)]))
    ctx.grad_lists.append(result)
    return result


def _value(v: Any) -> Any:
    return v.value if hasattr(v, "value") and not isinstance(v, tf.Tensor) else v


# -- splitting arguments --------------------------------------------------------------------------


def _split_arg(value: Any, m: int, axis: int, name: str) -> list[Any]:
    if hasattr(value, "smp_slice"):
        return [value.smp_slice(m, i, axis) for i in range(m)]
    parts = [_split_leaf(leaf, m, axis, name) for leaf in keras.tree.flatten(value)]
    return [keras.tree.pack_sequence_as(value, [p[i] for p in parts]) for i in range(m)]


def _split_leaf(value: Any, m: int, axis: int, name: str) -> list[Any]:
    if hasattr(value, "smp_slice"):
        return [value.smp_slice(m, i, axis) for i in range(m)]
    if isinstance(value, (tf.Tensor, np.ndarray, tf.Variable)) and len(np.shape(value)) > axis:
        n = int(value.shape[axis])
        if n % m:
            raise StepError(
                f"batch size must be divisible by microbatches. Received: argument '{name}' "
                f"with batch_size={n} (axis {axis}), microbatches={m}. Use a batch size that is "
                f"a multiple of {m}, or list '{name}' in non_split_inputs.")
        size = n // m
        return [tf.gather(value, tf.range(i * size, (i + 1) * size), axis=axis) for i in range(m)]
    return [value] * m


def _split_arguments(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], m: int,
                     non_split: set[str], axes: dict[str, int]) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    bound = inspect.signature(fn).bind(*args, **kwargs)
    per: dict[str, list[Any]] = {}
    for name, value in bound.arguments.items():
        per[name] = [value] * m if name in non_split else _split_arg(value, m, axes.get(name, 0), name)
    out = []
    params = inspect.signature(fn).parameters
    for i in range(m):
        a, k = [], {}
        for name, values in per.items():
            kind = params[name].kind
            if kind == inspect.Parameter.VAR_POSITIONAL:
                a.extend(values[i])
            elif kind == inspect.Parameter.VAR_KEYWORD:
                k.update(values[i])
            elif kind == inspect.Parameter.KEYWORD_ONLY:
                k[name] = values[i]
            else:
                a.append(values[i])
        out.append((tuple(a), k))
    return out


# -- the decorator ------------------------------------------------------------------------------


class _Step:
    """A function run once per microbatch across the pipeline. See the module docstring."""

    def __init__(self, fn: Callable[..., Any], non_split_inputs: list[str] | None,
                 input_split_axes: dict[str, int] | None, tf_kwargs: dict[str, Any]) -> None:
        if tf_kwargs.get("jit_compile") or tf_kwargs.get("experimental_compile"):
            raise StepError(
                "smp.step cannot be XLA-compiled as one function: it exchanges messages between "
                "ranks. Received: jit_compile=True. Set the `xla` parameter instead: tfsmp "
                "compiles every stage program with XLA.")
        unknown = set(tf_kwargs) - {"input_signature", "autograph", "reduce_retracing",
                                    "experimental_relax_shapes", "name", "jit_compile",
                                    "experimental_compile"}
        if unknown:
            raise StepError(f"smp.step got unknown arguments. Received: {sorted(unknown)}")
        self.fn = fn
        self.non_split = set(non_split_inputs or [])
        self.axes = dict(input_split_axes or {})
        self.input_signature = tf_kwargs.get("input_signature")
        self._trains: bool | None = None  # does the body return gradients? (first call decides)
        self._model_ids: set[int] | None = None
        params = inspect.signature(fn).parameters
        for name in self.non_split | set(self.axes):
            if name not in params:
                raise StepError(
                    f"non_split_inputs and input_split_axes name the step's arguments. Received: "
                    f"'{name}', but {fn.__name__} takes {list(params)}.")
        functools.update_wrapper(self, fn)

    @tf.autograph.experimental.do_not_convert  # type: ignore[untyped-decorator]
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # AutoGraph must not rewrite tfsmp's own Python (MPI calls, the pipeline executor).
        if tf.inside_function():
            return self._graph_call(args, kwargs)
        return self._eager_call(args, kwargs)

    # -- eager --------------------------------------------------------------------------------

    def _eager_call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        import tfsmp.core as core

        if not core.is_initialized():
            core.init()
        m = core.state().config.microbatches
        check_step_inputs(args, kwargs)  # every pipeline rank got the same batch (tfsmp/keras/data.py)
        parts = _split_arguments(self.fn, args, kwargs, m, self.non_split, self.axes)
        captured = [self._capture(a, k) for a, k in parts]
        model = captured[0][1]
        inputs = [c for c, _ in captured]
        engine: StepRuntime = model.engine_for(_model_input(*inputs[0]))
        traced = engine.view.traced
        if self._trains is None:  # same data on every rank, so every rank decides alike
            self._trains = self._dry_run(parts[0][0], parts[0][1], model).trains
        results: dict[int, tuple[Any, list[Any] | None]] = {}
        own_tape = _names_get_gradients(self.fn)
        if self._model_ids is None:  # the rank's weights are fixed once the model is partitioned
            self._model_ids = {id(v) for v in model.variables}
        metrics = MetricSync(self.fn, self._model_ids)

        def head(last: LastStage) -> Any:  # [Note: the head] in tfsmp/runtime/hooks.py
            i = last.microbatch
            ctx = _Context(model, "run")
            ctx.watch = last.differentiable
            ctx.metrics = metrics

            def run_call(*_: Any, training: Any = None, **__: Any) -> Any:
                return traced.pack_outputs(last.forward(training=bool(training)).outputs)

            ctx.run_call = run_call
            with _activate(ctx, own_tape=own_tape):
                out = self.fn(*parts[i][0], **parts[i][1])
            _check_used(ctx, self.fn)
            if self._trains:
                last.finish(ctx.watch_grads or [])
            results[i] = (out, _grad_list(ctx, out))
            return out

        step = engine.run_step([traced.pack_inputs(_model_input(*c)) for c in inputs], head,
                               train=bool(self._trains))
        return self._assemble(engine, step, results, m, metrics)

    def _dry_run(self, args: tuple[Any, ...], kwargs: dict[str, Any], model: Any) -> _DryRun:
        """Traces the body once with a shapes-only model call, into a function graph that is
        never executed: its structure, dtypes and shapes, without its side effects."""
        found: list[_DryRun] = []
        own_tape = _names_get_gradients(self.fn)

        def body() -> None:
            dry = _Context(model, "dry")
            with _activate(dry, own_tape=own_tape):
                out = self.fn(*args, **kwargs)
            _check_used(dry, self.fn)
            grads = dry.grad_lists[-1] if dry.grad_lists else None
            flat = [tf.convert_to_tensor(t) for t in _flat_without(out, grads)]
            found.append(_DryRun(dry.model, _grad_list(dry, out) is not None,
                                 _template(out, grads), [(t.dtype, t.shape) for t in flat],
                                 grads is not None))

        tf.function(body, autograph=False).get_concrete_function()
        return found[-1]

    def _capture(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        """Runs the body up to its model call: ((call args, call kwargs), the model)."""
        ctx = _Context(None, "capture")
        with _activate(ctx):
            try:
                self.fn(*args, **kwargs)
            except CapturedCall as c:
                return (c.args, c.kwargs), ctx.model
        raise StepError(
            f"A step must call the DistributedModel and return something that depends on its "
            f"output. Received: {self.fn.__name__} never called the model.")

    def _assemble(self, engine: StepRuntime, step: StepResult,
                  results: dict[int, tuple[Any, Any]], m: int, metrics: MetricSync) -> Any:
        """Every rank: the last stage's returned structure and metric state, with this rank's
        gradients from the runtime (`StepRuntime.step_gradients`: already averaged over the
        data-parallel replicas unless Horovod does it)."""
        view = engine.view
        template = None
        if view.is_last_rank:
            first, grads = results[0]
            template = _template(first, grads)
            flats = [[_to_numpy(v) for v in _flat_without(results[i][0], results[i][1])]
                     for i in range(m)]
            payload: Any = (template, flats, metrics.payload())
        else:
            payload = None
        template, flats, state = view.groups.pipeline.bcast_obj(payload, root=view.last_rank)
        metrics.apply(state, view.is_last_rank)
        own = engine.step_gradients(step, _body_gradients(results, m)) if _has_grads(
            template) else [[]] * m
        per_mb = [_fill(template, [tf.convert_to_tensor(v) for v in flats[i]], own[i])
                  for i in range(m)]
        return _to_step_outputs(per_mb, m)

    # -- inside an outer tf.function ------------------------------------------------------------

    def _graph_call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        import tfsmp.core as core

        with tf.init_scope():
            if not core.is_initialized():
                core.init()
        if tf.config.threading.get_inter_op_parallelism_threads() == 1:
            raise StepError(
                "An smp.step called inside a tf.function needs at least 2 TensorFlow inter-op "
                "threads (it runs the pipeline in a tf.py_function). Received: "
                "inter_op_parallelism_threads=1. Call smp.init() before TensorFlow runs any op, "
                "or set TF_NUM_INTEROP_THREADS=2, or call the step outside the tf.function.")
        m = core.state().config.microbatches
        flat_args = tf.nest.flatten((args, kwargs))
        tensor_pos = [i for i, a in enumerate(flat_args) if isinstance(a, (tf.Tensor, tf.Variable))]
        dry = self._dry_run(args, kwargs, None)
        if self._trains is None:  # the eager call inside need not trace the body again
            self._trains = dry.trains
        model, template, specs = dry.model, dry.template, dry.specs
        n_grads = len(model.trainable_variables) if dry.has_grads else 0
        tout = [dtype for dtype, _ in specs] * m + [v.dtype for v in model.trainable_variables] * (
            m if dry.has_grads else 0)

        def eager(*tensors: Any) -> list[Any]:
            values = list(flat_args)
            for pos, t in zip(tensor_pos, tensors):
                values[pos] = t
            a, k = tf.nest.pack_sequence_as((args, kwargs), values)
            result = self._eager_call(a, k)
            leaves = [so.outputs for so in _flat_without(result, _grads_in(result, template))]
            flat = [leaves[j][i] for i in range(m) for j in range(len(leaves))]
            if n_grads:
                own = _grads_in(result, template)
                flat += [own[j].outputs[i] for i in range(m) for j in range(n_grads)]
            return flat

        values = tf.py_function(eager, [flat_args[i] for i in tensor_pos], tout)
        n_out = len(specs)
        for i, v in enumerate(values[:n_out * m]):
            v.set_shape(_mb_shape(specs[i % n_out][1], m))
        per_mb_out = [values[i * n_out:(i + 1) * n_out] for i in range(m)]
        rest = values[n_out * m:]
        per_mb_grads = [[rest[i * n_grads + j] for j in range(n_grads)] for i in range(m)]
        for i in range(m):
            for g, v in zip(per_mb_grads[i], model.trainable_variables):
                g.set_shape(v.shape)
        return _to_step_outputs([_fill(template, per_mb_out[i], per_mb_grads[i]) for i in range(m)], m)


@dataclasses.dataclass
class _DryRun:
    """What a dry run of a step body found."""

    model: Any  # the DistributedModel the body calls
    trains: bool  # the body returns its tape.gradient / get_gradients list
    template: Any  # the returned structure (`_template`)
    specs: list[tuple[Any, Any]]  # (dtype, shape) of each returned tensor but the gradients
    has_grads: bool  # the body computed a gradient list


def step(fn: Callable[..., Any] | None = None, *, non_split_inputs: list[str] | None = None,
         input_split_axes: dict[str, int] | None = None, **tf_function_kwargs: Any) -> Any:
    """Decorates a function that runs once per microbatch, pipelined (SMP's ``smp.step``).

    Args:
        fn: the step body (forward and backward of one microbatch).
        non_split_inputs: names of arguments passed whole to every microbatch.
        input_split_axes: ``{argument name: axis}`` to split along (default 0).
        **tf_function_kwargs: as for ``tf.function`` (``input_signature`` …).
    """
    if fn is None:
        return lambda f: _Step(f, non_split_inputs, input_split_axes, tf_function_kwargs)
    return _Step(fn, non_split_inputs, input_split_axes, tf_function_kwargs)


# -- helpers ------------------------------------------------------------------------------------


def _model_input(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return args[0] if args else next(iter(kwargs.values()))


def _check_used(ctx: _Context, fn: Callable[..., Any]) -> None:
    if ctx.calls == 0:
        raise StepError(
            f"A step must call the DistributedModel and return something that depends on its "
            f"output. Received: {fn.__name__} never called the model.")


def _grad_list(ctx: _Context, out: Any) -> Any:
    """The object the body returned from ``tape.gradient(..., model.trainable_variables)``."""
    flat = [x for x in _walk(out)]
    for g in reversed(ctx.grad_lists):
        if any(x is g for x in flat):
            return g
    return None


def _walk(structure: Any) -> list[Any]:
    """Every node of ``structure``, containers included, parents first."""
    nodes: list[Any] = []
    keras.tree.traverse(nodes.append, structure)  # append returns None: go on into children
    return nodes


_GRADS = "__tfsmp_grads__"


def _is_grads_mark(leaf: Any) -> bool:
    return isinstance(leaf, str) and leaf == _GRADS


def _marked(out: Any, grads: Any) -> Any:
    """``out`` with the gradient list itself (by identity) replaced by the `_GRADS` mark."""
    if grads is None:
        return out
    return keras.tree.traverse(lambda node: _GRADS if node is grads else None, out)


def _template(out: Any, grads: Any) -> Any:
    """The returned structure with tensors as None and the gradient list as a marker."""
    def leaf(value: Any) -> Any:
        if _is_grads_mark(value):
            return _GRADS
        if value is None:
            raise StepError("A step must return tensors. Received: None inside the returned value.")
        return None

    return keras.tree.map_structure(leaf, _marked(out, grads))


def _flat_without(out: Any, grads: Any) -> list[Any]:
    """The leaves of ``out`` but those of the gradient list, in `keras.tree` order."""
    return [x for x in keras.tree.flatten(_marked(out, grads)) if not _is_grads_mark(x)]


def _fill(template: Any, leaves: list[Any], grads: list[Any]) -> Any:
    it = iter(leaves)
    return keras.tree.map_structure(
        lambda t: list(grads) if _is_grads_mark(t) else next(it), template)


def _grads_path(template: Any) -> tuple[Any, ...] | None:
    for path, leaf in keras.tree.flatten_with_path(template):
        if _is_grads_mark(leaf):
            return tuple(path)
    return None


def _has_grads(template: Any) -> bool:
    return _grads_path(template) is not None


def _grads_in(result: Any, template: Any) -> Any:
    """What ``result`` (filled from ``template``) holds where the template marks the gradients."""
    path = _grads_path(template)
    if path is None:
        return None
    for key in path:
        result = result[key]
    return result


def _to_step_outputs(per_mb: list[Any], m: int) -> Any:
    return keras.tree.map_structure(lambda *parts: StepOutput(list(parts)), *per_mb)


def _to_numpy(v: Any) -> Any:
    return np.asarray(v) if isinstance(v, (tf.Tensor, tf.Variable)) else v


def _mb_shape(shape: Any, m: int) -> Any:
    dims = shape.as_list() if hasattr(shape, "as_list") else list(shape)
    if dims and dims[0] is not None:
        dims[0] = dims[0] // m if dims[0] % m == 0 else None
    return tf.TensorShape(dims)


def _body_gradients(results: dict[int, tuple[Any, Any]], m: int) -> dict[int, list[Any]]:
    """Per microbatch, the flat gradient list the body returned (on the last stage's rank;
    empty elsewhere, where the runtime has them all).

    Raises:
        StepError: on the last stage's rank, when a training step returned no gradient list.
    """
    out: dict[int, list[Any]] = {}
    for i in range(m):
        if i not in results:
            out[i] = []
            continue
        body_grads = results[i][1]
        if body_grads is None:
            raise StepError(
                "A training step must return tape.gradient(loss, model.trainable_variables). "
                "Received: no gradient list in what the step returned.")
        out[i] = tf.nest.flatten(body_grads)
    return out
