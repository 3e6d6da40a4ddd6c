"""Calls of the stage programs without `tf.function`'s per-call dispatch.

Example::

    fwd = Program(tf.function(forward_fn))
    fwd(inputs, recv, True, consts)        # first time for these shapes: tf.function's own call
    fwd(inputs, recv, True, consts)        # then: its concrete function, called flat

[Note: program dispatch] A `tf.function` call binds its arguments to the function's signature,
builds a trace type of every argument and looks the concrete function up by it before it runs
anything: measured on this project's 2-core host (2026-12-07, one thread, a function of four
lists of tensors and a Python int, the shape of a stage program's call) 880 us per call against
460 us for its concrete function's ``__call__`` and 240 us for the concrete function's flat
call, which runs the same graph. A pipeline stage calls its programs once or twice per
microbatch (a zero-bubble stage three times), so on the peer benchmark's zb-v step that was 48
calls per rank and step. So a `Program` keeps, per call signature, the concrete function that
`tf.function` chose for it, and afterwards calls it flat. The stage programs
(`tfsmp.runtime.kernels.program`, with or without the OpenBLAS kernel), the taped backward's
accumulation, the optimizer's compiled update (optimizer_options.py) and the compiled metrics'
update (tfsmp/keras/trainer_metrics.py) are `Program`s:

* The signature is the argument structure (lists, tuples, dicts with string keys), each
  tensor's shape and dtype, and the value of every Python scalar or None (which the trace
  bakes in), made in one walk that also collects the tensors in `tf.nest` order (dicts by
  sorted key), the order of the concrete function's inputs.
* Only eager calls with positional arguments of those kinds take the fast path. Anything else
  (keyword arguments, variables, NumPy arrays, a call while a graph is being built, a
  signature not yet traced, and every call while `tf.config.run_functions_eagerly(True)` has
  functions run as Python) goes through `tf.function` itself, which traces where it must;
  a new signature is looked up once with ``get_concrete_function`` and checked against the
  concrete function's inputs (count, dtypes, shapes), and one that does not match is never
  called flat.
* The flat call is `ConcreteFunction._call_flat`, what `tf.function` itself ends in: it
  records on active gradient tapes, marks the function's variables as accessed, and takes
  the captured inputs as they are at the call.
* At most `_CACHE` signatures are kept (inputs whose shapes vary, [Note: relaxed shapes] in
  stage.py, map many signatures to one relaxed trace); past that the table starts over.

``call_options``, where given, are `context.function_call_options` for the calls (the
OpenBLAS kernel's, [Note: OpenBLAS products] in tfsmp/runtime/kernels), set around each call
and restored after it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Program"]

_CACHE = 64  # call signatures a program keeps ([Note: program dispatch])


class _Slow(Exception):
    """An argument the fast path does not take."""


def _walk(x: Any, tensors: list[Any], eager: type) -> Any:
    """The signature of ``x``; appends its tensors to ``tensors`` in `tf.nest` order."""
    t = type(x)
    if t is eager:
        tensors.append(x)
        return (x._shape_tuple(), x.dtype)  # noqa: SLF001 (x.shape builds a TensorShape)
    if t is list or t is tuple:
        return (t, tuple(_walk(v, tensors, eager) for v in x))
    if t is dict:
        keys = sorted(x)
        if any(type(k) is not str for k in keys):
            raise _Slow
        return (dict, tuple((k, _walk(x[k], tensors, eager)) for k in keys))
    if x is None or t is bool or t is int or t is float or t is str:
        return (t, x)
    raise _Slow


class Program:
    """A `tf.function` whose calls skip its dispatch once a signature is traced ([Note:
    program dispatch]); anything else (``get_concrete_function``, ...) is the function's own."""

    def __init__(self, fn: Any, call_options: Any = None) -> None:
        from tensorflow.python.eager import context
        from tensorflow.python.eager.polymorphic_function import eager_function_run
        from tensorflow.python.framework import ops

        self._fn = fn
        self._options = call_options
        self._context = context.context()
        self._eager = ops.EagerTensor
        self._run = eager_function_run  # RUN_FUNCTIONS_EAGERLY: tf.config.run_functions_eagerly
        self._flat: dict[Any, Any] = {}  # signature -> concrete function, or None: never flat
        self.flat = True  # False: every call is tf.function's own (benchmarks/dispatch.py)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        options = self._options
        if options is None:
            return self._call(args, kwargs)
        ctx = self._context
        saved = ctx.function_call_options
        ctx.function_call_options = options
        try:
            return self._call(args, kwargs)
        finally:
            ctx.function_call_options = saved

    def _call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if (kwargs or not self.flat or self._run.RUN_FUNCTIONS_EAGERLY
                or not self._context.executing_eagerly()):
            return self._fn(*args, **kwargs)
        tensors: list[Any] = []
        try:
            key = _walk(args, tensors, self._eager)
        except _Slow:
            return self._fn(*args)
        cf = self._flat.get(key, False)
        if cf is False:
            out = self._fn(*args)  # traces if it must
            self._learn(key, args, tensors)
            return out
        if cf is None:
            return self._fn(*args)
        return cf._call_flat(tensors, cf.captured_inputs)  # noqa: SLF001 (the note)

    def _learn(self, key: Any, args: tuple[Any, ...], tensors: list[Any]) -> None:
        """Keeps the concrete function `tf.function` chose for ``key``, if its inputs are
        ``tensors`` (else None: this signature always takes `tf.function`'s own call)."""
        if len(self._flat) >= _CACHE:
            self._flat.clear()
        cf = self._fn.get_concrete_function(*args)
        inputs = cf.inputs[:len(cf.inputs) - len(cf.captured_inputs)]
        fits = len(inputs) == len(tensors) and all(
            p.dtype == t.dtype and p.shape.is_compatible_with(t.shape)
            for p, t in zip(inputs, tensors))
        self._flat[key] = cf if fits else None

    def __getattr__(self, name: str) -> Any:
        if name == "_fn":  # not yet set (a copy being made): no recursion through _fn
            raise AttributeError(name)
        return getattr(self._fn, name)
