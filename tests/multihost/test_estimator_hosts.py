"""The estimator's `instance_count=2` across two emulated hosts, algo-1 and algo-2, launched from
algo-1 as the toolkit does: each host's SM_* variables and resourceconfig.json, and p=2 with one
stage per host equal to plain Keras (tests/mpi/scripts/runtime_cases.py, rtol 1e-5, atol 1e-6).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.mpihelp import REPO_ROOT, base_env
from tests.multihost.netns import Cluster

pytestmark = [pytest.mark.multihost, pytest.mark.mpi]
JOB = Path(__file__).parent / "scripts" / "estimator_job.py"
SPEC = "mlp:2:4:interleaved:speed"


def _cases(log: str) -> dict[str, dict[int, dict[str, Any]]]:
    out: dict[str, dict[int, dict[str, Any]]] = {}
    for line in log.splitlines():
        if "CASE {" in line:
            d = json.loads(line[line.index("CASE {") + 5:])
            out.setdefault(d["case"], {})[d["rank"]] = d
    return out


@pytest.mark.timeout(240)
def test_two_instances_run_on_algo_1_and_algo_2(hosts: Cluster, tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "part-0.txt").write_text("x")
    proc = hosts.run("algo-1", [sys.executable, str(JOB), str(tmp_path / "jobs"), str(data), SPEC],
                     timeout=200, env=base_env(), cwd=REPO_ROOT)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("JOB {")]
    assert lines, f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    job = json.loads(lines[-1][4:])
    assert job["status"] == "Completed", f"{job['error']}\n{job['log'][-4000:]}"
    base = job["job_dir"]
    # Launched as the toolkit does: from algo-1, --host algo-1:1,algo-2:1, TCP on eth0.
    cmd = job["command"]
    assert cmd[cmd.index("--host") + 1] == "algo-1:1,algo-2:1"
    assert "btl_tcp_if_include" in cmd and cmd[cmd.index("btl_tcp_if_include") + 1] == "eth0"
    views = _cases(job["log"])["sm_view"]
    own = {0: ("algo-1", base), 1: ("algo-2", f"{base}/hosts/algo-2")}
    for rank, d in sorted(views.items()):
        host, root = own[rank]
        assert (d["hostname"], d["processor"], d["sm_current_host"]) == (host, host, host), d
        assert d["sm_hosts"] == ["algo-1", "algo-2"] and d["resource"]["hosts"] == d["sm_hosts"]
        assert d["resource"]["current_host"] == host == d["training_env_host"], d
        assert d["resource"]["network_interface_name"] == "eth0", d
        assert (d["base"], d["model_dir"], d["channel"]) == (
            root, f"{root}/model", f"{root}/input/data/training"), d
        assert d["channel_files"] == ["part-0.txt"] and d["hp"] == "3", d
        assert d["argv"][:2] == ["--epochs", "3"] and d["cwd"] == f"{base}/code", d
        assert (d["mp_rank"], d["partitions"], d["local_rank"]) == (rank, 2, 0), d
    assert sorted(views) == [0, 1]
    # Each host wrote into its own model directory; algo-1's is the job's artifact.
    assert Path(base, "model", "rank0.txt").read_text() == "algo-1"
    assert Path(base, "hosts", "algo-2", "model", "rank1.txt").read_text() == "algo-2"
    assert job["model_data"] == f"file://{base}/model.tar.gz"
    results = _cases(job["log"])[SPEC]
    assert sorted(results) == [0, 1] and all(d["ok"] for d in results.values()), results
    assert all(d["held_bytes"] == d["plan_bytes"] for d in results.values())  # its stage only
