"""The pipeline engine of one rank: the step's bookkeeping, schedule, reduction and optimizer step.

Example::

    engine = Engine(traced, plan, schedules, config=config, comm=comm, rank_tag="[rank 0]",
                    objective=objective, optimizer=opt)   # usually built by runtime.setup
    result = engine.train_step(x, y, sample_weight)       # one optimizer step over the global batch
    result.loss, result.term_values                       # what Keras reports for that batch
    result = engine.evaluate(x, y, sample_weight)         # loss and outputs, no update

Roughly, for a training step on rank r (stages S_r = placement.stages(r): s mod p, or ZB-V's V):
    the global batch's rows -> this replica's rows (`replica_rows`) -> m' microbatches of any
    sizes, each with its constants (`objective.Consts`) -> the executor runs the lowered
    schedule (F/B/W/sends/receives) and calls this engine as its `StepHooks` ([Note: one driver]
    in hooks.py):
    -> reduce(s, result): sum stage s's gradients over its data-parallel replicas
    -> apply(result): every rank's finiteness, loss parts and normalizers in one allgather; the
             tied copies' sum; optimizer.apply_gradients(gradients of S_r, their variables)

[Note: one owner of the step] This engine alone turns a global batch into microbatches and back
into what Keras reports: which rows each replica trains on, how many microbatches a step has,
the constants every program needs for its share of the loss ([Note: loss numerators] in
objective.py), the layer losses ([Note: decomposable losses] in layer_losses.py) and weight
regularizers, and the step's loss, per-output losses and finiteness. Microbatches and replica
shares may be of any sizes (np.array_split's), so any batch size trains, and so does an epoch's
partial last batch: a replica left without rows still takes part in the reductions.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import tensorflow as tf
from keras import tree
from keras.src.backend import set_keras_mask

from tfsmp.comm.horovod import HorovodReducer
from tfsmp.errors import StepError
from tfsmp.partitioning.plan import StagePlan
from tfsmp.runtime import layer_losses as ll
from tfsmp.runtime import microbatch as mbatch
from tfsmp.runtime import watchdog as wd
from tfsmp.runtime.dynamic_shapes import BoundaryShapes, ShapeResolver, is_dynamic
from tfsmp.runtime.executor import (
    Executor,
    MicroBatch,
    StepResult,
    aligned_empty,
    as_tensor,
    held,
    host_view,
)
from tfsmp.runtime.fused_step import OneCallStep
from tfsmp.runtime.hooks import Head, StageResult, StepMode
from tfsmp.runtime.memory import DirectUpdate
from tfsmp.runtime.objective import Objective
from tfsmp.runtime.optimizer_options import OptimizerBridge
from tfsmp.runtime.stage import StageProgram
from tfsmp.runtime.ties import TiedCopies
from tfsmp.runtime.view import RankView
from tfsmp.schedule.actions import Action, Op
from tfsmp.schedule.lowering import Lowered, forward_only

if TYPE_CHECKING:
    from tfsmp.comm.base import Comm
    from tfsmp.config import Config
    from tfsmp.graph.tracer import TracedModel
    from tfsmp.timeline.events import Tracer

__all__ = ["Engine", "StepShape"]


@dataclass(frozen=True)
class StepShape:
    """How one global batch splits ([Note: one owner of the step]): every replica's rows,
    this replica's row range, the microbatches per replica and the batch's parts in all."""

    rows: int
    replica_rows: tuple[int, ...]
    start: int
    stop: int
    step_microbatches: int  # of every replica that has rows
    parts: int              # the batch's microbatches over all replicas

    @property
    def microbatches(self) -> int:
        """This replica's microbatches: 0 when it has no rows in this batch."""
        return self.step_microbatches if self.stop > self.start else 0

    @property
    def my_rows(self) -> int:
        return self.stop - self.start


