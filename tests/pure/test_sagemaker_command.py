"""Golden tests of the estimator's mpirun command: the toolkit's line, in Open MPI 5, per host.

Regenerate the golden files after an intended change with
``TFSMP_REGEN_GOLDEN=1 python -m pytest tests/pure/test_sagemaker_command.py`` and review the diff.
The command is built by the real estimator (`mpi_command()`, which writes nothing) with this
machine's facts pinned: python `/usr/bin/python3`, `mpirun`, root, no GPUs, no LD_LIBRARY_PATH;
the job directory reads `{job_dir}`. tests/mpi/test_estimator.py runs the same flags.
"""

from __future__ import annotations

import os
import shlex
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest

from tfsmp.estimator import TensorFlow, estimators
from tfsmp.estimator import plan as job_plan
from tfsmp.launch import sagemaker as sm

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "mpirun"
REGEN = os.environ.get("TFSMP_REGEN_GOLDEN") == "1"

ISSUE_PARAMS = {"partitions": 2, "microbatches": 4, "placement_strategy": "spread",
                "pipeline": "interleaved", "optimize": "speed", "horovod": True}
PAGE_DEFAULT = "--mca btl_vader_single_copy_mechanism none"           # the AWS page's comment
PAGE_EFA_TIP = "-x FI_EFA_USE_DEVICE_RDMA=1 -x FI_PROVIDER=efa -x RDMAV_FORK_SAFE=1"

# name -> (instance_type, instance_count, processes_per_host, custom_mpi_options)
CASES: dict[str, tuple[str, int, int, str]] = {
    "one_host": ("local", 1, 4, ""),
    "one_host_repeated_mca": ("local", 1, 4, PAGE_DEFAULT),
    "one_host_efa_p3dn": ("ml.p3dn.24xlarge", 1, 8, "--NCCL_DEBUG WARN"),
    "two_hosts": ("local", 2, 2, ""),
    "two_hosts_repeated_mca_efa_p4d": ("ml.p4d.24xlarge", 2, 4, f"{PAGE_DEFAULT} {PAGE_EFA_TIP}"),
}


@pytest.fixture
def pinned(monkeypatch: pytest.MonkeyPatch) -> None:
    """This machine's facts, fixed so the command is the same everywhere."""
    monkeypatch.setattr(sys, "executable", "/usr/bin/python3")
    monkeypatch.setattr(job_plan, "find_mpirun", lambda: "mpirun")
    monkeypatch.setattr(estimators, "_local_gpus", lambda: 0)
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.delenv("LD_LIBRARY_PATH", raising=False)


def build(tmp_path: Path, instance_type: str, count: int, ppn: int, custom: str,
          **kwargs: Any) -> tuple[list[str], str]:
    src = tmp_path / "src"
    src.mkdir(exist_ok=True)
    (src / "train.py").write_text("")
    (tmp_path / "data").mkdir(exist_ok=True)
    mpi = {"enabled": True, "processes_per_host": ppn, **({"custom_mpi_options": custom}
                                                          if custom else {})}
    with warnings.catch_warnings():  # oversubscription and version notes do not matter here
        warnings.simplefilter("ignore")
        est = TensorFlow(entry_point="train.py", source_dir=str(src), role="r",
                         instance_count=count, instance_type=instance_type,
                         framework_version="2.21", py_version="py311",
                         output_path=str(tmp_path / "jobs"), hyperparameters={"epochs": 2},
                         distribution={"smdistributed": {"modelparallel": {
                             "enabled": True, "parameters": ISSUE_PARAMS}}, "mpi": mpi}, **kwargs)
    argv = est.mpi_command({"training": str(tmp_path / "data")}, job_name="golden")
    text = sm.format_command(argv).replace(str(tmp_path / "jobs" / "golden"), "{job_dir}")
    return argv, text


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.usefixtures("pinned")
def test_command_matches_golden(name: str, tmp_path: Path) -> None:
    _, text = build(tmp_path, *CASES[name])
    path = GOLDEN / f"{name}.txt"
    if REGEN:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert text == path.read_text(), f"regenerate with TFSMP_REGEN_GOLDEN=1 if intended: {path}"


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.usefixtures("pinned")
def test_each_setting_appears_once(name: str, tmp_path: Path) -> None:
    argv, _ = build(tmp_path, *CASES[name])
    context = argv[:argv.index(":")] if ":" in argv else argv
    assert context.count("btl_vader_single_copy_mechanism") == 1
    assert context.count("--bind-to") == context.count("--map-by") == 1
    exported = [context[i + 1].split("=")[0] for i, t in enumerate(context) if t == "-x"]
    assert len(exported) == len(set(exported)), sorted(exported)


