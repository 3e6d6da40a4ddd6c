"""`plan_graph` on hand-built graphs: ordered non-empty stages, boundaries, costs, errors, speed."""

from __future__ import annotations

import time

import graphs
import pytest

from tfsmp.errors import ConfigError, PartitionError
from tfsmp.graph.ir import LayerGraph
from tfsmp.partitioning.plan import StagePlan
from tfsmp.partitioning.planner import (
    build_problem,
    effective_memory_weight,
    objective,
    plan_graph,
    vertex_weights,
)

METHODS = ["auto", "metis", "contiguous"]


def assert_valid(graph: LayerGraph, plan: StagePlan) -> None:
    """Every layer placed, every stage non-empty, every tensor forward, boundaries routed
    straight from producer stage to each consumer stage."""
    layers = [n.name for n in graph if not n.is_input]
    assert sorted(plan.stage_of) == sorted(layers)
    assert sorted(set(plan.stage_of.values())) == list(range(plan.num_stages))
    sent = {b.tensor: b for b in plan.boundaries}
    for key, info in graph.tensors.items():
        if graph.nodes[info.producer].is_input:
            continue
        src = plan.stage_of[info.producer]
        later = {plan.stage_of[c] for c in graph.consumers(key)}
        if key in graph.outputs:
            later.add(plan.num_stages - 1)
        assert all(s >= src for s in later), key
        later.discard(src)
        if later:
            assert sent[key].producer == src and set(sent[key].consumers) == later, key
        else:
            assert key not in sent
    assert [b.index for b in plan.boundaries] == list(range(len(plan.boundaries)))
    for group in graph.groups():
        assert len({plan.stage_of[n] for n in group if n in plan.stage_of}) <= 1, group


FIXTURES = {
    "chain": lambda: graphs.chain(8),
    "diamond": graphs.diamond,
    "skip": graphs.skip,
    "shared_layer": graphs.shared_layer,
    "multi_output": graphs.multi_output,
    "colocated_pair": graphs.colocated_pair,
}


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_every_fixture_gets_a_valid_ordered_plan(name: str, method: str) -> None:
    g = FIXTURES[name]()
    groups = len([gr for gr in g.groups() if not g.nodes[gr[0]].is_input])
    for k in range(1, groups + 1):
        plan = plan_graph(g, k, method=method)
        assert_valid(g, plan)
        assert plan.planner in ("metis", "contiguous")


@pytest.mark.parametrize("method", METHODS)
def test_chain_is_split_evenly(method: str) -> None:
    plan = plan_graph(graphs.chain(12), 4, method=method)
    assert [plan.stages[s].layers for s in range(4)] == [3, 3, 3, 3]
    assert plan.imbalance() == pytest.approx(1.0)


def test_diamond_keeps_the_heavy_branch_alone() -> None:
    # a=1, b=3, c=1, d=1 (thousand FLOPs): the best 3-stage plan isolates b.
    plan = plan_graph(graphs.diamond(), 3)
    assert plan.stages[plan.stage_of["b"]].layers == 1
    assert plan.imbalance() == pytest.approx(1.5)


def test_skip_connection_goes_straight_to_the_consuming_stage() -> None:
    g = graphs.skip(6)
    plan = plan_graph(g, 3)
    assert plan.stage_of["l0"] == 0 and plan.stage_of["out"] == 2
    (skip,) = [b for b in plan.boundaries if b.tensor == "l0:0:0"]
    assert skip.producer == 0 and skip.consumers == (2,)
    assert "l0:0:0" not in [b.tensor for b in plan.recv_boundaries(1)]


def test_shared_layer_and_the_layers_between_its_calls_stay_together() -> None:
    g = graphs.shared_layer()
    for k in (1, 2, 3):
        plan = plan_graph(g, k)
        assert plan.stage_of["a"] == plan.stage_of["b"]
    # a, b form one group; c and d the others: three groups at most
    with pytest.raises(PartitionError, match=r"only 3. Received: partitions=4, groups=3: \{a, b\}"):
        plan_graph(g, 4)


