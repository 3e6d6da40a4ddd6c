"""The bring-your-own-container path: the real SageMaker training toolkit (`sagemaker-training`
5.1.4, the container's `train` command) runs an SMP-style tfsmp script from the container layout
(/opt/ml, `sagemaker_mpi_*` hyperparameters, SM_HP_MP_PARAMETERS), on one emulated host and on two.

Its mpirun line is written for Open MPI 4, so it runs in tests/multihost/ompi4.py's environment
(Open MPI 4.1.8 + mpi4py built against it), which is opt-in: TFSMP_TOOLKIT_TESTS=1 (builds it,
minutes) or a cached build. Each host's /opt/ml is the job directory's, bind-mounted in a mount
namespace of its own (the toolkit's gethostname shim reads /opt/ml/input/config/resourceconfig.json
whatever SAGEMAKER_BASE_DIR says). What tests/multihost/scripts/toolkit_train.py changes in the
toolkit (no sshd on emulated hosts) is listed there.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.mpihelp import REPO_ROOT, base_env
from tests.multihost import ompi4
from tests.multihost.netns import LOGIN_PATH, STATE_DIR, Cluster
from tfsmp.launch import sagemaker as sm

pytestmark = [pytest.mark.multihost, pytest.mark.mpi]
SCRIPTS = Path(__file__).parent / "scripts"
SPEC = "mlp:2:4:interleaved:speed"
INSTANCE_TYPE = "ml.c5.2xlarge"  # a CPU type: no EFA or NCCL flags


@pytest.fixture(scope="module")
def venv() -> Path:
    if os.environ.get("TFSMP_TOOLKIT_TESTS") != "1":  # CI sets it; the default run skips
        pytest.skip("opt-in: the toolkit needs Open MPI 4 and mpi4py compiled against it (6-8 min "
                    f"to build on 2 cores, kept in {ompi4.venv_dir()}); set TFSMP_TOOLKIT_TESTS=1")
    return ompi4.build()


def _layout(root: Path, hosts: list[str], ppn: int) -> None:
    """Each host's /opt/ml as the SDK and SageMaker leave it: algo-1's is `root`, the others'
    `root/hosts/<name>`."""
    hps = {"epochs": 3, "test_scripts": str(REPO_ROOT / "tests" / "mpi" / "scripts"),
           "test_specs": SPEC, "mp_parameters": {"partitions": 2},
           "sagemaker_program": "sm_entry.py", "sagemaker_submit_directory": "/opt/ml/code",
           "sagemaker_container_log_level": 20, "sagemaker_job_name": "toolkit-job",
           "sagemaker_region": "us-west-2", "sagemaker_mpi_enabled": True,
           "sagemaker_mpi_num_of_processes_per_host": ppn,
           "sagemaker_mpi_custom_mpi_options": "--NCCL_DEBUG WARN",  # a btl would repeat ^openib
           "sagemaker_distributed_dataparallel_enabled": False}
    for host in hosts:
        base = root if host == hosts[0] else root / "hosts" / host
        config = base / "input" / "config"
        config.mkdir(parents=True)
        (config / "hyperparameters.json").write_text(json.dumps(sm.encode_hyperparameters(hps)))
        (config / "inputdataconfig.json").write_text(json.dumps(sm.input_data_config(["training"])))
        (config / "resourceconfig.json").write_text(json.dumps(
            sm.resource_config(hosts, host, INSTANCE_TYPE, "eth0")))
        (base / "input" / "data" / "training").mkdir(parents=True)
        (base / "input" / "data" / "training" / "part-0.txt").write_text("x")
        shutil.copytree(SCRIPTS / "estimator_src", base / "code")
        for d in ("model", "output/data"):
            (base / d).mkdir(parents=True)


def _with_opt_ml(base: Path, command: str) -> str:
    """Shell text: `command` with `base` as /opt/ml (run inside a fresh mount namespace)."""
    return (f"mount -t tmpfs tfsmp-opt /opt && mkdir /opt/ml && mount --bind {base} /opt/ml && "
            f"{command}")


def _agent(cluster: Cluster, root: Path, venv: Path) -> Path:
    """Open MPI 4's rsh agent: the harness's ssh stand-in, plus the host's own /opt/ml and what
    an image's ENV would give the login shell (Open MPI 4 on PATH, `ompi4.runtime_env`)."""
    cases = "\n".join(
        f"  {h.name}) ns={h.ns}; uts={h.uts}; tmp={h.tmpdir}; base={root / 'hosts' / h.name} ;;"
        for h in cluster.hosts)
    login = f"{venv}/bin:{LOGIN_PATH}"
    text = f"""#!/bin/bash
while [ $# -gt 0 ]; do
  case "$1" in -[bcDEeFIiJLlmOopQRSWw]) shift 2 ;; -*) shift ;; *) break ;; esac
done
host="$1"; shift
case "$host" in
{cases}
  *) echo "emulated ssh: unknown host '$host'" >&2; exit 255 ;;
esac
exec ip netns exec "$ns" nsenter --uts="$uts" -- unshare --mount --propagation private -- \\
  env -i HOME=/root USER=root LOGNAME=root SHELL=/bin/bash PATH={login} TMPDIR="$tmp" \\
  LD_LIBRARY_PATH={venv}/lib OPAL_PREFIX={venv} \\
  /bin/bash -c "mount -t tmpfs tfsmp-opt /opt && mkdir /opt/ml && mount --bind $base /opt/ml && $*"
"""
    path = STATE_DIR / "ompi4-ssh"
    path.write_text(text)
    path.chmod(0o755)
    return path


