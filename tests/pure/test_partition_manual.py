"""Manual plans: smp.partition scopes + default_partition, validated with errors that name layers."""

from __future__ import annotations

import graphs
import pytest

from tfsmp.errors import PartitionError
from tfsmp.partitioning.plan import StagePlan
from tfsmp.partitioning.planner import plan_graph


def _manual(graph: graphs.LayerGraph, k: int, scopes: dict[str, int],
            default: int | None = 0) -> StagePlan:
    return plan_graph(graph, k, method="manual", manual=scopes, default_partition=default)


def test_scoped_layers_go_to_their_stage_and_the_rest_to_default_partition() -> None:
    plan = plan_graph(graphs.chain(4), 2, method="manual", manual={"l2": 1, "l3": 1},
                      default_partition=0)
    assert dict(plan.stage_of) == {"l0": 0, "l1": 0, "l2": 1, "l3": 1}
    assert plan.planner == "manual"
    assert plan.notes == ("manual: 2 layers in smp.partition scopes, 2 on default_partition=0",)


def test_default_partition_may_be_a_later_stage() -> None:
    plan = plan_graph(graphs.chain(4), 2, method="manual", manual={"l0": 0}, default_partition=1)
    assert [plan.stage_of[f"l{i}"] for i in range(4)] == [0, 1, 1, 1]


def test_manual_scopes_are_ignored_by_automatic_methods() -> None:
    plan = plan_graph(graphs.chain(4), 2, manual={"l0": 1, "l1": 1, "l2": 1})
    assert plan.planner != "manual"
    assert plan.stage_of["l0"] == 0


def test_a_tensor_sent_backwards_names_the_edge() -> None:
    with pytest.raises(PartitionError, match=(
            r"Stages must be ordered.*Received: 'l1:0:0' from layer 'l1' \(stage 1\) to layer "
            r"'l2' \(stage 0\)")):
        _manual(graphs.chain(4), 2, {"l1": 1, "l3": 1})


def test_split_variable_sharing_names_the_layers_and_the_variable() -> None:
    with pytest.raises(PartitionError, match=(
            r"share a variable must be on one stage. Received: 'a'->0, 'b'->1 share variables "
            r"\['shared/kernel'\]")):
        _manual(graphs.colocated_pair(), 2, {"b": 1, "c": 1, "d": 1})


def test_split_calls_of_a_shared_layer_name_the_cycle() -> None:
    with pytest.raises(PartitionError, match=(
            r"called at several places must be on one stage.*Received: 'a'->0, 'b'->1")):
        _manual(graphs.shared_layer(), 2, {"b": 1, "c": 1, "d": 1})


def test_unknown_layer_names_are_listed() -> None:
    with pytest.raises(PartitionError, match=r"unknown layers \['dense_9'\]"):
        _manual(graphs.chain(2), 2, {"dense_9": 1})


def test_unassigned_layers_need_default_partition() -> None:
    with pytest.raises(PartitionError, match=(
            r"must be set when auto_partition is False. Received: default_partition=None, "
            r"1 such layers: \['l0'\]")):
        _manual(graphs.chain(2), 2, {"l1": 1}, default=None)


@pytest.mark.parametrize(("scopes", "default", "match"), [
    ({"l1": 2}, 0, r"Received: smp.partition\(2\) around layer 'l1', partitions=2"),
    ({"l1": 1}, -1, r"Received: default_partition=-1, partitions=2"),
])
def test_partition_index_out_of_range(scopes: dict[str, int], default: int, match: str) -> None:
    with pytest.raises(PartitionError, match=match):
        _manual(graphs.chain(2), 2, scopes, default)


def test_an_empty_stage_is_an_error() -> None:
    with pytest.raises(PartitionError, match=r"stages \[1\] are empty"):
        _manual(graphs.chain(3), 3, {"l2": 2})


def test_input_layers_in_scopes_are_ignored() -> None:
    plan = _manual(graphs.chain(2), 2, {"x": 1, "l1": 1})
    assert "x" not in plan.stage_of
