"""`tfsmp run` across two emulated hosts (algo-1, algo-2): equality with plain Keras, TCP between
hosts, per-host local ranks, the environment of remote ranks, and a rank dying on algo-2.

Equality uses tests/mpi/scripts/runtime_cases.py unchanged (rtol 1e-5, atol 1e-6 on the losses of
3 steps and on every final weight). Every launch starts on algo-1, as SageMaker's toolkit does, and
is bounded by `timeout -k 5`.
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.multihost.mhlaunch import FAST_TRANSPORT, cases, tfsmp_run
from tests.multihost.netns import Cluster

pytestmark = [pytest.mark.multihost, pytest.mark.mpi]
SCRIPTS = Path(__file__).parent / "scripts"
CASES = SCRIPTS / "host_cases.py"
PROBE_ENV = {"TFSMP_PROBE": "tfsmp-value", "SM_PROBE": "sm-value"}

ONE_STAGE_PER_HOST = ["mlp:2:4:interleaved:speed", "rescnn:2:4:simple:memory"]
SPREAD = ["mlp:2:4:interleaved:speed"]  # 4 TF processes on 2 cores: one model keeps it quick


def _check_equal(results: dict[str, dict[int, dict[str, Any]]], specs: list[str],
                 np: int) -> None:
    failures = []
    for spec in specs:
        ranks = results.get(spec, {})
        assert sorted(ranks) == list(range(np)), f"{spec}: reports from ranks {sorted(ranks)}"
        failures += [f"{spec} rank {r}: losses {d.get('losses')} vs {d.get('ref_losses')}, "
                     f"weight err {d.get('max_weight_err')}\n{d.get('error') or ''}"
                     for r, d in sorted(ranks.items()) if not d["ok"]]
        # Each rank holds exactly its own stage's variables.
        assert all(d["held_bytes"] == d["plan_bytes"] for d in ranks.values() if d["ok"]), spec
    assert not failures, "\n".join(failures)


def _check_remote_env(info: dict[int, dict[str, Any]]) -> None:
    """Every rank, algo-2's included, got the variables tfsmp run forwards."""
    for rank, d in info.items():
        env = d["env"]
        assert env["TFSMP_PROBE"] == "tfsmp-value" and env["SM_PROBE"] == "sm-value", (rank, d)
        assert env["PYTHONPATH"] and env["TF_NUM_INTRAOP_THREADS"] == "1", (rank, d)
        assert env["TMPDIR"].endswith(f"/{d['hostname']}/tmp"), (rank, d)  # its host's own


@pytest.mark.timeout(180)
def test_one_stage_per_host_equals_keras_over_tcp(hosts: Cluster) -> None:
    # p=2 on 2 ranks, one per host; Open MPI's own report names the transport per peer.
    res = tfsmp_run(hosts, [
        "--hosts", "algo-1:1,algo-2:1", "--config", '{"partitions": 2}',
        "--mpi-args", f"{FAST_TRANSPORT} --mca btl_base_verbose 30",
        str(CASES), "hostinfo", *ONE_STAGE_PER_HOST], timeout=150, env=PROBE_ENV)
    assert res.returncode == 0, res.describe()
    results = cases(res)
    info = results["hostinfo"]
    assert {r: (d["hostname"], d["processor"], d["stage"]) for r, d in info.items()} == {
        0: ("algo-1", "algo-1", 0), 1: ("algo-2", "algo-2", 1)}
    _check_remote_env(info)
    _check_equal(results, ONE_STAGE_PER_HOST, 2)
    # "[algo-1:PID] mca: bml: Using tcp btl for send to [[JOB,1],1] on node algo-2", both ways.
    used = set(re.findall(r"\[(algo-\d):\d+\] mca: bml: Using (\w+) btl for send to "
                          r"\[\[\d+,\d+\],\d+\] on node (algo-\d)", res.stderr))
    across = {(a, btl, b) for a, btl, b in used if a != b}
    assert across == {("algo-1", "tcp", "algo-2"), ("algo-2", "tcp", "algo-1")}, res.describe()


