"""Compiled programs of one pipeline stage: forward, backward and the fused last stage.

Example::

    program = StageProgram(traced, plan, stage=1, optimize="memory", objective=objective)
    sends = program.forward(0, inputs, recv, consts)  # stashes what backward needs
    grads_to_producers = program.backward(0, dys)     # accumulates dW into program.grads

[Note: stashing] ``optimize: speed`` keeps what the backward needs from every microbatch's
forward, and runs the backward and the gradients' accumulation as one compiled call: the
forward returns the products ``x·W`` of the stage's Dense and EinsumDense calls beside its
outputs, and the backward recomputes only what lies between them ([Note: replayed products] in
deferred.py). Measured on 4 × Dense(1024) at microbatch 256, one thread, alternating
(`benchmarks/stage_backward.py`): forward + backward 46 ms, against 51 ms for the taped
fallback (below) and 43 ms for the floor, one fused forward-backward call; the backward alone
30 ms against 35 ms. The fallback, the *taped backward*, keeps an eager
GradientTape per microbatch over the compiled forward and differentiates it with TensorFlow's
gradient of a function call (which also computes the gradient of every input, the model's own
included), then accumulates in a second call; a stage takes it where replaying saves nothing
or costs more: no Dense or EinsumDense call to replay, or a convolution or recurrent layer,
whose recomputation would cost what the replay saves (`_replays`), or with the environment
variable ``TFSMP_TAPED_BACKWARD=1`` (a diagnostic switch, used by the benchmarks to measure
both). ``optimize: memory`` keeps only the stage's input tensors and recomputes the forward
inside a compiled backward (1.49× a fused call). The last stage fuses forward, loss and
backward in one compiled call.

[Note: what a stage differentiates] A stage's backward differentiates its sends against the
gradients it received plus its own layers' losses ([Note: decomposable losses] in
layer_losses.py), both times the step's loss scale; the last stage differentiates its share of
the compiled loss ([Note: loss numerators] in objective.py) plus its layers' losses. Every
program takes the microbatch's constants vector (`objective.Consts`) as an input, so the same
trace serves every step and every microbatch size.

[Note: recompute state] A recomputed forward must see the state the original forward saw:
dropout seed-generator states, and BatchNormalization moving statistics must not be updated
twice. A backward that recomputes (memory mode, and speed mode's replay) therefore sets the stage's non-trainable variables to the values
they had before that microbatch's forward, recomputes, and then puts back the current values.

[Note: split stages] In a zero-bubble schedule a stage with ``W`` actions runs with ``split``
set: its forward (or fused last-stage call, or memory-mode recompute) runs the layers under a
`tfsmp.runtime.deferred` recorder, its backward (``B``) accumulates only the weight gradients of
layers that are not deferred and returns the gradients for the received tensors, and `weight`
(``W``) later turns the saved layer inputs and pre-activation gradients into the deferred
layers' weight gradients ([Note: split backward] in `deferred.py`). A microbatch is held from
its forward until its ``W``. ``fresh`` and ``fresh_w`` are the two halves' [Note: fresh
accumulators] flags: B and W of one microbatch write disjoint accumulators, and a variable that
gets gradient from both (a deferred kernel that another op also reads) gets B's part added in W.
An unsplit stage splits only the microbatches in ``drain`` ([Note: drain split] in
executor.py); its unsplit backwards write every accumulator (`_take_first`), so their W's add.

[Note: weights at the step's end] With several microbatches a stage needs each variable's
gradient summed over them before the update, and an accumulator per variable holds that sum for
the whole step: 4 bytes per float32 parameter beside the weights and the optimizer's slots, the
one state plain Keras does not keep (measured, benchmark 10: 1.08-1.11x plain Keras's bytes per
parameter under Adam, 1.3-1.4x under SGD, on every rank). A linear layer's weight gradient is
``xᵀ·dy`` though, and for weight-dominated stages its inputs and pre-activation gradients for
the whole batch are far smaller than the weights (a Dense(4096) at batch 8: 256 KiB against 64
MiB). So where `tfsmp.partitioning.memory.late_weights_pay` says so, a stage runs like a split
stage ([Note: split stages]) whose ``W`` comes once, at the step's end: B keeps each
microbatch's layer inputs and pre-activation gradients and builds no weight gradient for the
linear layers, which get no accumulator; `apply_late` then computes each such variable's
gradient for the whole batch (``Xᵀ·dY`` over the microbatches' rows) inside the optimizer's
update of that variable, one variable after another (`DirectUpdate.apply_computed`), so one
weight gradient exists at a time, as in plain Keras's train step. Other variables (embeddings,
normalization) keep accumulators. The engine uses it where it would update directly but for the
microbatch count ([Note: direct update] in memory.py: one replica, one unsplit stage per rank,
no tied copy, an optimizer that updates variable by variable, no ``clipnorm``/``clipvalue``).

[Note: late weights across replicas] With d > 1 data-parallel replicas a variable's gradient is
the sum over the replicas' rows, which the reduction used to take from an accumulator per
variable (so every replica held a full set of gradients all step: at p=4 x d=2 with sharded
optimizer state, 64 MiB per Dense(4096) layer beside 64 of weights and 64 of Adam slots). A
linear layer's gradient is ``Xᵀ·dY`` over all rows though, so at the step's end each replica
gathers every replica's saved inputs and pre-activation gradients (one allgather of a few KiB
to MiB, in data-rank order: `_replicas_rows`) and computes the whole batch's gradient itself
inside its update, as one process would. Replicas compute on the same gathered values, so
they update alike; with sharded optimizer state only a variable's owner updates it and the
weight exchange gives the others its values ([Note: weight exchange] in sharding.py). Other
variables keep accumulators and the reduction. `RunPlan.late_possible` allows it at any
microbatch count when d > 1; `late_weights_pay` decides with the whole batch's rows.

[Note: late before direct] At one microbatch and one replica a stage could also update each
variable inside its backward ([Note: direct update] in memory.py), but nothing there orders a
variable's update before the next gradient is computed, and the executor runs the backward
ahead of the updates: under SGD a direct update held every gradient and more (8.71 bytes per
parameter against plain Keras's 8.49; 6.72 with late weights at m > 1, benchmark 10). Late
weights compute one weight gradient at a time by construction. So where both are possible the
stage decides at its first forward, as at m > 1: late weights where `late_weights_pay`, and
its direct update otherwise (an activation-heavy stage, whose inputs and pre-activation
gradients would outweigh its linear variables).

[Note: finite flags] Whether a step's gradients are finite is checked once per stage and step,
when the step's result is taken (`GradientState.finite_status`): one sum over every accumulator
the step wrote (`all_finite`, [Note: cheap finiteness] in fused_step.py; the exact element-wise
test only when that sum is not finite). Accumulating keeps a non-finite value non-finite (NaN
stays NaN, inf + -inf is NaN), so the sum at the step's end sees any microbatch's. Per
microbatch, each compiled backward only returns whether that microbatch's own inputs (model
inputs, received tensors and received gradients, and the stage's layer losses) were finite: a
sum over tensors a fraction of the weights' size, kept as a tensor and read only on a bad step,
to name the first microbatch whose inputs were not (a stage that overflowed on finite inputs
is named without one). Before, every accumulation summed every accumulator it wrote: m reads
of the stage's gradients per step instead of one. The taped fallback and direct updates keep
their exact per-microbatch flags.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import tensorflow as tf
from keras.src.backend import get_keras_mask, set_keras_mask

from tfsmp.errors import StepError
from tfsmp.partitioning.memory import late_weights_pay
from tfsmp.partitioning.plan import Boundary, StagePlan
from tfsmp.runtime import deferred, kernels
from tfsmp.runtime import layer_losses as ll
from tfsmp.runtime.dispatch import Program
from tfsmp.runtime.gradients import CONCAT, SUM, GradientStore, all_finite
from tfsmp.runtime.hooks import StageResult, StepMode
from tfsmp.runtime.memory import DirectUpdate
from tfsmp.runtime.objective import Consts, Objective

if TYPE_CHECKING:
    from tfsmp.graph.tracer import TracedModel

__all__ = ["EvalOutput", "StageProgram", "all_finite", "is_differentiable"]


def is_differentiable(dtype: str) -> bool:
    return dtype in ("float16", "bfloat16", "float32", "float64")


def _replicas_rows(group: Any, xs: list[tf.Tensor], dys: list[tf.Tensor],
                   extras: dict[str, tf.Tensor]
                   ) -> tuple[list[tf.Tensor], list[tf.Tensor], dict[str, tf.Tensor]]:
    """[Note: late weights across replicas] Every replica's rows of the step's saved linear
    inputs and pre-activation gradients, in data-rank order, and the sum of their other
    gradient parts (``extras``): one allgather. A replica without rows sends none."""
    mine = ([np.asarray(x) for x in xs], [np.asarray(d) for d in dys],
            {k: np.asarray(v) for k, v in extras.items()})
    every = [g for g in group.allgather_obj(mine) if g[0]]
    if not every:
        return xs, dys, extras
    calls = len(every[0][0])
    xs = [tf.constant(np.concatenate([g[0][k] for g in every], 0)) for k in range(calls)]
    dys = [tf.constant(np.concatenate([g[1][k] for g in every], 0)) for k in range(calls)]
    summed: dict[str, Any] = {}
    for g in every:
        for k, v in g[2].items():
            summed[k] = summed[k] + v if k in summed else v
    return xs, dys, {k: tf.constant(v) for k, v in summed.items()}


def _accumulate_into(acc: tf.Variable, g: tf.Tensor, first: bool) -> tf.Tensor:
    """``acc = g`` for the step's first microbatch, else ``acc += g`` ([Note: fresh
    accumulators] in gradients.py); returns the accumulator's new value, whose finiteness
    `all_finite` checks with the others' ([Note: finite flags])."""
    fused = kernels.accumulate(acc, g, assign=first)  # [Note: products into accumulators]
    if fused is not None:
        return fused
    if first:
        return acc.assign(tf.cast(g, acc.dtype))
    return acc.assign_add(tf.cast(g, acc.dtype))


