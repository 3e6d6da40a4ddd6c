"""Global rank <-> (pipeline rank, data rank) for SMP's `cluster` and `spread` placements, and the groups.

Example::

    topo = Topology(world_size=8, partitions=2, placement="spread")
    topo.pipeline_rank_of(6), topo.data_rank_of(6)  # (1, 2): SMP's mp_rank and dp_rank
    topo.mp_groups()                           # [[0, 4], [1, 5], [2, 6], [3, 7]]
    topo.dp_groups()                           # [[0, 1, 2, 3], [4, 5, 6, 7]]

Pure: imports neither TensorFlow nor mpi4py.

[Note: rank layout] With P = partitions and D = world_size // P (SMP's published tables, 8 ranks):
- cluster: pipeline rank = rank % P, data rank = rank // P. A replica's pipeline ranks sit on
  consecutive ranks, so on one node they share fast links. P=2: mp_groups [0,1],[2,3],[4,5],[6,7].
- spread: pipeline rank = rank // D, data rank = rank % D. The replicas of one pipeline rank sit
  on consecutive ranks. P=2: mp_groups [0,4],[1,5],[2,6],[3,7].
An mp_group (one model replica) is ordered by pipeline rank; a dp_group (the replicas of one
pipeline rank, which reduce gradients together) is ordered by data rank. Which model chunks
("stages") a pipeline rank runs is `tfsmp.schedule.placement`'s business.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tfsmp.errors import ConfigError

if TYPE_CHECKING:
    from tfsmp.config import Config

__all__ = ["PLACEMENTS", "Topology", "select_gpu"]

PLACEMENTS = ("cluster", "spread")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class Topology:
    """The process grid of one run: `partitions` stages × `dp_size` replicas.

    Example::

        topo = Topology(world_size=4, partitions=2)      # cluster
        topo.rank_of(pipeline_rank=1, data_rank=1)               # 3
        print(topo.table())
    """

    world_size: int
    partitions: int
    placement: str = "cluster"

    def __post_init__(self) -> None:
        if not _is_int(self.world_size) or self.world_size < 1:
            raise ConfigError(f"world_size must be a positive integer. "
                              f"Received: world_size={self.world_size!r}.")
        if not _is_int(self.partitions) or self.partitions < 1:
            raise ConfigError(f"The number of partitions must be a positive integer. "
                              f"Received: partitions={self.partitions!r}.")
        if self.world_size % self.partitions:
            raise ConfigError(
                "world size must be a multiple of partitions (world size = partitions x "
                f"data-parallel degree). Received: world_size={self.world_size}, "
                f"partitions={self.partitions}. Launch a multiple of {self.partitions} processes.")
        if self.placement not in PLACEMENTS:
            raise ConfigError(f"placement_strategy must be a value in: ['spread', 'cluster']. "
                              f"Received: placement={self.placement!r}.")

    @classmethod
    def from_config(cls, config: Config, world_size: int) -> Topology:
        """The grid of `config` on `world_size` processes (with the config's world-size message)."""
        from tfsmp.config import check_world_size

        check_world_size(config, world_size)
        return cls(world_size, config.partitions, config.placement_strategy)

    @property
    def dp_size(self) -> int:
        """Number of model replicas (data-parallel degree)."""
        return self.world_size // self.partitions

    def _check(self, name: str, value: int, bound: int) -> None:
        if not _is_int(value) or not 0 <= value < bound:
            raise ConfigError(
                f"{name} must be an integer in [0, {bound}). Received: {name}={value!r}, on a grid "
                f"of world_size={self.world_size}, partitions={self.partitions}, "
                f"placement={self.placement!r}.")

    def pipeline_rank_of(self, rank: int) -> int:
        """The pipeline rank of global `rank` (SMP's `mp_rank`)."""
        self._check("rank", rank, self.world_size)
        if self.placement == "cluster":
            return rank % self.partitions
        return rank // self.dp_size

    def data_rank_of(self, rank: int) -> int:
        """The replica index of global `rank` (SMP's `dp_rank`)."""
        self._check("rank", rank, self.world_size)
        if self.placement == "cluster":
            return rank // self.partitions
        return rank % self.dp_size

    def rank_of(self, pipeline_rank: int, data_rank: int) -> int:
        """The global rank at `pipeline_rank` of replica `data_rank`."""
        self._check("pipeline_rank", pipeline_rank, self.partitions)
        self._check("data_rank", data_rank, self.dp_size)
        if self.placement == "cluster":
            return data_rank * self.partitions + pipeline_rank
        return pipeline_rank * self.dp_size + data_rank

    def mp_group(self, rank: int) -> list[int]:
        """Global ranks of `rank`'s replica, ordered by pipeline rank."""
        data_rank = self.data_rank_of(rank)
        return [self.rank_of(s, data_rank) for s in range(self.partitions)]

    def dp_group(self, rank: int) -> list[int]:
        """Global ranks at `rank`'s pipeline rank, ordered by data rank."""
        pipeline_rank = self.pipeline_rank_of(rank)
        return [self.rank_of(pipeline_rank, d) for d in range(self.dp_size)]

    def mp_groups(self) -> list[list[int]]:
        """Every replica's ranks, ordered by data rank."""
        return [[self.rank_of(s, d) for s in range(self.partitions)] for d in range(self.dp_size)]

    def dp_groups(self) -> list[list[int]]:
        """Every pipeline rank's replicas, ordered by pipeline rank."""
        return [[self.rank_of(s, d) for d in range(self.dp_size)] for s in range(self.partitions)]

    def table(self) -> str:
        """A printable grid: one row per stage (a dp_group), one column per replica (an mp_group).

        Example (8 ranks, partitions=2, cluster)::

            placement=cluster world_size=8 partitions=2 dp_size=4
                     dp 0  dp 1  dp 2  dp 3
            stage 0     0     2     4     6
            stage 1     1     3     5     7
        """
        width = max(len(f"dp {self.dp_size - 1}"), len(str(self.world_size - 1)))
        label = len(f"stage {self.partitions - 1}")
        head = " " * label + "".join(f"  {f'dp {d}':>{width}}" for d in range(self.dp_size))
        rows = [f"{f'stage {s}':<{label}}" + "".join(f"  {r:>{width}}" for r in group)
                for s, group in enumerate(self.dp_groups())]
        title = (f"placement={self.placement} world_size={self.world_size} "
                 f"partitions={self.partitions} dp_size={self.dp_size}")
        return "\n".join([title, head, *rows])


def select_gpu(local_rank: int, num_gpus: int, local_size: int | None = None) -> int | None:
    """The GPU a process pins: its node-local rank, one process per GPU as in SMP.

    Args:
        local_rank: the process's rank on its node.
        num_gpus: GPUs visible on the node.
        local_size: processes on the node, if known (for the error message).

    Returns:
        The GPU index, or None when the node has no GPU (run on CPU).

    Raises:
        ConfigError: an argument is negative, or the node runs more processes than it has GPUs.
    """
    if not _is_int(local_rank) or local_rank < 0:
        raise ConfigError(f"local_rank must be a non-negative integer. Received: local_rank={local_rank!r}.")
    if not _is_int(num_gpus) or num_gpus < 0:
        raise ConfigError(f"num_gpus must be a non-negative integer. Received: num_gpus={num_gpus!r}.")
    if num_gpus == 0:
        return None
    if local_rank < num_gpus:
        return local_rank
    procs = local_size if local_size is not None else local_rank + 1
    raise ConfigError(
        f"The number of node-local MPI processes {procs} cannot be larger than the device count "
        f"{num_gpus}. Received: local_rank={local_rank}, num_gpus={num_gpus}. Launch at most "
        f"{num_gpus} processes per node (e.g. processes_per_host={num_gpus}), or make more GPUs "
        "visible (CUDA_VISIBLE_DEVICES).")
