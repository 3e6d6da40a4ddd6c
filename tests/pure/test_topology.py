"""tfsmp.topology: SMP's published rank tables, round trips, group properties, and select_gpu."""

from __future__ import annotations

import re
from typing import Any

import pytest

from tfsmp.config import Config
from tfsmp.errors import ConfigError
from tfsmp.topology import Topology, select_gpu

# --- SMP's tables (its documentation of placement_strategy) --------------------------------------


def test_smp_cluster_table_8_ranks_2_partitions() -> None:
    topo = Topology(8, 2, "cluster")
    assert topo.mp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert topo.dp_groups() == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert topo.dp_size == 4


def test_smp_spread_table_8_ranks_2_partitions() -> None:
    topo = Topology(8, 2, "spread")
    assert topo.mp_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert topo.dp_groups() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [topo.pipeline_rank_of(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert topo.data_rank_of(6) == 2


def test_smp_4way_mp_2way_dp_table() -> None:
    # spread puts the replicas on [0,2,4,6] and [1,3,5,7]; cluster on [0,1,2,3] and [4,5,6,7].
    assert Topology(8, 4, "spread").mp_groups() == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert Topology(8, 4, "cluster").mp_groups() == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_groups_of_a_rank() -> None:
    topo = Topology(8, 2, "spread")
    assert topo.mp_group(6) == [2, 6]
    assert topo.dp_group(6) == [4, 5, 6, 7]
    cluster = Topology(8, 2)
    assert cluster.mp_group(5) == [4, 5]
    assert cluster.dp_group(5) == [1, 3, 5, 7]
    assert cluster.rank_of(pipeline_rank=1, data_rank=2) == 5


def test_table_text() -> None:
    assert Topology(8, 2).table() == (
        "placement=cluster world_size=8 partitions=2 dp_size=4\n"
        "         dp 0  dp 1  dp 2  dp 3\n"
        "stage 0     0     2     4     6\n"
        "stage 1     1     3     5     7")
    assert Topology(12, 3, "spread").table().splitlines()[-1] == "stage 2     8     9    10    11"


# --- properties over many grids -----------------------------------------------------------------

GRIDS = [(w, p, placement) for w in range(1, 25) for p in range(1, w + 1) if w % p == 0
         for placement in ("cluster", "spread")]


@pytest.mark.parametrize(("world", "partitions", "placement"), GRIDS)
def test_grid_properties(world: int, partitions: int, placement: str) -> None:
    topo = Topology(world, partitions, placement)
    dp = world // partitions
    for rank in range(world):  # every rank round-trips
        stage, data_rank = topo.pipeline_rank_of(rank), topo.data_rank_of(rank)
        assert 0 <= stage < partitions and 0 <= data_rank < dp
        assert topo.rank_of(stage, data_rank) == rank
        assert rank in topo.mp_group(rank) and rank in topo.dp_group(rank)
        assert topo.mp_group(rank) == topo.mp_groups()[data_rank]
        assert topo.dp_group(rank) == topo.dp_groups()[stage]
    for groups, size in ((topo.mp_groups(), partitions), (topo.dp_groups(), dp)):
        assert sorted(r for g in groups for r in g) == list(range(world))  # a partition of ranks
        assert all(len(g) == size for g in groups)
    for data_rank, group in enumerate(topo.mp_groups()):  # ordered by stage
        assert [topo.pipeline_rank_of(r) for r in group] == list(range(partitions))
        assert {topo.data_rank_of(r) for r in group} == {data_rank}
    for stage, group in enumerate(topo.dp_groups()):  # ordered by data rank
        assert [topo.data_rank_of(r) for r in group] == list(range(dp))
        assert {topo.pipeline_rank_of(r) for r in group} == {stage}
    consecutive = topo.mp_groups() if placement == "cluster" else topo.dp_groups()
    assert all(g == list(range(g[0], g[0] + len(g))) for g in consecutive)


def test_from_config() -> None:
    topo = Topology.from_config(Config(partitions=2, placement_strategy="spread"), 8)
    assert topo == Topology(8, 2, "spread")
    with pytest.raises(ConfigError, match=re.escape("Received: world_size=6, partitions=4. Launch 4 or 8 processes")):
        Topology.from_config(Config(partitions=4), 6)


# --- errors ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("args", "message"), [
    ((6, 4), "world size must be a multiple of partitions (world size = partitions x data-parallel degree). Received: world_size=6, partitions=4."),
    ((0, 1), "world_size must be a positive integer. Received: world_size=0."),
    ((8, 0), "The number of partitions must be a positive integer. Received: partitions=0."),
    ((8, True), "The number of partitions must be a positive integer. Received: partitions=True."),
    ((8.0, 2), "world_size must be a positive integer. Received: world_size=8.0."),
    ((8, 2, "DPT"), "placement_strategy must be a value in: ['spread', 'cluster']. Received: placement='DPT'."),
])
def test_bad_topology(args: tuple[Any, ...], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        Topology(*args)


def test_bad_ranks() -> None:
    topo = Topology(8, 2)
    with pytest.raises(ConfigError, match=re.escape("rank must be an integer in [0, 8). Received: rank=8, on a grid of world_size=8, partitions=2")):
        topo.pipeline_rank_of(8)
    with pytest.raises(ConfigError, match=re.escape("rank must be an integer in [0, 8). Received: rank=-1,")):
        topo.data_rank_of(-1)
    with pytest.raises(ConfigError, match=re.escape("pipeline_rank must be an integer in [0, 2). Received: pipeline_rank=2,")):
        topo.rank_of(2, 0)
    with pytest.raises(ConfigError, match=re.escape("data_rank must be an integer in [0, 4). Received: data_rank=4,")):
        topo.rank_of(0, 4)
    with pytest.raises(ConfigError, match=re.escape("rank must be an integer in [0, 8). Received: rank=True,")):
        topo.mp_group(True)


# --- select_gpu -----------------------------------------------------------------------------------


def test_select_gpu() -> None:
    assert select_gpu(0, 0) is None
    assert select_gpu(5, 0) is None  # CPU-only node: any number of processes
    assert select_gpu(0, 4) == 0
    assert select_gpu(3, 4) == 3


def test_select_gpu_errors() -> None:
    with pytest.raises(ConfigError, match=re.escape(
            "The number of node-local MPI processes 8 cannot be larger than the device count 4. "
            "Received: local_rank=5, num_gpus=4. Launch at most 4 processes per node")):
        select_gpu(5, 4, local_size=8)
    with pytest.raises(ConfigError, match=re.escape("node-local MPI processes 5 cannot be larger than the device count 4")):
        select_gpu(4, 4)
    with pytest.raises(ConfigError, match=re.escape("local_rank must be a non-negative integer. Received: local_rank=-1.")):
        select_gpu(-1, 4)
    with pytest.raises(ConfigError, match=re.escape("num_gpus must be a non-negative integer. Received: num_gpus=-2.")):
        select_gpu(0, -2)
