"""What the runtime will do for a configuration, described once: read by the runtime and the memory model.

Example::

    run = RunPlan.of("zb-h1", partitions=4, microbatches=8)
    run.compute                  # {rank: [Action, ...]}: the order the runtime executes
    run.placement.stages(0)      # [0]
    run.split_stages             # frozenset({0, 1, 2, 3}): stages with W actions
    run.direct_possible(0)       # False: several microbatches keep accumulators
    run.keeps_accumulators(0, optimizer_allows_direct=True)   # True
    run.lowered(plan, data_parallel=False)                    # `Lowered`, for one rank's executor

[Note: one description of the run] The runtime (`tfsmp.runtime.setup.make_schedule`, the
engine's choice between accumulators and direct updates) and the memory model
(`tfsmp.partitioning.memory`) used to assemble the schedule and decide direct updates each by
their own copy of the rules, and the copies drifted. Both now ask a `RunPlan`:

* the schedule actually run: the registered pipeline's compute actions ([Note: pipeline
  registry]) with the last stage's backward fused after its forward ([Note: fused last stage]
  in generators.py), for the step's microbatch count;
* which stages are split (``W`` actions: [Note: split stages] in tfsmp/runtime/stage.py);
* which ranks may update their variables inside their backward instead of keeping one
  accumulator per trainable variable ([Note: direct update] in tfsmp/runtime/memory.py): one
  microbatch, one data-parallel replica, one unsplit stage on the rank, no tied copies and
  ``nonfinite='raise'`` (with or without XLA) -- and, known only where the optimizer is (the
  runtime, or a caller that names it), an optimizer that can update variable by variable (no
  ``global_clipnorm``, ``gradient_accumulation_steps``, ``use_ema`` or loss scaling);
* which microbatches' backwards an unsplit stage splits at the step's end ([Note: drain split]
  in tfsmp/runtime/executor.py): ``drain``, 0 in memory mode and where the plan's memory check
  found the run fits its cap only without them (`tfsmp.partitioning.memory_check.check_memory`).

Pure: imports neither TensorFlow nor mpi4py.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from tfsmp.schedule.actions import Op, Schedule
from tfsmp.schedule.generators import fuse_last_stage, generate
from tfsmp.schedule.links import Links
from tfsmp.schedule.lowering import Lowered, lower
from tfsmp.schedule.placement import Placement
from tfsmp.schedule.registry import get

__all__ = ["DRAIN", "RunPlan", "drain_count"]

DRAIN = 2  # microbatches whose W an unsplit stage runs after its last backward ([Note: drain split])


@dataclass(frozen=True)
class RunPlan:
    """One description of the run ([Note: one description of the run])."""

    pipeline: str
    num_ranks: int
    num_microbatches: int
    chunks: int  # model chunks (stages) per rank
    placement: Placement
    compute: Schedule  # what the runtime executes: fused last stage, W actions where split
    active_microbatches: int | None = None
    data_parallel: int = 1
    tied: bool = False  # some trainable variable has copies on several stages
    nonfinite: str = "raise"
    drain: int = 0  # [Note: drain split] in tfsmp/runtime/executor.py

    @classmethod
    def of(cls, pipeline: str, partitions: int, microbatches: int, *, virtual_stages: int = 1,
           active_microbatches: int | None = None, data_parallel: int = 1, tied: bool = False,
           nonfinite: str = "raise", drain: int = 0) -> RunPlan:
        """The run of ``pipeline`` over ``partitions`` ranks at ``microbatches`` per step.

        Raises:
            ScheduleError: an unknown pipeline or an argument out of range (`generate`'s).
        """
        chunks = get(pipeline).chunks_for(virtual_stages)
        compute = fuse_last_stage(generate(pipeline, partitions, microbatches,
                                           virtual_stages=chunks,
                                           active_microbatches=active_microbatches))
        return cls(pipeline, partitions, microbatches, chunks,
                   Placement.for_pipeline(pipeline, partitions, chunks), compute,
                   active_microbatches, data_parallel, tied, nonfinite, drain)

    @classmethod
    def for_config(cls, config: Any, *, data_parallel: int = 1, tied: bool = False,
                   microbatches: int | None = None, drain: bool = True) -> RunPlan:
        """The run a `tfsmp.config.Config` asks for (``microbatches``: a step of another
        count, as a batch too small for the config's; ``drain``: False where the plan fits
        its memory cap only without the drain split, `StagePlan.drain_split`)."""
        return cls.of(config.pipeline, config.partitions, microbatches or config.microbatches,
                      virtual_stages=config.virtual_stages,
                      active_microbatches=config.active_microbatches,
                      data_parallel=data_parallel, tied=tied, nonfinite=config.nonfinite,
                      drain=drain_count(config.optimize) if drain else 0)

    def with_microbatches(self, microbatches: int) -> RunPlan:
        """The same run for a step of ``microbatches`` (a short batch runs fewer)."""
        if microbatches == self.num_microbatches:
            return self
        compute = fuse_last_stage(generate(self.pipeline, self.num_ranks, microbatches,
                                           virtual_stages=self.chunks,
                                           active_microbatches=self.active_microbatches))
        return replace(self, num_microbatches=microbatches, compute=compute)

    # -- what each rank does -------------------------------------------------------------------

    @property
    def split_stages(self) -> frozenset[int]:
        """Stages whose backward is split into B and W ([Note: split stages])."""
        return frozenset(a.stage for actions in self.compute.values() for a in actions
                         if a.op is Op.WEIGHT)

    def drain_microbatches(self, stage: int) -> frozenset[int]:
        """The microbatches whose backward ``stage`` splits at the step's end ([Note: drain
        split] in tfsmp/runtime/executor.py): its last ``drain`` backwards, on a stage without
        W actions whose producer is on another rank. (The executor also needs the stage to
        send gradients there, which only its lowered actions say: this is the memory model's
        upper bound.)"""
        if not self.drain or stage == 0 or stage in self.split_stages:
            return frozenset()
        if self.placement.rank(stage - 1) == self.placement.rank(stage):
            return frozenset()
        order = [a.microbatch for a in self.compute.get(self.placement.rank(stage), [])
                 if a.stage == stage and a.op is Op.BACKWARD and a.microbatch is not None]
        return frozenset(order[-self.drain:])

    def stages(self, rank: int) -> list[int]:
        return self.placement.stages(rank)

    def direct_possible(self, rank: int) -> bool:
        """Whether ``rank``'s stages may update inside their backward, if the optimizer allows
        ([Note: one description of the run]); when not, they keep accumulators: where late
        weights are possible, at one microbatch and one replica."""
        return self.num_microbatches == 1 and self.data_parallel == 1 and self.late_possible(rank)

    def late_possible(self, rank: int) -> bool:
        """Whether ``rank``'s linear layers may take their weight gradients at the step's end
        ([Note: weights at the step's end] in tfsmp/runtime/stage.py): `direct_possible` at
        any microbatch and replica count ([Note: late weights across replicas] in stage.py);
        at one of each, where both are possible, a stage takes late weights where they pay and
        updates directly otherwise ([Note: late before direct] in stage.py). The memory model
        asks the same."""
        return (len(self.stages(rank)) == 1
                and not (self.split_stages & set(self.stages(rank)))
                and not self.tied and self.nonfinite == "raise")

    def updates_directly(self, rank: int, optimizer_allows_direct: bool) -> bool:
        """Whether ``rank`` updates its variables in its backward (then it keeps no
        accumulators); ``optimizer_allows_direct``: the optimizer updates variable by variable
        (`tfsmp.runtime.memory.DirectUpdate.possible`, and no loss scaling)."""
        return optimizer_allows_direct and self.direct_possible(rank)

    def keeps_accumulators(self, stage: int, optimizer_allows_direct: bool) -> bool:
        """Whether ``stage`` keeps one gradient accumulator per trainable variable."""
        return not self.updates_directly(self.placement.rank(stage), optimizer_allows_direct)

    def lowered(self, links: Links | None, data_parallel: bool | None = None) -> Lowered:
        """Every rank's lowered actions (sends, receives, REDUCE, STEP) for the plan's stage
        graph ``links``, with the placement they were lowered for."""
        dp = self.data_parallel > 1 if data_parallel is None else data_parallel
        return Lowered(lower(self.compute, links, self.num_ranks, data_parallel=dp,
                             placement=self.placement), self.placement)


def drain_count(optimize: str) -> int:
    """How many microbatches' backwards an unsplit stage splits ([Note: drain split] in
    tfsmp/runtime/executor.py): `DRAIN` in speed mode; none in memory mode, whose backward
    recomputes the forward, where the W's inputs would be held beyond what the stage holds."""
    return DRAIN if optimize == "speed" else 0
