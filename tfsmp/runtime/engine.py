"""The pipeline engine of one rank: plan, schedule, stage programs, reduction and optimizer step.

Example::

    engine = Engine(traced, config, state, loss=loss_fn, optimizer=opt)
    result = engine.train_step(x, y, sample_weight)   # one optimizer step over the local batch
    outputs = engine.forward(x)                        # pipelined inference, outputs on the last stage

Roughly, for a training step on rank r (stages S_r = {s : s mod p = r}):
    split batch into m microbatches -> run the lowered schedule (F/B/sends/receives)
    -> REDUCE: sum each stage's gradient accumulators over its data-parallel replicas
    -> STEP: optimizer.apply(accumulators, variables of S_r); the next step's first
             microbatch overwrites the accumulators (stage.py, [Note: fresh accumulators])
Each microbatch loss is scaled by 1/(m·d), so the accumulated sum is the gradient of the mean
loss over the global batch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import numpy as np
import tensorflow as tf

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
from tfsmp.runtime.stage import StageProgram
from tfsmp.runtime.ties import TiedCopies
from tfsmp.schedule.actions import Action, Op

__all__ = ["Engine", "forward_only_schedule"]


def forward_only_schedule(plan: StagePlan, num_ranks: int, rank: int, num_microbatches: int
                          ) -> list[Action]:
    """Inference actions of one rank: per microbatch, its stages in order, each with its
    receives before and sends after. Acyclic stage order means it cannot deadlock."""
    out: list[Action] = []
    stages = [s for s in range(plan.num_stages) if s % num_ranks == rank]
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
        self.stages = [s for s in range(plan.num_stages) if s % self.num_ranks == self.pipe_rank]
        self.programs = {
            s: StageProgram(traced, plan, s, optimize=config.optimize, loss=loss,
                            jit_compile=bool(config.xla), relax_shapes=self._dynamic_inputs())
            for s in self.stages}
        self.last_rank = (plan.num_stages - 1) % self.num_ranks
        self.is_last_rank = self.pipe_rank == self.last_rank
        self.optimizer = optimizer
        self.loss_reduction = loss_reduction
        # [Note: tied reduction] in tfsmp/runtime/ties.py: a variable on two local stages is
        # updated once, from its first stage's accumulator, which holds the summed gradient
        self.ties = TiedCopies.of(traced, plan, self.programs, comm.pipeline, self.num_ranks,
                                  tag_ub=comm.tag_ub, watch=_watched)
        self._unique = self.ties.unique()
        self.variables = [v for v, _, _ in self._unique]
        self.accumulators = [self.programs[s].accumulators[i] for _, s, i in self._unique]
        self._train_actions = schedule[self.pipe_rank]
        self._tracer = tracer
        self._apply_fn: Any = None
        self._eval_actions: dict[int, list[Action]] = {}
        self._horovod = bool(config.horovod)
        self._executor: Executor | None = None  # the one that ran the last step
        self._executors: dict[tuple[int, int], Executor] = {}
        self._reducers: dict[tuple[Any, ...], _FusedReducer] = {}
        self.steps = 0
        self.skipped_steps = 0
        self._outputs: ShapeResolver | None = None
        # mixed_float16 wraps the optimizer in a LossScaleOptimizer (it has `inner_optimizer`;
        # `dynamic_scale` appears only once built, so test the wrapper, then build on every rank).
        self._loss_scaled = optimizer is not None and hasattr(optimizer, "inner_optimizer")
        if optimizer is not None and not optimizer.built:
            optimizer.build(self.variables)
        if self._loss_scaled:  # mixed_float16: the last stage multiplies its loss by the scale
            for prog in self.programs.values():
                prog.loss_scaler = optimizer.scale_loss
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
        scale = 1.0 if self.loss_reduction == "sum" else 1.0 / self.m
        scale /= self.dp_size
        for prog in self.programs.values():
            prog.scale.assign(scale)
            prog.track_finite = self.m > 1
            prog.reset_accumulators()  # whatever an earlier step left, even one that raised
        mbs = self._microbatches(x, y, sample_weight, self.m)
        ex = self._executor = self._executor_for(self._train_actions, self.m)
        self.steps += 1
        return ex.run(mbs, train=True, reduce=self._reduce, step=self._apply)

    def _executor_for(self, actions: list[Action], m: int) -> Executor:
        """The executor of one schedule, kept from step to step so that its receive buffers are
        reused ([Note: receive buffers] in tfsmp/runtime/executor.py)."""
        ex = self._executors.get((id(actions), m))
        if ex is None:
            ex = self._executors[(id(actions), m)] = Executor(
                actions, self.programs, self.plan, self.comm.pipeline, self.num_ranks, m,
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
        for prog in self.programs.values():
            prog.collect = True
            prog.scale.assign(1.0)
            prog.collected.clear()
        m = len(mbs)
        if train:
            actions = self._train_actions
        else:
            if m not in self._eval_actions:
                self._eval_actions[m] = forward_only_schedule(self.plan, self.num_ranks,
                                                              self.pipe_rank, m)
            actions = self._eval_actions[m]
        ex = self._executor = self._executor_for(actions, m)
        self.steps += 1
        try:
            return ex.run(mbs, train=train, head=head)
        finally:
            for prog in self.programs.values():
                prog.collect = False

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
            self._eval_actions[m] = forward_only_schedule(self.plan, self.num_ranks, self.pipe_rank, m)
        return self._executor_for(self._eval_actions[m], m).run(mbs, train=False)

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

    def _reduce(self, stage: int) -> None:
        prog = self.programs[stage]
        if self.dp_size > 1:
            self._sync_statistics(stage)
        accs = [a for i, a in enumerate(prog.accumulators) if i not in prog.sparse_parts]
        if self.dp_size == 1 or not prog.accumulators:
            return
        if prog.sparse_parts:  # concatenate every replica's rows, in replica (= batch) order
            mine = {i: (v.numpy(), x.numpy()) for i, (v, x) in prog.sparse_gradients().items()}
            gathered = self.comm.data.allgather_obj(mine)
            prog.sparse_parts = {i: [(tf.constant(g[i][0]), tf.constant(g[i][1])) for g in gathered]
                                 for i in mine}
        if self._horovod:
            import horovod.tensorflow as hvd

            summed = hvd.grouped_allreduce([a.value() for a in accs], op=hvd.Sum,
                                           name=f"tfsmp_grads_stage{stage}")
            for a, s in zip(accs, summed):
                a.assign(s)
            return
        if accs:
            self._allreduce_sum(accs, f"the data-parallel allreduce of stage {stage}'s gradients")

    def _all_finite(self) -> bool:
        """[Note: consistent skips] Whether every gradient of every rank is finite. All ranks
        decide together (one small allgather), so an update is applied or skipped everywhere
        alike and loss-scale state stays identical across ranks."""
        ok = all(bool(p._finite()) for p in self.programs.values()) and all(
            bool(tf.reduce_all(tf.math.is_finite(v))) for prog in self.programs.values()
            for parts in prog.sparse_parts.values() for v, _ in parts)
        losses = self._executor.result.losses if self._executor is not None else {}
        bad_mb = sorted(i for i, loss in losses.items() if not np.isfinite(float(loss)))
        first = {s: p.nonfinite_microbatch for s, p in self.programs.items()
                 if p.nonfinite_microbatch is not None}
        if not ok and self.m == 1:  # one microbatch: no per-microbatch tracking was needed
            first = {s: 0 for s, p in self.programs.items() if not bool(p._finite())}
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

    def _apply(self) -> None:
        if not self._all_finite():
            self.skipped_steps += 1  # the next step starts from fresh accumulators
            if self._loss_scaled:
                self.optimizer._stateful_handle_non_finite_grads()
            return
        self.ties.reduce()  # sum tied copies' gradients over their stages, before the step
        if not self.variables:
            return
        parts = {s: self.programs[s].sparse_gradients() for s in self.stages}
        sparse: dict[str, tuple[tf.Tensor, tf.Tensor]] = {
            str(j): parts[s][i] for j, (_, s, i) in enumerate(self._unique) if i in parts[s]}
        for s in self.stages:
            self.programs[s].sparse_parts.clear()
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
