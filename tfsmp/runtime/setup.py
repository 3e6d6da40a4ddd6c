"""Builds a rank's `Engine` from a Keras model: trace, plan (agreed by all ranks), take own stage."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from tfsmp import errors
from tfsmp.errors import PartitionError, StepError, TfsmpError
from tfsmp.partitioning.plan import StagePlan
from tfsmp.runtime import kernels
from tfsmp.runtime.engine import Engine
from tfsmp.runtime.objective import Objective
from tfsmp.schedule.lowering import Lowered
from tfsmp.schedule.placement import Placement
from tfsmp.schedule.run_plan import RunPlan

if TYPE_CHECKING:
    from tfsmp.config import Config

__all__ = ["build_engine", "make_plan", "make_schedule", "optimizer_name", "rebuild_engine"]



def make_plan(traced: Any, config: Any, optimizer: Any = None, manual: dict[str, int] | None = None,
              *, keep_ties: bool = False, step_samples: int | None = None,
              data_parallel: int = 1) -> StagePlan:
    """The plan for ``config``: from ``partition_file``, manual scopes, or the automatic planners.

    ``keep_ties``: plan tied layers onto one stage where the model allows it (an SMP-style
    subclass trains with `smp.step`, which cannot sum tied copies' gradients; [Note: tied
    reduction] in tfsmp/runtime/ties.py); ``step_samples``: rows per optimizer step, which
    prices tied copies' gradient reduction ([Note: pricing copies] in partitioning/ties.py)."""
    from tfsmp.partitioning.memory import cap_from_environment, settings_of

    opt_name = optimizer_name(optimizer)
    settings = settings_of(config, opt_name,
                           None if step_samples is None else step_samples // max(data_parallel, 1),
                           data_parallel)
    if config.partition_file:
        with open(config.partition_file) as f:
            plan = StagePlan.from_json(f.read())
        if plan.num_stages != config.num_stages:
            raise PartitionError(
                f"The plan in partition_file must have partitions × virtual_stages stages. "
                f"Received: {plan.num_stages} stages in {config.partition_file}, config wants "
                f"{config.num_stages}.")
        drain_split = plan.drain_split  # [Note: drain split]: as the file's check decided
        plan = replace(StagePlan.from_assignment(traced.graph, plan.stage_of, plan.num_stages,
                                                 planner="file"), drain_split=drain_split)
        return _within_cap(traced.graph, settings, lambda s: plan)
    from tfsmp.partitioning.planner import plan_graph

    method = "auto" if config.auto_partition else "manual"
    graph = traced.graph
    if keep_ties and config.auto_partition:
        graph = _ties_together(graph, config.num_stages)
    cap = cap_from_environment()
    # optimize="memory" without a memory_weight: the best compute split within the rank's
    # memory cap ([Note: memory plans] in tfsmp/partitioning/memory_plan.py)
    weight = config.memory_weight if config.optimize == "memory" else config.effective_memory_weight

    def plan_for(s: Any) -> StagePlan:
        return plan_graph(
            graph, config.num_stages, optimize=s.optimize,
            memory_weight=weight, method=method, manual=manual or {},
            default_partition=config.default_partition, contiguous=config.contiguous,
            optimizer=opt_name, step_samples=step_samples, memory=s, memory_cap=cap)

    return _within_cap(graph, settings, plan_for)


def _within_cap(graph: Any, settings: Any, plan_for: Any) -> StagePlan:
    """``plan_for(settings)``, refused when the memory model says a rank would exceed its cap
    (``TFSMP_MEMORY_PER_RANK``), before any rank allocates ([Note: the launcher obeys the
    model] in tfsmp/partitioning/memory_check.py).

    Raises:
        ConfigError: some rank's predicted peak is above the cap; the message says what fits.
    """
    import os

    from tfsmp.errors import ConfigError
    from tfsmp.partitioning.memory import cap_from_environment
    from tfsmp.partitioning.memory_check import CHECK_ENV, check_memory

    cap = cap_from_environment()
    if cap is None or os.environ.get(CHECK_ENV, "").lower() in ("0", "off", "false", "no"):
        return plan_for(settings)  # type: ignore[no-any-return]
    decision = check_memory(graph, settings, cap, plan_for)
    if not decision.fits:
        raise ConfigError(decision.message())
    return decision.plan


