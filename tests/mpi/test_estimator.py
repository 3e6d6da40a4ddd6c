"""`tfsmp.estimator` end to end: the job a SageMaker container would run, on this machine.

The first tests run small plain-Python scripts (no TensorFlow, a second or two each): the container
contract on two emulated hosts with every flag of the golden commands, failure reports, max_run,
and jobs without MPI. The last ones train examples/sagemaker/train.py: the issue's distribution
(4 ranks, Horovod), the same without Horovod on 2 ranks, and under `horovodrun`; each loads the
saved model in plain Keras and checks its predictions against the DistributedModel's.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import tarfile
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from mpihelp import REPO_ROOT, run_mpi

from tfsmp.estimator import LOCAL_ROLE, Estimator, TensorFlow, UnexpectedStatusException

pytestmark = pytest.mark.mpi

EXAMPLES = REPO_ROOT / "examples" / "sagemaker"
# What every job here gets: one thread per rank, quiet TF, idle ranks yield the cores.
JOB_ENV = {"OMP_NUM_THREADS": "1", "TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "1",
           "TF_CPP_MIN_LOG_LEVEL": "2", "OMPI_MCA_mpi_yield_when_idle": "1"}
ISSUE_DIST = {"smdistributed": {"modelparallel": {"enabled": True, "parameters": {
    "partitions": 2, "microbatches": 4, "placement_strategy": "spread",
    "pipeline": "interleaved", "optimize": "speed", "horovod": True}}},
    "mpi": {"enabled": True, "processes_per_host": 4}}

SHOW_ENV = '''
import json, os, sys, tempfile
from mpi4py import MPI
rank = MPI.COMM_WORLD.rank
keys = ["SM_CURRENT_HOST", "SM_HOSTS", "SM_HP_MP_PARAMETERS", "SM_HP_EPOCHS", "SM_NUM_GPUS",
        "SM_CHANNEL_TRAINING", "SM_MODEL_DIR", "SAGEMAKER_BASE_DIR", "TFSMP_CHECKPOINT_DIR",
        "TFSMP_CONFIG", "SM_CHANNEL_STALE"]
record = {k: os.environ.get(k) for k in keys}
record.update(rank=rank, argv=sys.argv[1:], cwd=os.getcwd(), tmp=tempfile.gettempdir(),
              files=sorted(os.listdir(os.environ["SM_CHANNEL_TRAINING"])))
print("RECORD " + json.dumps(record), flush=True)
if rank == 0:
    with open(os.path.join(os.environ["SM_MODEL_DIR"], "weights.txt"), "w") as f:
        f.write("trained")
if os.environ.get("FAIL_RANK") == str(rank):
    raise ValueError(f"boom on rank {rank}")
if os.environ.get("SLEEP"):
    import time; time.sleep(float(os.environ["SLEEP"]))
MPI.COMM_WORLD.Barrier()
'''


def _script_dir(tmp_path: Path, text: str = SHOW_ENV) -> Path:
    src = tmp_path / "src"
    src.mkdir(exist_ok=True)
    (src / "show.py").write_text(text)
    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    (data / "part-0.csv").write_text("1,2\n")
    return src


def _estimator(tmp_path: Path, distribution: dict[str, Any] | None, **kwargs: Any) -> TensorFlow:
    args: dict[str, Any] = dict(
        entry_point="show.py", source_dir=str(_script_dir(tmp_path)), role=LOCAL_ROLE,
        instance_count=1, instance_type="local", framework_version="2.21", py_version="py311",
        distribution=distribution, output_path=str(tmp_path / "jobs"),
        hyperparameters={"epochs": 3}, environment=dict(JOB_ENV))
    args.update(kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # 4 ranks on 2 cores: the oversubscription note
        return TensorFlow(**args)


def _records(log: str) -> dict[int, dict[str, Any]]:
    out = {}
    for line in log.splitlines():
        if "RECORD " in line:
            rec = json.loads(line.split("RECORD ", 1)[1])
            out[rec["rank"]] = rec
    return out


def test_two_emulated_hosts_see_the_container_contract(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TFSMP_CONFIG", '{"partitions": 4}')   # the launcher's, not the job's
    monkeypatch.setenv("SM_CHANNEL_STALE", "/old")
    # The golden file two_hosts_repeated_mca_efa_p4d.txt's flags, run for real.
    page_custom = ("--mca btl_vader_single_copy_mechanism none -x FI_EFA_USE_DEVICE_RDMA=1 "
                   "-x FI_PROVIDER=efa -x RDMAV_FORK_SAFE=1")
    dist = {"smdistributed": {"modelparallel": {"enabled": True, "parameters": {
        "partitions": 2, "microbatches": 4}}},
        "mpi": {"enabled": True, "processes_per_host": 2, "custom_mpi_options": page_custom}}
    est = _estimator(tmp_path, dist, instance_count=2, instance_type="ml.p4d.24xlarge")
    est.fit({"training": f"file://{tmp_path / 'data'}"}, logs=False, job_name="contract")

    job = tmp_path / "jobs" / "contract"
    recs = _records(est.logs())
    assert sorted(recs) == [0, 1, 2, 3]
    assert [recs[r]["SM_CURRENT_HOST"] for r in range(4)] == ["algo-1", "algo-1", "algo-2", "algo-2"]
    for rec in recs.values():
        assert rec["SM_HOSTS"] == '["algo-1","algo-2"]' and rec["SM_NUM_GPUS"] == "8"
        assert rec["TFSMP_CONFIG"] is None and rec["SM_CHANNEL_STALE"] is None
        assert json.loads(rec["SM_HP_MP_PARAMETERS"]) == {"partitions": 2, "microbatches": 4}
        assert rec["argv"] == ["--epochs", "3", "--model_dir", f"{job}/model", "--mp_parameters",
                               "microbatches=4,partitions=2"]
        assert rec["files"] == ["part-0.csv"] and rec["cwd"] == f"{job}/code"
        assert (rec["SAGEMAKER_BASE_DIR"], rec["TFSMP_CHECKPOINT_DIR"]) == (str(job),
                                                                           f"{job}/checkpoints")
    hps = json.loads((job / "input/config/hyperparameters.json").read_text())
    assert json.loads(hps["mp_parameters"]) == {"partitions": 2, "microbatches": 4}
    assert json.loads(hps["sagemaker_mpi_custom_mpi_options"]) == page_custom
    for name in ("inputdataconfig.json", "resourceconfig.json"):
        assert (job / "input/config" / name).is_file()
    assert (job / "input/data/training/part-0.csv").read_text() == "1,2\n"
    assert (job / "output/success").exists() and (job / "checkpoints").is_dir()
    assert "[1,2]<stdout>: RECORD" in est.logs()       # rank-tagged
    assert est.model_data == f"file://{job}/model.tar.gz"
    with tarfile.open(job / "model.tar.gz") as tar:
        assert tar.getnames() == ["weights.txt"]
    assert json.loads((job / "job.json").read_text())["TrainingJobStatus"] == "Completed"
    command = (job / "mpi_command.txt").read_text()
    assert command.count("btl_vader_single_copy_mechanism") == 1
    assert "FI_PROVIDER=efa" in command and "SM_CURRENT_HOST=algo-2" in command


def test_a_failed_rank_raises_with_its_error(tmp_path: Path) -> None:
    est = _estimator(tmp_path, {"mpi": {"enabled": True, "processes_per_host": 4}},
                     environment={**JOB_ENV, "FAIL_RANK": "2"})
    start = time.monotonic()
    with pytest.raises(UnexpectedStatusException,
                       match=r"(?s)^Error for Training job fails: Failed\. Reason: AlgorithmError: "
                             r"ExecuteUserScriptError:\nExitCode \d+\nErrorMessage \"\[rank 2\] "
                             r"ValueError: boom on rank 2\".*raise ValueError") as info:
        est.fit(str(tmp_path / "data"), logs=False, job_name="fails")
    assert time.monotonic() - start < 60  # the other ranks were aborted, not left waiting
    exc = info.value
    assert (exc.actual_status, exc.failed_rank, exc.allowed_statuses) == \
        ("Failed", 2, ["Completed", "Stopped"])
    assert exc.exit_code not in (None, 0) and exc.log_path and Path(exc.log_path).is_file()
    failure = (tmp_path / "jobs" / "fails" / "output" / "failure").read_text()
    assert 'ErrorMessage "[rank 2] ValueError: boom on rank 2"' in failure
    assert est.model_data is None
    assert "launching the job again" not in est.logs()  # a rank ran: never relaunched
    # the job's temp folder, as a container's /tmp, is gone with it ([Note: a job's temp folder])
    temps = {json.loads(m)["tmp"] for m in re.findall(r"RECORD (\{.*\})$", est.logs(), re.M)}
    assert len(temps) == 1 and Path(next(iter(temps))).name.startswith("tfsmp-tmp."), temps
    assert not Path(next(iter(temps))).exists()


def test_max_run_stops_the_job_and_keeps_the_model(tmp_path: Path) -> None:
    est = _estimator(tmp_path, {"mpi": {"enabled": True, "processes_per_host": 1}}, max_run=2,
                     environment={**JOB_ENV, "SLEEP": "120"})
    start = time.monotonic()
    with pytest.warns(UserWarning, match="exceeded max_run=2 s and was stopped"):
        est.fit(str(tmp_path / "data"), logs=False, job_name="slow")
    assert time.monotonic() - start < 60
    job = est.latest_training_job
    assert job is not None and job.describe()["SecondaryStatus"] == "MaxRuntimeExceeded"
    assert est.model_data == f"file://{tmp_path}/jobs/slow/model.tar.gz"


def test_without_mpi_each_host_runs_the_script_once(tmp_path: Path) -> None:
    script = "import os; print('HOST', os.environ['SM_CURRENT_HOST'], os.environ['SM_HOSTS'])"
    (_script_dir(tmp_path) / "plain.py").write_text(script)
    est = _estimator(tmp_path, None, entry_point="plain.py", instance_count=2)
    est.fit(str(tmp_path / "data"), logs=False, job_name="plain")
    lines = sorted(line for line in est.logs().splitlines() if "HOST" in line)
    assert lines == ['[algo-1] HOST algo-1 ["algo-1","algo-2"]',
                     '[algo-2] HOST algo-2 ["algo-1","algo-2"]']


def test_fit_without_wait_then_wait(tmp_path: Path) -> None:
    est = _estimator(tmp_path, {"mpi": {"enabled": True, "processes_per_host": 2}})
    est.fit(str(tmp_path / "data"), wait=False, job_name="later")
    job = est.latest_training_job
    assert job is not None and est.model_data is None
    job.wait()
    assert job.status == "Completed" and est.model_data is not None


FLAKY_LAUNCHER = """#!/bin/sh
# Fails like Open MPI's launcher when its PMIx listener cannot bind (the first call), then runs
# the real mpirun: [Note: launcher start-up failures] in tfsmp/launch/mpirun.py.
if [ ! -e "{marker}" ]; then
  touch "{marker}"
  echo "--------------------------------------------------------------------------" >&2
  echo "The PMIx server's listener thread failed to start. We cannot" >&2
  echo "continue." >&2
  exit 213