def test_early_model_output_is_a_boundary_to_the_last_stage() -> None:
    g = graphs.multi_output()
    plan = plan_graph(g, 3, method="contiguous")
    assert_valid(g, plan)
    h1 = next(b for b in plan.boundaries if b.tensor == "h1:0:0")
    assert h1.consumers[-1] == 2


def test_colocated_layers_share_a_stage() -> None:
    g = graphs.colocated_pair()
    for k in (1, 2, 3):
        plan = plan_graph(g, k)
        assert plan.stage_of["a"] == plan.stage_of["b"]


def test_tied_embedding_splits_with_a_copy_on_each_stage() -> None:
    # Before tied copies, the tie pulled emb..head into one stage and 3 stages were impossible
    # ("groups=2"); tests/pure/test_partition_ties.py covers the copies in depth.
    g = graphs.tied_embedding(4)
    plan = plan_graph(g, 3)
    assert_valid(g, plan)
    assert plan.stage_of["emb"] == 0 and plan.stage_of["head"] > 0
    assert plan.ties[0].stages == (0, plan.stage_of["head"])


def test_more_stages_than_layers_is_a_partition_error() -> None:
    with pytest.raises(PartitionError, match=r"Received: partitions=4, layers=3 \[l0, l1, l2\]. Use partitions <= 3"):
        plan_graph(graphs.chain(3), 4)