def _views(out: str) -> dict[str, dict[int, dict[str, Any]]]:
    views: dict[str, dict[int, dict[str, Any]]] = {}
    # Every `CASE {...}` wherever it is: Open MPI 4's --tag-output sometimes joins two ranks'
    # writes on one line (`...}[1,1]<stdout>:CASE {...`).
    for chunk in out.split("CASE {")[1:]:
        d, _ = json.JSONDecoder().raw_decode("{" + chunk)
        views.setdefault(d["case"], {})[d["rank"]] = d
    return views


def _train(cluster: Cluster, venv: Path, root: Path) -> str:
    env = base_env({**ompi4.runtime_env(venv),
                    "OMPI_MCA_plm_rsh_agent": str(_agent(cluster, root, venv))})
    train = f"exec {venv}/bin/python {SCRIPTS / 'toolkit_train.py'}"
    proc = cluster.run("algo-1", ["unshare", "--mount", "--propagation", "private", "--", "bash",
                                  "-c", _with_opt_ml(root, train)],
                       timeout=200, env=env, cwd="/")
    if proc.returncode != 0:
        cluster.kill_all()
    out = proc.stdout + proc.stderr
    (root / "train.log").write_text(out)  # for a failure's post-mortem
    assert proc.returncode == 0, out[-6000:]
    return out


def _check(out: str, hosts: list[str], ppn: int) -> None:
    np = len(hosts) * ppn
    # Open MPI 4's own map (--display-map, the toolkit's flag): ppn ranks on each host.
    nodes = re.findall(r"Data for node: (\S+)\s+Num slots: \d+\s+Max slots: \d+\s+Num procs: (\d+)",
                       out)
    assert nodes == [(host, str(ppn)) for host in hosts], nodes
    views = _views(out)
    seen = views["sm_view"]
    assert sorted(seen) == list(range(np)), seen
    for rank, d in seen.items():
        host = hosts[rank // ppn]
        # The toolkit's shim makes gethostname() the host's resourceconfig.json current_host;
        # Open MPI names the real (emulated) host.
        assert (d["hostname"], d["processor"], d["resource"]["current_host"]) == (host,) * 3, d
        assert d["sm_hosts"] == hosts and d["base"] == "/opt/ml", d
        assert json.loads(d["mp_parameters"]) == {"partitions": 2}, d
        assert d["argv"][:2] == ["--epochs", "3"] and d["cwd"] == "/opt/ml/code", d
        assert d["shim"] and d["partitions"] == 2, d
        assert d["mpi_library"] == "Open MPI v4.1.8", d  # the venv's, not the main Open MPI 5
        assert (d["mp_rank"], d["local_rank"]) == (rank % 2, rank % ppn), d
    # Toolkit issue #158: every rank gets the master's SM_* (its -x exports), SM_CURRENT_HOST too.
    assert {d["sm_current_host"] for d in seen.values()} == {hosts[0]}
    results = views[SPEC]
    assert sorted(results) == list(range(np)) and all(d["ok"] for d in results.values()), results


@pytest.mark.timeout(300)
def test_toolkit_runs_smp_script_on_one_host(hosts: Cluster, venv: Path, tmp_path: Path) -> None:
    _layout(tmp_path, ["algo-1"], 2)
    _check(_train(hosts, venv, tmp_path), ["algo-1"], 2)


@pytest.mark.timeout(300)
def test_toolkit_runs_smp_script_on_two_hosts(hosts: Cluster, venv: Path, tmp_path: Path) -> None:
    _layout(tmp_path, ["algo-1", "algo-2"], 1)
    _check(_train(hosts, venv, tmp_path), ["algo-1", "algo-2"], 1)