@pytest.mark.timeout(240)
def test_two_stages_by_two_replicas_spread_over_hosts_equals_keras(
        hosts: Cluster, tmp_path: Path) -> None:
    # spread: stage = rank // 2, so stage 0's replicas are algo-1's ranks and stage 1's algo-2's:
    # activations cross hosts, each stage's gradient reduction stays inside a host.
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("algo-1 slots=2\nalgo-2 slots=2\n")
    res = tfsmp_run(hosts, [
        "--hostfile", str(hostfile), "--network-interface", "eth0",
        "--config", '{"partitions": 2, "placement_strategy": "spread"}',
        "--mpi-args", FAST_TRANSPORT, str(CASES), "hostinfo", *SPREAD],
        timeout=210, env=PROBE_ENV)
    assert res.returncode == 0, res.describe()
    results = cases(res)
    info = results["hostinfo"]
    layout = {r: (d["hostname"], d["local_rank"], d["local_size"], d["stage"], d["data_rank"])
              for r, d in info.items()}
    assert layout == {0: ("algo-1", 0, 2, 0, 0), 1: ("algo-1", 1, 2, 0, 1),
                      2: ("algo-2", 0, 2, 1, 0), 3: ("algo-2", 1, 2, 1, 1)}
    for d in info.values():  # tfsmp's local rank is Open MPI's per-host one; GPU 0/1 per host
        assert (d["local_rank"], d["local_size"]) == (d["ompi_local_rank"], d["ompi_local_size"])
        assert d["gpu_of_two"] == d["local_rank"] and d["placement"] == "spread"
    assert {d["ompi_node_rank"] for d in info.values()} == {0, 1}
    _check_remote_env(info)
    _check_equal(results, SPREAD, 4)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["kill", "raise"])
def test_a_rank_dying_on_the_second_host_ends_the_job_naming_host_and_rank(
        hosts: Cluster, how: str) -> None:
    res = tfsmp_run(hosts, [
        "--hosts", "algo-1:2,algo-2:2", "--config", '{"partitions": 2}',
        "--mpi-args", FAST_TRANSPORT, str(SCRIPTS / "die_on_host.py"), how], timeout=60)
    ended = time.time()
    # Failed well before the launch's bound (prterun exits 137 after a SIGKILLed rank too).
    assert res.returncode != 0 and res.elapsed < 45, res.describe()
    assert all(f"rank {r} ready" in res.ranks.get(r, "") for r in range(4)), res.describe()
    died = float(re.search(r"dying at ([\d.]+)", res.ranks[3]).group(1))  # type: ignore[union-attr]
    assert ended - died < 10.0, res.describe()
    assert "unreachable" not in res.stdout
    text = " ".join(res.stderr.split())  # Open MPI wraps its messages
    if how == "kill":
        # Open MPI's own report often names a survivor that aborted first ([Note: who died] in
        # tfsmp/launch/rankguard.py); the rank's guard names the dead rank and only it.
        assert re.search(r"\[rank 3\] killed by signal 9 \(SIGKILL\) on host algo-2 \(pid \d+\)",
                         text), res.describe()
        assert len(re.findall(r"\] killed by signal", text)) == 1, res.describe()
    else:
        assert re.search(r"\[rank 3 \| pp_rank 1\] failed on host algo-2 \(pid \d+\); aborting "
                         r"the job", text), res.describe()
        assert "[rank 3 | pp_rank 1] RuntimeError: boom on rank 3" in res.rank_stderr[3]


def test_the_default_interface_is_the_one_that_reaches_the_hosts(hosts: Cluster) -> None:
    res = hosts.run("algo-1", [sys.executable, "-m", "tfsmp", "run", "--hosts", "algo-1:1,algo-2:1",
                               "--dry-run", "t.py"], timeout=30)
    assert res.returncode == 0, res.stderr
    assert "--mca btl_tcp_if_include eth0 --mca oob_tcp_if_include eth0" in res.stdout