@pytest.mark.parametrize(("kw", "match"), [
    ({"method": "greedy"}, "method must be one of"),
    ({"optimize": "fast"}, "optimize must be 'speed' or 'memory'. Received: optimize='fast'"),
    ({"optimize": "memory", "memory_weight": 1.5}, "memory_weight must be between 0.0 and 1.0"),
    ({"batch_size": 0}, "batch_size must be at least 1"),
])
def test_bad_arguments_are_config_errors(kw: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        plan_graph(graphs.chain(3), 2, **kw)  # type: ignore[arg-type]


def test_plans_round_trip_through_json() -> None:
    for g in (graphs.skip(), graphs.multi_output(), graphs.random_dag(60, seed=1)):
        for method in METHODS:
            plan = plan_graph(g, 3, method=method)
            assert StagePlan.from_json(plan.to_json()) == plan


def test_planning_is_deterministic() -> None:
    g = graphs.random_dag(300, seed=5)
    for method in METHODS:
        assert plan_graph(g, 6, method=method) == plan_graph(g, 6, method=method)


@pytest.mark.parametrize("seed", range(12))
def test_random_dags_get_valid_plans(seed: int) -> None:
    g = graphs.random_dag(10 + 7 * seed, seed=seed, window=3 + seed)
    for method in METHODS:
        for k in (1, 2, 3, 5, 8):
            assert_valid(g, plan_graph(g, k, method=method))


def test_auto_keeps_the_better_objective() -> None:
    g = graphs.random_dag(200, seed=7)
    auto = plan_graph(g, 5)
    scores = {m: objective(g, plan_graph(g, 5, method=m).stage_of, 5) for m in ("metis", "contiguous")}
    assert objective(g, auto.stage_of, 5) == min(scores.values())
    assert any(n.startswith("auto: kept") for n in auto.notes)


def _interleaved_branches() -> LayerGraph:
    """Two equal chains p and q built interleaved (so the topological order alternates them)
    and joined at the end: the best 2-stage plan is a chain per stage, cutting one tensor."""
    g = LayerGraph(name="two_towers")
    x = g.add_input("x", (16,))
    p = q = x
    for i in range(4):
        (p,) = graphs.add(g, f"p{i}", [p], width=64)
        (q,) = graphs.add(g, f"q{i}", [q], width=64)
    (j,) = graphs.add(g, "join", [p, q], flops=1.0)
    g.set_outputs([j])
    return g


def test_metis_beats_the_contiguous_split_of_an_interleaved_order() -> None:
    g = _interleaved_branches()
    contiguous = plan_graph(g, 2, method="contiguous")
    metis = plan_graph(g, 2, method="metis")
    assert len(contiguous.boundaries) == 2  # cuts both towers halfway
    assert {metis.stage_of[f"p{i}"] for i in range(4)} != {metis.stage_of[f"q{i}"] for i in range(4)}
    assert len(metis.boundaries) == 1
    assert objective(g, metis.stage_of, 2) < objective(g, contiguous.stage_of, 2)
    assert plan_graph(g, 2).planner == "metis"


def test_boundary_price_moves_the_cut_to_a_narrow_tensor_within_the_balance_cap() -> None:
    # FLOPs 10 10 1 1 10 10: balance alone cuts after l2 (21 | 21). Pricing bytes highly moves
    # the cut to l1's narrow output (20 | 22, within 1.10x the mean), but not to l0's even
    # narrower one (10 | 32 would break the cap).
    g = graphs.chain(6, flops=[10, 10, 1, 1, 10, 10], widths=[1, 2, 4096, 4096, 64, 64])
    balanced = plan_graph(g, 2, method="contiguous", flops_per_byte=0.0)
    assert [balanced.stage_of[f"l{i}"] for i in range(6)] == [0, 0, 0, 1, 1, 1]
    for method in METHODS:
        priced = plan_graph(g, 2, method=method, flops_per_byte=1e6)
        assert [priced.stage_of[f"l{i}"] for i in range(6)] == [0, 0, 1, 1, 1, 1]
        assert priced.imbalance() <= 1.10


def test_vertex_weights_speed_is_compute_share() -> None:
    g = graphs.chain(3, flops=[1, 2, 7], params=[1000, 0, 0])
    assert vertex_weights(g, "speed") == pytest.approx({"l0": 0.1, "l1": 0.2, "l2": 0.7})
    # speed balances compute whatever memory_weight says
    assert vertex_weights(g, "speed", memory_weight=0.9) == vertex_weights(g, "speed")


def test_vertex_weights_memory_blends_memory_and_compute() -> None:
    g = graphs.chain(2, flops=[1, 3], params=[300, 100], widths=[16, 16])
    mem = {n: g.memory_of(n, "sgd", 4) for n in ("l0", "l1")}
    total = sum(mem.values())
    w = vertex_weights(g, "memory", memory_weight=0.5, optimizer="sgd", batch_size=4)
    assert w["l0"] == pytest.approx(0.5 * mem["l0"] / total + 0.5 * 0.25)
    assert sum(w.values()) == pytest.approx(1.0)
    assert effective_memory_weight("memory", None) == 0.8


def test_unprofiled_graph_falls_back_to_counting_layers() -> None:
    g = graphs.chain(4, flops=[0, 0, 0, 0])
    assert set(vertex_weights(g).values()) == {0.25}
    plan = plan_graph(g, 2)
    assert [s.layers for s in plan.stages] == [2, 2]


def test_memory_plan_balances_parameters() -> None:
    # compute is even, parameters are not: memory mode moves the cut toward the heavy layer.
    g = graphs.chain(4, params=[100_000, 100, 100, 100])
    assert plan_graph(g, 2, optimize="speed").stages[0].layers == 2
    assert plan_graph(g, 2, optimize="memory", memory_weight=1.0).stages[0].layers == 1


def test_problem_contracts_groups_and_prices_bytes() -> None:
    p = build_problem(graphs.shared_layer())
    assert p.groups == [["a", "b"], ["c"], ["d"]]
    assert p.succ == [[1], [2], []]
    assert p.cuts() == [0, 64, 64, 0]
    assert p.kappa > 0


@pytest.mark.parametrize("make", [lambda: graphs.chain(1000), lambda: graphs.random_dag(1000)])
def test_a_thousand_layers_plan_into_8_stages_in_under_2s(make: object) -> None:
    g = make()  # type: ignore[operator]
    start = time.perf_counter()
    plan = plan_graph(g, 8)
    elapsed = time.perf_counter() - start
    assert elapsed < 2.0, elapsed
    assert plan.imbalance() <= 1.10
    assert sorted(set(plan.stage_of.values())) == list(range(8))
