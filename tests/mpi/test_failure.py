"""One rank raises, the job ends: non-zero exit within 20 s and the rank's tagged traceback."""

from __future__ import annotations

import pytest
from mpihelp import SCRIPTS, MpiTimeout, run_mpi

pytestmark = pytest.mark.mpi

LIMIT = 20.0


@pytest.mark.parametrize(("launcher", "mpi4py_module", "mode"), [
    ("mpirun", False, "main"),      # plain `mpirun python script.py`: hangs without tfsmp's hook
    ("mpirun", False, "thread"),    # an exception in a thread of rank 2
    ("tfsmp", True, "main"),        # `tfsmp run` (python -m mpi4py under the hood)
])
def test_exception_on_rank_2_ends_the_job(launcher: str, mpi4py_module: bool, mode: str) -> None:
    # The hard timeout is the bound: a hang raises MpiTimeout after LIMIT seconds.
    res = run_mpi(4, [SCRIPTS / "fail_rank2.py", mode], launcher=launcher,
                  mpi4py_module=mpi4py_module, timeout=LIMIT)
    assert res.returncode != 0, res.describe()
    assert res.elapsed < LIMIT
    tagged = res.rank_stderr.get(2, "")
    assert "[rank 2 | pp_rank 0] Traceback (most recent call last):" in tagged, res.describe()
    assert "[rank 2 | pp_rank 0] RuntimeError: boom on rank 2" in tagged, res.describe()
    if mode == "thread":
        assert "[rank 2 | pp_rank 0] Exception in thread stage-worker:" in tagged
    assert "unreachable" not in res.stdout
    assert all(f"rank {r} ready" in res.ranks.get(r, "") for r in range(4)), res.describe()


@pytest.mark.horovod
def test_exception_on_rank_2_ends_a_horovodrun_job() -> None:
    # horovodrun itself takes ~10 s to start here (it probes the build), hence the wider bound.
    res = run_mpi(4, [SCRIPTS / "fail_rank2.py"], launcher="horovodrun", mpi4py_module=False,
                  timeout=2 * LIMIT)
    assert res.returncode != 0, res.describe()
    assert "[rank 2 | pp_rank 0] RuntimeError: boom on rank 2" in res.rank_stderr.get(2, "")


def test_a_timed_out_job_shows_where_every_rank_was() -> None:
    # the test helpers' hard timeout prints every rank's Python stack before killing the job
    with pytest.raises(MpiTimeout) as timed_out:
        run_mpi(2, [SCRIPTS / "hang_rank0.py"], mpi4py_module=False, timeout=15)
    message = str(timed_out.value)
    assert "job exceeded its 15 s timeout" in message
    assert 'in wait_for_ever' in message and "hang_rank0.py" in message, message
    assert "hang_rank0.py\", line 16 in <module>" in message, message  # rank 1: the barrier
