"""`horovod: True`: tfsmp runs hvd.init on the data-parallel group, so hvd.allreduce stays in a stage."""

from __future__ import annotations

import pytest
from mpihelp import SCRIPTS, run_mpi

pytestmark = [pytest.mark.mpi, pytest.mark.horovod]


@pytest.mark.parametrize("launcher", ["tfsmp", "horovodrun"])
def test_hvd_allreduce_sums_over_the_replicas_of_one_stage(launcher: str) -> None:
    res = run_mpi(4, [SCRIPTS / "horovod_allreduce.py"], launcher=launcher, timeout=240,
                  config={"partitions": 2, "horovod": True})
    assert res.returncode == 0, res.describe()
    for rank in range(4):
        (rec,) = res.json_lines(rank)
        dp_group = [rank % 2, rank % 2 + 2]          # cluster: stage = rank % 2
        total = float(sum(r + 1 for r in dp_group))  # only the two replicas of this stage
        assert rec["dp_group"] == dp_group and rec["horovod"] is True
        assert (rec["hvd_rank"], rec["hvd_size"]) == (rec["dp_rank"], rec["dp_size"]) == (rank // 2, 2)
        assert rec["sum"] == [total, 10 * total]
        assert rec["grouped"] == [[total], [[total, total]]]
        assert rec["reducer"] == [total] * 3
