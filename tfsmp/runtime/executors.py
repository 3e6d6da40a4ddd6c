"""The executors of one rank, one per schedule it runs, kept from step to step.

Example::

    executors = Executors(schedules, programs, plan, comm.pipeline, placement, rank_tag="[rank 0]")
    executors.training(4)        # the lowered training schedule of a 4-microbatch step
    executors.idle(4)            # only its REDUCE and STEP: a replica without rows
    executors.forward(4)         # predict and evaluate
    executors.last               # the one that ran the last training or smp.step step

An executor keeps its receive buffers between steps ([Note: receive buffers] in buffers.py),
so each schedule keeps its executor.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from tfsmp.runtime.executor import Executor
from tfsmp.schedule.actions import Action, Op
from tfsmp.schedule.lowering import Lowered, forward_only

if TYPE_CHECKING:
    from tfsmp.comm.base import Group
    from tfsmp.partitioning.plan import StagePlan
    from tfsmp.runtime.dynamic_shapes import BoundaryShapes
    from tfsmp.runtime.stage import StageProgram
    from tfsmp.schedule.placement import Placement
    from tfsmp.timeline.events import Tracer

__all__ = ["Executors"]


class Executors:
    """Every schedule's executor on this rank. See the module docstring."""

    def __init__(self, schedules: Callable[[int], Lowered], programs: dict[int, StageProgram],
                 plan: StagePlan, group: Group, placement: Placement, *, num_ranks: int,
                 rank_tag: str, shapes: BoundaryShapes | None, drain: int = 0) -> None:
        """``drain``: `RunPlan.drain` ([Note: drain split] in executor.py)."""
        self.schedules = schedules
        self.programs = programs
        self.plan = plan
        self.group = group
        self.placement = placement
        self.num_ranks = num_ranks
        self.rank_tag = rank_tag
        self.drain = drain
        self.shapes = shapes
        self.stall_timeout = 600.0
        self.tracer: Tracer | None = None
        self.last: Executor | None = None  # the one that ran the last training step
        self.cache: dict[tuple[int, int], Executor] = {}
        self._actions: dict[tuple[str, int], list[Action]] = {}

    def actions(self, m: int) -> list[Action]:
        """This rank's lowered training actions for a step of ``m`` microbatches."""
        key = ("train", m)
        if key not in self._actions:
            self._actions[key] = self.schedules(m).actions[self.group.rank]
        return self._actions[key]

    def training(self, m: int) -> Executor:
        return self._for(self.actions(m), m)

    def idle(self, m: int) -> Executor:
        """A replica without rows: only the reductions and the step of an ``m``-microbatch
        schedule, in its order."""
        key = ("idle", m)
        if key not in self._actions:
            self._actions[key] = [a for a in self.actions(m) if a.op in (Op.REDUCE, Op.STEP)]
        return self._for(self._actions[key], 0)

    def forward(self, m: int) -> Executor:
        """Inference: every stage's forward of ``m`` microbatches."""
        key = ("forward", m)
        if key not in self._actions:
            self._actions[key] = forward_only(self.plan, self.placement, self.group.rank, m)
        return self._for(self._actions[key], m, track=False)

    def _for(self, actions: list[Action], m: int, track: bool = True) -> Executor:
        ex = self.cache.get((id(actions), m))
        if ex is None:
            ex = self.cache[(id(actions), m)] = Executor(
                actions, self.programs, self.plan, self.group, self.num_ranks, m,
                placement=self.placement, rank_tag=self.rank_tag, shapes=self.shapes,
                drain=self.drain)
        # read each step, as a new executor did: the limit and the tracer may change between steps
        ex.stall_timeout, ex.tracer = self.stall_timeout, self.tracer
        if track:
            self.last = ex
        return ex
