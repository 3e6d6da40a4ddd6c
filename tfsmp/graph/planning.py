"""`tfsmp.plan(model, partitions)`: trace a Keras model and plan its stages, without running it.

Importing this module is pure; calling `plan` imports the Keras tracer.

Example::

    import tfsmp
    plan = tfsmp.plan(keras.applications.ResNet50(weights=None), 4)
    print(plan.imbalance(), plan.to_json())
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tfsmp.graph.ir import LayerGraph
from tfsmp.partitioning.plan import StagePlan
from tfsmp.partitioning.planner import plan_graph

__all__ = ["optimizer_name", "plan", "plan_model", "trace_graph"]


def plan(model: Any, partitions: int, optimize: str = "speed", batch_size: int | None = None,
         memory_weight: float | None = None, method: str = "auto", optimizer: str | None = None,
         *, manual: Mapping[str, int] | None = None, default_partition: int | None = None,
         contiguous: bool = True) -> StagePlan:
    """Plans ``model`` into ``partitions`` ordered stages (what `DistributedModel` would run).

    Args:
        model: a Keras model (Functional, Sequential or subclassed).
        partitions: number of stages.
        optimize: ``"speed"`` balances compute; ``"memory"`` blends memory and compute.
        batch_size: samples per stage step, for activation memory (``None``: 1).
        memory_weight: weight of memory in the ``"memory"`` blend (default 0.8).
        method: ``"auto"``, ``"metis"``, ``"contiguous"`` or ``"manual"``.
        optimizer: Keras optimizer name for optimizer-state memory (default: the compiled
            model's optimizer, else Adam).
        manual: layer -> stage, for ``method="manual"``.
        default_partition: stage of layers ``manual`` does not name.
        contiguous: METIS only: make each stage connected where the graph allows.

    Returns:
        The `StagePlan`.

    Raises:
        PartitionError: if the model cannot be split so.
        TraceError: if the tracer cannot read the model.
    """
    return plan_model(model, partitions, optimize=optimize, batch_size=batch_size,
                      memory_weight=memory_weight, method=method, optimizer=optimizer,
                      manual=manual, default_partition=default_partition,
                      contiguous=contiguous)[0]


def plan_model(model: Any, partitions: int, *, optimize: str = "speed",
               batch_size: int | None = None, memory_weight: float | None = None,
               method: str = "auto", optimizer: str | None = None,
               manual: Mapping[str, int] | None = None, default_partition: int | None = None,
               contiguous: bool = True) -> tuple[StagePlan, LayerGraph]:
    """Like `plan`, also returning the traced graph (for `tfsmp.partitioning.report`)."""
    graph = trace_graph(model, batch_size)
    result = plan_graph(
        graph, partitions, optimize=optimize, memory_weight=memory_weight, method=method,
        manual=manual, default_partition=default_partition, contiguous=contiguous,
        optimizer=optimizer or optimizer_name(model), batch_size=batch_size or 1)
    return result, graph


def trace_graph(model: Any, batch_size: int | None = None) -> LayerGraph:
    """The model's `LayerGraph`, from the Keras tracer (imports TensorFlow)."""
    from tfsmp.graph.tracer import trace

    graph: LayerGraph = trace(model, batch_size=batch_size).graph
    return graph


def optimizer_name(model: Any) -> str | None:
    """The compiled model's optimizer class name, lower-cased (``"adam"``), or None."""
    opt = getattr(model, "optimizer", None)
    return type(opt).__name__.lower() if opt is not None else None