def _inputs_finite(tensors: list[Any]) -> tf.Tensor:
    """Whether every floating-point tensor among a microbatch's inputs, received tensors and
    received gradients is finite: only which microbatch to name on a bad step ([Note: finite
    flags])."""
    return all_finite([t for t in tensors if t is not None and t.dtype.is_floating])


@dataclass
class EvalOutput:
    """A forward without stashing: what to send, the model outputs on the last stage (their
    Keras masks attached), and this microbatch's share of the stage's layer losses."""

    sends: list[tf.Tensor]
    outputs: list[tf.Tensor]
    layer_loss: tf.Tensor


@dataclass
class _Stash:
    inputs: list[tf.Tensor]
    recv: list[tf.Tensor]
    consts: tf.Tensor
    tape: tf.GradientTape | None = None
    sends: list[tf.Tensor] | None = None
    layer_loss: tf.Tensor | None = None
    state: list[tf.Tensor] | None = None
    recv_grads: list[tf.Tensor] | None = None
    slots: list[tf.Tensor] | None = None  # [Note: split stages]
    xs: list[tf.Tensor] | None = None
    products: list[tf.Tensor] | None = None  # [Note: replayed products] in deferred.py


@dataclass
class _WeightWork:
    """What a split stage's ``W`` needs: deferred layers' inputs and pre-activation gradients,
    and B's gradients of deferred variables that other ops also read."""

    xs: list[tf.Tensor]
    dys: list[tf.Tensor]
    extras: dict[int, tf.Tensor]


