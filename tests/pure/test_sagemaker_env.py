"""What a job sees, as a SageMaker training container shows it: hyperparameters, SM_* and CLI args."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tfsmp.config import load_config
from tfsmp.launch import sagemaker as sm

ISSUE_PARAMS = {"partitions": 2, "microbatches": 4, "placement_strategy": "spread",
                "pipeline": "interleaved", "optimize": "speed", "horovod": True}
ISSUE_DIST = {"smdistributed": {"modelparallel": {"enabled": True, "parameters": ISSUE_PARAMS}},
              "mpi": {"enabled": True, "processes_per_host": 4}}
PATHS = sm.JobPaths("/opt/ml")


def job_hps(dist: dict[str, Any] = ISSUE_DIST) -> dict[str, Any]:
    resolved = sm.resolve_distribution(dist, instance_count=1,
                                       resources=sm.Resources("ml.p3.16xlarge", 8, 64))
    return {"epochs": 3, **sm.distribution_hyperparameters(resolved, "ml.p3.16xlarge"),
            "model_dir": PATHS.model, "sagemaker_program": "train.py",
            "sagemaker_submit_directory": "file:///src", "sagemaker_container_log_level": 20,
            "sagemaker_job_name": "job-1"}


def env_of(hps: dict[str, Any], host: str = "algo-1", hosts: tuple[str, ...] = ("algo-1",),
           ) -> dict[str, str]:
    return sm.job_env(paths=PATHS, hosts=list(hosts), current_host=host, hyperparameters=hps,
                      channels=["training", "test"],
                      resources=sm.Resources("ml.p3.16xlarge", 8, 64), entry_point="train.py",
                      module_dir="file:///src", job_name="job-1")


def test_to_cmd_args_is_the_toolkits() -> None:
    # The toolkit's own docstring example, plus its dict, bool, None and one-letter rules.
    assert sm.to_cmd_args({"model_dir": "/opt/ml/model", "batch_size": 25}) == \
        ["--batch_size", "25", "--model_dir", "/opt/ml/model"]
    assert sm.to_cmd_args({"mp_parameters": {"partitions": 2, "horovod": True}, "k": None}) == \
        ["-k", "", "--mp_parameters", "horovod=True,partitions=2"]


def test_to_env_vars_is_the_toolkits() -> None:
    assert sm.to_env_vars({"model_dir": "/opt/ml/model", "hosts": ["algo-1"], "n": 2,
                           "d": {"b": True, "a": None}, "none": None}) == {
        "SM_MODEL_DIR": "/opt/ml/model", "SM_HOSTS": '["algo-1"]', "SM_N": "2",
        "SM_D": '{"a":null,"b":true}', "SM_NONE": ""}


def test_distribution_adds_the_sdks_hyperparameters() -> None:
    hps = job_hps()
    assert {k: hps[k] for k in hps if k.startswith("sagemaker_") or k == "mp_parameters"} == {
        "sagemaker_mpi_enabled": True, "sagemaker_mpi_num_of_processes_per_host": 4,
        "sagemaker_mpi_custom_mpi_options": "", "sagemaker_distributed_dataparallel_enabled": False,
        "sagemaker_instance_type": "ml.p3.16xlarge", "mp_parameters": ISSUE_PARAMS,
        "sagemaker_program": "train.py", "sagemaker_submit_directory": "file:///src",
        "sagemaker_container_log_level": 20, "sagemaker_job_name": "job-1"}


def test_hyperparameters_json_encodes_every_value() -> None:
    encoded = sm.encode_hyperparameters(job_hps())
    assert encoded["epochs"] == "3" and encoded["sagemaker_program"] == '"train.py"'
    assert json.loads(encoded["mp_parameters"]) == ISSUE_PARAMS
    assert encoded["sagemaker_mpi_enabled"] == "true"


def test_the_script_sees_the_sm_variables() -> None:
    env = env_of(job_hps())
    assert env["SM_HP_MP_PARAMETERS"] == json.dumps(ISSUE_PARAMS, sort_keys=True,
                                                    separators=(",", ":"))
    assert json.loads(env["SM_HPS"]) == {"epochs": 3, "model_dir": "/opt/ml/model",
                                         "mp_parameters": ISSUE_PARAMS}
    assert env["SM_HP_EPOCHS"] == "3" and env["SM_HP_MODEL_DIR"] == "/opt/ml/model"
    assert env["SM_MODEL_DIR"] == "/opt/ml/model"
    assert env["SM_CHANNELS"] == '["test","training"]'
    assert env["SM_CHANNEL_TRAINING"] == "/opt/ml/input/data/training"
    assert env["SM_OUTPUT_DATA_DIR"] == "/opt/ml/output/data"
    assert (env["SM_NUM_GPUS"], env["SM_NUM_CPUS"]) == ("8", "64")
    assert (env["SM_HOSTS"], env["SM_CURRENT_HOST"]) == ('["algo-1"]', "algo-1")
    assert env["SM_CURRENT_INSTANCE_TYPE"] == "ml.p3.16xlarge"
    assert json.loads(env["SM_FRAMEWORK_PARAMS"])["sagemaker_mpi_enabled"] is True
    assert "mp_parameters" not in json.loads(env["SM_FRAMEWORK_PARAMS"])
    assert json.loads(env["SM_USER_ARGS"]) == [
        "--epochs", "3", "--model_dir", "/opt/ml/model", "--mp_parameters",
        "horovod=True,microbatches=4,optimize=speed,partitions=2,pipeline=interleaved,"
        "placement_strategy=spread"]
    training = json.loads(env["SM_TRAINING_ENV"])
    assert training["hyperparameters"] == json.loads(env["SM_HPS"])
    assert training["channel_input_dirs"]["test"] == "/opt/ml/input/data/test"
    assert training["is_modelparallel_enabled"] is True and training["master_hostname"] == "algo-1"
    assert training["resource_config"]["current_instance_type"] == "ml.p3.16xlarge"


def test_tfsmp_reads_the_config_the_job_gets() -> None:
    cfg = load_config(environ=env_of(job_hps()), world_size=4)
    assert (cfg.partitions, cfg.microbatches, cfg.placement_strategy, cfg.horovod) == \
        (2, 4, "spread", True)


def test_each_host_is_itself_in_its_training_env() -> None:
    env = env_of(job_hps(), host="algo-2", hosts=("algo-1", "algo-2"))
    training = json.loads(env["SM_TRAINING_ENV"])
    assert env["SM_CURRENT_HOST"] == "algo-2"
    assert (training["current_host"], training["is_master"]) == ("algo-2", False)


def test_resource_and_input_config_files() -> None:
    rc = sm.resource_config(["algo-1", "algo-2"], "algo-1", "local", "lo")
    assert rc["hosts"] == ["algo-1", "algo-2"] and rc["current_host"] == "algo-1"
    assert rc["instance_groups"][0]["hosts"] == ["algo-1", "algo-2"]
    assert sm.input_data_config(["training"]) == {"training": {
        "TrainingInputMode": "File", "S3DistributionType": "FullyReplicated",
        "RecordWrapperType": "None"}}


def test_job_paths_mirror_opt_ml() -> None:
    p = sm.JobPaths("/tmp/jobs/j/")
    assert (p.code, p.model, p.input_config, p.output_data, p.checkpoints) == (
        "/tmp/jobs/j/code", "/tmp/jobs/j/model", "/tmp/jobs/j/input/config",
        "/tmp/jobs/j/output/data", "/tmp/jobs/j/checkpoints")
    assert p.channel("training") == "/tmp/jobs/j/input/data/training"


@pytest.mark.parametrize(("hosts", "text"), [
    (["algo-1"], "localhost slots=4\n"),
    (["algo-1", "algo-2"], "localhost slots=8\n"),
])
def test_hostfile_puts_emulated_hosts_on_localhost(hosts: list[str], text: str) -> None:
    assert sm.hostfile_text(hosts, 4).endswith(text)
    assert sm.host_names(2) == ["algo-1", "algo-2"]


def test_hostfile_for_real_hosts_has_one_line_each() -> None:
    assert sm.hostfile_text(["algo-1", "algo-2"], 8, ["node1", "node2"]).splitlines()[1:] == \
        ["node1 slots=8", "node2 slots=8"]