def optimizer_name(optimizer: Any) -> str | None:
    """The memory model's name of a Keras optimizer (`tfsmp.graph.ir.OPTIMIZER_SLOTS`): its
    class name, ``sgd_momentum`` for SGD with momentum, ``amsgrad`` for Adam's variant."""
    if optimizer is None:
        return None
    inner = getattr(optimizer, "inner_optimizer", optimizer)  # a loss-scale wrapper's
    name = type(inner).__name__.lower()
    if name == "sgd" and float(getattr(inner, "momentum", 0.0) or 0.0) > 0:
        return "sgd_momentum"
    if name == "adam" and getattr(inner, "amsgrad", False):
        return "amsgrad"
    return name


def _ties_together(graph: Any, num_stages: int) -> Any:
    """The graph with its ties co-located, when that still leaves a group per stage."""
    if not graph.ties:
        return graph
    together = graph.with_ties_colocated()
    groups = [g for g in together.groups() if any(not together.nodes[n].is_input for n in g)]
    return together if len(groups) >= num_stages else graph


def _cost_with_batch(traced: Any, sample_x: Any) -> None:
    """Costs unknown dimensions with the first batch's shapes ([Note: unknown dimensions] in
    tfsmp/graph/costs.py). What layers keep for backward is not measured here: running layers
    on world rank 0 before it takes its stage leaves pages in TensorFlow's allocator (measured:
    more than 150 MiB for one Dense(4096) layer, which made a rank near its cap fail), so a
    memory plan here counts layer outputs; `tfsmp plan --memory-per-rank ... --out plan.json`
    measures them in a process of its own, and ``partition_file`` runs that plan."""
    from tfsmp.graph import costs

    try:
        costs.resolve_dims(traced, costs.input_shapes(traced, sample_x))
    except Exception:  # only estimates: a batch the tracer cannot read keeps the traced ones
        return


def _rows(sample_x: Any) -> int | None:
    """The batch size of a sample batch, when its first leaf has a known one."""
    import tensorflow as tf

    leaves = tf.nest.flatten(sample_x)
    shape = getattr(leaves[0], "shape", None) if leaves else None
    rows = shape[0] if shape is not None and len(shape) else None
    return int(rows) if isinstance(rows, int) and rows > 0 else None


def make_schedule(plan: StagePlan, config: Config, placement: Placement, data_parallel: bool,
                  microbatches: int | None = None) -> Lowered:
    """Every rank's lowered training actions for a step of ``microbatches`` (default: the
    config's) microbatches, with the ``placement`` they were lowered for: the run described by
    `RunPlan` ([Note: one description of the run] in tfsmp/schedule/run_plan.py)."""
    run = RunPlan.for_config(config, microbatches=microbatches,
                             data_parallel=2 if data_parallel else 1)
    if run.placement != placement:
        raise PartitionError(
            f"The schedule must be lowered for the job's placement. Received: "
            f"{run.placement.describe()} against {placement.describe()}.")
    return run.lowered(plan, data_parallel)


def _take_own_stage(traced: Any, plan: StagePlan, stages: list[int], placement: Any = None,
                    comm: Any = None) -> None:
    """Materializes this rank's stages' variables and releases the others'; with ``comm`` (an
    MPI job) a read of another stage's variable asks the rank of this pipeline group that
    holds it ([Note: remote reads] in tfsmp/comm/remote_reads.py)."""
    from tfsmp.comm import remote_reads
    from tfsmp.graph.deferred import is_deferred, materialize, release

    mine = {n for s in stages for n in plan.layers(s)}
    own = traced.variables_of(mine)
    own_ids = {id(v) for v in own}
    every = traced.variables_of(set(plan.stage_of))
    others = [v for v in every if id(v) not in own_ids]
    materialize([v for v in own if is_deferred(v)])
    service = remote_reads.service() if comm is not None and placement is not None else None
    if service is None:
        release([v for v in others if not is_deferred(v)])
        return
    end = len(traced.variable_order)  # the same order on every rank, paths breaking ties
    keyed = sorted(every, key=lambda v: (traced.variable_order.get(id(v), end), v.path))
    index = {id(v): i for i, v in enumerate(keyed)}
    build = service.offer({index[id(v)]: v for v in own})
    service.remember(traced, build)  # later offers of this partitioning (optimizer slots)
    holder: dict[int, int] = {}  # variable id -> the world rank of its first stage
    for s in range(plan.num_stages):
        for v in traced.variables_of(set(plan.layers(s))):
            holder.setdefault(id(v), comm.pipeline.ranks[placement.rank(s)])
    sources = {id(v): service.source(holder[id(v)], (build, index[id(v)]), v.path)
               for v in others if id(v) in holder}
    release(others, sources)