class StageProgram:
    """The compiled forward/backward of one stage. See the module docstring."""

    def __init__(
        self,
        traced: TracedModel,
        plan: StagePlan,
        stage: int,
        *,
        optimize: str = "memory",
        objective: Objective | None = None,
        jit_compile: bool = False,
        relax_shapes: bool = False,
        split: bool = False,
        accumulate: bool = True,
    ) -> None:
        self.stage = stage
        self.is_last = stage == plan.num_stages - 1
        self.optimize = optimize
        self.traced = traced
        names = set(plan.layers(stage))
        self.calls = [c for c in traced.calls if c.layer_name in names]
        read = {k for c in self.calls for k in c.input_keys}
        self.input_keys = [k for k in traced.input_keys if k in read]
        self.recv: list[Boundary] = plan.recv_boundaries(stage)
        self.send: list[Boundary] = plan.send_boundaries(stage)
        self.output_keys = list(traced.output_keys) if self.is_last else []
        self.trainable = [v for v in traced.variables_of(names) if v.trainable]
        self.non_trainable = [v for v in traced.variables_of(names) if not v.trainable]
        # [Note: results own their gradients] in gradients.py: the store outlives steps, each
        # step writes a `GradientState` of its own, which its result keeps
        self._store = GradientStore(stage, self.trainable, accumulate)
        self.grads = self._store.step()
        self.update: DirectUpdate | None = None  # [Note: direct update] in memory.py
        self._diff_recv = [i for i, b in enumerate(self.recv) if is_differentiable(b.dtype)]
        self._diff_send = [i for i, b in enumerate(self.send) if is_differentiable(b.dtype)]
        self.objective = objective
        self._stash: dict[int, _Stash] = {}
        # [Note: decomposable losses] in layer_losses.py: per call, the rule of each loss it adds
        self.loss_rules: dict[int, list[str | None] | None] = {}
        self.unmeasured: set[str] = set()  # layers whose losses appeared without a known rule
        self._sparse_measured = False
        # [Note: relaxed shapes] With inputs whose shapes vary between batches (sequence
        # lengths), a program traces for the first shape and once more, with the varying
        # dimensions relaxed to None, at the second; every later shape, new or seen, reuses a
        # trace (what Keras's own train function does). Static models keep exact-shape traces.
        def compile_fn(f: Callable[..., Any]) -> Any:
            # [Note: OpenBLAS products] in tfsmp/runtime/kernels: labelled with blas='openblas'
            return kernels.program(f, jit_compile=jit_compile or None,
                                   reduce_retracing=relax_shapes)

        self._compile_fn = compile_fn
        self._fwd = compile_fn(self._forward_fn)
        self._eval = compile_fn(self._eval_fn)
        self._fwd_split = compile_fn(self._forward_split_fn)
        self._fwd_stash = compile_fn(self._forward_stash_fn)
        self._retrace()  # the programs that update or accumulate
        # [Note: collect mode] `@smp.step` returns every microbatch's gradients (StepOutput),
        # so with `collect` set the weight gradients are kept per microbatch, not summed.
        self.collect = False
        # [Note: split stages]: set when the schedule gives this stage W actions
        self.split = split
        self._weight_work: dict[int, _WeightWork] = {}
        # [Note: drain split]: microbatches whose backward an unsplit stage splits this step
        self.drain: frozenset[int] = frozenset()
        # per input shape: the split backward's zero slots, and each deferred call's input and
        # pre-activation (shape, dtype), what weights at the step's end would keep per microbatch
        self._slot_cache: dict[tuple[Any, ...], tuple[list[tf.Tensor], list[tuple[Any, Any]]]] = {}
        self._deferred_layers: list[Any] | None = None
        self._deferred_vars: list[int] = []  # trainable index of each deferred (variable, call)
        self._deferred: frozenset[int] = frozenset()
        self._index = {id(v): i for i, v in enumerate(self.trainable)}
        # [Note: stashing]: the compiled backward, or the taped fallback
        self.replay = optimize == "speed" and _replays(self.calls)
        if self.replay:
            deferred.install()
        # [Note: weights at the step's end]: asked for (late), and decided at the first forward
        self.late = False
        self._late_microbatches = 1
        self._late_decided = False
        self._late_fn: Any = None
        self._late_owner: DirectUpdate | None = None
        self._late_mine: tuple[int, ...] = ()  # the trainable variables the late update takes

    @property
    def accumulators(self) -> list[tf.Variable]:
        return self._store.accumulators

    def set_update(self, update: DirectUpdate | None) -> None:
        """Updates this stage's variables inside its backward with ``update``'s optimizer, or
        (None) accumulates their gradients for the engine's step; programs trace anew."""
        self.update = update
        if update is None:
            self._store.ensure_accumulators()
        self._retrace()

    def _retrace(self) -> None:
        """New programs for those that update or accumulate (each traces at its next call)."""
        self._bwd_recompute = self._compile_fn(self._backward_recompute_fn)
        self._fused = self._compile_fn(self._fused_fn)
        self._weight = self._compile_fn(self._weight_fn)
        self._accumulate = Program(tf.function(self._accumulate_fn))  # [Note: program dispatch]
        self._direct = Program(tf.function(self._direct_fn))
        self._traced_generation = self._store.generation  # [Note: traced accumulators]

    def _ensure_accumulators(self, skip: frozenset[int] = frozenset()) -> None:
        """The store's `ensure_accumulators`; programs that captured replaced accumulators
        trace anew ([Note: traced accumulators] in gradients.py)."""
        self._store.ensure_accumulators(skip)
        if self._store.generation != self._traced_generation:
            self._retrace()

    @property
    def late_undecided(self) -> bool:
        """Whether this stage would take linear layers' gradients at the step's end but has not
        yet decided it (at its first forward)."""
        return self.late and not self._late_decided

    def set_late(self, late: bool, microbatches: int) -> None:
        """Computes the linear layers' weight gradients at the step's end instead of
        accumulating them, where that holds less ([Note: weights at the step's end]; decided at
        the first forward, when the microbatch's shapes are known)."""
        self.late, self._late_microbatches, self._late_decided = late, microbatches, False
        self._late_fn = None
        if late:
            self._store.drop_accumulators()  # made at the decision, for the variables not deferred
        elif self.update is None:  # a direct update keeps none ([Note: direct update])
            self._ensure_accumulators()

    def _decide_late(self, inputs: list[tf.Tensor], recv: list[tf.Tensor], consts: tf.Tensor
                     ) -> None:
        """The first forward of a late stage: its linear calls and their shapes (a trace),
        then whether keeping their inputs and gradients for a step holds less than their
        variables' accumulators would."""
        self._late_decided = True
        # discovers the deferred calls ([Note: split backward]) and this microbatch's specs
        specs = self._discovered(inputs, recv, consts)[1]
        per_mb = sum(_nbytes(shape, dtype) for shape, dtype in specs)
        avoided = sum(_nbytes(self.trainable[i].shape, tf.as_dtype(self.trainable[i].dtype))
                      for i in self._deferred)
        trainable = sum(_nbytes(v.shape, tf.as_dtype(v.dtype)) for v in self.trainable)
        # the step's rows times the bytes a row holds: the same on every replica, whatever
        # rows its own first microbatch has (a batch that splits unevenly over replicas gave
        # them different decisions, so different accumulators, and their gradient reductions
        # waited on each other for ever)
        rows_mb = float(consts[Consts.ROWS_MB])  # the rows ``specs`` were made with
        rows = float(consts[Consts.ROWS])
        held = per_mb / rows_mb * rows if rows_mb > 0 else per_mb * self._late_microbatches
        if not late_weights_pay(held, avoided, trainable):
            self.late = False
            if self.update is not None:  # it updates directly: no accumulators
                return
        elif self.update is not None:  # [Note: late before direct]
            self.update = None
            self._retrace()
        self._ensure_accumulators(self._deferred if self.late else frozenset())

    def apply_late(self, update: DirectUpdate, factor: float, group: Any = None,
                   owned: set[int] | None = None) -> bool:
        """The step's update of this stage's variables, each linear layer's weight gradient
        computed for the whole batch from every microbatch's saved inputs and pre-activation
        gradients ([Note: weights at the step's end]); returns whether every gradient was
        finite (a variable whose gradient is not is left as it was). ``group`` (the stage's
        data-parallel replicas) and ``owned`` (ids of the variables this replica updates):
        [Note: late weights across replicas]."""
        works = [self._weight_work.pop(i) for i in sorted(self._weight_work)]
        calls = len(self._deferred_layers or [])
        xs = [tf.concat([w.xs[k] for w in works], 0) for k in range(calls)] if works else []
        dys = [tf.concat([w.dys[k] for w in works], 0) for k in range(calls)] if works else []
        extras: dict[str, tf.Tensor] = {}
        for w in works:
            for i, g in w.extras.items():
                extras[str(i)] = extras[str(i)] + g if str(i) in extras else g
        if group is not None and group.size > 1:
            xs, dys, extras = _replicas_rows(group, xs, dys, extras)
        sparse = {str(i): part for i, part in self.grads.sparse.items()}
        mine = tuple(i for i, v in enumerate(self.trainable) if owned is None or id(v) in owned)
        if not mine:
            return True
        if self._late_fn is None or self._late_owner is not update or self._late_mine != mine:
            self._late_fn = kernels.program(self._late_update_fn, reduce_retracing=True)
            self._late_owner, self._late_mine = update, mine
        return bool(self._late_fn(xs, dys, extras, sparse, tf.constant(factor, tf.float32)))

    def _late_update_fn(self, xs: list[tf.Tensor], dys: list[tf.Tensor],
                        extras: dict[str, tf.Tensor], sparse: dict[str, tuple[Any, Any]],
                        factor: tf.Tensor) -> tf.Tensor:
        update = self._late_owner
        parts: dict[int, list[tuple[int, int]]] = {}  # variable -> [(call, 0 kernel / 1 bias)]
        pos = 0
        for k, layer in enumerate(self._deferred_layers or []):
            for j, v in enumerate((layer._kernel, layer.bias)):
                if v is not None:
                    parts.setdefault(self._deferred_vars[pos], []).append((k, j))
                    pos += 1

        def deferred_grad(i: int) -> tf.Tensor:
            total: Any = extras.get(str(i))
            for k, j in parts.get(i, []):
                layer = (self._deferred_layers or [])[k]
                g = deferred.weight_gradients([layer], [xs[k]], [dys[k]])[j][1]
                total = g if total is None else total + g
            return total * tf.cast(factor, total.dtype)

        def sparse_grad(i: int) -> tf.IndexedSlices:
            values, indices = sparse[str(i)]
            shape = tf.shape(self.trainable[i], tf.int64)
            return tf.IndexedSlices(values * tf.cast(factor, values.dtype), indices, shape)

        def dense_grad(i: int) -> tf.Tensor:
            g = self.grads.accumulators[i].value()
            return g * tf.cast(factor, g.dtype)

        makers: list[Callable[[], Any]] = []
        for i in self._late_mine:
            kind = (deferred_grad if i in self._deferred else
                    sparse_grad if str(i) in sparse else dense_grad)
            makers.append(lambda i=i, kind=kind: kind(i))  # type: ignore[misc]
        return update.apply_computed(  # type: ignore[union-attr]
            makers, [self.trainable[i] for i in self._late_mine])

    def set_objective(self, objective: Objective | None) -> None:
        """Trains with another compiled loss from now on: the fused last stage traces anew."""
        self.objective = objective
        self._fused = self._compile_fn(self._fused_fn)

    def measure_layer_losses(self) -> bool:
        """Measures how every loss this stage's layers add combines over microbatches ([Note:
        decomposable losses]); returns whether any call adds one. Runs once, before training."""
        for pos, call in enumerate(self.calls):
            if ll.may_add_losses(call.layer):
                self.loss_rules[pos] = ll.probe_call(call)
        return any(rules is None or rules for rules in self.loss_rules.values())

    def per_microbatch_losses(self) -> list[str]:
        """Layers whose added loss is neither a sum nor a mean over samples, or could not be
        measured ([Note: decomposable losses]): with several parts per step, each part's value
        counts as a row-weighted mean (a mixture-of-experts balancing loss per microbatch, as
        pipeline frameworks compute it)."""
        return sorted({self.calls[pos].layer_name for pos, rules in self.loss_rules.items()
                       if rules is None or None in rules})

    # -- the graph interpreter -----------------------------------------------------------------

    def _run(self, inputs: list[tf.Tensor], recv: list[tf.Tensor], training: bool,
             consts: tf.Tensor) -> tuple[list[tf.Tensor], list[tf.Tensor], tf.Tensor]:
        """Runs the stage's calls: (tensors to send, model outputs, layer-loss share)."""
        env: dict[str, Any] = dict(zip(self.input_keys, inputs))
        env.update(zip((b.tensor for b in self.recv), recv))
        frac = Consts.frac(consts)
        layer_loss = tf.zeros((), tf.float32)
        for pos, call in enumerate(self.calls):
            call.run(env, training=training)
            if pos in self.loss_rules:
                added = ll.own_losses(call.layer)
                rules = self.loss_rules[pos]
                if added and (rules is None or len(rules) != len(added)):
                    self.unmeasured.add(call.layer_name)
                    rules = [ll.MEAN] * len(added)
                elif rules and None in rules:  # neither: per microbatch, as a mean
                    rules = [ll.MEAN if r is None else r for r in rules]
                layer_loss += ll.combine(added, rules or [], frac)
        return ([env[b.tensor] for b in self.send], [env[k] for k in self.output_keys],
                layer_loss)

    def _sources(self, recv: list[tf.Tensor], slots: list[tf.Tensor] | None = None) -> list[Any]:
        return ([v.value for v in self.trainable] + [recv[i] for i in self._diff_recv]
                + list(slots or []))

    def _targets(self, sends: list[tf.Tensor], dys: list[tf.Tensor], layer_loss: tf.Tensor,
                 consts: tf.Tensor) -> tuple[list[tf.Tensor], list[tf.Tensor]]:
        """What a middle stage differentiates ([Note: what a stage differentiates])."""
        scale = consts[Consts.SCALE]
        targets = [sends[i] for i in self._diff_send] + [layer_loss]
        grads = [dys[i] for i in self._diff_send] + [tf.reshape(scale, ())]
        return targets, grads

    def _split_grads(self, grads: list[Any], recv: list[tf.Tensor], collect: bool = False,
                     first: bool = False, defer: bool = False,
                     inputs_ok: tf.Tensor | None = None
                     ) -> tuple[list[tf.Tensor], Any, Any, tf.Tensor]:
        """Accumulates dense weight gradients (``first``: assigns them, [Note: fresh
        accumulators]) except deferred ones ([Note: split stages]); returns gradients for every
        received boundary, the sparse ones as ``{str(variable index): (values, indices)}`` (with
        ``collect``: the list of all weight gradients of this microbatch instead), B's
        gradients of deferred variables (``{str(index): gradient}``, only those another op
        reads) and ``inputs_ok``, the microbatch's inputs' flag ([Note: finite flags]; a
        direct update's own flag instead)."""
        n = len(self.trainable)
        deferred_vars = self._deferred if defer else frozenset()
        out = [tf.zeros_like(r) for r in recv]
        for j, i in enumerate(self._diff_recv):
            out[i] = tf.convert_to_tensor(grads[n + j])
        if collect:
            return out, [tf.convert_to_tensor(g) for g in grads[:n]], {}, tf.constant(True)
        if self.update is not None:  # [Note: direct update]
            return out, {}, {}, self.update.apply(list(grads[:n]), self.trainable)
        sparse: dict[str, tuple[tf.Tensor, tf.Tensor]] = {}
        extras: dict[str, tf.Tensor] = {}
        for i, (acc, g) in enumerate(zip(self.grads.accumulators, grads[:n])):
            if i in deferred_vars:
                if g is not None:
                    extras[str(i)] = tf.convert_to_tensor(g)
            elif g is None:
                _accumulate_into(acc, tf.zeros_like(acc), first)
            elif isinstance(g, tf.IndexedSlices):
                sparse[str(i)] = (tf.cast(g.values, acc.dtype), g.indices)
            else:
                _accumulate_into(acc, g, first)
        return out, sparse, extras, tf.constant(True) if inputs_ok is None else inputs_ok

    @staticmethod
    def _unconnected(defer: bool) -> tf.UnconnectedGradients:
        """ZERO unsplit; NONE when split, so B can tell which deferred variables other ops read."""
        return tf.UnconnectedGradients.NONE if defer else tf.UnconnectedGradients.ZERO

    # -- compiled functions --------------------------------------------------------------------

    def _forward_fn(self, inputs: list[tf.Tensor], recv: list[tf.Tensor], training: bool,
                    consts: tf.Tensor) -> tuple[list[tf.Tensor], tf.Tensor]:
        sends, _, layer_loss = self._run(inputs, recv, training, consts)
        return sends, layer_loss

    def _forward_split_fn(self, inputs: list[tf.Tensor], recv: list[tf.Tensor],
                          slots: list[tf.Tensor], training: bool, consts: tf.Tensor
                          ) -> tuple[list[tf.Tensor], tf.Tensor, list[tf.Tensor]]:
        with deferred.recording(slots, self._owns) as rec:
            sends, _, layer_loss = self._run(inputs, recv, training, consts)
        return sends, layer_loss, rec.xs

    def _forward_stash_fn(self, inputs: list[tf.Tensor], recv: list[tf.Tensor], training: bool,
                          consts: tf.Tensor) -> tuple[list[tf.Tensor], tf.Tensor, list[tf.Tensor]]:
        """The forward of a replaying stage: also the products its backward replays ([Note:
        replayed products] in deferred.py)."""
        with deferred.recording(None, self._owns) as rec:
            sends, _, layer_loss = self._run(inputs, recv, training, consts)
        return sends, layer_loss, rec.products

    def _backward_recompute_fn(self, inputs: list[tf.Tensor], recv: list[tf.Tensor],
                               dys: list[tf.Tensor], state: list[tf.Tensor], consts: tf.Tensor,
                               collect: bool, first: bool, slots: list[tf.Tensor] | None = None,
                               products: list[tf.Tensor] | None = None) -> Any:
        """The compiled backward of memory mode (recompute the forward) and of speed mode
        (``products`` given: replay them, [Note: stashing]), accumulation included."""
        current = [tf.identity(v.value) for v in self.non_trainable]
        for v, s in zip(self.non_trainable, state):
            v.assign(s)
        recording = (deferred.recording(slots, self._owns, products)
                     if slots is not None or products is not None else _nothing())
        with tf.GradientTape() as tape:
            tape.watch([recv[i] for i in self._diff_recv] + list(slots or []))
            with recording as rec:
                sends, _, layer_loss = self._run(inputs, recv, True, consts)
        targets, output_grads = self._targets(sends, dys, layer_loss, consts)
        grads = tape.gradient(targets, self._sources(recv, slots), output_gradients=output_grads,
                              unconnected_gradients=self._unconnected(slots is not None))
        for v, c in zip(self.non_trainable, current):
            v.assign(c)
        k = len(self.trainable) + len(self._diff_recv)
        inputs_ok = _inputs_finite([*inputs, *recv, *dys, layer_loss])
        split = self._split_grads(grads[:k], recv, collect, first, defer=slots is not None,
                                  inputs_ok=inputs_ok)
        if slots is None:
            return split
        return (*split, rec.xs, _zeros_for_none(grads[k:], slots))  # type: ignore[union-attr]

    def _fused_fn(self, inputs: list[tf.Tensor], recv: list[tf.Tensor], y: Any, sample_weight: Any,
                  consts: tf.Tensor, first: bool, slots: list[tf.Tensor] | None = None,
                  model_inputs: list[tf.Tensor] | None = None) -> Any:
        with tf.GradientTape() as tape:
            tape.watch([recv[i] for i in self._diff_recv] + list(slots or []))
            with deferred.recording(slots, self._owns) if slots is not None else _nothing() as rec:
                _, outputs, layer_loss = self._run(inputs, recv, True, consts)
            terms = self.objective.call(y, self.traced.pack_outputs(outputs), sample_weight,  # type: ignore[union-attr]
                                        model_inputs)
            total = self.objective.backprop(terms, consts) + layer_loss  # type: ignore[union-attr]
            scaled = total * consts[Consts.SCALE]
        grads = tape.gradient(scaled, self._sources(recv, slots),
                              unconnected_gradients=self._unconnected(slots is not None))
        k = len(self.trainable) + len(self._diff_recv)
        split = self._split_grads(grads[:k], recv, first=first, defer=slots is not None,
                                  inputs_ok=_inputs_finite([*inputs, *recv, layer_loss]))
        record = (_stack(terms.numerators), _stack(terms.normalizers), layer_loss)
        masks = _masks_of(outputs)
        if slots is None:
            return record, outputs, masks, split
        return record, outputs, masks, split, rec.xs, _zeros_for_none(grads[k:], slots)  # type: ignore[union-attr]

    def _eval_fn(self, inputs: list[tf.Tensor], recv: list[tf.Tensor], training: bool,
                 consts: tf.Tensor) -> tuple[list[tf.Tensor], list[tf.Tensor], list[Any], tf.Tensor]:
        sends, outputs, layer_loss = self._run(inputs, recv, training, consts)
        return sends, outputs, _masks_of(outputs), layer_loss

    def _direct_fn(self, grads: list[Any]) -> tf.Tensor:
        return self.update.apply(grads, self.trainable)  # type: ignore[union-attr]

    def _accumulate_fn(self, grads: list[tf.Tensor | None], first: bool) -> tf.Tensor:
        return all_finite([_accumulate_into(acc, g, first)
                           for acc, g in zip(self.grads.accumulators, grads) if g is not None])

    def _weight_fn(self, xs: list[tf.Tensor], dys: list[tf.Tensor], extras: dict[str, tf.Tensor],
                   first: bool) -> tf.Tensor:
        """W of one microbatch: the deferred layers' weight gradients into their accumulators."""
        sums: dict[int, tf.Tensor] = {int(k): g for k, g in extras.items()}
        pairs = deferred.weight_gradients(self._deferred_layers or [], xs, dys)
        for i, (_, g) in zip(self._deferred_vars, pairs):
            sums[i] = sums[i] + g if i in sums else g
        accs = self.grads.accumulators
        for i in sorted(sums):  # checked at the step's end ([Note: finite flags])
            _accumulate_into(accs[i], sums[i], first)
        return tf.constant(True)

    # -- split stages --------------------------------------------------------------------------

    def _splitting(self, i: int) -> bool:
        """Whether microbatch ``i``'s backward leaves the linear layers' weight gradients to a
        W: on a split stage, a late one, or one of this step's drain microbatches ([Note: drain
        split])."""
        if self.collect:
            return False
        return self.split or self.late or self._drains(i)

    def _drains(self, i: int) -> bool:
        """Whether microbatch ``i`` is one of this step's drain microbatches ([Note: drain
        split]): on a stage that is neither split (its W's are the schedule's) nor late (the
        step's end computes them inside the update, [Note: weights at the step's end], where
        the linear layers' accumulators are placeholders), nor updating directly."""
        return (i in self.drain and self.update is None and not self.split
                and not self.late)

    def _take_first(self, split: bool) -> bool:
        """The [Note: fresh accumulators] flag of a backward: a split one writes B's half, an
        unsplit one every accumulator, so a later W of the step (on an unsplit stage, [Note:
        drain split]) adds to what it wrote."""
        return self.grads.take_fresh() if split else self.grads.take_fresh_all()

    def has_weight_work(self, i: int) -> bool:
        """Whether microbatch ``i``'s W is a drain W left to run ([Note: drain split])."""
        return self._drains(i) and i in self._weight_work

    def _slots(self, inputs: list[tf.Tensor], recv: list[tf.Tensor], consts: tf.Tensor
               ) -> list[tf.Tensor]:
        """Zero slots of this microbatch's input shapes ([Note: split backward])."""
        return self._discovered(inputs, recv, consts)[0]

    def _discovered(self, inputs: list[tf.Tensor], recv: list[tf.Tensor], consts: tf.Tensor
                    ) -> tuple[list[tf.Tensor], list[tuple[Any, Any]]]:
        """`_slot_cache`'s entry for this microbatch's input shapes, made at the first."""
        key = _shape_key(inputs, recv)
        found = self._slot_cache.get(key)
        if found is None:
            if len(self._slot_cache) >= 8:  # varying lengths: bound what is kept
                self._slot_cache.clear()
            deferred.install()
            rec = deferred.discover(lambda: self._run(inputs, recv, True, consts), self._owns)
            self._adopt(rec.layers)
            specs = [(x.shape, x.dtype) for x in rec.xs] + list(zip(rec.shapes, rec.dtypes))
            found = self._slot_cache[key] = (
                [tf.zeros(s, d) for s, d in zip(rec.shapes, rec.dtypes)], specs)
        return found

    def _owns(self, layer: Any) -> bool:
        """Whether this stage trains the layer's kernel and bias (a layer whose weights live
        elsewhere, a tied copy say, keeps its weight gradient in B)."""
        return all(id(v) in self._index for v in (layer._kernel, layer.bias) if v is not None)

    def _adopt(self, layers: list[Any]) -> None:
        """Maps the deferred calls' kernels and biases onto this stage's trainable variables."""
        if self._deferred_layers is not None:
            if len(layers) != len(self._deferred_layers) or any(
                    a is not b for a, b in zip(layers, self._deferred_layers)):
                raise StepError(
                    f"A split stage must call the same linear layers for every batch shape. "
                    f"Received: stage {self.stage} called {[x.name for x in layers]}, earlier "
                    f"{[x.name for x in self._deferred_layers]}. Use pipeline='interleaved' "
                    f"for this model.")
            return
        order = [self._index[id(v)] for layer in layers
                 for v in (layer._kernel, layer.bias) if v is not None]
        self._deferred_layers = list(layers)
        self._deferred_vars = order
        self._deferred = frozenset(order)

    def _defer(self, i: int, xs: list[tf.Tensor], dys: list[tf.Tensor], extras: dict[str, Any]
               ) -> None:
        self._weight_work[i] = _WeightWork(list(xs), list(dys),
                                           {int(k): g for k, g in extras.items()})

    # -- sparse structure ----------------------------------------------------------------------

    def _keep_sparse(self, i: int, sparse: dict[str, tuple[tf.Tensor, tf.Tensor]],
                     inputs: list[tf.Tensor], recv: list[tf.Tensor], consts: tf.Tensor) -> None:
        if sparse and not self._sparse_measured:
            self.grads.rules.update(self._measure_sparse(inputs, recv, consts,
                                                         sorted(int(k) for k in sparse)))
        self.grads.add_sparse(i, sparse)

    def _measure_sparse(self, inputs: list[tf.Tensor], recv: list[tf.Tensor], consts: tf.Tensor,
                        indices: list[int]) -> dict[int, str]:
        """Whether each sparse gradient's slices follow the batch's rows or not ([Note: sparse
        structure] in gradients.py): its slice count for a microbatch and for that microbatch
        repeated twice, measured once per stage in inference mode (no state changes).

        The counts are read from the gradients' static shapes in a trace that never runs, so
        the measurement allocates no tensor: run eagerly under a tape, it held the stage's
        activations for twice a microbatch, an eager tape's 2-2.5x of what the compiled
        backward keeps, and that set the rank's peak (measured: +97 MiB on GPT-2's first stage,
        [Note: memory model] in tfsmp/partitioning/memory.py). Only where a count depends on
        the values (no static shape) does the stage run, eagerly, as before."""
        self._sparse_measured = True
        consts = consts[:Consts.TERMS]  # inference's constants
        traced = [self._traced_counts(inputs, recv, consts, indices, reps) for reps in (1, 2)]
        counts = {i: (one, two) for i, one, two in zip(indices, *traced)}
        unknown = [i for i in indices if None in counts[i]]
        if unknown:
            counts.update(self._run_counts(inputs, recv, consts, unknown))
        rules: dict[int, str] = {}
        for i, (one, two) in counts.items():
            if one is None or two is None or one < 0 or two == 2 * one:
                rules[i] = CONCAT
            elif two == one:
                rules[i] = SUM
            else:
                raise StepError(
                    f"A variable read by a lookup must be read either once per sample or "
                    f"independently of the batch, for tfsmp to split the batch. Received: "
                    f"{self.grads.variable_name(i)} on stage {self.stage} is read both ways ({one} rows "
                    f"for a microbatch, {two} for twice its samples). Use microbatches=1 with "
                    f"one replica, or read the table through two layers.")
        return rules

    def _traced_counts(self, inputs: list[tf.Tensor], recv: list[tf.Tensor], consts: tf.Tensor,
                       indices: list[int], reps: int) -> list[int | None]:
        """Per trainable of ``indices``, its gradient's slices for ``reps`` copies of the
        microbatch, from a trace of a fresh function that never runs (the compiled programs
        keep their traces): -1 for a dense gradient, None when known only at run time."""
        found: list[int | None] = [None] * len(indices)

        def spec(t: tf.Tensor) -> tf.TensorSpec:
            shape = tuple(t.shape)
            return tf.TensorSpec((shape[0] * reps, *shape[1:]) if shape else (), t.dtype)

        def count(ins: list[tf.Tensor], rv: list[tf.Tensor], c: tf.Tensor) -> None:
            found[:] = self._slice_counts(ins, rv, c, indices)

        try:
            tf.function(count).get_concrete_function(
                [spec(t) for t in inputs], [spec(t) for t in recv],
                tf.TensorSpec.from_tensor(consts))
        except Exception:  # a stage that cannot trace on specs: measured by running it
            return [None] * len(indices)
        return found

    def _slice_counts(self, ins: list[tf.Tensor], rv: list[tf.Tensor], consts: tf.Tensor,
                      indices: list[int]) -> list[int | None]:
        """Per trainable of ``indices``, its gradient's slice count on these inputs (-1 for a
        dense gradient; None when a trace cannot know it), traced or eager alike."""
        with tf.GradientTape() as tape:
            out = self._eval_fn(ins, rv, False, consts)
            target = tf.add_n([tf.reduce_sum(tf.cast(t, tf.float32))
                               for t in (*out[0], *out[1]) if t.dtype.is_floating]
                              or [tf.zeros(())])
        grads = tape.gradient(target, [self.trainable[i].value for i in indices])
        return [(None if g.indices.shape[0] is None else int(g.indices.shape[0]))
                if isinstance(g, tf.IndexedSlices) else -1 for g in grads]

    def _run_counts(self, inputs: list[tf.Tensor], recv: list[tf.Tensor], consts: tf.Tensor,
                    indices: list[int]) -> dict[int, tuple[int | None, int | None]]:
        """The slice counts of `_traced_counts`, by running the stage eagerly under a tape."""
        one, two = (self._slice_counts([tf.concat([t] * reps, 0) for t in inputs],
                                       [tf.concat([t] * reps, 0) for t in recv], consts, indices)
                    for reps in (1, 2))
        return {i: (a, b) for i, a, b in zip(indices, one, two)}

    # -- what the executor calls ---------------------------------------------------------------

    def forward(self, i: int, inputs: list[tf.Tensor], recv: list[tf.Tensor], consts: tf.Tensor
                ) -> list[tf.Tensor]:
        """Training forward of microbatch ``i``; returns the tensors to send (boundary order)."""
        if self.late and not self._late_decided:
            self._decide_late(inputs, recv, consts)
        slots = self._slots(inputs, recv, consts) if self._splitting(i) else None
        if self.replay:  # [Note: stashing]
            state = [tf.identity(v.value) for v in self.non_trainable]
            sends, layer_loss, products = self._fwd_stash(inputs, recv, True, consts)
            self._stash[i] = _Stash(inputs, recv, consts, state=state, slots=slots,
                                    products=list(products))
            self.grads.losses[i] = layer_loss
            return list(sends)
        if self.optimize == "speed":
            tape = tf.GradientTape()
            with tape:
                tape.watch([recv[i2] for i2 in self._diff_recv] + list(slots or []))
                if slots is None:
                    (sends, layer_loss), xs = self._fwd(inputs, recv, True, consts), None
                else:
                    sends, layer_loss, xs = self._fwd_split(inputs, recv, slots, True, consts)
            self._stash[i] = _Stash(inputs, recv, consts, tape=tape, sends=sends,
                                    layer_loss=layer_loss, slots=slots, xs=xs)
            self.grads.losses[i] = layer_loss
            return list(sends)
        state = [tf.identity(v.value) for v in self.non_trainable]
        sends, layer_loss = self._fwd(inputs, recv, True, consts)
        self.grads.losses[i] = layer_loss
        self._stash[i] = _Stash(inputs, recv, consts, state=state, slots=slots)
        return list(sends)

    def backward(self, i: int, dys: list[tf.Tensor]) -> list[tf.Tensor]:
        """Backward of microbatch ``i`` given gradients for the sent tensors; returns gradients
        for the received tensors (boundary order) and accumulates weight gradients (on a split
        stage only those of layers that are not deferred, [Note: split stages])."""
        st = self._stash.pop(i)
        if st.recv_grads is not None:  # fused last stage: already done in forward
            return st.recv_grads
        if st.tape is not None:
            return self._backward_taped(i, st, dys)
        slots = st.slots
        first = False if self.collect else self._take_first(slots is not None)
        result = self._bwd_recompute(st.inputs, st.recv, dys, st.state or [], st.consts,
                                     self.collect, first, slots, st.products)
        recv_grads, extra, extras, flag = result[:4]
        if self.collect:
            self.grads.collected[i] = list(extra)
            return list(recv_grads)
        self._keep_sparse(i, extra, st.inputs, st.recv, st.consts)
        self._add_flag(i, flag)
        if slots is not None:
            self._defer(i, result[4], result[5], extras)
        return list(recv_grads)

    def _add_flag(self, i: int, flag: tf.Tensor) -> None:
        """A compiled backward's flag: a direct update's verdict, else the microbatch's
        inputs' ([Note: finite flags])."""
        if self.update is not None:
            self.grads.add_flag(i, flag)
        else:
            self.grads.add_hint(i, flag)

    def _backward_taped(self, i: int, st: _Stash, dys: list[tf.Tensor]) -> list[tf.Tensor]:
        slots = st.slots or []
        targets, output_grads = self._targets(st.sends or [], dys, st.layer_loss, st.consts)
        grads = st.tape.gradient(  # type: ignore[union-attr]
            targets, self._sources(st.recv, slots), output_gradients=output_grads,
            unconnected_gradients=self._unconnected(bool(slots)))
        n = len(self.trainable)
        k = n + len(self._diff_recv)
        out = [tf.zeros_like(r) for r in st.recv]
        for j, r in enumerate(self._diff_recv):
            out[r] = tf.convert_to_tensor(grads[n + j])
        if self.collect:
            self.grads.collected[i] = [tf.convert_to_tensor(g) for g in grads[:n]]
            return out
        if self.update is not None:  # [Note: direct update]
            self.grads.add_flag(i, self._direct(list(grads[:n])))
            return out
        dense: list[Any] = []
        extras: dict[str, Any] = {}
        sparse: dict[str, tuple[tf.Tensor, tf.Tensor]] = {}
        accs = self.grads.accumulators
        for r, g in enumerate(grads[:n]):
            if r in self._deferred and slots:
                if g is not None:
                    extras[str(r)] = g
                dense.append(None)
            elif g is None:
                dense.append(tf.zeros_like(accs[r]))
            elif isinstance(g, tf.IndexedSlices):
                sparse[str(r)] = (tf.cast(g.values, accs[r].dtype), g.indices)
                dense.append(None)
            else:
                dense.append(g)
        self._keep_sparse(i, sparse, st.inputs, st.recv, st.consts)
        if any(g is not None for g in dense):
            self.grads.add_flag(i, self._accumulate(dense, self._take_first(st.slots is not None)))
        if slots:
            self._defer(i, st.xs or [], _zeros_for_none(grads[k:], slots), extras)
        return out

    def weight(self, i: int) -> None:
        """``W`` of microbatch ``i`` ([Note: split stages]); a no-op when its backward was whole
        (an unsplit stage, or `smp.step`'s collect mode)."""
        work = self._weight_work.pop(i, None)
        if work is None or self._deferred_layers is None:
            return
        extras = {str(k): g for k, g in work.extras.items()}
        self._weight(work.xs, work.dys, extras, self.grads.take_fresh_w())

    def forward_backward_last(self, i: int, inputs: list[tf.Tensor], recv: list[tf.Tensor],
                              y: Any, sample_weight: Any, consts: tf.Tensor,
                              model_inputs: list[tf.Tensor] | None = None
                              ) -> tuple[tuple[tf.Tensor, tf.Tensor, tf.Tensor], list[tf.Tensor]]:
        """Last stage: forward, loss and backward in one call. Returns ((numerators,
        normalizers, layer loss) of this microbatch, model outputs with their masks).
        ``model_inputs``: every model input of the microbatch, for a model's own compute_loss
        ([Note: a model's own compute_loss] in tfsmp/keras/model_loss.py)."""
        if self.late and not self._late_decided:
            self._decide_late(inputs, recv, consts)
        slots = self._slots(inputs, recv, consts) if self._splitting(i) else None
        result = self._fused(inputs, recv, y, sample_weight, consts,
                             self._take_first(slots is not None), slots, model_inputs)
        record, outputs, masks, (recv_grads, sparse, extras, flag) = result[:4]
        self._keep_sparse(i, sparse, inputs, recv, consts)
        self._add_flag(i, flag)
        self.grads.losses[i] = record[2]
        if slots is not None:
            self._defer(i, result[4], result[5], extras)
        self._stash[i] = _Stash(inputs, recv, consts, recv_grads=list(recv_grads))
        return record, _with_masks(outputs, masks)

    def evaluate(self, inputs: list[tf.Tensor], recv: list[tf.Tensor], training: bool = False,
                 consts: tf.Tensor | None = None) -> EvalOutput:
        """Forward without stashing. Under a caller's GradientTape this is differentiable (used
        by `smp.step`'s last stage)."""
        if consts is None:
            consts = tf.zeros([Consts.TERMS], tf.float32)
        sends, outputs, masks, layer_loss = self._eval(inputs, recv, training, consts)
        return EvalOutput(list(sends), _with_masks(outputs, masks), layer_loss)

    def diff_recv(self, recv: list[tf.Tensor]) -> list[tf.Tensor]:
        """The received tensors that carry gradients (floating point), in boundary order."""
        return [recv[i] for i in self._diff_recv]

    def finish_head(self, i: int, inputs: list[tf.Tensor], recv: list[tf.Tensor],
                    diff_grads: list[tf.Tensor | None]) -> None:
        """Stores the gradients a custom last-stage head computed for the received tensors."""
        out = [tf.zeros_like(r) for r in recv]
        for j, k in enumerate(self._diff_recv):
            g = diff_grads[j] if j < len(diff_grads) else None
            if g is not None:
                out[k] = tf.convert_to_tensor(g)
        self._stash[i] = _Stash(inputs, recv, tf.zeros([Consts.TERMS]), recv_grads=out)

    def begin_step(self, mode: StepMode) -> None:
        """Starts a step of kind ``mode`` ([Note: one driver] in hooks.py): the next microbatch
        overwrites the accumulators, and in collect mode weight gradients are kept per
        microbatch; the step's gradients are a new object its result will own ([Note: results
        own their gradients] in gradients.py)."""
        self.grads = self._store.step()
        self._weight_work.clear()
        self.collect = mode.collect

    def result(self) -> StageResult:
        """This step's gradients, combined over microbatches, and their finiteness (a stage no
        microbatch reached, on a replica without rows in the batch, reports zeros)."""
        if not self.collect:
            self.grads.zero_if_unwritten()
        self.grads.combine_microbatches()
        finite, first = self.grads.finite_status()
        return StageResult(self.stage, finite, first, self.grads)

    def held_microbatches(self) -> int:
        """Microbatches whose activations this stage holds: from forward until backward, or
        until ``W`` on a split stage."""
        late = self.late and not self.split  # step-end inputs: small, counted apart
        return len(self._stash.keys() | (set() if late else self._weight_work.keys()))


