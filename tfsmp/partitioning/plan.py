"""`StagePlan`: which stage runs each layer, the tensors crossing stages, and per-stage costs.

Pure. Every planner (METIS, contiguous DP, manual) ends by calling `StagePlan.from_assignment`,
which validates the assignment and derives boundaries and costs, so all plans obey one set of rules.

Example::

    plan = StagePlan.from_assignment(graph, {"d1": 0, "d2": 1}, planner="manual")
    plan.boundaries[0]    # Boundary(index=0, tensor="d1:0:0", producer=0, consumers=(1,), ...)
    StagePlan.from_json(plan.to_json()) == plan

[Note: boundary order] Boundaries are numbered by (producer stage, position of the tensor in the
graph's topological layer order, tensor key; a mask ``"<key>#mask"`` right after its tensor).
Every rank derives the same numbering from the same graph, so message tags built from boundary
indices agree without communication.

[Note: model inputs and outputs] Model inputs are not boundaries: every rank reads the batch.
Model outputs are needed by the last stage (it computes the loss), so an output produced on an
earlier stage is a boundary to the last stage.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from tfsmp.errors import PartitionError
from tfsmp.graph.ir import LayerGraph, optimizer_slots
from tfsmp.partitioning.ties import TiedCopies, copy_memory, placements

__all__ = ["Boundary", "StageCost", "StagePlan"]


@dataclass(frozen=True)
class Boundary:
    """A tensor produced on one stage and read on later ones (sent straight to each consumer)."""

    index: int
    tensor: str
    producer: int
    consumers: tuple[int, ...]
    shape: tuple[int | None, ...]
    dtype: str
    bytes_per_sample: int


@dataclass(frozen=True)
class StageCost:
    """Per-stage totals. ``compute`` is FLOPs (or seconds when profiled) per sample;
    ``memory`` is bytes of parameters + optimizer state + activations for one sample, tied
    copies included; ``send_bytes`` is boundary bytes per sample this stage sends forward;
    ``copy_bytes`` is parameter bytes of tied copies whose owner is another stage;
    ``tie_bytes`` is the trainable bytes whose gradients this stage sums with other stages'
    copies every step ([Note: tied copies] in `tfsmp.graph.ir`)."""

    layers: int
    compute: float
    memory: float
    param_bytes: int
    send_bytes: int
    copy_bytes: int = 0
    tie_bytes: int = 0


@dataclass(frozen=True)
class StagePlan:
    """An ordered assignment of layers to stages. Build with `from_assignment`."""

    num_stages: int
    stage_of: Mapping[str, int]
    boundaries: tuple[Boundary, ...]
    stages: tuple[StageCost, ...]
    planner: str = "manual"
    notes: tuple[str, ...] = field(default=())
    ties: tuple[TiedCopies, ...] = field(default=())
    # the run may split its drain's backwards ([Note: drain split] in
    # tfsmp/runtime/executor.py); False where the plan fits its memory cap only without
    drain_split: bool = True

    # -- construction -----------------------------------------------------------------------

    @classmethod
    def from_assignment(
        cls,
        graph: LayerGraph,
        stage_of: Mapping[str, int],
        num_stages: int,
        planner: str = "manual",
        optimizer: str | None = None,
        notes: tuple[str, ...] = (),
    ) -> StagePlan:
        """Validates ``stage_of`` (every non-input layer on a stage in ``[0, num_stages)``, every
        stage non-empty, no tensor flowing to an earlier stage, co-located groups together) and
        derives boundaries and costs.

        Raises:
            PartitionError: naming the offending layers or edge.
        """
        layers = [n.name for n in graph if not n.is_input]
        if num_stages < 1:
            raise PartitionError(f"num_stages must be at least 1. Received: num_stages={num_stages}")
        if len(layers) < num_stages:
            raise PartitionError(
                f"Every stage needs at least one layer, so a model with {len(layers)} layers "
                f"cannot be split into more stages. Received: partitions={num_stages}, "
                f"layers={len(layers)}. Use partitions <= {len(layers)}.")
        assignment: dict[str, int] = {}
        for name in layers:
            if name not in stage_of:
                raise PartitionError(f"Every layer needs a stage. Received: no stage for layer '{name}'.")
            s = stage_of[name]
            if not isinstance(s, int) or not 0 <= s < num_stages:
                raise PartitionError(
                    f"Stages must be integers in [0, {num_stages}). Received: stage_of['{name}']={s!r}")
            assignment[name] = s
        empty = sorted(set(range(num_stages)) - set(assignment.values()))
        if empty:
            raise PartitionError(
                f"Every stage needs at least one layer. Received: stages {empty} are empty "
                f"(num_stages={num_stages}).")
        for group in graph.colocate:
            placed = {assignment[n] for n in group if n in assignment}
            if len(placed) > 1:
                where = ", ".join(f"'{n}'->{assignment[n]}" for n in sorted(group) if n in assignment)
                raise PartitionError(
                    f"Layers that share a variable must be on one stage. Received: {where}. "
                    f"Put them in the same smp.partition scope.")
        order = graph.topological_order()
        position = {n: i for i, n in enumerate(order)}
        producers: dict[int, list[tuple[int, int, str]]] = {}
        for key, info in graph.tensors.items():
            src = info.producer
            if graph.nodes[src].is_input:
                continue
            s_src = assignment[src]
            consumers = {assignment[c] for c in graph.consumers(key) if c in assignment}
            if key in graph.outputs:
                consumers.add(num_stages - 1)
            for c in graph.consumers(key):
                if c in assignment and assignment[c] < s_src:
                    raise PartitionError(
                        f"Stages must be ordered: a tensor may only flow to the same or a later "
                        f"stage. Received: '{key}' from layer '{src}' (stage {s_src}) to layer "
                        f"'{c}' (stage {assignment[c]}). Move '{c}' to stage >= {s_src} or "
                        f"'{src}' to stage <= {assignment[c]}.")
            later = tuple(sorted(s for s in consumers if s > s_src))
            if later:
                producers.setdefault(s_src, []).append((position[src], _output_index(key), key))
        boundaries: list[Boundary] = []
        for s_src in sorted(producers):
            for _, _, key in sorted(producers[s_src], key=lambda t: (t[0], t[2])):
                info = graph.tensors[key]
                consumers = {assignment[c] for c in graph.consumers(key) if c in assignment}
                if key in graph.outputs:
                    consumers.add(num_stages - 1)
                boundaries.append(Boundary(
                    index=len(boundaries), tensor=key, producer=s_src,
                    consumers=tuple(sorted(s for s in consumers if s > s_src)),
                    shape=info.shape, dtype=info.dtype, bytes_per_sample=info.bytes_per_sample))
        ties = placements(graph, assignment)
        stages = tuple(
            _stage_cost(graph, [n for n in layers if assignment[n] == s], boundaries, s, optimizer,
                        ties)
            for s in range(num_stages))
        return cls(num_stages, dict(sorted(assignment.items(), key=lambda kv: position[kv[0]])),
                   tuple(boundaries), stages, planner, notes, ties)

    # -- queries --------------------------------------------------------------------------------

    def layers(self, stage: int) -> list[str]:
        """Layer names of a stage, in topological order."""
        return [n for n, s in self.stage_of.items() if s == stage]

    def recv_boundaries(self, stage: int) -> list[Boundary]:
        """Boundaries a stage receives in forward (and sends gradients for in backward)."""
        return [b for b in self.boundaries if stage in b.consumers]

    def send_boundaries(self, stage: int) -> list[Boundary]:
        """Boundaries a stage produces and sends forward."""
        return [b for b in self.boundaries if b.producer == stage]

    def peers_forward(self, stage: int) -> list[int]:
        """Stages this stage sends activations to, ascending."""
        return sorted({c for b in self.send_boundaries(stage) for c in b.consumers})

    def peers_backward(self, stage: int) -> list[int]:
        """Stages this stage receives activations from (and sends gradients to), ascending."""
        return sorted({b.producer for b in self.recv_boundaries(stage)})

    def imbalance(self) -> float:
        """max/mean of per-stage compute (1.0 is perfect balance)."""
        comp = [s.compute for s in self.stages]
        mean = sum(comp) / len(comp)
        return max(comp) / mean if mean > 0 else 1.0

    def memory_imbalance(self) -> float:
        mem = [s.memory for s in self.stages]
        mean = sum(mem) / len(mem)
        return max(mem) / mean if mean > 0 else 1.0

    # -- serialization ------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "num_stages": self.num_stages,
            "planner": self.planner,
            "stage_of": dict(self.stage_of),
            "stages": [asdict(s) for s in self.stages],
            "boundaries": [
                {**asdict(b), "consumers": list(b.consumers), "shape": list(b.shape)}
                for b in self.boundaries
            ],
            "imbalance": self.imbalance(),
            "notes": list(self.notes),
            "ties": [{**asdict(t), "variables": list(t.variables), "nodes": list(t.nodes),
                      "stages": list(t.stages)} for t in self.ties],
            "drain_split": self.drain_split,
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> StagePlan:
        d = json.loads(text)
        return cls(
            num_stages=int(d["num_stages"]),
            stage_of={str(k): int(v) for k, v in d["stage_of"].items()},
            boundaries=tuple(
                Boundary(index=b["index"], tensor=b["tensor"], producer=b["producer"],
                         consumers=tuple(b["consumers"]), shape=tuple(b["shape"]),
                         dtype=b["dtype"], bytes_per_sample=b["bytes_per_sample"])
                for b in d.get("boundaries", [])),
            stages=tuple(StageCost(**s) for s in d.get("stages", [])),
            planner=d.get("planner", "manual"),
            notes=tuple(d.get("notes", ())),
            ties=tuple(
                TiedCopies(variables=tuple(t["variables"]), nodes=tuple(t["nodes"]),
                           stages=tuple(t["stages"]), owner_stage=t["owner_stage"],
                           param_bytes=t["param_bytes"],
                           trainable_param_bytes=t["trainable_param_bytes"])
                for t in d.get("ties", [])),
            drain_split=bool(d.get("drain_split", True)),
        )


def _output_index(key: str) -> int:
    """The output index of ``"{layer}:{call}:{index}"``, also of its mask ``"…#mask"``."""
    return int(key.split("#", 1)[0].rsplit(":", 1)[1])


def _stage_cost(graph: LayerGraph, names: list[str], boundaries: list[Boundary], stage: int,
                optimizer: str | None, ties: tuple[TiedCopies, ...] = ()) -> StageCost:
    slots = optimizer_slots(optimizer)
    nodes = [graph.nodes[n] for n in names]
    held = [t for t in ties if stage in t.stages]
    copies = [t for t in held if t.owner_stage != stage]
    return StageCost(
        layers=len(nodes),
        compute=sum(n.compute for n in nodes),
        memory=sum(n.param_bytes + slots * n.trainable_param_bytes + n.activation_bytes
                   for n in nodes) + sum(copy_memory(t, optimizer) for t in copies),
        param_bytes=sum(n.param_bytes for n in nodes) + sum(t.param_bytes for t in copies),
        send_bytes=sum(b.bytes_per_sample * len(b.consumers)
                       for b in boundaries if b.producer == stage),
        copy_bytes=sum(t.param_bytes for t in copies),
        tie_bytes=sum(t.trainable_param_bytes for t in held if t.copies > 1),
    )

