"""METIS planner: its repair steps keep stages ordered, non-empty, connected and balanced."""

from __future__ import annotations

import graphs
import pytest

from tfsmp.graph.ir import LayerGraph
from tfsmp.partitioning import metis
from tfsmp.partitioning.planner import Problem, build_problem


def _ordered(p: Problem, stage: list[int]) -> bool:
    return all(stage[c] >= stage[g] for g in range(len(p)) for c in p.succ[g])


def test_metis_parts_a_chain_into_runs() -> None:
    p = build_problem(graphs.chain(12))
    parts = metis.metis_parts(p, 3)
    assert sorted(set(parts)) == [0, 1, 2]
    runs = [parts[i] for i in range(12) if i == 0 or parts[i] != parts[i - 1]]
    assert len(runs) == 3  # each part one run: METIS cut the chain twice


@pytest.mark.parametrize("seed", range(6))
def test_both_repairs_order_any_wanted_stages(seed: int) -> None:
    p = build_problem(graphs.random_dag(80, seed=seed))
    wanted = [(7 * g + seed) % 4 for g in range(len(p))]  # deliberately scrambled
    for stage in (metis._push_forward(p, wanted), metis._pull_back(p, wanted)):
        assert _ordered(p, stage)


def test_push_forward_is_the_least_ordered_assignment_above_wanted() -> None:
    p = build_problem(graphs.chain(4))
    assert metis._push_forward(p, [1, 0, 2, 0]) == [1, 1, 2, 2]
    assert metis._pull_back(p, [1, 0, 2, 0]) == [0, 0, 0, 0]


def test_fill_empty_gives_every_stage_a_group_and_keeps_order() -> None:
    p = build_problem(graphs.random_dag(40, seed=3))
    for start in ([0] * len(p), [3] * len(p), [0] * 20 + [3] * (len(p) - 20)):
        stage = list(start)
        metis._fill_empty(p, stage, 4)
        assert sorted(set(stage)) == [0, 1, 2, 3]
        assert _ordered(p, stage)


def _split_branch() -> LayerGraph:
    """x -> a -> b -> d -> e and x -> c -> d: stage {b, c} is two pieces."""
    g = LayerGraph(name="branch")
    x = g.add_input("x", (16,))
    (a,) = graphs.add(g, "a", [x])
    (b,) = graphs.add(g, "b", [a])
    (c,) = graphs.add(g, "c", [x], flops=10.0)
    (d,) = graphs.add(g, "d", [b, c])
    (e,) = graphs.add(g, "e", [d])
    g.set_outputs([e])
    return g


def test_connect_moves_a_disconnected_piece_to_a_stage_it_touches() -> None:
    p = build_problem(_split_branch())
    names = [grp[0] for grp in p.groups]
    stage = [{"a": 0, "b": 1, "c": 1, "d": 2, "e": 2}[n] for n in names]
    load = p.load(stage, 3)
    assert len(metis._components(load, 1)) == 2
    metis._connect(load)
    assert all(len(metis._components(load, s)) == 1 for s in range(3))
    assert _ordered(p, load.stage)
    assert load.stage[names.index("b")] == 1  # the heavier piece stays


def test_refine_balances_a_lopsided_chain() -> None:
    p = build_problem(graphs.chain(8))
    load = p.load([0, 0, 0, 0, 0, 0, 0, 1], 2)
    metis._refine(load, contiguous=True)
    assert sorted(len(m) for m in load.members) == [4, 4]
    assert _ordered(p, load.stage)


@pytest.mark.parametrize("contiguous", [True, False])
def test_partition_metis_is_ordered_and_non_empty(contiguous: bool) -> None:
    for seed in range(5):
        p = build_problem(graphs.random_dag(120, seed=seed, window=30))
        for k in (2, 4, 7):
            stage = metis.partition_metis(p, k, contiguous=contiguous)
            assert sorted(set(stage)) == list(range(k))
            assert _ordered(p, stage)


def test_partition_metis_handles_one_stage_and_one_group_per_stage() -> None:
    p = build_problem(graphs.chain(5))
    assert metis.partition_metis(p, 1) == [0] * 5
    assert metis.partition_metis(p, 5) == [0, 1, 2, 3, 4]
