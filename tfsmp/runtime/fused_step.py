"""One compiled training step for a pipeline of one stage and one microbatch.

Example::

    step = OneCallStep(program, variables, indices, optimizer, objective, rank_tag="[rank 0]")
    result = step.run(microbatch, step_number=1, nonfinite="raise")

[Note: one-call step] With one pipeline rank, one stage, one microbatch and one data-parallel
replica there is nothing to schedule: no message, no accumulation over microbatches, no
reduction. Going through the executor would still cost three compiled calls per step (the fused
last stage writing the accumulators, their finiteness check, the optimizer reading them back),
each a full pass over every gradient: about 5-8% of a Dense(1024)x8 step at batch 256
(`benchmarks/bench_overhead.py`). Keras's own train function is one call: forward, loss,
gradients and ``optimizer.apply``. This step is that call plus the finiteness check of
[Note: consistent skips] (engine.py), folded into the same graph: the update runs under
``tf.cond`` on the flag, so a non-finite step changes no variable, as the executor path's skip
does. The gradients are exactly the fused last stage's (the same loss terms, one part, zeros for
unconnected variables), so the result equals the executor path bit for bit.

[Note: one-call direct update] A world of one is the one-microbatch, one-replica case of [Note:
direct update] (tfsmp/runtime/memory.py), and the `RunPlan` says so: where the pipeline would
update each variable inside its backward (``nonfinite='raise'``, an optimizer that updates
variable by variable, no loss scaling), the one-call step does too. Each variable's update then
waits only for its own gradient and its own finiteness, so TensorFlow runs Adam's kernels of the
last layers while the backward of the first ones still runs, as in plain Keras's train step; the
single ``tf.cond`` on every gradient's flag held all of them until the last gradient existed
(benchmark 1 measured 1.04-1.05 against Keras with it). The whole update still sits under one
``tf.cond`` on the loss's finiteness, known before the backward starts, so a non-finite loss
(the usual bad step) changes no variable and no iteration count; gradients that overflow under a
finite loss leave the variables with finite gradients updated, and the error says so, as the
pipeline's direct update does. ``nonfinite='skip'`` and "apply" keep the all-or-nothing
``tf.cond``.

[Note: cheap finiteness] A sum is non-finite whenever one of its terms is (NaN propagates; an
infinity gives an infinity or NaN), so a finite sum of every gradient proves them all finite in
one streaming read without a boolean temporary. Only a non-finite sum, which large finite values
could also cause by overflowing, pays for the exact element-wise test.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf
from keras.src.backend import get_keras_mask, set_keras_mask

from tfsmp.errors import StepError
from tfsmp.runtime import kernels
from tfsmp.runtime.executor import MicroBatch, StepResult
from tfsmp.runtime.fused_updates import fused_updates
from tfsmp.runtime.memory import DirectUpdate
from tfsmp.runtime.report import DIRECT_NOTE
from tfsmp.runtime.stage import all_finite

__all__ = ["OneCallStep", "all_finite"]


class OneCallStep:
    """A whole training step in one `tf.function` call. See [Note: one-call step]."""

    def __init__(
        self,
        program: Any,
        variables: list[Any],
        indices: list[int],
        optimizer: Any,
        objective: Any,
        *,
        rank_tag: str,
        relax_shapes: bool = False,
        direct: bool = False,
    ) -> None:
        """``variables[j]`` is ``program.trainable[indices[j]]`` (the optimizer's order);
        ``direct``: update variable by variable where ``nonfinite='raise'`` ([Note: one-call
        direct update])."""
        self.program = program
        self.variables = variables
        self.indices = indices
        self.optimizer = optimizer
        self.objective = objective
        self.rank_tag = rank_tag
        self.direct = direct
        self._fn = kernels.program(self._step_fn, reduce_retracing=relax_shapes)
        self._fn_direct = kernels.program(self._direct_step_fn, reduce_retracing=relax_shapes)

    def _forward(self, inputs: list[tf.Tensor]) -> list[tf.Tensor]:
        prog = self.program
        env: dict[str, Any] = dict(zip(prog.input_keys, inputs))
        for call in prog.calls:
            call.run(env, training=True)
        return [env[k] for k in prog.output_keys]

    def _gradients(self, inputs: list[tf.Tensor], y: Any, sample_weight: Any, consts: tf.Tensor
                   ) -> tuple[Any, list[tf.Tensor], list[Any], tf.Tensor]:
        """(loss terms, outputs, gradients in the optimizer's order, the loss's flag)."""
        trainable = self.program.trainable
        with tf.GradientTape() as tape:
            outputs = self._forward(inputs)
            terms = self.objective.call(y, self.program.traced.pack_outputs(outputs), sample_weight)
            loss = self.objective.backprop(terms, consts)  # one part: exactly Keras's loss
        grads = tape.gradient(loss, [v.value for v in trainable],
                              unconnected_gradients=tf.UnconnectedGradients.ZERO)
        return terms, outputs, [grads[i] for i in self.indices], tf.reduce_all(
            tf.math.is_finite(loss))

    @staticmethod
    def _results(terms: Any, outputs: list[tf.Tensor], loss_ok: tf.Tensor, grads_ok: tf.Tensor
                 ) -> tuple[tf.Tensor, tf.Tensor, list[tf.Tensor], list[Any], tf.Tensor, tf.Tensor]:
        numerators = tf.stack([tf.cast(n, tf.float32) for n in terms.numerators])
        normalizers = tf.stack([tf.cast(d, tf.float32) for d in terms.normalizers])
        masks = [get_keras_mask(t) for t in outputs]
        return numerators, normalizers, outputs, masks, loss_ok, grads_ok

    def _step_fn(self, inputs: list[tf.Tensor], y: Any, sample_weight: Any, consts: tf.Tensor,
                 always: tf.Tensor
                 ) -> tuple[tf.Tensor, tf.Tensor, list[tf.Tensor], list[Any], tf.Tensor, tf.Tensor]:
        terms, outputs, ordered, loss_ok = self._gradients(inputs, y, sample_weight, consts)
        grads_ok = all_finite(ordered)

        def apply() -> tf.Tensor:
            with fused_updates(self.optimizer):  # the step's tail: [Note: fused updates]
                self.optimizer.apply_gradients(zip(ordered, self.variables))
            return tf.constant(True)

        # ``always``: nonfinite="apply" (a fit with TerminateOnNaN) updates as plain Keras does
        tf.cond(tf.logical_or(always, tf.logical_and(loss_ok, grads_ok)), apply,
                lambda: tf.constant(False))
        return self._results(terms, outputs, loss_ok, grads_ok)

    def _direct_step_fn(self, inputs: list[tf.Tensor], y: Any, sample_weight: Any,
                        consts: tf.Tensor
                        ) -> tuple[tf.Tensor, tf.Tensor, list[tf.Tensor], list[Any], tf.Tensor,
                                   tf.Tensor]:
        """[Note: one-call direct update]: each variable's update under its own gradient's
        flag, all of them under the loss's."""
        terms, outputs, ordered, loss_ok = self._gradients(inputs, y, sample_weight, consts)

        def apply() -> tf.Tensor:
            with fused_updates(self.optimizer):  # [Note: fused updates], per variable
                return DirectUpdate(self.optimizer).apply(ordered, self.variables)

        grads_ok = tf.cond(loss_ok, apply, lambda: all_finite(ordered))
        return self._results(terms, outputs, loss_ok, grads_ok)

    def run(self, mb: MicroBatch, *, step_number: int, nonfinite: str,
            tracer: Any = None) -> tuple[StepResult, bool]:
        """Runs the step; returns its result and whether the update was applied.

        Raises:
            StepError: non-finite loss or gradients with ``nonfinite="raise"``, worded as the
                executor path's [Note: consistent skips] (no variable changed, but for
                [Note: one-call direct update]'s finite gradients under a finite loss).
        """
        inputs = [mb.inputs[k] for k in self.program.input_keys]
        direct = self.direct and nonfinite == "raise"
        args: tuple[Any, ...] = (inputs, mb.y, mb.sample_weight, mb.consts)
        fn = self._fn_direct if direct else self._fn
        if not direct:
            args += (tf.constant(nonfinite == "apply"),)
        if tracer is None:
            n, d, outputs, masks, loss_ok, grads_ok = fn(*args)
        else:  # one span: the compiled call holds forward, backward and the optimizer step
            with tracer.event(f"{self.program.stage}F0", "F"):
                n, d, outputs, masks, loss_ok, grads_ok = fn(*args)
            with tracer.event(f"{self.program.stage}STEP", "STEP"):
                pass
        outputs = list(outputs)
        for t, m in zip(outputs, masks):
            if m is not None:
                set_keras_mask(t, m)
        result = StepResult(outputs={0: outputs})
        summed = self.objective.partial([(n.numpy(), d.numpy(), mb.size)], mb.size)
        result.term_values = self.objective.values(summed)
        result.loss = self.objective.total(result.term_values)
        loss_ok, grads_ok = bool(loss_ok), bool(grads_ok)
        if (loss_ok and grads_ok) or nonfinite in ("skip", "apply"):
            return result, (loss_ok and grads_ok) or nonfinite == "apply"
        where = "no stage" if grads_ok else f"stage {self.program.stage} from microbatch 0"
        raise StepError(
            f"{self.rank_tag} Non-finite values at step {step_number}: loss of microbatch(es) "
            f"{'none' if loss_ok else [0]} on the last stage; gradients of {where}. "
            f"{DIRECT_NOTE if direct and loss_ok else ''}Lower the learning rate, check the data, or set nonfinite='skip' to skip such "
            f"updates on every rank.")
