"""Memory plans: among the contiguous splits whose every rank fits, the best compute balance.

Pure: imports neither TensorFlow nor Keras.

Example::

    settings = MemorySettings(partitions=4, microbatches=8, batch_size=64, optimizer="adam")
    plan = plan_within_memory(graph, 4, settings, cap=2.5 * 2**30)

[Note: memory plans] ``optimize: memory`` used to blend each layer's memory share (weight 0.8)
with its compute share, which balanced neither: keras_hub Llama and Gemma came out at compute
max/mean 1.99 at p=4 (the embedding's memory pulled the cut), ResNet50 at 1.6. A pipeline runs
at the pace of its slowest stage, and memory is a constraint, not a cost: a plan that fits is as
good as one that fits with room to spare. So a memory plan is the compute plan (what ``optimize:
speed`` plans) when every rank of it fits the cap (``tfsmp run --memory-per-rank``, or no cap),
and otherwise the optimal contiguous split of compute ([Note: contiguous DP]) over the splits
whose every stage fits its budget ([Note: memory limits]): the cap less what a rank holds
besides its stages' layers. Stage budgets count weights, optimizer state, accumulators, one
microbatch's activations and the microbatches the schedule keeps per stage; the finished plan is
checked by the full memory model (`predict_memory`: tied copies, buffers, transients) and a
rank above the cap tightens its stages' budgets by the excess, a few times at most. When
nothing fits, the plan is the leanest split (the least largest stage), and its notes say so;
`tfsmp plan --memory-per-rank` then says what would fit.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from tfsmp.graph.ir import LayerGraph
from tfsmp.partitioning.contiguous import MemoryLimits, split_within_memory
from tfsmp.partitioning.memory import (
    GRADIENTS_IN_FLIGHT,
    MemorySettings,
    group_bytes,
    predict_memory,
    stage_counts,
)
from tfsmp.partitioning.plan import StagePlan
from tfsmp.partitioning.planner import FLOPS_PER_BYTE, Problem, build_problem, check_feasible

__all__ = ["plan_within_memory", "what_fits"]

_RETRIES = 3
_SEARCH_STEPS = 40


def plan_within_memory(graph: LayerGraph, num_stages: int, settings: MemorySettings,
                       cap: float | None, compute: StagePlan, *,
                       flops_per_byte: float = FLOPS_PER_BYTE,
                       step_samples: int | None = None) -> StagePlan:
    """The memory plan of ``graph``: ``compute`` (the compute plan) when it fits ``cap``, else
    the best compute split that fits. See [Note: memory plans].

    Raises:
        PartitionError: too few layers or groups for ``num_stages``.
    """
    if cap is None or not any(_excess(compute, graph, settings, cap)):
        why = ("memory: no cap, the compute plan" if cap is None
               else f"memory: the compute plan fits {cap / 2**30:.2f} GiB per rank")
        return _annotated(compute, graph, settings, why)
    problem = build_problem(graph, optimize="speed", optimizer=settings.optimizer,
                            flops_per_byte=flops_per_byte, step_samples=step_samples)
    check_feasible(problem, num_stages)
    fixed, held = group_bytes(graph, problem.groups, settings)
    pf = np.concatenate([[0.0], np.cumsum(fixed)])
    ph = np.concatenate([[0.0], np.cumsum(held)])
    counts = tuple(float(c) for c in stage_counts(settings, num_stages))
    least = _leanest(problem, num_stages, pf, ph, counts)
    largest = max((n.trainable_param_bytes for n in graph), default=0)
    outside = settings.baseline + settings.runtime + GRADIENTS_IN_FLIGHT * largest
    budget = [cap - outside] * num_stages
    why = f"memory: the best compute split within {cap / 2**30:.2f} GiB per rank"
    plan = None
    for _ in range(_RETRIES + 1):
        stage = _split(problem, num_stages, MemoryLimits(pf, ph, counts, tuple(budget)))
        if stage is None:
            break
        plan = _plan(graph, problem, stage, num_stages, settings, why)
        over = _excess(plan, graph, settings, cap)
        if not any(over):
            return plan
        budget = [b - o for b, o in zip(budget, over)]
    stage = _split(problem, num_stages, MemoryLimits(pf, ph, counts, (least * (1 + 1e-9),)
                                                     * num_stages))
    return _plan(graph, problem, stage or [0] * len(problem), num_stages, settings,
                 f"memory: nothing fits {cap / 2**30:.2f} GiB per rank; the leanest split "
                 f"(largest stage {least / 2**30:.2f} GiB before baseline and buffers)")


def _split(problem: Problem, k: int, limits: MemoryLimits) -> list[int] | None:
    starts = split_within_memory(problem.weight, problem.cuts(), k, limits, problem.kappa)
    if starts is None:
        return None
    ends = [*starts[1:], len(problem)]
    stage = [0] * len(problem)
    for s, (a, b) in enumerate(zip(starts, ends)):
        for g in range(a, b):
            stage[g] = s
    return stage


def _leanest(problem: Problem, k: int, pf: np.ndarray, ph: np.ndarray,
             counts: tuple[float, ...]) -> float:
    """The least budget, the same for every stage, that some contiguous split fits."""
    lo, hi = 0.0, float(pf[-1] + max(counts, default=0.0) * ph[-1]) + 1.0
    for _ in range(_SEARCH_STEPS):
        mid = (lo + hi) / 2
        if split_within_memory(problem.weight, problem.cuts(), k,
                               MemoryLimits(pf, ph, counts, (mid,) * k)) is None:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-4 * hi:
            break
    return hi


def _plan(graph: LayerGraph, problem: Problem, stage: list[int], k: int,
          settings: MemorySettings, why: str) -> StagePlan:
    plan = StagePlan.from_assignment(graph, problem.stage_of(stage), k, planner="memory",
                                     optimizer=settings.optimizer)
    return _annotated(plan, graph, settings, why)


def _annotated(plan: StagePlan, graph: LayerGraph, settings: MemorySettings,
               why: str) -> StagePlan:
    plan = _with_note(plan, why)
    ranks = predict_memory(plan, graph, settings)
    peaks = ", ".join(f"{r.total / 2**30:.2f}" for r in ranks)
    return _with_note(plan, f"memory: predicted peak per rank (GiB) {peaks}")


def _excess(plan: StagePlan, graph: LayerGraph, settings: MemorySettings,
            cap: float | None) -> list[float]:
    """Per stage, how far its rank's predicted peak is above ``cap`` (0 within it)."""
    over = [0.0] * plan.num_stages
    if cap is None:
        return over
    for r in predict_memory(plan, graph, settings):
        for st in r.stages:
            over[st] = max(0.0, math.ceil(r.total - cap)) / len(r.stages)
    return over


