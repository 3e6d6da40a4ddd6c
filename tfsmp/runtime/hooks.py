"""The typed seam between the executor (which drives stage programs) and the engine (which reduces and steps).

Example::

    class Engine:                       # satisfies StepHooks
        def reduce(self, stage: int, result: StageResult) -> None: ...
        def apply(self, result: StepResult) -> None: ...

    executor.run(microbatches, mode=StepMode(train=True), hooks=engine)

[Note: one driver] Only the executor calls a `StageProgram` during a step: it starts the step on
every program with the step's `StepMode` (whether `smp.step` collects per-microbatch gradients),
runs the actions, and hands each stage's `StageResult` to ``hooks.reduce`` at the stage's REDUCE
action and the whole `StepResult` to ``hooks.apply`` at STEP. The engine reads and replaces
gradients only through the result's `GradientState` ([Note: gradient state] in gradients.py),
never through the programs' attributes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from tfsmp.runtime.gradients import GradientState

__all__ = ["StageResult", "StepHooks", "StepMode"]


@dataclass(frozen=True)
class StepMode:
    """What kind of step the executor runs: how each program must behave for it."""

    train: bool = True
    collect: bool = False  # `smp.step`: keep every microbatch's weight gradients, do not sum


@dataclass
class StageResult:
    """What one stage produced in one training step: its finiteness and its gradients, owned
    by ``grads`` ([Note: gradient state] in gradients.py), combined over its microbatches."""

    stage: int
    finite: bool
    first_nonfinite: int | None  # first microbatch after which an accumulator was not finite
    grads: GradientState


class StepHooks(Protocol):
    """What the executor calls at a schedule's REDUCE and STEP actions."""

    def reduce(self, stage: int, result: StageResult) -> None:
        """Reduce ``stage``'s gradients over its data-parallel replicas (REDUCE)."""

    def apply(self, result: Any) -> None:
        """Apply the step's gradients (STEP); ``result`` is the executor's `StepResult`."""
