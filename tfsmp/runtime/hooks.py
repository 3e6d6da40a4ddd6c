"""The typed seam between the executor (which drives stage programs) and the engine (which reduces and steps).

Example::

    class Engine:                       # satisfies StepHooks
        def reduce(self, stage: int, result: StageResult) -> None: ...
        def apply(self, result: StepResult) -> None: ...

    executor.run(microbatches, mode=StepMode(train=True), hooks=engine)

    def head(last: LastStage) -> Any:   # smp.step's last stage, one microbatch
        out = last.forward(training=True)       # differentiable under the caller's tape
        last.finish(grads_of(last.differentiable))
        return out.outputs

    executor.run(microbatches, mode=StepMode(train=True, collect=True), head=head)

[Note: one driver] Only the executor calls a `StageProgram` during a step: it starts the step on
every program with the step's `StepMode` (whether `smp.step` collects per-microbatch gradients),
runs the actions, and hands each stage's `StageResult` to ``hooks.reduce`` at the stage's REDUCE
action and the whole `StepResult` to ``hooks.apply`` at STEP. The engine, the reduction, the
tied-copy sum and `smp.step` read and replace gradients only through the result's
`GradientState` ([Note: results own their gradients] in gradients.py), never through a
program's attributes.

[Note: the head] `smp.step` runs the user's step body in place of the last stage's fused loss.
It gets a `LastStage` for one microbatch: the stage's forward (differentiable under the body's
tape) and a place for the gradients of the received tensors, and nothing else of the program.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import tensorflow as tf

    from tfsmp.runtime.executor import StepResult
    from tfsmp.runtime.gradients import GradientState
    from tfsmp.runtime.stage import EvalOutput, StageProgram
    from tfsmp.runtime.view import RankView

__all__ = ["Head", "LastStage", "StageResult", "StepHooks", "StepMode", "StepRuntime"]


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
    # the first microbatch to blame for non-finite gradients (-1: none can be named, [Note:
    # finite flags] in stage.py), None when they are finite
    first_nonfinite: int | None
    grads: GradientState


class StepHooks(Protocol):
    """What the executor calls at a schedule's REDUCE and STEP actions."""

    def reduce(self, stage: int, result: StageResult) -> None:
        """Reduce ``stage``'s gradients over its data-parallel replicas (REDUCE)."""

    def apply(self, result: StepResult) -> None:
        """Apply the step's gradients (STEP); ``result`` is the executor's `StepResult`."""


class LastStage:
    """The last stage of one microbatch, as a custom head sees it ([Note: the head])."""

    def __init__(self, program: StageProgram, microbatch: int, inputs: list[tf.Tensor],
                 received: list[tf.Tensor]) -> None:
        self._program = program
        self.microbatch = microbatch
        self._inputs = inputs
        self._received = received

    @property
    def differentiable(self) -> list[tf.Tensor]:
        """The received tensors that carry gradients (floating point), in boundary order."""
        return self._program.diff_recv(self._received)

    def forward(self, training: bool) -> EvalOutput:
        """The stage's forward on this microbatch, differentiable under a caller's tape."""
        return self._program.evaluate(self._inputs, self._received, training=training)

    def finish(self, grads: Sequence[tf.Tensor | None]) -> None:
        """Keeps the gradients of `differentiable` (None: zero) for the stage's backward."""
        self._program.finish_head(self.microbatch, self._inputs, self._received, list(grads))


class Head(Protocol):
    """A custom last stage: runs on each microbatch, returns what the step keeps as its
    outputs (`StepResult.outputs`)."""

    def __call__(self, last: LastStage) -> Any: ...


class StepRuntime(Protocol):
    """What `smp.step` (tfsmp/keras/step.py) asks of the runtime: run the microbatches with a
    custom last stage, then hand back this rank's gradients per microbatch, already reduced.
    The API layer keeps no runtime bookkeeping (stage offsets, replica means)."""

    @property
    def view(self) -> RankView: ...

    def run_step(self, inputs: list[dict[str, Any]], head: Head, train: bool = True
                 ) -> StepResult:
        """Runs one step of ``inputs[i]`` (microbatch i's model inputs by tensor key)."""

    def step_gradients(self, result: StepResult, body: Mapping[int, Sequence[Any]]
                       ) -> list[list[tf.Tensor]]:
        """Per microbatch, this rank's weight gradients in `model.trainable_variables` order
        (``body[i]``: what microbatch i's step body returned as its gradient list on the last
        stage's rank), averaged over the data-parallel replicas unless Horovod reduces them."""
