"""`RankView` (tfsmp/runtime/view.py): a rank's stages, their variables by checkpoint key, the
writer of each key, and the groups, as checkpoints and the Keras API read them.

One process: a real partitioned `DistributedModel` at p=1 with two virtual stages (both on this
rank), and views of every rank of a 2 × 2 grid built over the threaded local backend (no step
runs, only ranks and sizes are read) to check one writer per key across the job, ties included.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from types import SimpleNamespace

import numpy as np
import pytest

keras = pytest.importorskip("keras")
tf = pytest.importorskip("tensorflow")
pytestmark = pytest.mark.tf


def _shared_dense() -> keras.Model:
    """x -> shared -> bn -> a -> b -> shared -> head: a Dense tied across the model, a
    BatchNormalization for non-trainable variables."""
    keras.utils.set_random_seed(0)
    x = keras.Input((8,), name="x")
    shared = keras.layers.Dense(8, activation="tanh", name="shared")
    h = keras.layers.BatchNormalization(name="bn")(shared(x))
    for name in ("a", "b"):
        h = keras.layers.Dense(8, activation="relu", name=name)(h)
    return keras.Model(x, keras.layers.Dense(3, name="head")(shared(h)), name="shared_dense")


@pytest.fixture(scope="module")
def partitioned() -> Iterator[object]:
    import tfsmp

    if tfsmp.is_initialized():
        tfsmp.shutdown()
    tfsmp.init({"partitions": 1, "virtual_stages": 2, "pipeline": "interleaved",
                "microbatches": 2})
    dm = tfsmp.DistributedModel(_shared_dense())
    dm.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    dm.partition(np.zeros((4, 8), "float32"))
    yield dm
    tfsmp.shutdown()


def test_the_view_lists_this_ranks_stages_and_their_variables_as_the_programs_hold_them(
        partitioned: object) -> None:
    engine = partitioned._engine  # type: ignore[attr-defined]
    view = partitioned.rank_view  # type: ignore[attr-defined]
    assert view is engine.view  # built once
    assert (view.world_rank, view.pipeline_rank, view.pipeline_size) == (0, 0, 1)
    assert (view.data_rank, view.data_size, view.num_stages) == (0, 1, 2)
    assert [s.stage for s in view.stages] == [0, 1] == sorted(engine.programs)
    assert [s.is_last for s in view.stages] == [False, True]
    assert view.last_rank == 0 and view.is_last_rank
    for s in view.stages:
        prog = engine.programs[s.stage]
        assert [id(v) for v in s.trainable.values()] == [id(v) for v in prog.trainable]
        assert [id(v) for v in s.non_trainable.values()] == [id(v) for v in prog.non_trainable]
        assert set(s.layers) == set(engine.plan.layers(s.stage))
        for key, v in s.variables.items():
            assert view.keys[id(v)] == key
    bn = {k for s in view.stages for k in s.non_trainable}
    assert bn == {"bn/moving_mean", "bn/moving_variance"}
    # the optimizer's list: each variable once (the tied `shared` counts at its first stage)
    assert [id(v) for v in view.trainable_variables] == [id(v) for v in engine.variables]
    assert [id(v) for v in partitioned.trainable_variables] == [  # type: ignore[attr-defined]
        id(v) for v in engine.variables]
    comm = engine.comm
    assert (view.groups.world, view.groups.pipeline, view.groups.data) == (
        comm.world, comm.pipeline, comm.data)


def test_one_process_holds_and_writes_every_key(partitioned: object) -> None:
    view = partitioned.rank_view  # type: ignore[attr-defined]
    model_keys = {"shared/kernel", "shared/bias", "bn/gamma", "bn/beta", "bn/moving_mean",
                  "bn/moving_variance", "a/kernel", "a/bias", "b/kernel", "b/bias",
                  "head/kernel", "head/bias"}
    assert set(view.variables) == model_keys
    assert set(view.held) == set(view.writes) == model_keys
    assert set(view.writer.values()) == {0}
    assert view.key_stage["shared/kernel"] == 0  # a tie is keyed at its lowest stage


def test_the_view_is_read_only(partitioned: object) -> None:
    view = partitioned.rank_view  # type: ignore[attr-defined]
    with pytest.raises(dataclasses.FrozenInstanceError):
        view.pipeline_rank = 1
    with pytest.raises(TypeError):
        view.writer["a/kernel"] = 3
    with pytest.raises(TypeError):
        view.stages[0].trainable["x"] = None


def test_checkpoints_read_the_view(partitioned: object) -> None:
    """The checkpoint's layout is the model's RankView itself, not a copy of it."""
    from tfsmp.checkpoint import store

    view = partitioned.rank_view  # type: ignore[attr-defined]
    layout, slots, globals_, _ = store._tables(partitioned, None, {})
    assert layout is view and not slots and not globals_
    assert layout.held == view.held and layout.writes == view.writes
    assert dict(layout.key_stage) == dict(view.key_stage) and dict(layout.keys) == dict(view.keys)


def test_summary_and_plan_come_from_the_view(partitioned: object) -> None:
    lines: list[str] = []
    partitioned.summary(print_fn=lines.append)  # type: ignore[attr-defined]
    assert lines[0].startswith("DistributedModel 'distributed_shared_dense': 2 stages")
    assert partitioned.plan is partitioned.rank_view.plan  # type: ignore[attr-defined]


# -- every rank of a 2 x 2 grid ------------------------------------------------------------------

def _grid_views(strategy: str, kind: str) -> list[object]:
    """The view of every world rank of partitions=2 with 4 stages and 2 replicas; `shared` is
    read on stages 0 and 3 (a tie), so under `interleaved` both pipeline ranks hold a copy."""
    from tfsmp.comm.local import create_local_comms
    from tfsmp.graph.tracer import trace
    from tfsmp.partitioning.plan import StagePlan
    from tfsmp.runtime.view import RankView
    from tfsmp.schedule.placement import Placement
    from tfsmp.topology import Topology

    traced = trace(_shared_dense())
    assignment = {"shared": 0, "bn": 0, "a": 1, "b": 2, "shared@1": 3, "head": 3}
    plan = StagePlan.from_assignment(traced.graph, assignment, 4, planner="test")
    config = SimpleNamespace(partitions=2, placement_strategy=strategy, horovod=False)
    comms = create_local_comms(Topology(4, 2, strategy))
    return [RankView.build(traced, plan, c, config, Placement(2, 4, kind)) for c in comms]


@pytest.mark.parametrize(("strategy", "kind"),
                         [("cluster", "interleaved"), ("spread", "interleaved"), ("cluster", "v")])
def test_every_key_has_one_writer_in_the_job_ties_included(strategy: str, kind: str) -> None:
    from tfsmp.schedule.placement import Placement
    from tfsmp.topology import Topology

    views = _grid_views(strategy, kind)
    topo, placement = Topology(4, 2, strategy), Placement(2, 4, kind)
    for v in views:
        assert v.placement == placement
        assert [s.stage for s in v.stages] == placement.stages(v.pipeline_rank)
        assert (v.pipeline_rank, v.data_rank) == (topo.pipeline_rank_of(v.world_rank),
                                                  topo.data_rank_of(v.world_rank))
        assert v.last_rank == placement.rank(3)
    writes = [k for v in views for k in v.writes]
    assert sorted(writes) == sorted(views[0].variables)  # each key exactly once in the job
    by_key = {k: v.world_rank for v in views for k in v.writes}
    assert by_key == dict(views[0].writer)
    # the writer: data rank 0 of the pipeline rank that runs the key's lowest stage
    for key, s in views[0].key_stage.items():
        assert views[0].writer[key] == topo.rank_of(placement.rank(s), 0)
    assert views[0].key_stage["shared/kernel"] == 0  # the tie (stages 0 and 3) is written from 0
    holders = {v.world_rank for v in views if "shared/kernel" in v.held}
    assert holders == {topo.rank_of(placement.rank(s), d) for s in (0, 3) for d in (0, 1)}
    assert [v.world_rank for v in views if "shared/kernel" in v.writes] == [topo.rank_of(0, 0)]