@pytest.mark.usefixtures("pinned")
def test_efa_flags_only_for_efa_types(tmp_path: Path) -> None:
    nccl_only, _ = build(tmp_path, "ml.p3dn.24xlarge", 1, 8, "")
    rdma, _ = build(tmp_path, "ml.p4d.24xlarge", 1, 8, "")
    plain, _ = build(tmp_path, "ml.p3.16xlarge", 1, 8, "")
    assert {"FI_PROVIDER=efa", "NCCL_PROTO=simple"} <= set(nccl_only)
    assert "FI_EFA_USE_DEVICE_RDMA=1" not in nccl_only
    assert {"FI_PROVIDER=efa", "FI_EFA_USE_DEVICE_RDMA=1", "RDMAV_FORK_SAFE=1"} <= set(rdma)
    assert not any(t.startswith("FI_") for t in plain)


@pytest.mark.usefixtures("pinned")
def test_each_host_runs_its_ranks_with_its_own_name(tmp_path: Path) -> None:
    argv, _ = build(tmp_path, "local", 2, 2, "")
    first, second = shlex.join(argv).split(" : ")
    assert "-np 2" in first and "-x SM_CURRENT_HOST=algo-1" in first
    assert second.startswith("-np 2 -x SM_CURRENT_HOST=algo-2 /usr/bin/python3 -m mpi4py train.py")
    assert "--hostfile {}".format(tmp_path / "jobs" / "golden" / "hostfile") in first


@pytest.mark.usefixtures("pinned")
def test_user_environment_is_exported(tmp_path: Path) -> None:
    argv, _ = build(tmp_path, "local", 1, 2, "", environment={"TF_NUM_INTRAOP_THREADS": "1"})
    assert argv[argv.index("TF_NUM_INTRAOP_THREADS") - 1] == "-x"


# -- custom mpi options ----------------------------------------------------------------------

def test_a_repeated_setting_keeps_the_later_value_once() -> None:
    builtin = ["--mca", "btl_vader_single_copy_mechanism", "none", "-x", "NCCL_DEBUG=INFO", "-x",
               "PATH"]
    custom = ["-mca", "btl_sm_single_copy_mechanism", "cma", "-x", "NCCL_DEBUG=WARN", "-verbose"]
    assert sm.merge_mpi_options(builtin, custom) == [
        "-x", "PATH", "-mca", "btl_sm_single_copy_mechanism", "cma", "-x", "NCCL_DEBUG=WARN",
        "-verbose"]


def test_custom_binding_replaces_the_builtin_and_is_respelled() -> None:
    argv = sm.toolkit_mpirun_command(
        hosts=["algo-1"], processes_per_host=2, entry_argv=["t.py"], exported=[],
        custom_mpi_options="-bind-to core -map-by socket", instance_type="local",
        hostfile="hf", python="py")
    assert argv.count("--bind-to") == argv.count("--map-by") == 1
    assert argv[argv.index("--bind-to") + 1] == "core"
    assert argv[argv.index("--map-by") + 1] == "socket"
    assert "-bind-to" not in argv


def test_nccl_debug_option_is_the_toolkits() -> None:
    argv = sm.toolkit_mpirun_command(
        hosts=["algo-1"], processes_per_host=1, entry_argv=["t.py"], exported=[],
        custom_mpi_options="--NCCL_DEBUG=WARN", instance_type="local", hostfile="hf",
        python="py")
    assert "NCCL_DEBUG=WARN" in argv and "--NCCL_DEBUG=WARN" not in argv


@pytest.mark.usefixtures("pinned")
def test_the_launchers_own_sagemaker_variables_do_not_leak(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SM_CHANNEL_STALE", "/old")
    argv, _ = build(tmp_path, "local", 1, 2, "")
    assert "SM_CHANNEL_STALE" not in argv