def build_engine(model: Any, sample_x: Any, state: Any, *, compile_loss: Any, optimizer: Any,
                 rank_tag: str, subclassed: bool, xla: bool, profile_batch: Any = None
                 ) -> Engine:
    """The engine of ``model``: traced, planned on world rank 0, this rank's stages taken;
    ``xla``: whether its stage programs compile with XLA (the `xla` parameter or Keras's
    `jit_compile`: [Note: jit_compile is xla] in tfsmp/keras/model.py)."""
    from tfsmp.graph.scopes import assignment, recording
    from tfsmp.graph.tracer import trace

    config = state.config
    kernels.use(config.blas)  # [Note: OpenBLAS products]: built and loaded before any trace
    with recording() as placed:
        traced = trace(model, sample_input=sample_x)
    manual = assignment(traced, placed) if not config.auto_partition else None
    world = state.comm.world
    answer: tuple[str, str] = ("plan", "")
    failed: TfsmpError | None = None  # world rank 0's, the cause of what every rank raises
    if world.rank == 0:
        _cost_with_batch(traced, sample_x)
        if profile_batch is not None:
            from tfsmp.graph.costs import profile

            profile(traced, profile_batch)
        try:
            answer = ("plan", make_plan(traced, config, optimizer, manual, keep_ties=subclassed,
                                        step_samples=_rows(sample_x),
                                        data_parallel=state.comm.data.size).to_json())
        except TfsmpError as e:  # a plan above the memory cap, a model too small for the
            # stages, ...: refused on every rank alike, never on rank 0 alone while the others
            # wait for the plan
            failed, answer = e, (type(e).__name__, str(e))
    kind, text = world.bcast_obj(answer, root=0)
    if kind != "plan":
        refusal = getattr(errors, kind, StepError)  # the same error on every rank
        raise refusal(f"{rank_tag} {text}") from failed
    plan = StagePlan.from_json(text)
    # the one placement of the job: stage -> pipeline rank (tfsmp/schedule/placement.py)
    placement = RunPlan.for_config(config).placement
    stages = placement.stages(state.comm.pipeline.rank)
    _take_own_stage(traced, plan, stages, placement, state.comm)
    data_parallel = state.comm.data.size > 1

    def schedules(m: int) -> Lowered:
        return make_schedule(plan, config, placement, data_parallel, microbatches=m)

    tracer = None
    if config.trace_dir:
        from tfsmp.timeline.events import Tracer

        tracer = Tracer(config.trace_dir, state.rank)
    objective = Objective(compile_loss)  # None: the layers' losses only, as in Keras
    return Engine(traced, plan, schedules, config=config, comm=state.comm, rank_tag=rank_tag,
                  objective=objective, optimizer=optimizer, tracer=tracer, horovod=state.horovod,
                  xla=xla)


def rebuild_engine(engine: Engine, compile_loss: Any, optimizer: Any, *, xla: bool) -> Engine:
    """``engine``'s plan and schedules with new stage programs, the compiled loss and optimizer
    ([Note: changing the model] in tfsmp/keras/model.py); ``xla``: whether they compile with
    XLA, as in `build_engine`."""
    objective = Objective(compile_loss)  # None: the layers' losses only, as in Keras
    return engine.rebuilt(objective, optimizer, xla=xla)
