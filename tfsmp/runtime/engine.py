"""The pipeline engine of one rank: sequences batching, the schedule, reduction, the report and the optimizer step.

Example::

    engine = Engine(traced, plan, schedules, config=config, comm=comm, rank_tag="[rank 0]",
                    objective=objective, optimizer=opt)   # usually built by runtime.setup
    result = engine.train_step(x, y, sample_weight)       # one optimizer step over the global batch
    result.loss, result.term_values                       # what Keras reports for that batch
    result = engine.evaluate(x, y, sample_weight)         # loss and outputs, no update

Roughly, for a training step on rank r (stages S_r = placement.stages(r)):
    `Batching`: the global batch's rows -> this replica's rows -> m' microbatches of any sizes,
        each with its constants (`objective.Consts`)
    -> `Executors`: the executor runs the lowered schedule (F/B/W/sends/receives) and calls this
        engine as its `StepHooks` ([Note: one driver] in hooks.py):
    -> reduce(s, result): `Reduction` sums stage s's gradients over its data-parallel replicas
    -> apply(result): `StepReport` (every rank's finiteness, loss parts and normalizers in one
        allgather; the loss), the tied copies' sum, optimizer.apply_gradients(gradients of S_r)
Every gradient is read from the step's result ([Note: results own their gradients] in
gradients.py), never from a program.

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
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import tensorflow as tf

from tfsmp import failure
from tfsmp.comm.horovod import HorovodReducer
from tfsmp.errors import StepError
from tfsmp.partitioning.plan import StagePlan
from tfsmp.runtime import layer_losses as ll
from tfsmp.runtime import microbatch as mbatch
from tfsmp.runtime import watchdog as wd
from tfsmp.runtime.batching import Batching, StepShape
from tfsmp.runtime.dynamic_shapes import BoundaryShapes, is_dynamic
from tfsmp.runtime.executor import Executor, StepResult
from tfsmp.runtime.executors import Executors
from tfsmp.runtime.fused_step import OneCallStep
from tfsmp.runtime.hooks import Head, StageResult, StepMode
from tfsmp.runtime.objective import Objective
from tfsmp.runtime.optimizer_options import OptimizerBridge
from tfsmp.runtime.reduction import Reduction
from tfsmp.runtime.reduction import _FusedReducer as _FusedReducer  # where tests look for it
from tfsmp.runtime.report import RankReport, StateWatch, StepReport, loss_records
from tfsmp.runtime.stage import StageProgram
from tfsmp.runtime.ties import TiedCopies
from tfsmp.runtime.updates import Updates
from tfsmp.runtime.view import RankView
from tfsmp.schedule.lowering import Lowered
from tfsmp.schedule.placement import Placement
from tfsmp.schedule.run_plan import RunPlan

if TYPE_CHECKING:
    from tfsmp.comm.base import Comm
    from tfsmp.config import Config
    from tfsmp.graph.tracer import TracedModel
    from tfsmp.timeline.events import Tracer

__all__ = ["Engine", "StepShape"]


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
        xla: bool = False,
    ) -> None:
        self.traced = traced
        self.plan = plan
        # the process's own config, never a copy: what a script changes on it between steps
        # (stall_timeout, as tests/mpi/scripts/fault_*.py do) reaches the next step
        self.config = config
        self._xla = xla  # [Note: jit_compile is xla] in tfsmp/keras/model.py
        self.comm = comm
        self.rank_tag = rank_tag
        # [Note: one description of the run] in tfsmp/schedule/run_plan.py: the schedule run,
        # its split stages, and whether stages may update inside their backward
        self.run = RunPlan.for_config(config, data_parallel=comm.data.size,
                                      tied=any(t.copies > 1 for t in plan.ties),
                                      drain=plan.drain_split)
        self.objective = objective
        self.custom_loss: Any = None  # [Note: a model's own compute_loss]: set_custom_loss
        shapes = BoundaryShapes.for_plan(traced, plan)  # [Note: dynamic boundaries]
        relax = _dynamic_inputs(traced, shapes)
        # stages that may update in their backward, or take linear layers' gradients at the
        # step's end ([Note: weights at the step's end] in stage.py), make no accumulators
        direct_possible = (self.run.direct_possible(comm.pipeline.rank)
                           or self.run.late_possible(comm.pipeline.rank))
        self.programs = {
            s: StageProgram(traced, plan, s, optimize=config.optimize, objective=objective,
                            jit_compile=xla, relax_shapes=relax,
                            split=s in self.run.split_stages, accumulate=not direct_possible)
            for s in self.stages}
        # [Note: tied reduction] in tfsmp/runtime/ties.py: a variable on two local stages is
        # updated once, from its first stage's accumulator, which holds the summed gradient
        self.ties = TiedCopies.of(traced, plan, self.programs, comm.pipeline, self.placement,
                                  tag_ub=comm.tag_ub, watch=_watched)
        # [Note: optimizer shards] in tfsmp/partitioning/shards.py (shard_optimizer_state)
        owned = (None if self.view.owned is None
                 else {id(v) for v in self.view.optimizer_variables})
        self.updates = Updates(self.programs, self.ties, self.run, pipe_rank=comm.pipeline.rank,
                               group=comm.pipeline, xla=xla, rank_tag=rank_tag,
                               counted=self._counted_here, owned=owned, exchange_group=comm.data,
                               clip_group=comm.world, watch=_watched,
                               everywhere=lambda: list(traced.model.trainable_variables))
        # [Note: what a rank converts] in batching.py
        self.batching = Batching(traced, data_rank=comm.data.rank, data_size=comm.data.size,
                                 microbatches=config.microbatches, rank_tag=rank_tag,
                                 reads={k for p in self.programs.values() for k in p.input_keys},
                                 labels=any(p.is_last for p in self.programs.values()))
        self.reduction = Reduction(comm.data, horovod=horovod, watch=_watched)
        self.executors = Executors(schedules, self.programs, plan, comm.pipeline, self.placement,
                                   num_ranks=config.partitions, rank_tag=rank_tag,
                                   shapes=shapes, drain=self.run.drain)
        self._tracer = tracer
        self._one_call: OneCallStep | bool | None = None  # False: not applicable
        self._shape = StepShape(0, (0,), 0, 0, 0, 0)  # the last training step's
        self.steps = 0
        self.skipped_steps = 0
        # the config's, or "apply" (as Keras: update whatever the gradients) while a fit has
        # Keras's TerminateOnNaN (tfsmp/keras/model.py `nonfinite_mode`)
        self.nonfinite: str = config.nonfinite
        self._layer_losses: bool | None = None  # does any stage of the job add layer losses?
        self._state = StateWatch(self.programs, rank_tag)
        self.set_optimizer(optimizer)
        self.reduction.broadcast_first([v for p in self.programs.values()
                                        for v in (*p.trainable, *p.non_trainable)])
        self.ties.sync()  # copies of tied variables start identical

    def compiles_with_xla(self) -> bool:
        """Whether the stage programs compile with XLA ([Note: jit_compile is xla] in
        tfsmp/keras/model.py)."""
        return self._xla

    def rebuilt(self, objective: Objective | None, optimizer: Any, xla: bool) -> Engine:
        """A new engine over the same traced model, plan and schedules, whose stage programs
        read the variables' trainable flags anew ([Note: changing the model] in
        tfsmp/keras/model.py); ``xla``: whether the new stage programs compile with XLA.
        Every rank calls it."""
        return Engine(self.traced, self.plan, self.executors.schedules, config=self.config,
                      comm=self.comm, rank_tag=self.rank_tag, objective=objective,
                      optimizer=optimizer, tracer=self._tracer, horovod=self.reduction.horovod,
                      xla=xla)

    # -- what the rank holds -------------------------------------------------------------------

    @property
    def placement(self) -> Placement:
        """stage -> pipeline rank: the one the schedules were lowered for."""
        return self.run.placement

    @property
    def stages(self) -> list[int]:
        return self.placement.stages(self.comm.pipeline.rank)

    @property
    def variables(self) -> list[Any]:
        """This rank's trainable variables, each once (what the optimizer updates)."""
        return self.updates.variables

    @property
    def optimizer(self) -> Any:
        return self.updates.optimizer

    @property
    def _bridge(self) -> OptimizerBridge | None:  # tests/mpi/scripts/soak_cases.py reads it
        return self.updates.bridge

    @property
    def is_last_rank(self) -> bool:
        return self.comm.pipeline.rank == self.placement.last_rank

    @property
    def _executor(self) -> Executor | None:
        """The executor of the last training step (tests read it)."""
        return self.executors.last

    @property
    def _executors(self) -> dict[tuple[int, int], Executor]:
        return self.executors.cache

    @functools.cached_property
    def view(self) -> RankView:
        """This rank's read-only view of the partitioned model (tfsmp/runtime/view.py)."""
        return RankView.build(self.traced, self.plan, self.comm, self.config, self.placement)

    def output_shapes(self, x: Any) -> list[tuple[int | None, ...]]:
        """The shapes of the model's outputs (batch axis first) for inputs shaped like ``x``."""
        return self.batching.output_shapes(x)

    def step_shape(self, rows: int, microbatches: int | None = None) -> StepShape:
        return self.batching.step_shape(rows, microbatches)

    def check_inputs_packed(self, packed: dict[str, Any]) -> None:
        self.batching.check_inputs_packed(packed)

    # -- steps ---------------------------------------------------------------------------------

    def train_step(self, x: Any, y: Any, sample_weight: Any = None) -> StepResult:
        """One optimizer step over the global batch ``x`` (every rank passes the same batch)."""
        self.batching.check_batch_sizes(x, y, sample_weight)
        shape = self.batching.step_shape(mbatch.batch_size_of(x))
        if self.objective is not None and not self.objective.prepared:
            self._prepare(x, y, sample_weight)
        scale = self.updates.bridge.loss_scale() if self.updates.bridge is not None else 1.0
        self.steps += 1
        self._shape = shape
        one_call = self._one_call_step()
        if one_call is not None:  # [Note: one-call step] in tfsmp/runtime/fused_step.py
            mb = self.batching.microbatches(x, y, sample_weight, shape,
                                            objective=self._objective(), scale=scale)[0]
            result, applied = one_call.run(mb, step_number=self.steps,
                                           nonfinite=self.nonfinite, tracer=self._tracer)
            self.skipped_steps += not applied
            result.microbatches = [mb]
            return result
        if min(shape.replica_rows) == 0:
            self.updates.settle_late_without_rows()
        self._configure_executors()
        if shape.microbatches == 0:  # this replica has no rows: it only takes part in the reductions
            self.batching.check_inputs(x)  # but refuses a bad batch as the others do
            return self.executors.idle(shape.step_microbatches).run(
                [], mode=StepMode(train=True), hooks=self)
        mbs = self.batching.microbatches(x, y, sample_weight, shape,
                                         objective=self._objective(), scale=scale)
        ex = self.executors.training(shape.microbatches)
        # the executor starts every program afresh, even after a step that raised, and calls
        # this engine's `reduce` and `apply` ([Note: one driver] in tfsmp/runtime/hooks.py)
        with self._state.watching(shape.microbatches > 1):
            return ex.run(mbs, mode=StepMode(train=True), hooks=self)

    def run_step(self, inputs: list[dict[str, Any]], head: Head, train: bool = True
                 ) -> StepResult:
        """One `smp.step` call: ``inputs[i]`` are microbatch i's model inputs (by tensor key).
        The last stage runs ``head``; other stages keep per-microbatch weight gradients
        ([Note: collect mode] in tfsmp/runtime/stage.py; no reduction, no optimizer step: the
        script applies them, `step_gradients` hands them over)."""
        if train:
            self.ties.check_collect(self.rank_tag)
            self._check_unsharded()
        mbs = self.batching.given_microbatches(inputs)
        self._configure_executors()
        m = len(mbs)
        ex = self.executors.training(self.config.microbatches) if train else \
            self.executors.forward(m)
        self.steps += 1
        return ex.run(mbs, mode=StepMode(train=train, collect=True), head=head)

    def _check_unsharded(self) -> None:
        """An `smp.step` script applies its own optimizer to every variable of the rank, which
        sharded optimizer state cannot split ([Note: optimizer shards])."""
        if self.view.owned is not None:
            raise StepError(
                f"{self.rank_tag} shard_optimizer_state shards the optimizer of compile() and "
                f"fit()/train_on_batch(); an smp.step script applies its own optimizer to all "
                f"of a rank's variables. Received: shard_optimizer_state=True with "
                f"{self.comm.data.size} replicas and a training smp.step. Fix: set "
                f"shard_optimizer_state=False, or train with model.fit.")

    def step_gradients(self, result: StepResult, body: Mapping[int, Sequence[Any]]
                       ) -> list[list[tf.Tensor]]:
        """Per microbatch of an `smp.step` ``result``, this rank's weight gradients in
        `model.trainable_variables` order (its stages', ascending), averaged over the data-
        parallel replicas unless Horovod reduces them (the script does, as SMP required).

        ``body[i]``: the gradient list microbatch i's step body returned on the last stage's
        rank (one per variable of this rank; only the last stage's are read: the other
        stages' come from their collected gradients)."""
        m = len(result.microbatches)
        out: list[list[tf.Tensor]] = []
        for i in range(m):
            grads: list[Any] = []
            for s in sorted(self.programs):
                trainable = self.programs[s].trainable
                if self.programs[s].is_last:
                    flat = list(body[i])
                    mine = (flat[len(grads):len(grads) + len(trainable)]
                            if len(flat) >= len(grads) + len(trainable) else flat[-len(trainable):])
                    grads += [g if g is not None else tf.zeros_like(v.value)
                              for g, v in zip(mine, trainable)]
                else:
                    grads += self.collected(result, s).get(
                        i, [tf.zeros_like(v.value) for v in trainable])
            out.append(grads)
        if self.comm.data.size == 1 or self.reduction.horovod is not None or not out:
            return out
        n = len(out[0])
        reduced = self.data_mean([g for per_mb in out for g in per_mb])
        return [reduced[i * n:(i + 1) * n] for i in range(m)]

    def collected(self, result: StepResult, stage: int) -> dict[int, list[tf.Tensor]]:
        """``result``'s weight gradients of ``stage`` by microbatch ([Note: collect mode] in
        tfsmp/runtime/stage.py); empty for a stage that fused them into its head."""
        found = result.stages.get(stage)
        return dict(found.grads.collected) if found is not None else {}

    def data_mean(self, tensors: list[Any]) -> list[tf.Tensor]:
        """The mean of each tensor over this stage's data-parallel replicas (one allreduce;
        every replica calls it with tensors of the same shapes and dtypes)."""
        return self.reduction.mean(tensors, "the data-parallel mean of a step's gradients")

    def forward(self, x: Any) -> tuple[StepShape, StepResult]:
        """Pipelined inference of this replica's rows of the global batch ``x``; outputs land on
        the last stage's rank, with their Keras masks."""
        self.batching.check_dense(x)
        return self._forward(x, self.batching.step_shape(mbatch.batch_size_of(x)))

    def _forward(self, x: Any, shape: StepShape) -> tuple[StepShape, StepResult]:
        """`forward` of a batch whose data was checked (`evaluate` checks it with its targets)."""
        if shape.microbatches == 0:  # no rows here: refuse a bad batch as the others do
            self.batching.check_inputs(x)
            return shape, StepResult()
        mbs = self.batching.microbatches(x, None, None, shape)
        self._configure_executors()
        result = self.executors.forward(len(mbs)).run(mbs, mode=StepMode(train=False))
        result.microbatches = mbs
        return shape, result

    def evaluate(self, x: Any, y: Any, sample_weight: Any = None) -> StepResult:
        """The loss of the global batch as Keras's ``test_step`` computes it, on every rank,
        and the model outputs of this replica's rows on the last stage's rank."""
        self.batching.check_batch_sizes(x, y, sample_weight)
        shape = self.batching.step_shape(mbatch.batch_size_of(x))
        objective = self._objective()
        if not objective.prepared:
            self._prepare(x, y, sample_weight)
        _, result = self._forward(x, shape)
        partial = np.zeros(2 * len(objective.terms))
        # a model's own compute_loss is called once on the whole batch after the step (by
        # tfsmp/keras/trainer_metrics.py), not per microbatch: its term stays 0 here
        if self.is_last_rank and result.outputs and objective.custom is None:
            self.batching.labels(result.microbatches, y, sample_weight, shape)
            for i, mb in enumerate(result.microbatches):
                rec = objective.call(mb.y, self.traced.pack_outputs(result.outputs[i]),
                                     mb.sample_weight)
                result.records[i] = (np.asarray([float(n) for n in rec.numerators]),
                                     np.asarray([float(d) for d in rec.normalizers]), 0.0)
            partial = objective.partial(loss_records(objective, result)[0], shape.rows)
        layer = float(sum(float(v) for v in result.layer_losses.values()))
        mine = RankReport(partial, layer, self._regularization_value())
        StepReport.gather(self.comm.world, mine, _watched,
                          "every rank's evaluation losses (an allgather)").assemble(
            objective, result, shape.parts)
        return result

    # -- StepHooks ([Note: one driver] in tfsmp/runtime/hooks.py) ------------------------------

    def reduce(self, stage: int, result: StageResult) -> None:
        """REDUCE: sums ``stage``'s gradients of this step over its data-parallel replicas."""
        self.reduction.reduce_stage(result.grads, self.programs[stage].non_trainable)

    def apply(self, result: StepResult) -> None:
        """STEP: applies the optimizer to this rank's variables, or skips the update on every
        rank alike when some gradient or loss is not finite ([Note: consistent skips] in
        report.py)."""
        mine = RankReport.of_training(result, self.objective, self._shape.rows,
                                      regularization=self._regularization_value())
        report = StepReport.gather(
            self.comm.world, mine, _watched,
            "every rank's finite-gradient flag and loss parts (an allgather)")
        factor = report.assemble(self.objective, result, self._shape.parts)
        keras_way = self.nonfinite == "apply"  # update with whatever the step computed
        if not report.finite and not keras_way:
            self._nonfinite(report)
            return
        if self.updates.direct:
            return  # each variable was updated in its stage's backward ([Note: direct update])
        grads = {s: r.grads for s, r in result.stages.items()}
        self.ties.reduce(grads)  # sum tied copies' gradients over their stages, before the step
        self.updates.apply(grads, factor, strict=not keras_way)

    def _nonfinite(self, report: StepReport) -> None:
        """[Note: consistent skips] Skips the update on every rank, or raises on every rank."""
        self.skipped_steps += 1  # the next step starts from fresh accumulators
        if self.updates.skipped() or self.nonfinite == "skip":
            return
        # every rank raises it, after the step's allgather ([Note: a step that fails partway])
        raise failure.alike(StepError(
            report.nonfinite_message(self.rank_tag, self.steps, self.updates.direct)))

    # -- before the first step -----------------------------------------------------------------

    def _prepare(self, x: Any, y: Any, sample_weight: Any) -> None:
        """Before the first training step, on every rank alike: measures the layer losses of
        this rank's stages, learns the compiled loss's terms, and refuses what a pipeline cannot
        honour ([Note: one owner of the step])."""
        mine = any([p.measure_layer_losses() for p in self.programs.values()]) or any(
            getattr(v, "regularizer", None) is not None for v in self.variables)
        parts = self.config.microbatches * self.comm.data.size
        split = sorted({n for p in self.programs.values() for n in p.per_microbatch_losses()})
        if split and parts > 1:
            warnings.warn(
                f"{self.rank_tag} Layer(s) {split} add a loss that is neither a sum nor a mean "
                f"over their samples (a mixture-of-experts balancing loss, for example): with "
                f"{parts} parts per step it is computed per microbatch and averaged over the "
                f"rows, as pipeline frameworks do; one part per step (microbatches=1, one "
                f"replica) gives plain Keras's value (docs/keras_semantics.md, \"Per "
                f"microbatch\").", stacklevel=2)
        with _watched("every rank's layer-loss flag (an allgather)"):
            self._layer_losses = any(self.comm.world.allgather_obj(mine))
        if (self._objective().compile_loss is None and self._objective().custom is None
                and not self._layer_losses):
            raise StepError(  # Keras's words (Trainer.compute_loss), on every rank alike
                f"{self.rank_tag} No loss to compute. Provide a `loss` argument in `compile()`. "
                f"Received: a model compiled without a loss whose layers add none (add_loss, "
                f"regularizers).")
        rows = min(mbatch.batch_size_of(x), 3)
        head = mbatch.take_rows((x, y, sample_weight), 0, rows)
        inputs = None
        if self._objective().custom is not None:  # [Note: a model's own compute_loss]
            packed = self.traced.pack_inputs(head[0])
            inputs = [packed[k] for k in self.traced.input_keys]
        # a later batch may have more parts than this one: decide for the most a step can have
        self._objective().prepare(head[1], head[2], self.batching.like_outputs(head[0]),
                                  parts=parts,
                                  has_layer_losses=self._layer_losses,
                                  scaled=self.updates.bridge is not None and self.updates.bridge.scaled,
                                  rank_tag=self.rank_tag, inputs=inputs)
        if inputs is not None and self.plan.num_stages > 1:  # one stage holds every variable
            self._refuse_foreign_reads(head[1], head[2], self.batching.like_outputs(head[0]),
                                       inputs)

    def _refuse_foreign_reads(self, y: Any, sample_weight: Any, y_pred: Any,
                              inputs: list[Any]) -> None:
        """[Note: a loss that reads other stages] A model's own compute_loss that reads a
        variable of another stage (it runs layers of the model again, as Keras's `Distiller`
        does to extract a student's intermediate features) cannot run in the last stage's
        compiled programs; each rank holding the last stage traces it (`Objective.foreign_read`)
        and every rank refuses alike, before the first step, instead of the last stage failing
        inside it."""
        last = self.plan.num_stages - 1
        mine = (self._objective().foreign_read(y, sample_weight, y_pred, inputs)
                if last in self.programs else None)
        with _watched("every rank's check of the model's compute_loss (an allgather)"):
            found = [p for p in self.comm.world.allgather_obj(mine) if p]
        if found:
            owner = getattr(self._objective().custom, "owner", None)
            name = type(owner).__name__ if owner is not None else "the model"
            raise StepError(
                f"{self.rank_tag} A model's own compute_loss() runs on the last pipeline stage, "
                f"inside its compiled step, and can read only that stage's variables. "
                f"Received: {name}.compute_loss reads variable '{found[0]}', which stage "
                f"{last} does not hold (the loss runs layers of other stages again, as Keras's "
                f"Distiller does to extract a student's intermediate features). Fix: compute "
                f"the loss from y, y_pred and the inputs only (for a Distiller: distill the "
                f"logits, without feature distillation), or train with partitions=1 (data "
                f"parallelism), or with plain Keras.")

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

    def _one_call_step(self) -> OneCallStep | None:
        """The step as one compiled call where nothing needs scheduling: one pipeline rank,
        one stage, one microbatch, one replica, no tied copies, no loss scaling, no XLA, no
        split (zero-bubble) stage, and no layer losses ([Note: one-call step] in
        tfsmp/runtime/fused_step.py)."""
        if self._one_call is None:
            prog = self.programs.get(0)
            fits = (self.config.partitions == 1 and self.plan.num_stages == 1
                    and self.config.microbatches == 1 and self.comm.data.size == 1
                    and not self.ties.count and not self._xla
                    and self.optimizer is not None and self.updates.bridge is not None
                    and self.updates.bridge.plain and not self._layer_losses
                    and self.objective is not None and self.objective.prepared
                    and self.objective.custom is None)
            self._one_call = False
            if fits and prog is not None and not prog.split:
                self._one_call = OneCallStep(
                    prog, self.variables, [i for _, _, i in self.updates.unique], self.optimizer,
                    self.objective, rank_tag=self.rank_tag,
                    relax_shapes=_dynamic_inputs(self.traced, self.executors.shapes),
                    direct=self.updates.by_variable)  # [Note: one-call direct update]
        return self._one_call if isinstance(self._one_call, OneCallStep) else None

    def _configure_executors(self) -> None:
        # read each step: the limit and the tracer may change between steps
        self.executors.stall_timeout = self.config.stall_timeout
        self.executors.tracer = self._tracer

    # -- compile again -------------------------------------------------------------------------

    def set_objective(self, compile_loss: Any) -> None:
        """Trains with ``compile_loss`` from now on (a model compiled again after partitioning)."""
        # None: the layers' losses only, as in Keras
        self.objective = Objective(compile_loss, self.custom_loss)
        for prog in self.programs.values():
            prog.set_objective(self.objective)
        self._one_call = None

    def has_layer_losses(self) -> bool:
        """Whether some rank's layers add losses or its variables have regularizers (known
        from the first step's preparation on)."""
        return bool(getattr(self, "_layer_losses", False))

    def set_custom_loss(self, custom: Any) -> None:
        """Trains with the model's own compute_loss, ``custom(inputs, y, y_pred,
        sample_weight)``, from now on (None: the compiled loss); [Note: a model's own
        compute_loss] in tfsmp/keras/model_loss.py. The last stage's ranks then convert every
        model input, which the loss is given."""
        if custom is self.custom_loss:
            return
        self.custom_loss = custom
        if custom is not None and self.is_last_rank:
            self.batching.reads = None
        if self.objective is not None:
            self.set_objective(self.objective.compile_loss)

    def set_optimizer(self, optimizer: Any) -> None:
        """Steps with ``optimizer`` from now on (a model compiled again after partitioning)."""
        self._one_call = None
        self.updates.set(optimizer)

    def _counted_here(self, variables: list[Any] | None = None) -> list[bool]:
        """Per variable of this rank: whether its pipeline rank is the one that counts it once
        in sums over the pipeline (a tied variable is held by several ranks)."""
        view = self.view
        return [view.placement.rank(view.key_stage[view.keys[id(v)]]) == self.comm.pipeline.rank
                for v in (self.variables if variables is None else variables)]

    def finalize(self) -> None:
        """What Keras does at the end of ``fit``: the optimizer's final variable values (its
        exponential moving averages, with ``use_ema``) on every rank's own variables."""
        self.updates.finalize()


def _dynamic_inputs(traced: TracedModel, shapes: BoundaryShapes | None) -> bool:
    """Whether some input or boundary has a dimension known only at run time: then stage
    programs trace with relaxed shapes, as Keras's own train function does."""
    return shapes is not None or any(
        is_dynamic(traced.graph.tensors[k].shape) for k in traced.input_keys)


def _watched(what: str) -> Any:
    """A blocking collective the watchdog times (tfsmp.runtime.watchdog, [Note: blocking calls])."""
    dog = wd.for_process()
    return dog.blocking(what) if dog is not None else contextlib.nullcontext()
