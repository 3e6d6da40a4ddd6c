"""A host lost for good: `tfsmp run --max-restarts` relaunches on the hosts left, with fewer replicas.

4 ranks over algo-1 and algo-2 (p=2 × d=2, one replica per host) train
tests/mpi/scripts/resume_train.py with Keras's BackupAndRestore. After step 9 the whole of algo-2
goes away: every process in it is SIGKILLed and its network namespace deleted, so nothing can
reach it any more. The launcher on algo-1 finds algo-2 unreachable, relaunches on algo-1 alone
with 2 ranks (d=1), which restore the backup (written by d=2; reshardable) and train on to the
end. `fit`'s batch_size is the global batch, so the run does the same arithmetic as an
uninterrupted one, up to the order of the replicas' gradient sum: the final weights equal the
single-host reference within rtol 1e-5.
"""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from tests.mpihelp import SCRIPTS, Result, run_mpi
from tests.multihost import netns
from tests.multihost.conftest import HOSTS
from tests.multihost.mhlaunch import FAST_TRANSPORT, tfsmp_run

pytestmark = [pytest.mark.multihost, pytest.mark.mpi]

SCRIPT = SCRIPTS / "resume_train.py"
CONFIG = {"partitions": 2, "microbatches": 2, "seed": 3}


def _lose_host(cluster: netns.Cluster, name: str) -> None:
    """The host and its network vanish: every process in it dies, the namespace goes."""
    host = cluster.host(name)
    netns._kill_namespace_processes(host.ns)
    netns._sh("ip", "netns", "del", host.ns, check=False)


def _final(out: Path) -> dict[str, np.ndarray]:
    with np.load(out / "final.npz") as f:
        return {k: f[k] for k in f.files}


@pytest.mark.full  # 35 s; the default run relaunches a killed rank on one host (test_resume.py)
@pytest.mark.timeout(600)
def test_losing_a_host_relaunches_on_the_rest_with_fewer_replicas(
        hosts: netns.Cluster, tmp_path: Path) -> None:
    reference = tmp_path / "reference"
    reference.mkdir()
    res = run_mpi(2, [SCRIPT, reference, "--epochs", "2"], config=CONFIG, launcher="tfsmp",
                  timeout=300)
    assert res.returncode == 0, res.describe()
    out, flag = tmp_path / "job", tmp_path / "lose-algo-2-now"
    out.mkdir()
    box: dict[str, Result] = {}

    def job() -> None:
        box["res"] = tfsmp_run(hosts, [
            "--hosts", "algo-1:2,algo-2:2", "--config", json.dumps(CONFIG),
            "--max-restarts", "1", "--restart-backoff", "0.2", "--mpi-args", FAST_TRANSPORT,
            str(SCRIPT), str(out), "--epochs", "2", "--host-kill-file", f"{flag}:9"],
            timeout=400)

    thread = threading.Thread(target=job)
    thread.start()
    try:
        deadline = time.monotonic() + 300
        while not flag.exists() and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert flag.exists(), box.get("res")
        _lose_host(hosts, "algo-2")
        thread.join(420)
    finally:
        thread.join(420)
        netns.up(HOSTS)  # the next tests need both hosts again
    got = box["res"]
    text = " ".join(got.stderr.split())
    assert got.returncode == 0, got.describe()
    assert re.search(r"tfsmp run: restart 1 of 1 in 0\.2 s: .*host algo-2 lost \(not "
                     r"reachable\); relaunching on algo-1:2 with 2 ranks", text), got.describe()
    firsts = [json.loads(m) for m in re.findall(r"FIRST (\{[^}]*\})", got.stdout)]
    assert firsts == [{"epoch": 0, "step": 0}, {"epoch": 1, "step": 1}], got.describe()
    done = json.loads(re.search(r"DONE (\{[^}]*\})", got.stdout).group(1))  # type: ignore[union-attr]
    assert done["dp_size"] == 1 and done["iterations"] == 16, got.describe()
    final, want = _final(out), _final(reference)
    assert sorted(final) == sorted(want)
    worst = max(float(np.max(np.abs(final[k] - want[k]) / (np.abs(want[k]) + 1e-6)))
                for k in want)
    said = re.search(r"tfsmp run: restart 1 of 1 .*?with 2 ranks", text)
    print(f"{said.group(0) if said else ''}\nlost algo-2 after step 9; resumed on algo-1 with "
          f"d=1; worst relative difference from the reference {worst:.2e}")
    for k in want:
        np.testing.assert_allclose(final[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)
