"""The pipeline engine of one rank: plan, schedule, stage programs, reduction and optimizer step.

Example::

    engine = Engine(traced, plan, schedule, config=config, comm=comm, rank_tag="[rank 0]",
                    loss=loss_fn, optimizer=opt)       # usually built by runtime.setup
    result = engine.train_step(x, y, sample_weight)   # one optimizer step over the local batch
    outputs = engine.forward(x)                        # pipelined inference, outputs on the last stage

Roughly, for a training step on rank r (stages S_r = placement.stages(r): s mod p, or ZB-V's V):
    split batch into m microbatches -> the executor runs the lowered schedule (F/B/W/sends/
    receives) and calls this engine as its `StepHooks` ([Note: one driver] in hooks.py):
    -> reduce(s, result): sum stage s's gradient accumulators over its data-parallel replicas
    -> apply(result): optimizer.apply(accumulators, variables of S_r); the next step's first
             microbatch overwrites the accumulators (stage.py, [Note: fresh accumulators])
Each microbatch loss is scaled by 1/(m·d), so the accumulated sum is the gradient of the mean
loss over the global batch.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import tensorflow as tf

from tfsmp.comm.horovod import HorovodReducer
from tfsmp.errors import StepError
from tfsmp.partitioning.plan import StagePlan
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
from tfsmp.runtime.hooks import StageResult, StepMode
from tfsmp.runtime.stage import StageProgram, concat_sparse
from tfsmp.runtime.ties import TiedCopies
from tfsmp.runtime.view import RankView
from tfsmp.schedule.actions import Action, Op
from tfsmp.schedule.placement import Placement

__all__ = ["Engine", "forward_only_schedule"]


def forward_only_schedule(plan: StagePlan, placement: Placement, rank: int, num_microbatches: int
                          ) -> list[Action]:
    """Inference actions of one rank: per microbatch, its stages in order, each with its
    receives before and sends after. Acyclic stage order means it cannot deadlock."""
    out: list[Action] = []
    stages = placement.stages(rank)
    for i in range(num_microbatches):
        for s in stages:
            out.extend(Action(s, Op.RECV_F, i, q) for q in plan.peers_backward(s))
            out.append(Action(s, Op.FORWARD, i))
            out.extend(Action(s, Op.SEND_F, i, c) for c in plan.peers_forward(s))
    return out


class Engine:
    """One rank's share of a pipelined model. See the module docstring."""

    def __init__(
        self,
        traced: Any,
        plan: StagePlan,
        schedule: dict[int, list[Action]],
        *,
        config: Any,
        comm: Any,
        rank_tag: str,
        loss: Callable[..., tf.Tensor] | None,
        optimizer: Any,
        loss_reduction: str = "sum_over_batch_size",
        tracer: Any = None,
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
        # one owner of stage -> pipeline rank: s % p, or ZB-V's V (tfsmp/schedule/placement.py)
        self.placement = Placement.for_pipeline(config.pipeline, self.num_ranks, config.chunks)
        self.stages = self.placement.stages(self.pipe_rank)
        self._train_actions = schedule[self.pipe_rank]
        # mixed_float16 wraps the optimizer in a LossScaleOptimizer (it has `inner_optimizer`;
        # `dynamic_scale` appears only once built, so test the wrapper, then build on every rank).
        self._loss_scaled = optimizer is not None and hasattr(optimizer, "inner_optimizer")
        # [Note: split stages] in stage.py: a stage with W actions defers weight gradients to W
        weighted = {a.stage for a in self._train_actions if a.op.value == "W"}
        self.programs = {
            s: StageProgram(traced, plan, s, optimize=config.optimize, loss=loss,
                            jit_compile=bool(config.xla), relax_shapes=self._dynamic_inputs(),
                            split=s in weighted,
                            loss_scaler=optimizer.scale_loss if self._loss_scaled else None)
            for s in self.stages}
        self.last_rank = self.placement.last_rank
        self.is_last_rank = self.pipe_rank == self.last_rank
        self.optimizer = optimizer
        self.loss_reduction = loss_reduction
        # [Note: tied reduction] in tfsmp/runtime/ties.py: a variable on two local stages is
        # updated once, from its first stage's accumulator, which holds the summed gradient
        self.ties = TiedCopies.of(traced, plan, self.programs, comm.pipeline, self.placement,
                                  tag_ub=comm.tag_ub, watch=_watched)
        self._unique = self.ties.unique()
        self.variables = [v for v, _, _ in self._unique]
        self.accumulators = [self.programs[s].accumulators[i] for _, s, i in self._unique]
        self._tracer = tracer
        self._loss = loss
        self._one_call: OneCallStep | bool | None = None  # False: not applicable
        self._apply_fn: Any = None
        self._eval_actions: dict[int, list[Action]] = {}
        self._horovod = horovod  # with `horovod: True`, gradients are summed through Horovod
        self._executor: Executor | None = None  # the one that ran the last step
        self._executors: dict[tuple[int, int], Executor] = {}
        self._reducers: dict[tuple[Any, ...], _FusedReducer] = {}
        self.steps = 0
        self.skipped_steps = 0
        self._outputs: ShapeResolver | None = None
        if optimizer is not None and not optimizer.built:
            optimizer.build(self.variables)
        self.broadcast_from_first_replica()
        self.ties.sync()  # copies of tied variables start identical

    # -- data ----------------------------------------------------------------------------------

    def _dynamic_inputs(self) -> bool:
        """Whether some input or boundary has a dimension known only at run time: then stage
        programs trace with relaxed shapes, as Keras's own train function does."""
        return self.boundary_shapes is not None or any(
            is_dynamic(self.traced.graph.tensors[k].shape) for k in self.traced.input_keys)

    def output_shapes(self, x: Any) -> list[tuple[int | None, ...]]:
        """The shapes of the model's outputs (batch axis first) for inputs shaped like ``x``
        (tensors, possibly symbolic with unknown dimensions), without running the model."""
        flat = self.traced._flatten_inputs(x)
        shapes = {k: tuple(v.shape) for k, v in zip(self.traced.input_keys, flat)}
        if self._outputs is None:
            self._outputs = ShapeResolver(self.traced, self.traced.output_keys)
        found = self._outputs.shapes(shapes)
        return [found[k] for k in self.traced.output_keys]

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

    def _microbatches(self, x: Any, y: Any, sample_weight: Any, m: int) -> list[MicroBatch]:
        packed = {k: tf.convert_to_tensor(v) for k, v in self.traced.pack_inputs(x).items()}
        self.check_inputs_packed(packed)  # the batch is converted once, then sliced
        self.check_batch_sizes(x, y, sample_weight)
        xs = [packed] if m == 1 else mbatch.split(packed, m)
        ys = mbatch.split(y, m, what="target batch") if y is not None else [None] * m
        ws = (mbatch.split(sample_weight, m, what="sample_weight batch")
              if sample_weight is not None else [None] * m)
        return [MicroBatch(xi, _to_tensors(yi), _to_tensors(wi), size=mbatch.batch_size_of(xi))
                for xi, yi, wi in zip(xs, ys, ws)]

    # -- steps ---------------------------------------------------------------------------------

    def train_step(self, x: Any, y: Any, sample_weight: Any = None) -> StepResult:
        """One optimizer step over this replica's batch ``x`` (global batch / d rows)."""
        one_call = self._one_call_step()
        if one_call is not None:  # [Note: one-call step] in tfsmp/runtime/fused_step.py
            mb = self._microbatches(x, y, sample_weight, 1)[0]
            self.steps += 1
            result, applied = one_call.run(mb, step_number=self.steps,
                                           nonfinite=self.config.nonfinite, tracer=self._tracer)
            self.skipped_steps += not applied
            return result
        scale = 1.0 if self.loss_reduction == "sum" else 1.0 / self.m
        scale /= self.dp_size
        mbs = self._microbatches(x, y, sample_weight, self.m)
        ex = self._executor = self._executor_for(self._train_actions, self.m)
        self.steps += 1
        # the executor starts every program afresh, even after a step that raised, and calls
        # this engine's `reduce` and `apply` ([Note: one driver] in tfsmp/runtime/hooks.py)
        return ex.run(mbs, mode=StepMode(train=True, scale=scale), hooks=self)

    def _one_call_step(self) -> OneCallStep | None:
        """The step as one compiled call where nothing needs scheduling: one pipeline rank,
        one stage, one microbatch, one replica, no tied copies, no loss scaling, no XLA and no
        split (zero-bubble) stage ([Note: one-call step] in tfsmp/runtime/fused_step.py)."""
        if self._one_call is None:
            prog, loss = self.programs.get(0), self._loss
            fits = (self.num_ranks == 1 and self.plan.num_stages == 1 and self.m == 1
                    and self.dp_size == 1 and not self.ties.count and not self.config.xla
                    and self.optimizer is not None and not hasattr(self.optimizer, "inner_optimizer"))
            self._one_call = False
            if fits and prog is not None and not prog.split and loss is not None:
                self._one_call = OneCallStep(
                    prog, self.variables, [i for _, _, i in self._unique], self.optimizer, loss,
                    rank_tag=self.rank_tag, relax_shapes=self._dynamic_inputs())
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

    def run_step(self, inputs: list[dict[str, Any]], head: Callable[..., Any], train: bool = True
                 ) -> StepResult:
        """One `smp.step` call: ``inputs[i]`` are microbatch i's model inputs (by tensor key).
        The last stage runs ``head``; other stages keep per-microbatch weight gradients in
        ``program.collected`` (no reduction, no optimizer step: the script applies them)."""
        if train:
            self.ties.check_collect(self.rank_tag)
        mbs = []
        for packed in inputs:
            tensors = {k: tf.convert_to_tensor(v) for k, v in packed.items()}
            self.check_inputs_packed(tensors)
            size = int(next(iter(tensors.values())).shape[0]) if tensors else 0
            mbs.append(MicroBatch(tensors, size=size))
        m = len(mbs)
        if train:
            actions = self._train_actions
        else:
            if m not in self._eval_actions:
                self._eval_actions[m] = forward_only_schedule(self.plan, self.placement,
                                                              self.pipe_rank, m)
            actions = self._eval_actions[m]
        ex = self._executor = self._executor_for(actions, m)
        self.steps += 1
        return ex.run(mbs, mode=StepMode(train=train, collect=True), head=head)

    def collected(self, stage: int) -> dict[int, list[tf.Tensor]]:
        """The last `run_step`'s weight gradients of ``stage``, by microbatch ([Note: collect
        mode] in tfsmp/runtime/stage.py); empty for a stage that fused them into its head."""
        found = self._executor.result.stages.get(stage) if self._executor is not None else None
        return dict(found.collected) if found is not None else {}

    @functools.cached_property
    def view(self) -> RankView:
        """This rank's read-only view of the partitioned model (tfsmp/runtime/view.py)."""
        return RankView.build(self.traced, self.plan, self.comm, self.config, self.placement)

    def set_optimizer(self, optimizer: Any) -> None:
        """Steps with ``optimizer`` from now on (a model compiled again after partitioning)."""
        self.optimizer = optimizer
        self._apply_fn = None
        self._one_call = None

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

    def forward(self, x: Any, num_microbatches: int | None = None) -> StepResult:
        """Pipelined inference; outputs land on the last stage's rank."""
        m = num_microbatches or self.m
        b = mbatch.batch_size_of(x)
        if b % m:
            m = 1  # a final partial batch in predict/evaluate runs unsplit
        mbs = self._microbatches(x, None, None, m)
        if m not in self._eval_actions:
            self._eval_actions[m] = forward_only_schedule(self.plan, self.placement, self.pipe_rank,
                                                          m)
        return self._executor_for(self._eval_actions[m], m).run(mbs, mode=StepMode(train=False))

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
        """REDUCE: sums ``stage``'s gradients over its data-parallel replicas."""
        prog = self.programs[stage]
        if self.dp_size > 1:
            self._sync_statistics(stage)
        accs = [a for i, a in enumerate(prog.accumulators) if i not in result.sparse]
        if self.dp_size == 1 or not prog.accumulators:
            return
        if result.sparse:  # concatenate every replica's rows, in replica (= batch) order
            mine = {i: (v.numpy(), x.numpy()) for i, (v, x) in concat_sparse(result.sparse).items()}
            gathered = self.comm.data.allgather_obj(mine)
            result.sparse.clear()  # in place: tied copies read the same parts
            result.sparse.update({i: [(tf.constant(g[i][0]), tf.constant(g[i][1]))
                                      for g in gathered] for i in mine})
        if self._horovod is not None:
            summed = self._horovod.grouped_allreduce([a.value() for a in accs],
                                                     name=f"tfsmp_grads_stage{stage}")
            for a, s in zip(accs, summed):
                a.assign(s)
            return
        if accs:
            self._allreduce_sum(accs, f"the data-parallel allreduce of stage {stage}'s gradients")

    def _all_finite(self, result: StepResult) -> bool:
        """[Note: consistent skips] Whether every gradient of every rank is finite. All ranks
        decide together (one small allgather), so an update is applied or skipped everywhere
        alike and loss-scale state stays identical across ranks."""
        stages = result.stages.values()
        ok = all(r.finite for r in stages) and all(
            bool(tf.reduce_all(tf.math.is_finite(v))) for r in stages
            for parts in r.sparse.values() for v, _ in parts)
        bad_mb = sorted(i for i, loss in result.losses.items() if not np.isfinite(float(loss)))
        first = {r.stage: r.first_nonfinite for r in stages if r.first_nonfinite is not None}
        with _watched("every rank's finite-gradient flag (an allgather)"):
            report = self.comm.world.allgather_obj((ok, first, bad_mb))
        if all(r[0] for r in report) and not any(r[2] for r in report):
            return True
        if self._loss_scaled or self.config.nonfinite == "skip":
            return False
        grads = {s: i for r in report for s, i in r[1].items()}
        mbs = sorted({i for r in report for i in r[2]})
        where = ", ".join(f"stage {s} from microbatch {i}" for s, i in sorted(grads.items()))
        raise StepError(
            f"{self.rank_tag} Non-finite values at step {self.steps}: loss of microbatch(es) "
            f"{mbs or 'none'} on the last stage; gradients of {where or 'no stage'}. "
            f"Lower the learning rate, check the data, or set nonfinite='skip' to skip such "
            f"updates on every rank.")

    def apply(self, result: StepResult) -> None:
        """STEP: applies the optimizer to this rank's variables, or skips the update on every
        rank alike when some gradient is not finite."""
        if not self._all_finite(result):
            self.skipped_steps += 1  # the next step starts from fresh accumulators
            if self._loss_scaled:
                self.optimizer._stateful_handle_non_finite_grads()
            return
        self.ties.reduce()  # sum tied copies' gradients over their stages, before the step
        if not self.variables:
            return
        parts = {s: concat_sparse(result.stages[s].sparse) for s in self.stages}
        sparse: dict[str, tuple[tf.Tensor, tf.Tensor]] = {
            str(j): parts[s][i] for j, (_, s, i) in enumerate(self._unique) if i in parts[s]}
        if self._apply_fn is None:
            variables, accs = self.variables, self.accumulators
            optimizer = self.optimizer
            apply_grads = (optimizer._stateful_handle_finite_grads if self._loss_scaled
                           else optimizer.apply)

            def apply(sparse: dict[str, tuple[tf.Tensor, tf.Tensor]]) -> None:
                grads: list[Any] = []
                for i, a in enumerate(accs):
                    if str(i) in sparse:
                        values, indices = sparse[str(i)]
                        grads.append(tf.IndexedSlices(values, indices, tf.shape(a, tf.int64)))
                    else:
                        grads.append(a.value())
                apply_grads(grads, variables)

            self._apply_fn = tf.function(apply, jit_compile=bool(self.config.xla),
                                         reduce_retracing=True)
        self._apply_fn(sparse)



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


def _watched(what: str) -> Any:
    """A blocking collective the watchdog times (tfsmp.runtime.watchdog, [Note: blocking calls])."""
    dog = wd.for_process()
    return dog.blocking(what) if dog is not None else contextlib.nullcontext()


def _to_tensors(structure: Any) -> Any:
    if structure is None:
        return None
    if isinstance(structure, dict):
        return {k: _to_tensors(v) for k, v in structure.items()}
    if isinstance(structure, (list, tuple)):
        return type(structure)(_to_tensors(v) for v in structure)
    return tf.convert_to_tensor(structure)
