"""The contiguous DP equals brute force on every chain of up to 10 layers and 4 stages."""

from __future__ import annotations

import itertools
import random

import graphs
import pytest

from tfsmp.errors import PartitionError
from tfsmp.partitioning.contiguous import split_sequence
from tfsmp.partitioning.planner import Objective, better, build_problem, objective, plan_graph


def _splits(n: int, k: int) -> list[list[int]]:
    """Every split of n items into k non-empty runs, as stage-per-item lists."""
    out = []
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = [0, *cuts, n]
        out.append([s for s in range(k) for _ in range(bounds[s + 1] - bounds[s])])
    return out


def _brute_force(graph: graphs.LayerGraph, k: int, **kw: object) -> Objective:
    problem = build_problem(graph, **kw)  # type: ignore[arg-type]
    best: Objective | None = None
    for stage in _splits(len(problem), k):
        obj = problem.load(stage, k).objective()
        if best is None or better(obj, best):
            best = obj
    assert best is not None
    return best


def _random_chain(n: int, seed: int) -> graphs.LayerGraph:
    rng = random.Random(seed)
    return graphs.chain(
        n, flops=[rng.choice([rng.uniform(100, 10_000), 1000.0]) for _ in range(n)],
        widths=[rng.choice([1, 16, 64, 256]) for _ in range(n)],
        params=[rng.randint(0, 5000) for _ in range(n)])


CASES = [(n, k) for n in range(1, 11) for k in range(1, min(4, n) + 1)]


@pytest.mark.parametrize("optimize", ["speed", "memory"])
@pytest.mark.parametrize(("n", "k"), CASES)
def test_dp_planner_equals_brute_force_on_chains(n: int, k: int, optimize: str) -> None:
    for seed in range(4):
        g = _random_chain(n, seed * 100 + n * 10 + k)
        # the blended objective: an explicit memory_weight (without one, optimize="memory"
        # plans compute within a memory cap, [Note: memory plans])
        weight = 0.8 if optimize == "memory" else None
        plan = plan_graph(g, k, method="contiguous", optimize=optimize, memory_weight=weight)
        got = objective(g, plan.stage_of, k, optimize=optimize)
        want = _brute_force(g, k, optimize=optimize)
        assert not better(want, got), (n, k, seed, got, want)
        assert got[0] == pytest.approx(want[0], rel=1e-9)


def test_dp_equals_brute_force_on_equal_weights_with_ties() -> None:
    for n in range(1, 11):
        for k in range(1, min(4, n) + 1):
            g = graphs.chain(n)  # all equal: many optimal splits
            plan = plan_graph(g, k, method="contiguous")
            assert not better(_brute_force(g, k), objective(g, plan.stage_of, k))


def test_split_sequence_minimises_the_largest_run() -> None:
    assert split_sequence([3, 1, 1, 3], [0] * 5, 2) == [0, 2]
    assert split_sequence([1, 1, 10, 1, 1], [0] * 6, 3) == [0, 2, 3]
    assert split_sequence([5.0], [0, 0], 1) == [0]


def test_split_sequence_prefers_the_narrow_cut_among_equal_bottlenecks() -> None:
    # Cutting at 1 or 2 gives the same largest run (2 of 3); position 2 carries fewer bytes.
    assert split_sequence([1, 1, 1], [0, 500, 8, 0], 2) == [0, 2]
    assert split_sequence([1, 1, 1], [0, 8, 500, 0], 2) == [0, 1]


def test_split_sequence_rejects_more_runs_than_items() -> None:
    with pytest.raises(PartitionError, match=r"num_stages <= items. Received: num_stages=3, items=2"):
        split_sequence([1, 1], [0, 0, 0], 3)