class Engine:
    """One rank's share of a pipelined model. See the module docstring."""

    def __init__(
        self,
        traced: TracedModel,
        plan: StagePlan,
        schedules: Callable[[int], Lowered],
        *,
        config: Config,
        comm: Comm,
        rank_tag: str,
        objective: Objective | None,
        optimizer: Any,  # a Keras optimizer, or None (an SMP script applies its own)
        tracer: Tracer | None = None,
        horovod: HorovodReducer | None = None,
    ) -> None:
        self.traced = traced
        self.plan = plan
        self.config = config
        self.comm = comm
        self.rank_tag = rank_tag
        self.num_ranks = config.partitions
        self.pipe_rank = comm.pipeline.rank
        self.dp_size = comm.data.size
        self.m = config.microbatches
        # [Note: dynamic boundaries] in tfsmp/runtime/dynamic_shapes.py; None: all static
        self.boundary_shapes = BoundaryShapes.for_plan(traced, plan)
        # stage -> pipeline rank (s % p, or ZB-V's V): the one the schedules were lowered for
        lowered = schedules(self.m)
        self.placement = lowered.placement
        self.stages = self.placement.stages(self.pipe_rank)
        self._schedules = schedules
        self._actions: dict[int, list[Action]] = {self.m: lowered.actions[self.pipe_rank]}
        self._train_actions = self._actions[self.m]
        # [Note: split stages] in stage.py: a stage with W actions defers weight gradients to W
        weighted = {a.stage for a in self._train_actions if a.op is Op.WEIGHT}
        self.objective = objective
        # [Note: direct update] in tfsmp/runtime/memory.py: whether stages may update their
        # variables inside their backward (then they make no accumulators), and whether they do
        self._direct_possible = self._can_update_directly(plan, weighted)
        self._direct = False
        # [Note: weights at the step's end] in stage.py: the same, for several microbatches
        self._late_possible = self._can_update_late(plan, weighted)
        self._late = False
        self._late_update: DirectUpdate | None = None
        self.programs = {
            s: StageProgram(traced, plan, s, optimize=config.optimize, objective=objective,
                            jit_compile=bool(config.xla), relax_shapes=self._dynamic_inputs(),
                            split=s in weighted,
                            accumulate=not (self._direct_possible or self._late_possible))
            for s in self.stages}
        self.last_rank = self.placement.last_rank
        self.is_last_rank = self.pipe_rank == self.last_rank
        # [Note: tied reduction] in tfsmp/runtime/ties.py: a variable on two local stages is
        # updated once, from its first stage's accumulator, which holds the summed gradient
        self.ties = TiedCopies.of(traced, plan, self.programs, comm.pipeline, self.placement,
                                  tag_ub=comm.tag_ub, watch=_watched)
        self._unique = self.ties.unique()
        self.variables = [v for v, _, _ in self._unique]
        self._tracer = tracer
        self._one_call: OneCallStep | bool | None = None  # False: not applicable
        self.optimizer: Any = None
        self._bridge: OptimizerBridge | None = None
        self._horovod = horovod  # with `horovod: True`, gradients are summed through Horovod
        self._executor: Executor | None = None  # the one that ran the last step
        self._executors: dict[tuple[int, int], Executor] = {}
        self._reducers: dict[tuple[Any, ...], _FusedReducer] = {}
        self._sparse_union: dict[int, set[int]] = {}  # [Note: sparse agreement] in `reduce`
        self._eval_actions: dict[int, list[Action]] = {}
        self._step_shape = StepShape(0, (0,), 0, 0, 0, 0)  # the last training step's
        self._idle_actions: dict[int, list[Action]] = {}
        self.steps = 0
        self.skipped_steps = 0
        self._outputs: ShapeResolver | None = None
        self._layer_losses: bool | None = None  # does any stage of the job add layer losses?
        self._warned_state = False
        self.set_optimizer(optimizer)
        self.broadcast_from_first_replica()
        self.ties.sync()  # copies of tied variables start identical

    def _can_update_directly(self, plan: StagePlan, weighted: set[int]) -> bool:
        """[Note: direct update]: one microbatch, one replica, one unsplit stage per rank, no
        tied copies, no XLA and ``nonfinite='raise'`` (the optimizer is checked when set)."""
        return (self.m == 1 and self.dp_size == 1 and len(self.stages) == 1 and not weighted
                and not any(t.copies > 1 for t in plan.ties) and not self.config.xla
                and self.config.nonfinite == "raise")

    def _can_update_late(self, plan: StagePlan, weighted: set[int]) -> bool:
        """[Note: weights at the step's end] in stage.py: `_can_update_directly`'s conditions
        but for the microbatch count, which is above one."""
        return self.m > 1 and self.dp_size == 1 and len(self.stages) == 1 and not weighted and \
            not any(t.copies > 1 for t in plan.ties) and not self.config.xla and \
            self.config.nonfinite == "raise"

    # -- data ----------------------------------------------------------------------------------

    def _dynamic_inputs(self) -> bool:
        """Whether some input or boundary has a dimension known only at run time: then stage
        programs trace with relaxed shapes, as Keras's own train function does."""
        return self.boundary_shapes is not None or any(
            is_dynamic(self.traced.graph.tensors[k].shape) for k in self.traced.input_keys)

    def output_shapes(self, x: Any) -> list[tuple[int | None, ...]]:
        """The shapes of the model's outputs (batch axis first) for inputs shaped like ``x``
        (tensors, possibly symbolic with unknown dimensions), without running the model."""
        flat = self.traced.flatten_inputs(x)
        shapes = {k: tuple(v.shape) for k, v in zip(self.traced.input_keys, flat)}
        if self._outputs is None:
            self._outputs = ShapeResolver(self.traced, self.traced.output_keys)
        found = self._outputs.shapes(shapes)
        return [found[k] for k in self.traced.output_keys]

    def step_shape(self, rows: int, microbatches: int | None = None) -> StepShape:
        """How a global batch of ``rows`` splits over replicas and microbatches, the same on
        every rank ([Note: one owner of the step])."""
        shares = mbatch.split_sizes(rows, self.dp_size)
        r = self.comm.data.rank
        start = sum(shares[:r])
        nonempty = [s for s in shares if s > 0]
        m = min(microbatches or self.m, min(nonempty)) if nonempty else 0
        return StepShape(rows, tuple(shares), start, start + shares[r], m, m * len(nonempty))

    def check_batch_sizes(self, x: Any, y: Any, sample_weight: Any) -> None:
        """Targets and sample weights have one row per input row (else only the last stage's
        loss would fail, and its peers would wait for it).

        Raises:
            StepError: on every rank alike, before any message.
        """
        b = mbatch.batch_size_of(x)
        for what, value in (("targets", y), ("sample_weight", sample_weight)):
            n = mbatch.batch_size_of(value) if value is not None else b
            if n != b:
                raise StepError(
                    f"{self.rank_tag} Targets and sample weights must have one row per input "
                    f"row. Received: inputs with batch size {b}, {what} with batch size {n}. "
                    f"Pass x, y and sample_weight of the same length.")

    def _microbatches(self, x: Any, y: Any, sample_weight: Any, shape: StepShape, *,
                      scale: float = 1.0, train: bool = True) -> list[MicroBatch]:
        """This replica's microbatches of a global batch, with their constants (a training
        step's carry the loss terms' too; inference's only the rows, `Consts.TERMS` long, so
        one trace serves predict before and after training)."""
        packed = {k: tf.convert_to_tensor(v) for k, v in self.traced.pack_inputs(x).items()}
        self.check_inputs_packed(packed)  # the batch is converted once, then sliced
        mine = (packed, y, sample_weight)
        if shape.my_rows != shape.rows:
            mine = mbatch.take_rows(mine, shape.start, shape.stop)
        out = []
        start = 0
        for size in mbatch.split_sizes(shape.my_rows, shape.microbatches):
            xi, yi, wi = mbatch.take_rows(mine, start, start + size)
            start += size
            consts = (self._objective().constants(rows=shape.rows, rows_mb=size,
                                                  sample_weight=sample_weight, scale=scale,
                                                  parts=shape.parts) if train
                      else np.array([shape.rows, size, scale, 1.0], np.float32))
            out.append(MicroBatch(xi, _to_tensors(yi), _to_tensors(wi), size=size,
                                  consts=tf.constant(consts)))
        return out

    # -- steps ---------------------------------------------------------------------------------

    def train_step(self, x: Any, y: Any, sample_weight: Any = None) -> StepResult:
        """One optimizer step over the global batch ``x`` (every rank passes the same batch)."""
        self.check_batch_sizes(x, y, sample_weight)
        shape = self.step_shape(mbatch.batch_size_of(x))
        if self.objective is not None and not self.objective.prepared:
            self._prepare(x, y, sample_weight, shape)
        one_call = self._one_call_step()
        scale = self._bridge.loss_scale() if self._bridge is not None else 1.0
        if one_call is not None:  # [Note: one-call step] in tfsmp/runtime/fused_step.py
            mb = self._microbatches(x, y, sample_weight, shape, scale=scale)[0]
            self.steps += 1
            result, applied = one_call.run(mb, step_number=self.steps,
                                           nonfinite=self.config.nonfinite, tracer=self._tracer)
            self.skipped_steps += not applied
            result.microbatches = [mb]
            return result
        self.steps += 1
        if shape.microbatches == 0:  # this replica has no rows: it only takes part in the reductions
            return self._idle_step(shape)
        mbs = self._microbatches(x, y, sample_weight, shape, scale=scale)
        ex = self._executor = self._executor_for(self._actions_for(shape.microbatches),
                                                 shape.microbatches)
        self._step_shape = shape
        watch = not self._warned_state and shape.microbatches > 1
        before = self._state_digest() if watch else {}
        self._warned_state |= watch
        # the executor starts every program afresh, even after a step that raised, and calls
        # this engine's `reduce` and `apply` ([Note: one driver] in tfsmp/runtime/hooks.py)
        result = ex.run(mbs, mode=StepMode(train=True), hooks=self)
        if before:
            self._warn_state_updates(before)
        return result

    def _idle_step(self, shape: StepShape) -> StepResult:
        """A replica without rows in this batch: zero gradients through the same reductions
        and the same optimizer step as its peers, in its schedule's order."""
        self._step_shape = shape
        actions = self._idle_actions.get(shape.step_microbatches)
        if actions is None:
            actions = self._idle_actions[shape.step_microbatches] = [
                a for a in self._actions_for(shape.step_microbatches)
                if a.op in (Op.REDUCE, Op.STEP)]
        ex = self._executor = self._executor_for(actions, 0)
        return ex.run([], mode=StepMode(train=True), hooks=self)

    def _actions_for(self, m: int) -> list[Action]:
        """This rank's lowered training actions for a step of ``m`` microbatches."""
        if m not in self._actions:
            self._actions[m] = self._schedules(m).actions[self.pipe_rank]
        return self._actions[m]

    def _prepare(self, x: Any, y: Any, sample_weight: Any, shape: StepShape) -> None:
        """Before the first training step, on every rank alike: measures the layer losses of
        this rank's stages, learns the compiled loss's terms, and refuses what a pipeline cannot
        honour ([Note: one owner of the step])."""
        mine = any([p.measure_layer_losses() for p in self.programs.values()]) or bool(
            self._regularized())
        with _watched("every rank's layer-loss flag (an allgather)"):
            self._layer_losses = any(self.comm.world.allgather_obj(mine))
        rows = min(mbatch.batch_size_of(x), 3)
        head = mbatch.take_rows((x, y, sample_weight), 0, rows)
        y_pred = self._like_outputs(head[0])
        # a later batch may have more parts than this one: decide for the most a step can have
        self._objective().prepare(head[1], head[2], y_pred, parts=self.m * self.dp_size,
                               has_layer_losses=self._layer_losses,
                               scaled=self._bridge is not None and self._bridge.scaled,
                               rank_tag=self.rank_tag)

    def _like_outputs(self, x: Any) -> Any:
        """Random tensors shaped like the model's outputs for inputs ``x``, carrying a mask
        where the model's output carries one (what a loss's kind depends on)."""
        shapes = self.output_shapes(tree.map_structure(tf.convert_to_tensor, x))
        rng = np.random.default_rng(0)
        outs = []
        tensors = self.traced.graph.tensors
        for key, shp, mask_key in zip(self.traced.output_keys, shapes,
                                      self.traced.output_mask_keys):
            dtype = tf.as_dtype(tensors[key].dtype)
            value = tf.constant(rng.normal(size=[int(d or 1) for d in shp]).astype(np.float32))
            value = tf.cast(value if dtype.is_floating else tf.abs(value), dtype)
            if mask_key is not None:  # a mask the stage will really produce (graph/masks.py)
                dims = [shp[0], *(shp[i + 1] if d is None else d
                                  for i, d in enumerate(tensors[mask_key].shape))]
                set_keras_mask(value, tf.ones([int(d or 1) for d in dims], tf.bool))
            outs.append(value)
        return self.traced.pack_outputs(outs)

    def _one_call_step(self) -> OneCallStep | None:
        """The step as one compiled call where nothing needs scheduling: one pipeline rank,
        one stage, one microbatch, one replica, no tied copies, no loss scaling, no XLA, no
        split (zero-bubble) stage, and no layer losses ([Note: one-call step] in
        tfsmp/runtime/fused_step.py)."""
        if self._one_call is None:
            prog = self.programs.get(0)
            fits = (self.num_ranks == 1 and self.plan.num_stages == 1 and self.m == 1
                    and self.dp_size == 1 and not self.ties.count and not self.config.xla
                    and self.optimizer is not None and self._bridge is not None
                    and self._bridge.plain and not self._layer_losses
                    and self.objective is not None and self.objective.prepared)
            self._one_call = False
            if fits and prog is not None and not prog.split:
                self._one_call = OneCallStep(
                    prog, self.variables, [i for _, _, i in self._unique], self.optimizer,
                    self.objective, rank_tag=self.rank_tag, relax_shapes=self._dynamic_inputs())
        return self._one_call if isinstance(self._one_call, OneCallStep) else None

    def _executor_for(self, actions: list[Action], m: int) -> Executor:
        """The executor of one schedule, kept from step to step so that its receive buffers are
        reused ([Note: receive buffers] in tfsmp/runtime/executor.py)."""
        ex = self._executors.get((id(actions), m))
        if ex is None:
            ex = self._executors[(id(actions), m)] = Executor(
                actions, self.programs, self.plan, self.comm.pipeline, self.num_ranks, m,
                placement=self.placement,
                rank_tag=self.rank_tag, shapes=self.boundary_shapes)
        # read each step, as a new executor did: the limit and the tracer may change between steps
        ex.stall_timeout, ex.tracer = self.config.stall_timeout, self._tracer
        return ex

    def _state_digest(self) -> dict[str, float]:
        """A checksum of every non-trainable variable a layer may update in call() (moving
        statistics, documented apart, and random seed states excluded)."""
        return {f"{c.layer_name}": float(tf.reduce_sum(tf.abs(tf.cast(v, tf.float64))))
                for p in self.programs.values() for c in p.calls
                for v in getattr(c.layer, "non_trainable_variables", [])
                if "seed_generator" not in v.path and "moving_" not in v.path}

    def _warn_state_updates(self, before: dict[str, float]) -> None:
        """Warns once when a layer changed its own state during a step of several
        microbatches: it did so once per microbatch, where plain Keras does it once per batch
        (BatchNormalization's moving statistics are documented in docs/keras_semantics.md)."""
        after = self._state_digest()
        changed = sorted({name for name, value in before.items() if after.get(name) != value})
        if changed:
            warnings.warn(
                f"{self.rank_tag} Layers {changed} updated their own state in call(); with "
                f"several microbatches they do so once per microbatch, where plain Keras does "
                f"once per batch (as BatchNormalization, docs/keras_semantics.md).",
                stacklevel=4)

    def run_step(self, inputs: list[dict[str, Any]], head: Head, train: bool = True
                 ) -> StepResult:
        """One `smp.step` call: ``inputs[i]`` are microbatch i's model inputs (by tensor key).
        The last stage runs ``head``; other stages keep per-microbatch weight gradients
        ([Note: collect mode] in tfsmp/runtime/stage.py; no reduction, no optimizer step: the
        script applies them)."""
        if train:
            self.ties.check_collect(self.rank_tag)
        mbs = []
        for packed in inputs:
            tensors = {k: tf.convert_to_tensor(v) for k, v in packed.items()}
            self.check_inputs_packed(tensors)
            size = int(next(iter(tensors.values())).shape[0]) if tensors else 0
            consts = tf.constant([size, size, 1.0, 1.0], tf.float32)
            mbs.append(MicroBatch(tensors, size=size, consts=consts))
        m = len(mbs)
        actions = self._train_actions if train else self._forward_actions(m)
        ex = self._executor = self._executor_for(actions, m)
        self.steps += 1
        return ex.run(mbs, mode=StepMode(train=train, collect=True), head=head)

    def collected(self, result: StepResult, stage: int) -> dict[int, list[tf.Tensor]]:
        """``result``'s weight gradients of ``stage`` by microbatch ([Note: collect mode] in
        tfsmp/runtime/stage.py); empty for a stage that fused them into its head."""
        found = result.stages.get(stage)
        return dict(found.grads.collected) if found is not None else {}

    @functools.cached_property
    def view(self) -> RankView:
        """This rank's read-only view of the partitioned model (tfsmp/runtime/view.py)."""
        return RankView.build(self.traced, self.plan, self.comm, self.config, self.placement)

    def set_objective(self, compile_loss: Any) -> None:
        """Trains with ``compile_loss`` from now on (a model compiled again after partitioning)."""
        self.objective = Objective(compile_loss) if compile_loss is not None else None
        for prog in self.programs.values():
            prog.set_objective(self.objective)
        self._one_call = None

    def set_optimizer(self, optimizer: Any) -> None:
        """Steps with ``optimizer`` from now on (a model compiled again after partitioning)."""
        self.optimizer = optimizer
        self._one_call = None
        self._bridge = None
        if optimizer is None:
            self._set_updates(False)
            return
        if not optimizer.built:
            optimizer.build(self.variables)
        self._bridge = OptimizerBridge(optimizer, self.variables, self._counted_here(),
                                       self.comm.pipeline, xla=bool(self.config.xla),
                                       rank_tag=self.rank_tag)
        # [Note: direct update]: an optimizer with nothing beyond Keras's own apply that
        # updates variable by variable; otherwise the stages accumulate
        self._set_updates(self._direct_possible and self._bridge.plain
                          and DirectUpdate.possible(optimizer))

    def _set_updates(self, direct: bool) -> None:
        """Stages update inside their backward, or accumulate ([Note: direct update])."""
        if self._direct_possible:
            for prog in self.programs.values():
                prog.set_update(DirectUpdate(self.optimizer) if direct else None)
        self._direct = direct
        late = (self._late_possible and self._bridge is not None and self._bridge.plain
                and DirectUpdate.possible_late(self.optimizer))
        if self._late_possible:
            for prog in self.programs.values():
                prog.set_late(late, self.m)
        self._late = late
        self._late_update = DirectUpdate(self.optimizer) if late else None

    def _counted_here(self) -> list[bool]:
        """Per variable of this rank: whether its pipeline rank is the one that counts it once
        in sums over the pipeline (a tied variable is held by several ranks)."""
        view = self.view
        return [view.placement.rank(view.key_stage[view.keys[id(v)]]) == self.pipe_rank
                for v in self.variables]

    def _regularized(self) -> list[Any]:
        return [v for v in self.variables if getattr(v, "regularizer", None) is not None]

    def check_inputs_packed(self, packed: dict[str, Any]) -> None:
        """Every input's per-sample shape must match the traced model's, before any message.

        Args:
            packed: the inputs keyed by tensor key (`TracedModel.pack_inputs`).

        Raises:
            StepError: naming the input, on every rank alike (all ranks see the same batch).
        """
        for key, value in packed.items():
            want = self.traced.graph.tensors[key].shape
            got = tuple(np.shape(value))[1:]
            if len(got) != len(want) or any(w is not None and w != g for w, g in zip(want, got)):
                raise StepError(
                    f"{self.rank_tag} Every batch must have the per-sample shape the model was "
                    f"traced with. Received: input '{key.split(':')[0]}' with shape {got}, "
                    f"expected {tuple(want)}. Pad or crop batches to one shape (shapes may not "
                    f"change between batches of a pipelined model).")

    def _forward_actions(self, m: int) -> list[Action]:
        if m not in self._eval_actions:
            self._eval_actions[m] = forward_only(self.plan, self.placement, self.pipe_rank, m)
        return self._eval_actions[m]

    def forward(self, x: Any, shape: StepShape | None = None) -> tuple[StepShape, StepResult]:
        """Pipelined inference of this replica's rows of the global batch ``x``; outputs land on
        the last stage's rank, with their Keras masks."""
        shape = shape or self.step_shape(mbatch.batch_size_of(x))
        if shape.microbatches == 0:
            return shape, StepResult()
        mbs = self._microbatches(x, None, None, shape, train=False)
        m = len(mbs)
        result = self._executor_for(self._forward_actions(m), m).run(
            mbs, mode=StepMode(train=False))
        result.microbatches = mbs
        return shape, result

    def evaluate(self, x: Any, y: Any, sample_weight: Any = None) -> StepResult:
        """The loss of the global batch as Keras's ``test_step`` computes it, on every rank,
        and the model outputs of this replica's rows on the last stage's rank."""
        self.check_batch_sizes(x, y, sample_weight)
        shape = self.step_shape(mbatch.batch_size_of(x))
        objective = self._objective()
        if not objective.prepared:
            self._prepare(x, y, sample_weight, shape)
        _, result = self.forward(x, shape)
        partial = np.zeros(2 * len(objective.terms))
        if self.is_last_rank and result.outputs:
            ys = mbatch.take_rows((y, sample_weight), shape.start, shape.stop)
            records = []
            start = 0
            for i, mb in enumerate(result.microbatches):
                yi, wi = mbatch.take_rows(ys, start, start + mb.size)
                start += mb.size
                pred = self.traced.pack_outputs(result.outputs[i])
                rec = objective.call(_to_tensors(yi), pred, _to_tensors(wi))
                records.append((np.asarray([float(n) for n in rec.numerators]),
                                np.asarray([float(d) for d in rec.normalizers]), mb.size))
                mb.y, mb.sample_weight = _to_tensors(yi), _to_tensors(wi)
            partial = objective.partial(records, shape.rows)
        layer = float(sum(float(v) for v in result.layer_losses.values()))
        reg = self._regularization_value()
        with _watched("every rank's evaluation losses (an allgather)"):
            report = self.comm.world.allgather_obj((partial, layer, reg))
        summed = np.sum([r[0] for r in report], axis=0) if len(partial) else partial
        result.term_values = objective.values(summed)
        result.loss = (objective.total(result.term_values)
                       + sum(r[1] for r in report) + sum(r[2] for r in report))
        return result

    def _objective(self) -> Objective:
        if self.objective is None:
            raise StepError(
                f"{self.rank_tag} Training and evaluating need a compiled loss. Received: a "
                f"model compiled without one. Call model.compile(optimizer=..., loss=...).")
        return self.objective

    def _regularization_value(self) -> float:
        """The weight regularizers' value of the variables this rank writes (each counted once
        in the job), for the loss Keras reports."""
        if not self._layer_losses:
            return 0.0
        mine = [v for v, counted in zip(self.variables, self._counted_here())
                if counted and self.comm.data.rank == 0 and getattr(v, "regularizer", None)]
        return float(ll.regularization(mine)) if mine else 0.0

    # -- reduction and optimizer ---------------------------------------------------------------

    def _allreduce_sum(self, variables: list[Any], what: str, wide: bool = False,
                       scale: float = 1.0) -> None:
        """Sums ``variables`` over this stage's replicas through one fused MPI buffer (``wide``:
        in float64), times ``scale``, and assigns the result back.

        [Note: fused reduction] One compiled function flattens every variable into one tensor,
        whose memory MPI reads in place (a copy into a persistent 64-byte-aligned buffer, then
        ``Allreduce`` in place), and a second compiled function splits the reduced buffer
        (aliased through DLPack, `executor.as_tensor`), scales, casts and assigns it back: two
        TensorFlow calls per reduction instead of a conversion per variable (2-4x faster,
        docs/performance.md).
        """
        key = (tuple(id(v) for v in variables), wide)
        reducer = self._reducers.get(key)
        if reducer is None:
            reducer = self._reducers[key] = _FusedReducer(variables, wide)
        flat = reducer.gather()
        with _watched(what):
            self.comm.data.allreduce_(flat)
        reducer.scatter(flat, scale)

    def broadcast_from_first_replica(self) -> None:
        """Gives every replica of each stage data rank 0's floating variables, so that replicas
        start alike even when no ``seed`` fixed the initializers (each process draws its own)."""
        if self.dp_size == 1:
            return
        stage_vars = [v for s in self.stages for v in (*self.programs[s].trainable,
                                                        *self.programs[s].non_trainable)]
        floats = [v for v in stage_vars if np.dtype(tf.as_dtype(v.dtype).as_numpy_dtype).kind == "f"]
        if not floats:
            return
        reducer = _FusedReducer(floats, wide=True)
        flat = reducer.gather()
        if self.comm.data.rank != 0:
            flat[:] = 0.0  # a sum with zeros from the others is data rank 0's values, exactly
        with _watched("the broadcast of the first replica's initial weights"):
            self.comm.data.allreduce_(flat)
        reducer.scatter(flat, 1.0)

    def data_mean(self, tensors: list[Any]) -> list[tf.Tensor]:
        """The mean of each tensor over this stage's data-parallel replicas (one fused MPI
        allreduce; every replica calls it with tensors of the same shapes and dtypes)."""
        if self.dp_size == 1 or not tensors:
            return [tf.convert_to_tensor(t) for t in tensors]
        values = [np.asarray(tf.convert_to_tensor(t)) for t in tensors]
        dtype = np.result_type(*values)
        dtype = dtype if dtype.kind == "f" else np.dtype(np.float32)
        flat = np.concatenate([v.astype(dtype).ravel() for v in values])
        with _watched("the data-parallel mean of a step's gradients"):
            self.comm.data.allreduce_(flat)
        flat /= self.dp_size
        out, start = [], 0
        for v in values:
            part = flat[start:start + v.size].reshape(v.shape)
            out.append(tf.convert_to_tensor(part.astype(v.dtype)))
            start += v.size
        return out

    def _sync_statistics(self, stage: int) -> None:
        """Averages the stage's floating non-trainable variables (BatchNormalization moving
        statistics) over its replicas, so every replica keeps the same copy (each updated them
        from its own share of the batch)."""
        stats = [v for v in self.programs[stage].non_trainable
                 if np.dtype(v.dtype).kind == "f"]
        if not stats:
            return
        self._allreduce_sum(stats, f"the data-parallel average of stage {stage}'s statistics",
                            wide=True, scale=1.0 / self.dp_size)

    # -- StepHooks ([Note: one driver] in tfsmp/runtime/hooks.py) ------------------------------

    def reduce(self, stage: int, result: StageResult) -> None:
        """REDUCE: sums ``stage``'s gradients over its data-parallel replicas (sparse ones
        combined as the whole batch's, [Note: sparse structure] in gradients.py)."""
        prog = self.programs[stage]
        grads = result.grads
        if self.dp_size > 1:
            self._sync_statistics(stage)
        if self.dp_size == 1 or not prog.trainable:
            return
        # [Note: sparse agreement] A variable is sparse on every replica or on none (one
        # graph), except on a replica without rows in the batch, which has no parts. The first
        # step's reduction therefore agrees on the set in one allgather; later steps gather
        # sparse parts only for stages that have some, and reduce the rest densely at once.
        known = self._sparse_union.get(stage)
        sparse = set(grads.sparse_indices()) | (known or set())
        if known is None or known:
            with _watched(f"the sparse gradients of stage {stage} (an allgather)"):
                gathered = self.comm.data.allgather_obj(grads.host_sparse())
            sparse |= {i for g in gathered for i in g}
            self._sparse_union[stage] = set(sparse)
            if sparse:
                grads.combine_replicas(
                    [{i: (tf.constant(v), tf.constant(x)) for i, (v, x) in g.items()}
                     for g in gathered if g])
        accs = [a for i, a in enumerate(grads.accumulators) if i not in sparse]
        if self._horovod is not None:
            summed = self._horovod.grouped_allreduce([a.value() for a in accs],
                                                     name=f"tfsmp_grads_stage{stage}")
            for a, s in zip(accs, summed):
                a.assign(s)
            return
        if accs:
            self._allreduce_sum(accs, f"the data-parallel allreduce of stage {stage}'s gradients")

    def _report(self, result: StepResult) -> tuple[bool, list[Any]]:
        """This rank's finiteness and loss parts, and every rank's, in one allgather ([Note:
        consistent skips]): an update is applied or skipped everywhere alike, and every rank
        learns the step's loss."""
        stages = result.stages.values()
        ok = all(r.finite for r in stages)
        first = {r.stage: r.first_nonfinite for r in stages if r.first_nonfinite is not None}
        partial = np.zeros(0)
        bad_mb: list[int] = []
        if self.objective is not None and self.objective.prepared and result.records:
            shape = self._step_shape
            records = []
            for i in sorted(result.records):
                n, d, _ = result.records[i]
                n, d = np.asarray(n), np.asarray(d)
                if not (np.isfinite(n).all() and np.isfinite(d).all()):
                    bad_mb.append(i)
                records.append((n, d, result.microbatches[i].size))
            partial = self.objective.partial(records, shape.rows)
        layer = float(sum(float(v) for r in stages for v in r.grads.losses.values()))
        reg = self._regularization_value()
        with _watched("every rank's finite-gradient flag and loss parts (an allgather)"):
            report = self.comm.world.allgather_obj((ok, first, bad_mb, partial, layer, reg))
        return all(r[0] for r in report) and not any(r[2] for r in report), report

    def _losses(self, result: StepResult, report: list[Any]) -> float:
        """Fills ``result.loss`` and ``result.term_values`` from every rank's parts; returns
        the factor the gradients are multiplied by ([Note: loss numerators] in objective.py)."""
        if self.objective is None or not self.objective.prepared:
            return 1.0
        parts = [r[3] for r in report if len(r[3])]
        summed = np.sum(parts, axis=0) if parts else np.zeros(2 * len(self.objective.terms))
        result.term_values = self.objective.values(summed)
        result.loss = (self.objective.total(result.term_values) + sum(r[4] for r in report)
                       + sum(r[5] for r in report))
        return self.objective.deferred_factor(summed, self._step_shape.parts)

    def apply(self, result: StepResult) -> None:
        """STEP: applies the optimizer to this rank's variables, or skips the update on every
        rank alike when some gradient or loss is not finite."""
        finite, report = self._report(result)
        factor = self._losses(result, report)
        if not finite:
            self._nonfinite(report)
            return
        if self._direct:
            return  # each variable was updated in its stage's backward ([Note: direct update])
        if self._late and all(p.late for p in self.programs.values()):
            self._apply_late(factor)  # [Note: weights at the step's end] in stage.py
            return
        self.ties.reduce()  # sum tied copies' gradients over their stages, before the step
        if not self.variables or self._bridge is None:
            return
        sparse: dict[str, tuple[tf.Tensor, tf.Tensor]] = {}
        for j, (_, s, i) in enumerate(self._unique):
            found = self.programs[s].grads.sparse.get(i)
            if found is not None:
                sparse[str(j)] = found
        accs = [self.programs[s].grads.accumulators[i] for _, s, i in self._unique]
        self._bridge.apply(accs, sparse, factor)

    def _apply_late(self, factor: float) -> None:
        update = self._late_update or DirectUpdate(self.optimizer)
        if not all(p.apply_late(update, factor) for p in self.programs.values()):
            raise StepError(
                f"{self.rank_tag} Non-finite weight gradients at step {self.steps} on this "
                f"rank; they are computed during the update ([Note: weights at the step's end]), "
                f"so variables with finite gradients were updated. Lower the learning rate, "
                f"check the data, or set nonfinite='skip' to skip such updates on every rank.")

    def _nonfinite(self, report: list[Any]) -> None:
        """[Note: consistent skips] Skips the update on every rank, or raises on every rank."""
        self.skipped_steps += 1  # the next step starts from fresh accumulators
        if (self._bridge is not None and self._bridge.on_nonfinite()) or \
                self.config.nonfinite == "skip":
            return
        grads = {s: i for r in report for s, i in r[1].items()}
        mbs = sorted({i for r in report for i in r[2]})
        where = ", ".join(f"stage {s} from microbatch {i}" for s, i in sorted(grads.items()))
        raise StepError(
            f"{self.rank_tag} Non-finite values at step {self.steps}: loss of microbatch(es) "
            f"{mbs or 'none'} on the last stage; gradients of {where or 'no stage'}. "
            f"{_DIRECT_NOTE if self._direct else ''}"
            f"Lower the learning rate, check the data, or set nonfinite='skip' to skip such "
            f"updates on every rank.")

    def finalize(self) -> None:
        """What Keras does at the end of ``fit``: the optimizer's final variable values (its
        exponential moving averages, with ``use_ema``) on every rank's own variables."""
        if self.optimizer is not None and self.variables:
            self.optimizer.finalize_variable_values(self.variables)


