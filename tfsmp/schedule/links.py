"""`StageLinks`: which stages send activations to which, so schedules can be lowered without a model.

Example::

    links = StageLinks.chain(4)                          # 0 -> 1 -> 2 -> 3
    skip = StageLinks(3, {0: [1, 2], 1: [2]})            # stage 0 also feeds stage 2 directly
    skip.peers_forward(0), skip.peers_backward(2)        # ([1, 2], [0, 1])

A `tfsmp.partitioning.plan.StagePlan` answers the same two questions from its boundaries, so
everything here that takes links also takes a plan (see `Links`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from tfsmp.errors import ScheduleError

__all__ = ["Links", "StageLinks", "as_links"]


class Links(Protocol):
    """What lowering, validation and simulation need to know about the stage graph."""

    @property
    def num_stages(self) -> int: ...

    def peers_forward(self, stage: int) -> list[int]: ...

    def peers_backward(self, stage: int) -> list[int]: ...


@dataclass(frozen=True)
class StageLinks:
    """Stage graph as ``forward[s]`` = the later stages that read a tensor stage ``s`` produces."""

    num_stages: int
    forward: Mapping[int, Sequence[int]]

    def __post_init__(self) -> None:
        if self.num_stages < 1:
            raise ScheduleError(
                f"StageLinks needs at least one stage. Received: num_stages={self.num_stages}")
        for s, consumers in self.forward.items():
            for c in consumers:
                if not 0 <= s < c < self.num_stages:
                    raise ScheduleError(
                        f"Links must go from a stage to a later stage in [0, {self.num_stages}). "
                        f"Received: {s} -> {c}")

    @classmethod
    def chain(cls, num_stages: int) -> StageLinks:
        """The default pipeline: each stage feeds the next one."""
        return cls(num_stages, {s: [s + 1] for s in range(num_stages - 1)})

    def peers_forward(self, stage: int) -> list[int]:
        """Stages this stage sends activations to, ascending."""
        return sorted(set(self.forward.get(stage, ())))

    def peers_backward(self, stage: int) -> list[int]:
        """Stages this stage receives activations from (and sends gradients to), ascending."""
        return sorted(s for s, consumers in self.forward.items() if stage in consumers)


def as_links(plan: Links | None, num_stages: int) -> Links:
    """``plan`` itself, or the chain over ``num_stages`` when it is None.

    Raises:
        ScheduleError: ``plan`` has a different number of stages than the schedule.
    """
    if plan is None:
        return StageLinks.chain(num_stages)
    if plan.num_stages != num_stages:
        raise ScheduleError(
            f"The plan and the schedule must have the same number of stages. Received: "
            f"plan.num_stages={plan.num_stages}, schedule stages={num_stages}. A schedule for p "
            f"ranks and v virtual stages has p·v stages; partition into that many.")
    return plan