def _replays(calls: list[Any]) -> bool:
    """Whether a speed-mode stage runs the compiled backward ([Note: stashing]): it has a
    Dense or EinsumDense call to replay and no convolution or recurrent layer to recompute."""
    if os.environ.get("TFSMP_TAPED_BACKWARD", "") not in ("", "0"):
        return False
    import keras

    costly = (keras.layers.RNN, *(getattr(keras.layers, n) for n in dir(keras.layers)
                                  if "Conv" in n and isinstance(getattr(keras.layers, n), type)))
    layers = [sub for c in calls if isinstance(c.layer, keras.layers.Layer)
              for sub in c.layer._flatten_layers(include_self=True)]
    return (any(deferred.replayable(x) for x in layers)
            and not any(isinstance(x, costly) for x in layers))


def _shape_key(inputs: list[tf.Tensor], recv: list[tf.Tensor]) -> tuple[Any, ...]:
    """A microbatch's input shapes and dtypes (the key of a stage's per-shape caches)."""
    return tuple((tuple(t.shape), t.dtype) for t in (*inputs, *recv))


def _nbytes(shape: Any, dtype: Any) -> int:
    """Bytes of a tensor of ``shape`` (unknown dimensions count 1) and ``dtype``."""
    n = 1
    for d in tf.TensorShape(shape).as_list():
        n *= d or 1
    return n * int(tf.as_dtype(dtype).size)


def _stack(values: list[tf.Tensor]) -> tf.Tensor:
    return tf.stack([tf.cast(v, tf.float32) for v in values]) if values else tf.zeros([0])


def _masks_of(outputs: list[tf.Tensor]) -> list[Any]:
    """The Keras mask of each output (None where it has none), as compiled code returns them."""
    return [get_keras_mask(t) for t in outputs]


def _with_masks(outputs: list[tf.Tensor], masks: list[Any]) -> list[tf.Tensor]:
    """Outputs returned by compiled code with their Keras masks attached again."""
    out = list(outputs)
    for t, m in zip(out, masks):
        if m is not None:
            set_keras_mask(t, m)
    return out


def _zeros_for_none(grads: list[Any], like: list[tf.Tensor]) -> list[tf.Tensor]:
    """A slot's gradient is None when nothing after its layer reaches the stage's outputs."""
    return [tf.zeros_like(s) if g is None else tf.convert_to_tensor(g) for g, s in zip(grads, like)]


@contextlib.contextmanager
def _nothing() -> Iterator[None]:
    yield None
