"""The typed seam between the executor (which drives stage programs) and the engine (which reduces and steps).

Example::

    class Engine:                       # satisfies StepHooks
        def reduce(self, stage: int, result: StageResult) -> None: ...
        def apply(self, result: StepResult) -> None: ...

    executor.run(microbatches, mode=StepMode(train=True, scale=1 / 8), hooks=engine)

[Note: one driver] Only the executor calls a `StageProgram` during a step: it starts the step on
every program with the step's `StepMode` (loss scale, whether `smp.step` collects per-microbatch
gradients), runs the actions, and hands each stage's `StageResult` to ``hooks.reduce`` at the
stage's REDUCE action and the whole `StepResult` to ``hooks.apply`` at STEP. The engine reads
gradients' finiteness, sparse rows and collected gradients from those results, never from the
programs' attributes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

__all__ = ["StageResult", "StepHooks", "StepMode"]


@dataclass(frozen=True)
class StepMode:
    """What kind of step the executor runs: how each program must behave for it."""

    train: bool = True
    scale: float = 1.0     # each microbatch loss times this (1/(m·d) for a mean loss)
    collect: bool = False  # `smp.step`: keep every microbatch's weight gradients, do not sum


@dataclass
class StageResult:
    """What one stage produced in one training step.

    ``sparse`` maps a trainable-variable index to its (values, indices) parts in batch order
    ([Note: sparse gradients] in stage.py); a reduction may replace the parts (every replica's
    rows) in place. ``collected`` (collect mode) maps a microbatch to its weight gradients.
    """

    stage: int
    finite: bool = True
    first_nonfinite: int | None = None  # first microbatch after which an accumulator was not
    sparse: dict[int, list[tuple[Any, Any]]] = field(default_factory=dict)
    collected: dict[int, list[Any]] = field(default_factory=dict)


class StepHooks(Protocol):
    """What the executor calls at a schedule's REDUCE and STEP actions."""

    def reduce(self, stage: int, result: StageResult) -> None:
        """Reduce ``stage``'s gradients over its data-parallel replicas (REDUCE)."""

    def apply(self, result: Any) -> None:
        """Apply the step's gradients (STEP); ``result`` is the executor's `StepResult`."""
