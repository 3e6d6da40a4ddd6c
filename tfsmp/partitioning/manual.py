"""Manual plans: layers in ``smp.partition(i)`` scopes go to stage ``i``, the rest to
``default_partition`` (SMP's ``auto_partition: False``).

Pure.

Example::

    plan = plan_manual(graph, 2, {"dense_2": 1, "dense_3": 1}, default_partition=0)
"""

from __future__ import annotations

from collections.abc import Mapping

from tfsmp.errors import PartitionError
from tfsmp.graph.ir import LayerGraph
from tfsmp.partitioning.plan import StagePlan

__all__ = ["plan_manual"]

_SHOWN = 8  # names listed in an error before "..."


def plan_manual(graph: LayerGraph, num_stages: int, manual: Mapping[str, int],
                default_partition: int | None, *, optimizer: str | None = None) -> StagePlan:
    """Builds the plan the user's ``smp.partition`` scopes describe.

    Args:
        graph: the layer graph.
        num_stages: number of stages.
        manual: layer name -> stage, for layers created or called inside ``smp.partition(i)``
            (input layers are ignored: every rank reads the batch).
        default_partition: stage of every other layer.
        optimizer: Keras optimizer name, for the memory estimates.

    Returns:
        The validated plan.

    Raises:
        PartitionError: for unknown layer names, stages out of range, layers with no stage,
            layers that must share a stage placed apart, or a tensor sent to an earlier stage.
            Layers sharing trainable variables may sit apart: each stage holds a copy.
    """
    _check_names(graph, manual)
    for name, s in manual.items():
        _check_stage(s, num_stages, f"smp.partition({s!r}) around layer '{name}'")
    layers = [n.name for n in graph if not n.is_input]
    # A tied copy (a later call of a layer, [Note: tied copies]) follows its layer's scope
    # unless the scopes name the copy itself.
    manual = {**{n: manual[graph.nodes[n].layer] for n in layers
                 if n not in manual and graph.nodes[n].layer in manual}, **manual}
    outside = [n for n in layers if n not in manual]
    if outside and default_partition is None:
        raise PartitionError(
            f"Layers outside every smp.partition scope go to default_partition, which must be "
            f"set when auto_partition is False. Received: default_partition=None, "
            f"{len(outside)} such layers: {_names(outside)}. Set default_partition.")
    if default_partition is not None:
        _check_stage(default_partition, num_stages, f"default_partition={default_partition!r}")
    stage_of = {n: manual[n] if n in manual else int(default_partition or 0) for n in layers}
    _check_groups(graph, stage_of)
    notes = (f"manual: {len(layers) - len(outside)} layers in smp.partition scopes, "
             f"{len(outside)} on default_partition={default_partition}",)
    return StagePlan.from_assignment(graph, stage_of, num_stages, planner="manual",
                                     optimizer=optimizer, notes=notes)


def _names(names: list[str]) -> str:
    shown = ", ".join(f"'{n}'" for n in names[:_SHOWN])
    return f"[{shown}{', ...' if len(names) > _SHOWN else ''}]"


def _check_names(graph: LayerGraph, manual: Mapping[str, int]) -> None:
    unknown = [n for n in manual if n not in graph.nodes]
    if unknown:
        raise PartitionError(
            f"smp.partition scopes must name layers of the model. Received: unknown layers "
            f"{_names(unknown)}; the model has {_names(list(graph.nodes))}.")


def _check_stage(stage: object, num_stages: int, what: str) -> None:
    if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < num_stages:
        raise PartitionError(
            f"A partition index must be an integer in [0, partitions). Received: {what}, "
            f"partitions={num_stages}. Use an index below {num_stages}.")


def _check_groups(graph: LayerGraph, stage_of: Mapping[str, int]) -> None:
    """Layers sharing non-trainable variables, and calls of a stateful shared layer with the
    layers between them (a cycle in the layer graph), must sit on one stage."""
    for group in graph.groups():
        stages = {stage_of[n] for n in group if n in stage_of}
        if len(stages) < 2:
            continue
        where = ", ".join(f"'{n}'->{stage_of[n]}" for n in group if n in stage_of)
        for shared in graph.colocate:
            members = sorted(n for n in shared if n in stage_of)
            if len({stage_of[n] for n in members}) > 1:
                raise PartitionError(
                    f"Layers that share a variable must be on one stage. Received: "
                    f"{', '.join(f'{n!r}->{stage_of[n]}' for n in members)} share "
                    f"{_shared_variables(graph, members)}. Put them in the same smp.partition "
                    f"scope.")
        raise PartitionError(
            f"A layer called at several places must be on one stage with the layers between its "
            f"calls when it has non-trainable state (seeds, moving statistics) that its calls "
            f"update in order (the calls form a cycle in the layer graph). Received: {where}. "
            f"Put these layers in the same smp.partition scope.")


def _shared_variables(graph: LayerGraph, members: list[str]) -> str:
    seen: dict[str, int] = {}
    for n in members:
        for v in set(graph.nodes[n].variables):
            seen[v] = seen.get(v, 0) + 1
    common = sorted(v for v, c in seen.items() if c > 1)
    return f"variables {common}" if common else "variables"
