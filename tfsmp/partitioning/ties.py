"""Tied copies in plans: which stages hold a copy of shared variables, and what the copies cost.

Pure.

Example::

    copies = placements(graph, stage_of)          # one TiedCopies per `Tie` of the graph
    copies[0].stages                              # (0, 1): the embedding on 0, the head on 1
    ties = group_ties(graph, groups, memory_weight=0.0, optimizer="adam", batch_size=1,
                      step_samples=64)            # what the planner's objective charges

[Note: pricing copies] A stage that runs a node of a `Tie` holds a copy of its variables (their
bytes, plus optimizer state). The owner's copy is already in its node's ``param_bytes``; every
other stage holding a copy pays ``param_bytes + slots * trainable_param_bytes`` more memory. When
copies sit on two or more stages, each of them sends and receives its copy's gradient once per
optimizer step; the objective prices that as ``trainable_param_bytes / step_samples`` boundary
bytes per sample in and out (the same unit as activations). ``step_samples`` defaults to the
planner's ``batch_size`` (1), which overprices the reduction: the planner then keeps tied layers
on one stage whenever the layers between them allow it and that costs no more than the copies.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tfsmp.graph.ir import LayerGraph, Tie, optimizer_slots

__all__ = ["GroupTie", "TiedCopies", "copy_memory", "group_ties", "placements"]


@dataclass(frozen=True)
class TiedCopies:
    """Where a `Tie`'s variables live in a plan: one copy on each of ``stages``."""

    variables: tuple[str, ...]
    nodes: tuple[str, ...]
    stages: tuple[int, ...]   # ascending
    owner_stage: int          # the stage whose node counts the bytes (checkpoints write its copy)
    param_bytes: int
    trainable_param_bytes: int

    @property
    def copies(self) -> int:
        return len(self.stages)


@dataclass(frozen=True)
class GroupTie:
    """A `Tie` seen by the planner: the groups running its nodes and its prices."""

    groups: tuple[int, ...]   # distinct, ascending
    owner: int                # the group of the tie's owner node
    weight: float             # an extra copy's share of the layer weights (memory part)
    nbytes: int               # reduction bytes per sample, each way, when copies sit apart


def copy_memory(copy: Tie | TiedCopies, optimizer: str | None) -> float:
    """Bytes one copy pins: parameters and optimizer state."""
    return copy.param_bytes + optimizer_slots(optimizer) * copy.trainable_param_bytes


def placements(graph: LayerGraph, stage_of: Mapping[str, int]) -> tuple[TiedCopies, ...]:
    """The stages holding each tie's copies under an assignment (nodes -> stage)."""
    out = []
    for tie in graph.ties:
        stages = sorted({stage_of[n] for n in tie.nodes if n in stage_of})
        if not stages:
            continue
        out.append(TiedCopies(tie.variables, tie.nodes, tuple(stages),
                              stage_of.get(tie.owner, stages[0]), tie.param_bytes,
                              tie.trainable_param_bytes))
    return tuple(out)


def group_ties(graph: LayerGraph, groups: Sequence[Sequence[str]], *, memory_weight: float,
               optimizer: str | None, batch_size: int, step_samples: int | None) -> list[GroupTie]:
    """The graph's ties over the planner's groups, priced per [Note: pricing copies].

    ``memory_weight`` is the effective weight of memory in a layer's cost (0 for
    ``optimize="speed"``); memory is normalised by the model's total, as `vertex_weights` does.
    """
    where = {n: gi for gi, g in enumerate(groups) for n in g}
    total = sum(graph.memory_of(n.name, optimizer, batch_size) for n in graph if not n.is_input)
    samples = max(1, step_samples or batch_size)
    out = []
    for tie in graph.ties:
        members = sorted({where[n] for n in tie.nodes if n in where})
        if len(members) < 2:
            continue  # all its nodes share a group: one copy, nothing to price
        share = memory_weight * copy_memory(tie, optimizer) / total if total > 0 else 0.0
        out.append(GroupTie(tuple(members), where.get(tie.owner, members[0]), share,
                            math.ceil(tie.trainable_param_bytes / samples)))
    return out