class _FusedReducer:
    """Flattens a fixed list of variables into one buffer and back ([Note: fused reduction])."""

    def __init__(self, variables: list[Any], wide: bool) -> None:
        self.variables = variables
        kinds = {np.dtype(tf.as_dtype(v.dtype).as_numpy_dtype) for v in variables}
        common = np.dtype(np.float64) if wide else np.result_type(*kinds)
        if common.kind != "f":  # bfloat16 (ml_dtypes): MPI has no sum for it
            common = np.dtype(np.float32)
        self.dtype = tf.as_dtype(common)
        self.sizes = [int(np.prod(v.shape)) for v in variables]
        self.buffer: np.ndarray | None = None
        dtype, sizes = self.dtype, self.sizes

        def gather() -> tf.Tensor:
            return tf.concat([tf.reshape(tf.cast(v, dtype), [-1]) for v in variables], 0)

        def scatter(flat: tf.Tensor, scale: tf.Tensor) -> None:
            flat = flat * tf.cast(scale, dtype)
            for v, part in zip(variables, tf.split(flat, sizes)):
                v.assign(tf.cast(tf.reshape(part, v.shape), v.dtype))

        self._gather = tf.function(gather)
        self._scatter = tf.function(scatter)

    def gather(self) -> np.ndarray:
        """The variables' values, concatenated, in a writable aligned buffer."""
        flat = self._gather()
        buf = self.buffer
        if buf is None or held(buf):
            buf = self.buffer = aligned_empty((sum(self.sizes),),
                                              np.dtype(self.dtype.as_numpy_dtype))
        np.copyto(buf, host_view(flat))
        return buf

    def scatter(self, flat: np.ndarray, scale: float) -> None:
        """Assigns ``flat * scale`` back to the variables."""
        self._scatter(as_tensor(flat), tf.constant(scale, tf.float64))


_DIRECT_NOTE = ("With one microbatch each stage updates its variables during its backward "
                "pass ([Note: direct update]), so variables with finite gradients were updated. ")


def _watched(what: str) -> Any:
    """A blocking collective the watchdog times (tfsmp.runtime.watchdog, [Note: blocking calls])."""
    dog = wd.for_process()
    return dog.blocking(what) if dog is not None else contextlib.nullcontext()


def _to_tensors(structure: Any) -> Any:
    if structure is None:
        return None
    return tree.map_structure(tf.convert_to_tensor, structure)

