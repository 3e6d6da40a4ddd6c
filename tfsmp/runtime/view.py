"""`RankView`: one rank's typed, read-only view of the partitioned model.

Example::

    view = engine.view
    view.pipeline_rank, view.data_rank          # this rank's place in the process grid
    [s.stage for s in view.stages]              # the stages (model chunks) this rank runs
    view.stages[0].trainable["d0/kernel"]       # a stage's variables, by checkpoint key
    view.writer["d0/kernel"]                    # the world rank that writes d0/kernel
    view.groups.pipeline.bcast_obj(logs, root=view.last_rank)

Checkpoints and the Keras API read this instead of the engine's attributes, so the engine may
change how it runs a step without breaking them. Terms: a *stage* is a model chunk (the plan's
unit, ``plan.num_stages`` of them); a rank's place in the pipeline is its *pipeline rank* (SMP's
``mp_rank``/``pp_rank``), and with virtual stages one pipeline rank runs several stages.

[Note: one writer per key] Every checkpoint key has exactly one writer in the job: the rank of
data rank 0 whose pipeline rank runs the lowest stage holding the variable. A tied variable
(copies on several stages, [Note: tied copies] in tfsmp/graph/ir.py) is written once, from its
lowest stage; restoring reads it into every copy.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from tfsmp.runtime.checkpoint_keys import variable_keys
from tfsmp.topology import Topology

if TYPE_CHECKING:
    from tfsmp.comm.base import Comm, Group
    from tfsmp.config import Config
    from tfsmp.graph.tracer import TracedModel
    from tfsmp.partitioning.plan import StagePlan
    from tfsmp.schedule.placement import Placement

__all__ = ["Groups", "RankView", "StageView"]


@dataclass(frozen=True)
class Groups:
    """The collectives a rank's model needs, as the comm seam's groups."""

    world: Group      # every rank of the job
    pipeline: Group   # this replica's ranks, index == pipeline rank
    data: Group       # the ranks at this pipeline rank, index == data rank


@dataclass(frozen=True)
class StageView:
    """One stage (model chunk) this rank runs, and the variables it owns.

    ``trainable``/``non_trainable`` map checkpoint keys to variables, in the order the stage's
    program holds them (its gradient accumulators follow ``trainable``).
    """

    stage: int
    is_last: bool
    layers: tuple[str, ...]
    trainable: Mapping[str, Any]
    non_trainable: Mapping[str, Any]

    @property
    def variables(self) -> dict[str, Any]:
        return {**self.trainable, **self.non_trainable}


@dataclass(frozen=True)
class RankView:
    """This rank's share of the partitioned model. See the module docstring."""

    world_rank: int
    pipeline_rank: int
    pipeline_size: int          # ranks per replica (SMP's partitions)
    data_rank: int
    data_size: int              # replicas
    num_stages: int             # stages of one replica (partitions x virtual_stages)
    placement: Placement        # stage -> pipeline rank (tfsmp/schedule/placement.py)
    stages: tuple[StageView, ...]  # this rank's stages, ascending
    keys: Mapping[int, str]     # id(variable) -> checkpoint key, every model variable
    variables: Mapping[str, Any]   # key -> variable, every model variable, in stage order
    key_stage: Mapping[str, int]   # key -> the lowest stage holding it
    writer: Mapping[str, int]   # key -> world rank writing it ([Note: one writer per key])
    groups: Groups
    horovod: bool               # data-parallel gradient reduction goes through Horovod
    traced: TracedModel
    plan: StagePlan
    # [Note: optimizer shards] in tfsmp/partitioning/shards.py: key -> world rank writing its
    # optimizer slots (its owner), and the keys whose optimizer state this rank holds (None:
    # every trainable variable of its stages, unsharded)
    slot_writer: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    owned: frozenset[str] | None = None

    @property
    def last_rank(self) -> int:
        """The pipeline rank running the last stage (it computes the loss)."""
        return self.placement.last_rank

    @property
    def is_last_rank(self) -> bool:
        return self.pipeline_rank == self.last_rank

    @functools.cached_property
    def held(self) -> tuple[str, ...]:
        """Keys of the variables this rank's stages hold, in `variables` order."""
        mine = {k for s in self.stages for k in (*s.trainable, *s.non_trainable)}
        return tuple(k for k in self.variables if k in mine)

    @functools.cached_property
    def writes(self) -> tuple[str, ...]:
        """Keys this rank writes into a checkpoint."""
        return tuple(k for k in self.held if self.writer[k] == self.world_rank)

    def held_variables(self) -> dict[str, Any]:
        return {k: self.variables[k] for k in self.held}

    @functools.cached_property
    def trainable_variables(self) -> tuple[Any, ...]:
        """What this rank's optimizer updates: each trainable variable of its stages once (a
        variable on two local stages counts at its first), in stage order."""
        seen: dict[int, Any] = {}
        for s in self.stages:
            for v in s.trainable.values():
                seen.setdefault(id(v), v)
        return tuple(seen.values())

    @functools.cached_property
    def optimizer_variables(self) -> tuple[Any, ...]:
        """What this rank's optimizer builds slots for and updates: `trainable_variables`, or
        with sharded optimizer state the ones this replica owns."""
        if self.owned is None:
            return self.trainable_variables
        return tuple(v for v in self.trainable_variables if self.keys[id(v)] in self.owned)

    @classmethod
    def build(cls, traced: TracedModel, plan: StagePlan, comm: Comm, config: Config,
              placement: Placement) -> RankView:
        """The view of ``comm``'s rank; ``config`` gives the grid (partitions, placement
        strategy) and whether Horovod reduces gradients."""
        p = config.partitions
        keys = variable_keys(traced)
        key_stage: dict[str, int] = {}
        variables: dict[str, Any] = {}
        for s in range(plan.num_stages):
            for v in traced.variables_of(plan.layers(s)):
                variables.setdefault(keys[id(v)], v)
                key_stage.setdefault(keys[id(v)], s)
        topo = Topology(comm.world.size, p, config.placement_strategy)
        writer = {k: topo.rank_of(placement.rank(s), 0) for k, s in key_stage.items()}
        pipeline_rank = comm.pipeline.rank
        slot_writer, owned = dict(writer), None
        if getattr(config, "shard_optimizer_state", False) and comm.data.size > 1:
            from tfsmp.runtime.sharding import replica_owners

            for r in range(p):
                split = replica_owners(traced, plan, placement, keys, r, comm.data.size)
                slot_writer.update({k: topo.rank_of(r, d) for k, d in split.items()
                                    if placement.rank(key_stage[k]) == r})
                if r == pipeline_rank:
                    owned = frozenset(k for k, d in split.items() if d == comm.data.rank)
        stages = tuple(_stage_view(traced, plan, s, keys)
                       for s in placement.stages(pipeline_rank))
        return cls(
            world_rank=comm.world.rank, pipeline_rank=pipeline_rank, pipeline_size=p,
            data_rank=comm.data.rank, data_size=comm.data.size, num_stages=plan.num_stages,
            placement=placement, stages=stages, keys=MappingProxyType(keys),
            variables=MappingProxyType(variables), key_stage=MappingProxyType(key_stage),
            writer=MappingProxyType(writer),
            groups=Groups(world=comm.world, pipeline=comm.pipeline, data=comm.data),
            horovod=bool(config.horovod), traced=traced, plan=plan,
            slot_writer=MappingProxyType(slot_writer), owned=owned)


def _stage_view(traced: TracedModel, plan: StagePlan, stage: int, keys: dict[int, str]
                ) -> StageView:
    """A stage's variables, split as its `StageProgram` splits them (same order)."""
    names = plan.layers(stage)
    owned = traced.variables_of(set(names))
    return StageView(
        stage=stage, is_last=stage == plan.num_stages - 1, layers=tuple(names),
        trainable=MappingProxyType({keys[id(v)]: v for v in owned if v.trainable}),
        non_trainable=MappingProxyType({keys[id(v)]: v for v in owned if not v.trainable}))
