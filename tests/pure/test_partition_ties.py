"""Tied copies in plans: placement, pricing, the keep-together alternative, report and JSON."""

from __future__ import annotations

import random

import graphs
import pytest
from test_partition_planner import assert_valid

from tfsmp.graph.ir import LayerGraph, Tie
from tfsmp.partitioning.manual import plan_manual
from tfsmp.partitioning.plan import StagePlan
from tfsmp.partitioning.planner import build_problem, plan_graph
from tfsmp.partitioning.report import format_report


def _short_tie(head: int = 8) -> LayerGraph:
    """x -> a -> b -> a@1 -> l0..l{head-1}: a small layer called twice close together."""
    g = LayerGraph(name="short_tie")
    (t,) = graphs.add(g, "a", [g.add_input("x", (16,))], params=10, variables=("a/kernel",))
    (t,) = graphs.add(g, "b", [t])
    (t,) = graphs.add(g, "a@1", [t], call=1)
    g.nodes["a@1"].variables, g.nodes["a@1"].layer = (), "a"
    for i in range(head):
        (t,) = graphs.add(g, f"l{i}", [t])
    g.set_outputs([t])
    g.ties.append(Tie(("a", "a@1"), ("a/kernel",), 40, 40))
    return g


@pytest.mark.parametrize("k", [2, 3, 4])
@pytest.mark.parametrize("method", ["auto", "metis", "contiguous"])
def test_a_tied_embedding_splits_into_any_number_of_stages(k: int, method: str) -> None:
    g = graphs.tied_embedding(4)
    plan = plan_graph(g, k, method=method)
    assert_valid(g, plan)
    (tie,) = plan.ties
    assert tie.stages == tuple(sorted({plan.stage_of["emb"], plan.stage_of["head"]}))
    assert tie.owner_stage == plan.stage_of["emb"] == 0
    assert any(n.startswith("ties: ") for n in plan.notes)
    if k > 2:  # keeping emb..head together leaves only 2 groups
        assert any("ties: copies needed (2 groups without)" in n for n in plan.notes)


def test_stage_costs_count_the_copy_and_its_reduction() -> None:
    g = graphs.tied_embedding(4, params=1000)
    plan = plan_graph(g, 2, optimizer="adam")
    head = plan.stage_of["head"]
    assert head == 1
    assert [s.copy_bytes for s in plan.stages] == [0, 4000]
    assert [s.tie_bytes for s in plan.stages] == [4000, 4000]
    # the copy's parameters and Adam's two slots are in the head stage's memory
    without = sum(g.memory_of(n, "adam") for n in plan.layers(1))
    assert plan.stages[1].memory == without + 3 * 4000
    assert plan.stages[1].param_bytes == 4000


def test_copies_cost_memory_in_the_objective() -> None:
    g = graphs.tied_embedding(4, params=100_000)
    speed = build_problem(g, optimize="speed")
    memory = build_problem(g, optimize="memory")
    assert speed.ties[0].weight == 0.0 and memory.ties[0].weight > 0.0
    stage = [0, 0, 0, 0, 0, 1, 1]  # emb l0..l3 | head tail
    apart = memory.load(stage, 2)
    assert apart.w[1] == pytest.approx(memory.weight[5] + memory.weight[6] + memory.ties[0].weight)
    assert apart.inb[1] >= memory.ties[0].nbytes and apart.outb[0] >= memory.ties[0].nbytes


def test_the_reduction_is_priced_per_sample_of_a_step() -> None:
    g = graphs.tied_embedding(4, params=1000)
    assert build_problem(g).ties[0].nbytes == 4000
    assert build_problem(g, step_samples=64).ties[0].nbytes == 63  # ceil(4000 / 64)


def test_a_small_tie_close_together_stays_on_one_stage() -> None:
    g = _short_tie()
    plan = plan_graph(g, 2)
    assert_valid(g, plan)
    assert plan.ties[0].stages == (0,)
    assert plan.stage_of["a"] == plan.stage_of["b"] == plan.stage_of["a@1"]
    assert "ties: kept each tie on one stage" in plan.notes
    assert plan.stages[0].tie_bytes == 0 and plan.stages[1].copy_bytes == 0


def test_copies_win_when_keeping_the_tie_together_unbalances_the_stages() -> None:
    g = _short_tie(head=1)
    for n in ("a", "b", "a@1"):  # the tie spans the bulk of the work
        g.nodes[n].flops_forward *= 20
        g.nodes[n].flops_backward *= 20
    plan = plan_graph(g, 2, step_samples=256)
    assert_valid(g, plan)
    assert plan.ties[0].copies == 2
    assert "ties: kept the copies" in plan.notes


def test_stage_load_moves_keep_tie_accounts_exact() -> None:
    g = graphs.tied_embedding(6, params=500)
    p = build_problem(g, optimize="memory", step_samples=8)
    rng = random.Random(3)
    k = 3
    stage = [min(k - 1, i * k // len(p)) for i in range(len(p))]
    load = p.load(list(stage), k)
    for _ in range(200):
        g_ = rng.randrange(len(p))
        to = rng.randrange(k)
        load.move(g_, to)
        fresh = p.load(list(load.stage), k)
        assert load.w == pytest.approx(fresh.w)
        assert (load.inb, load.outb) == (fresh.inb, fresh.outb)


def test_plans_with_ties_round_trip_through_json() -> None:
    g = graphs.tied_embedding(4)
    plan = plan_graph(g, 3)
    again = StagePlan.from_json(plan.to_json())
    assert again == plan
    old = plan.to_dict()
    del old["ties"]
    for s in old["stages"]:
        del s["copy_bytes"], s["tie_bytes"]
    import json

    assert StagePlan.from_json(json.dumps(old)).ties == ()  # plans written before ties load


def test_report_shows_the_copies_and_the_kept_tie() -> None:
    g = graphs.tied_embedding(4, params=1000)
    text = format_report(plan_graph(g, 2), g)
    assert "tied: [emb/embeddings] (3.9 KiB) has 2 copies, on stages [0, 1]" in text
    assert "gradients are summed every step" in text
    kept = _short_tie()
    assert "is kept on stage 0: one copy, used by a, a@1" in format_report(plan_graph(kept, 2), kept)


def test_manual_copies_follow_their_layer_unless_named() -> None:
    g = _short_tie(head=2)
    same = plan_manual(g, 2, {"a": 0, "b": 0, "l0": 1}, default_partition=1)
    assert same.stage_of["a@1"] == 0 and same.ties[0].copies == 1
    apart = plan_manual(g, 2, {"a": 0, "b": 0, "a@1": 1}, default_partition=1)
    assert apart.stage_of["a@1"] == 1 and apart.ties[0].stages == (0, 1)