def _with_note(plan: StagePlan, note: str) -> StagePlan:
    return replace(plan, notes=(*plan.notes, note))


def what_fits(graph: LayerGraph, settings: MemorySettings, cap: float, *,
              max_partitions: int | None = None) -> list[str]:
    """What would make a model that does not fit ``cap`` fit: more partitions, ``optimize:
    memory``, or more microbatches (each tried with the memory planner and the memory model,
    one change at a time, smallest first). Empty when nothing tried fits."""
    out = []
    k = settings.partitions * settings.virtual_stages
    groups = sum(1 for g in graph.groups() if any(not graph.nodes[n].is_input for n in g))
    limit = min(groups, max_partitions or 4 * settings.partitions)
    for p in range(settings.partitions + 1, limit // settings.virtual_stages + 1):
        peak = _worst(graph, replace(settings, partitions=p), cap)
        if peak is not None:
            out.append(f"partitions={p} (largest rank {peak / 2**30:.2f} GiB)")
            break
    if settings.optimize == "speed":
        peak = _worst(graph, replace(settings, optimize="memory"), cap, k)
        if peak is not None:
            out.append(f"optimize='memory' (largest rank {peak / 2**30:.2f} GiB)")
    m = settings.microbatches * 2
    while m <= settings.batch_size:
        if settings.batch_size % m == 0:
            peak = _worst(graph, replace(settings, microbatches=m), cap, k)
            if peak is not None:
                out.append(f"microbatches={m} (largest rank {peak / 2**30:.2f} GiB)")
                break
        m *= 2
    return out


def _worst(graph: LayerGraph, settings: MemorySettings, cap: float,
           num_stages: int | None = None) -> int | None:
    """The largest rank's predicted peak of the memory plan under ``settings``, if it fits."""
    from tfsmp.errors import PartitionError
    from tfsmp.partitioning.planner import plan_graph

    k = num_stages or settings.partitions * settings.virtual_stages
    try:
        plan = plan_graph(graph, k, optimize="memory", optimizer=settings.optimizer,
                          batch_size=settings.batch_size, memory=settings, memory_cap=cap)
    except PartitionError:
        return None
    worst = max(r.total for r in predict_memory(plan, graph, settings))
    return worst if worst <= cap else None
