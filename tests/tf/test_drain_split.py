"""[Note: drain split] in tfsmp/runtime/executor.py: an unsplit stage that sends gradients to
another rank splits the backward of its last microbatches, and their W's run later.

The stage's gradients must be those of whole backwards (rtol 1e-6): the same sums, in the same
order, whichever microbatches were split, in speed mode (compiled and taped backward) and memory
mode; and the executor picks the last `DRAIN` backwards of each such stage, none of a split
(zero-bubble) stage's, and none of a stage that sends no gradients to another rank.
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfsmp.comm.local import create_local_comms
from tfsmp.graph.tracer import trace
from tfsmp.partitioning.plan import StagePlan
from tfsmp.runtime.executor import Executor
from tfsmp.schedule.run_plan import DRAIN, RunPlan
from tfsmp.topology import Topology

pytestmark = pytest.mark.tf
M, ROWS, WIDTH = 4, 8, 16


def _program(optimize: str, monkeypatch: pytest.MonkeyPatch, taped: bool) -> Any:
    """Stage 1 of 3 of a Dense stack: it receives activations and sends gradients."""
    from tfsmp.runtime.stage import StageProgram

    if taped:
        monkeypatch.setenv("TFSMP_TAPED_BACKWARD", "1")
    keras.utils.set_random_seed(0)
    x = keras.Input((WIDTH,), name="x")
    h = x
    for k in range(6):
        h = keras.layers.Dense(WIDTH, activation="relu", name=f"d{k}")(h)
    traced = trace(keras.Model(x, h))
    assignment = {f"d{k}": k // 2 for k in range(6)}
    plan = StagePlan.from_assignment(traced.graph, assignment, 3, planner="file")
    return StageProgram(traced, plan, 1, optimize=optimize)


def _gradients(prog: Any, drain: frozenset[int]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The stage's accumulated weight gradients and its input gradients after a step of M
    microbatches, forwards then backwards (as a drain runs them), W's of ``drain`` last."""
    from tfsmp.runtime.hooks import StepMode

    prog.begin_step(StepMode(train=True))
    prog.drain = drain
    consts = tf.constant([M * ROWS, ROWS, 1.0, 0.0])
    rng = np.random.default_rng(1)
    for i in range(M):
        prog.forward(i, [], [tf.constant(rng.standard_normal((ROWS, WIDTH), dtype=np.float32))],
                     consts)
    to_producer = []
    for i in range(M):
        dy = tf.constant(rng.standard_normal((ROWS, WIDTH), dtype=np.float32))
        to_producer += [np.asarray(g) for g in prog.backward(i, [dy])]
        assert prog.has_weight_work(i) == (i in drain)
    for i in sorted(drain):
        prog.weight(i)
    prog.result()
    return [np.asarray(a) for a in prog.accumulators], to_producer


@pytest.mark.parametrize(("optimize", "taped"), [("speed", False), ("speed", True),
                                                 ("memory", False)])
def test_split_microbatches_give_the_gradients_of_whole_backwards(
        optimize: str, taped: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    prog = _program(optimize, monkeypatch, taped)
    assert prog.replay == (optimize == "speed" and not taped)
    whole, sent = _gradients(prog, frozenset())
    for drain in (frozenset({2, 3}), frozenset(range(M)), frozenset({3})):
        got, got_sent = _gradients(prog, drain)
        for a, b in zip(got + got_sent, whole + sent):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def _drain_plans(pipeline: str, p: int, m: int, v: int = 1, drain: int = DRAIN
                 ) -> dict[int, dict[int, frozenset[int]]]:
    """Each rank's `Executor._drain_plan` for ``pipeline`` on a chain of stages; checks that
    the `RunPlan` (the memory model's source) names the same microbatches."""
    run = RunPlan.of(pipeline, p, m, virtual_stages=v, drain=drain)
    stages = run.placement.num_stages
    plan = StagePlan(stages, {f"l{s}": s for s in range(stages)}, (), (), "test")
    lowered = run.lowered(None, data_parallel=False)
    comms = create_local_comms(Topology(p, p, "cluster"))
    got = {r: Executor(lowered.actions[r], {}, plan, comms[r].pipeline, p, m,
                       placement=run.placement, drain=run.drain)._drain_plan() for r in range(p)}
    for s in range(stages):
        assert got[run.placement.rank(s)].get(s, frozenset()) == run.drain_microbatches(s)
    return got


def test_the_last_backwards_of_stages_that_send_gradients_to_another_rank() -> None:
    last = frozenset(range(8 - DRAIN, 8))
    assert _drain_plans("interleaved", 2, 8, drain=0) == {0: {}, 1: {}}  # memory mode, a cap
    assert _drain_plans("interleaved", 2, 8) == {0: {}, 1: {1: last}}
    assert _drain_plans("simple", 4, 8) == {0: {}, 1: {1: last}, 2: {2: last}, 3: {3: last}}
    assert _drain_plans("zb-h1", 2, 8) == {0: {}, 1: {}}  # its W's are the schedule's
    v2 = _drain_plans("interleaved", 2, 8, v=2)  # stages 0, 2 on rank 0; 1, 3 on rank 1
    assert v2 == {0: {2: last}, 1: {1: last, 3: last}}
    assert _drain_plans("interleaved", 2, 1) == {0: {}, 1: {1: frozenset({0})}}


def test_a_partition_file_keeps_its_drain_decision(tmp_path: Any) -> None:
    """A plan checked without the drain split (`tfsmp run --memory-per-rank`'s file) runs
    without it: `make_plan` rebuilds the file's assignment and keeps ``drain_split``, which
    the engine's `RunPlan` reads."""
    from dataclasses import replace

    from tfsmp.config import Config
    from tfsmp.runtime.setup import make_plan

    x = keras.Input((WIDTH,), name="x")
    h = x
    for k in range(4):
        h = keras.layers.Dense(WIDTH, name=f"d{k}")(h)
    traced = trace(keras.Model(x, h))
    plan = StagePlan.from_assignment(traced.graph, {f"d{k}": k // 2 for k in range(4)}, 2)
    for drain in (False, True):
        path = tmp_path / f"plan_{drain}.json"
        path.write_text(replace(plan, drain_split=drain).to_json())
        config = Config(partitions=2, optimize="speed", partition_file=str(path))
        got = make_plan(traced, config)
        assert got.drain_split is drain
        assert RunPlan.for_config(config, drain=got.drain_split).drain == (DRAIN if drain else 0)