fi
exec "{mpirun}" "$@"
"""


def test_a_launcher_that_dies_before_any_rank_is_launched_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tfsmp.estimator import plan as job_plan
    from tfsmp.launch.mpirun import find_mpirun

    launcher = tmp_path / "mpirun"
    launcher.write_text(FLAKY_LAUNCHER.format(marker=tmp_path / "failed_once", mpirun=find_mpirun()))
    launcher.chmod(0o755)
    monkeypatch.setattr(job_plan, "find_mpirun", lambda *a, **k: str(launcher))
    est = _estimator(tmp_path, {"mpi": {"enabled": True, "processes_per_host": 2}})
    est.fit(str(tmp_path / "data"), logs=False, job_name="flaky")
    log = est.logs()
    assert "listener thread failed to start" in log and "launching the job again" in log
    assert sorted(_records(log)) == [0, 1]
    assert est.latest_training_job is not None
    assert est.latest_training_job.status == "Completed"


def test_generic_estimator_runs_the_same_job(tmp_path: Path) -> None:
    src = _script_dir(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        est = Estimator(image_uri="123.dkr.ecr.us-west-2.amazonaws.com/tfsmp:latest", role="r",
                        instance_count=1, instance_type="local", entry_point="show.py",
                        source_dir=str(src), output_path=str(tmp_path / "jobs"),
                        distribution={"mpi": {"enabled": True, "processes_per_host": 2}},
                        environment=dict(JOB_ENV))
    est.fit(str(tmp_path / "data"), logs=False, job_name="generic")
    recs = _records(est.logs())
    assert sorted(recs) == [0, 1] and recs[0]["argv"] == []   # no model_dir: not the TF estimator


# -- training a DistributedModel ----------------------------------------------------------------

def _runtime_missing() -> str | None:
    spec = importlib.util.find_spec("tfsmp.keras.model")
    if spec is None or spec.origin is None:
        return "tfsmp.keras.model (DistributedModel) does not exist yet"
    # Read, not imported: importing it would load TensorFlow into the pytest process.
    if ("def save(" not in Path(spec.origin).read_text()
            or importlib.util.find_spec("tfsmp.checkpoint.export") is None):
        return "DistributedModel.save(<path>.keras) (tfsmp.checkpoint.export) is not written yet"
    return None


def _needs_runtime() -> None:
    reason = _runtime_missing()
    if reason:
        pytest.skip(reason)


def _make_data(directory: Path) -> Path:
    sys.path.insert(0, str(EXAMPLES))
    try:
        from launch import make_data  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(EXAMPLES))
    make_data(str(directory), samples=1024)
    return directory


LOAD_AND_PREDICT = """
import sys, numpy as np, keras
model = keras.models.load_model(sys.argv[1])
probe = np.load(sys.argv[2])
np.save(sys.argv[3], np.asarray(model.predict(probe["x"], verbose=0)))
"""


def _check_plain_keras_model(model_file: Path, output_dir: Path) -> None:
    """The saved model loads in plain Keras and predicts what the DistributedModel predicted."""
    out = output_dir / "plain_keras.npy"
    proc = subprocess.run([sys.executable, "-c", LOAD_AND_PREDICT, str(model_file),
                           str(output_dir / "probe.npz"), str(out)], capture_output=True,
                          text=True, timeout=300, env={**os.environ, **JOB_ENV})
    assert proc.returncode == 0, proc.stderr[-3000:]
    expected = np.load(output_dir / "probe.npz")["y"]
    np.testing.assert_allclose(np.load(out), expected, rtol=1e-5, atol=1e-5)


def _train(tmp_path: Path, distribution: dict[str, Any], job_name: str) -> Path:
    data = _make_data(tmp_path / "data")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        est = TensorFlow(entry_point="train.py", source_dir=str(EXAMPLES), role=LOCAL_ROLE,
                         instance_count=1, instance_type="local", framework_version="2.21",
                         py_version="py311", distribution=distribution,
                         output_path=str(tmp_path / "jobs"), max_run=900,
                         hyperparameters={"epochs": 3, "batch_size": 64},
                         environment=dict(JOB_ENV))
    est.fit({"training": str(data)}, job_name=job_name)
    job = tmp_path / "jobs" / job_name
    assert est.model_data == f"file://{job}/model.tar.gz"
    unpacked = tmp_path / "unpacked"
    with tarfile.open(job / "model.tar.gz") as tar:
        tar.extractall(unpacked, filter="data")
    history = json.loads((job / "output/data/history.json").read_text())
    assert history["loss"][-1] < history["loss"][0]
    _check_plain_keras_model(unpacked / "model.keras", job / "output" / "data")
    return job


@pytest.mark.timeout(900)
@pytest.mark.skipif(importlib.util.find_spec("horovod") is None,
                    reason="horovod: True needs Horovod: run `tfsmp install-horovod`")
def test_the_issue_distribution_trains_and_saves_a_plain_keras_model(tmp_path: Path) -> None:
    _needs_runtime()
    _train(tmp_path, ISSUE_DIST, "issue")


@pytest.mark.full  # the issue's distribution (above) runs the same estimator path by default
@pytest.mark.timeout(600)
def test_two_stages_without_horovod_train_and_save_a_plain_keras_model(tmp_path: Path) -> None:
    _needs_runtime()
    dist = {"smdistributed": {"modelparallel": {"enabled": True, "parameters": {
        "partitions": 2, "microbatches": 4, "pipeline": "interleaved", "optimize": "speed"}}},
        "mpi": {"enabled": True, "processes_per_host": 2}}
    _train(tmp_path, dist, "two-stages")


@pytest.mark.horovod
@pytest.mark.full  # horovodrun's own launch of the example; CI runs it (TFSMP_FULL_TESTS=1)
@pytest.mark.timeout(600)
def test_horovodrun_runs_the_example_script(tmp_path: Path) -> None:
    _needs_runtime()
    data = _make_data(tmp_path / "data")
    config = {"partitions": 2, "microbatches": 2, "horovod": True}
    res = run_mpi(2, [EXAMPLES / "train.py", "--training", data, "--model_dir",
                      tmp_path / "model", "--output_data_dir", tmp_path / "out", "--epochs", "1"],
                  launcher="horovodrun", timeout=500,
                  env={"SM_HP_MP_PARAMETERS": json.dumps(config)})
    assert res.returncode == 0, res.describe()
    _check_plain_keras_model(tmp_path / "model" / "model.keras", tmp_path / "out")
